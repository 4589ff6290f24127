"""The dose-response of same-role parallelism: slopes over the slot count n.

The study's mechanism (reference/paper.md §5) is a dose-response claim: under Isolated-Policies
*parallel same-role agents on shared prompts* amplify that role's gradient and drive the terminal
fall; under a Shared-Policy the dominant role's gradient mass captures the shared adapter. A grid
tests it when its cells of one workflow differ in the slot count of one role, e.g. variants
``n1``, ``n2``, ``n4`` setting ``workflow.params.n`` of Voting (its ``generator`` slots) and
Orch-Workers (its ``worker`` slots).

**Series.** Trained IP and SP cells are grouped by (task, scale, workflow, and the variant's
settings other than ``workflow.params``), so that an ``lr`` variant crossed with the n variants
would form a series of its own rather than be pooled. In a series the *parallel role* is the role
whose slot count (``CellRun.slots``) differs across its cells; when two roles do, the one with
the most slots is taken. A series with fewer than two distinct counts is no dose axis, and a
grid without one gets no table.

**x = log2 n**: the slope is per *doubling* of the parallel slots. Why: the doses the study and a
grid can afford are geometric (1, 2, 4); in log2 n they are equally spaced, so no dose has more
leverage than another, and the slope reads as "what one more doubling does". n = 1 is the control
with no parallelism.

**Measures** of each trained cell:

* ``amplitude``: log2 of the parallel role's gradient-norm peak over first
  (:func:`marlow.report.evidence.grad_norm_ratios`: under SP the role's own norm
  ``grad_norm_own``, under IP its adapter's; both from the warmup's end). log2, because the
  ratios are heavy-tailed (docs/results/tiny-long.md C3: a mean of 1297 with a CI of 131..2462):
  on the raw scale one seed's spike would be the whole slope; in log2 a slope of 1 means the
  amplitude doubles per doubling of n.
* ``mass_share``: the parallel role's mean share of gradient mass over the steps from the
  warmup's end on (``runstats``' ``warmup_end_step``; every step when the run logs no learning
  rate). Under SP it is the logged ``train/<role>/grad_mass_share`` (|g_role| over the sum of the
  roles' |g|, per update, averaged over the step's updates). Under IP no adapter is shared and
  nothing logs it: **marlow's choice** is the role's adapter norm ``train/<role>/grad_norm``
  divided by the sum over the workflow's roles of theirs, per step, then averaged; steps where a
  role logged no norm are left out. Both are shares of *per-update* norms; the IP adapter of a
  role with more turns may also take more updates per step (``train/<adapter>/updates``), which
  this share does not count, as SP's does not.
* ``terminal_drop``: peak - final validation accuracy (``runstats``); ``peak``: the peak.

**Tests.** Each (series, policy, measure) gets the within-seed slope (seed fixed effects), its
95 % t-interval, the stratified permutation test (doses permuted within each seed), its smallest
attainable p, and the detectable slope at alpha 0.05 and 80 % power (all in
:mod:`marlow.report.significance`). The study predicts, as rises with n: IP amplitude, IP terminal
drop, SP mass share. Those rows get a verdict: *holds* (slope > 0 and p < 0.05), *refuted*
(slope < 0 and p < 0.05), *not shown* (else: an effect below ``detectable`` could not be told
from noise). The other measures get *no prediction* but every number. One more row per series,
"IP - SP terminal-drop slope" (predicted positive: IP's drop rises faster than SP's): the
difference of the two slopes, its SE from the two independent SEs (sqrt(se_ip^2 + se_sp^2)), df
the smaller of the two; its p is the **t-based** two-sided p of difference / SE (no permutation
that swaps policy labels is run for this row alone).

**Figures** ``fig-dose-<measure>`` (``fig-dose-mass-share``, ...): n on a log2 axis (ticks at the
grid's doses), one panel per series (workflow), IP and SP in the report's colours, each seed's
cell a point (IP nudged left, SP right), the mean over seeds at each n a line.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass

from matplotlib.lines import Line2D

from marlow.config.titles import POLICY_LABELS
from marlow.diagnostics.runstats import after_warmup, series
from marlow.report.evidence import ALPHA, grad_norm_ratios
from marlow.report.figures import (
    COLORS,
    Plot,
    empty_figure,
    finish_plot,
    legend_below,
    new_figure,
    slug,
)
from marlow.report.results import CellRun, GridRuns
from marlow.report.significance import (
    detectable_effect,
    slope_permutation_p,
    t975,
    t_two_sided_p,
    within_slope,
)
from marlow.report.tables import Table
from marlow.workflows.load import workflow_title

MEASURES = ("amplitude", "mass_share", "terminal_drop", "peak")
LABELS = {
    "amplitude": "log2 grad-norm peak over first",
    "mass_share": "gradient mass share",
    "terminal_drop": "terminal drop (peak - final)",
    "peak": "peak validation accuracy",
}
PREDICTED = {("ip", "amplitude"), ("ip", "terminal_drop"), ("sp", "mass_share")}
"""(policy, measure) the study predicts to rise with n; the rest are measured, not judged."""
POLICIES = ("ip", "sp")
DIFF = "ip - sp"  # the policy column of the difference-of-slopes row


@dataclass(frozen=True)
class DoseSeries:
    """The trained IP and SP cells of one workflow whose ``role`` has several slot counts."""

    task: str
    scale: str  # without the variant
    workflow: str
    role: str  # the parallel role
    variants: tuple[str, ...]
    runs: tuple[CellRun, ...]

    def points(self, policy: str, measure: str) -> list[tuple[int, int, float]]:
        """(seed, n, value) of every cell of ``policy`` where ``measure`` is defined."""
        out = []
        for run in self.runs:
            if run.id.policy == policy:
                value = measure_value(run, self.role, measure)
                if value is not None and math.isfinite(value):
                    out.append((run.id.seed, run.slots[self.role], value))
        return out


def mass_share(run: CellRun, role: str) -> float | None:
    """``role``'s mean share of gradient mass from the warmup's end on (see the module text)."""
    if run.id.policy == "sp":
        points = series(run.records, f"train/{role}/grad_mass_share")
    else:
        norms = {r: dict(series(run.records, f"train/{r}/grad_norm")) for r in run.slots}
        steps = sorted(set.intersection(*(set(v) for v in norms.values()))) if norms else []
        totals = {s: sum(v[s] for v in norms.values()) for s in steps}
        points = [(s, norms[role][s] / totals[s]) for s in steps if totals[s] > 0]
    points = after_warmup(points, run.stats.get("warmup_end_step"))
    return statistics.fmean(v for _, v in points) if points else None


def measure_value(run: CellRun, role: str, measure: str) -> float | None:
    """One cell's ``measure`` (:data:`MEASURES`) for the parallel ``role``."""
    if measure == "amplitude":
        ratio = grad_norm_ratios(run).get(role)
        return math.log2(ratio) if ratio is not None and ratio > 0 else None
    if measure == "mass_share":
        return mass_share(run, role)
    if measure == "terminal_drop":
        return run.stats["val"]["terminal_drop"]
    if measure == "peak":
        return run.peak
    raise ValueError(f"unknown dose measure {measure!r}; valid: {', '.join(MEASURES)}")


