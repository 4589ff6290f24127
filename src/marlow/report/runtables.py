"""The per-cell diagnostic tables: Table 2 (per-role peak-over-first ratios), the signature
tables and the detector verdicts. Same :class:`~marlow.report.tables.Table` records as the
cross-cell tables.

Choices the spec leaves open, made here:

* **Table 2** has one row per (cell, role) of every trained and SA-RL cell, SP cells included:
  marlow logs every role under SP too (the paper's Table 2 has one shared row for SP), with
  the role's own gradient norm (``grad_norm_own``) standing in for an adapter's under SP.
  Ratios are ``runstats``' (peak over the first *positive* value); None where a series never
  turned positive.
* **Signatures**: per cell, the first and the last stored signature step, one row per (role,
  step), one column per signature (the union over cells, in :data:`SIGNATURE_ORDER` then by
  name); a cell with one stored step has one row per role, ``which`` = ``only``.
* **Detectors** are shown for trained and SA-RL cells (base and transfer cells do not train).
  A fired verdict's evidence is ``detectors.describe``; a quiet one's is its scalar evidence in
  one line (nested keys joined by dots, lists longer than 4 left out, cut at 240 characters).
  ``logged`` lists the steps at which the trainer's own alarm fired (``fired_at`` of each
  ``events.jsonl`` record of that detector).
"""

from __future__ import annotations

from marlow.diagnostics.detectors import Verdict, describe
from marlow.report.results import TRAINED_KINDS, GridRuns
from marlow.report.tables import IDENT, Table, fmt, ident

SIGNATURE_ORDER = (
    "n_turns",
    "length_mean",
    "length_p50",
    "length_p95",
    "truncation_rate",
    "boxed_rate",
    "hedge_rate",
    "slot_jaccard_3gram",
    "terse_rate",
    "class_python_code_fence",
    "class_bare_stamp",
    "class_other",
    "verdict_parse_rate",
    "strategy_openers_unique",
    "strategy_diversity",
)


def table2(res: GridRuns) -> Table:
    rows = []
    for run in res.runs.values():
        if run.id.kind not in TRAINED_KINDS:
            continue
        for role, st in run.stats["roles"].items():
            ratio = {
                m: (st.get(m) or {}).get("peak_over_first")
                for m in ("chi2_update", "perplexity", "grad_norm")
            }
            rows.append(
                {
                    **ident(run.id),
                    "role": role,
                    "slots": run.slots.get(role),
                    "chi2_ratio": ratio["chi2_update"],
                    "perplexity_ratio": ratio["perplexity"],
                    "grad_norm_ratio": ratio["grad_norm"],
                    "chi2_peak_step": (st.get("chi2_update") or {}).get("peak_step"),
                }
            )
    cols = [
        *IDENT,
        "role",
        "slots",
        "chi2_ratio",
        "perplexity_ratio",
        "grad_norm_ratio",
        "chi2_peak_step",
    ]
    note = (
        "Per role: peak over first positive logged value of chi2_update, training "
        "perplexity and grad norm (the role's own under SP), and the step of the chi2 peak."
    )
    return Table("table2", "Table 2: per-role peak-over-first ratios", cols, rows, note)


def signatures_table(res: GridRuns) -> Table:
    rows, names = [], set()
    for run in res.runs.values():
        if not run.signatures:
            continue
        steps = sorted(run.signatures)
        picks = (
            [("only", steps[0])] if len(steps) == 1 else [("first", steps[0]), ("last", steps[-1])]
        )
        roles = list(dict.fromkeys(r for _, s in picks for r in run.signatures[s]))
        for role in roles:
            for which, step in picks:
                sig = run.signatures[step].get(role, {})
                names.update(sig)
                rows.append(
                    {"cell": run.id.name, "role": role, "which": which, "step": step, **sig}
                )
    order = [n for n in SIGNATURE_ORDER if n in names] + sorted(names - set(SIGNATURE_ORDER))
    note = "Trajectory signatures per cell and role at the first and the last stored step."
    return Table(
        "table-signatures",
        "Signature tables",
        ["cell", "role", "which", "step", *order],
        rows,
        note,
    )


def _quiet(evidence: dict) -> str:
    """One line of a quiet verdict's evidence: scalars, and nested scalars as ``a.b=v``."""
    parts: list[str] = []

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list | tuple):
            if len(value) <= 4:
                parts.append(f"{prefix}={list(value)}")
        else:
            parts.append(f"{prefix}={fmt(value, 3)}")

    walk("", evidence)
    line = ", ".join(parts)
    return line if len(line) <= 240 else line[:239] + "\u2026"


def evidence_line(v: Verdict) -> str:
    return describe(v) if v.fired else _quiet(v.evidence)


def detectors_table(res: GridRuns) -> Table:
    rows = []
    for run in res.runs.values():
        if run.id.kind not in TRAINED_KINDS:
            continue
        for v in run.verdicts:
            logged = [
                e.get("fired_at", e.get("step")) for e in run.events if e.get("detector") == v.name
            ]
            rows.append(
                {
                    "cell": run.id.name,
                    "detector": v.name,
                    "fired": v.fired,
                    "step": v.step,
                    "evidence": evidence_line(v),
                    "logged": ", ".join(str(s) for s in logged),
                }
            )
    note = (
        "Recomputed on the finished run with its own detect.* thresholds; 'logged' are the "
        "steps the trainer's alarms recorded in events.jsonl."
    )
    cols = ["cell", "detector", "fired", "step", "evidence", "logged"]
    return Table("table-detectors", "Detector verdicts", cols, rows, note)
