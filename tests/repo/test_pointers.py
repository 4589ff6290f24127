"""Source, bench scripts, shipped configs and the documentation describe marlow as it is: no
pointer to a document a user's clone does not have (a spec, a measurement log, a design note, a
folder beside the repository) or to the tracker's issues, whose numbers mean nothing to a reader.
The CHANGELOG, which is history, may name them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POINTER = re.compile(
    r"SPEC §|\bSPEC \d|MEASURED\.md|DESIGN\.md|STYLE\.md|\.\./shared|\b[Ii]ssues? \d+|"
    r"\bthe issue\b|\(issue\b"
)
FOLDERS = ("src", "bench", "configs", "examples", "docs")
FILES = ("README.md", "CONTRIBUTING.md", "Makefile", "mkdocs.yml", "pyproject.toml")
SUFFIXES = {".py", ".yaml", ".yml", ".sh", ".toml", ".md"}


def test_no_source_file_points_outside_the_repository_or_to_an_issue():
    paths = [
        path
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in SUFFIXES and ".egg-info" not in str(path)
    ]
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in [*paths, *(ROOT / f for f in FILES)]
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if POINTER.search(line)
    ]
    assert found == [], "\n".join(found)


def test_the_pattern_catches_each_kind_of_pointer():
    for text in ("(SPEC §4.4)", "see MEASURED.md", "(issue 13)", "Issue 7", "the issue asks"):
        assert POINTER.search(text), text
    for text in ("SPECIAL_TOKENS", "fix the issues the review names", "tissue 3"):
        assert not POINTER.search(text), text
