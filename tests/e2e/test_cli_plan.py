"""``marlow plan`` as a user types it: a config file with overrides, the table, ``--json`` and the
``--gpu-mem`` verdict; it writes nothing and needs no hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marlow.config import load_config
from marlow.plan import plan_run
from tests.conftest import in_process

MARLOW = [sys.executable, "-m", "marlow.cli"]
FITS = ("grpo.micro_tokens=4096", "rollout.max_batch=16")  # the paper preset, cut to fit 80 GiB


def plan_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MARLOW_CACHE": str(cwd / "cache")}
    return subprocess.run(
        [*MARLOW, "plan", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def test_json_of_a_config_file_with_overrides_equals_the_library_plan(tmp_path: Path):
    (tmp_path / "run.yaml").write_text("preset: paper\nworkflow: {name: voting}\n")
    done = plan_cli("run.yaml", *FITS, "--gpu-mem", "80", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    expected = plan_run(load_config(tmp_path / "run.yaml", list(FITS)), gpu_mem_gib=80.0)
    assert printed == json.loads(json.dumps(expected.to_dict()))
    assert printed["model"] == "Qwen/Qwen3-1.7B" and printed["fits"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # nothing written


def test_the_table_and_both_verdicts(tmp_path: Path):
    fits = plan_cli(
        "preset=paper", *FITS, "--gpu-mem", "80", "--prompt-tokens", "512", cwd=tmp_path
    )
    assert fits.returncode == 0, fits.stderr
    for needle in (
        "shipped architecture qwen3-1.7b",
        "1,720,574,976",  # the base's parameters
        "adapter generator",
        "adapter aggregator",
        "69,730,304",  # LoRA rank 64 on every linear of Qwen3-1.7B, per adapter
        "512 prompt",
        "fits in 80 GiB",
    ):
        assert needle in fits.stdout, (needle, fits.stdout)
    too_small = plan_cli("preset=paper", "--gpu-mem", "24", cwd=tmp_path)
    assert too_small.returncode == 0, too_small.stderr
    shown = " ".join(too_small.stdout.split())
    assert "does NOT fit in 24 GiB; it would with " in shown
    suggested = plan_run(load_config(None, ["preset=paper"]), gpu_mem_gib=24.0).suggestions
    assert suggested and all(f"{k}={v}" in shown for k, v in suggested.items()), shown
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("model", "card"),
    [("Qwen/Qwen3-0.6B", 48), ("Qwen/Qwen3-1.7B", 80), ("Qwen/Qwen3-4B", 80)],
)
def test_the_paper_preset_fits_the_studys_cards(model, card, tmp_path):
    """§A.8: two GPUs per cell, 48 GB L40S for 0.6B, 80 GB H100 for 1.7B and 4B; each
    data-parallel process holds the whole plan, so the verdict is per GPU."""
    done = in_process(["plan", "preset=paper", f"model.name={model}", "--gpu-mem", card], tmp_path)
    assert done.exit_code == 0, done.output
    assert f"fits in {card} GiB" in " ".join(done.output.split()), done.output
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_plans_first_help_example_fits(tmp_path):
    config = Path(__file__).parents[2] / "configs" / "paper-voting-ip.yaml"
    done = plan_cli(str(config), "--gpu-mem", "80", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "fits in 80 GiB" in done.stdout, done.stdout


OFF = "grpo.activation_checkpointing=off"


@pytest.mark.parametrize(
    ("extra", "card", "needed"),
    [
        # the rollout batch's KV cache and the micro-batch's activations
        (
            ("rollout.max_batch=256", "grpo.micro_tokens=65536", OFF),
            80,
            {"max_batch", "micro_tokens"},
        ),
        # one turn alone is too long for the card, and the rollout batch of the longest turn
        # that fits too
        (("rollout.max_new_tokens=30000", OFF), 80, {"max_new_tokens", "max_batch"}),
        # the paper preset on a 32 GiB card, its rollout batches small
        (("rollout.max_batch=8", OFF), 32, {"max_new_tokens", "micro_tokens"}),
        # checkpointed layers (auto, a Hugging Face model): the activations fit, the KV cache not
        (("rollout.max_batch=256", "grpo.micro_tokens=65536"), 80, {"max_batch"}),
        ((), 40, {"max_batch"}),
    ],
)
def test_a_run_that_does_not_fit_gets_every_setting_that_would_make_it(extra, card, needed):
    base = ("preset=paper", "model.name=Qwen/Qwen3-4B", *extra)
    first = plan_run(load_config(None, list(base)), gpu_mem_gib=card)  # as plan --json prints
    assert first.fits is False
    suggested = [f"{k}={v}" for k, v in first.suggestions.items()]
    assert {s.split("=")[0].split(".")[1] for s in suggested} == needed, suggested
    # together they fit, and each is the largest that does: one more of any of them does not
    assert plan_run(load_config(None, [*base, *suggested]), gpu_mem_gib=card).fits is True
    for s in suggested:
        key, value = s.split("=")
        more = [x if x != s else f"{key}={int(value) + 1}" for x in suggested]
        assert plan_run(load_config(None, [*base, *more]), gpu_mem_gib=card).fits is False, s
