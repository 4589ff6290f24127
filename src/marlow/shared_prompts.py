"""Score the rows of a micro-batch that share a prompt with that prompt forwarded once.

A GRPO group samples one prompt several times, so most micro-batches hold several rows with the
same prompt. Scored one row a sequence, each row forwards its prompt again. Packed, the rows of
one prompt become one sequence: the prompt, then each row's completion in turn::

    prompt p0 .. pP-1 | row a: a0 .. aLa-2 | row b: b0 .. bLb-2 | ... | padding

A completion's tokens sit at the positions they have in their own sequence (P, P + 1, ...: the
rotary embedding sees the same positions), and attend to the prompt and to their own row's
earlier tokens only (a block mask), so each hidden state is that of the row's own sequence:
causal attention makes the prompt's activations independent of what follows it. The last
completion token of a row is not an input (it predicts nothing that is scored). Log-probs,
entropies and gradients equal the one-row-a-sequence forward's up to float round-off (tests);
the gradient of a shared prompt's activations is the sum over its rows, which autograd forms.

When it is used (:func:`pack_shared_prompts`), a choice of marlow: when the packed forward's
estimated arithmetic is smaller than the plain one's. Each layout is costed as
``tokens x linear + attended pairs x attention`` from the model's config, where ``linear`` is the
multiply-adds of a layer's projections and MLP per token and ``attention`` those of one
query-key pair (scores and values over every head); a layout attends every pair of its padded
width, since a masked attention computes them all. Packing cuts the tokens (a prompt once
instead of once per row) but lengthens the sequences, so it pays for short completions after
long shared prompts and not for long completions (at Qwen3-0.6B's widths, eight completions of
128 tokens after a 200-token prompt pack to 0.56 of the plain cost; of 512 tokens, to 1.34,
so they stay plain).

Only for models whose every layer attends to the whole sequence (no sliding window), with the
``sdpa`` or ``eager`` attention of transformers (a custom mask); any other model takes the
plain forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marlow.archs import Shape

PACKED_ATTENTION = ("sdpa", "eager")
"""transformers attention implementations that take a custom (batch, 1, query, key) mask."""


@dataclass(frozen=True)
class Packing:
    """The packed layout of a micro-batch's rows (:func:`pack_shared_prompts`)."""

    ids: torch.Tensor  # (G, W) long: one sequence per distinct prompt, right-padded
    positions: torch.Tensor  # (G, W) long: each token's position in its own row's sequence
    mask: torch.Tensor  # (G, 1, W, W): bool (sdpa) or additive float (eager) attention mask
    index: torch.Tensor  # (T, L) long: flat index into (G * W) of the state predicting token j


def packable(config) -> bool:
    """Whether a model of this config can be scored packed: every layer attends to the whole
    sequence, through an attention implementation that takes a custom mask."""
    if getattr(config, "_attn_implementation", None) not in PACKED_ATTENTION:
        return False
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or getattr(config, "use_sliding_window", True) is False


def layout_cost(config, sequences: int, width: int) -> float:
    """Estimated multiply-adds of one layer over ``sequences`` sequences of padded ``width``:
    tokens x (projections + MLP) + attended pairs x (scores + values over every head)."""
    s = Shape.of(config)
    linear = s.h * s.d * (2 * s.a + 2 * s.g) + 3 * s.h * s.I
    pair = 2 * s.a * s.d
    return sequences * width * linear + sequences * width * width * pair


def pack_shared_prompts(
    ids: torch.Tensor,
    prompt_len: torch.Tensor,
    mask: torch.Tensor,
    config,
    dtype: torch.dtype,
) -> Packing | None:
    """The packed layout of right-padded rows ``ids`` (T, S) with prompts of ``prompt_len`` (T,)
    and real completion tokens ``mask`` (T, L), or None when the plain layout is estimated
    cheaper (:func:`layout_cost`: always so when no two rows share a prompt) or the model is not
    :func:`packable`. ``dtype``: the hidden states' dtype, for the eager attention's additive
    mask. Rows share a prompt when their prompt token ids are equal."""
    if not packable(config):
        return None
    rows = ids.tolist()
    plen = prompt_len.tolist()
    if min(plen) < 1:  # no state predicts a first token: left to the plain layout
        return None
    clen = mask.sum(1).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for t, (row, p) in enumerate(zip(rows, plen, strict=True)):
        groups.setdefault(tuple(row[:p]), []).append(t)
    if len(groups) == len(rows):
        return None
    lengths = [len(p) + sum(max(clen[t] - 1, 0) for t in members) for p, members in groups.items()]
    width = max(lengths)
    plain = layout_cost(config, len(rows), ids.shape[1])
    if layout_cost(config, len(groups), width) >= plain:
        return None
    G = len(groups)
    packed = [[0] * width for _ in range(G)]
    positions = [[0] * width for _ in range(G)]
    segment = [[-2] * width for _ in range(G)]  # -1: prompt, t: row t's completion, -2: padding
    index = [[0] * mask.shape[1] for _ in range(len(rows))]
    for g, (prompt, members) in enumerate(groups.items()):
        P = len(prompt)
        packed[g][:P] = prompt
        positions[g][:P] = range(P)
        segment[g][:P] = [-1] * P
        at = P
        for t in members:
            n = max(clen[t] - 1, 0)  # completion tokens that are inputs: all but the last
            packed[g][at : at + n] = rows[t][P : P + n]
            positions[g][at : at + n] = range(P, P + n)
            segment[g][at : at + n] = [t] * n
            # token 0 is predicted by the prompt's last state, token j >= 1 by input j - 1
            index[t][: clen[t]] = [g * width + P - 1] + [g * width + at + j for j in range(n)]
            at += n
    device = ids.device
    seg = torch.tensor(segment, device=device)
    q = torch.arange(width, device=device)
    causal = q[None, :] <= q[:, None]  # (query, key)
    same = (seg[:, None, :] == -1) | (seg[:, None, :] == seg[:, :, None])  # (G, query, key)
    allowed = (causal[None] & same)[:, None]  # padding attends to the prompt and earlier padding
    if getattr(config, "_attn_implementation", None) == "eager":
        blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
        allowed = torch.where(allowed, torch.zeros((), dtype=dtype, device=device), blocked)
    return Packing(
        ids=torch.tensor(packed, device=device),
        positions=torch.tensor(positions, device=device),
        mask=allowed,
        index=torch.tensor(index, device=device),
    )
