"""The documentation site's own facts: each navigation label is its page's title, the site and the
package name the same addresses, the installation page names only what the project has, and the
strict build checks the anchors other pages link to (a setting's, a metric's)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def nav_pages(entries: list) -> list[tuple[str, str]]:
    """Every labelled page of the navigation, as (label, path); a section's pages in order, and
    a page listed without a label (the theme then shows its title) left out."""
    found = []
    for entry in entries:
        if isinstance(entry, dict):
            for label, value in entry.items():
                found += nav_pages(value) if isinstance(value, list) else [(label, value)]
    return found


def title(path: str) -> str:
    """A page's first ``# `` heading."""
    return next(
        line[2:].strip() for line in (DOCS / path).read_text().splitlines() if line.startswith("# ")
    )


def test_every_nav_label_is_its_pages_title():
    pages = nav_pages(MKDOCS["nav"])
    assert len(pages) > 30
    assert [(label, path) for label, path in pages if title(path) != label] == []


def test_the_site_and_the_package_name_the_same_addresses():
    urls = PYPROJECT["project"]["urls"]
    assert urls["Repository"] == urls["Homepage"] == MKDOCS["repo_url"]
    assert urls["Documentation"] == MKDOCS["site_url"]
    assert MKDOCS["repo_url"].removeprefix("https://github.com/") == MKDOCS["repo_name"]
    install = (DOCS / "installation.md").read_text()
    assert f"git clone {MKDOCS['repo_url']}.git" in install


def test_the_installation_page_follows_home_and_is_linked_from_it_and_the_readme():
    assert nav_pages(MKDOCS["nav"])[:2] == [
        ("marlow", "index.md"),
        ("Installation", "installation.md"),
    ]
    assert "](installation.md)" in (DOCS / "index.md").read_text()
    assert "](docs/installation.md)" in (ROOT / "README.md").read_text()


def test_the_installation_page_names_real_targets_and_describes_every_extra():
    page = (DOCS / "installation.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    named = set(re.findall(r"`make ([\w-]+)", page)) | set(
        re.findall(r"^make ([\w-]+)", page, re.M)
    )
    assert {"install", "install-vllm", "test-vllm"} <= named <= targets
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert [e for e in extras if f"| `{e}` |" not in page] == []
    for given in re.findall(r"\.\[([\w,-]+)\]", page):
        assert set(given.split(",")) <= set(extras), given
    for script in re.findall(r"`?(bench/[\w.]+\.sh)", page):
        assert (ROOT / script).is_file(), script


def test_links_to_setting_and_metric_anchors_build_and_a_missing_one_fails(tmp_path):
    pytest.importorskip("material")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    good = [
        "settings.md#task.family",
        "settings.md#steps",
        "settings.md#rollout.vllm",
        "metrics.md#grad_norm",
        "metrics.md#reward_reason",
    ]
    bad = ["settings.md#task.nope", "metrics.md#grad_nope"]
    links = " ".join(f"[{n}](reference/{target})" for n, target in enumerate(good + bad))
    with (tmp_path / "docs" / "tasks.md").open("a") as page:
        page.write(f"\n{links}\n")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode != 0, done.stderr[-2000:]
    warned = re.findall(r"contains a link '(reference/[^']+)'", done.stderr)
    assert sorted(warned) == sorted(f"reference/{target}" for target in bad), done.stderr[-2000:]
