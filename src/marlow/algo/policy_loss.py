"""The policy loss per token, as small pure functions chosen by name (``grpo.policy_loss``).

A policy loss takes one micro-batch's tensors (:class:`LossInputs`) and the run's clip and
correction settings (:class:`LossSettings`) and returns the (T, L) per-token loss; the trainer
then weighs it with the aggregation's weights (:func:`marlow.algo.losses.token_weights`), sums,
and backpropagates (``marlow.training.grpo.update_adapter``). The one built in, ``ppo-clip``:

    loss_it = w_it * surrogate_it + beta_i * k3_it

* surrogate: PPO's clipped surrogate with clip-higher and optional dual-clip
  (:func:`marlow.algo.losses.clipped_surrogate`);
* w: the truncated importance weight min(pi_old / pi_sampler, C) under
  ``grpo.rollout_correction=truncate`` (:func:`marlow.algo.losses.rollout_is_weights`), else 1;
* beta_i k3: the per-role KL anchor to the base, ``mitigate.kl_coef`` (beta_i the row's role's
  coefficient; k3 = exp(d) - d - 1 with d = logp_base - logp, :func:`marlow.algo.estimators.k3_tokens`),
  absent when no row of the micro-batch has one (the paper's: no KL term).

A new loss is one function ``(LossInputs, LossSettings) -> LossOutput`` and one
``@register_policy_loss("name")``; ``grpo.policy_loss=name`` selects it (registered before the
config is read). Its ``surrogate`` output feeds the ratio and clip-fraction metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from marlow.algo.estimators import k3_tokens
from marlow.algo.losses import SurrogateOut, clipped_surrogate, rollout_is_weights
from marlow.registry import Registry

__all__ = [
    "LossInputs",
    "LossOutput",
    "LossSettings",
    "policy_loss",
    "policy_loss_names",
    "register_policy_loss",
]


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch of T turns padded to L tokens."""

    logp: Tensor  # (T, L) log-probs of the sampled tokens under the policy being trained (grad)
    old_logp: Tensor  # (T, L) the same before the step's first update (a constant)
    advantages: Tensor  # (T,) one advantage per turn
    sampler_logp: Tensor | None = None  # (T, L) as the sampler recorded them
    base_logp: Tensor | None = None  # (T, L) under the frozen base (the KL anchor's reference)
    kl_coef: Tensor | None = None  # (T,) each row's KL coefficient; None: no KL term


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float | None = None  # dual-clip's c; None: off
    rollout_correction: str = "off"  # "truncate": weigh by min(pi_old / pi_sampler, cap)
    rollout_correction_cap: float = 2.0


class LossOutput(NamedTuple):
    loss: Tensor  # (T, L) the per-token loss, unmasked: aggregate it with the mask's weights
    surrogate: SurrogateOut  # the clipped surrogate's ratios and clip flags, for the metrics


PolicyLoss = Callable[[LossInputs, LossSettings], LossOutput]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register
"""Register a policy loss under ``name`` (a decorator); a name is registered once."""


def policy_loss_names() -> list[str]:
    return POLICY_LOSSES.names()


def policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; a ValueError lists the valid names."""
    return POLICY_LOSSES.get(name)


@register_policy_loss("ppo-clip")
def ppo_clip(x: LossInputs, s: LossSettings) -> LossOutput:
    """PPO's clipped surrogate, times the truncated importance weight, plus the KL anchor
    (module docstring)."""
    out = clipped_surrogate(
        x.logp, x.old_logp, x.advantages, s.clip_low, s.clip_high, s.clip_ratio_c
    )
    loss = out.loss  # (T, L)
    if s.rollout_correction == "truncate":  # the sampler is not pi_old
        loss = loss * rollout_is_weights(x.old_logp, x.sampler_logp, s.rollout_correction_cap)
    if x.kl_coef is not None:
        loss = loss + x.kl_coef[:, None] * k3_tokens(x.logp, x.base_logp)
    return LossOutput(loss, out)
