"""The report's figures as PNG bytes, drawn with matplotlib's object API (``Figure`` and its
Agg canvas: no pyplot, no global backend switch, nothing left open).

* ``fig-delta``: peak accuracy minus the base per (task, scale, workflow, policy); the bar is the
  mean over seeds, the dots the seeds (the paper's Fig. 2).
* ``fig-scatter``: IP peak (x) against SP peak (y) of every matched (task, scale, workflow,
  seed), with the diagonal; colour = workflow, marker = task (Fig. 3).
* ``fig-dynamics-{task}-{scale}``: one per (task, scale), one column per multi-agent workflow;
  top row train success (``train/all/accuracy``), bottom row validation accuracy; per policy
  (IP, SP, SA-RL) each seed a thin line of its own dash pattern, the mean over seeds a thick
  line with its 95 % confidence band (:func:`marlow.report.significance.ci95`, where two or more seeds
  logged the step); the base model through the workflow (black) and as a single agent (brown),
  dotted (Fig. 4).
* ``fig-instability``: max chi2, max grad norm and entropy collapse depth of every matched cell,
  IP and SP side by side, one row per cell (Fig. 5).
* ``fig-roles-{cell}``: every trained cell's per-role time series over steps: reward, gradient
  norm (each role's own share under SP), chi2_update, entropy and mean response length, one
  line per role (or adapter).

Every figure is laid out by matplotlib's constrained layout, its legend below the plots, and is
checked before it is encoded (:func:`layout_problems`: no two texts overlap, none leaves the
canvas); a problem found is kept in ``Plot.problems`` and printed in the page, never hidden. A
figure without data is still drawn, saying so, so the page always has the same figures; a
statistic that is None (a run that never logged it) is a gap, not a zero. PNGs at 96 dpi; ids
are lower case with anything but letters, digits and dots turned into dashes (``1.7B`` ->
``1.7b``).
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import MaxNLocator

from marlow.config.titles import POLICY_LABELS
from marlow.diagnostics.runstats import series
from marlow.report.results import TRAINED_KINDS, CellRun, GridRuns
from marlow.report.significance import ci95
from marlow.report.tables import Table, groups, matched_pairs, seeds
from marlow.workflows.load import workflow_title

COLORS = {"ip": "C0", "sp": "C1", "sa-rl": "C2", "transfer": "C4", "base": "k"}
BASE_SINGLE = "#8c564b"  # the single-agent base, distinct from the workflow's base (black)
SEED_DASHES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))  # seed i of a cell: its own dashes
MARKERS = {"math": "o", "code": "s"}
DPI = 96
OVERLAP_PX = 1.0  # two texts whose boxes share more than this area (px^2) overlap
BAND_SEEDS = 3
"""Seeds a step needs for its 95 % band: with two, t(0.975, 1) = 12.7 makes the band +-9 sd wide
and it covers the whole axis; the two seed lines themselves show the spread better."""


@dataclass(frozen=True)
class Plot:
    id: str
    title: str
    caption: str
    png: bytes
    problems: tuple[str, ...] = ()  # what layout_problems found

    @property
    def alt(self) -> str:
        return f"{self.title}. {self.caption}"


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _texts(fig: Figure, renderer) -> list[tuple[str, object]]:
    """(text, window extent) of every text the figure draws: titles, labels, tick labels of
    ticks inside the view, legends, annotations."""
    found: list[Text] = [t for t in (fig._suptitle,) if t is not None] + list(fig.texts)
    for legend in fig.legends:
        found += legend.get_texts()
    for ax in fig.axes:
        found += [ax.title, ax._left_title, ax._right_title, *ax.texts]
        if ax.get_legend() is not None:
            found += ax.get_legend().get_texts()
        for axis, view in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            found.append(axis.label)
            lo, hi = sorted(view)
            pad = 1e-9 * max(1.0, abs(hi - lo))
            for tick in axis.get_major_ticks():
                if lo - pad <= tick.get_loc() <= hi + pad:
                    found += [tick.label1, tick.label2]
    return [
        (t.get_text(), t.get_window_extent(renderer))
        for t in dict.fromkeys(found)  # once each (the suptitle is also among fig.texts)
        if t.get_visible() and t.get_text().strip() and (t.axes is None or t.axes.get_visible())
    ]


def layout_problems(fig: Figure) -> list[str]:
    """Texts of ``fig`` that overlap another or leave the canvas, as drawn (one line each)."""
    fig.canvas.draw()
    boxes = _texts(fig, fig.canvas.get_renderer())
    width, height = fig.bbox.width, fig.bbox.height
    out = []
    for text, bb in boxes:
        if bb.x0 < -1 or bb.y0 < -1 or bb.x1 > width + 1 or bb.y1 > height + 1:
            out.append(f"text {text!r} is clipped at the figure's edge")
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1 :]:
            w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
            h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
            if w > 0 and h > 0 and w * h > OVERLAP_PX:
                out.append(f"texts {a!r} and {b!r} overlap")
    return out


def finish_plot(id: str, title: str, caption: str, fig: Figure) -> Plot:
    problems = tuple(layout_problems(fig))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return Plot(id, title, caption, buf.getvalue(), problems)


def slug(text: str) -> str:
    """An id-safe form: lower case, runs of anything but [a-z0-9.] as one dash."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def legend_below(fig: Figure, entries: dict[str, object], most: int = 5) -> None:
    """The figure's legend (label -> handle) under its plots, in rows of at most ``most``: never
    over a title or a curve."""
    if entries:
        fig.legend(
            list(entries.values()),
            list(entries),
            loc="outside lower center",
            ncols=min(len(entries), most),
            fontsize=8,
        )


