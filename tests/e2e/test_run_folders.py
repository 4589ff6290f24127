"""A run read from another folder than the one it was trained in, and what
resuming a finished run says (item 9).

The run is trained with a workflow file given by a relative path; its folder keeps the file's
text (``workflow.yaml``), and inspect, eval and resume read that copy, never the typed path, so
each works from any folder and after the source file is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PRETRAIN_STEPS, in_process

MARLOW = [sys.executable, "-m", "marlow.cli"]

SOLVER_CRITIC = """\
title: SolverCritic
roles:
  solver: {kind: answer}
  critic: {kind: judge}
stages:
  - {role: solver, prompt: generator/answer}
  - {role: critic, prompt: evaluator/review, reads: {answer: last.solver}, parser: verdict}
  - repeat: 1
    stages:
      - {role: solver, prompt: generator/revise, when: verdict_incorrect,
         reads: {answer: last.solver, critique: last.critic}}
answer: last.solver
"""

TINY = [
    "steps=2",
    "val_every=1",
    "ckpt_every=1",
    "threads=1",
    "model.name=tiny-s",
    f"model.pretrain_steps={PRETRAIN_STEPS}",
    "task.val_size=4",
    "rollout.max_new_tokens=16",
    "grpo.batch_problems=2",
    "grpo.group_size=2",
]


def marlow(args: list[str], cache: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MARLOW_CACHE": cache}
    return subprocess.run(
        [*MARLOW, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


@pytest.mark.slow
def test_a_run_with_a_relative_workflow_file_reads_from_any_folder(tiny_cache, tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "solver_critic.yaml").write_text(SOLVER_CRITIC)
    train = ["train", "workflow.name=solver_critic.yaml", "policy.routing=ip", *TINY]
    done = marlow([*train, "--out", "runs/sc-ip"], tiny_cache, project)
    assert done.returncode == 0, done.stderr
    run = project / "runs" / "sc-ip"
    assert (run / "workflow.yaml").read_text() == SOLVER_CRITIC
    (project / "solver_critic.yaml").unlink()  # the typed path now leads nowhere, anywhere

    evaluated = marlow(["eval", str(run), "--json"], tiny_cache, elsewhere)
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["step"] == 2

    resumed = marlow(["train", "--out", str(run), "--resume", "steps=3"], tiny_cache, elsewhere)
    assert resumed.returncode == 0, resumed.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]

    shown = in_process(["inspect", run, "--json"], elsewhere)
    assert shown.exit_code == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert set(report["roles"]) == {"solver", "critic", "all"}
    # item 9: a metric sampled every diagnostics.every (5) steps shows its own latest step
    solver = report["roles"]["solver"]
    assert report["train_step"] == 3 and solver["latest_step"]["chi2_update"] == 1
    assert solver["latest_step"]["reward"] == 3
    table = in_process(["inspect", run], elsewhere)
    assert table.exit_code == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("│ chi2_update "))
    assert "(step 1)" in row, table.stdout

    # item 9: a finished run resumed again says so, and records nothing
    events = (run / "events.jsonl").read_text()
    again = marlow(["train", "--out", str(run), "--resume"], tiny_cache, elsewhere)
    assert again.returncode == 0, again.stderr
    assert "already finished at step 3; pass steps=N to extend it" in again.stderr
    assert (run / "events.jsonl").read_text() == events
