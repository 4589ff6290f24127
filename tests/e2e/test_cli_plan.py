"""``marlow plan`` as a user types it: a config file with overrides, the table, ``--json`` and the
``--gpu-mem`` verdict; it writes nothing and needs no hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from marlow.config import load_config
from marlow.plan import plan_run

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
    too_small = plan_cli("preset=paper", "--gpu-mem", "80", cwd=tmp_path)
    assert too_small.returncode == 0, too_small.stderr
    assert "does NOT fit in 80 GiB" in too_small.stdout
    assert list(tmp_path.iterdir()) == []
