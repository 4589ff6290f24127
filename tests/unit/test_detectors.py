"""Detectors on synthetic metric series: ones that must fire and ones that must not."""

from __future__ import annotations

import math

import pytest

from marlow.config import DetectConfig
from marlow.diagnostics.detectors import (
    describe,
    gradient_amplification,
    run_detectors,
    sp_role_capture,
    terminal_cliff,
)


def val(*points):
    return [{"step": s, "val/all/accuracy": a} for s, a in points]


def test_terminal_cliff_fires_when_accuracy_stays_below_the_peak():
    v = terminal_cliff(val((0, 0.50), (10, 0.62), (20, 0.60), (30, 0.55), (40, 0.54)), drop=0.05)
    assert v.fired and v.step == 30
    assert v.evidence["peak"] == 0.62 and v.evidence["peak_step"] == 10
    assert v.evidence["below"] == [(30, 0.55), (40, 0.54)]


def test_terminal_cliff_does_not_fire_on_a_recovery_a_single_dip_or_a_rising_run():
    recovered = val((0, 0.50), (10, 0.62), (20, 0.50), (30, 0.61))
    single = val((0, 0.50), (10, 0.62), (20, 0.61), (30, 0.55))
    rising = val((0, 0.50), (10, 0.55), (20, 0.58), (30, 0.60))
    for records in (recovered, single, rising):
        assert not terminal_cliff(records, drop=0.05, patience=2).fired
    assert terminal_cliff(single, drop=0.05, patience=1).fired


def amplification_run(gen_chi2, agg_chi2, accs):
    records = []
    for step, (g, a) in enumerate(zip(gen_chi2, agg_chi2, strict=True), start=1):
        records.append(
            {
                "step": step,
                "train/generator/chi2_update": g,
                "train/aggregator/chi2_update": a,
                "train/generator/perplexity": 1.1,
                "train/aggregator/perplexity": 1.1,
            }
        )
    records += [{"step": s, "val/all/accuracy": acc} for s, acc in accs]
    return records


SLOTS = {"generator": 3, "aggregator": 1}


def test_gradient_amplification_fires_at_the_multi_slot_roles_onset():
    records = amplification_run(
        [0.01, 0.03, 0.08, 0.05], [0.01, 0.012, 0.011, 0.01], [(0, 0.5), (2, 0.6), (4, 0.5)]
    )
    v = gradient_amplification(records, SLOTS, window=1)
    # the generator reaches 3x its first value at step 2; validation then falls to 0.5 at step 4
    assert v.fired and v.step == 2 and v.evidence["role"] == "generator"
    assert v.evidence["onset_ratio"] == pytest.approx(3.0)
    assert v.evidence["ratios"]["generator"]["chi2_update"] == pytest.approx(8.0)
    assert v.evidence["validation_drop"] == (4, 0.5) and v.evidence["best_before"] == 0.6
    assert v.evidence["single_slot_max"]["aggregator"] == pytest.approx(1.2)
    assert "rose 3.00x by step 2" in describe(v) and "fell to 0.500 at step 4" in describe(v)


def test_gradient_amplification_stays_quiet_without_a_later_drop_or_when_single_slot_roles_move():
    no_drop = amplification_run(
        [0.01, 0.03, 0.08, 0.05], [0.01, 0.01, 0.01, 0.01], [(0, 0.5), (2, 0.6), (4, 0.61)]
    )
    both_rise = amplification_run(
        [0.01, 0.03, 0.08, 0.05], [0.01, 0.03, 0.05, 0.01], [(0, 0.5), (2, 0.6), (4, 0.5)]
    )
    fell_before_the_rise = amplification_run(
        [0.01, 0.02, 0.02, 0.09], [0.01, 0.01, 0.01, 0.01], [(0, 0.5), (1, 0.6), (2, 0.5)]
    )
    for records in (no_drop, both_rise, fell_before_the_rise):
        assert not gradient_amplification(records, SLOTS, window=1).fired
    assert gradient_amplification(no_drop, SLOTS, window=1).evidence["ratios"]["generator"][
        "chi2_update"
    ] == pytest.approx(8.0)


