"""Every setting is described from the schema: ``marlow settings`` and the settings page read
the same rows, and no field or section goes without a description."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from marlow.cli import app
from marlow.config import RunConfig, resolve
from marlow.config.describe import TOP, sections, settings, summary


def test_every_setting_has_a_description():
    missing = [s.key for s in settings() if not s.description.strip()]
    assert missing == []


def test_the_rows_are_every_leaf_field_of_the_schema_with_its_own_default():
    rows = {s.key: s for s in settings()}
    defaults = RunConfig()
    for key, row in rows.items():
        value = defaults
        for part in key.split("."):
            value = getattr(value, part)
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else None
        if shown is not None or isinstance(value, (int, float, str)):
            assert row.default == (shown if shown is not None else str(value)), key
    assert rows["grpo.clip_low"].valid == ">= 0.0 and < 1.0"
    assert rows["policy.routing"].valid == "sp, ip, map, base"
    assert (
        rows["steps"].section == TOP
        and rows["rollout.vllm.max_model_len"].section == "rollout.vllm"
    )


def test_each_key_is_one_a_run_accepts():
    for row in settings():
        if row.type in ("int", "float") and row.default not in ("null",):
            section, _, field = row.key.rpartition(".")
            data = {field: float(row.default) if row.type == "float" else int(row.default)}
            for part in reversed(section.split(".") if section else []):
                data = {part: data}
            resolve(data)  # the default, given explicitly, validates


def test_a_section_lists_its_own_settings_and_an_unknown_one_names_the_valid():
    grpo = settings("grpo")
    assert grpo and all(s.key.startswith("grpo.") and s.key.count(".") == 1 for s in grpo)
    assert [s.key for s in settings(TOP)][:2] == ["preset", "seed"]
    assert sections()[0] == TOP and "rollout.vllm" in sections()
    with pytest.raises(ValueError, match="valid: top, model, task"):
        settings("nope")


def test_every_section_says_what_it_is_for_in_plain_words():
    for section in sections():
        text = summary(section)
        assert text.endswith(".") and "\n" not in text, section
        assert ":mod:" not in text and "``" not in text, section
    assert summary(TOP).startswith("The run as a whole")
    assert summary("rollout.vllm").startswith("The vLLM engine")
    with pytest.raises(ValueError, match="valid: top, model"):
        summary("nope")


def test_marlow_settings_prints_a_section_and_refuses_an_unknown_one():
    done = CliRunner().invoke(app, ["settings", "optim"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    said = " ".join(done.output.split())
    assert summary("optim") in said
    for row in settings("optim"):
        assert f"{row.key} = {row.default}" in said
        assert row.description in said
    bad = CliRunner().invoke(app, ["settings", "optimizer"])
    assert bad.exit_code == 2
    assert "no settings section 'optimizer'; valid: top," in " ".join(bad.output.split())
