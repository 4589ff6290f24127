"""Failure detectors on a run's records, as pure functions returning a verdict with its
evidence. The trainer runs them after every validation (:func:`run_detectors`), ``marlow
inspect`` and reports run them on finished runs.

* ``terminal_cliff``: validation accuracy falls at least ``drop`` below its running peak and
  stays there for the last ``patience`` validations (all of them, up to the last one logged).
  It fires at the first validation of that final run below the line.
* ``gradient_amplification`` (an IP mechanism; computed from per-role metrics, which SP logs
  too): a role with several slots has a ``chi2_update`` or ``perplexity`` curve (running median
  of ``window`` values over its first one, from the end of the learning-rate warmup, so the
  schedule alone cannot fire it) that reaches ``rise`` at some step, the onset; every single-slot
  role's curves stayed under ``flat`` up to the onset; and a validation after the onset is at
  least ``drop`` under the best validation up to it. It fires at the onset.
* ``sp_role_capture`` (SP): at a signature step s, one role's ``grad_mass_share`` has been at
  least ``share`` on each of the last ``patience`` training steps up to s (the dominant role),
  and another role of the same adapter (the captured one) has moved toward the dominant role's
  shape since the first signatures: its evaluator code-fence rate rose by ``shift`` (absolute),
  its aggregator terse rate fell by ``shift``, or the gap between its mean length and the
  dominant role's closed by the fraction ``close`` (a gap under 10% of the dominant length at the
  start is not counted). It fires at the first such signature step.

Thresholds are marlow's defaults, not the paper's (it gives none); each is a config field
(``detect.*``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from marlow.diagnostics.runstats import rise_curve, series, warmup_end

if TYPE_CHECKING:
    from marlow.config import DetectConfig

Signatures = Mapping[int, Mapping[str, Mapping[str, float]]]  # step -> role -> name -> value


@dataclass(frozen=True)
class Verdict:
    name: str
    fired: bool
    step: int | None = None  # where it fired
    evidence: dict = field(default_factory=dict)


def terminal_cliff(records: Sequence[dict], drop: float = 0.05, patience: int = 2) -> Verdict:
    val = series(records, "val/all/accuracy")
    if len(val) < patience + 1:
        return Verdict("terminal_cliff", False, evidence={"validations": len(val)})
    peak_step, peak = max(val, key=lambda sv: (sv[1], -sv[0]))
    line = peak - drop
    tail: list[tuple[int, float]] = []
    for step, acc in reversed(val):
        if step <= peak_step or acc > line:
            break
        tail.append((step, acc))
    tail.reverse()
    evidence = {
        "metric": "val/all/accuracy",
        "peak": peak,
        "peak_step": peak_step,
        "threshold": line,
        "below": tail,
    }
    fired = len(tail) >= patience
    return Verdict("terminal_cliff", fired, tail[0][0] if fired else None, evidence)


def gradient_amplification(
    records: Sequence[dict],
    slots: dict[str, int],
    rise: float = 3.0,
    flat: float = 1.5,
    drop: float = 0.05,
    window: int = 3,
) -> Verdict:
    """``slots``: each role's slot count in the workflow (Voting: generator 3, aggregator 1).

    Each role's ``chi2_update`` and ``perplexity`` curve is ``runstats.rise_curve``: from the
    warmup's end, the running median of ``window`` logged values over its first value. The
    detector fires at the onset, the first step at which a multi-slot role's curve reaches
    ``rise``, when every single-slot role's curves stayed under ``flat`` up to that step and a
    later validation is at least ``drop`` under the best one up to it. Why the onset and not the
    peak: on the tiny world a raised rate drove the 3-slot generator's chi2 up 100-fold over
    eight steps while validation was already falling, and the aggregator's chi2 jumped only once
    its inputs (the generators' answers) had gone bad: "rising while single-slot
    roles stay flat, before a validation drop" is read as the rise coming first.
    """
    start = warmup_end(records)
    curves = {
        role: {
            m: rise_curve(series(records, f"train/{role}/{m}"), start, window)
            for m in ("chi2_update", "perplexity")
        }
        for role in slots
    }
    ratios = {
        role: {m: max((r for _, r in c), default=None) for m, c in by.items()}
        for role, by in curves.items()
    }
    singles = [r for r, n in slots.items() if n == 1]
    val = series(records, "val/all/accuracy")
    evidence: dict = {"ratios": ratios, "slots": dict(slots), "window": window}
    for role, n in slots.items():
        if n < 2:
            continue
        for metric, curve in curves[role].items():
            onset = next(((step, r) for step, r in curve if r >= rise), None)
            if onset is None:
                continue
            step = onset[0]
            upto = {
                r: max((x for c in curves[r].values() for s, x in c if s <= step), default=0.0)
                for r in singles
            }
            before = [acc for s, acc in val if s <= step]
            fallen = [
                (s, acc) for s, acc in val if s > step and before and acc <= max(before) - drop
            ]
            if all(x < flat for x in upto.values()) and fallen:
                evidence.update(
                    role=role,
                    metric=metric,
                    onset=step,
                    onset_ratio=onset[1],
                    single_slot_max=upto,
                    best_before=max(before),
                    validation_drop=fallen[0],
                )
                return Verdict("gradient_amplification", True, step, evidence)
    return Verdict("gradient_amplification", False, evidence=evidence)


def _dominant(
    records: Sequence[dict], roles: Sequence[str], upto: int, share: float, patience: int
):
    """(role, its last ``patience`` shares) when one role held ``share`` on each of them."""
    for role in roles:
        tail = [(st, v) for st, v in series(records, f"train/{role}/grad_mass_share") if st <= upto]
        tail = tail[-patience:]
        if len(tail) == patience and all(v >= share for _, v in tail):
            return role, tail
    return None


CAPTURE_RATES = (("class_python_code_fence", +1), ("terse_rate", -1))
"""The rate whose move (up +1, down -1) shows a captured role taking the dominant role's shape:
a judge's code fences, a select role's terseness. Each exists only in the signatures of its kind,
so a role's own is the one it has."""


def _moves_toward(
    first: Mapping[str, Mapping[str, float]],
    now: Mapping[str, Mapping[str, float]],
    role: str,
    dominant: str,
    shift: float,
    close: float,
) -> dict | None:
    """How ``role``'s signature moved toward ``dominant``'s shape, or None."""
    a, b = first.get(role, {}), now.get(role, {})
    key, sign = next(((k, sg) for k, sg in CAPTURE_RATES if k in a), ("", 0))
    if key in a and key in b and sign * (b[key] - a[key]) >= shift:
        return {"signature": key, "first": a[key], "now": b[key]}
    d0, d1 = first.get(dominant, {}).get("length_mean"), now.get(dominant, {}).get("length_mean")
    if not (d0 and d1 and "length_mean" in a and "length_mean" in b):
        return None
    gap0, gap1 = abs(a["length_mean"] - d0) / d0, abs(b["length_mean"] - d1) / d1
    if gap0 < 0.1 or (gap0 - gap1) / gap0 < close:
        return None
    return {
        "signature": "length_mean",
        "first": a["length_mean"],
        "now": b["length_mean"],
        "dominant_first": d0,
        "dominant_now": d1,
        "gap_closed": (gap0 - gap1) / gap0,
    }


def sp_role_capture(
    records: Sequence[dict],
    signatures: Signatures,
    share: float = 0.7,
    patience: int = 2,
    shift: float = 0.2,
    close: float = 0.5,
) -> Verdict:
    roles = sorted({k.split("/")[1] for r in records for k in r if k.endswith("/grad_mass_share")})
    steps = sorted(signatures)
    evidence: dict = {"roles_sharing": roles, "signature_steps": steps}
    if len(roles) < 2 or len(steps) < 2:
        return Verdict("sp_role_capture", False, evidence=evidence)
    first = signatures[steps[0]]
    for step in steps[1:]:
        found = _dominant(records, roles, step, share, patience)
        if found is None:
            continue
        dominant, tail = found
        for role in roles:
            if role == dominant:
                continue
            moved = _moves_toward(first, signatures[step], role, dominant, shift, close)
            if moved is not None:
                evidence.update(
                    dominant=dominant,
                    shares=tail,
                    captured=role,
                    first_step=steps[0],
                    **moved,
                )
                return Verdict("sp_role_capture", True, step, evidence)
    return Verdict("sp_role_capture", False, evidence=evidence)


def run_detectors(
    records: Sequence[dict],
    signatures: Signatures,
    slots: Mapping[str, int],
    cfg: DetectConfig,
) -> list[Verdict]:
    """Every detector with the run's thresholds (``detect.*``); ``slots``: slots per role."""
    return [
        terminal_cliff(records, cfg.cliff_drop, cfg.cliff_patience),
        gradient_amplification(
            records, dict(slots), cfg.amp_rise, cfg.amp_flat, cfg.cliff_drop, cfg.amp_window
        ),
        sp_role_capture(
            records,
            signatures,
            cfg.capture_share,
            cfg.capture_patience,
            cfg.capture_shift,
            cfg.capture_close,
        ),
    ]


def describe(v: Verdict) -> str:
    """One line saying what a fired verdict saw."""
    e = v.evidence
    if v.name == "terminal_cliff":
        return (
            f"validation accuracy {e['below'][-1][1]:.3f} stays more than "
            f"{e['peak'] - e['threshold']:.3g} below its peak {e['peak']:.3f} (step {e['peak_step']})"
        )
    if v.name == "gradient_amplification":
        step, acc = e["validation_drop"]
        return (
            f"{e['role']} ({e['slots'][e['role']]} slots) {e['metric']} rose "
            f"{e['onset_ratio']:.2f}x by step {e['onset']} (running median of {e['window']}) "
            f"while single-slot roles stayed flat; validation then fell to {acc:.3f} at step "
            f"{step} (best before: {e['best_before']:.3f})"
        )
    if v.name == "sp_role_capture":
        return (
            f"{e['dominant']} holds {e['shares'][-1][1]:.2f} of the shared gradient and "
            f"{e['captured']}'s {e['signature']} moved {e['first']:.3g} -> {e['now']:.3g}"
        )
    return v.name
