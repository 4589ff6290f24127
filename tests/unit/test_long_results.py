"""The committed long-run grid (issue 19): its report is of ``configs/grids/tiny-long.yaml`` as it
stands, every cell finished, and its summary page is what ``docs/results/long_summary.py``
writes from the committed files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from marlow.experiments.grid import expand, load_grid

ROOT = Path(__file__).parents[2]
RESULTS = ROOT / "docs" / "results" / "tiny-long"


def test_the_committed_report_holds_every_cell_of_the_long_grid_file_finished():
    cells = {c.name: c for c in expand(load_grid(ROOT / "configs" / "grids" / "tiny-long.yaml"))}
    index = json.loads((RESULTS / "index.json").read_text())["cells"]
    assert set(index) == set(cells)
    assert {c["state"] for c in index.values()} == {"done"}
    trained = [c for c in cells.values() if c.kind == "trained"]
    assert min(c.config.steps for c in trained) >= 150
    assert {c.task for c in trained} == {"math", "code"}
    assert {c.workflow for c in trained if c.task == "math"} >= {"voting", "eval_opt"}
    assert {c.policy for c in trained} == {"ip", "sp"} and {c.seed for c in trained} == {0, 1, 2}
    assert len({c.scale for c in trained}) >= 2
    lrs = {c.config.optim.lr for c in trained}
    assert 3e-3 in lrs and len(lrs) >= 2  # an unstable rate and the preset's
    # the runner's clock for the trained and base cells, two at a time, stays under 3 h
    assert sum(c["seconds"] for c in index.values()) / 2 < 3 * 3600


def test_the_summary_page_is_generated_from_the_committed_report(monkeypatch):
    monkeypatch.chdir(ROOT)  # the page names the folder as given
    path = ROOT / "docs" / "results" / "long_summary.py"
    spec = importlib.util.spec_from_file_location("long_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = module.main("docs/results/tiny-long")
    committed = (ROOT / "docs" / "results" / "tiny-long.md").read_text()
    assert committed.startswith(page)
    report = json.loads((RESULTS / "report.json").read_text())
    verdicts = {r["verdict"] for r in report["tables"]["table-claims"]["rows"]}
    assert verdicts <= {"holds", "refuted", "not shown"} and verdicts
    assert any(r["meets"] is True for r in report["tables"]["table-mitigations"]["rows"])
