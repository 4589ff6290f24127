"""Run-level statistics on synthetic metric series, with values worked by hand."""

from __future__ import annotations

import pytest

from marlow.diagnostics.runstats import run_statistics

# Voting-IP-like run: two roles, chi2 of the generator climbs to 8x its first value at step 3.
RECORDS = [
    {"step": 0, "val/all/accuracy": 0.50},
    {
        "step": 1,
        "train/generator/chi2_update": 0.01,
        "train/aggregator/chi2_update": 0.02,
        "train/generator/perplexity": 1.2,
        "train/aggregator/perplexity": 1.1,
        "train/generator/grad_norm": 0.5,
        "train/generator/grad_norm_max": 0.6,
        "train/aggregator/grad_norm": 0.2,
        "train/aggregator/grad_norm_max": 0.2,
        "train/all/entropy": 0.30,
        "train/generator/entropy": 0.35,
        "train/aggregator/entropy": 0.1,
    },
    {
        "step": 2,
        "train/generator/chi2_update": 0.04,
        "train/aggregator/chi2_update": 0.02,
        "train/generator/perplexity": 1.5,
        "train/aggregator/perplexity": 1.1,
        "train/generator/grad_norm": 1.5,
        "train/generator/grad_norm_max": 2.5,
        "train/aggregator/grad_norm": 0.2,
        "train/aggregator/grad_norm_max": 0.3,
        "train/all/entropy": 0.10,
        "train/generator/entropy": 0.05,
        "train/aggregator/entropy": 0.1,
        "val/all/accuracy": 0.62,
    },
    {
        "step": 3,
        "train/generator/chi2_update": 0.08,
        "train/aggregator/chi2_update": 0.01,
        "train/generator/perplexity": 1.8,
        "train/aggregator/perplexity": 1.0,
        "train/generator/grad_norm": 1.0,
        "train/generator/grad_norm_max": 1.1,
        "train/aggregator/grad_norm": 0.1,
        "train/aggregator/grad_norm_max": 0.1,
        "train/all/entropy": 0.20,
        "train/generator/entropy": 0.25,
        "train/aggregator/entropy": 0.1,
    },
    {"step": 4, "val/all/accuracy": 0.62},
    {"step": 5, "val/all/accuracy": 0.41},
]


def test_validation_peak_final_and_terminal_drop():
    val = run_statistics(RECORDS)["val"]
    assert val["peak_accuracy"] == 0.62 and val["peak_step"] == 2  # the tie goes to step 2
    assert val["final_accuracy"] == 0.41 and val["final_step"] == 5
    assert val["terminal_drop"] == pytest.approx(0.21)


def test_peak_over_first_ratios_per_role():
    roles = run_statistics(RECORDS)["roles"]
    gen, agg = roles["generator"], roles["aggregator"]
    assert gen["chi2_update"]["peak_over_first"] == pytest.approx(8.0)  # 0.08 / 0.01
    assert gen["chi2_update"]["peak_step"] == 3
    assert agg["chi2_update"]["peak_over_first"] == pytest.approx(1.0)  # peak is the first value
    assert agg["chi2_update"]["peak_step"] == 1
    assert gen["perplexity"]["peak_over_first"] == pytest.approx(1.5)  # 1.8 / 1.2
    assert gen["grad_norm"]["peak_over_first"] == pytest.approx(3.0)  # 1.5 / 0.5
    assert gen["entropy_collapse_depth"] == pytest.approx(0.30)  # 0.35 - 0.05
    assert agg["entropy_collapse_depth"] == 0.0


def test_run_maxima_and_entropy_collapse():
    stats = run_statistics(RECORDS)
    assert stats["max_chi2"] == pytest.approx(0.08)
    assert stats["max_grad_norm"] == pytest.approx(2.5)  # the largest per-update norm
    assert stats["entropy_collapse_depth"] == pytest.approx(0.20)  # 0.30 - 0.10


def test_sp_roles_use_their_own_gradient_and_ratios_start_at_the_first_positive_value():
    records = [
        {
            "step": 1,
            "train/generator/chi2_update": 0.0,
            "train/generator/grad_norm_own": 0.4,
            "train/shared/grad_norm": 0.9,
        },
        {
            "step": 2,
            "train/generator/chi2_update": 0.05,
            "train/generator/grad_norm_own": 1.2,
            "train/shared/grad_norm": 1.0,
        },
    ]
    gen = run_statistics(records)["roles"]["generator"]
    assert gen["chi2_update"]["peak_over_first"] == 1.0  # 0.05 / 0.05: step 1 moved nothing
    assert gen["chi2_update"]["first_step"] == 2
    flat = run_statistics([{"step": 1, "train/x/chi2_update": 0.0}])["roles"]["x"]
    assert flat["chi2_update"]["peak_over_first"] is None
    assert gen["grad_norm"]["peak_over_first"] == pytest.approx(3.0)  # own gradient: 1.2 / 0.4
    assert run_statistics(records)["max_grad_norm"] == pytest.approx(1.0)  # the adapter's norm


def test_ratio_baseline_is_taken_once_the_learning_rate_warmup_is_over():
    # lr 0, 0.5, 1.0 (warmup ends at step 3), then 0.8: the baseline is step 3's chi2 (0.04), not
    # step 2's (0.01), and the peak is looked for from step 3 on: 0.06 at step 4 -> 1.5.
    records = [
        {"step": s, "train/g/lr": lr, "train/g/chi2_update": c}
        for s, lr, c in ((1, 0.0, 0.0), (2, 0.5, 0.01), (3, 1.0, 0.04), (4, 0.8, 0.06))
    ]
    stats = run_statistics(records)
    assert stats["warmup_end_step"] == 3
    chi2 = stats["roles"]["g"]["chi2_update"]
    assert (chi2["first_step"], chi2["peak_step"]) == (3, 4)
    assert chi2["peak_over_first"] == pytest.approx(1.5)
    no_lr = run_statistics([{k: v for k, v in r.items() if k != "train/g/lr"} for r in records])
    assert no_lr["warmup_end_step"] is None
    assert no_lr["roles"]["g"]["chi2_update"]["peak_over_first"] == pytest.approx(6.0)
