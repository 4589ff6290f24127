"""The dose-response of same-role parallelism: the within-seed slope, its permutation
test and detectable effect worked by hand, and the dose table on hand-made runs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from marlow.config import dump_config
from marlow.diagnostics.runstats import run_statistics
from marlow.fileio import write_json, write_text
from marlow.grids.grid import expand, parse_grid
from marlow.report import build_report
from marlow.report import significance as report_stats
from marlow.report.dose import dose_figures, dose_series, dose_table, mass_share
from marlow.report.results import CellId, CellRun, GridRuns
from marlow.report.significance import (
    detectable_effect,
    slope_permutation_p,
    t_two_sided_p,
    within_slope,
)

# Two seeds at x = 0, 1, 2 (log2 of n = 1, 2, 4), and a third seed with a single point.
#   seed a: y = 1, 2, 4   ybar = 7/3   centred y (-4/3, -1/3, 5/3)   Sxy = 4/3 + 5/3 = 3
#   seed b: y = 0, 2, 2   ybar = 4/3   centred y (-4/3,  2/3, 2/3)   Sxy = 4/3 + 2/3 = 2
# Sxx = 2 + 2 = 4, slope = 5/4. Residuals (centred y - 1.25 centred x), in twelfths:
#   a: (-1, -4, 5), b: (-1, 8, -7); SSE = (1 + 16 + 25 + 1 + 64 + 49) / 144 = 13/12.
# df = N - S - 1 = 6 - 2 - 1 = 3; SE^2 = SSE / df / Sxx = 13/144, SE = sqrt(13)/12.
HAND = [("a", 0, 1.0), ("a", 1, 2.0), ("a", 2, 4.0), ("b", 0, 0.0), ("b", 1, 2.0), ("b", 2, 2.0)]


def test_within_seed_slope_worked_by_hand():
    fit = within_slope(HAND)
    se = math.sqrt(13) / 12
    assert fit["slope"] == pytest.approx(1.25, abs=1e-12)
    assert fit["se"] == pytest.approx(se, abs=1e-12)
    assert (fit["df"], fit["n"], fit["seeds"]) == (3, 6, 2)
    assert fit["ci_low"] == pytest.approx(1.25 - 3.182 * se, abs=1e-12)
    assert fit["ci_high"] == pytest.approx(1.25 + 3.182 * se, abs=1e-12)


def test_a_seed_with_a_single_point_is_dropped():
    assert within_slope([*HAND, ("c", 1, 100.0)]) == within_slope(HAND)
    assert slope_permutation_p([*HAND, ("c", 1, 100.0)]) == slope_permutation_p(HAND)
    lone = within_slope([("a", 0, 1.0), ("b", 1, 2.0)])
    assert lone["slope"] is None and lone["seeds"] == 0
    assert slope_permutation_p([("a", 0, 1.0), ("b", 1, 2.0)])["p_value"] is None


def test_stratified_permutation_p_counted_by_hand():
    # T = sum (x - xbar_s)(y - ybar_s). Seed a's 6 orders of x give T_a in {3, 1, 2, -2, -1, -3};
    # seed b's (two tied values) give T_b in {2, 2, 0, 0, -2, -2}. Observed T = 3 + 2 = 5; of the
    # 36 pairs, |T_a + T_b| >= 5 only for (3, 2) and (-3, -2), 2 ways each: p = 4/36.
    test = slope_permutation_p(HAND)
    assert test["p_value"] == pytest.approx(4 / 36, abs=1e-12)
    assert test["min_p"] == pytest.approx(4 / 36, abs=1e-12)  # the observed is the most extreme
    assert (test["method"], test["permutations"]) == ("exact", 36)
    # Seed a as y = 1, 4, 2: T_a = 4/3 - 1/3 = 1, T = 3. |T_a + T_b| >= 3: T_b = 2 with
    # T_a in {1, 2, 3}; T_b = 0 with T_a = +-3; T_b = -2 with T_a in {-1, -2, -3}; each T_b two
    # ways: (3 + 2 + 3) * 2 = 16 of 36.
    shuffled = [("a", 0, 1.0), ("a", 1, 4.0), ("a", 2, 2.0), *HAND[3:]]
    test = slope_permutation_p(shuffled)
    assert test["p_value"] == pytest.approx(16 / 36, abs=1e-12)
    assert test["min_p"] == pytest.approx(4 / 36, abs=1e-12)


def test_monte_carlo_permutations_agree_with_exact(monkeypatch):
    monkeypatch.setattr(report_stats, "EXACT_MAX_PERMUTATIONS", 10)
    test = slope_permutation_p(HAND, draws=20_000)
    assert test["method"].startswith("monte-carlo")
    assert test["p_value"] == pytest.approx(4 / 36, abs=0.01)
    assert test["min_p"] == pytest.approx(1 / 20_001)


def test_detectable_effect_worked_by_hand():
    se = math.sqrt(13) / 12  # the hand slope's SE, df 3: t(0.975) 3.182 + t(0.80) 0.978
    assert detectable_effect(se, 3) == pytest.approx((3.182 + 0.978) * se, abs=1e-12)
    assert detectable_effect(0.1, 120) == pytest.approx((1.960 + 0.842) * 0.1, abs=1e-12)
    assert detectable_effect(None, 3) is None and detectable_effect(0.1, 0) is None


def test_t_p_values_match_the_tables():
    for df in range(1, 31):
        assert t_two_sided_p(report_stats.T975[df - 1], df) == pytest.approx(0.05, abs=2e-4)
        assert t_two_sided_p(report_stats.T80[df - 1], df) == pytest.approx(0.40, abs=1e-3)
    assert t_two_sided_p(1.0, 2) == pytest.approx(1 - 1 / math.sqrt(3), abs=1e-12)  # t/sqrt(2+t^2)
    assert t_two_sided_p(1.0, 1) == pytest.approx(0.5, abs=1e-12)  # Cauchy: 1 - 2 atan(1) / (pi/2)
    assert t_two_sided_p(0.0, 7) == 1.0


# ---- the dose table on hand-made runs ----------------------------------------------------------


def run(policy, seed, n, *, ratio=2.0, drop=0.1, share=0.5, workflow="voting", flat=None):
    """A trained cell with ``n`` parallel slots of its role: validation 0.5, 0.7, 0.7 - drop;
    four training steps (learning rate at its maximum throughout) in which the parallel role's
    gradient norm goes from 0.1 to ``0.1 * ratio``, the single-slot role's stays at 0.1, and
    (SP) the parallel role's logged mass share is ``share``."""
    role, single = (
        ("generator", "aggregator") if workflow == "voting" else ("worker", "synthesizer")
    )
    key = "grad_norm_own" if policy == "sp" else "grad_norm"
    records = [
        {"step": 0, "val/all/accuracy": 0.5},
        {"step": 2, "val/all/accuracy": 0.7},
        {"step": 4, "val/all/accuracy": 0.7 - drop},
    ]
    for step in range(1, 5):
        rec = {"step": step, "train/generator/lr": 1e-3}
        grow = ratio if step == 3 else 1.0
        for r, value in ((role, 0.1 * grow), (single, 0.1)):
            rec[f"train/{r}/{key}"] = value
            rec[f"train/{r}/chi2_update"] = 0.01  # runstats finds a run's roles by this key
        if policy == "sp":
            rec[f"train/{role}/grad_mass_share"] = share
            rec[f"train/{single}/grad_mass_share"] = 1 - share
        records.append(rec)
    records.sort(key=lambda r: r["step"])
    cid = CellId(
        f"{workflow}-{policy}-n{n}-s{seed}", "trained", workflow, policy, f"tiny-s n{n}", "math",
        seed, f"n{n}",
    )  # fmt: skip
    slots = {role: n, single: 1} if flat is None else flat
    return CellRun(cid, None, records, run_statistics(records), {}, slots)