def _settings_key(res: GridRuns, variant: str) -> str:
    """The variant's settings without ``workflow.params`` (what the dose variants vary)."""
    settings = dict(((res.grid or {}).get("variants") or {}).get(variant) or {})
    workflow = {k: v for k, v in (settings.pop("workflow", None) or {}).items() if k != "params"}
    if workflow:
        settings["workflow"] = workflow
    return json.dumps(settings, sort_keys=True, default=str)


def dose_series(res: GridRuns) -> list[DoseSeries]:
    """Every series of the grid with a dose axis (two or more slot counts of one role)."""
    groups: dict[tuple, list[CellRun]] = {}
    for run in res.runs.values():
        i = run.id
        if i.kind == "trained" and i.policy in POLICIES and run.records:
            key = (i.task, i.grid_scale, i.workflow, _settings_key(res, i.variant))
            groups.setdefault(key, []).append(run)
    out = []
    for (task, scale, workflow, _), runs in groups.items():
        counts: dict[str, set[int]] = {}
        for run in runs:
            for role, n in run.slots.items():
                counts.setdefault(role, set()).add(n)
        varying = [r for r, ns in counts.items() if len(ns) >= 2]
        if not varying:
            continue
        role = max(varying, key=lambda r: (max(counts[r]), r))
        runs = [r for r in runs if role in r.slots]
        dose = {r.id.variant: r.slots[role] for r in runs}  # a variant's cells share their n
        variants = tuple(sorted(dose, key=lambda v: (dose[v], v)))
        out.append(DoseSeries(task, scale, workflow, role, variants, tuple(runs)))
    return out