def test_gradient_amplification_smooths_out_a_single_spike_but_not_a_sustained_rise():
    accs = [(0, 0.5), (4, 0.6), (8, 0.5)]
    flat_agg = [0.01] * 7
    spike = amplification_run([0.01, -0.002, 0.01, 0.5, 0.01, 0.012, 0.01], flat_agg, accs)
    assert gradient_amplification(spike, SLOTS, window=1).fired  # the raw series fires
    quiet = gradient_amplification(spike, SLOTS)  # the running median of 3 does not
    assert not quiet.fired
    assert quiet.evidence["ratios"]["generator"]["chi2_update"] == pytest.approx(1.2)
    # medians at steps 3..7: 0.01, 0.01, 0.05, 0.06, 0.08 -> 5x at step 5; the aggregator
    # jumps only after the onset (its inputs went bad), which does not hold the alarm back
    rising = amplification_run(
        [0.01, 0.01, 0.01, 0.05, 0.06, 0.08, 0.08], [0.01] * 5 + [5.0, 5.0], accs
    )
    v = gradient_amplification(rising, SLOTS)
    assert v.fired and v.step == 5 and v.evidence["onset_ratio"] == pytest.approx(5.0)
    assert v.evidence["ratios"]["aggregator"]["chi2_update"] == pytest.approx(500.0)
    assert gradient_amplification(rising, SLOTS, window=5).evidence["ratios"]["generator"][
        "chi2_update"
    ] == pytest.approx(6.0)  # medians 0.01 (step 5), 0.05, 0.06


def shares(*gen_shares):
    """SP records, steps 1..k: the generator's share of the shared gradient, the aggregator the rest."""
    return [
        {
            "step": step,
            "train/generator/grad_mass_share": g,
            "train/aggregator/grad_mass_share": 1.0 - g,
        }
        for step, g in enumerate(gen_shares, start=1)
    ]


def sigs(agg_terse, agg_len=8.0, gen_len=60.0):
    return {
        "generator": {"length_mean": gen_len},
        "aggregator": {"length_mean": agg_len, "terse_rate": agg_terse},
    }


def test_sp_role_capture_fires_when_the_dominated_aggregator_stops_being_terse():
    records = shares(0.6, 0.75, 0.8, 0.82)
    v = sp_role_capture(records, {0: sigs(0.9), 2: sigs(0.85), 4: sigs(0.6)}, share=0.7)
    # step 2: the share held 0.7 on one step only (patience 2); step 4: 0.8, 0.82 and 0.9 -> 0.6
    assert v.fired and v.step == 4
    e = v.evidence
    assert (e["dominant"], e["captured"], e["signature"]) == (
        "generator",
        "aggregator",
        "terse_rate",
    )
    assert e["shares"] == [(3, 0.8), (4, 0.82)]
    assert (e["first"], e["now"]) == (0.9, 0.6)
    assert "aggregator's terse_rate moved 0.9 -> 0.6" in describe(v)


def test_sp_role_capture_fires_when_the_length_gap_closes():
    records = shares(0.9, 0.9)
    # gap at the start |8 - 60| / 60 = 0.867; later |40 - 64| / 64 = 0.375: closed 0.567 >= 0.5
    v = sp_role_capture(records, {0: sigs(0.9), 2: sigs(0.9, agg_len=40.0, gen_len=64.0)})
    assert v.fired and v.evidence["signature"] == "length_mean"
    assert v.evidence["gap_closed"] == pytest.approx((52 / 60 - 24 / 64) / (52 / 60), rel=1e-12)


def test_sp_role_capture_stays_quiet_without_dominance_without_drift_or_without_sharing():
    drift = {0: sigs(0.9), 2: sigs(0.5)}
    assert not sp_role_capture(shares(0.6, 0.65), drift).fired  # nobody holds 0.7
    assert not sp_role_capture(shares(0.9, 0.9), {0: sigs(0.9), 2: sigs(0.75)}).fired  # 0.15 < 0.2
    # the length gap closed by 0.3 of itself only: (0.867 - 0.607) / 0.867
    assert not sp_role_capture(shares(0.9, 0.9), {0: sigs(0.9), 2: sigs(0.9, 8.0 + 15.6)}).fired
    ip = [{"step": 1, "train/generator/chi2_update": 0.1}]
    assert not sp_role_capture(ip, drift).fired  # IP: no shared adapter, no shares


