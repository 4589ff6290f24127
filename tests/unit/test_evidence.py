"""Detectors judged on evidence and the claims' verdicts, on hand-made runs."""

from __future__ import annotations

import pytest

from marlow.diagnostics.runstats import run_statistics
from marlow.report import evidence
from marlow.report.evidence import claims as claims_module
from marlow.report.evidence import detection
from marlow.report.evidence.claims import _verdict
from marlow.report.evidence.detection import _score, tune
from marlow.report.evidence.labels import label_amplification, label_capture, label_cliff
from marlow.report.results import CellId, CellRun

VOTING = {"generator": 3, "aggregator": 1}


def cell(val, policy="ip", seed=0, train=None, name=None):
    """A trained Voting cell with validation accuracies ``val`` (one every 2 steps from 0) and
    per-step training metrics ``train`` (step -> {key: value})."""
    records = {}
    for i, acc in enumerate(val):
        records.setdefault(2 * i, {"step": 2 * i})["val/all/accuracy"] = acc
    for step, values in (train or {}).items():
        records.setdefault(step, {"step": step}).update(values)
    records = [records[s] for s in sorted(records)]
    cid = CellId(
        name or f"Voting-{policy.upper()}-s{seed}",
        "trained",
        "voting",
        policy,
        "tiny-s",
        "math",
        seed,
    )
    return CellRun(cid, None, records, run_statistics(records), {}, dict(VOTING))


def test_a_cliff_is_a_final_well_under_a_peak_before_the_end():
    run = cell([0.4, 0.6, 0.58, 0.52, 0.45])
    label = label_cliff(run)
    assert label.positive and label.began == 6  # 0.52 is the first under 0.6 - 0.05
    assert not label_cliff(cell([0.4, 0.6, 0.55, 0.52])).positive  # 0.08 under: not 0.10
    assert not label_cliff(cell([0.4, 0.5, 0.6])).positive  # the peak is the last validation


def amplified(ratio_gen, ratio_agg, policy="ip"):
    key = "grad_norm_own" if policy == "sp" else "grad_norm"
    train = {}
    for step in range(1, 11):
        grow = 1 + (ratio_gen - 1) * (step - 1) / 9
        train[step] = {
            "train/all/reward": 0.5,
            f"train/generator/{key}": 0.1 * grow,
            f"train/aggregator/{key}": 0.1 * (1 + (ratio_agg - 1) * (step - 1) / 9),
            "train/generator/lr": 1e-3,
            "train/generator/chi2_update": 0.01,  # runstats finds a run's roles by this key
            "train/aggregator/chi2_update": 0.01,
        }
    return train


def test_amplification_is_a_multi_slot_role_rising_far_beyond_the_single_slot_ones():
    run = cell([0.5, 0.5], train=amplified(4.0, 1.2))
    label = label_amplification(run)
    assert label.positive and label.evidence["role"] == "generator"
    assert label.began == 7  # 0.1 * (1 + 3 (s - 1) / 9) reaches 0.3 = 3 x 0.1 at step 7
    assert not label_amplification(cell([0.5, 0.5], train=amplified(2.5, 1.0))).positive
    assert not label_amplification(cell([0.5, 0.5], train=amplified(4.0, 3.0))).positive


def captured(share, gen_len, agg_len):
    train = {}
    for step in range(1, 13):
        late = step > 6
        train[step] = {
            "train/all/reward": 0.5,
            "train/generator/grad_mass_share": share if late else 0.5,
            "train/aggregator/grad_mass_share": 1 - share if late else 0.5,
            "train/generator/length_mean": 40.0,
            "train/aggregator/length_mean": agg_len[1] if late else agg_len[0],
        }
    return train


