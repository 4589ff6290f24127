"""`marlow report` on a synthetic grid results folder whose numbers are chosen by hand.

The folder is the grid runner's layout (index.json, cells/NAME/{cell.json, config.yaml,
metrics.jsonl, signatures/, events.jsonl}) for the grid voting + eval_opt, IP/SP, tiny-s, math,
seeds 0 and 1, controls base, SA-RL and transfer: 20 cells, cell names and configs from
``marlow.grids.grid.expand``. ``Eval-Opt-SP-tiny-s-Math-s1`` failed.

Peak validation accuracies (fractions):

    cell               s0    s1       cell                 s0    s1
    Voting-IP         0.70  0.60      Eval-Opt-IP         0.52  0.46
    Voting-SP         0.55  0.58      Eval-Opt-SP         0.50  failed
    Voting-Base       0.35  0.33      Eval-Opt-Base       0.32  0.30
    Voting-Transfer   0.45  0.41      Eval-Opt-Transfer   0.40  0.38
    Single-SA         0.50  0.40      Single-Base         0.30  0.28

Voting-IP-s0 is built to fire terminal_cliff and gradient_amplification at step 3, and
Voting-SP-s0 to fire sp_role_capture at step 4; every other trained cell is flat.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from marlow.config import ConfigError, dump_config
from marlow.fileio import write_json, write_text
from marlow.grids.grid import expand, parse_grid
from marlow.report import build_report, make_report, paired_test, sign_flip_p
from marlow.report import significance as report_stats
from marlow.report.figures import _seed_lines, layout_problems, new_figure, slug
from marlow.report.tables import fmt

GRID = {
    "workflows": ["voting", "eval_opt"],
    "policies": ["ip", "sp"],
    "scales": ["tiny-s"],
    "tasks": ["math"],
    "seeds": [0, 1],
    "controls": ["base", "sa-rl", "transfer"],
    # four training steps: too few for the running median of 3 the detector takes by default
    "settings": {"steps": 4, "detect": {"amp_window": 1}},
}
FAILED = "Eval-Opt-SP-tiny-s-Math-s1"
PEAKS = {
    "Voting-IP": (0.70, 0.60),
    "Voting-SP": (0.55, 0.58),
    "Eval-Opt-IP": (0.52, 0.46),
    "Eval-Opt-SP": (0.50, None),
    "Voting-Base": (0.35, 0.33),
    "Eval-Opt-Base": (0.32, 0.30),
    "Voting-Transfer": (0.45, 0.41),
    "Eval-Opt-Transfer": (0.40, 0.38),
    "Single-SA": (0.50, 0.40),
    "Single-Base": (0.30, 0.28),
}
FLAT = {"chi2_update": [0.0, 0.02, 0.02, 0.02], "perplexity": [1.1] * 4, "grad_norm": [0.3] * 4}
# Voting-IP-s0's generator: chi2 first positive 0.01 (step 2), peak 0.08 (step 3): ratio 8;
# perplexity 1.8 / 1.2 = 1.5; grad norm 1.5 / 0.5 = 3. Its aggregator stays flat (ratios 1).
AMPLIFIED = {
    "chi2_update": [0.0, 0.01, 0.08, 0.04],
    "perplexity": [1.2, 1.5, 1.8, 1.6],
    "grad_norm": [0.5, 1.0, 1.5, 1.0],
}
ENTROPY = [0.50, 0.40, 0.30, 0.35]  # collapse depth 0.50 - 0.30 = 0.20


def _train_records(val: list[tuple[int, float]], roles: dict, sp: bool) -> list[dict]:
    """Steps 1-4 of training, one record each, and validation records of their own."""
    records: list[dict] = []
    for k in range(4):
        rec: dict = {"step": k + 1, "train/all/accuracy": 0.3 + 0.1 * k}
        rec["train/all/entropy"] = ENTROPY[k]
        for role, metrics in roles.items():
            rec[f"train/{role}/chi2_update"] = metrics["chi2_update"][k]
            rec[f"train/{role}/perplexity"] = metrics["perplexity"][k]
            if sp:  # SP: one adapter's norm, and each role's own gradient beside it
                rec[f"train/{role}/grad_norm_own"] = metrics["grad_norm"][k]
                rec[f"train/{role}/grad_mass_share"] = metrics.get("share", 1 / len(roles))
            else:
                rec[f"train/{role}/grad_norm"] = metrics["grad_norm"][k]
        if sp:
            rec["train/shared/grad_norm"] = 0.4 + 0.1 * k  # max 0.7
        records.append(rec)
    for step, acc in val:
        records.append({"step": step, "val/all/accuracy": acc})
    return sorted(records, key=lambda r: r["step"])


def _records(name: str, peak: float) -> list[dict]:
    kind = name.split("-tiny-s")[0]
    if kind.endswith(("Base", "Transfer")):
        return [{"step": 0, "val/all/accuracy": peak}]
    roles = {"Voting": ("generator", "aggregator"), "Eval-Opt": ("generator", "evaluator")}
    if kind == "Single-SA":
        return _train_records([(0, 0.3), (2, peak), (4, peak - 0.05)], {"generator": FLAT}, False)
    sp = kind.endswith("SP")
    metrics = {role: dict(FLAT) for role in roles[kind.rsplit("-", 1)[0]]}
    val = [(0, 0.4), (2, peak), (4, peak)]
    if name == "Voting-IP-tiny-s-Math-s0":
        metrics["generator"] = AMPLIFIED
        val = [(0, 0.40), (2, 0.70), (3, 0.55), (4, 0.50)]  # two validations under 0.65
    if name == "Voting-SP-tiny-s-Math-s0":
        metrics["generator"] = {**FLAT, "share": 0.8}
        metrics["aggregator"] = {**FLAT, "share": 0.2}
    return _train_records(val, metrics, sp)


SIGNATURES = {  # cell -> step -> role -> signature -> value
    "Voting-SP-tiny-s-Math-s0": {
        0: {"generator": {"length_mean": 40.0}, "aggregator": {"terse_rate": 0.9}},
        4: {"generator": {"length_mean": 42.0}, "aggregator": {"terse_rate": 0.5}},
    },
    "Voting-IP-tiny-s-Math-s0": {
        0: {"generator": {"length_mean": 40.0, "hedge_rate": 0.1}},
        2: {"generator": {"length_mean": 50.0, "hedge_rate": 0.2}},
        4: {"generator": {"length_mean": 60.0, "hedge_rate": float("nan")}},
    },
    "Voting-Base-tiny-s-Math-s0": {0: {"generator": {"length_mean": 39.0}}},
}


def write_results(root: Path) -> Path:
    """Write the synthetic results folder into ``root``; return it."""
    cells = expand(parse_grid(GRID))
    index = {}
    for cell in cells:
        folder = root / "cells" / cell.name
        state, error = "done", None
        if cell.name == FAILED:
            state, error = "failed", "Traceback (most recent call last):\nRuntimeError: loss is nan"
        index[cell.name] = {**cell.describe(), "state": state, "error": error}
        index[cell.name]["path"] = f"cells/{cell.name}"
        write_json(folder / "cell.json", cell.describe())
        write_text(folder / "config.yaml", dump_config(cell.config))
        if state != "done":
            continue
        peak = PEAKS[cell.name.split("-tiny-s")[0]][cell.seed]
        lines = [json.dumps(r) for r in _records(cell.name, peak)]
        write_text(folder / "metrics.jsonl", "\n".join(lines) + "\n")
        for step, sigs in SIGNATURES.get(cell.name, {}).items():
            write_json(folder / "signatures" / f"step_{step:06d}.json", sigs)
    event = {"step": 4, "detector": "terminal_cliff", "fired_at": 3, "evidence": {}}
    write_text(root / "cells/Voting-IP-tiny-s-Math-s0/events.jsonl", json.dumps(event) + "\n")
    assert len(index) == 20, sorted(index)
    write_json(root / "index.json", {"grid": GRID, "cells": index})
    return root


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = write_results(tmp_path_factory.mktemp("grid"))
    return build_report(root, root / "out" / "report.html")


@pytest.fixture(scope="module")
def tables(built: Path) -> dict:
    return json.loads(built.with_suffix(".json").read_text())["tables"]


def _row(rows: list[dict], **match) -> dict:
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def test_table1_means_spreads_and_residuals(tables):
    voting = _row(tables["table1"]["rows"], workflow="voting")
    approx = pytest.approx
    assert (voting["base_mean"], voting["base_n"]) == (approx(0.34), 2)
    assert voting["base_sd"] == approx(math.sqrt(2 * 0.01**2))  # stdev(0.35, 0.33) = 0.01414
    assert voting["sa_rl_mean"] == approx(0.45) and voting["sa_rl_sd"] == approx(0.0707107)
    assert voting["ip_mean"] == approx(0.65) and voting["sp_mean"] == approx(0.565)
    assert voting["sp_sd"] == approx(0.0212132)  # stdev(0.55, 0.58)
    assert voting["transfer_mean"] == approx(0.43) and voting["transfer_n"] == 2
    # residuals per seed: IP - SA = [0.20, 0.20]; SP - SA = [0.05, 0.18]
    assert voting["ip_minus_sa_rl_mean"] == approx(0.20) and voting["ip_minus_sa_rl_sd"] == approx(
        0
    )
    assert voting["sp_minus_sa_rl_mean"] == approx(0.115)
    assert voting["sp_minus_sa_rl_sd"] == approx(0.0919239)  # stdev(0.05, 0.18)
    evalopt = _row(tables["table1"]["rows"], workflow="eval_opt")
    assert evalopt["sp_n"] == 1 and evalopt["sp_sd"] is None  # the s1 cell failed
    assert evalopt["sp_minus_sa_rl_mean"] == approx(0.0) and evalopt["sp_minus_sa_rl_n"] == 1
    assert evalopt["ip_minus_sa_rl_mean"] == approx(0.04)  # (0.02 + 0.06) / 2
    assert evalopt["sa_rl_mean"] == voting["sa_rl_mean"]  # one SA-RL control per (task, scale)


def test_delta_against_the_base_of_the_same_workflow_and_seed(tables):
    rows = tables["table-delta"]["rows"]
    ip = _row(rows, cell="Voting-IP-tiny-s-Math-s0")
    assert ip["base_cell"] == "Voting-Base-tiny-s-Math-s0"
    assert ip["delta_peak"] == pytest.approx(0.35) and ip["delta_final"] == pytest.approx(0.15)
    sa = _row(rows, cell="Single-SA-tiny-s-Math-s1")
    assert sa["base_cell"] == "Single-Base-tiny-s-Math-s1" and sa["delta_peak"] == pytest.approx(
        0.12
    )
    tr = _row(rows, cell="Eval-Opt-Transfer-tiny-s-Math-s1")
    assert tr["delta_peak"] == pytest.approx(0.08)  # 0.38 - 0.30
    assert not [r for r in rows if r["kind"] == "base" or r["cell"] == FAILED]


def test_table2_peak_over_first_ratios(tables):
    rows = tables["table2"]["rows"]
    gen = _row(rows, cell="Voting-IP-tiny-s-Math-s0", role="generator")
    assert gen["slots"] == 3
    assert gen["chi2_ratio"] == pytest.approx(8.0) and gen["chi2_peak_step"] == 3
    assert gen["perplexity_ratio"] == pytest.approx(1.5) and gen[
        "grad_norm_ratio"
    ] == pytest.approx(3.0)
    agg = _row(rows, cell="Voting-IP-tiny-s-Math-s0", role="aggregator")
    assert agg["chi2_ratio"] == pytest.approx(1.0) and agg["chi2_peak_step"] == 2  # tie: earliest
    sp = _row(rows, cell="Voting-SP-tiny-s-Math-s1", role="generator")
    assert sp["grad_norm_ratio"] == pytest.approx(1.0)  # from grad_norm_own under SP
    assert {r["kind"] for r in rows} == {"trained", "sa-rl"}


def test_paired_ip_vs_sp_over_seeds(tables):
    rows = tables["table-paired"]["rows"]
    # Voting: d = IP - SP = [0.15, 0.02]; sign sums +-0.15 +-0.02 = 0.17, 0.13, -0.13, -0.17;
    # |S| >= 0.17 for 2 of the 4 patterns: p = 0.5
    voting = _row(rows, workflow="voting")
    assert voting["n"] == 2 and voting["mean_diff"] == pytest.approx(0.085)
    assert voting["p_value"] == pytest.approx(0.5) and voting["min_p"] == pytest.approx(0.5)
    # Eval-Opt: only seed 0 is matched (SP s1 failed): d = [0.02], p = 1
    evalopt = _row(rows, workflow="eval_opt")
    assert evalopt["n"] == 1 and evalopt["p_value"] == 1.0 and evalopt["sd_diff"] is None
    # pooled d = [0.15, 0.02, 0.02]: S_obs = 0.19, sums of the 8 patterns are +-0.19, +-0.15
    # (twice), +-0.11; only +-0.19 reach it: p = 2/8
    pooled = _row(rows, workflow="all")
    assert pooled["n"] == 3 and pooled["p_value"] == pytest.approx(0.25)
    assert pooled["method"] == "exact"


def test_sign_flip_exact_hand_worked():
    # d = [0.3, -0.1, 0.2, 0.05], S_obs = 0.45. With +0.3 the 8 sums are 0.65, 0.55, 0.45, 0.35,
    # 0.25, 0.15, 0.05, -0.05: three reach 0.45 (the observed one exactly, through float noise),
    # three more mirrored with -0.3: p = 6/16
    assert sign_flip_p([0.3, -0.1, 0.2, 0.05]) == pytest.approx(0.375)
    assert sign_flip_p([0.0, 0.0]) == 1.0
    assert sign_flip_p([]) is None
    assert sign_flip_p([0.1] * 6) == pytest.approx(2 / 64)


def test_sign_flip_monte_carlo_agrees_with_exact(monkeypatch):
    diffs = [0.3, -0.1, 0.2, 0.05, 0.12, -0.02, 0.07]
    exact = sign_flip_p(diffs)
    monkeypatch.setattr(report_stats, "EXACT_MAX_N", 3)
    mc = sign_flip_p(diffs, seed=1)
    assert mc == sign_flip_p(diffs, seed=1)  # seeded: the same draws
    assert mc == pytest.approx(exact, abs=0.005)
    assert paired_test([0.5] * 7, [0.4] * 7)["method"].startswith("monte-carlo")


def test_instability_amplitude_per_matched_cell(tables):
    rows = tables["table-instability"]["rows"]
    assert len(rows) == 3  # voting s0, s1; eval_opt s0 (its SP s1 failed)
    v0 = _row(rows, workflow="voting", seed=0)
    assert v0["ip_max_chi2"] == pytest.approx(0.08) and v0["sp_max_chi2"] == pytest.approx(0.02)
    assert v0["ip_max_grad_norm"] == pytest.approx(1.5) and v0["sp_max_grad_norm"] == pytest.approx(
        0.7
    )
    assert v0["ip_entropy_collapse"] == pytest.approx(0.20)


def test_detector_verdicts_with_evidence(tables):
    rows = tables["table-detectors"]["rows"]
    fired = {(r["cell"], r["detector"]): r for r in rows if r["fired"]}
    assert set(fired) == {
        ("Voting-IP-tiny-s-Math-s0", "terminal_cliff"),
        ("Voting-IP-tiny-s-Math-s0", "gradient_amplification"),
        ("Voting-SP-tiny-s-Math-s0", "sp_role_capture"),
    }
    amp = fired[("Voting-IP-tiny-s-Math-s0", "gradient_amplification")]
    assert amp["step"] == 3 and "generator (3 slots) chi2_update rose 8.00x" in amp["evidence"]
    cap = fired[("Voting-SP-tiny-s-Math-s0", "sp_role_capture")]
    assert cap["step"] == 4 and "terse_rate moved 0.9 -> 0.5" in cap["evidence"]
    assert fired[("Voting-IP-tiny-s-Math-s0", "terminal_cliff")]["logged"] == "3"
    quiet = _row(rows, cell="Single-SA-tiny-s-Math-s0", detector="terminal_cliff")
    assert not quiet["fired"] and "peak=0.500" in quiet["evidence"]
    assert len(rows) == 3 * 9  # 7 trained cells done + 2 SA-RL, three detectors each


def test_signature_tables_first_and_last_step(tables):
    rows = tables["table-signatures"]["rows"]
    ip = [r for r in rows if r["cell"] == "Voting-IP-tiny-s-Math-s0"]
    assert [(r["which"], r["step"], r["length_mean"]) for r in ip] == [
        ("first", 0, 40.0),
        ("last", 4, 60.0),  # step 2 is neither
    ]
    assert ip[1]["hedge_rate"] is None  # NaN is written as null
    base = _row(rows, cell="Voting-Base-tiny-s-Math-s0")
    assert (base["which"], base["step"]) == ("only", 0)
    agg = _row(rows, cell="Voting-SP-tiny-s-Math-s0", role="aggregator", which="last")
    assert agg["terse_rate"] == 0.5
    cols = tables["table-signatures"]["columns"]
    assert cols[:5] == ["cell", "role", "which", "step", "length_mean"]


def test_missing_cells_are_listed_and_left_out(tables, built):
    missing = tables["table-missing"]["rows"]
    assert missing == [
        {
            "name": FAILED,
            "kind": "trained",
            "state": "failed",
            "reason": "RuntimeError: loss is nan",
        }
    ]
    cells = _row(tables["table-cells"]["rows"], cell=FAILED)
    assert cells["state"] == "missing" and cells["peak"] is None
    assert len(tables["table-cells"]["rows"]) == 20
    assert FAILED in built.read_text()


def test_done_cell_without_metrics_is_missing_not_a_crash(tmp_path):
    root = write_results(tmp_path)
    (root / "cells/Voting-SP-tiny-s-Math-s1/metrics.jsonl").unlink()
    report = make_report(root)
    missing = {m["name"]: m for m in report.results.missing}
    assert "no metrics.jsonl" in missing["Voting-SP-tiny-s-Math-s1"]["reason"]
    voting = _row(report.tables["table1"].rows, workflow="voting")
    assert voting["sp_n"] == 1 and voting["sp_mean"] == pytest.approx(0.55)


def test_a_grid_with_nothing_finished_still_reports(tmp_path):
    root = write_results(tmp_path)
    index = json.loads((root / "index.json").read_text())
    for entry in index["cells"].values():
        entry.update(state="pending", error=None)
    write_json(root / "index.json", index)
    page = build_report(root)
    report = json.loads(page.with_suffix(".json").read_text())
    assert len(report["tables"]["table-missing"]["rows"]) == 20
    assert {r["reason"] for r in report["tables"]["table-missing"]["rows"]} == {"state pending"}
    assert report["tables"]["table1"]["rows"][0]["ip_n"] == 0  # the rows are there, empty
    assert not report["tables"]["table-paired"]["rows"]
    assert page.read_text().count("data:image/png;base64,") == 4  # "no data" figures


def test_csv_and_json_of_every_table(built, tables):
    folder = built.parent / "report"
    assert set(tables) == {p.stem for p in folder.glob("*.csv")}
    with (folder / "table1.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["workflow"] for r in rows] == ["voting", "eval_opt"]
    assert float(rows[0]["ip_mean"]) == pytest.approx(0.65)
    assert rows[1]["sp_sd"] == ""  # None is an empty field
    assert list(rows[0]) == tables["table1"]["columns"]
    with (folder / "table-detectors.csv").open() as f:
        fired = [r for r in csv.DictReader(f) if r["fired"] == "true"]
    assert len(fired) == 3
    assert not list(built.parent.rglob("*.tmp"))  # atomic writes leave nothing behind


def test_html_is_self_contained_with_every_id(built, tables):
    html = built.read_text()
    payload = json.loads(built.with_suffix(".json").read_text())
    for table_id in tables:
        assert f'<table id="{table_id}">' in html
    for fig in payload["figures"]:
        assert f'<figure id="{fig["id"]}"><img' in html
        assert (built.parent / fig["png"]).read_bytes()[:4] == b"\x89PNG"
    roles = [f["id"] for f in payload["figures"] if f["id"].startswith("fig-roles-")]
    assert len(payload["figures"]) == 4 + len(roles)
    trained = [  # every finished trained cell (IP, SP, SA-RL) has its per-role figure
        name
        for name in json.loads((built.parent.parent / "index.json").read_text())["cells"]
        if name.split("-tiny-s")[0].endswith(("-IP", "-SP", "-SA")) and name != FAILED
    ]
    assert sorted(roles) == sorted(f"fig-roles-{slug(n)}" for n in trained)
    assert html.count('src="data:image/png;base64,') == len(payload["figures"])
    assert all(not f["layout_problems"] for f in payload["figures"])
    assert "0.650 \u00b1 0.071 (n=2)" in html  # Table 1's Voting IP cell
    assert "http://" not in html and "https://" not in html


def test_no_index_is_a_one_line_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no index.json"):
        build_report(tmp_path)
    write_results(tmp_path)
    with pytest.raises(ConfigError, match="must end in .html"):
        build_report(tmp_path, tmp_path / "report.txt")


def test_cli_report(tmp_path):
    from typer.testing import CliRunner

    from marlow.cli import app

    runner = CliRunner()
    bad = runner.invoke(app, ["report", str(tmp_path)])
    assert bad.exit_code == 2 and "no index.json" in bad.output
    write_results(tmp_path)
    ok = runner.invoke(app, ["report", str(tmp_path), "-o", str(tmp_path / "r.html")])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "r.html").is_file() and (tmp_path / "r" / "table1.csv").is_file()


# ------------------------------------------------------ headline, layout, counts, seeds


def test_the_headline_says_what_the_tables_say(built):
    page = json.loads(built.with_suffix(".json").read_text())
    first, second, claims, third = page["headline"]
    verdicts = {r["claim"]: r["verdict"] for r in page["tables"]["table-claims"]["rows"]}
    assert claims.startswith(
        "The study's claims here: " + ", ".join(f"{c} {v}" for c, v in verdicts.items())
    )
    # Voting IP (0.70, 0.60) vs base (0.35, 0.33): +31.0 points, the largest mean gain
    assert first.startswith("4 of 4 trained multi-agent cells beat the base model")
    assert "Voting IP tiny-s Math (+31.0 points)" in first
    paired = page["tables"]["table-paired"]["rows"][-1]
    assert f"over {paired['n']} matched pairs" in second and "IP peaks higher" in second
    assert f"p = {paired['p_value']:.3g}" in second
    fired = [r for r in page["tables"]["table-detectors"]["rows"] if r["fired"]]
    assert third.startswith("Detectors fired:") and fired[0]["cell"] in third
    html = built.read_text()
    assert html.index('id="headline"') < html.index("<nav>")  # at the top of the page


def test_layout_problems_finds_overlapping_and_clipped_text():
    fig = new_figure(4, 3)
    ax = fig.subplots()
    ax.set_title("a title")
    assert layout_problems(fig) == []
    ax.text(0.5, 1.02, "a text over the title", transform=ax.transAxes, ha="center")
    assert any("overlap" in p and "a title" in p for p in layout_problems(fig))
    fig = new_figure(4, 3)
    fig.subplots()
    fig.text(0.9, 0.5, "far off to the right")
    assert any("clipped" in p for p in layout_problems(fig))
    fig = new_figure(6, 3)  # sixty tick labels on a short axis collide
    ax = fig.subplots()
    ax.set_yticks(range(60), [f"cell {i}" for i in range(60)])
    assert any("overlap" in p for p in layout_problems(fig))


def test_counts_print_as_integers_and_measures_keep_decimals():
    assert fmt(100.0, column="n_turns") == "100"
    assert fmt(2.0, column="step") == "2" and fmt(512.0, column="length_p95") == "512"
    assert fmt(41.5, column="length_mean") == "41.500"
    assert fmt(1.0, column="boxed_rate") == "1.000"  # a rate that happens to be whole
    assert fmt(0.25, column="n_turns") == "0.250"  # not a whole count: shown as it is


def test_seeds_are_distinct_lines_around_their_mean():
    from marlow.report.results import CellRun

    def run(vals):
        records = [{"step": s, "val/all/accuracy": v} for s, v in enumerate(vals)]
        return CellRun(None, None, records, {}, {}, {})

    fig = new_figure(4, 3)
    ax = fig.subplots()
    runs = [(0, run([0.2, 0.4])), (1, run([0.3, 0.5])), (2, run([0.4, 0.9]))]
    assert _seed_lines(ax, runs, "val/all/accuracy", "C0", ".")
    *each, mean = ax.lines
    assert [line.get_linestyle() for line in each] == ["-", "--", ":"]  # one pattern per seed
    assert mean.get_linewidth() > max(line.get_linewidth() for line in each)
    assert list(mean.get_ydata()) == pytest.approx([0.3, 0.6])
    band = ax.collections[0].get_paths()[0].vertices[:, 1]  # the 95 % band, clipped to [0, 1]
    bounds = [report_stats.ci95([0.2, 0.3, 0.4]), report_stats.ci95([0.4, 0.5, 0.9])]
    assert min(band) == pytest.approx(min(max(lo, 0.0) for lo, _ in bounds))
    assert max(band) == pytest.approx(max(min(hi, 1.0) for _, hi in bounds))
    assert min(band) == 0.0  # step 1's interval reaches below 0: clipped


def test_ci95_is_the_t_interval_of_the_mean():
    lo, hi = report_stats.ci95([1.0, 2.0, 3.0])  # mean 2, sd 1, t(0.975, 2) = 4.303
    assert (lo, hi) == pytest.approx((2 - 4.303 / 3**0.5, 2 + 4.303 / 3**0.5))
    assert report_stats.ci95([0.5]) is None
    many = [float(i % 7) for i in range(40)]  # past the table: the normal's 1.96
    mean, sd = sum(many) / 40, __import__("statistics").stdev(many)
    assert report_stats.ci95(many)[1] == pytest.approx(mean + 1.96 * sd / 40**0.5)


def test_variants_are_matched_and_compared_within_themselves(tmp_path):
    from marlow.report.results import load_results
    from marlow.report.tables import matched_pairs

    grid = {
        "workflows": ["voting"],
        "seeds": [0],
        "controls": ["base"],
        "settings": {"steps": 2},
        "variants": {"slow": {"optim": {"lr": 1e-4}}, "fast": {"optim": {"lr": 3e-3}}},
    }
    peaks = {
        "IP-tiny-s-Math-slow": 0.5,
        "SP-tiny-s-Math-slow": 0.4,
        "IP-tiny-s-Math-fast": 0.7,
        "SP-tiny-s-Math-fast": 0.6,
        "Base-tiny-s-Math-slow": 0.3,
        "Base-tiny-s-Math-fast": 0.2,
    }
    index = {}
    for cell in expand(parse_grid(grid)):
        folder = tmp_path / "cells" / cell.name
        index[cell.name] = {
            **cell.describe(),
            "state": "done",
            "error": None,
            "path": f"cells/{cell.name}",
        }
        write_json(folder / "cell.json", cell.describe())
        write_text(folder / "config.yaml", dump_config(cell.config))
        peak = peaks[cell.name.removeprefix("Voting-")]
        write_text(
            folder / "metrics.jsonl", json.dumps({"step": 0, "val/all/accuracy": peak}) + "\n"
        )
    write_json(tmp_path / "index.json", {"grid": grid, "cells": index})
    res = load_results(tmp_path)
    assert sorted({i.scale for i in res.ids}) == ["tiny-s fast", "tiny-s slow"]
    pairs = {key[1]: (ip.peak, sp.peak) for key, _, ip, sp in matched_pairs(res)}
    assert pairs == {"tiny-s slow": (0.5, 0.4), "tiny-s fast": (0.7, 0.6)}
    delta = {r["cell"]: r["delta_peak"] for r in make_report(tmp_path).tables["table-delta"].rows}
    assert delta["Voting-IP-tiny-s-Math-fast"] == pytest.approx(0.5)  # 0.7 - its own base (0.2)


def test_long_noisy_series_are_drawn_as_trailing_means():
    from marlow.report.figures import smoothed

    pts = [(s, float(s % 2)) for s in range(1, 7)]  # 1, 0, 1, 0, 1, 0
    assert smoothed(pts, 1) == pts
    assert smoothed(pts, 2) == [(1, 1.0), (2, 0.5), (3, 0.5), (4, 0.5), (5, 0.5), (6, 0.5)]
