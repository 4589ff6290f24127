"""The adapter-sync check: after each update the rollout engine must serve the new weights.

Every step, once the update is done, the trainer already scores one *probe* turn per adapter
under the updated policy (the shortest turn of its batch, :func:`marlow.training.grpo.probe_row`;
on diagnostics steps every turn). :func:`engine_drift` asks the rollout engine to score that
same turn (``RolloutEngine.score``, teacher-forced) and measures how far the two disagree;
:func:`check_sync` stops the run with :class:`AdapterSyncError` when an adapter's drift passes
the tolerance of the run's dtype. The cost is one short forward per adapter per step in the
engine and one read of the trainer's probe log-probs.

Drift = the mean absolute difference of the per-token log-probs over the probe's completion
tokens. Tolerances (:data:`TOLERANCE`, per base dtype), choices of marlow, not fixed by the
issue: an engine scoring through the trainer's own model (the HF backend) gives a drift of
exactly 0 when the trainer scored the probe alone, and round-off (measured 4e-8 to 8e-8 in
float32) on diagnostics steps, whose rescoring pads turns into micro-batches; the tolerances
are there for engines with their own kernels and batching (vLLM):

* ``float32``: 1e-4. Two float32 forwards of one sequence through different kernels agree to
  ~1e-6..1e-5 per log-prob; 1e-4 leaves a margin of ten.
* ``bfloat16``: 2e-2. Logits carry 8 mantissa bits: a logit of magnitude ~10 is rounded by up
  to ~0.02, and two independently rounded computations differ by about that on some tokens;
  the mean over a turn's tokens is smaller.
* ``float16``: 5e-3 (11 mantissa bits: about 8x tighter than bfloat16, with a margin).

The low-precision values are reasoned, not measured against a second engine: marlow ships only
the HF backend (drift 0). What the check catches: an engine serving stale weights (not reloaded
after the update), another adapter's weights, or the base. Measured on the test's tiny world
(float32, one update): a stale copy drifts 0.022 per token, swapped adapters 0.048. What it
cannot catch: a staleness smaller than the tolerance, i.e. an update that moved the probe's
log-probs less than it (that stale copy exceeds bfloat16's 2e-2 only by a hair; small
learning rates early in a run move less); the drift is logged per adapter as
``train/<adapter>/engine_drift`` so a trend shows. An adapter whose update left non-finite
log-probs is not compared (that update is undone, :mod:`marlow.training.nonfinite`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from marlow.rollout.base import RolloutEngine
from marlow.training.batch import AdapterBatch
from marlow.training.grpo import probe_logp, probe_row
from marlow.types import GenRequest

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


class AdapterSyncError(RuntimeError):
    """The rollout engine serves other weights than the trainer holds; one line."""


def engine_drift(
    engine: RolloutEngine, model, batch: AdapterBatch, new_logp: torch.Tensor | None = None
) -> float:
    """Mean |engine - trainer| log-prob over the probe turn's tokens, at temperature 1 (the
    raw logits' log_softmax: vLLM scores prompt tokens no other way). ``new_logp``: the trainer's
    updated log-probs of the probe turn at temperature 1 when it has them (the finiteness check's,
    :func:`marlow.training.grpo.probe_logp`); else they are computed here (one short forward)."""
    row = probe_row(batch)
    if new_logp is None:
        new_logp = probe_logp(model, batch, 1.0)
    ours = new_logp.tolist()  # one read of the device
    turn = batch.turns[row]
    request = GenRequest(prompt_ids=turn.prompt_ids, adapter=batch.adapter)
    theirs = engine.score([request], [turn.completion_ids], 1.0)[0]
    return sum(abs(a - b) for a, b in zip(ours, theirs, strict=True)) / max(len(ours), 1)


def check_sync(drifts: Sequence[dict[str, float]], dtype: str, step: int) -> dict[str, float]:
    """Every rank's drift per adapter (``World.gather``, so every rank decides alike) -> the
    step's ``train/<adapter>/engine_drift`` metrics (the largest over ranks); raises
    :class:`AdapterSyncError` naming the first adapter over the tolerance of ``dtype``."""
    worst: dict[str, float] = {}
    for rank in drifts:
        for adapter, drift in rank.items():
            drift = drift if drift == drift else math.inf  # NaN: the engine scored garbage
            worst[adapter] = max(worst.get(adapter, 0.0), drift)
    tol = TOLERANCE[dtype]
    for adapter in sorted(worst):
        if worst[adapter] > tol:
            raise AdapterSyncError(
                f"stopped at step {step}: the rollout engine does not serve adapter {adapter!r} "
                f"as updated: its log-probs of a probe turn differ from the trainer's by "
                f"{worst[adapter]:.3g} per token (tolerance {tol:g} for dtype={dtype}); it "
                "serves stale or other weights, so the step's samples would not come from the "
                "policy being trained. Check that the backend reloads the adapters after each "
                "update"
            )
    return {f"train/{a}/engine_drift": d for a, d in sorted(worst.items())}