def test_capture_is_a_dominant_share_while_another_role_takes_its_length():
    run = cell([0.5, 0.5], policy="sp", train=captured(0.8, 40.0, (10.0, 30.0)))
    label = label_capture(run)
    assert label.positive and label.evidence["dominant"] == "generator"
    assert label.evidence["captured"] == "aggregator" and label.began == 10  # the last quarter
    assert not label_capture(
        cell([0.5, 0.5], policy="sp", train=captured(0.55, 40.0, (10.0, 30.0)))
    ).positive
    assert not label_capture(
        cell([0.5, 0.5], policy="sp", train=captured(0.8, 40.0, (10.0, 15.0)))
    ).positive
    assert not label_capture(
        cell([0.5, 0.5], policy="ip", train=captured(0.8, 40.0, (10.0, 30.0)))
    ).positive


def test_precision_recall_and_lead_against_the_labels():
    runs = [
        cell([0.4, 0.6, 0.58, 0.52, 0.45], seed=0),  # cliff; the detector fires at step 6
        cell([0.4, 0.6, 0.6, 0.6, 0.54], seed=0),  # a 0.06 dip at the end: no cliff label
        cell([0.4, 0.5, 0.55, 0.6, 0.62], seed=0),  # rising: neither
    ]
    score = _score(runs, "terminal_cliff", {"cliff_drop": 0.05, "cliff_patience": 1})
    assert (score["tp"], score["fp"], score["fn"]) == (1, 1, 0)
    assert score["precision"] == 0.5 and score["recall"] == 1.0
    assert score["median_lead"] == 6 - 6  # fired at the first validation under the line
    strict = _score(runs, "terminal_cliff", {"cliff_drop": 0.08, "cliff_patience": 1})
    assert (strict["tp"], strict["fp"], strict["fn"]) == (1, 0, 0)


def test_tuning_picks_the_thresholds_with_the_best_f1_on_its_seeds():
    runs = [
        cell([0.4, 0.6, 0.58, 0.52, 0.45]),
        cell([0.4, 0.6, 0.6, 0.54, 0.54]),  # two validations 0.06 under: no cliff label
        cell([0.4, 0.6, 0.6, 0.6, 0.53]),
    ]
    assert _score(runs, "terminal_cliff", {})["fp"] == 1  # the defaults (0.05, 2) fire on it
    best = tune(runs, "terminal_cliff")
    score = _score(runs, "terminal_cliff", best)
    assert score["f1"] == 1.0 and best["cliff_drop"] >= 0.08
    # nothing labelled nor fired: the defaults stay
    flat = [cell([0.5, 0.5, 0.5, 0.5])]
    assert tune(flat, "terminal_cliff") == {"cliff_drop": 0.05, "cliff_patience": 2}


@pytest.mark.parametrize(
    ("values", "verdict"),
    [
        ([0.1, 0.2, 0.1, 0.05, 0.1, 0.3], "holds"),  # p = 2 / 64
        ([-0.1, -0.2, -0.1, -0.05, -0.1, -0.3], "refuted"),
        ([0.1, -0.2, 0.1, 0.05, -0.1, 0.3], "not shown"),
        ([0.1, 0.2, 0.1], "not shown"),  # three pairs: p >= 0.25, never below 0.05
        ([], "not shown"),
    ],
)
def test_a_claim_holds_only_in_its_direction_with_p_under_005(values, verdict):
    out = _verdict(values)
    assert out["verdict"] == verdict
    if values:
        assert out["n"] == len(values) and out["min_p"] == pytest.approx(2 / 2 ** len(values))


