"""The tiny worlds a grid's cells need, pre-trained once each before the cells start.

Without this the first cell would pre-train on one thread while the others wait for its lock.
Each world trains in a child process of its own: a grid process that pre-trained in-process
stood at 9.5 GiB resident during its second world (tiny-m math, after tiny-m code) and would
have held that for the rest of the grid. Ray cells pre-train on their own node instead: its
cache is its own.
"""

from __future__ import annotations

from collections.abc import Callable

from marlow.grids.cell_process import die_with_parent
from marlow.grids.grid import Cell


def pretrain_worlds(cells: list[Cell], log: Callable[[str], None]) -> None:
    """Pre-train each tiny (scale, task, steps, batch) the cells need and neither the shipped
    worlds (``model.world``: :func:`marlow.models.tiny_world`) nor the cache hold, one child
    process each, with the recipe's threads (``marlow.tiny.pretrain.THREADS``); a failure is
    logged (its cells will try again and record the error themselves)."""
    import multiprocessing

    from marlow.config import ModelConfig
    from marlow.models import is_tiny, pretrain_notice, task_family, tiny_world_folder

    needed = {}
    for c in cells:
        model, task = c.config.model, task_family(c.config.model, c.config.task)
        if is_tiny(model.name) and model.world != "shipped":  # shipped: nothing to pre-train
            key = (model.name, task, model.pretrain_steps, model.pretrain_batch)
            needed.setdefault(tiny_world_folder(model, task), key)
    for folder, (scale, task, steps, batch) in sorted(needed.items(), key=str):
        if (folder / "meta.json").exists():  # a shipped world, or one in the cache
            continue
        model = ModelConfig(name=scale, pretrain_steps=steps, pretrain_batch=batch)
        log(pretrain_notice(model, task) or f"pre-training {scale} ({task})")
        child = multiprocessing.get_context("spawn").Process(
            target=_pretrain_world, args=(scale, task, steps, batch), daemon=True
        )
        child.start()
        child.join()
        if child.exitcode != 0:
            log(f"pre-training {scale} ({task}) failed (exit {child.exitcode})")


def _pretrain_world(scale: str, task: str, steps: int | None, batch: int | None) -> None:
    """Body of a pre-training child: progress lines go to the grid's standard output."""
    from marlow.tiny.pretrain import pretrain_tiny

    die_with_parent()
    pretrain_tiny(scale, steps=steps, batch=batch, task=task, log=lambda m: print(m, flush=True))