def _verdict(policy: str, measure: str, slope: float | None, p: float | None) -> str:
    if (policy, measure) not in PREDICTED and policy != DIFF:
        return "no prediction"
    if slope is None or p is None or p >= ALPHA or slope == 0:
        return "not shown"
    return "holds" if slope > 0 else "refuted"


def _slope_row(s: DoseSeries, policy: str, measure: str) -> tuple[dict, dict]:
    points = s.points(policy, measure)
    fit = within_slope([(seed, math.log2(n), y) for seed, n, y in points])
    test = slope_permutation_p([(seed, math.log2(n), y) for seed, n, y in points])
    row = {
        "policy": policy,
        "measure": measure,
        "prediction": "rises with n" if (policy, measure) in PREDICTED else "",
        "cells": fit["n"],
        "seeds": fit["seeds"],
        "doses": ",".join(str(n) for n in sorted({n for _, n, _ in points})),
        "slope": fit["slope"],
        "df": fit["df"] if fit["se"] is not None else None,
        "ci_low": fit["ci_low"],
        "ci_high": fit["ci_high"],
        "p_value": test["p_value"],
        "min_p": test["min_p"],
        "detectable": detectable_effect(fit["se"], fit["df"]),
        "verdict": _verdict(policy, measure, fit["slope"], test["p_value"]),
        "figure": f"fig-dose-{slug(measure)}",
    }
    return row, fit


def _difference_row(ip: dict, sp: dict) -> dict:
    """IP - SP terminal-drop slope from the two fits; the t-based p (see the module text)."""
    row = {
        "policy": DIFF,
        "measure": "terminal_drop",
        "prediction": "IP - SP terminal-drop slope > 0",
        "cells": ip["n"] + sp["n"],
        "seeds": min(ip["seeds"], sp["seeds"]),
        "figure": "fig-dose-terminal-drop",
    }
    if ip["slope"] is None or sp["slope"] is None:
        return {**row, "slope": None, "verdict": "not shown"}
    diff = ip["slope"] - sp["slope"]
    row["slope"] = diff
    if ip["se"] is None or sp["se"] is None:
        return {**row, "verdict": "not shown"}
    se, df = math.hypot(ip["se"], sp["se"]), min(ip["df"], sp["df"])
    p = t_two_sided_p(diff / se, df) if se > 0 else (0.0 if diff else 1.0)
    half = t975(df) * se
    return {
        **row,
        "df": df,
        "ci_low": diff - half,
        "ci_high": diff + half,
        "p_value": p,
        "detectable": detectable_effect(se, df),
        "verdict": _verdict(DIFF, "terminal_drop", diff, p),
    }


COLUMNS = [
    "task",
    "scale",
    "workflow",
    "variants",
    "policy",
    "role",
    "measure",
    "prediction",
    "cells",
    "seeds",
    "doses",
    "slope",
    "df",
    "ci_low",
    "ci_high",
    "p_value",
    "min_p",
    "detectable",
    "verdict",
    "figure",
]