def grid(runs):
    variants = {r.id.variant: {"workflow": {"params": {"n": 1}}} for r in runs}
    return GridRuns(
        None, {"variants": variants}, [r.id for r in runs], {r.id.name: r for r in runs}, []
    )


def rows_of(runs):
    table = dose_table(dose_series(grid(runs)))
    return {(r["policy"], r["measure"]): r for r in table.rows}


SEEDS = (0, 1, 2, 3)
BUMP = {0: 0.0, 1: 0.03, 2: -0.02, 3: 0.05}  # a seed's own level, the same at every n
WIGGLE = {(0, 1): 0.04, (0, 2): -0.06, (0, 4): 0.02, (1, 1): -0.03, (1, 2): 0.05, (1, 4): -0.02,
          (2, 1): 0.01, (2, 2): -0.01, (2, 4): 0.0, (3, 1): -0.05, (3, 2): 0.02, (3, 4): 0.03}  # fmt: skip


def dose_grid():
    """Voting at n = 1, 2, 4 over four seeds: IP amplitude doubles per doubling of n (times a
    seed's own factor); IP terminal drop falls by 0.05 per doubling, with a seed wiggle; SP mass
    share is noise around 0.5 with no trend."""
    runs = []
    for seed in SEEDS:
        for n in (1, 2, 4):
            x = math.log2(n)
            ip_drop = 0.2 - 0.05 * x + BUMP[seed] + 0.1 * WIGGLE[seed, n]
            runs.append(run("ip", seed, n, ratio=3.0 * 2**seed * n, drop=ip_drop))
            share = 0.5 + BUMP[seed] + WIGGLE[seed, n]
            runs.append(run("sp", seed, n, ratio=3.0, drop=0.1 + BUMP[seed], share=share))
    return runs


