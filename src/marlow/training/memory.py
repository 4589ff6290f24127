"""Peak device memory of each phase of a training step, as metrics.

On a CUDA device a phase starts by resetting the caching allocator's peak statistics and ends by
reading them, so that each step's record carries, per phase (``rollout``, ``learn``), in GiB:

* ``memory/<phase>_peak_allocated_gib``: the most memory tensors held at once
  (``torch.cuda.max_memory_allocated``), the quantity ``marlow plan`` predicts;
* ``memory/<phase>_peak_reserved_gib``: the most the allocator held from the card, cached free
  blocks included (``torch.cuda.max_memory_reserved``), what the card must have.

Both count everything resident during the phase, the base weights, adapters and optimizer state
too. Other devices have no such per-device statistics, so there the functions do nothing and
the record has no ``memory/*`` keys. Each process reads its own device: in a data-parallel run
the record holds rank 0's, as for the ``time/*`` metrics.
"""

from __future__ import annotations

import torch

GIB = 2**30


def start_phase(device: torch.device) -> None:
    """Reset ``device``'s peak memory statistics (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def phase_peaks(device: torch.device, phase: str) -> dict[str, float]:
    """The peaks since :func:`start_phase` as ``memory/<phase>_peak_*_gib`` metrics; ``{}`` off
    CUDA."""
    if device.type != "cuda":
        return {}
    return {
        f"memory/{phase}_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
        f"memory/{phase}_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
    }
