"""The Python API: the docs' example (docs/how-to/python.md) runs as written, and
load_run reads a run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import marlow
from marlow.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def docs_example() -> str:
    """The first Python block of the page "Train from Python"."""
    text = (ROOT / "docs" / "how-to" / "python.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_docs_python_example_runs_as_written(tmp_path):
    # The example names the default tiny-s world, which marlow ships: it pre-trains nothing.
    cache = tmp_path / "cache"
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    script = tmp_path / "example.py"
    script.write_text(docs_example())
    env = {**os.environ, "MARLOW_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not cache.exists()  # the shipped world: nothing pre-trained, nothing cached
    assert "Loading weights" not in done.stderr + done.stdout  # quiet unless verbose
    # quiet, not mute: one line per long phase, and no detail
    phases = done.stderr.splitlines()
    assert phases[0].startswith("training Voting (sp) on tiny-s (math), 2 steps"), phases
    assert phases[1].startswith("trained to step 2 in "), phases
    assert phases[2].startswith("evaluating checkpoint "), phases
    assert len(phases) == 3, phases
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    assert [step for step, _ in eval(lines[0])] == [0, 2]  # noqa: S307 - our own printout
    assert lines[1] == "['shared']"
    folder = tmp_path / "runs" / "api-demo" / "evals" / "step-2"
    assert lines[2].endswith(str(folder)) or lines[2].endswith("runs/api-demo/evals/step-2")
    record = json.loads((folder / "eval.json").read_text())
    assert lines[2].startswith(str(record["val/all/accuracy"]))

    run = marlow.load_run(tmp_path / "runs" / "api-demo")
    assert run.config.policy.routing == "sp" and run.config.steps == 2
    assert len(run.metrics) == 3 and run.metrics["step"] == [0, 1, 2]
    assert run.metrics["val/all/accuracy"][1] is None  # step 1 did not validate
    assert run.evals["step-2"] == record
    assert [c.name for c in run.checkpoints][-1] == "step_000002"
    with pytest.raises(KeyError, match="no metric"):
        run.metrics["val/all/acuracy"]
    with pytest.raises(KeyError, match="no metric 'val/all/acuracy'"):
        run.metrics.series("val/all/acuracy")


def test_load_run_refuses_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(ConfigError, match="not a run folder"):
        marlow.load_run(tmp_path)


def test_settings_go_over_the_config_by_section():
    cfg = marlow.make_config(
        str(ROOT / "configs" / "voting-sp-tiny.yaml"), steps=7, optim={"lr": 5e-4}
    )
    assert (cfg.steps, cfg.optim.lr, cfg.policy.routing) == (7, 5e-4, "sp")
    assert cfg.optim.warmup_steps == 3  # the rest of the section is the preset's
    with pytest.raises(ConfigError, match="optim.lrr"):
        marlow.make_config(None, optim={"lrr": 1})
    dotted = marlow.make_config(None, **{"optim.lr": 5e-4, "optim": {"warmup_steps": 1}})
    assert (dotted.optim.lr, dotted.optim.warmup_steps) == (5e-4, 1)  # as on the command line
