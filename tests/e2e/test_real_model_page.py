"""The how-to "Train your own workflow on a real model" (docs/how-to/real-model.md), run as a user
would: its reward and config blocks written to files, its commands run in order. ``marlow plan``
runs as written (it sizes Qwen3-0.6B from the architecture marlow ships, no weights); the
commands that load the model point ``model.name`` at a local folder holding a random Qwen3 of the
real architecture and tokenizer format (``marlow.archs.stand_in``, shrunk to 2 narrow layers so
that a step takes seconds), and train one short step. Random weights never answer right, so
``task check`` ends on its one problem, that no group's rewards vary; every other command exits 0.
The figures the page states are those ``marlow plan`` prints and the committed measurements."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from marlow.archs.stand_in import save_stand_in
from marlow.cli import app

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "how-to" / "real-model.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SHRINK = {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
}  # fmt: skip
SMALL_RUN = [
    "steps=1", "val_every=1", "ckpt_every=1", "task.val_size=2", "grpo.batch_problems=2",
    "grpo.group_size=2", "rollout.max_new_tokens=8", "diagnostics.signature_problems=2",
    "dtype=float32", "device=cpu",
]  # fmt: skip


def blocks(lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(PAGE.read_text()) if m.group(1) == lang]


def commands() -> list[list[str]]:
    lines = [line for block in blocks("bash") for line in block.splitlines()]
    return [words for line in lines if (words := shlex.split(line, comments=True))]


def run(words: list[str]) -> tuple[int, str]:
    done = CliRunner().invoke(app, words[1:], env={"COLUMNS": "200"})
    return done.exit_code, done.output


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    """The page's files in a scratch folder: the reward, the config, a jsonl of the user's own
    columns, and a random Qwen3 in a local folder."""
    (reward,) = blocks("python")
    (config,) = blocks("yaml")
    (tmp_path / "my_rewards.py").write_text(reward)
    (tmp_path / "my-qwen.yaml").write_text(config)
    shutil.copy(ROOT / "examples" / "sums" / "sums_task" / "sums.jsonl", tmp_path / "my.jsonl")
    save_stand_in("qwen3-0.6b", tmp_path / "qwen3", dtype=__import__("torch").float32,
                  overrides=SHRINK)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_real_model_page_runs_in_order(folder):
    said = {}
    for words in commands():
        name = " ".join(words[:2]) if words[1] != "task" else "marlow task check"
        if name == "marlow serve":  # runs until stopped: tests/e2e/test_serve.py drives one
            continue
        if name in ("marlow train", "marlow task check"):
            words = [*words, f"model.name={folder / 'qwen3'}", *SMALL_RUN]
        code, out = run(words)
        said[name] = out
        if name == "marlow task check":  # random weights: no group's rewards vary
            assert code != 0 and "error: no group of 4 sampled has rewards that vary" in out, out
            assert "gold answers: 200 of 200 score at least" in out, out
            assert out.count("final answer:") == 2 and "aggregator prompt:" in out, out
            assert "groups whose rewards vary: 0 of" in out, out
        else:
            assert code == 0, f"{shlex.join(words)}: exit {code}\n{out[-2000:]}"
    assert list(said) == [
        "marlow plan", "marlow task check", "marlow train", "marlow inspect", "marlow answer",
    ]  # fmt: skip
    assert (folder / "runs" / "qwen-ip" / "checkpoints" / "step_000001").is_dir()
    # every memory figure the page states is one marlow plan printed for its config
    page = PAGE.read_text()
    plan_section = page.split("## Before the run")[1].split("## ")[0]
    printed = memory_figures(said["marlow plan"])
    assert memory_figures(plan_section) and memory_figures(plan_section) <= printed, printed


def memory_figures(text: str) -> set[tuple[float, str]]:
    return {
        (float(n.replace(",", "")), unit) for n, unit in re.findall(r"(\d[\d,.]*) (GiB|MiB)", text)
    }


def test_the_step_costs_the_page_states_are_the_committed_measurements():
    row = {
        cells[0]: cells[1:]
        for line in PAGE.read_text().splitlines()
        if line.startswith("| ")
        and len(cells := [c.strip() for c in line.strip("|").split("|")]) > 4
    }
    for card, name in (("one H100 80GB", "gpu_check_graphs"), ("one H200", "gpu_check")):
        gpu = json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text())
        (step,) = gpu["sizes"]["qwen3-0.6b"]["runs"][0]["steps"]
        assert gpu["environment"]["gpu"].startswith(f"NVIDIA {card.removeprefix('one ')}")
        peak = max(step["rollout_peak_allocated_gib"], step["learn_peak_allocated_gib"])
        assert row[card][:4] == [
            f"{step['rollout_s'] + step['learn_s']:.1f} s", f"{step['rollout_s']:.1f} s",
            f"{step['learn_s']:.1f} s", f"{peak:.2f} GiB",
        ]  # fmt: skip
    smoke = (ROOT / "bench" / "qwen3_smoke.py").read_text()
    cpu = re.search(r"step 2: ([\d.]+) s \(rollout ([\d.]+) s, learn ([\d.]+) s", smoke)
    rss = re.search(r"peak RSS of the run: ([\d,]+) MiB", smoke).group(1)
    assert row["2 CPU cores, no GPU"][:4] == [
        f"{float(cpu.group(1)):.0f} s", f"{cpu.group(2)} s", f"{cpu.group(3)} s", f"{rss} MiB RSS",
    ]  # fmt: skip
