"""The report's figures as PNG bytes, drawn with matplotlib's object API (``Figure`` and its
Agg canvas: no pyplot, no global backend switch, nothing left open).

* ``fig-delta``: peak accuracy minus the base per (task, scale, workflow, policy); the bar is the
  mean over seeds, the dots the seeds (the paper's Fig. 2).
* ``fig-scatter``: IP peak (x) against SP peak (y) of every matched (task, scale, workflow,
  seed), with the diagonal; colour = workflow, marker = task (Fig. 3).
* ``fig-dynamics-{task}-{scale}``: one per (task, scale), one column per multi-agent workflow;
  top row train success (``train/all/accuracy``), bottom row validation accuracy, IP, SP and
  SA-RL, one line per seed; the base's validation accuracy (mean over seeds) dotted (Fig. 4).
* ``fig-instability``: max chi2, max grad norm and entropy collapse depth of every matched cell,
  IP and SP side by side; cells labelled by workflow code (E, V, O), scale, task, seed (Fig. 5).

A figure without data is still drawn, saying so, so the page always has the same figures; a
statistic that is None (a run that never logged it) is a gap, not a zero. PNGs at 96 dpi; ids
are lower case with anything but letters, digits and dots turned into dashes (``1.7B`` ->
``1.7b``).
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

from marlow.diagnostics.runstats import series
from marlow.report.results import GridRuns
from marlow.report.tables import Table, groups, matched_pairs, seeds
from marlow.titles import POLICY_LABELS
from marlow.workflows.load import workflow_title

COLORS = {"ip": "C0", "sp": "C1", "sa-rl": "0.35", "transfer": "C2", "base": "0.6"}
STYLES = {"ip": "-", "sp": "-", "sa-rl": "--"}
MARKERS = {"math": "o", "code": "s"}
DPI = 96


@dataclass(frozen=True)
class Plot:
    id: str
    title: str
    caption: str
    png: bytes


def slug(text: str) -> str:
    """An id-safe form: lower case, runs of anything but [a-z0-9.] as one dash."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def _empty(fig: Figure, what: str) -> bytes:
    ax = fig.subplots()
    ax.axis("off")
    ax.text(0.5, 0.5, f"no data: {what}", ha="center", va="center", fontsize=12)
    return _png(fig)


def delta_figure(delta: Table) -> Plot:
    bars: dict[tuple, list[float]] = {}
    for r in delta.rows:
        if r["delta_peak"] is not None:
            key = (r["task"], r["scale"], r["workflow"], r["policy"])
            bars.setdefault(key, []).append(r["delta_peak"])
    keys = sorted(bars, key=lambda k: (k[2], k[0], k[1], k[3]))
    fig = Figure(figsize=(7.0, 1.2 + 0.32 * max(len(keys), 1)))
    caption = "Peak validation accuracy minus the base model's (bar: mean over seeds; dots: seeds)."
    if not keys:
        return Plot("fig-delta", "Delta against the base", caption, _empty(fig, "no deltas"))
    ax = fig.subplots()
    y = np.arange(len(keys))
    ax.barh(y, [np.mean(bars[k]) for k in keys], color=[COLORS.get(k[3], "C4") for k in keys])
    for i, k in enumerate(keys):
        ax.plot(bars[k], [i] * len(bars[k]), "k.", ms=5)
    labels = [
        f"{workflow_title(w)} {POLICY_LABELS.get(p, p)} {s} {t.title()}" for t, s, w, p in keys
    ]
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("peak accuracy \u2212 base")
    return Plot("fig-delta", "Delta against the base", caption, _png(fig))


def scatter_figure(res: GridRuns) -> Plot:
    pairs = matched_pairs(res)
    caption = "IP vs SP peak validation accuracy on matched cells; above the diagonal SP is higher."
    fig = Figure(figsize=(5.2, 5.0))
    if not pairs:
        return Plot("fig-scatter", "IP vs SP", caption, _empty(fig, "no matched IP/SP cells"))
    ax = fig.subplots()
    workflows = list(dict.fromkeys(key[2] for key, *_ in pairs))
    seen: set[str] = set()
    for (task, _scale, wf), _seed, ip, sp in pairs:
        label = f"{workflow_title(wf)} {task.title()}"
        ax.scatter(
            ip.peak,
            sp.peak,
            color=f"C{workflows.index(wf) % 10}",
            marker=MARKERS.get(task, "^"),
            label=None if label in seen else label,
            edgecolor="k",
            linewidth=0.5,
        )
        seen.add(label)
    vals = [v for _, _, ip, sp in pairs for v in (ip.peak, sp.peak)]
    pad = 0.05 * max(max(vals) - min(vals), 0.1)
    lo, hi = min(vals) - pad, max(vals) + pad
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="IP = SP")
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="IP peak accuracy", ylabel="SP peak accuracy")
    ax.set_aspect("equal")
    ax.legend(fontsize=8)
    return Plot("fig-scatter", "IP vs SP", caption, _png(fig))


