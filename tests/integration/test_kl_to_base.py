"""kl_to_base per role: zero while the adapter is still its zero-initialised self, then equal to a
k3 estimate computed here with plain PyTorch (adapter on vs disabled)."""

from __future__ import annotations

import pytest
import torch

from marlow.policy.adapters import use_adapter
from marlow.training.trainer import Trainer
from marlow.types import BASE
from tests.integration.reference import completion_logp


def _episodes(trainer: Trainer, step: int):
    episodes = trainer.rollout(trainer.task.train_batch(0, step, 2), 4, 0.8, seed=step)
    for ep in episodes:
        ep.reward = float(ep.sample % 2)
    return episodes


def test_kl_to_base_is_zero_at_init_then_matches_a_plain_k3(small_config, tmp_path):
    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": "ip"},
        rollout={"temperature": 0.8},
        optim={"lr": 5e-2},
        grpo={"batch_problems": 2, "group_size": 4},
        diagnostics={"every": 1},
    )
    trainer = Trainer(cfg, tmp_path / "run")
    first = trainer.learn(1, _episodes(trainer, 1))
    for role in ("generator", "aggregator"):
        assert first[f"train/{role}/kl_to_base"] == 0.0  # LoRA B starts at zero: pi == base

    episodes = _episodes(trainer, 2)
    turns = [t for ep in episodes for t in ep.turns]
    expected = {}
    with torch.no_grad():
        for role in ("generator", "aggregator"):
            own = [t for t in turns if t.role == role]
            with use_adapter(trainer.model, role):
                lp = torch.cat([completion_logp(trainer.model, t, 0.8) for t in own])
            with use_adapter(trainer.model, BASE):
                ref = torch.cat([completion_logp(trainer.model, t, 0.8) for t in own])
            d = ref - lp  # k3 = mean over the role's tokens of exp(d) - d - 1
            expected[role] = float((torch.exp(d) - d - 1).mean())
    second = trainer.learn(2, episodes)  # scores before it updates: the policy measured above
    for role, value in expected.items():
        assert value > 1e-6  # step 1's update moved the policy away from the base
        assert second[f"train/{role}/kl_to_base"] == pytest.approx(value, rel=1e-4)
    assert second["train/all/kl_to_base"] > 0.0


def test_kl_to_base_can_be_switched_off(small_config, tmp_path):
    cfg = small_config(workflow={"name": "single"}, diagnostics={"kl_to_base": False})
    trainer = Trainer(cfg, tmp_path / "run")
    record = trainer.learn(1, _episodes(trainer, 1))
    assert not any(k.endswith("/kl_to_base") for k in record)
    assert record["time/kl_to_base_s"] == 0.0


def test_sampled_diagnostics_run_on_steps_one_and_every_kth(small_config, tmp_path):
    cfg = small_config(workflow={"name": "single"}, diagnostics={"every": 3})
    trainer = Trainer(cfg, tmp_path / "run")
    logged = {}
    for step in range(1, 5):
        record = trainer.learn(step, _episodes(trainer, step))
        logged[step] = {k for k in record if k.endswith(("/chi2_update", "/kl_to_base"))}
        assert "train/generator/perplexity" in record  # the pre-update metrics are every step's
    assert (
        logged[1]
        == logged[4]
        == {
            "train/generator/chi2_update",
            "train/all/chi2_update",
            "train/generator/kl_to_base",
            "train/all/kl_to_base",
        }
    )
    assert logged[2] == logged[3] == set()
