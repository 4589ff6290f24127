"""Score turns under the current policy: per-token log-probs and entropies of the completions.

Each turn is scored on exactly the token ids the sampler saw (prompt + completion), right-padded
(the step's batch record, :mod:`marlow.training.batch`). Completion token j of a turn with prompt
length P is predicted by the logits at position P + j - 1. Logits are divided by the sampling
temperature, as verl does, so the ratio in the loss compares the same distribution the sampler
drew from.

The head: where the model's logits are its plain linear head on the decoder's last hidden state
(:func:`marlow.models.decoder_and_head`: Qwen3, Qwen2, Llama, Mistral, the head not
LoRA-wrapped), only the hidden states of the completion tokens go through the head, a chunk of
tokens at a time
(:func:`marlow.algo.estimators.head_logprobs_and_entropy`), so a micro-batch never holds its
(tokens, vocabulary) logits, in the forward or for the backward: memory grows with the chunk,
not with tokens x vocabulary. Any other model is scored from its whole logits
(:func:`marlow.algo.estimators.token_logprobs_and_entropy`). The two agree to float round-off
(tests).

Precision: the logits come in the base's dtype (bfloat16 under ``dtype=bfloat16``); they are cast
to float32 before the temperature and the log-softmax, so log-probs and entropies are float32
whatever the base's dtype, on the model's device.

Turns are sorted by length and cut into micro-batches of at most ``micro_tokens`` padded tokens
with little padding (memory and speed only: the result is the same up to float round-off). Under a
Shared-Policy this matters: long aggregator prompts and short voter turns would otherwise share one
padded batch (measured: twice the learn time of the same turns under IP).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from marlow.config.schema import MICRO_TOKENS_OFF_CUDA
from marlow.models import completion_logprobs
from marlow.training.batch import AdapterBatch, Chunk

MAX_PAD_WASTE = 0.25  # at most this share of a micro-batch's padded tokens is padding


@dataclass
class Scored:
    logp: torch.Tensor  # (T, L) float32 log-prob of each completion token; 0 on padding
    entropy: torch.Tensor | None  # (T, L) float32 entropy of the tempered policy; 0 on padding;
    # None where the pass was asked for none (``entropy=False``)
    mask: torch.Tensor  # (T, L) bool, True on real completion tokens


def score_chunk(
    model, chunk: Chunk, temperature: float, share_prompts: bool = True, entropy: bool = True
) -> Scored:
    """Log-probs (with gradient when enabled) and entropies of one micro-batch's completions
    (:func:`marlow.models.completion_logprobs`; ``share_prompts``: rows with the same prompt
    forward it once where that is cheaper; ``entropy`` False: none computed)."""
    logp, ent = completion_logprobs(
        model,
        chunk.ids,
        chunk.attention,
        chunk.prompt_len,
        chunk.targets,
        chunk.mask,
        temperature,
        share_prompts,
        entropy,
    )
    return Scored(logp, ent, chunk.mask)


def micro_batches(
    lengths: Sequence[int],
    micro_tokens: int | Literal["auto"],
    max_waste: float = MAX_PAD_WASTE,
    keys: Sequence[Hashable] | None = None,
) -> list[list[int]]:
    """Indices of rows of the given sequence ``lengths`` cut into micro-batches: sorted by length,
    so that rows of similar length share a batch. A batch closes when its padded size would pass
    ``micro_tokens`` or when padding would exceed ``max_waste`` of it. Each index appears exactly
    once. With ``keys`` (one per row), rows are first split by key (in order of first
    appearance): no batch mixes two keys, and the batches of one key come one after another.
    ``micro_tokens="auto"`` (a config's, not sized to a card): :data:`MICRO_TOKENS_OFF_CUDA`."""
    if micro_tokens == "auto":
        micro_tokens = MICRO_TOKENS_OFF_CUDA
    buckets: dict[Hashable, list[int]] = {}
    for i in range(len(lengths)):
        buckets.setdefault(None if keys is None else keys[i], []).append(i)
    chunks: list[list[int]] = []
    for members in buckets.values():
        current: list[int] = []
        used = 0  # real tokens in ``current``
        for i in sorted(members, key=lambda i: lengths[i]):
            padded = lengths[i] * (len(current) + 1)  # ascending order: this row is the longest
            if current and (
                padded > micro_tokens or padded - used - lengths[i] > max_waste * padded
            ):
                chunks.append(current)
                current, used = [], 0
            current.append(i)
            used += lengths[i]
        if current:
            chunks.append(current)
    return chunks


def score_rows(
    model,
    batch: AdapterBatch,
    rows: Sequence[int],
    *,
    temperature: float,
    micro_tokens: int | Literal["auto"],
    keys: Sequence[Hashable] | None = None,
    share_prompts: bool = True,
    entropy: bool = True,
) -> Iterator[tuple[list[int], Scored]]:
    """Score ``rows`` of ``batch`` in micro-batches (see :func:`micro_batches`), lazily: yields
    (indices into ``rows``, Scored of those rows in that order). A caller that backpropagates can
    free each chunk's graph before the next is built. ``keys`` (one per row of ``rows``, e.g. its
    role) keeps micro-batches key-pure and each key's consecutive. ``share_prompts`` and
    ``entropy``: as :func:`score_chunk`."""
    rows = list(rows)
    lengths = [batch.seq_len[i] for i in rows]
    for local in micro_batches(lengths, micro_tokens, keys=keys):
        chunk = batch.chunk([rows[j] for j in local])
        yield local, score_chunk(model, chunk, temperature, share_prompts, entropy)
