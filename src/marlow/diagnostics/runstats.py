"""Run-level statistics of one run, from its ``metrics.jsonl`` records.

* validation: peak accuracy and its step (ties go to the earliest step), final accuracy and its
  step, terminal drop = peak - final;
* per role, for ``chi2_update``, ``perplexity`` and ``grad_norm``: the first logged value, the
  peak, peak-over-first ratio and the step of the peak. ``grad_norm`` is logged per adapter
  (``train/<adapter>/grad_norm``); under SP each role's own gradient is ``grad_norm_own``, which
  is used for the role when present;
* max chi2 (the largest per-role ``chi2_update`` of the run), max grad norm (the largest
  ``grad_norm_max`` of any adapter, else its ``grad_norm``: an adapter's norm, as in the paper's
  Fig. 5), entropy collapse depth (first minus minimum of ``train/all/entropy``, and per role).

Choices of marlow: "chi2" in run-level statistics means ``chi2_update`` (new vs old policy over a
step's updates, the training-side amplitude). The "first" value of a ratio (its baseline) is the
first *positive* logged value at or after the **end of the learning-rate warmup**, and the peak is
taken from that step on. Why: on a fixed batch an update's size grows with the learning rate, and
``chi2_update`` with its square, so during the warmup (which starts at learning rate 0, as in verl
and Hugging Face) the peak-over-first ratio measured the schedule, not the dynamics (8.3 with 15
warmup steps, 2.8 with 3, on one fixed batch). The warmup's end is read from the
run's own records: the first step at which the largest logged adapter learning rate
(``train/<adapter>/lr``) reaches its maximum over the run (the cosine schedule only falls after
it). A run that logs no learning rate keeps the first positive value of the whole series. A
series never positive from there has no ratio (None).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

RUN_LEVEL = {
    "max_chi2": "the largest chi2_update peak of any role over the run",
    "max_grad_norm": "the largest grad_norm_max (a micro-batch's gradient norm) of any adapter "
    "at any step; an adapter's latest is in its row",
    "entropy_collapse_depth": "train/all/entropy's first value less its lowest (nats; 0 when it "
    "never fell below the first)",
    "peak/first": "a metric's peak over its first positive value after warmup: 1 is flat; a "
    "multi-slot role's grad_norm at detect.amp_rise (3) over a median of 3 fires "
    "gradient_amplification",
}
"""What ``marlow inspect`` shows of the whole run, beside the metrics of its steps."""

RATIO_METRICS = ("chi2_update", "perplexity", "grad_norm")


def series(records: Sequence[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record holding ``key``, in file order."""
    return [(int(r["step"]), float(r[key])) for r in records if key in r]


def _roles(records: Sequence[dict]) -> list[str]:
    out: list[str] = []
    for r in records:
        for key in r:
            parts = key.split("/")
            is_role = len(parts) == 3 and parts[0] == "train" and parts[2] == "chi2_update"
            if is_role and parts[1] != "all" and parts[1] not in out:
                out.append(parts[1])
    return out


def warmup_end(records: Sequence[dict]) -> int | None:
    """The first step at which the largest logged adapter learning rate is at its run maximum
    (None when no learning rate is logged)."""
    lrs: dict[int, float] = {}
    for r in records:
        values = [v for k, v in r.items() if k.startswith("train/") and k.endswith("/lr")]
        if values:
            lrs[int(r["step"])] = max(values)
    if not lrs:
        return None
    top = max(lrs.values())
    return min(step for step, lr in lrs.items() if lr >= top * (1 - 1e-9))


def after_warmup(points: list[tuple[int, float]], start: int | None) -> list[tuple[int, float]]:
    """The (step, value) points from ``start`` on (the warmup's end); all of them when ``start``
    is None or nothing is logged from there."""
    if start is not None and any(step >= start for step, _ in points):
        return [(step, v) for step, v in points if step >= start]
    return points


def _peak_over_first(
    points: list[tuple[int, float]], start: int | None = None
) -> dict[str, float | int | None]:
    points = after_warmup(points, start)
    base = next(((step, v) for step, v in points if v > 0), None)
    peak_step, peak = max(points, key=lambda sv: (sv[1], -sv[0]))
    return {
        "first": base[1] if base else None,
        "first_step": base[0] if base else None,
        "peak": peak,
        "peak_step": peak_step,
        "peak_over_first": peak / base[1] if base else None,
    }


def rise_curve(
    points: list[tuple[int, float]], start: int | None, window: int
) -> list[tuple[int, float]]:
    """(step, ratio) from ``start`` on (the warmup's end; every point when None or when nothing
    is logged from there): the running median of the last ``window`` logged values over the first
    positive such median, the baseline. A median of 3 lets no single value move the curve: the
    sampled-token ``chi2_update`` estimate (mean rho^2 - 1) is noisy and can be negative, and one
    spike fired the detector on a default-rate run. Empty when fewer than
    ``window`` values are logged or no median is positive. ``window=1`` is the raw series."""
    points = after_warmup(points, start)
    medians = [
        (points[i][0], statistics.median(v for _, v in points[i - window + 1 : i + 1]))
        for i in range(window - 1, len(points))
    ]
    base = next((m for _, m in medians if m > 0), None)
    if base is None:
        return []
    first = next(i for i, (_, m) in enumerate(medians) if m > 0)
    return [(step, m / base) for step, m in medians[first:]]


def _collapse(points: list[tuple[int, float]]) -> float | None:
    return points[0][1] - min(v for _, v in points) if points else None


def run_statistics(records: Sequence[dict]) -> dict:
    out: dict = {}
    val = series(records, "val/all/accuracy")
    if val:
        peak_step, peak = max(val, key=lambda sv: (sv[1], -sv[0]))
        final_step, final = val[-1]
        out["val"] = {
            "peak_accuracy": peak,
            "peak_step": peak_step,
            "final_accuracy": final,
            "final_step": final_step,
            "terminal_drop": peak - final,
        }
    roles: dict[str, dict] = {}
    start = warmup_end(records)
    out["warmup_end_step"] = start
    for role in _roles(records):
        stats: dict = {}
        for metric in RATIO_METRICS:
            key = f"train/{role}/{metric}"
            if metric == "grad_norm" and any(f"train/{role}/grad_norm_own" in r for r in records):
                key = f"train/{role}/grad_norm_own"
            points = series(records, key)
            if points:
                stats[metric] = _peak_over_first(points, start)
        depth = _collapse(series(records, f"train/{role}/entropy"))
        if depth is not None:
            stats["entropy_collapse_depth"] = depth
        roles[role] = stats
    out["roles"] = roles
    chi2 = [s["chi2_update"]["peak"] for s in roles.values() if "chi2_update" in s]
    out["max_chi2"] = max(chi2) if chi2 else None
    norms = [v for r in records for k, v in r.items() if k.endswith("/grad_norm_max")]
    if not norms:  # adapter norms only: a role's own norm under SP is not an adapter's
        norms = [v for r in records for k, v in r.items() if k.endswith("/grad_norm")]
    out["max_grad_norm"] = max(norms) if norms else None
    out["entropy_collapse_depth"] = _collapse(series(records, "train/all/entropy"))
    return out
