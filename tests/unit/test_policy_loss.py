"""The policy loss as a registered pure function (marlow.algo.policy_loss), against values worked
by hand (each comment shows the arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch

from marlow.algo.policy_loss import (
    LossInputs,
    LossSettings,
    policy_loss,
    policy_loss_names,
    register_policy_loss,
)

LOGP = torch.tensor([[math.log(1.5), math.log(0.5)]])  # ratios 1.5 and 0.5 against old = 0
OLD = torch.zeros(1, 2)


def test_ppo_clip_is_the_clipped_surrogate_with_clip_higher():
    # A = +1: min(r, clip(r, 0.8, 1.28)) = min(1.5, 1.28) = 1.28 and min(0.5, 0.8) = 0.5
    got = policy_loss("ppo-clip")(LossInputs(LOGP, OLD, torch.tensor([1.0])), LossSettings())
    assert got.loss[0].tolist() == pytest.approx([-1.28, -0.5], abs=1e-7)
    assert got.surrogate.clipped_high.tolist() == [[True, False]]
    # A = -1: min(-1.5, -1.28) = -1.5 and min(-0.5, -0.8) = -0.8
    neg = policy_loss("ppo-clip")(LossInputs(LOGP, OLD, torch.tensor([-1.0])), LossSettings())
    assert neg.loss[0].tolist() == pytest.approx([1.5, 0.8], abs=1e-7)
    assert neg.surrogate.clipped_low.tolist() == [[False, True]]


def test_truncated_importance_weights_multiply_the_surrogate():
    # w = min(exp(old - sampler), 2): exp(0 - ln 0.25) = 4 -> 2; exp(0 - ln 2) = 0.5
    sampler = torch.tensor([[math.log(0.25), math.log(2.0)]])
    got = policy_loss("ppo-clip")(
        LossInputs(LOGP, OLD, torch.tensor([1.0]), sampler_logp=sampler),
        LossSettings(rollout_correction="truncate", rollout_correction_cap=2.0),
    )
    assert got.loss[0].tolist() == pytest.approx([-1.28 * 2, -0.5 * 0.5], abs=1e-6)


def test_the_kl_anchor_adds_beta_times_k3():
    # d = base - logp = (-ln 1.5, ln 2); k3 = e^d - d - 1 = (2/3 + ln 1.5 - 1, 2 - ln 2 - 1)
    k3 = [2 / 3 + math.log(1.5) - 1, 1 - math.log(2.0)]  # 0.0721318, 0.3068528
    got = policy_loss("ppo-clip")(
        LossInputs(
            LOGP,
            OLD,
            torch.tensor([1.0]),
            base_logp=torch.zeros(1, 2),
            kl_coef=torch.tensor([0.5]),
        ),
        LossSettings(),
    )
    assert got.loss[0].tolist() == pytest.approx(
        [-1.28 + 0.5 * k3[0], -0.5 + 0.5 * k3[1]], abs=1e-6
    )


def test_a_new_loss_is_one_function_and_one_registration():
    from marlow.config import resolve

    @register_policy_loss("test-reinforce")
    def reinforce(x, s):
        base = policy_loss("ppo-clip")(x, s)  # for its ratio statistics
        return base._replace(loss=-x.advantages[:, None] * x.logp)

    assert "test-reinforce" in policy_loss_names()
    got = policy_loss("test-reinforce")(LossInputs(LOGP, OLD, torch.tensor([2.0])), LossSettings())
    assert got.loss[0].tolist() == pytest.approx([-2 * math.log(1.5), -2 * math.log(0.5)])
    assert resolve({"grpo": {"policy_loss": "test-reinforce"}}).grpo.policy_loss == "test-reinforce"
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("test-reinforce")(reinforce)
    with pytest.raises(ValueError, match="unknown policy loss 'nope'; valid: .*ppo-clip"):
        policy_loss("nope")
