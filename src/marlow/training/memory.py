"""Peak device memory of each phase of a training step, as metrics.

On a CUDA device a phase starts by resetting the caching allocator's peak statistics and ends by
reading them, so that each step's record carries, per phase (``rollout``, ``learn``), in GiB:

* ``memory/<phase>_peak_allocated_gib``: the most memory tensors held at once
  (``torch.cuda.max_memory_allocated``), the quantity ``marlow plan`` predicts;
* ``memory/<phase>_peak_reserved_gib``: the most the allocator held from the card, cached free
  blocks included (``torch.cuda.max_memory_reserved``), what the card must have;
* ``memory/<phase>_start_allocated_gib``: what tensors held when the phase began
  (``torch.cuda.memory_allocated``): the weights, adapters and optimizer state, and whatever
  the phase before left (so that a learn phase's peak above ``marlow plan``'s says whether it
  was there before the phase or made in it).

All three count everything resident, the base weights, adapters and optimizer state
too. Other devices have no such per-device statistics, so there the functions do nothing and
the record has no ``memory/*`` keys. Each process reads its own device: in a data-parallel run
the record holds rank 0's, as for the ``time/*`` metrics.

:class:`LiveBytes` counts, on any device, what the allocated peak measures on CUDA, for a
benchmark or a test (a Python call per operation: too slow for a run).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2**30


def card_memory(device: torch.device) -> int | None:
    """The bytes of ``device``'s memory where marlow sizes settings to it (``grpo.micro_tokens``
    and ``grpo.activation_checkpointing`` auto): a CUDA card's total, None on other devices."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def start_phase(device: torch.device) -> int | None:
    """Reset ``device``'s peak memory statistics and return the bytes tensors hold now (CUDA
    only; None elsewhere)."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def phase_peaks(device: torch.device, phase: str, start: int | None) -> dict[str, float]:
    """The peaks since :func:`start_phase` (which returned ``start``) and what was held when it
    was called, as ``memory/<phase>_*_gib`` metrics; ``{}`` off CUDA."""
    if device.type != "cuda":
        return {}
    return {
        f"memory/{phase}_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
        f"memory/{phase}_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        f"memory/{phase}_start_allocated_gib": (start or 0) / GIB,
    }


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors that operations make inside the context and that are alive at
    once, counted operation by operation (each storage once, from its first tensor until it is
    freed): ``peak``, the most over the whole context, and ``peaks``, the most while ``phase``
    held each name a caller set it to. Storages of ``before`` (tensors made before, such as the
    weights) are not counted, nor are their views. The CPU's counterpart of
    ``torch.cuda.max_memory_allocated`` less what was allocated before, without the allocator's
    rounding; what a device's kernels allocate for themselves (workspaces) is not seen."""

    def __init__(self, before: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.before = {t.untyped_storage().data_ptr() for t in before}
        self.live: dict[int, weakref.ref] = {}
        self.now = self.peak = 0
        self.phase: str | None = None
        self.peaks: dict[str, int] = {}

    def _forget(self, key: int, size: int) -> Callable[[weakref.ref], None]:
        def forget(_ref: weakref.ref) -> None:
            if self.live.pop(key, None) is not None:
                self.now -= size

        return forget

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in self.live and key not in self.before:
                self.live[key] = weakref.ref(storage, self._forget(key, size))
                self.now += size
        self.peak = max(self.peak, self.now)
        if self.phase is not None:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.now)
        return out