def test_amplitude_doubling_per_doubling_of_n_is_slope_one():
    rows = rows_of(dose_grid())
    amp = rows["ip", "amplitude"]
    assert amp["slope"] == pytest.approx(1.0, abs=1e-12)  # log2(3 * 2^seed * n): 1 per doubling
    assert (amp["cells"], amp["seeds"], amp["doses"], amp["role"]) == (12, 4, "1,2,4", "generator")
    assert amp["p_value"] == pytest.approx(2 / 1296)  # only the observed order and its reverse
    assert amp["verdict"] == "holds"
    assert rows["sp", "amplitude"]["slope"] == pytest.approx(0.0, abs=1e-12)
    assert rows["sp", "amplitude"]["verdict"] == "no prediction"


def test_verdicts_holds_refuted_and_not_shown():
    rows = rows_of(dose_grid())
    assert rows["ip", "amplitude"]["verdict"] == "holds"
    drop = rows["ip", "terminal_drop"]  # predicted to rise; it falls, clearly
    assert drop["slope"] < 0 and drop["p_value"] < 0.05 and drop["verdict"] == "refuted"
    share = rows["sp", "mass_share"]  # predicted to rise; noise
    assert share["p_value"] >= 0.05 and share["verdict"] == "not shown"
    assert share["detectable"] > abs(share["slope"])
    for key in (("ip", "peak"), ("sp", "peak"), ("ip", "mass_share"), ("sp", "terminal_drop")):
        assert rows[key]["verdict"] == "no prediction"
    assert all(r["detectable"] is not None for r in rows.values())
    diff = rows["ip - sp", "terminal_drop"]  # SP's drop has slope 0: the difference is IP's
    assert diff["slope"] == pytest.approx(drop["slope"], abs=1e-12)
    assert diff["verdict"] == "refuted" and diff["df"] == drop["df"] == 12 - 4 - 1
    se_ip = (drop["ci_high"] - drop["ci_low"]) / 2 / 2.365  # t(0.975, 7)
    assert diff["detectable"] == pytest.approx((2.365 + 0.896) * se_ip, rel=1e-9)  # SP's SE is 0


def test_ip_mass_share_is_the_adapter_norm_over_the_sum_of_the_roles():
    cell = run("ip", 0, 2)
    # the learning rate peaks at step 2 (the warmup's end); from there, per step:
    #   step 2: 0.6 / (0.6 + 0.2) = 0.75; step 3: 0.3 / (0.3 + 0.3) = 0.5; step 4: 0.2 / 0.4 = 0.5
    # mean 7/12 (step 1, 0.1 / 0.4, is in the warmup and left out)
    norms = {1: (0.1, 0.3), 2: (0.6, 0.2), 3: (0.3, 0.3), 4: (0.2, 0.2)}
    for rec in cell.records:
        if rec["step"] in norms:
            rec["train/generator/grad_norm"], rec["train/aggregator/grad_norm"] = norms[rec["step"]]
            rec["train/generator/lr"] = 1e-3 * min(rec["step"], 2) / 2
    cell.stats.update(run_statistics(cell.records))
    assert cell.stats["warmup_end_step"] == 2
    assert mass_share(cell, "generator") == pytest.approx(7 / 12, abs=1e-12)
    assert mass_share(run("sp", 0, 2, share=0.8), "generator") == pytest.approx(0.8)


