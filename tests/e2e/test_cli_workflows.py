"""``marlow workflows`` and a workflow written only as a file (configs/workflows/debate.yaml)
training from the CLI under SP and IP with per-role metrics, and named by its title in a grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marlow.grids.grid import expand, load_grid
from tests.conftest import PRETRAIN_STEPS
from tests.e2e.test_cli import run

DEBATE = Path(__file__).parents[2] / "configs" / "workflows" / "debate.yaml"


def test_workflows_lists_the_built_ins_and_checks_a_file(tmp_path):
    done = run(["workflows"], "", tmp_path)
    assert done.returncode == 0, done.stderr
    for name in ("single", "eval_opt", "voting", "orch_workers", "Orch-Workers"):
        assert name in done.stdout
    done = run(["workflows", "check", str(DEBATE)], "", tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "roles: debater (answer), judge (select)" in out
    assert "2. debater x2; prompt rebut; round 1; reads mine=own.debater" in out
    assert "Q: What is 12 + 30?\nA: <debater output 2>\nC: 1) <debater output 1>\nFix:" in out
    assert "--- judge slot 0 round 0 (select) prompt:" in out
    # placeholders count a role's outputs over the episode: round 2 revises the second answer
    done = run(["workflows", "check", "eval_opt"], "", tmp_path)
    assert done.returncode == 0, done.stderr
    second = "--- generator slot 0 round 2 (answer) prompt:\nQ: What is 12 + 30?\n"
    assert second + "A: <generator output 2>\nC: <evaluator output 2>\nFix:" in done.stdout


@pytest.mark.parametrize("routing", ["sp", "ip"])
def test_debate_trains_from_its_file_with_per_role_metrics(tiny_cache, tmp_path, routing):
    done = run(
        [
            "train",
            f"workflow.name={DEBATE}",
            f"policy.routing={routing}",
            "steps=2",
            "val_every=2",
            "threads=1",
            f"model.pretrain_steps={PRETRAIN_STEPS}",
            "task.val_size=4",
            "rollout.max_new_tokens=16",
            "grpo.batch_problems=2",
            "grpo.group_size=2",
            "--out",
            "run",
        ],
        tiny_cache,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2]
    for role in ("debater", "judge"):
        for metric in ("reward", "entropy", "chi2_update", "length_mean"):
            assert f"train/{role}/{metric}" in records[1], (role, metric)
    adapters = ["shared"] if routing == "sp" else ["debater", "judge"]
    folder = tmp_path / "run" / "checkpoints" / "step_000002" / "adapters"
    assert sorted(p.name for p in folder.iterdir()) == adapters
    signatures = json.loads((tmp_path / "run" / "signatures" / "step_000002.json").read_text())
    assert "terse_rate" in signatures["judge"]  # a select role's signature, read by kind
    assert "slot_jaccard_3gram" in signatures["debater"]


def test_a_grid_names_a_file_workflow_by_its_title(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"workflows: [voting, {DEBATE}]\ncontrols: []\n")
    names = [cell.name for cell in expand(load_grid(grid))]
    assert sorted(names) == [
        "Debate-IP-tiny-s-Math",
        "Debate-SP-tiny-s-Math",
        "Voting-IP-tiny-s-Math",
        "Voting-SP-tiny-s-Math",
    ]
