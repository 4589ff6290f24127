"""``marlow quickstart``: a real, small training comparison on the tiny world.

1. pre-train (or load from cache) the tiny model;
2. evaluate the base model through Voting (the base control);
3. train Voting-IP, Voting-SP and Single (the SA-RL control) with the tiny preset;
4. write ``summary.json`` (peak and final validation accuracy of each, with the evaluation size)
   and ``val_curves.png`` into the output folder.

Cells run in parallel worker processes when the machine has the cores (one torch thread each);
each cell is an ordinary run folder under ``cells/``.

``task="code"`` runs the same four cells on the tiny code world (its own pre-trained model,
``marlow.tiny.codecorpus``) with :data:`CODE_SETTINGS` under the tiny preset; cells are named
``...-Code``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

from marlow.config import ConfigError, RunConfig, merge, resolve
from marlow.diagnostics.runstats import run_statistics, series
from marlow.train.trainer import Trainer, read_metrics

Log = Callable[[str], None]

SCALE = "tiny-s"  # the default; model.name=tiny-m (or tiny-l) in the settings picks another
TASKS = ("math", "code")
CODE_SETTINGS: dict = {
    # 200 validation problems: grading runs programs in the sandbox (~20 ms of a core each)
    "task": {"name": "code", "val_size": 200},
    # a tiny code answer is at most ~100 characters, a synthesizer's ~120
    "rollout": {"max_new_tokens": 128},
}


def cell_configs(
    seed: int = 0, steps: int | None = None, settings: dict | None = None, task: str = "math"
) -> dict[str, RunConfig]:
    """The four quickstart cells, named as SPEC §1 says. ``settings`` (nested dict) applies to
    all; ``model.name`` may pick another tiny scale; ``task`` is math or code."""
    from marlow.tiny.model import SCALES

    if task not in TASKS:
        raise ConfigError(f"quickstart task is {task!r}; valid: {', '.join(TASKS)}")
    base = merge(CODE_SETTINGS, settings or {}) if task == "code" else dict(settings or {})
    if base.get("task", {}).get("name", task) != task:
        raise ConfigError(f"task.name {base['task']['name']!r} contradicts quickstart task {task}")
    common = {"preset": "tiny", "seed": seed, **base}
    common["model"] = {"name": SCALE, **common.get("model", {})}
    scale = common["model"]["name"]
    if scale not in SCALES:
        raise ConfigError(
            f"quickstart runs on the tiny world: model.name is {scale!r}; valid: {', '.join(SCALES)}"
        )
    if steps is not None:
        common["steps"] = steps
    t = task.capitalize()
    cells = {
        f"Voting-Base-{scale}-{t}": {
            "workflow": {"name": "voting"},
            "policy": {"routing": "base"},
            "steps": 0,
        },
        f"Single-SA-{scale}-{t}": {"workflow": {"name": "single"}, "policy": {"routing": "ip"}},
        f"Voting-IP-{scale}-{t}": {"workflow": {"name": "voting"}, "policy": {"routing": "ip"}},
        f"Voting-SP-{scale}-{t}": {"workflow": {"name": "voting"}, "policy": {"routing": "sp"}},
    }
    return {name: resolve(merge(common, over)) for name, over in cells.items()}


def _run_cell(name: str, config_json: str, out: str, threads: int) -> str:
    import torch

    torch.set_num_threads(threads)
    config = RunConfig.model_validate_json(config_json)
    Trainer(config, out).run(resume=True)
    return name


def last_step(run_dir: Path) -> int:
    """The last step a cell has logged (0 before it starts)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)
    try:
        return int(json.loads(lines[-1])["step"])
    except (ValueError, KeyError):
        return 0  # a line being written


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


def plot_curves(cells: dict[str, Path], path: Path, task: str = "math") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, run_dir in cells.items():
        curve = accuracy_curve(run_dir)
        steps, acc = zip(*curve, strict=True)
        if len(curve) == 1:
            ax.axhline(acc[0], linestyle="--", color="gray", label=f"{name} (untrained)")
        else:
            ax.plot(steps, acc, marker="o", label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"marlow quickstart: tiny {task}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def quickstart(
    out: str | Path = "marlow-quickstart",
    *,
    seed: int = 0,
    steps: int | None = None,
    workers: int | None = None,
    settings: dict | None = None,
    task: str = "math",
    log: Log | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Run the comparison on the tiny ``task`` world (math or code); returns the summary
    written to ``out/summary.json``."""
    log = log or (lambda _m: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    from marlow.tiny.pretrain import pretrain_tiny

    configs = cell_configs(seed, steps, settings, task)
    model = next(iter(configs.values())).model
    pretrain_tiny(model.name, steps=model.pretrain_steps, log=log, task=task)
    timings["pretrain_or_cache_s"] = time.perf_counter() - t0
    dirs = {name: out / "cells" / name for name in configs}
    # Every cell in its own process with one torch thread: tiny models gain nothing from
    # intra-op threads, and processes with several threads each on few cores slow down 10x+
    # (MEASURED.md). The OS shares the cores; the cells finish at about the same time.
    workers = workers or len(configs)
    t1 = time.perf_counter()
    log(f"training {len(configs)} cells in {workers} process(es), one thread each")
    # spawn, not fork: the parent has run torch (pretraining) and forked OpenMP pools can hang
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        futures = {
            pool.submit(_run_cell, name, cfg.model_dump_json(), str(dirs[name]), 1): name
            for name, cfg in configs.items()
        }
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=2.0, return_when=FIRST_COMPLETED)
            for f in finished:
                f.result()  # a failed cell fails the quickstart, with its own error
                log(f"cell done: {futures[f]}")
            if on_progress is not None:
                for name, cfg in configs.items():
                    on_progress(name, last_step(dirs[name]), cfg.steps)
    timings["cells_s"] = time.perf_counter() - t1
    summary = {"task": task, "cells": summarize(dirs), "timings_s": timings}
    summary["voting_gain_over_base"] = gains_over_base(summary["cells"])
    summary["timings_s"]["total_s"] = time.perf_counter() - t0
    plot_curves(dirs, out / "val_curves.png", task)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "summary.json")
    return summary
