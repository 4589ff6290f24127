"""The documentation site's own facts: the strict build checks the anchors other pages link
to (a setting's, a metric's)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


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