def test_a_grid_without_a_dose_axis_has_no_table():
    runs = [
        run(p, s, 3, flat={"generator": 3, "aggregator": 1}) for p in ("ip", "sp") for s in (0, 1)
    ]
    series = dose_series(grid(runs))
    assert series == [] and dose_table(series) is None and dose_figures(series) == []


def test_orch_workers_parallel_role_is_the_worker():
    runs = [
        run(p, s, n, workflow="orch_workers") for p in ("ip", "sp") for s in (0, 1) for n in (1, 3)
    ]
    (series,) = dose_series(grid(runs))
    assert series.role == "worker" and series.variants == ("n1", "n3")


# ---- a report built on a results folder with a dose axis ----------------------------------------

DOSE_GRID = {
    "workflows": ["voting"],
    "seeds": [0, 1],
    "controls": [],
    "settings": {"steps": 4},
    "variants": {
        "n1": {"workflow": {"params": {"n": 1}}},
        "n2": {"workflow": {"params": {"n": 2}}},
    },
}


def test_the_report_of_a_dose_grid_holds_the_dose_table_and_figures(tmp_path):
    index = {}
    for cell in expand(parse_grid(DOSE_GRID)):
        n = cell.config.workflow.params["n"]
        folder = tmp_path / "cells" / cell.name
        index[cell.name] = {**cell.describe(), "state": "done", "error": None}
        index[cell.name]["path"] = f"cells/{cell.name}"
        write_text(folder / "config.yaml", dump_config(cell.config))
        records = run(cell.policy, cell.seed, n, ratio=2.0 * n).records
        write_text(folder / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    write_json(tmp_path / "index.json", {"grid": DOSE_GRID, "cells": index})
    page = build_report(tmp_path)  # beside index.json, where long_summary.py reads both
    report = json.loads(page.with_suffix(".json").read_text())
    rows = report["tables"]["table-dose"]["rows"]
    amp = next(r for r in rows if (r["policy"], r["measure"]) == ("ip", "amplitude"))
    assert amp["slope"] == pytest.approx(1.0) and amp["doses"] == "1,2" and amp["seeds"] == 2
    assert (tmp_path / "report" / "table-dose.csv").read_text().startswith("task,scale,")
    figures = {f["id"] for f in report["figures"]}
    wanted = {
        "fig-dose-amplitude",
        "fig-dose-mass-share",
        "fig-dose-terminal-drop",
        "fig-dose-peak",
    }
    assert wanted <= figures
    assert all(not f["layout_problems"] for f in report["figures"] if f["id"] in wanted)
    html = page.read_text()
    assert 'id="table-dose"' in html and 'id="sec-dose"' in html and 'id="fig-dose-peak"' in html
    assert any(line.startswith("Dose-response") for line in report["headline"])
    summary = _long_summary().main(str(tmp_path), "A dose grid")
    assert "## Dose-response of same-role parallelism" in summary
    assert "- voting IP amplitude (generator): +1.000 per doubling of n" in summary


def _long_summary():
    path = Path(__file__).parents[2] / "docs" / "results" / "long_summary.py"
    spec = importlib.util.spec_from_file_location("long_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_power_page_is_what_dose_power_writes():
    root = Path(__file__).parents[2] / "docs" / "results"
    spec = importlib.util.spec_from_file_location("dose_power", root / "dose_power.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = module.main(["--scale", "tiny-m lr3e-3", "--scale", "tiny-m lr1e-3"])
    assert (root / "dose_power.md").read_text() == page
    (lr3,) = json.loads(module.main(["--json"]))
    # tiny-m lr3e-3 math peaks over seeds 0-2 (table-cells.csv) and their squared deviations:
    #   Voting IP .66 .72 .71 (SS .002067), Voting SP .68 .73 .71 (.001267),
    #   Eval-Opt IP .61 .65 .66 (.0014), Eval-Opt SP .62 .63 .66 (.000867)
    # pooled variance = .0056 / (4 groups x 2 df) = .0007; 4 seeds x 3 doses: Sxx 8, df 7
    sd = lr3["spread"]["peak"]["sd"]
    assert sd == pytest.approx(math.sqrt(0.0007), abs=1e-9)
    four = next(
        d for d in lr3["designs"] if (d["measure"], d["seeds"], d["val_size"]) == ("peak", 4, 100)
    )
    assert four["slope"] == pytest.approx((2.365 + 0.896) * sd / math.sqrt(8), abs=1e-12)
