"""Failure detectors on a run's records (SPEC §5), as pure functions returning a verdict with its
evidence. The trainer runs them after every validation (:func:`run_detectors`), ``marlow
inspect`` and reports run them on finished runs.

* ``terminal_cliff``: validation accuracy falls at least ``drop`` below its running peak and
  stays there for the last ``patience`` validations (all of them, up to the last one logged).
  It fires at the first validation of that final run below the line.
* ``gradient_amplification`` (an IP mechanism; computed from per-role metrics, which SP logs
  too): a role with several slots has a peak-over-first ratio of ``chi2_update`` or
  ``perplexity`` of at least ``rise``, every single-slot role stays under ``flat`` on both, and
  the multi-slot role's peak comes no later than the first validation that is ``drop`` below
  the peak accuracy. Ratios are ``runstats``' (baseline: the first positive value once
  the learning-rate warmup is over, so the schedule alone cannot fire it).
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

from marlow.diagnostics.runstats import run_statistics, series

if TYPE_CHECKING:
    from marlow.config import DetectConfig

Signatures = Mapping[int, Mapping[str, Mapping[str, float]]]  # step -> role -> name -> value


@dataclass(frozen=True)
class Verdict:
    name: str
    fired: bool
    step: int | None = None  # where it fired
    evidence: dict = field(default_factory=dict)


def _first_drop(val: list[tuple[int, float]], drop: float) -> tuple[int, float, int] | None:
    """(peak step, peak, step of the first validation at least ``drop`` under the running peak)."""
    peak_step, peak = val[0]
    for step, acc in val[1:]:
        if acc > peak:
            peak_step, peak = step, acc
        elif acc <= peak - drop:
            return peak_step, peak, step
    return None


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
) -> Verdict:
    """``slots``: each role's slot count in the workflow (Voting: generator 3, aggregator 1)."""
    roles = run_statistics(records)["roles"]
    ratios = {
        role: {
            m: roles.get(role, {}).get(m, {}).get("peak_over_first")
            for m in ("chi2_update", "perplexity")
        }
        for role in slots
    }
    singles = [r for r, n in slots.items() if n == 1]
    flat_ok = all((v or 0.0) < flat for r in singles for v in ratios[r].values())
    val = series(records, "val/all/accuracy")
    cliff = _first_drop(val, drop) if val else None
    evidence: dict = {"ratios": ratios, "slots": dict(slots), "validation_drop": cliff}
    for role, n in slots.items():
        if n < 2:
            continue
        for metric, ratio in ratios[role].items():
            if ratio is None or ratio < rise or not flat_ok or cliff is None:
                continue
            peak_step = roles[role][metric]["peak_step"]
            if peak_step <= cliff[2]:
                evidence.update(role=role, metric=metric, peak_step=peak_step)
                return Verdict("gradient_amplification", True, peak_step, evidence)
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


CAPTURE_RATES = {"evaluator": ("class_python_code_fence", +1), "aggregator": ("terse_rate", -1)}
"""The rate whose move (up +1, down -1) shows a captured role taking the dominant role's shape."""


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
    key, sign = CAPTURE_RATES.get(role, ("", 0))
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
        gradient_amplification(records, dict(slots), cfg.amp_rise, cfg.amp_flat, cfg.cliff_drop),
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
        ratio = e["ratios"][e["role"]][e["metric"]]
        return (
            f"{e['role']} ({e['slots'][e['role']]} slots) {e['metric']} rose {ratio:.2f}x by step "
            f"{e['peak_step']} while single-slot roles stayed flat, before validation fell at "
            f"step {e['validation_drop'][2]}"
        )
    if v.name == "sp_role_capture":
        return (
            f"{e['dominant']} holds {e['shares'][-1][1]:.2f} of the shared gradient and "
            f"{e['captured']}'s {e['signature']} moved {e['first']:.3g} -> {e['now']:.3g}"
        )
    return v.name
