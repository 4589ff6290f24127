"""The report's cross-cell tables, computed from a loaded results folder (:mod:`marlow.report.results`).

Every table is a :class:`Table`: a stable ``id`` (the HTML element id and the CSV file name),
its columns and its rows (dicts keyed by column). Numbers are kept raw here (accuracies as
fractions in [0, 1], as the metrics log them); formatting is the renderer's.

Choices the spec leaves open, made here:

* **Accuracy** of a cell is its peak validation accuracy (``runstats``: ties go to the earliest
  step). A base or transfer cell validates once, so its peak is that one value.
* **Table 1** has one row per (task, scale, multi-agent workflow), in index order. Its SA-RL
  column is the Single cell of the same (task, scale, seed), the same in every workflow's row.
  The residuals IP - SA-RL and SP - SA-RL are taken per seed (only seeds where both cells
  finished) and then summarised, so they are paired; with the same seeds present they equal the
  difference of the column means.
* **Delta vs base**: every trained, SA-RL and transfer cell against the base cell of the same
  (workflow, task, scale, seed) (SA-RL against Single-Base): peak - base and final - base.
* **Matched pairs** are (task, scale, workflow, seed) where both the IP and the SP cell
  finished; they feed the scatter, the instability table and the paired test. The paired test
  is run per (task, scale, workflow) over seeds, and once pooled over every matched pair (the
  ``all`` row: the sign-flip null, no pair favours either routing, holds pair by pair).

The per-cell diagnostic tables (Table 2, signatures, detectors) are in
:mod:`marlow.report.runtables`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from marlow.diagnostics.metrics import TOOL_METRICS
from marlow.report.results import CellId, CellRun, GridRuns
from marlow.report.significance import paired_test, summarize

Formatter = Callable[[dict], str]
COLUMNS = ("base", "sa_rl", "ip", "sp", "transfer")  # Table 1 accuracy columns
POLICY_OF = {"base": "base", "sa_rl": "sa-rl", "ip": "ip", "sp": "sp", "transfer": "transfer"}
IDENT = ("cell", "kind", "workflow", "policy", "task", "scale", "seed")  # a cell's columns
GROUP = ("task", "scale", "workflow")  # a Table 1 row's columns


@dataclass
class Table:
    id: str
    title: str
    columns: list[str]
    rows: list[dict]
    note: str = ""
    # HTML view: (header, formatter) pairs; None shows ``columns`` as they are
    view: list[tuple[str, Formatter]] | None = field(default=None, repr=False)


COUNT_SUFFIXES = ("_n", "_step", "_turns", "_problems", "length_p50", "length_p95", "length_max")


def is_count(column: str) -> bool:
    """Whether a column holds counts (problems, turns, steps, token lengths): shown as integers."""
    return (
        column in ("n", "step", "steps")
        or column.startswith("n_")
        or column.endswith(COUNT_SUFFIXES)
    )


def fmt(value: object, digits: int = 3, column: str = "") -> str:
    """A cell of the HTML view: numbers to ``digits`` decimals, counts (:func:`is_count`) as
    integers, None/NaN as an en dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "\u2013"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if is_count(column) and value.is_integer():
            return f"{int(value):,}"
        return f"{value:.{digits}f}" if abs(value) < 1e4 else f"{value:.3g}"
    return str(value)


def _msd(prefix: str) -> Formatter:
    """'mean ± sd (n)' of the ``{prefix}_mean/_sd/_n`` columns of a row."""

    def show(row: dict) -> str:
        n = row[f"{prefix}_n"]
        if not n:
            return "\u2013"
        sd = row[f"{prefix}_sd"]
        spread = f" \u00b1 {sd:.3f}" if sd is not None else ""
        return f"{row[f'{prefix}_mean']:.3f}{spread} (n={n})"

    return show


def _col(name: str, digits: int = 3) -> Formatter:
    return lambda row: fmt(row.get(name), digits)


# -- the grid's structure ------------------------------------------------------------------------


def groups(res: GridRuns) -> list[tuple[str, str, str]]:
    """(task, scale, workflow) of every multi-agent workflow in the index, in index order."""
    out: list[tuple[str, str, str]] = []
    for i in res.ids:
        key = (i.task, i.scale, i.workflow)
        if i.workflow != "single" and key not in out:
            out.append(key)
    return out


