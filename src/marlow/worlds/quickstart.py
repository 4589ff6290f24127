"""``marlow quickstart``: a real, small training comparison on the tiny world.

1. load the tiny world marlow ships for the quickstart (``marlow.tiny.shipped``; with
   ``model.world=rebuild``, or a recipe marlow does not ship, pre-train it or take it from the cache);
2. evaluate the base model through Voting and Single (the base controls);
3. train Voting-IP, Voting-SP and Single (the SA-RL control) with the tiny preset;
4. write ``summary.json`` (peak and final validation accuracy of each, with the evaluation size)
   and ``val_curves.png`` into the output folder.

The quickstart is a small grid (:func:`quickstart_grid`) run by the grid runner: every cell in
its own process, one torch thread each; the output folder is a grid results folder (``index.json``,
``cells/NAME/``), so an interrupted quickstart run again finishes only what was missing.

Every cell runs under the ``quickstart`` preset (``marlow.config.presets.PRESETS``): the tiny preset
for 12 steps (1 warm-up step) on a tiny-s world pre-trained with a quick recipe (8 x 4800, half the
tokens of the full 64 x 1200 one), so that a cold quickstart fits 5 minutes on 2 cores (shipped: it is not
pre-trained at all unless asked). The
quick recipe is tiny-s's: another scale picked with ``model.name`` pre-trains with its full
recipe unless ``model.pretrain_batch``/``model.pretrain_steps`` are given.

``task="code"`` runs the same cells on the tiny code world (its own pre-trained model,
``marlow.tiny.codecorpus``) under the preset's code overlay, which is the tiny preset's; cells
are named ``...-Code``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import get_args

from marlow.choices import BuiltinTask
from marlow.config import ConfigError, RunConfig
from marlow.diagnostics.runstats import run_statistics, series
from marlow.diagnostics.sinks import read_metrics
from marlow.fileio import write_json
from marlow.grids.grid import GridSpec, expand
from marlow.grids.runner import run_grid

Log = Callable[[str], None]

SCALE = "tiny-s"  # the default; model.name=tiny-m (or tiny-l) in the settings picks another
TASKS: tuple[str, ...] = get_args(BuiltinTask)
PRESET = "quickstart"  # every cell's preset (marlow.config.presets.PRESETS), with its task overlay


def quickstart_grid(
    seed: int = 0, steps: int | None = None, settings: dict | None = None, task: str = "math"
) -> GridSpec:
    """The quickstart as a grid: Voting under IP and SP, with the base and SA-RL controls, on
    one tiny scale. ``settings`` (nested dict) applies to every cell; ``model.name`` may pick
    another tiny scale; ``task`` is math or code."""
    from marlow.tiny.model import SCALES

    if task not in TASKS:
        raise ConfigError(f"quickstart task is {task!r}; valid: {', '.join(TASKS)}")
    base = dict(settings or {})
    if base.get("task", {}).get("name", task) != task:
        raise ConfigError(f"task.name {base['task']['name']!r} contradicts quickstart task {task}")
    model = dict(base.get("model", {}))
    scale = model.pop("name", SCALE)
    if scale not in SCALES:
        raise ConfigError(
            f"quickstart runs on the tiny world: model.name is {scale!r}; valid: {', '.join(SCALES)}"
        )
    if scale != SCALE:  # the preset's quick pre-training recipe is tiny-s's
        model = {"pretrain_batch": None, "pretrain_steps": None, **model}
    shared = {"preset": PRESET, **base, "model": model}
    if steps is not None:
        shared["steps"] = steps
    return GridSpec(
        workflows=["voting"],
        policies=["ip", "sp"],
        scales=[scale],
        tasks=[task],
        seeds=[seed],
        controls=["base", "sa-rl"],
        settings=shared,
    )


def cell_configs(
    seed: int = 0, steps: int | None = None, settings: dict | None = None, task: str = "math"
) -> dict[str, RunConfig]:
    """The quickstart's cells by name, with their resolved configs."""
    return {c.name: c.config for c in expand(quickstart_grid(seed, steps, settings, task))}


def accuracy_curve(run_dir: Path) -> list[tuple[int, float]]:
    return series(read_metrics(run_dir), "val/all/accuracy")