def empty_figure(fig: Figure, what: str) -> Figure:
    ax = fig.subplots()
    ax.axis("off")
    ax.text(0.5, 0.5, f"no data: {what}", ha="center", va="center", fontsize=12)
    return fig


def delta_figure(delta: Table) -> Plot:
    bars: dict[tuple, list[float]] = {}
    for r in delta.rows:
        if r["delta_peak"] is not None:
            key = (r["task"], r["scale"], r["workflow"], r["policy"])
            bars.setdefault(key, []).append(r["delta_peak"])
    keys = sorted(bars, key=lambda k: (k[2], k[0], k[1], k[3]))
    fig = new_figure(7.0, 1.4 + 0.3 * max(len(keys), 1))
    caption = "Peak validation accuracy minus the base model's (bar: mean over seeds; dots: seeds)."
    title = "Delta against the base"
    if not keys:
        return finish_plot("fig-delta", title, caption, empty_figure(fig, "no deltas"))
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
    return finish_plot("fig-delta", title, caption, fig)


def scatter_figure(res: GridRuns) -> Plot:
    pairs = matched_pairs(res)
    caption = "IP vs SP peak validation accuracy on matched cells; above the diagonal SP is higher."
    fig = new_figure(5.2, 5.4)
    if not pairs:
        return finish_plot(
            "fig-scatter", "IP vs SP", caption, empty_figure(fig, "no matched IP/SP cells")
        )
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
    ax.tick_params(axis="x", labelrotation=45)
    handles, labels = ax.get_legend_handles_labels()
    legend_below(fig, dict(zip(labels, handles, strict=True)), most=3)
    return finish_plot("fig-scatter", "IP vs SP", caption, fig)


def dynamics_figures(res: GridRuns) -> list[Plot]:
    points = list(dict.fromkeys((task, scale) for task, scale, _ in groups(res)))
    return [_dynamics(res, task, scale) for task, scale in points]