def seeds(res: GridRuns, task: str, scale: str) -> list[int]:
    return sorted({i.seed for i in res.ids if (i.task, i.scale) == (task, scale)})


def matched_pairs(res: GridRuns) -> list[tuple[tuple[str, str, str], int, CellRun, CellRun]]:
    """((task, scale, workflow), seed, IP cell, SP cell) for every pair where both finished."""
    out = []
    for task, scale, wf in groups(res):
        for seed in seeds(res, task, scale):
            ip = res.find("ip", wf, (task, scale, seed))
            sp = res.find("sp", wf, (task, scale, seed))
            if ip is not None and sp is not None:
                out.append(((task, scale, wf), seed, ip, sp))
    return out


def ident(cid: CellId) -> dict:
    """The identity columns (:data:`IDENT`) of a cell."""
    return {"cell": cid.name, **{k: getattr(cid, k) for k in IDENT[1:]}}


# -- tables --------------------------------------------------------------------------------------


def cells_table(res: GridRuns) -> Table:
    rows = []
    for i in res.ids:
        run = res.runs.get(i.name)
        val = run.stats["val"] if run else {}
        rows.append(
            {
                **ident(i),
                "state": "done" if run else "missing",
                "peak": val.get("peak_accuracy"),
                "peak_step": val.get("peak_step"),
                "final": val.get("final_accuracy"),
                "terminal_drop": val.get("terminal_drop"),
            }
        )
    cols = [*IDENT, "state", "peak", "peak_step", "final", "terminal_drop"]
    return Table(
        "table-cells",
        "All cells",
        cols,
        rows,
        "Every cell of the index; peak and final "
        "validation accuracy (fractions) of the finished ones.",
    )


def missing_table(res: GridRuns) -> Table:
    return Table(
        "table-missing",
        "Missing cells",
        ["name", "kind", "state", "reason"],
        list(res.missing),
        "Cells not done or not readable; they are left out of every other table.",
    )


def table1(res: GridRuns) -> Table:
    rows = []
    for task, scale, wf in groups(res):
        row: dict = {"task": task, "scale": scale, "workflow": wf}
        peaks: dict[str, dict[int, float]] = {c: {} for c in COLUMNS}
        for seed in seeds(res, task, scale):
            for col in COLUMNS:
                run = res.find(
                    POLICY_OF[col], "single" if col == "sa_rl" else wf, (task, scale, seed)
                )
                if run is not None:
                    peaks[col][seed] = run.peak
        for col in COLUMNS:
            row.update({f"{col}_{k}": v for k, v in summarize(list(peaks[col].values())).items()})
        for col in ("ip", "sp"):
            diffs = [v - peaks["sa_rl"][s] for s, v in peaks[col].items() if s in peaks["sa_rl"]]
            row.update({f"{col}_minus_sa_rl_{k}": v for k, v in summarize(diffs).items()})
        rows.append(row)
    stats = [*COLUMNS, "ip_minus_sa_rl", "sp_minus_sa_rl"]
    cols = [*GROUP] + [f"{c}_{k}" for c in stats for k in ("mean", "sd", "n")]
    heads = ["base", "SA-RL", "IP", "SP", "transfer", "IP \u2212 SA-RL", "SP \u2212 SA-RL"]
    view = [(c, _col(c)) for c in GROUP]
    view += [(h, _msd(c)) for h, c in zip(heads, stats, strict=True)]
    note = (
        "Peak validation accuracy, mean \u00b1 sample sd (n seeds). Residuals against SA-RL "
        "are paired per seed. Transfer: the SA-RL adapter on the generator role only."
    )
    return Table("table1", "Table 1: peak accuracy and residuals vs SA-RL", cols, rows, note, view)