def summarize(cells: dict[str, Path]) -> dict:
    """Per cell: validation peak/final (``run_statistics``), first accuracy, evaluation size, and
    the run-level instability statistics."""
    summary: dict[str, dict] = {}
    for name, run_dir in cells.items():
        records = read_metrics(run_dir)
        stats = run_statistics(records)
        val = stats["val"]
        summary[name] = {
            "peak_accuracy": val["peak_accuracy"],
            "peak_step": val["peak_step"],
            "final_accuracy": val["final_accuracy"],
            "final_step": val["final_step"],
            "first_accuracy": series(records, "val/all/accuracy")[0][1],
            "n_val": int(
                next(r["val/all/n_problems"] for r in records if "val/all/n_problems" in r)
            ),
            "max_chi2": stats["max_chi2"],
            "max_grad_norm": stats["max_grad_norm"],
            "entropy_collapse_depth": stats["entropy_collapse_depth"],
        }
    return summary


def gains_over_base(cells: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Accuracy points each trained Voting cell gains over the base model through Voting."""
    base = next(row for name, row in cells.items() if name.startswith("Voting-Base"))
    return {
        name: {
            "peak_minus_base": round(100 * (row["peak_accuracy"] - base["peak_accuracy"]), 1),
            "final_minus_base": round(100 * (row["final_accuracy"] - base["peak_accuracy"]), 1),
        }
        for name, row in cells.items()
        if name.startswith("Voting-") and not name.startswith("Voting-Base")
    }


BASE_STYLES = {"Voting": ("k", ":"), "Single": ("#8c564b", "-.")}
"""The untrained models' lines: each base its own colour and dashes (through Voting: black
dotted; as a single agent: brown dash-dot), apart from the trained cells' colours (by policy)."""
POLICY_COLORS = {"IP": "C0", "SP": "C1", "SA": "C2"}  # as in marlow report's figures


def plot_curves(cells: dict[str, Path], path: Path, task: str = "math") -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, run_dir in cells.items():
        curve = accuracy_curve(run_dir)
        steps, acc = zip(*curve, strict=True)
        if len(curve) == 1:
            color, dashes = BASE_STYLES.get(name.split("-")[0], ("0.5", "--"))
            ax.axhline(acc[0], ls=dashes, color=color, lw=1.4, label=f"{name} (untrained)")
        else:
            policy = name.split("-tiny")[0].rsplit("-", 1)[-1]
            ax.plot(steps, acc, marker="o", color=POLICY_COLORS.get(policy, "C4"), label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"marlow quickstart: tiny {task}")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)  # fileio writes text; a figure is saved by matplotlib itself


def quickstart(
    out: str | Path = "marlow-quickstart",
    *,
    seed: int = 0,
    steps: int | None = None,
    workers: int | None = None,
    settings: dict | None = None,
    task: str = "math",
    log: Log | None = None,
    on_progress: Callable[[str, str, int, int], None] | None = None,
) -> dict:
    """Run the comparison on the tiny ``task`` world (math or code); returns the summary
    written to ``out/summary.json``. ``on_progress(cell, state, step, total)``: the grid
    runner's progress callback."""
    log = log or (lambda _m: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    from marlow.models import tiny_world

    grid = quickstart_grid(seed, steps, settings, task)
    cells = expand(grid)
    tiny_world(cells[0].config.model, task, log)  # the shipped world (checked), or pre-trained
    timings["pretrain_or_cache_s"] = time.perf_counter() - t0
    dirs = {c.name: out / "cells" / c.name for c in cells}
    # Every cell at once, one torch thread each on every machine: tiny models gain nothing from
    # intra-op threads, processes with several threads each on few cores slow down 10x+, and the
    # thread count changes float sums, so the quickstart's measured accuracies need one. The OS
    # shares the cores; the cells finish at about the same time.
    t1 = time.perf_counter()
    states = run_grid(
        grid,
        out,
        workers=workers or len(cells),
        threads=1,
        log=log,
        on_progress=on_progress,
    )
    failed = [name for name, state in states.items() if state != "done"]
    if failed:
        raise RuntimeError(
            f"quickstart cell {failed[0]} failed: see {out / 'cells' / failed[0] / 'error.txt'}"
        )
    timings["cells_s"] = time.perf_counter() - t1
    summary = {"task": task, "cells": summarize(dirs), "timings_s": timings}
    summary["voting_gain_over_base"] = gains_over_base(summary["cells"])
    summary["timings_s"]["total_s"] = time.perf_counter() - t0
    plot_curves(dirs, out / "val_curves.png", task)
    write_json(out / "summary.json", summary)
    return summary
