"""The faithful presets: ``official`` takes the official code's value on every switch,
``paper`` the text's, every difference is a documented switch, and docs/presets.md holds the
table the code prints."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from marlow.cli import app
from marlow.config import ConfigError, RunConfig, preset_diff, preset_diff_markdown, resolve
from marlow.config.presets import PRESETS, SWITCHES

ROOT = Path(__file__).resolve().parents[2]

OFFICIAL = {  # field -> (paper value, official value), written out from the official code
    "grpo.minibatch_unit": ("turns", "prompts"),
    "optim.schedule_stepping": ("per-step", "shared-uncapped"),
    "grpo.advantage_scope": ("problem", "trajectory"),
    "workflow.parse": ("last-box", "first-match"),
    "grpo.clip_ratio_c": (None, 3.0),
    "task.format_penalty": (-0.1, 0.0),
    "workflow.rounds_count": ("revisions", "judge-calls"),
    "workflow.workers": ("fixed", "parsed"),
    "workflow.context": ("latest", "conversation"),
    "workflow.prompts": ("marlow", "official"),
    "task.split_rule": ("hash", "permutation"),
    "task.split_seed": (0, 42),
}
OFFICIAL_CODE = {
    "task.code_reward": ("pass_rate", "all_pass"),
    "task.code_block": ("fallback", "last-block"),
    "task.code_timeout_s": (None, 3.0),
}


def field(config: RunConfig, key: str):
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("task", ["math", "code"])
def test_paper_and_official_take_each_switch_from_their_source(task):
    paper = resolve({"preset": "paper", "task": {"name": task}})
    official = resolve({"preset": "official", "task": {"name": task}})
    table = OFFICIAL | (OFFICIAL_CODE if task == "code" else {})
    for key, (text, code) in table.items():
        assert field(paper, key) == text, key
        assert field(official, key) == code, key
    assert official.grpo.update_turns == 64 * 8  # verl's 512 turns per update
    assert paper.grpo.update_turns == 64
    # everything else is the paper's: the same model, dtype and Table 7 fields
    assert (official.model, official.dtype, official.optim.lr) == (
        paper.model,
        paper.dtype,
        paper.optim.lr,
    )


def test_every_difference_is_a_documented_switch_and_every_switch_differs():
    diffs = preset_diff("paper", "official")
    assert {d.key for d in diffs} == set(OFFICIAL) | set(OFFICIAL_CODE)
    assert all(d.switch is not None for d in diffs)
    assert {s.key for s in SWITCHES} == {d.key for d in diffs}
    by_key = {d.key: d for d in diffs}
    assert by_key["task.code_reward"].task == "code" and by_key["workflow.parse"].task == "all"
    for s in SWITCHES:
        assert s.what and s.paper and s.official


def test_the_docs_table_is_the_codes():
    page = (ROOT / "docs" / "presets.md").read_text()
    assert preset_diff_markdown("paper", "official") in page


def test_diff_presets_command_prints_the_table_and_refuses_unknown_presets():
    runner = CliRunner()
    out = runner.invoke(app, ["diff-presets", "paper", "official", "--markdown"])
    assert out.exit_code == 0 and out.stdout == preset_diff_markdown("paper", "official")
    wide = runner.invoke(app, ["diff-presets", "paper", "tiny"], env={"COLUMNS": "300"})
    assert wide.exit_code == 0 and "grpo.batch_problems" in wide.stdout
    bad = runner.invoke(app, ["diff-presets", "paper", "offical"])
    assert bad.exit_code == 2
    assert "preset 'offical' is unknown; valid: " + ", ".join(PRESETS) in bad.output


def test_an_unknown_preset_in_a_config_names_the_valid_ones():
    with pytest.raises(ConfigError, match="paper, official, tiny"):
        resolve({"preset": "offical"})
