"""The study's four claims with verdicts, and the mitigations measured on the unstable cells.

**Claims** (C1-C4), each with an effect over matched cells and seeds, its 95 % t-interval
(:func:`marlow.report.significance.ci95`), the paired sign-flip test, and a verdict: *holds* (the
effect is in the claimed direction and p < :data:`ALPHA`), *refuted* (the opposite direction and
p < ALPHA), or *not shown* (neither; with few seeds the test cannot reach 0.05 at all, and
``min_p`` says so):

* C1 multi-agent RL beats the base: peak minus the base's, per trained multi-agent cell and seed;
* C2 IP peaks higher than SP: IP minus SP peak per matched (task, scale, workflow, seed);
* C3 IP shows larger per-role gradient amplitude: IP minus SP of the largest per-role
  gradient-norm peak over first;
* C4 IP cells with same-role parallel slots fall off terminal cliffs while SP redistributes
  failure: IP minus SP terminal drop (peak - final) on workflows with parallel slots; holds only
  when, besides, some SP cell is labelled ``sp_role_capture``.

**Mitigations** (:func:`mitigation_table`): a grid variant that sets ``mitigate`` is measured
against the variant with the same settings and no mitigation, on that variant's cells labelled
``terminal_cliff``: it meets the bar when it halves the terminal drop with the peak within its
95 % interval.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from marlow.report.evidence.labels import grad_norm_ratios, label_capture, label_cliff, trained_runs
from marlow.report.results import CellRun, GridRuns
from marlow.report.significance import ci95, min_p, sign_flip_p
from marlow.report.tables import Table, matched_pairs

ALPHA = 0.05
"""The significance level of the claims' verdicts."""


def _verdict(values: Sequence[float]) -> dict:
    """Mean, 95 % CI, sign-flip p and the verdict of an effect claimed to be positive."""
    if not values:
        return {
            "n": 0,
            "effect": None,
            "ci_low": None,
            "ci_high": None,
            "p_value": None,
            "min_p": None,
            "verdict": "not shown",
        }
    p = sign_flip_p(values)
    mean = statistics.fmean(values)
    band = ci95(values)
    verdict = "not shown"
    if p is not None and p < ALPHA:
        verdict = "holds" if mean > 0 else "refuted" if mean < 0 else "not shown"
    n = len(values)
    return {
        "n": n,
        "effect": mean,
        "ci_low": band[0] if band else None,
        "ci_high": band[1] if band else None,
        "p_value": p,
        "min_p": min_p(n),
        "verdict": verdict,
    }


def _amplitude(run: CellRun) -> float | None:
    ratios = grad_norm_ratios(run).values()
    return max(ratios) if ratios else None


def claims_table(res: GridRuns, delta: Table, dynamics: Sequence[str]) -> Table:
    """C1-C4 with their verdicts; a grid with variants gets them per variant (an unstable
    learning rate and its mitigation are other experiments than the preset's rate: pooling
    them would mix effects of opposite sign), its variant named in the ``variant`` column."""
    pairs = matched_pairs(res)
    variant_of = {
        r["cell"]: res.runs[r["cell"]].id.variant if res and r["cell"] in res.runs else ""
        for r in delta.rows
    }
    variants = sorted(
        {ip.id.variant for _, _, ip, _ in pairs} | set(variant_of.values()),
    )
    rows = []
    for variant in variants or [""]:
        suffix = f"-{variant}" if variant else ""
        figures = [f for f in dynamics if not variant or f.endswith(suffix)]
        rows += _claims(
            [p for p in pairs if p[2].id.variant == variant],
            [r for r in delta.rows if variant_of.get(r["cell"]) == variant],
            figures[0] if figures else "",
            variant or None,
        )
    cols = [
        "variant",
        "claim",
        "statement",
        "measure",
        "n",
        "effect",
        "ci_low",
        "ci_high",
        "p_value",
        "min_p",
        "verdict",
        "figure",
    ]
    if not any(r["variant"] for r in rows):
        cols.remove("variant")
    note = (
        "Effect: the mean over matched cells and seeds; ci: its 95 % t-interval; p: the paired "
        f"sign-flip test against 0. holds: the claimed direction with p < {ALPHA}; refuted: "
        "the opposite with p < 0.05; not shown: neither (min_p: the smallest p possible with n)."
        " A grid's variants are judged apart."
    )
    return Table("table-claims", "The study's claims at this scale", cols, rows, note)


