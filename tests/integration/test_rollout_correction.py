"""grpo.rollout_correction=truncate in a real update: each token's surrogate is
weighed by min(pi_old / pi_sampler, C), so a sampler that gave every token twice the trainer's
probability (log-probs raised by ln 2) halves the gradient; ``off`` ignores the
sampler. The mismatch it corrects is logged per role as rollout_abs_dlogp (ln 2 here)."""

from __future__ import annotations

import copy
import math

import torch

from marlow.policy.adapters import adapter_parameters
from marlow.training.trainer import Trainer


def one_update(cfg, out, episodes):
    trainer = Trainer(cfg, out)
    grads = {}
    update = trainer.optim.update

    def keep(adapter):
        params = adapter_parameters(trainer.model, adapter)
        grads[adapter] = torch.cat([p.grad.detach().reshape(-1) for p in params.values()])
        return update(adapter)

    trainer.optim.update = keep
    return trainer.learn(1, copy.deepcopy(episodes)), grads


def test_truncated_weights_halve_the_loss_of_an_overconfident_sampler(small_config, tmp_path):
    settings = dict(
        workflow={"name": "voting"},
        policy={"routing": "ip"},
        grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 1000},  # one update
    )
    off_cfg = small_config(**settings)
    trainer = Trainer(off_cfg, tmp_path / "sample")
    episodes = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, 0.7, seed=5)
    for ep in episodes:
        ep.reward = float(ep.sample % 2)
        for turn in ep.turns:  # the sampler claims twice the probability the trainer gives
            turn.sampler_logprobs = [lp + math.log(2) for lp in turn.sampler_logprobs]
    on_cfg = small_config(
        **{**settings, "grpo": {**settings["grpo"], "rollout_correction": "truncate"}}
    )
    off, off_grads = one_update(off_cfg, tmp_path / "off", episodes)
    on, on_grads = one_update(on_cfg, tmp_path / "on", episodes)
    for adapter in ("generator", "aggregator"):
        # advantages of mean zero: the loss at ratio 1 sums to ~0, its gradient does not
        assert float(off_grads[adapter].norm()) > 1e-3
        scale = float(off_grads[adapter].abs().max())  # float32 sums: round-off 1e-5 of it
        torch.testing.assert_close(
            on_grads[adapter], 0.5 * off_grads[adapter], rtol=1e-4, atol=1e-5 * scale
        )
        # and not the unweighted gradient: the test can fail
        assert float((on_grads[adapter] - off_grads[adapter]).abs().max()) > 0.1 * scale
    for role in ("generator", "aggregator"):  # |logp_old - logp_sampler| = ln 2 on every token
        assert abs(off[f"train/{role}/rollout_abs_dlogp"] - math.log(2)) < 1e-5