def smoothed(points: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """(step, mean of the last ``window`` values up to it): a trailing moving average."""
    vals = [v for _, v in points]
    return [
        (step, float(np.mean(vals[max(0, i - window + 1) : i + 1])))
        for i, (step, _) in enumerate(points)
    ]


def smoothing_window(runs: list[tuple[int, CellRun]], key: str) -> int:
    """A trailing window of about a fifteenth of the longest series (1: none), so that a
    per-step metric of a long run reads as a curve rather than noise."""
    longest = max((len(series(run.records, key)) for _, run in runs), default=0)
    return max(1, longest // 15)


def _seed_lines(
    ax, runs: list[tuple[int, CellRun]], key: str, color: str, marker: str, window: int = 1
) -> bool:
    """Each seed's series thin, in its own dash pattern; the mean over seeds thick with its
    95 % band where two or more seeds logged the step. ``window`` > 1: every series is first
    :func:`smoothed`. False when no seed logged ``key``."""
    by_step: dict[int, list[float]] = {}
    drawn = False
    for index, (_seed, run) in enumerate(runs):
        pts = smoothed(series(run.records, key), window)
        if not pts:
            continue
        steps, vals = zip(*pts, strict=True)
        dash = SEED_DASHES[index % len(SEED_DASHES)]
        thin = {"lw": 0.8, "alpha": 0.6} if len(runs) > 1 else {"lw": 1.4}
        ax.plot(steps, vals, color=color, ls=dash, marker=marker, ms=3, **thin)
        for step, value in pts:
            by_step.setdefault(step, []).append(value)
        drawn = True
    if len(runs) > 1 and by_step:
        steps = sorted(by_step)
        ax.plot(steps, [np.mean(by_step[s]) for s in steps], color=color, lw=2.0)
        band = [(s, ci95(by_step[s])) for s in steps if len(by_step[s]) >= BAND_SEEDS]
        band = [(s, (max(b[0], 0.0), min(b[1], 1.0))) for s, b in band if b is not None]
        if band:
            xs = [s for s, _ in band]
            ax.fill_between(
                xs, [b[0] for _, b in band], [b[1] for _, b in band], color=color, alpha=0.15, lw=0
            )
    return drawn


def _dynamics(res: GridRuns, task: str, scale: str) -> Plot:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    workflows = [wf for t, s, wf in groups(res) if (t, s) == (task, scale)]
    fig = new_figure(3.6 * len(workflows) + 0.8, 6.2)
    axes = fig.subplots(2, len(workflows), squeeze=False, sharey="row", sharex="col")
    legend: dict[str, object] = {}
    windows: set[int] = set()  # the train row's smoothing, per policy
    point_seeds = seeds(res, task, scale)
    for col, wf in enumerate(workflows):
        top, bottom = axes[0][col], axes[1][col]
        top.set_title(workflow_title(wf))
        for policy in ("ip", "sp", "sa-rl"):
            source = "single" if policy == "sa-rl" else wf
            found = [(seed, res.find(policy, source, (task, scale, seed))) for seed in point_seeds]
            runs = [(seed, run) for seed, run in found if run is not None]
            color = COLORS[policy]
            window = smoothing_window(runs, "train/all/accuracy")
            windows.add(window)
            drawn = _seed_lines(top, runs, "train/all/accuracy", color, "", window)
            drawn |= _seed_lines(bottom, runs, "val/all/accuracy", color, ".")
            if drawn:
                legend.setdefault(
                    POLICY_LABELS.get(policy, policy), Line2D([], [], color=color, lw=2)
                )
        for name, workflow, color in (
            ("Base", wf, COLORS["base"]),
            ("Base (single agent)", "single", BASE_SINGLE),
        ):
            peaks = [
                run.peak
                for seed in point_seeds
                if (run := res.find("base", workflow, (task, scale, seed))) is not None
            ]
            if peaks:
                bottom.axhline(np.mean(peaks), color=color, ls=":", lw=1.4)
                legend.setdefault(name, Line2D([], [], color=color, ls=":", lw=1.4))
        for ax in (top, bottom):
            if not ax.lines:
                ax.text(
                    0.5, 0.5, "no finished cell", ha="center", va="center", transform=ax.transAxes
                )
        bottom.set_xlabel("step")
    axes[0][0].set_ylabel("train success")
    axes[1][0].set_ylabel("validation accuracy")
    if len(point_seeds) >= BAND_SEEDS:
        legend["mean, 95 % CI"] = Patch(color="0.5", alpha=0.3)
    elif len(point_seeds) > 1:
        legend["mean over seeds"] = Line2D([], [], color="0.4", lw=2)
    if len(point_seeds) > 1:
        for index, seed in enumerate(point_seeds[: len(SEED_DASHES)]):
            legend[f"seed {seed}"] = Line2D([], [], color="0.4", lw=0.8, ls=SEED_DASHES[index])
    legend_below(fig, legend)
    fig.suptitle(f"{task.title()} {scale}: training dynamics per workflow")
    window = max(windows, default=1)
    smooth = f" (a trailing mean over {window} steps)" if window > 1 else ""
    caption = (
        f"{task.title()}, {scale}: train success{smooth} (top) and validation accuracy (bottom) "
        "per step. IP, SP and SA-RL: each seed a thin line (its own dash pattern), the mean over seeds "
        f"thick with its 95 % confidence band (t-based, clipped to [0, 1], where {BAND_SEEDS} or "
        "more seeds logged the step); dotted: the base model through the workflow (black) and "
        "as a single agent (brown)."
    )
    return finish_plot(
        f"fig-dynamics-{slug(task)}-{slug(scale)}", "Training dynamics", caption, fig
    )


def instability_figure(inst: Table) -> Plot:
    caption = (
        "Training-side instability amplitude on matched cells: max chi2_update, max adapter "
        "grad norm, entropy collapse depth; IP and SP side by side, one row per cell."
    )
    title = "Instability amplitude"
    fig = new_figure(9.0, 1.6 + 0.32 * max(len(inst.rows), 1))
    if not inst.rows:
        return finish_plot("fig-instability", title, caption, empty_figure(fig, "no pairs"))
    axes = fig.subplots(1, 3, sharey=True)
    y = np.arange(len(inst.rows))
    labels = [
        f"{workflow_title(r['workflow'])} {r['scale']} {r['task'].title()} s{r['seed']}"
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
            ax.barh(y + off, vals, 0.4, color=COLORS[policy], label=POLICY_LABELS[policy])
        ax.set_xlabel(name)
        ax.xaxis.set_major_locator(MaxNLocator(3))
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    legend_below(fig, dict(zip(labels, handles, strict=True)))
    return finish_plot("fig-instability", title, caption, fig)


ROLE_PANELS = (
    ("reward", "reward"),
    ("grad_norm", "grad norm"),
    ("chi2_update", "chi2 update"),
    ("entropy", "entropy"),
    ("length_mean", "mean length"),
)


def _role_keys(run: CellRun) -> list[str]:
    """The roles (or adapters) a run logged per-role training metrics for, in log order."""
    roles: dict[str, None] = {}
    for record in run.records:
        for key in record:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "train" and parts[1] != "all":
                roles.setdefault(parts[1])
    return list(roles)


def role_figures(res: GridRuns) -> list[Plot]:
    """Per-role time series of every trained cell (IP, SP, SA-RL), in index order."""
    runs = [res.runs[i.name] for i in res.ids if i.name in res.runs and i.kind in TRAINED_KINDS]
    return [
        _roles(run) for run in runs if any(k.startswith("train/") for r in run.records for k in r)
    ]


def _roles(run: CellRun) -> Plot:
    fig = new_figure(12.0, 2.9)
    axes = fig.subplots(1, len(ROLE_PANELS))
    roles = _role_keys(run)
    shown: dict[str, object] = {}
    for ax, (metric, name) in zip(axes, ROLE_PANELS, strict=True):
        for index, role in enumerate(roles):
            key = f"train/{role}/{metric}"
            if metric == "grad_norm" and any(
                f"train/{role}/grad_norm_own" in r for r in run.records
            ):
                key = f"train/{role}/grad_norm_own"
            pts = series(run.records, key)
            if pts:
                steps, vals = zip(*smoothed(pts, max(1, len(pts) // 15)), strict=True)
                (line,) = ax.plot(steps, vals, color=f"C{index % 10}", lw=1.2)
                shown.setdefault(role, line)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(4, integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(4))
        ax.tick_params(labelsize=8)
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    legend_below(fig, shown, most=6)
    fig.suptitle(run.id.name, fontsize=11)
    caption = (
        f"{run.id.name}: per-role training series over steps: reward, gradient norm (under a "
        "shared adapter each role's own), chi2 of the update, entropy and mean response length; "
        "each a trailing mean over a fifteenth of its points when it has 30 or more."
    )
    return finish_plot(
        f"fig-roles-{slug(run.id.name)}", f"Per-role series of {run.id.name}", caption, fig
    )