def dose_table(all_series: list[DoseSeries]) -> Table | None:
    """The slopes over log2 n of every series, policy and measure (None: no dose axis)."""
    if not all_series:
        return None
    rows = []
    for s in all_series:
        head = {
            "task": s.task,
            "scale": s.scale,
            "workflow": s.workflow,
            "variants": ", ".join(v for v in s.variants if v),
            "role": s.role,
        }
        fits = {}
        for policy in POLICIES:
            for measure in MEASURES:
                row, fits[policy, measure] = _slope_row(s, policy, measure)
                rows.append({**head, **row})
        diff = _difference_row(fits["ip", "terminal_drop"], fits["sp", "terminal_drop"])
        rows.append({**head, **diff})
    note = (
        "Slope of each measure over log2 n (per doubling of the parallel role's slots), with "
        "one intercept per seed; ci: its 95 % t-interval; p: the permutation test that permutes "
        "the doses within each seed (min_p: the smallest p these values allow), except the "
        "IP - SP row, whose p is t-based on the two slopes' SEs (df the smaller). amplitude: "
        "log2 of the parallel role's grad-norm peak over first; mass_share: its mean share of "
        "gradient mass after the warmup (IP: its adapter norm over the sum of the roles'); "
        "terminal_drop: peak - final; peak: peak validation accuracy. holds / refuted: the "
        f"predicted rise, or a fall, with p < {ALPHA}; not shown: neither, so an effect below "
        "`detectable` (the slope found with 80 % power at alpha 0.05) could not be told from "
        "noise; no prediction: measured, not predicted by the study."
    )
    return Table("table-dose", "Dose-response of same-role parallelism", COLUMNS, rows, note)


def dose_figures(all_series: list[DoseSeries]) -> list[Plot]:
    """``fig-dose-<measure>`` for each measure (none without a dose axis)."""
    return [_dose_figure(all_series, m) for m in MEASURES] if all_series else []


def _panel_title(s: DoseSeries, all_series: list[DoseSeries]) -> str:
    title = workflow_title(s.workflow)
    places = {(x.task, x.scale) for x in all_series}
    if len(places) > 1:
        title += f" {s.task.title()} {s.scale}"
    same = [x for x in all_series if (x.task, x.scale, x.workflow) == (s.task, s.scale, s.workflow)]
    if len(same) > 1:  # other settings crossed with the doses: name the series' variants
        title += f" ({', '.join(s.variants)})"
    return title


def _dose_figure(all_series: list[DoseSeries], measure: str) -> Plot:
    fid = f"fig-dose-{slug(measure)}"
    title = f"Dose-response: {LABELS[measure]}"
    caption = (
        f"{LABELS[measure].capitalize()} against the parallel role's slot count n (log2 axis), "
        "one panel per workflow: IP and SP, each seed a point (IP shifted left, SP right, so "
        "they do not hide each other), the line the mean over seeds at each n."
    )
    fig = new_figure(3.4 * len(all_series) + 0.8, 3.6)
    axes = fig.subplots(1, len(all_series), squeeze=False)[0]
    legend: dict[str, object] = {}
    for ax, s in zip(axes, all_series, strict=True):
        doses = sorted({r.slots[s.role] for r in s.runs})
        for shift, policy in ((2**-0.06, "ip"), (2**0.06, "sp")):
            points = s.points(policy, measure)
            if not points:
                continue
            color = COLORS[policy]
            ax.scatter(
                [n * shift for _, n, _ in points],
                [y for _, _, y in points],
                color=color,
                s=14,
                alpha=0.7,
                edgecolor="none",
            )
            by_n: dict[int, list[float]] = {}
            for _, n, y in points:
                by_n.setdefault(n, []).append(y)
            ns = sorted(by_n)
            ax.plot(ns, [statistics.fmean(by_n[n]) for n in ns], color=color, lw=1.8)
            legend.setdefault(POLICY_LABELS.get(policy, policy), Line2D([], [], color=color, lw=2))
        ax.set_xscale("log", base=2)
        ax.set_xticks(doses, [str(n) for n in doses])
        ax.minorticks_off()
        ax.set_xlim(doses[0] / 2**0.4, doses[-1] * 2**0.4)
        ax.set_xlabel(f"n ({s.role} slots)")
        ax.set_title(_panel_title(s, all_series), fontsize=10)
        if not ax.collections:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    axes[0].set_ylabel(LABELS[measure], fontsize=9)
    legend["seed"] = Line2D([], [], color="0.4", marker="o", ls="", ms=4)
    legend["mean over seeds"] = Line2D([], [], color="0.4", lw=1.8)
    legend_below(fig, legend)
    if not any(s.points(p, measure) for s in all_series for p in POLICIES):
        fig = empty_figure(new_figure(6.0, 2.0), f"no cell has {measure}")
    return finish_plot(fid, title, caption, fig)
