"""The shipped tool workflow (Test-Fix) trains under SP and IP on the tiny code world, and the
built-in code tool runs a program on the visible tests only."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from marlow.cli import app
from marlow.diagnostics.sinks import read_metrics
from marlow.tasks.loaders import load_humaneval
from marlow.tiny import codegen
from marlow.training.trainer import Trainer
from marlow.workflows.codetools import run_visible_tests
from tests.conftest import DATA


@pytest.mark.parametrize("routing", ["ip", "sp"])
def test_test_fix_trains_on_the_tiny_code_world_with_its_tool_feedback_recorded(
    small_config, tmp_path, routing
):
    cfg = small_config(
        steps=1,
        val_every=1,
        model={"name": "tiny-s", "pretrain_steps": 1200, "pretrain_batch": 64},  # shipped
        task={"name": "code", "val_size": 4},
        workflow={"name": "test_fix"},
        policy={"routing": routing},
        rollout={"max_new_tokens": 48},
        sample_episodes=4,
    )
    Trainer(cfg, tmp_path).run()
    last = read_metrics(tmp_path)[-1]
    assert last["train/tests/calls"] == 1.0 and last["val/tests/calls"] == 1.0
    assert last["train/tests/errors"] == 0.0 and last["train/tests/seconds"] > 0
    assert 0.0 <= last["train/tests/ok_rate"] <= 1.0
    assert "train/solver/entropy" in last  # the roles train; the tool is none of them
    assert not any(k.startswith("train/tests/") and k.endswith("entropy") for k in last)
    adapters = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*/adapters/*"))
    assert adapters == (["fixer", "solver"] if routing == "ip" else ["shared"])
    episodes = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    for ep in episodes:
        kinds = [t.get("role", t.get("tool")) for t in ep["turns"]]
        assert kinds[:2] == ["solver", "tests"]
        tool = ep["turns"][1]
        assert tool["inputs"]["program"] == ep["turns"][0]["completion"]
        assert tool["status"] == "ok" and tool["output"]
        fixed = tool["fields"]["ok"] is False
        assert kinds[2:] == (["fixer"] if fixed else [])  # the fixer runs only on a failure
    if routing == "ip":  # the trained workflow answers with its tool stage in the trace
        done = CliRunner().invoke(
            app, ["answer", str(tmp_path), "f(x) = x+1", "--trace", "--temperature", "0"]
        )
        assert done.exit_code == 0, done.output
        assert "--- solver (slot 0, adapter solver)" in done.output
        assert "--- tool tests (slot 0, ok)" in done.output
        assert "No visible tests for this problem." in done.output  # a question has none


def test_the_code_tool_runs_the_visible_tests_never_the_hidden_ones():
    problems = codegen.val_problems(20)
    for p in problems:
        visible, hidden = p.meta["visible_tests"], p.meta["tests"]
        assert visible["inputs"] and not set(map(str, visible["inputs"])) & set(
            map(str, hidden["inputs"])
        )
    p = problems[0]
    right = run_visible_tests({"program": f"```python\n{p.meta['reference']}\n```"}, p, [])
    assert right["ok"] is True and right["total"] == len(p.meta["visible_tests"]["inputs"])
    wrong = run_visible_tests({"program": f"```python\n{p.meta['bug']}\n```"}, p, [])
    assert wrong["ok"] is False and "visible tests failed" in wrong["text"]
    for x in p.meta["tests"]["inputs"]:  # what it says names no hidden input
        assert f"({', '.join(map(repr, x))})" not in wrong["text"]


def test_humaneval_rows_carry_their_docstring_examples_as_visible_tests():
    problems = load_humaneval(DATA / "HumanEval.jsonl.gz")[0]
    shown = [p for p in problems if "visible_tests" in p.meta]
    assert len(problems) == 164 and len(shown) == 112
    failing = []
    for p in shown:
        program = f"```python\n{p.prompt}{p.meta['canonical_solution']}\n```"
        if not run_visible_tests({"program": program}, p, [])["ok"]:
            failing.append(p.id)
    # two docstrings show a wrong value (the canonical solutions are right by the hidden tests)
    assert failing == ["humaneval/HumanEval/47", "humaneval/HumanEval/116"]


def test_test_fix_trains_on_humaneval_format_data(small_config, tmp_path):
    cfg = small_config(
        steps=1,
        val_every=1,
        model={"name": "tiny-s", "pretrain_steps": 1200, "pretrain_batch": 64},
        task={
            "name": "code",
            "source": str(DATA / "HumanEval.jsonl.gz"),
            "dataset": "humaneval",
            "val_size": 2,
        },
        workflow={"name": "test_fix"},
        policy={"routing": "ip"},
        grpo={"batch_problems": 2, "group_size": 2},
        rollout={"max_new_tokens": 24},
    )
    Trainer(cfg, tmp_path).run()
    last = read_metrics(tmp_path)[-1]
    assert last["train/tests/calls"] > 0 and last["train/tests/errors"] == 0.0
    assert "train/solver/entropy" in last