def delta_table(res: GridRuns) -> Table:
    rows = []
    for run in res.runs.values():
        if run.id.kind == "base":
            continue
        base = res.find("base", run.id.workflow, run.id.point)
        b = base.peak if base else None
        rows.append(
            {
                **ident(run.id),
                "peak": run.peak,
                "final": run.final,
                "base_cell": base.id.name if base else None,
                "base_accuracy": b,
                "delta_peak": run.peak - b if b is not None else None,
                "delta_final": run.final - b if b is not None else None,
            }
        )
    cols = [*IDENT, "peak", "final", "base_cell", "base_accuracy", "delta_peak", "delta_final"]
    note = "Each cell against the base model in the same workflow, task, scale and seed."
    return Table("table-delta", "Per-cell delta against the base", cols, rows, note)


def paired_table(res: GridRuns) -> Table:
    by_group: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for key, _seed, ip, sp in matched_pairs(res):
        by_group.setdefault(key, []).append((ip.peak, sp.peak))
    rows = []
    entries = list(by_group.items())
    pooled = [pair for pairs in by_group.values() for pair in pairs]
    if pooled:
        entries.append((("all", "all", "all"), pooled))
    for (task, scale, wf), pairs in entries:
        ip, sp = [a for a, _ in pairs], [b for _, b in pairs]
        test = paired_test(ip, sp)
        rows.append(
            {
                "task": task,
                "scale": scale,
                "workflow": wf,
                "mean_ip": summarize(ip)["mean"],
                "mean_sp": summarize(sp)["mean"],
                **test,
            }
        )
    cols = [*GROUP, "n", "mean_ip", "mean_sp", "mean_diff", "sd_diff", "p_value", "min_p", "method"]
    note = (
        "IP \u2212 SP peak accuracy over seeds, paired on (task, scale, workflow, seed); "
        "two-sided sign-flip permutation p-value. min_p is the smallest p the test can "
        "give with n pairs."
    )
    return Table("table-paired", "Paired IP-vs-SP test over seeds", cols, rows, note)


def instability_table(res: GridRuns) -> Table:
    rows = []
    stats = (
        ("max_chi2", "max_chi2"),
        ("max_grad_norm", "max_grad_norm"),
        ("entropy_collapse", "entropy_collapse_depth"),
    )
    for (task, scale, wf), seed, ip, sp in matched_pairs(res):
        row = {
            "task": task,
            "scale": scale,
            "workflow": wf,
            "seed": seed,
            "ip_cell": ip.id.name,
            "sp_cell": sp.id.name,
        }
        for col, key in stats:
            row[f"ip_{col}"], row[f"sp_{col}"] = ip.stats[key], sp.stats[key]
        rows.append(row)
    cols = [*GROUP, "seed", "ip_cell", "sp_cell"]
    cols += [f"{p}_{c}" for c, _ in stats for p in ("ip", "sp")]
    note = (
        "Per matched cell: max chi2_update of any role, max adapter grad norm, entropy "
        "collapse depth (first minus minimum of train/all/entropy)."
    )
    return Table("table-instability", "Instability amplitude (IP vs SP)", cols, rows, note)


def tools_table(res: GridRuns) -> Table | None:
    """Each cell's tool stages, their metrics averaged over the training steps (None when no
    cell has one): how often each was called, its failures and time, how often the role after
    a reported failure changed its answer."""
    rows = []
    for run in res.runs.values():
        tools = sorted({k.split("/")[1] for r in run.records for k in r if _is_tool_key(k)})
        for tool in tools:
            row: dict = {**ident(run.id), "tool": tool}
            for m in TOOL_METRICS:
                values = [r[f"train/{tool}/{m}"] for r in run.records if f"train/{tool}/{m}" in r]
                row[m] = sum(values) / len(values) if values else None
            rows.append(row)
    if not rows:
        return None
    note = (
        "Per cell and tool stage, the mean over training steps: calls per episode; errors, the "
        "fraction of calls that raised, timed out or returned no text; seconds per call (each "
        "call's latency); wall_s, the wall seconds of the tool's stages per step; "
        "ok_rate, of the calls that report ok, the fraction that passed; revision_rate, of the "
        "calls that reported a failure, the fraction after which the next role changed the "
        "answer the tool examined."
    )
    cols = [*IDENT, "tool", *TOOL_METRICS]
    return Table("table-tools", "Tool stages", cols, rows, note)


def _is_tool_key(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == "train" and parts[2] == "calls"
