"""Running a grid's cells into one results folder, on local processes or on Ray.

:func:`run_grid` expands the grid, takes the folder's lock, refuses a folder whose cells ran
under other settings, pre-trains the tiny worlds the cells need, and drives a pool: ready cells
are submitted up to the pool's width, and each one is recorded in the index as it ends. Running
a grid again skips cells with ``DONE``, resumes the others from their last checkpoint
(``Trainer.run(resume=True)`` continues exactly as if never stopped) and retries failed ones. A
transfer cell waits for its SA-RL cell; when that failed, the transfer fails with a message
naming it. An interrupt (SIGINT to the grid process, whether from a terminal's Ctrl-C or
``kill -INT``) stops the running cells' processes, marks those cells ``pending`` in the index
(with the step each reached: a choice of marlow, so the index never says ``running`` for a cell
nothing runs) and re-raises, so the caller exits; the next run resumes them.

The pieces, one concern each: :mod:`~marlow.grids.results_folder` (the folder, its index
and lock), :mod:`~marlow.grids.pools` (local processes or Ray, and how many at once),
:mod:`~marlow.grids.cell_process` (one cell in its own process),
:mod:`~marlow.grids.pretraining` (tiny worlds pre-trained before the cells).
"""

from __future__ import annotations

import os
import shutil
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from marlow.fileio import write_text
from marlow.grids.grid import Cell, CellResources, GridSpec, expand
from marlow.grids.pools import RUNNERS, LocalPool, Pool, RayPool, plan_workers
from marlow.grids.pretraining import pretrain_worlds
from marlow.grids.results_folder import GridIndex, last_step, locked, refuse_changed_cells

Progress = Callable[[str, str, int, int], None]  # (cell, state, step, total)
Log = Callable[[str], None]