def test_c4_needs_a_captured_sp_cell_besides_the_cliffs(monkeypatch):
    from marlow.report.tables import Table

    pairs = []
    for seed in range(6):
        ip = cell([0.4, 0.6, 0.45], "ip", seed)  # falls 0.15
        sp = cell([0.4, 0.6, 0.6], "sp", seed)  # holds
        pairs.append((("math", "tiny-s", "voting"), seed, ip, sp))
    monkeypatch.setattr(claims_module, "matched_pairs", lambda res: pairs)
    delta = Table("table-delta", "", [], [], "")
    claims = {r["claim"]: r for r in evidence.claims_table(None, delta, ["fig-x"]).rows}
    assert claims["C4"]["effect"] == pytest.approx(0.15) and claims["C4"]["p_value"] < 0.05
    assert claims["C4"]["verdict"] == "not shown"  # no SP cell shows role capture
    monkeypatch.setattr(claims_module, "label_capture", lambda run: evidence.Label(True, 1))
    claims = {r["claim"]: r for r in evidence.claims_table(None, delta, ["fig-x"]).rows}
    assert claims["C4"]["verdict"] == "holds" and claims["C4"]["figure"] == "fig-x"
    assert claims["C2"]["verdict"] == "not shown"  # equal peaks


def test_a_mitigation_is_judged_on_its_baselines_unstable_cells(tmp_path):
    import json

    from marlow.config import dump_config
    from marlow.fileio import write_json, write_text
    from marlow.grids.grid import expand, parse_grid
    from marlow.report.evidence import mitigation_table
    from marlow.report.results import load_results

    grid = {
        "workflows": ["voting"],
        "seeds": [0, 1],
        "controls": [],
        "settings": {"steps": 4},
        "variants": {
            "fast": {"optim": {"lr": 3e-3}},
            "fast-kl": {"optim": {"lr": 3e-3}, "mitigate": {"kl_coef": {"*": 0.1}}},
        },
    }
    curves = {  # (variant, policy, seed) -> validation accuracies at steps 0, 2, 4
        ("fast", "IP", 0): [0.4, 0.70, 0.45],
        ("fast", "IP", 1): [0.4, 0.74, 0.50],
        ("fast", "SP", 0): [0.4, 0.66, 0.62],  # drops 0.04: not a cliff, not counted
        ("fast", "SP", 1): [0.4, 0.72, 0.48],
        ("fast-kl", "IP", 0): [0.4, 0.69, 0.62],
        ("fast-kl", "IP", 1): [0.4, 0.71, 0.66],
        ("fast-kl", "SP", 0): [0.4, 0.60, 0.30],
        ("fast-kl", "SP", 1): [0.4, 0.70, 0.64],
    }
    index = {}
    for c in expand(parse_grid(grid)):
        folder = tmp_path / "cells" / c.name
        index[c.name] = {**c.describe(), "state": "done", "error": None, "path": f"cells/{c.name}"}
        write_json(folder / "cell.json", c.describe())
        write_text(folder / "config.yaml", dump_config(c.config))
        val = curves[(c.variant, c.policy.upper(), c.seed)]
        lines = [json.dumps({"step": 2 * i, "val/all/accuracy": a}) for i, a in enumerate(val)]
        write_text(folder / "metrics.jsonl", "\n".join(lines) + "\n")
    write_json(tmp_path / "index.json", {"grid": grid, "cells": index})
    (row,) = mitigation_table(load_results(tmp_path)).rows
    assert (row["mitigation"], row["baseline"], row["unstable_cells"]) == ("fast-kl", "fast", 3)
    # baseline cliffs: drops 0.25, 0.24, 0.24; their mitigated twins: 0.07, 0.05, 0.06
    assert row["drop_baseline"] == pytest.approx(0.73 / 3)
    assert row["drop_mitigated"] == pytest.approx(0.18 / 3)
    assert row["peak_baseline"] == pytest.approx(0.72) and row["peak_mitigated"] == pytest.approx(
        0.70
    )
    assert row["meets"]  # a quarter of the drop; the peak 0.02 lower, within the CI (+-0.05)
    assert row["peak_ci_half"] == pytest.approx(4.303 * 0.02 / 3**0.5)


