"""One grid cell, trained or evaluated in a process of its own: the body of every local or Ray
task of :mod:`marlow.grids.runner`.

A cell process dies with its parent (Linux ``PR_SET_PDEATHSIG``), and a local pool's worker also
with the grid process (:class:`marlow.grids.pools.LocalPool`), so a killed grid leaves no orphan
writing into the results folder. The cell writes ``cell.json`` first, appends the
trainer's log to ``log.txt`` and writes ``DONE`` (JSON: its wall seconds) last: ``DONE`` is the
only proof that a cell finished.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from marlow.fileio import write_json

if TYPE_CHECKING:
    from collections.abc import Callable

    from marlow.config import RunConfig


def run_cell(cell_json: dict, config_json: str, out: str, threads: int, sa_rl: str | None) -> str:
    """Train or evaluate one cell into ``out``; ``sa_rl`` is the folder of the SA-RL cell a
    transfer cell takes its generator adapter from. Returns the cell's name."""
    import torch

    from marlow.config import RunConfig

    die_with_parent()
    torch.set_num_threads(threads)
    started = time.monotonic()
    run_dir = Path(out).absolute()  # the cell's reward may change the working directory
    sa_rl = str(Path(sa_rl).absolute()) if sa_rl else None
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "cell.json", cell_json)
    with open(run_dir / "log.txt", "a") as log_file:

        def log(message: str) -> None:
            log_file.write(f"{time.strftime('%H:%M:%S')} {message}\n")
            log_file.flush()

        assigned = _ray_resources()
        if assigned is not None:
            log(f"ray resources: {json.dumps(assigned, sort_keys=True)}")
        config = RunConfig.model_validate_json(config_json)
        _train(cell_json["kind"], config, run_dir, sa_rl, log)
        seconds = round(time.monotonic() - started, 1)
        log(f"finished in {seconds} s")
    write_json(run_dir / "DONE", {"seconds": seconds})
    return cell_json["name"]


def _ray_resources() -> dict | None:
    """What Ray assigned this cell's task (None outside a Ray worker)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    ids = ray.get_runtime_context().get_assigned_resources()
    return {name: float(amount) for name, amount in ids.items()}


def _train(
    kind: str, config: RunConfig, run_dir: Path, sa_rl: str | None, log: Callable[[str], None]
) -> None:
    """Run the cell's trainer (resuming its last checkpoint); a transfer cell first loads the
    SA-RL cell's generator adapter."""
    from marlow.policy.adapters import load_adapter_weights
    from marlow.training import checkpoint
    from marlow.training.trainer import Trainer

    with Trainer(config, run_dir, log=log) as trainer:
        if kind == "transfer" and "generator" not in (config.policy.role_map or {}):
            log(f"{config.workflow.name} has no generator role: every role runs on the base model")
        elif kind == "transfer":
            found = checkpoint.latest(Path(sa_rl)) if sa_rl else None
            if found is None:
                raise FileNotFoundError(f"SA-RL cell {sa_rl} has no checkpoint to transfer")
            load_adapter_weights(trainer.model, found / "adapters", ["generator"])
            trainer.engine.refresh(["generator"])
            log(f"generator adapter from {found}")
        trainer.run(resume=True)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a killed grid may leave its cells running
        pass
