"""The reference pages (docs/reference) are what the code writes: the command line, the
settings, the workflow file and the grid file. A stale page fails here; ``python -m
marlow.docpages docs/reference`` rewrites them. Each setting and each metric has an anchor that
other pages link to (``settings.md#task.family``, ``metrics.md#grad_norm``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from marlow.config.describe import TOP, sections, settings, summary
from marlow.docpages import FOLD_AT, HEAD, PAGES, _fold, main, stale, write

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "docs" / "reference"


def test_the_committed_pages_are_what_the_code_writes():
    assert stale(FOLDER) == [], "run: python -m marlow.docpages docs/reference"


def test_a_changed_or_missing_page_is_stale_and_the_check_says_so(tmp_path, capsys):
    write(tmp_path)
    assert stale(tmp_path) == []
    (tmp_path / "settings.md").write_text("# Settings\n")
    (tmp_path / "cli.md").unlink()
    assert sorted(stale(tmp_path)) == ["cli.md", "settings.md"]
    assert main([str(tmp_path), "--check"]) == 1
    assert "stale:" in capsys.readouterr().out
    assert main([str(tmp_path)]) == 0 and main([str(tmp_path), "--check"]) == 0


def test_the_pages_hold_every_command_setting_and_file_field():
    import typer

    from marlow.cli import app

    cli = PAGES["cli.md"]()
    for name in typer.main.get_command(app).commands:
        assert f"## marlow {name}" in cli, name
    page = PAGES["settings.md"]()
    for row in settings():
        assert f"| [`{row.key}`](#{row.key}){{#{row.key}}} |" in page, row.key
    workflow = PAGES["workflow-file.md"]()
    for field in ("`stages`", "`reads`", "`when`", "`kind`", "`answer`"):
        assert f"| {field} |" in workflow, field
    assert "| `variants` |" in PAGES["grid-file.md"]()


def html_ids(page: str) -> list[str]:
    """The ids of ``page`` (its front matter left out) as the site's Markdown renders it."""
    markdown = pytest.importorskip("markdown")
    body = page.split("---\n", 2)[2] if page.startswith("---\n") else page
    html = markdown.markdown(body, extensions=["attr_list", "tables", "toc"])
    return re.findall(r' id="([^"]+)"', html)


def test_each_setting_and_section_is_anchored_at_its_key_as_typed():
    ids = html_ids(PAGES["settings.md"]())
    assert len(ids) == len(set(ids))
    assert set(ids) == {row.key for row in settings()} | set(sections()) | {"settings"}  # h1
    assert {"task.family", "rollout.max_new_tokens", "steps", "rollout.vllm", "top"} <= set(ids)


def test_each_metric_is_anchored_at_its_name_without_angle_brackets():
    from marlow.diagnostics.metrics import METRICS

    ids = html_ids(PAGES["metrics.md"]())
    assert len(ids) == len(set(ids))
    names = {m.name.replace("<", "").replace(">", "") for m in METRICS}
    assert names <= set(ids) and {"grad_norm", "own_reward", "reward_reason"} <= names


def test_a_long_description_shows_its_first_clause_and_folds_the_rest():
    short = "validate every this many steps"
    assert _fold(short) == short
    for row in settings():
        text = row.description
        cell = _fold(text)
        if len(text) <= FOLD_AT:
            continue
        head, rest = re.fullmatch(
            r'<details class="more"><summary>(.*) …</summary>(.*)</details>', cell
        ).groups()
        assert len(head) <= HEAD and rest, row.key
        assert f"{head} {rest}".split() == text.split(), row.key
    family = _fold(next(r.description for r in settings() if r.key == "task.family"))
    assert (
        "<summary>which templates of the prompt set the roles read, and on a tiny model which tiny world: …</summary>"
        in family
    )


def test_each_section_of_the_settings_page_says_what_it_is_for():
    page = PAGES["settings.md"]()
    for section in sections():
        heading = "Top level" if section == TOP else section
        assert f"## {heading} {{#{section}}}\n\n{summary(section)}\n" in page, section


def test_the_file_pages_head_their_sections_as_a_user_writes_the_file():
    workflow, grid = PAGES["workflow-file.md"](), PAGES["grid-file.md"]()
    assert re.findall(r"^## (.*)$", workflow, re.M) == [
        "Top level {#top-level}",
        "A parameter (`params:` entries) {#params}",
        "A role (`roles:` entries) {#roles}",
        "A stage (`stages:` entries) {#stages}",
        "A tool stage (`tool:` entries of `stages:`) {#tool-stage}",
    ]
    assert re.findall(r"^## (.*)$", grid, re.M) == [
        "Top level {#top-level}",
        "Resources (`resources:`) {#resources}",
    ]
    assert "| `stages` | (required) | list[[stage](#stages)] |" in workflow
    assert "| `resources` | `gpus=0.0, cpus=null, custom={}` | [resources](#resources) |" in grid
    for name in ("WorkflowFile", "ParamFile", "RoleFile", "StageFile", "GridSpec", "CellResources"):
        assert name not in workflow + grid, name
