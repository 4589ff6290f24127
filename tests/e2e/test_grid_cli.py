"""``marlow grid`` as a user types it: key=value overrides, a dry
run that counts the cells and says the controls are the default ones, a failed cell's line with
``[k/N]`` and its error file, and a grid trained with a workflow file by a relative path that
reads (report, inspect) from another folder after that file is gone, under one workflow name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import PRETRAIN_STEPS, in_process
from tests.e2e.test_run_folders import SOLVER_CRITIC

GRID = f"""\
workflows: [solver_critic.yaml]
policies: [ip]
settings:
  steps: 3
  val_every: 1
  ckpt_every: 1
  threads: 1
  model: {{pretrain_steps: {PRETRAIN_STEPS}}}
  task: {{val_size: 2}}
  rollout: {{max_new_tokens: 8}}
  grpo: {{batch_problems: 2, group_size: 2}}
"""
CELLS = [
    "SolverCritic-IP-tiny-s-Math",
    "Single-SA-tiny-s-Math",
    "Single-Base-tiny-s-Math",
    "SolverCritic-Base-tiny-s-Math",
]


def marlow(args, cache, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "MARLOW_CACHE": cache, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "marlow", *args], capture_output=True, text=True, env=env, cwd=cwd
    )


@pytest.mark.slow
def test_a_grid_with_overrides_a_failed_cell_and_a_workflow_file_read_elsewhere(
    tiny_cache, tmp_path
):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "solver_critic.yaml").write_text(SOLVER_CRITIC)
    (project / "grid.yaml").write_text(GRID)

    dry = marlow(["grid", "grid.yaml", "steps=1", "--dry-run"], tiny_cache, project)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[:-1] == CELLS
    assert lines[-1].startswith("4 cells: 1 trained, 1 sa-rl, 2 base (controls base, sa-rl are ")
    assert "set `controls: []`" in lines[-1]

    # the run: two of those cells (the trained one and its base), and a folder in the way of
    # the base cell: it fails, the other runs
    (project / "two.yaml").write_text(
        GRID.replace("policies: [ip]", "policies: [ip]\ncontrols: [base]")
    )
    broken = project / "res" / "cells" / "SolverCritic-Base-tiny-s-Math"
    broken.mkdir(parents=True)
    (broken / "metrics.jsonl").write_text('{"step": 0}\n')
    done = marlow(["grid", "two.yaml", "steps=1", "--out", "res"], tiny_cache, project)
    assert done.returncode == 1, done.stderr[-3000:]
    failed = [line for line in done.stderr.splitlines() if f"{broken.name}: failed" in line]
    assert len(failed) == 1, done.stderr[-3000:]
    # [1/2] or [2/2]: the count is of cells ended, and the two may end in either order (one
    # worker runs them one after the other, two run them side by side)
    assert re.match(rf"\[[12]/2\] {broken.name}: failed: ResumeError: ", failed[0]), failed[0]
    assert failed[0].endswith(f"({broken.relative_to(project) / 'error.txt'})")
    assert ".." not in failed[0].replace("(res/", "")
    assert "Traceback" in (broken / "error.txt").read_text()
    trained = project / "res" / "cells" / CELLS[0]
    assert "steps: 1\n" in (trained / "config.yaml").read_text()  # the override reached it
    assert "# run with: steps=1" in (project / "res" / "grid.yaml").read_text()
    index = json.loads((project / "res" / "index.json").read_text())["cells"]
    assert {n: c["state"] for n, c in index.items()} == {CELLS[0]: "done", broken.name: "failed"}

    (project / "solver_critic.yaml").unlink()
    results = project / "res"
    shown = in_process(["inspect", trained, "--json"], elsewhere)
    assert shown.exit_code == 0, shown.stderr
    assert set(json.loads(shown.stdout)["roles"]) == {"solver", "critic", "all"}
    grid_folder = in_process(["inspect", results], elsewhere)
    assert grid_folder.exit_code == 2
    said = " ".join(grid_folder.stderr.split())
    assert f"marlow inspect {results}/cells/" in said and f"marlow report {results}" in said

    report = marlow(["report", str(results)], tiny_cache, elsewhere)
    assert report.returncode == 0, report.stderr[-3000:]
    tables = "\n".join(p.read_text() for p in (results / "report").glob("*.csv"))
    assert "SolverCritic" in tables and "solver_critic" not in tables
