"""Running a grid's cells into one results folder, on local processes or on Ray (SPEC §6).

The results folder::

    DIR/grid.yaml              the grid as given
    DIR/index.json             every cell: identity, state (pending|running|done|failed), error,
                               and, once done, seconds (wall time of the cell's last process)
    DIR/cells/NAME/            an ordinary run folder (config.yaml, metrics.jsonl, checkpoints/,
                               signatures/, events.jsonl) plus cell.json (the cell's identity),
                               log.txt (the trainer's log), error.txt (a failure's traceback)
                               and, once it has finished, DONE (JSON: its wall seconds)

``DONE`` is the only proof that a cell finished (written by the cell itself, last); the index
is a view the parent process rewrites atomically after every change. Running a grid again skips
cells with ``DONE``, resumes the others from their last checkpoint (``Trainer.run(resume=True)``
continues exactly as if never stopped) and retries failed ones. A transfer cell waits for its
SA-RL cell; when that failed, the transfer fails with a message naming it. A folder whose cells
ran under other settings than the grid now gives them (their ``config.yaml`` differs) is refused,
naming the cells and fields, so one table never mixes two grids.

Cell processes die with the grid process (Linux ``PR_SET_PDEATHSIG``), so a killed grid leaves
no orphan writing into the folder, and a lock file keeps two grid processes off one folder.

Sizing (local runner): workers = min(cores, cells ready, memory available * 0.8 / memory per
cell), torch threads per cell = cores // workers. Memory per cell is an estimate of marlow's,
not a measurement: 1.5 GiB for a tiny scale, 16 GiB for any other model (override with
``--workers``). Ray: each cell is a task asking for ``threads`` CPUs (and one GPU when
``model.device`` is CUDA: not yet, CPU only here).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from marlow.experiments.grid import Cell, GridSpec, expand
from marlow.fileio import write_json, write_text

Progress = Callable[[str, str, int, int], None]  # (cell, state, step, total)
Log = Callable[[str], None]
TINY_CELL_GIB = 1.5
OTHER_CELL_GIB = 16.0
RUNNERS = ("local", "ray")


# -- one cell, in its own process -----------------------------------------------------------------


def run_cell(cell_json: dict, config_json: str, out: str, threads: int, sa_rl: str | None) -> str:
    """Train or evaluate one cell into ``out``; the body of every local or Ray task."""
    import torch

    from marlow.config import RunConfig

    _die_with_parent()
    torch.set_num_threads(threads)
    started = time.monotonic()
    run_dir = Path(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "cell.json", cell_json)
    with open(run_dir / "log.txt", "a") as log_file:

        def log(message: str) -> None:
            log_file.write(f"{time.strftime('%H:%M:%S')} {message}\n")
            log_file.flush()

        _run(cell_json, RunConfig.model_validate_json(config_json), run_dir, sa_rl, log)
        seconds = round(time.monotonic() - started, 1)
        log(f"finished in {seconds} s")
    write_json(run_dir / "DONE", {"seconds": seconds})
    return cell_json["name"]


def _run(cell_json: dict, config, run_dir: Path, sa_rl: str | None, log) -> None:
    from marlow.policy.adapters import load_adapter_weights
    from marlow.train import checkpoint
    from marlow.train.trainer import Trainer

    trainer = Trainer(config, run_dir, log=log)
    if cell_json["kind"] == "transfer" and "generator" not in (config.policy.role_map or {}):
        log(f"{config.workflow.name} has no generator role: every role runs on the base model")
    elif cell_json["kind"] == "transfer":
        found = checkpoint.latest(Path(sa_rl)) if sa_rl else None
        if found is None:
            raise FileNotFoundError(f"SA-RL cell {sa_rl} has no checkpoint to transfer")
        load_adapter_weights(trainer.model, found / "adapters", ["generator"])
        log(f"generator adapter from {found}")
    trainer.run(resume=True)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the grid) dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a killed grid may leave its cells running
        pass


# -- pools ------------------------------------------------------------------------------------------


class Pool(Protocol):
    workers: int

    def submit(self, cell: Cell, args: tuple) -> Any: ...
    def wait(self, handles: list[Any], timeout: float) -> list[Any]: ...
    def result(self, handle: Any) -> str: ...
    def close(self) -> None: ...


class LocalPool:
    """Worker processes (spawned: no forked torch state), one cell each at a time."""

    def __init__(self, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.workers = workers
        ctx = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)

    def submit(self, cell: Cell, args: tuple) -> Any:
        return self._pool.submit(run_cell, *args)

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        done, _ = wait_futures(handles, timeout=timeout, return_when=FIRST_COMPLETED)
        return list(done)

    def result(self, handle: Any) -> str:
        return handle.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayPool:
    """Each cell a Ray task asking for its CPU threads; ``address`` None starts a local Ray."""

    def __init__(self, workers: int, threads: int, address: str | None) -> None:
        try:
            import ray
        except ImportError:
            from marlow.config import ConfigError

            raise ConfigError(
                "--runner ray needs Ray; install it with: pip install 'marlow[ray]'"
            ) from None
        self._ray = ray
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if address is None:
                kwargs["num_cpus"] = os.cpu_count() or 1
            ray.init(address=address, **kwargs)
        self.workers = workers
        self._task = ray.remote(num_cpus=threads, max_retries=0)(run_cell)

    def submit(self, cell: Cell, args: tuple) -> Any:
        return self._task.remote(*args)

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        done, _ = self._ray.wait(handles, num_returns=1, timeout=timeout)
        return done

    def result(self, handle: Any) -> str:
        return self._ray.get(handle)

    def close(self) -> None:
        self._ray.shutdown()


# -- the grid -------------------------------------------------------------------------------------


def plan_workers(cells: list[Cell], cores: int | None = None, mem_gib: float | None = None) -> int:
    """How many cells run at once on this machine (see the module docstring)."""
    from marlow.models import is_tiny

    cores = cores or os.cpu_count() or 1
    mem_gib = _available_gib() if mem_gib is None else mem_gib
    per_cell = max(TINY_CELL_GIB if is_tiny(c.config.model.name) else OTHER_CELL_GIB for c in cells)
    return max(1, min(cores, len(cells), int(mem_gib * 0.8 // per_cell)))


def _available_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 8.0


class GridIndex:
    """A running grid's bookkeeping: each cell's state, error and wall seconds, its folder, and
    ``index.json``, rewritten atomically after every change (what ``report`` later reads as
    :class:`marlow.report.results.GridRuns`)."""

    def __init__(self, root: str | Path, cells: list[Cell], grid: GridSpec) -> None:
        self.root = Path(root)
        self.cells = {c.name: c for c in cells}
        self.grid = grid
        self.state: dict[str, str] = {}
        self.error: dict[str, str | None] = {}
        self.seconds: dict[str, float | None] = {}  # a done cell's, read from its DONE once
        for c in cells:
            self.set(c.name, "done" if self.done(c.name) else "pending", write=False)

    def dir(self, name: str) -> Path:
        return self.root / "cells" / name

    def done(self, name: str) -> bool:
        return (self.dir(name) / "DONE").exists()

    def set(self, name: str, state: str, error: str | None = None, *, write=True) -> None:
        self.state[name], self.error[name] = state, error
        self.seconds[name] = self._read_seconds(name) if state == "done" else None
        if write:
            self.write_index()

    def _read_seconds(self, name: str) -> float | None:
        """A finished cell's wall seconds (its last process only: a resumed cell's earlier
        processes are not counted), or None."""
        try:
            return float(json.loads((self.dir(name) / "DONE").read_text())["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # a DONE from before marlow timed cells

    def write_index(self) -> None:
        cells = {
            name: {
                **c.describe(),
                "state": self.state[name],
                "error": self.error[name],
                "seconds": self.seconds[name],
                "path": f"cells/{name}",
            }
            for name, c in self.cells.items()
        }
        write_json(self.root / "index.json", {"grid": self.grid.model_dump(), "cells": cells})


@contextmanager
def _locked(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another marlow grid is running in {root}") from None
        yield


def run_grid(
    grid: GridSpec,
    out: str | Path,
    *,
    runner: str = "local",
    workers: int | None = None,
    address: str | None = None,
    grid_text: str | None = None,
    log: Log | None = None,
    on_progress: Progress | None = None,
) -> dict[str, str]:
    """Run every unfinished cell of ``grid`` into ``out``; returns each cell's final state."""
    if runner not in RUNNERS:
        from marlow.config import ConfigError

        raise ConfigError(f"runner {runner!r} is unknown; valid: {', '.join(RUNNERS)}")
    log = log or (lambda _m: None)
    cells = expand(grid)
    root = Path(out)
    with _locked(root):
        if grid_text is not None:
            write_text(root / "grid.yaml", grid_text)
        _refuse_changed_cells(root, cells)
        results = GridIndex(root, cells, grid)
        results.write_index()
        todo = [c for c in cells if results.state[c.name] != "done"]
        skipped = len(cells) - len(todo)
        if skipped:
            log(f"{skipped} of {len(cells)} cells already done: skipped")
        if todo and runner == "local":
            pretrain_worlds(todo, log)
        if todo:
            n = workers or plan_workers(todo)
            threads = max(1, (os.cpu_count() or 1) // n)
            log(f"running {len(todo)} cells, {n} at a time, {threads} thread(s) each ({runner})")
            pool: Pool = LocalPool(n) if runner == "local" else RayPool(n, threads, address)
            try:
                _drive(pool, todo, results, threads, log, on_progress)
            finally:
                pool.close()
        return dict(results.state)


def _refuse_changed_cells(root: Path, cells: list[Cell]) -> None:
    """A cell folder that ran (or began) under another config than the grid now gives it would
    be skipped or resumed under the wrong settings, mixing two grids in one table: refuse,
    naming the cells and the fields (``config.yaml`` is what each cell ran with)."""
    from marlow.config import ConfigError, differences, load_config

    changed = []
    for cell in cells:
        stored = root / "cells" / cell.name / "config.yaml"
        if stored.exists():
            diffs = differences(load_config(stored), cell.config)
            if diffs:
                changed.append(f"{cell.name} ({', '.join(diffs[:3])})")
    if changed:
        raise ConfigError(
            f"{len(changed)} cell(s) in {root} ran under other settings than this grid gives "
            f"them: {'; '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}. Use another "
            "--out, or delete those cell folders to run them again"
        )


def pretrain_worlds(cells: list[Cell], log: Log) -> None:
    """Pre-train each tiny (scale, task, steps) the cells need, once, with every core, before
    the cells start (else the first cell pre-trains on one thread while the others wait for its
    lock). Each world trains in a child process of its own: a grid process that pre-trained
    in-process stood at 9.5 GiB resident during its second world (tiny-m math, after tiny-m
    code) and would have held that for the rest of the grid. Ray cells pre-train on their own
    node instead: its cache is its own."""
    import multiprocessing

    from marlow.models import is_tiny
    from marlow.tiny.pretrain import tiny_path

    worlds = {
        (c.config.model.name, c.config.task.name, c.config.model.pretrain_steps)
        for c in cells
        if is_tiny(c.config.model.name)
    }
    for scale, task, steps in sorted(worlds, key=str):
        if (tiny_path(scale, steps=steps, task=task) / "meta.json").exists():
            continue
        child = multiprocessing.get_context("spawn").Process(
            target=_pretrain_world, args=(scale, task, steps), daemon=True
        )
        child.start()
        child.join()
        if child.exitcode != 0:  # its cells will try again and record the error themselves
            log(f"pre-training {scale} ({task}) failed (exit {child.exitcode})")


def _pretrain_world(scale: str, task: str, steps: int | None) -> None:
    """Body of a pre-training child: progress lines go to the grid's standard output."""
    from marlow.tiny.pretrain import pretrain_tiny

    _die_with_parent()
    pretrain_tiny(scale, steps=steps, task=task, log=lambda m: print(m, flush=True))


def _drive(
    pool: Pool,
    todo: list[Cell],
    results: GridIndex,
    threads: int,
    log: Log,
    on_progress: Progress | None,
) -> None:
    """Submit ready cells up to the pool's width; record each one as it ends."""
    waiting = list(todo)
    running: dict[Any, Cell] = {}
    while waiting or running:
        for cell in list(waiting):
            blocked = [n for n in cell.needs if results.state.get(n) == "failed"]
            if blocked:
                waiting.remove(cell)
                results.set(cell.name, "failed", f"needs {blocked[0]}, which failed")
                log(f"{cell.name}: failed (needs {blocked[0]})")
            elif len(running) < pool.workers and all(results.done(n) for n in cell.needs):
                waiting.remove(cell)
                sa_rl = str(results.dir(cell.needs[0])) if cell.needs else None
                args = (
                    cell.describe(),
                    cell.config.model_dump_json(),
                    str(results.dir(cell.name)),
                    threads,
                    sa_rl,
                )
                running[pool.submit(cell, args)] = cell
                results.set(cell.name, "running")
        if not running:
            continue
        for handle in pool.wait(list(running), timeout=1.0):
            cell = running.pop(handle)
            try:
                pool.result(handle)
                results.set(cell.name, "done")
                finished = sum(s in ("done", "failed") for s in results.state.values())
                seconds = results.seconds[cell.name]
                took = "" if seconds is None else f" in {seconds:.0f} s"
                log(f"[{finished}/{len(results.state)}] {cell.name}: done{took}")
            except Exception as err:  # noqa: BLE001 - a cell's failure must not stop the grid
                message = f"{type(err).__name__}: {err}".splitlines()[0]
                write_text(results.dir(cell.name) / "error.txt", traceback.format_exc())
                results.set(cell.name, "failed", message)
                log(f"{cell.name}: failed: {message}")
        if on_progress is not None:
            for cell in running.values():
                on_progress(
                    cell.name, "running", last_step(results.dir(cell.name)), cell.config.steps
                )
            for name, state in results.state.items():
                if state in ("done", "failed"):
                    c = results.cells[name]
                    on_progress(name, state, c.config.steps, c.config.steps)


def last_step(run_dir: Path) -> int:
    """The last step a cell has logged (0 before it starts)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    tail = path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        return int(json.loads(tail)["step"])
    except (ValueError, KeyError):
        return 0  # a line being written