def dynamics_figures(res: GridRuns) -> list[Plot]:
    points = list(dict.fromkeys((task, scale) for task, scale, _ in groups(res)))
    return [_dynamics(res, task, scale) for task, scale in points]


def _dynamics(res: GridRuns, task: str, scale: str) -> Plot:
    workflows = [wf for t, s, wf in groups(res) if (t, s) == (task, scale)]
    fig = Figure(figsize=(3.6 * len(workflows) + 0.6, 5.6))
    axes = fig.subplots(2, len(workflows), squeeze=False, sharey="row")
    legend: dict[str, object] = {}
    for col, wf in enumerate(workflows):
        top, bottom = axes[0][col], axes[1][col]
        top.set_title(workflow_title(wf))
        base_vals = []
        for seed in seeds(res, task, scale):
            point = (task, scale, seed)
            for policy in ("ip", "sp", "sa-rl"):
                run = res.find(policy, "single" if policy == "sa-rl" else wf, point)
                if run is None:
                    continue
                style = {"color": COLORS[policy], "ls": STYLES[policy], "lw": 1.2}
                for ax, key, marker in (
                    (top, "train/all/accuracy", ""),
                    (bottom, "val/all/accuracy", "."),
                ):
                    pts = series(run.records, key)
                    if pts:
                        steps, vals = zip(*pts, strict=True)
                        (line,) = ax.plot(steps, vals, marker=marker, **style)
                        legend.setdefault(POLICY_LABELS.get(policy, policy), line)
            base = res.find("base", wf, point)
            if base is not None:
                base_vals.append(base.peak)
        if base_vals:
            line = bottom.axhline(np.mean(base_vals), color=COLORS["base"], ls=":", lw=1.2)
            legend.setdefault("Base", line)
        for ax in (top, bottom):
            if not ax.lines:
                ax.text(
                    0.5, 0.5, "no finished cell", ha="center", va="center", transform=ax.transAxes
                )
        bottom.set_xlabel("step")
    axes[0][0].set_ylabel("train success")
    axes[1][0].set_ylabel("validation accuracy")
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="upper right", fontsize=8)
    fig.suptitle(f"{task.title()} {scale}: training dynamics per workflow (one line per seed)")
    caption = (
        f"{task.title()}, {scale}: train success (top) and validation accuracy (bottom) per step; "
        "IP, SP and SA-RL, one line per seed; dotted: the base model."
    )
    return Plot(f"fig-dynamics-{slug(task)}-{slug(scale)}", "Training dynamics", caption, _png(fig))


def instability_figure(inst: Table) -> Plot:
    caption = (
        "Training-side instability amplitude on matched cells: max chi2_update, max adapter "
        "grad norm, entropy collapse depth; IP and SP side by side."
    )
    fig = Figure(figsize=(max(6.4, 0.55 * len(inst.rows) + 2.0), 7.5))
    if not inst.rows:
        return Plot("fig-instability", "Instability amplitude", caption, _empty(fig, "no pairs"))
    axes = fig.subplots(3, 1, sharex=True)
    x = np.arange(len(inst.rows))
    labels = [
        f"{workflow_title(r['workflow'])[0]} {r['scale']} {r['task'].title()} s{r['seed']}"
        for r in inst.rows
    ]
    stats = (
        ("max_chi2", "max chi2"),
        ("max_grad_norm", "max grad norm"),
        ("entropy_collapse", "entropy collapse"),
    )
    for ax, (key, name) in zip(axes, stats, strict=True):
        for off, policy in ((-0.2, "ip"), (0.2, "sp")):
            vals = [
                np.nan if r[f"{policy}_{key}"] is None else r[f"{policy}_{key}"] for r in inst.rows
            ]
            ax.bar(x + off, vals, 0.4, color=COLORS[policy], label=POLICY_LABELS[policy])
        ax.set_ylabel(name)
    axes[0].legend(fontsize=8)
    axes[-1].set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    return Plot("fig-instability", "Instability amplitude", caption, _png(fig))
