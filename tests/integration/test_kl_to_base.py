"""kl_to_base per role: zero while the adapter is still its zero-initialised self, then equal to a
k3 estimate computed here with plain PyTorch (adapter on vs disabled)."""

from __future__ import annotations

import dataclasses

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


def test_kl_to_base_reads_the_base_log_probs_of_the_kl_penalty(small_config, tmp_path, monkeypatch):
    """Under mitigate.kl_coef a diagnostics step scores the base once, before the update, and
    kl_to_base reads those log-probs. An update changes only the adapters, so they equal a base
    pass after the update (the pass kl_to_base would make of its own), and so does the metric
    (within 1e-6)."""
    from marlow.diagnostics.metrics import Meter
    from marlow.training import trainer as trainer_module

    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": "ip"},
        rollout={"temperature": 0.8},
        optim={"lr": 5e-2},
        grpo={"batch_problems": 2, "group_size": 4},
        diagnostics={"every": 1},
        mitigate={"kl_coef": {"*": 0.05}},
    )
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.learn(1, _episodes(trainer, 1))  # the adapters leave the base
    score_base, kl_to_base_stats = trainer_module.score_base, trainer_module.kl_to_base_stats
    base_passes, two_pass = [], {}

    def counted(model, batch, *args):
        base_passes.append(batch.adapter)
        return score_base(model, batch, *args)

    def beside_a_second_pass(meter, batch):
        after = dataclasses.replace(batch, base_logp=None)
        score_base(trainer.model, after, 0.8, trainer.grpo.micro_tokens)
        torch.testing.assert_close(batch.base_logp, after.base_logp, atol=1e-6, rtol=0)
        alone = Meter()
        kl_to_base_stats(alone, after)
        two_pass.update(alone.result("train"))
        kl_to_base_stats(meter, batch)

    monkeypatch.setattr(trainer_module, "score_base", counted)
    monkeypatch.setattr(trainer_module, "kl_to_base_stats", beside_a_second_pass)
    record = trainer.learn(2, _episodes(trainer, 2))
    assert sorted(base_passes) == sorted(trainer.adapters)  # one base pass per adapter
    for role in ("generator", "aggregator"):
        key = f"train/{role}/kl_to_base"
        assert record[key] > 1e-6  # the policy left the base
        assert record[key] == pytest.approx(two_pass[key], abs=1e-6, rel=1e-6)