def test_each_alarm_and_labelled_event_is_listed_with_its_steps(monkeypatch):
    runs = [
        cell([0.4, 0.6, 0.58, 0.52, 0.45], seed=0, name="cliff-s0"),
        cell([0.4, 0.5, 0.55, 0.6, 0.62], seed=0, name="rising-s0"),
        cell([0.4, 0.6, 0.58, 0.52, 0.45], seed=1, name="cliff-s1"),
        cell([0.4, 0.62, 0.6, 0.5, 0.4], seed=1, name="cliff-late-s1"),
        cell([0.4, 0.5, 0.55, 0.6, 0.62], seed=1, name="rising-s1"),
    ]
    monkeypatch.setattr(detection, "trained_runs", lambda res: runs)
    summary, events = evidence.detector_evaluation(None)
    (cliff,) = [r for r in summary.rows if r["detector"] == "terminal_cliff"]
    assert cliff["tuned_on_seeds"] == "0" and cliff["reported_on_seeds"] == "1"
    assert (cliff["tp"], cliff["fp"], cliff["fn"]) == (2, 0, 0)
    assert cliff["labelled_tuning"] == 1 and cliff["judged"]  # one to tune on, two to score
    (amp,) = [r for r in summary.rows if r["detector"] == "gradient_amplification"]
    assert (amp["labelled_tuning"], amp["labelled"], amp["judged"]) == (0, 0, False)
    listed = {r["cell"]: r for r in events.rows if r["detector"] == "terminal_cliff"}
    assert set(listed) == {"cliff-s0", "cliff-s1", "cliff-late-s1"}  # the rising cells: neither
    late = listed["cliff-late-s1"]
    assert late["set"] == "reported" and listed["cliff-s0"]["set"] == "tuning"
    assert late["labelled"] and late["began"] == 6  # 0.5 is the first 0.05 under 0.62
    assert late["fired"] and late["lead"] == late["fired_step"] - 6


def test_each_variant_has_its_own_verdicts(monkeypatch):
    from dataclasses import replace

    from marlow.report.tables import Table

    def in_variant(run, variant):
        return replace(run, id=replace(run.id, variant=variant, name=f"{run.id.name}-{variant}"))

    pairs = []
    for seed in range(6):
        for variant, (ip_peak, sp_peak) in {"slow": (0.6, 0.5), "fast": (0.4, 0.5)}.items():
            ip = in_variant(cell([0.3, ip_peak], "ip", seed), variant)
            sp = in_variant(cell([0.3, sp_peak], "sp", seed), variant)
            pairs.append((("math", f"tiny-s {variant}", "voting"), seed, ip, sp))
    monkeypatch.setattr(claims_module, "matched_pairs", lambda res: pairs)
    delta = Table("table-delta", "", [], [], "")
    dynamics = ["fig-dynamics-math-tiny-s-fast", "fig-dynamics-math-tiny-s-slow"]
    table = evidence.claims_table(None, delta, dynamics)
    assert table.columns[0] == "variant"
    c2 = {r["variant"]: r for r in table.rows if r["claim"] == "C2"}
    assert c2["slow"]["verdict"] == "holds" and c2["slow"]["effect"] == pytest.approx(0.1)
    assert c2["fast"]["verdict"] == "refuted" and c2["fast"]["n"] == 6  # not pooled with slow
    c4 = {r["variant"]: r["figure"] for r in table.rows if r["claim"] == "C4"}
    assert c4 == {"fast": dynamics[0], "slow": dynamics[1]}


def test_a_grid_of_many_seeds_holds_out_half_of_them(monkeypatch):
    runs = [cell([0.4, 0.6, 0.58, 0.52, 0.45], seed=s, name=f"cliff-s{s}") for s in range(6)]
    monkeypatch.setattr(detection, "trained_runs", lambda res: runs)
    summary, events = evidence.detector_evaluation(None)
    (cliff,) = [r for r in summary.rows if r["detector"] == "terminal_cliff"]
    assert (cliff["tuned_on_seeds"], cliff["reported_on_seeds"]) == ("0, 1, 2", "3, 4, 5")
    assert (cliff["labelled_tuning"], cliff["labelled"], cliff["tp"]) == (3, 3, 3)
    assert {r["seed"] for r in events.rows if r["set"] == "reported"} == {3, 4, 5}
