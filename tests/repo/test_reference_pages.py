"""The reference pages (docs/reference) are what the code writes: the command line, the
settings, the workflow file and the grid file. A stale page fails here; ``python -m
marlow.reference docs/reference`` rewrites them."""

from __future__ import annotations

from pathlib import Path

from marlow.config.describe import settings
from marlow.reference import PAGES, main, stale, write

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "docs" / "reference"


def test_the_committed_pages_are_what_the_code_writes():
    assert stale(FOLDER) == [], "run: python -m marlow.reference docs/reference"


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
        assert f"| `{row.key}` |" in page, row.key
    workflow = PAGES["workflow-file.md"]()
    for field in ("`stages`", "`reads`", "`when`", "`kind`", "`answer`"):
        assert f"| {field} |" in workflow, field
    assert "| `variants` |" in PAGES["grid-file.md"]()