def _claims(pairs: list, delta_rows: list[dict], figure: str, variant: str | None) -> list[dict]:
    """The four claims' rows over one variant's matched pairs and base deltas."""
    c1 = [
        r["delta_peak"]
        for r in delta_rows
        if r["delta_peak"] is not None and r["policy"] in ("ip", "sp")
    ]
    c2 = [ip.peak - sp.peak for _, _, ip, sp in pairs]
    c3 = [
        a - b
        for _, _, ip, sp in pairs
        if (a := _amplitude(ip)) is not None and (b := _amplitude(sp)) is not None
    ]
    parallel = [(ip, sp) for _, _, ip, sp in pairs if any(n > 1 for n in ip.slots.values())]
    c4 = [
        ip.stats["val"]["terminal_drop"] - sp.stats["val"]["terminal_drop"] for ip, sp in parallel
    ]
    captured = [sp.id.name for _, sp in parallel if label_capture(sp).positive]
    rows = [
        {
            "variant": variant,
            "claim": "C1",
            "statement": "multi-agent RL beats the base model",
            "measure": "peak - base, per trained multi-agent cell and seed",
            **_verdict(c1),
            "figure": "fig-delta",
        },
        {
            "variant": variant,
            "claim": "C2",
            "statement": "IP reaches higher peaks than SP",
            "measure": "IP - SP peak, per matched cell and seed",
            **_verdict(c2),
            "figure": "fig-scatter",
        },
        {
            "variant": variant,
            "claim": "C3",
            "statement": "IP shows larger per-role gradient amplitude",
            "measure": "IP - SP largest per-role grad-norm peak over first",
            **_verdict(c3),
            "figure": "fig-instability",
        },
        {
            "variant": variant,
            "claim": "C4",
            "statement": "IP with same-role parallel slots falls off terminal cliffs; "
            "SP redistributes failure (role capture)",
            "measure": "IP - SP terminal drop on workflows with parallel slots; SP cells labelled "
            f"capture: {len(captured)}",
            **_verdict(c4),
            "figure": figure,
        },
    ]
    if rows[3]["verdict"] == "holds" and not captured:
        rows[3]["verdict"] = "not shown"  # the cliffs without the capture are half the claim
    return rows


def _baseline_of(variants: dict[str, dict], name: str) -> str | None:
    """The variant a mitigation variant is measured against: the one whose settings are its own
    without ``mitigate`` (None when ``name`` sets no mitigation or no such variant exists)."""
    own = variants.get(name, {})
    if "mitigate" not in own:
        return None
    rest = {k: v for k, v in own.items() if k != "mitigate"}
    return next((v for v, s in variants.items() if v != name and s == rest), None)


def mitigation_table(res: GridRuns) -> Table:
    """Each mitigation variant against its baseline variant (the same settings without
    ``mitigate``), on the baseline's unstable cells: the trained cells whose run is labelled
    ``terminal_cliff``, each matched with the mitigated cell of the same workflow, policy, scale,
    task and seed. The criterion: the mean terminal drop (peak - final) at most half
    the baseline's, and the mean peak not lower than the baseline's by more than the half-width
    of its 95 % interval."""
    variants = (res.grid or {}).get("variants") or {}
    runs = {
        (
            r.id.variant,
            r.id.workflow,
            r.id.policy,
            r.id.grid_scale,
            r.id.task,
            r.id.seed,
        ): r
        for r in trained_runs(res)
    }
    rows = []
    for name in variants:
        base = _baseline_of(variants, name)
        if base is None:
            continue
        pairs = [
            (run, runs.get((name, *key[1:])))
            for key, run in runs.items()
            if key[0] == base and label_cliff(run).positive
        ]
        pairs = [(b, m) for b, m in pairs if m is not None]
        row = {"mitigation": name, "baseline": base, "unstable_cells": len(pairs)}
        if pairs:
            drop_b = statistics.fmean(b.stats["val"]["terminal_drop"] for b, _ in pairs)
            drop_m = statistics.fmean(m.stats["val"]["terminal_drop"] for _, m in pairs)
            peaks_b = [b.peak for b, _ in pairs]
            peak_b, peak_m = statistics.fmean(peaks_b), statistics.fmean(m.peak for _, m in pairs)
            band = ci95(peaks_b)
            half = (band[1] - band[0]) / 2 if band else None
            halved = drop_m <= drop_b / 2
            kept = half is not None and peak_m >= peak_b - half
            row.update(
                drop_baseline=drop_b,
                drop_mitigated=drop_m,
                peak_baseline=peak_b,
                peak_mitigated=peak_m,
                peak_ci_half=half,
                meets=halved and kept,
            )
        rows.append(row)
    cols = [
        "mitigation",
        "baseline",
        "unstable_cells",
        "drop_baseline",
        "drop_mitigated",
        "peak_baseline",
        "peak_mitigated",
        "peak_ci_half",
        "meets",
    ]
    note = (
        "Each mitigation variant against the variant with its settings but no mitigation, on "
        "that variant's cells labelled terminal_cliff and their mitigated twins. meets: the "
        "mean terminal drop at most half the baseline's and the mean peak within the "
        "half-width of the baseline peak's 95 % interval (needs two or more unstable cells)."
    )
    return Table("table-mitigations", "Mitigations on the unstable cells", cols, rows, note)
