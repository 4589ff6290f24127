"""Fewer passes, same numbers: when an adapter's step is one update, logp_old taken from the update
forward (no separate scoring pass) gives the loss, the gradients, the updated weights and every
metric of the separate pass within 1e-6."""

from __future__ import annotations

import pytest
import torch

from marlow.policy.adapters import adapter_parameters
from marlow.training import trainer as trainer_module
from marlow.training.trainer import Trainer


def one_step(cfg, out, monkeypatch, fused: bool):
    trainer = Trainer(cfg, out)
    episodes = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, 0.8, seed=5)
    for ep in episodes:
        ep.reward = float(ep.sample % 2)
    calls, scored = [], []
    with monkeypatch.context() as mp:
        score_old = trainer_module.score_old
        mp.setattr(trainer_module, "score_old", lambda b, *a: scored.append(b) or score_old(b, *a))
        if not fused:
            mp.setattr(trainer_module, "fused_old_logp", lambda *a: False)
        else:
            real = trainer_module.fused_old_logp
            mp.setattr(
                trainer_module, "fused_old_logp", lambda *a: calls.append(real(*a)) or real(*a)
            )
        grads = {}
        update = trainer.optim.update

        def keep(adapter):
            params = adapter_parameters(trainer.model, adapter)
            grads[adapter] = {k: p.grad.detach().clone() for k, p in params.items()}
            return update(adapter)

        trainer.optim.update = keep
        record = trainer.learn(1, episodes)
    weights = {a: adapter_parameters(trainer.model, a) for a in trainer.adapters}
    return record, grads, weights, calls, scored


@pytest.mark.parametrize("routing", ["ip", "sp"])
def test_fused_logp_old_equals_the_separate_pass(small_config, tmp_path, monkeypatch, routing):
    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": routing},
        rollout={"temperature": 0.8},
        optim={"lr": 5e-2},
        grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 1000},
        diagnostics={"every": 1},
    )
    fast, fast_grads, fast_w, calls, scored = one_step(cfg, tmp_path / "a", monkeypatch, True)
    full, full_grads, full_w, _, full_scored = one_step(cfg, tmp_path / "b", monkeypatch, False)
    assert calls and all(calls)  # every adapter took the fused path
    assert scored == [] and len(full_scored) == len(full_grads)  # and skipped its scoring pass
    keys = {k for k in full if not k.startswith("time/")}
    assert keys == {k for k in fast if not k.startswith("time/")}
    assert {"chi2_update", "kl_to_base", "loss", "grad_norm", "entropy", "chi2_rollout"} <= {
        k.rsplit("/", 1)[1] for k in keys
    }
    for k in sorted(keys):
        assert fast[k] == pytest.approx(full[k], abs=1e-6, rel=1e-6), k
    assert fast_grads.keys() == full_grads.keys()
    for adapter, grads in full_grads.items():
        assert any(float(g.abs().max()) > 1e-4 for g in grads.values())  # a real gradient
        for name, g in grads.items():
            torch.testing.assert_close(fast_grads[adapter][name], g, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(
                fast_w[adapter][name], full_w[adapter][name], atol=1e-6, rtol=0
            )
