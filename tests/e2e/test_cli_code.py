"""``marlow quickstart --task code`` as a user types it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from marlow.config import ConfigError
from marlow.worlds.quickstart import cell_configs
from tests.conftest import PRETRAIN_STEPS
from tests.e2e.test_cli import run


def test_code_cells_are_the_quickstart_cells_on_the_code_world():
    cells = cell_configs(task="code")
    assert list(cells) == [
        "Voting-IP-tiny-s-Code",
        "Voting-SP-tiny-s-Code",
        "Single-SA-tiny-s-Code",
        "Single-Base-tiny-s-Code",
        "Voting-Base-tiny-s-Code",
    ]
    for cfg in cells.values():
        assert cfg.task.name == "code" and cfg.task.val_size == 200
        assert cfg.rollout.max_new_tokens == 128 and cfg.preset == "quickstart"
    assert (
        cell_configs(task="code", settings={"task": {"val_size": 9}})[
            "Voting-IP-tiny-s-Code"
        ].task.val_size
        == 9
    )
    assert list(cell_configs())[0] == "Voting-IP-tiny-s-Math"  # math unchanged
    assert cell_configs()["Voting-IP-tiny-s-Math"].task.name == "math"
    with pytest.raises(ConfigError, match="valid: math, code"):
        cell_configs(task="chess")
    with pytest.raises(ConfigError, match="contradicts"):
        cell_configs(task="math", settings={"task": {"name": "code"}})


def test_a_wrong_quickstart_task_fails_in_one_line(tmp_path: Path):
    done = run(["quickstart", "--task", "chess", "--out", "qs"], str(tmp_path / "cache"), tmp_path)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "valid: math, code" in lines[0], done.stderr
    assert not (tmp_path / "qs" / "summary.json").exists()


@pytest.mark.slow  # four cells plus a short code pre-training: about a minute on 2 cores
def test_code_quickstart_on_a_shrunk_tiny_world(tiny_cache, tmp_path: Path):
    settings = [
        f"model.pretrain_steps={PRETRAIN_STEPS}",
        "task.val_size=6",
        "rollout.max_new_tokens=24",
        "grpo.batch_problems=2",
        "grpo.group_size=2",
        "val_every=1",
    ]
    args = ["quickstart", "--task", "code", *settings, "--steps", "2", "--out", "qs"]
    done = run(args, tiny_cache, tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "qs" / "summary.json").read_text())
    assert summary["task"] == "code"
    assert set(summary["cells"]) == {
        "Voting-Base-tiny-s-Code",
        "Single-Base-tiny-s-Code",
        "Single-SA-tiny-s-Code",
        "Voting-IP-tiny-s-Code",
        "Voting-SP-tiny-s-Code",
    }
    assert all(row["n_val"] == 6 for row in summary["cells"].values())
    assert "Voting-IP-tiny-s-Code" in done.stdout


def test_pretrain_tiny_names_the_valid_tasks(tmp_path):
    done = run(["pretrain-tiny", "--task", "chess"], str(tmp_path), tmp_path)
    assert done.returncode == 2 and "valid: math, code" in done.stderr


@pytest.mark.slow
def test_pretrain_tiny_reports_the_greedy_generator_of_its_world(tiny_cache, tmp_path):
    # the conftest's world: a cache hit, then the greedy report (measured by the CLI, not stored)
    done = run(["pretrain-tiny", "--steps", str(PRETRAIN_STEPS)], tiny_cache, tmp_path)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.parent == Path(tiny_cache) and (path / "meta.json").exists()
    assert re.search(
        r"tiny-s \(math\): greedy generator accuracy [01]\.\d{3} on 200 val", done.stderr
    )
    quiet = run(
        ["pretrain-tiny", "--steps", str(PRETRAIN_STEPS), "--no-report"], tiny_cache, tmp_path
    )
    assert quiet.stdout == done.stdout and "greedy" not in quiet.stderr
