"""PPO clipped surrogate with clip-higher, and the loss aggregation modes.

Per token t of turn i (T turns, padded to L tokens):

    r_it    = exp(logp_new_it - logp_old_it)
    loss_it = -min( r_it * A_it,  clip(r_it, 1 - eps_low, 1 + eps_high) * A_it )

with eps_low = 0.2 and eps_high = 0.28 (DAPO's "clip-higher": a wider upper range lets unlikely
tokens with positive advantage grow, against entropy collapse). There is no KL term. The clipped
branch is the active one (its gradient is zero) exactly when

    r < 1 - eps_low  and A < 0     -> `clipped_low`
    r > 1 + eps_high and A > 0     -> `clipped_high`

Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; verl's ``clip_ratio_c``),
off unless a c > 1 is given. For A < 0 the clipped loss above grows without bound as r grows
(-min(rA, clip(r)A) = r|A| once r > 1 + eps_high); dual-clip caps it:

    loss_it = min(loss_it, c * |A_it|)     where A_it < 0     -> `clipped_dual` where the cap binds

so a token whose ratio has run far past c under a negative advantage stops pushing (its gradient
is 0), as in verl's ``compute_policy_loss``.

Truncated importance sampling (``grpo.rollout_correction=truncate``; Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training", as verl's and TRL's rollout
corrections). The sampler (vLLM: other kernels, other precision) is not exactly the trainer's
pi_old, so the surrogate, whose expectation assumes tokens drawn from pi_old, is re-weighted per
token by the ratio of the two, capped at C so that a token the sampler found unlikely cannot
dominate:

    w_it    = min( exp(logp_old_it - logp_sampler_it), C )     (a constant: no gradient)
    loss_it = w_it * loss_it

``rollout_is_weights`` returns w.

Aggregation turns the (T, L) per-token loss into a scalar. With m_it in {0, 1} the loss mask,
n_i = sum_t m_it the tokens of turn i and N = #{i : n_i > 0} the turns with at least one token:

    token-mean           J = sum_it m_it * loss_it / sum_it m_it
    seq-mean-token-mean  J = (1 / N) * sum_{i: n_i > 0} (1 / n_i) * sum_t m_it * loss_it
    seq-mean-token-sum   J = (1 / N) * sum_{i: n_i > 0} sum_t m_it * loss_it

Each is a weighted sum J = sum_it w_it * loss_it; `token_weights` returns w. The point of the
weights: compute them once on the *whole* mini-batch, cut the rows into micro-batches, and
sum_micro (w_micro * loss_micro).sum() is exactly the full mini-batch loss (and so its gradient),
whereas averaging micro-batch means is not whenever micro-batches hold different token counts.
Rows with no masked token get zero weight and are not counted in N. An all-empty mask gives J = 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from marlow.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "SurrogateOut",
    "aggregate",
    "clipped_surrogate",
    "rollout_is_weights",
    "token_weights",
]


class SurrogateOut(NamedTuple):
    """Per-token outputs of `clipped_surrogate`; every field is (T, L)."""

    loss: Tensor  # (T, L) float, -min(r*A, clip(r)*A); unmasked, aggregate it with a mask
    ratio: Tensor  # (T, L) float, r = exp(logp_new - logp_old)
    clipped_low: Tensor  # (T, L) bool, r < 1 - clip_low and A < 0 (clipped branch active)
    clipped_high: Tensor  # (T, L) bool, r > 1 + clip_high and A > 0 (clipped branch active)
    clipped_dual: Tensor  # (T, L) bool, A < 0 and the dual-clip cap c * |A| binds


def clipped_surrogate(
    logp_new: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = None,
) -> SurrogateOut:
    """PPO clipped surrogate per token (see the module docstring for the formula).

    Args:
        logp_new: (T, L) log-probs of the sampled tokens under the policy being trained (grad).
        logp_old: (T, L) the same under the policy that was current before this step's first
            update. Treated as a constant (detached).
        advantages: (T, L) per-token or (T,) per-turn advantages, broadcast over tokens.
            Treated as a constant (detached).
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        clip_ratio_c: dual-clip constant c > 1 (verl uses 3.0), or None for no dual-clip.

    Padded positions are computed like any other; mask them when aggregating.
    """
    if logp_new.dim() != 2 or logp_new.shape != logp_old.shape:
        raise ValueError(
            "logp_new and logp_old must both be (T, L); got "
            f"{tuple(logp_new.shape)} and {tuple(logp_old.shape)}"
        )
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(
            f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
            f"clip_high={clip_high} (paper: 0.2 and 0.28)"
        )
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1 (verl: 3.0), got {clip_ratio_c}")
    adv = advantages.detach().to(logp_new.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # (T, 1), one advantage per turn
    if (
        adv.dim() != 2
        or adv.shape[0] != logp_new.shape[0]
        or adv.shape[1] not in (1, logp_new.shape[1])
    ):
        raise ValueError(
            f"advantages must be (T,) or (T, L) with (T, L) = {tuple(logp_new.shape)}; "
            f"got {tuple(advantages.shape)}"
        )
    adv = adv.expand_as(logp_new)  # (T, L)

    ratio = torch.exp(logp_new - logp_old.detach())  # (T, L)
    unclipped = ratio * adv  # (T, L)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # (T, L)
    loss = -torch.minimum(unclipped, clipped)  # (T, L)
    clipped_dual = torch.zeros_like(loss, dtype=torch.bool)  # (T, L)
    if clip_ratio_c is not None:
        cap = -adv * clip_ratio_c  # (T, L) c * |A| where A < 0
        with torch.no_grad():
            clipped_dual = (adv < 0) & (loss > cap)  # (T, L) bool
        loss = torch.where(clipped_dual, cap, loss)  # (T, L)

    with torch.no_grad():
        clipped_low = (ratio < 1.0 - clip_low) & (adv < 0)  # (T, L) bool
        clipped_high = (ratio > 1.0 + clip_high) & (adv > 0)  # (T, L) bool
    return SurrogateOut(loss, ratio, clipped_low, clipped_high, clipped_dual)


# --- aggregation modes -------------------------------------------------------------------------

WeightFn = Callable[[Tensor], Tensor]  # (T, L) float 0/1 mask -> (T, L) weights
_AGGREGATIONS: Registry[WeightFn] = Registry("aggregation mode")
_register = _AGGREGATIONS.register


def _safe_reciprocal(x: Tensor) -> Tensor:
    """1 / x where x > 0, else 0 (for empty rows or an empty batch)."""
    positive = x > 0
    return torch.where(positive, 1.0 / torch.where(positive, x, torch.ones_like(x)), 0.0)


@_register("token-mean")
def _token_mean(m: Tensor) -> Tensor:
    # w_it = m_it / sum_jk m_jk
    return m * _safe_reciprocal(m.sum())  # (T, L)


@_register("seq-mean-token-mean")
def _seq_mean_token_mean(m: Tensor) -> Tensor:
    # w_it = m_it / (n_i * N)
    n_tokens = m.sum(dim=1, keepdim=True)  # (T, 1) n_i
    n_turns = (n_tokens > 0).sum().to(m.dtype)  # () N
    return m * _safe_reciprocal(n_tokens) * _safe_reciprocal(n_turns)  # (T, L)


@_register("seq-mean-token-sum")
def _seq_mean_token_sum(m: Tensor) -> Tensor:
    # w_it = m_it / N
    n_turns = (m.sum(dim=1) > 0).sum().to(m.dtype)  # () N
    return m * _safe_reciprocal(n_turns)  # (T, L)


AGGREGATIONS: tuple[str, ...] = tuple(_AGGREGATIONS)
"""Valid aggregation mode names (the default is `seq-mean-token-mean`)."""


def token_weights(mask: Tensor, mode: str, dtype: torch.dtype | None = None) -> Tensor:
    """Weights w (T, L) such that the aggregated loss is (w * per_token_loss).sum().

    Args:
        mask: (T, L) bool or 0/1 float; 1 marks a token whose loss counts.
        mode: one of AGGREGATIONS.
        dtype: dtype of the weights; default: the mask's if floating, else float32. Pass the
            loss's dtype so that, e.g., 1/3 is not rounded to float32 for a float64 loss.

    Returns:
        (T, L) weights, zero wherever the mask is zero, no gradient. Compute them on the full
        mini-batch before cutting it into micro-batches.
    """
    weight_fn = _AGGREGATIONS.get(mode)
    if mask.dim() != 2:
        raise ValueError(f"mask must be (T, L), got shape {tuple(mask.shape)}")
    if dtype is None:
        dtype = mask.dtype if mask.is_floating_point() else torch.float32
    return weight_fn(mask.detach().to(dtype))  # (T, L)


def aggregate(per_token_loss: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Scalar loss = sum_it w_it * loss_it with w = token_weights(mask, mode).

    Positions outside the mask are replaced by 0 before weighting, so a NaN or inf there cannot
    leak into the forward value.
    """
    if per_token_loss.shape != mask.shape:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and mask {tuple(mask.shape)} "
            "must have the same (T, L) shape"
        )
    w = token_weights(mask, mode, dtype=per_token_loss.dtype)  # (T, L)
    kept = torch.where(w != 0, per_token_loss, torch.zeros_like(per_token_loss))  # (T, L)
    return (w * kept).sum()  # ()


def rollout_is_weights(logp_old: Tensor, logp_sampler: Tensor, cap: float) -> Tensor:
    """Truncated importance weights min(exp(logp_old - logp_sampler), cap), per token, detached
    (module docstring). logp_old, logp_sampler: (T, L); cap >= 1."""
    if logp_old.shape != logp_sampler.shape:
        raise ValueError(
            f"logp_old {tuple(logp_old.shape)} and logp_sampler {tuple(logp_sampler.shape)} differ"
        )
    if not cap >= 1.0:
        raise ValueError(f"the importance-weight cap must be >= 1, got {cap}")
    log_w = (logp_old.detach() - logp_sampler.detach().to(logp_old.dtype)).clamp(max=math.log(cap))
    return torch.exp(log_w)