def run_grid(
    grid: GridSpec,
    out: str | Path,
    *,
    runner: str = "local",
    workers: int | None = None,
    threads: int | None = None,
    address: str | None = None,
    grid_text: str | None = None,
    log: Log | None = None,
    on_progress: Progress | None = None,
) -> dict[str, str]:
    """Run every unfinished cell of ``grid`` into ``out``; returns each cell's final state.
    ``threads``: torch threads per cell (default: the cores shared among the ``workers``)."""
    if runner not in RUNNERS:
        from marlow.config import ConfigError

        raise ConfigError(f"runner {runner!r} is unknown; valid: {', '.join(RUNNERS)}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers (cells at once) must be >= 1, got {workers}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads per cell must be >= 1, got {threads}")
    log = log or (lambda _m: None)
    cells = expand(grid)
    root = Path(out).absolute()  # the cells' folders, wherever a worker's directory is
    with _left_as_found(root), locked(root):
        if grid_text is not None:
            write_text(root / "grid.yaml", grid_text)
        refuse_changed_cells(root, cells)
        index = GridIndex(root, cells, grid)
        index.write_index()
        todo = [c for c in cells if index.state[c.name] != "done"]
        skipped = len(cells) - len(todo)
        if skipped:
            log(f"{skipped} of {len(cells)} cells already done: skipped")
        if todo and runner == "local":
            pretrain_worlds(todo, log)
        if todo:
            n = workers if workers is not None else plan_workers(todo)
            if threads is None:
                threads = max(1, (os.cpu_count() or 1) // n)
            log(f"running {len(todo)} cells, {n} at a time, {threads} thread(s) each ({runner})")
            if runner == "local" and grid.resources != CellResources():
                log("resources are what each cell asks Ray for; the local runner ignores them")
            pool: Pool = (
                LocalPool(n) if runner == "local" else RayPool(n, threads, address, grid.resources)
            )
            try:
                _drive(pool, todo, index, threads, log, on_progress)
            finally:
                pool.close()
        return dict(index.state)


@contextmanager
def _left_as_found(root: Path) -> Iterator[None]:
    """A results folder that this grid makes is removed again where the grid fails (or is
    interrupted) before any cell began: a failed start, such as a Ray address where no cluster
    answers, leaves nothing behind. A folder that existed, or where a cell began, stays."""
    fresh = not root.exists()
    try:
        yield
    except BaseException:
        if fresh and not (root / "cells").exists():
            shutil.rmtree(root, ignore_errors=True)
        raise


def _drive(
    pool: Pool,
    todo: list[Cell],
    index: GridIndex,
    threads: int,
    log: Log,
    on_progress: Progress | None,
) -> None:
    """Submit ready cells up to the pool's width; record each one as it ends."""
    waiting = list(todo)
    running: dict[Any, Cell] = {}  # pool handle -> its cell
    try:
        while waiting or running:
            _submit_ready(pool, waiting, running, index, threads, log)
            if not running:
                continue
            for handle in pool.wait(list(running), timeout=1.0):
                _record_end(pool, handle, running.pop(handle), index, log)
            if on_progress is not None:
                _show_progress(running.values(), index, on_progress)
    except KeyboardInterrupt:  # SIGINT to the grid (Ctrl-C, or kill -INT from a script)
        _interrupt(pool, running, index, log)
        raise


def _interrupt(pool: Pool, running: dict[Any, Cell], index: GridIndex, log: Log) -> None:
    """Stop the running cells' processes, then mark them ``pending`` in the index (with the
    step each reached), so that the index says what is true: nothing runs, and running the grid
    again resumes them from their last checkpoint. A cell that finished meanwhile (``DONE``)
    is recorded done."""
    pool.stop(list(running))
    for cell in running.values():
        if index.done(cell.name):
            index.set(cell.name, "done")
            continue
        step = last_step(index.dir(cell.name))
        index.set(cell.name, "pending", f"interrupted at step {step}; the grid resumes it")
    log(
        f"interrupted: stopped {len(running)} running cell(s); run the same `marlow grid` again "
        "to resume them from their last checkpoint"
    )


def _submit_ready(
    pool: Pool,
    waiting: list[Cell],
    running: dict[Any, Cell],
    index: GridIndex,
    threads: int,
    log: Log,
) -> None:
    """Fail the waiting cells whose needs failed; submit those whose needs are done, while the
    pool has room (both leave ``waiting``; submitted ones join ``running``)."""
    for cell in list(waiting):
        blocked = [n for n in cell.needs if index.state.get(n) == "failed"]
        if blocked:
            waiting.remove(cell)
            index.set(cell.name, "failed", f"needs {blocked[0]}, which failed")
            finished = sum(s in ("done", "failed") for s in index.state.values())
            log(f"[{finished}/{len(index.state)}] {cell.name}: failed (needs {blocked[0]})")
        elif len(running) < pool.workers and all(index.done(n) for n in cell.needs):
            waiting.remove(cell)
            sa_rl = str(index.dir(cell.needs[0])) if cell.needs else None
            args = (
                cell.describe(),
                cell.config.model_dump_json(),
                str(index.dir(cell.name)),
                threads,
                sa_rl,
            )
            running[pool.submit(cell, args)] = cell
            index.set(cell.name, "running")


def _record_end(pool: Pool, handle: Any, cell: Cell, index: GridIndex, log: Log) -> None:
    """A cell's process ended: done, or failed with its traceback in ``error.txt``."""
    try:
        pool.result(handle)
        index.set(cell.name, "done")
        finished = sum(s in ("done", "failed") for s in index.state.values())
        seconds = index.seconds[cell.name]
        took = "" if seconds is None else f" in {seconds:.0f} s"
        log(f"[{finished}/{len(index.state)}] {cell.name}: done{took}")
    except Exception as err:  # noqa: BLE001 - a cell's failure must not stop the grid
        message = f"{type(err).__name__}: {err}".splitlines()[0]
        error = index.dir(cell.name) / "error.txt"
        write_text(error, traceback.format_exc())
        index.set(cell.name, "failed", message)
        finished = sum(s in ("done", "failed") for s in index.state.values())
        log(f"[{finished}/{len(index.state)}] {cell.name}: failed: {message.rstrip('.')} ({error})")


def _show_progress(running: Iterable[Cell], index: GridIndex, on_progress: Progress) -> None:
    """Each running cell at its last logged step; each ended cell at its last step."""
    for cell in running:
        on_progress(cell.name, "running", last_step(index.dir(cell.name)), cell.config.steps)
    for name, state in index.state.items():
        if state in ("done", "failed"):
            c = index.cells[name]
            on_progress(name, state, c.config.steps, c.config.steps)
