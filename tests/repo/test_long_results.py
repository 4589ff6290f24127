"""The committed long-run grids: the long grid and the dose-response grid.
Each report is of its grid file (``configs/grids/<name>.yaml``) as it stands, every cell
finished, and each summary page is what ``docs/results/long_summary.py`` writes from the
committed files. Every committed figure is shown on a results page, and each published report is
linked."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from marlow.grids.grid import expand, load_grid

ROOT = Path(__file__).parents[2]
RESULTS = ROOT / "docs" / "results" / "tiny-long"
DOSE = ROOT / "docs" / "results" / "tiny-dose"


def finished_trained_cells(name: str) -> list:
    """The trained cells of ``configs/grids/<name>.yaml``, after checking that the committed
    index holds every cell of the file, each done, at 150 steps or more, and that the runner's
    clock for all of them, two at a time, stays under 3 h."""
    cells = {c.name: c for c in expand(load_grid(ROOT / "configs" / "grids" / f"{name}.yaml"))}
    index = json.loads((ROOT / "docs" / "results" / name / "index.json").read_text())["cells"]
    assert set(index) == set(cells)
    assert {c["state"] for c in index.values()} == {"done"}
    assert sum(c["seconds"] for c in index.values()) / 2 < 3 * 3600
    trained = [c for c in cells.values() if c.kind == "trained"]
    assert min(c.config.steps for c in trained) >= 150
    return trained


def test_the_committed_report_holds_every_cell_of_the_long_grid_file_finished():
    trained = finished_trained_cells("tiny-long")
    assert {c.task for c in trained} == {"math", "code"}
    assert {c.workflow for c in trained if c.task == "math"} >= {"voting", "eval_opt"}
    assert {c.policy for c in trained} == {"ip", "sp"} and {c.seed for c in trained} == {0, 1, 2}
    assert len({c.scale for c in trained}) >= 2
    lrs = {c.config.optim.lr for c in trained}
    assert 3e-3 in lrs and len(lrs) >= 2  # an unstable rate and the preset's


def test_the_committed_dose_report_holds_every_cell_of_the_dose_grid_file_finished():
    trained = finished_trained_cells("tiny-dose")
    assert {c.workflow for c in trained} == {"voting", "orch_workers"}
    assert {c.config.workflow.params["n"] for c in trained} == {1, 2, 4}
    assert {c.policy for c in trained} == {"ip", "sp"} and len({c.seed for c in trained}) >= 4


def test_the_dose_report_gives_a_slope_per_workflow_policy_and_measure():
    report = json.loads((DOSE / "report.json").read_text())
    rows = report["tables"]["table-dose"]["rows"]
    measures = {"amplitude", "mass_share", "terminal_drop", "peak"}
    for workflow in ("voting", "orch_workers"):
        for policy in ("ip", "sp"):
            got = {r["measure"] for r in rows if (r["workflow"], r["policy"]) == (workflow, policy)}
            assert got == measures
    judged = [r for r in rows if r["verdict"] != "no prediction"]
    assert {r["verdict"] for r in judged} <= {"holds", "refuted", "not shown"} and judged
    for r in judged:
        assert r["ci_low"] <= r["slope"] <= r["ci_high"] and r["detectable"] > 0
    assert (DOSE / "report" / "fig-dose-terminal-drop.png").stat().st_size > 0


TITLES = {"tiny-long": "Long runs: tiny-long", "tiny-dose": "Same-role parallelism: tiny-dose"}
"""Each long grid's page title, as its regeneration command gives it."""


def long_summary():
    path = ROOT / "docs" / "results" / "long_summary.py"
    spec = importlib.util.spec_from_file_location("long_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list(TITLES))
def test_the_summary_page_is_generated_from_the_committed_report(monkeypatch, name):
    monkeypatch.chdir(ROOT)  # the page names the folder as given
    page = long_summary().main(f"docs/results/{name}", TITLES[name])
    committed = (ROOT / "docs" / "results" / f"{name}.md").read_text()
    assert committed.startswith(page)
    assert f"]({name}/report.html)" in page  # the published report, linked
    report = json.loads((ROOT / "docs" / "results" / name / "report.json").read_text())
    verdicts = {r["verdict"] for r in report["tables"]["table-claims"]["rows"]}
    assert verdicts <= {"holds", "refuted", "not shown"} and verdicts


def test_the_long_grid_kl_variant_meets_the_mitigation_bar():
    report = json.loads((RESULTS / "report.json").read_text())
    assert any(r["meets"] is True for r in report["tables"]["table-mitigations"]["rows"])


def test_every_committed_figure_is_shown_as_an_image_on_a_results_page():
    results = ROOT / "docs" / "results"
    pages = "\n".join(p.read_text() for p in results.glob("*.md"))
    shown = {(results / path).resolve() for path in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", pages)}
    figures = [p for p in results.glob("**/report/*") if p.suffix in (".png", ".svg")]
    assert figures and [p for p in figures if p.resolve() not in shown] == []


def test_the_per_role_figures_are_folded_and_only_committed_ones_shown(monkeypatch):
    monkeypatch.chdir(ROOT)
    dose = long_summary().main("docs/results/tiny-dose", TITLES["tiny-dose"])
    assert '??? note "Per-role series of every trained cell (72 figures)"' in dose
    long = long_summary().main("docs/results/tiny-long", TITLES["tiny-long"])
    assert "fig-roles-" not in long  # their PNGs are not committed
    assert "![Delta against the base](tiny-long/report/fig-delta.png){ loading=lazy }" in long


def test_the_results_overview_links_each_published_report():
    overview = (ROOT / "docs" / "results" / "overview.md").read_text()
    for name in TITLES:
        assert f"]({name}/report.html)" in overview, name
