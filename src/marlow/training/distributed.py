"""Data parallelism: the processes ``torchrun`` starts, and the few places where they meet.

``torchrun --nproc_per_node N -m marlow train ...`` (or ``marlow train --nproc N``) starts N
copies of the same run. Each takes a contiguous block of the step's problems (:meth:`Ranks.shard`:
every group stays on one rank, so group-relative advantages are local), samples, grades and scores
it, and the copies meet only where the algorithm needs all of them (docs/scaling.md):

* the update: mini-batches are cut from the *global* turn list with the same permutation on
  every rank, each rank weighs its rows with the whole mini-batch's normaliser, and the adapter's
  gradients are summed across ranks (one all-reduce per adapter per mini-batch, explicit rather
  than DDP: only the active adapter's parameters are in the graph) before the clip and the AdamW
  step, so every rank takes the same step and the adapters stay identical;
* metrics: each rank's sums and weights are merged (:meth:`marlow.diagnostics.metrics.Meter.merge`),
  never taken from rank 0 alone; validation episodes are gathered in global order;
* files and decisions: rank 0 alone writes the run folder (config, metrics, samples, signatures,
  events, checkpoints) and decides on alarms; the others follow its broadcast.

Samples equal a one-process run's only when each request carries its own seed
(``rollout.seeding=request``, required with more than one process: the default ``auto`` picks it
under torchrun, :func:`resolve_seeding`): then a two-process run and a
one-process run with the same global batch and seeds train the same adapters up to float
round-off (tests/integration/test_data_parallel.py). Backends: gloo for CPU runs, nccl for CUDA.
Timing metrics (``time/*``) and the code sandbox's error count are rank 0's own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from marlow.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's ``size`` processes (one process: no messages)."""

    rank: int = 0
    size: int = 1
    owned: bool = False  # join_ranks started the process group: leave() ends it

    def leave(self) -> None:
        """The run's last collective: wait for every rank, then end the process group these
        ranks started. A rank that exits with gloo's threads still running can abort at exit
        (SIGABRT, "terminate called without an active exception") after a finished run."""
        if self.size > 1 and self.owned and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> range:
        """This rank's contiguous block of ``n`` items (the first ``n % size`` ranks get one more)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor across ranks, in place (one message for all of them)."""
        if self.size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def all_(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank."""
        if self.size == 1:
            return flag
        return all(self.gather(flag))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (picklable objects)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


SOLO = Ranks()
"""One process: every collective is the identity."""


def resolve_seeding(config: RunConfig, size: int) -> tuple[RunConfig, str | None]:
    """``rollout.seeding=auto`` resolved for a run of ``size`` processes: ``request`` under
    several (data parallel needs it), ``call`` under one (so a one-process run samples exactly
    as before ``auto`` existed). Returns the config with the resolved value, which the run
    records in its ``config.yaml`` (so a resume or a re-read sees what ran), and the line to log
    once (None when nothing was resolved)."""
    if config.rollout.seeding != "auto":
        return config, None
    value = "request" if size > 1 else "call"
    rollout = config.rollout.model_copy(update={"seeding": value})
    why = (
        f"{size} data-parallel processes: each request samples from its own seed"
        if size > 1
        else "one process"
    )
    return config.model_copy(update={"rollout": rollout}), f"rollout.seeding=auto: {value} ({why})"


def check_ranks(config: RunConfig, size: int) -> None:
    """What a run needs to be split over ``size`` processes, refused in one line otherwise
    (``rollout.seeding=auto`` becomes ``request``: :func:`resolve_seeding`)."""
    if size == 1:
        return
    if config.rollout.seeding not in ("request", "auto"):
        raise ConfigError(
            f"config field 'rollout.seeding' is {config.rollout.seeding!r}, but a data-parallel "
            f"run ({size} processes) samples each request from its own seed; valid: request, "
            "auto"
        )
    if config.grpo.batch_problems < size:
        raise ConfigError(
            f"config field 'grpo.batch_problems' is {config.grpo.batch_problems}, fewer than the "
            f"{size} data-parallel processes; valid: at least {size}"
        )


def launched_size() -> int:
    """How many processes ``torchrun`` started (1 when it did not start this one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def bind_local_device() -> None:
    """Under torchrun on a CUDA machine, make this process's current GPU its LOCAL_RANK, so that
    ``device=cuda`` (or ``auto``) resolves to one GPU per process. Call before resolving the
    device."""
    if launched_size() > 1 and torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def join_ranks(device: torch.device) -> Ranks:
    """The ranks ``torchrun`` started this process among, joined (gloo for a CPU device, nccl for
    CUDA), or one process alone."""
    size = launched_size()
    if size == 1:
        return Ranks()
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Ranks(dist.get_rank(), dist.get_world_size(), owned)