def test_run_detectors_runs_all_three_with_the_config_thresholds():
    records = shares(0.9, 0.9) + val((0, 0.5), (1, 0.4), (2, 0.39))
    cfg = DetectConfig(cliff_drop=0.05, cliff_patience=2)
    verdicts = run_detectors(records, {0: sigs(0.9), 2: sigs(0.5)}, SLOTS, cfg)
    assert [v.name for v in verdicts] == [
        "terminal_cliff",
        "gradient_amplification",
        "sp_role_capture",
    ]
    assert [v.fired for v in verdicts] == [True, False, True]
    strict = DetectConfig(cliff_patience=3, capture_shift=0.5)
    assert not any(
        v.fired for v in run_detectors(records, {0: sigs(0.9), 2: sigs(0.5)}, SLOTS, strict)
    )


def scheduled_run(gen_after_warmup, warmup=15, steps=20, lr=1e-3):
    """An IP Voting run on one fixed batch under a linear warmup from 0 then a cosine decay. To
    first order an update's size is proportional to the learning rate and chi2_update to its
    square, so the generator's chi2 is k * lr(t)^2 times ``gen_after_warmup(t)`` (1: no dynamics
    of its own). The aggregator's turns carry no advantage: its chi2 stays at a noise floor.
    Validation falls a little at the end, so only the ratios decide."""
    records = []
    for t in range(1, steps + 1):
        if t <= warmup + 1:
            rate = lr * (t - 1) / warmup  # 0 at step 1, the peak at step warmup + 1
        else:
            rate = lr * 0.5 * (1 + math.cos(math.pi * (t - warmup - 1) / (steps - warmup)))
        records.append(
            {
                "step": t,
                "train/generator/lr": rate,
                "train/aggregator/lr": rate,
                "train/generator/chi2_update": 1e4 * rate**2 * gen_after_warmup(t),
                "train/aggregator/chi2_update": 1e-4,
                "train/generator/perplexity": 1.1,
                "train/aggregator/perplexity": 1.1,
            }
        )
    records += [{"step": s, "val/all/accuracy": a} for s, a in ((0, 0.5), (10, 0.6), (20, 0.5))]
    return records


def test_gradient_amplification_does_not_fire_on_the_warmup_of_a_fixed_batch():
    records = scheduled_run(lambda t: 1.0)
    # Measured from the first positive value (step 2, lr = 1e-3 / 15) the warmup alone gives a
    # ratio of 15^2 = 225, which fired; from the end of the warmup (step 16) it is 1.
    first = records[1]["train/generator/chi2_update"]
    assert max(r["train/generator/chi2_update"] for r in records[:20]) / first == pytest.approx(225)
    v = gradient_amplification(records, SLOTS)
    assert not v.fired
    assert v.evidence["ratios"]["generator"]["chi2_update"] == pytest.approx(1.0)


def test_gradient_amplification_fires_on_a_rise_past_the_warmup():
    # Same schedule, but past the warmup the 3-slot generator's chi2 grows by its own dynamics
    # (factors 2, 6, 30 at steps 17-19) while the learning rate decays: (lr(t) / lr(16))^2 =
    # ((1 + cos(pi (t - 16) / 5)) / 2)^2 = 0.818, 0.428, 0.119 -> ratios 1.64, 2.57, 3.58: the
    # peak 3.58 at step 19 clears rise = 3, before validation falls at step 20.
    rise = {17: 2.0, 18: 6.0, 19: 30.0, 20: 30.0}
    records = scheduled_run(lambda t: rise.get(t, 1.0))
    v = gradient_amplification(records, SLOTS, window=1)  # the raw series: what is shown is
    # where the baseline sits
    assert v.fired and v.evidence["role"] == "generator"
    lr = {r["step"]: r["train/generator/lr"] for r in records if "train/generator/lr" in r}
    peak = max(rise[t] * (lr[t] / lr[16]) ** 2 for t in rise)
    assert v.evidence["ratios"]["generator"]["chi2_update"] == pytest.approx(peak)
    assert peak == pytest.approx(30 * ((1 + math.cos(3 * math.pi / 5)) / 2) ** 2) and v.step == 19
