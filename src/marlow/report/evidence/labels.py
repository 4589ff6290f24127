"""Labels: each trained cell of a grid judged, after the fact, by rules that read only its
finished series (marlow's rules, from the study's definitions; each threshold a constant here).

* ``terminal_cliff``: the last validation is at least :data:`CLIFF_DROP` under the run's peak,
  and the peak is not the last validation. The drop *began* at the first validation after the
  peak that is at least half of that under the peak.
* ``gradient_amplification``: a role with two or more slots has a gradient-norm peak over its
  first value (from the warmup's end; ``runstats``: ``grad_norm_own`` under SP, the adapter's
  norm under IP) of at least :data:`AMP_RATIO`, and at least :data:`AMP_OVER` times every
  single-slot role's. It began at the first step that role's norm reached ``AMP_RATIO`` times its
  first value.
* ``sp_role_capture`` (SP cells): over the last quarter of the training steps one role holds a
  mean ``grad_mass_share`` of at least :data:`CAPTURE_SHARE`, and another role's mean response
  length moved toward the dominant role's: the relative gap between the two closed by at least
  :data:`CAPTURE_CLOSE` from the first quarter to the last (a first gap under 10 % of the
  dominant role's length does not count). It began at the first step of the last quarter.

The online detectors (``marlow.diagnostics.detectors``) have thresholds of their own; why they
differ from these: the comment above :data:`CLIFF_DROP`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from marlow.diagnostics.runstats import after_warmup, series, warmup_end
from marlow.report.results import CellRun, GridRuns

# Why these label thresholds are not the online detectors' (``detect.cliff_drop`` 0.05 against
# CLIFF_DROP 0.10; ``detect.amp_rise`` on a running median of chi2 and perplexity against
# AMP_RATIO on the gradient norm's peak): a label is the ground truth, decided after the run on
# its whole finished series, so it asks for a larger effect that lasted (a drop still there at the
# end, the peak over the whole run); a detector must fire while the run goes, on the series so
# far, so it watches earlier and smaller signs. The report measures how well those early signs
# predict the late truth (precision, recall, lead); that measurement means something only while
# the two are defined apart. Equal thresholds would make it circular.
CLIFF_DROP = 0.10
AMP_RATIO = 3.0
AMP_OVER = 2.0
CAPTURE_SHARE = 0.6
CAPTURE_CLOSE = 0.5


@dataclass(frozen=True)
class Label:
    """A rule's judgement of one run: positive or not, when the event began, and the figures
    it read."""

    positive: bool
    began: int | None = None  # the step the labelled event began
    evidence: dict = field(default_factory=dict)


def trained_runs(res: GridRuns) -> list[CellRun]:
    """The grid's trained cells that logged records (the ones labels and claims read)."""
    return [r for r in res.runs.values() if r.id.kind == "trained" and r.records]


def label_cliff(run: CellRun) -> Label:
    val = series(run.records, "val/all/accuracy")
    if len(val) < 2:
        return Label(False)
    peak_step, peak = max(val, key=lambda sv: (sv[1], -sv[0]))
    last_step, last = val[-1]
    if peak_step == last_step or last > peak - CLIFF_DROP:
        return Label(False, evidence={"peak": peak, "final": last})
    began = next(s for s, a in val if s > peak_step and a <= peak - CLIFF_DROP / 2)
    return Label(True, began, {"peak": peak, "peak_step": peak_step, "final": last})


def _norm_key(run: CellRun, role: str) -> str:
    """The metric of ``role``'s gradient norm: its own (``grad_norm_own``) under a shared
    adapter, else its adapter's (``grad_norm``; under IP the adapter is named after the role)."""
    own = f"train/{role}/grad_norm_own"
    return own if any(own in r for r in run.records) else f"train/{role}/grad_norm"


def grad_norm_ratios(run: CellRun) -> dict[str, float]:
    """Each role's gradient-norm peak over first (``runstats``: from the warmup's end; the
    role's own norm ``grad_norm_own`` under SP, its adapter's under IP), where it has one."""
    ratios: dict[str, float] = {}
    for role, stats in run.stats.get("roles", {}).items():
        ratio = stats.get("grad_norm", {}).get("peak_over_first")
        if ratio is not None:
            ratios[role] = ratio
    return ratios


def label_amplification(run: CellRun) -> Label:
    start = warmup_end(run.records)
    ratios = {r: v for r, v in grad_norm_ratios(run).items() if r in run.slots}
    singles = [ratios[r] for r, n in run.slots.items() if n == 1 and r in ratios]
    for role, n in run.slots.items():
        ratio = ratios.get(role)
        if n < 2 or ratio is None or ratio < AMP_RATIO:
            continue
        if all(ratio >= AMP_OVER * s for s in singles):
            points = after_warmup(series(run.records, _norm_key(run, role)), start)
            first = next(v for _, v in points if v > 0)
            began = next(s for s, v in points if v >= AMP_RATIO * first)
            return Label(True, began, {"role": role, "ratio": ratio, "single_slot": singles})
    return Label(False, evidence={"ratios": ratios})


def label_capture(run: CellRun) -> Label:
    if run.id.policy != "sp":
        return Label(False)
    roles = sorted(run.slots)
    steps = sorted({int(r["step"]) for r in run.records if "train/all/reward" in r})
    if len(steps) < 4 or len(roles) < 2:
        return Label(False)
    q = len(steps) // 4
    head, tail = set(steps[:q]), set(steps[-q:])

    def mean(role: str, metric: str, part: set[int]) -> float | None:
        vals = [v for s, v in series(run.records, f"train/{role}/{metric}") if s in part]
        return statistics.fmean(vals) if vals else None

    for dominant in roles:
        share = mean(dominant, "grad_mass_share", tail)
        if share is None or share < CAPTURE_SHARE:
            continue
        d0, d1 = mean(dominant, "length_mean", head), mean(dominant, "length_mean", tail)
        for role in roles:
            a0, a1 = mean(role, "length_mean", head), mean(role, "length_mean", tail)
            if role == dominant or None in (d0, d1, a0, a1) or not d0 or not d1:
                continue
            gap0, gap1 = abs(a0 - d0) / d0, abs(a1 - d1) / d1
            if gap0 >= 0.1 and (gap0 - gap1) / gap0 >= CAPTURE_CLOSE:
                evidence = {
                    "dominant": dominant,
                    "share": share,
                    "captured": role,
                    "gap_first": gap0,
                    "gap_last": gap1,
                }
                return Label(True, min(tail), evidence)
    return Label(False)


LABELS = {
    "terminal_cliff": label_cliff,
    "gradient_amplification": label_amplification,
    "sp_role_capture": label_capture,
}
