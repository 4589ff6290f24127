"""Gradient-mass share per role under SP: shares sum to 1 and equal the per-role gradient norms of
separate backward passes, written here with plain PyTorch."""

from __future__ import annotations

import math

import pytest
import torch

from marlow.algo.turn_advantages import turn_advantages
from marlow.policy.adapters import adapter_parameters, use_adapter
from marlow.training.batch import credit_rows
from marlow.training.trainer import Trainer
from tests.integration.reference import completion_logp


def role_gradient_norm(model, turns, adv, params, *, n_turns, temperature):
    """|grad| of this role's part of the seq-mean-token-mean loss (ratio 1 at the first update)."""
    for p in params:
        p.grad = None
    total = 0.0
    for t in turns:
        logp = completion_logp(model, t, temperature)
        total = total - (torch.exp(logp - logp.detach()) * adv[id(t)]).mean() / n_turns
    total.backward()
    return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params if p.grad is not None))


def test_sp_grad_mass_shares_match_separate_backward_passes(small_config, tmp_path):
    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": "sp"},
        rollout={"temperature": 0.8},
        grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 1000},
    )
    trainer = Trainer(cfg, tmp_path / "run")
    episodes = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, 0.8, seed=3)
    for ep in episodes:
        ep.reward = float(ep.sample % 2)
    named = adapter_parameters(trainer.model, "shared")
    params = list(named.values())
    start = {k: v.detach().clone() for k, v in named.items()}

    record = trainer.learn(1, episodes)
    assert record["train/shared/updates"] == 1
    shares = {r: record[f"train/{r}/grad_mass_share"] for r in ("generator", "aggregator")}
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)

    with torch.no_grad():
        for k, v in named.items():
            v.copy_(start[k])
    turns, rows = credit_rows(episodes)
    values, _, _ = turn_advantages(rows, "problem", eps=cfg.grpo.eps)
    adv = {id(t): a for t, a in zip(turns, values.tolist(), strict=True)}
    norms = {}
    with use_adapter(trainer.model, "shared"):
        for role in shares:
            own = [t for t in turns if t.role == role]
            norms[role] = role_gradient_norm(
                trainer.model, own, adv, params, n_turns=len(turns), temperature=0.8
            )
    assert all(n > 0 for n in norms.values())
    for role in shares:
        assert record[f"train/{role}/grad_norm_own"] == pytest.approx(norms[role], rel=1e-4)
        assert shares[role] == pytest.approx(norms[role] / sum(norms.values()), rel=1e-4)
    # the generator has 3 slots per episode: it carries most of the gradient mass
    assert shares["generator"] > shares["aggregator"]


def test_ip_records_no_shares(small_config, tmp_path):
    cfg = small_config(workflow={"name": "voting"}, policy={"routing": "ip"})
    trainer = Trainer(cfg, tmp_path / "run")
    episodes = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, 0.8, seed=3)
    record = trainer.learn(1, episodes)
    assert not any(k.endswith("/grad_mass_share") for k in record)


def test_shares_sum_to_one_when_some_mini_batches_hold_one_role(small_config, tmp_path):
    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": "sp"},
        grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 2},
    )
    trainer = Trainer(cfg, tmp_path / "run")
    episodes = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, 0.8, seed=3)
    for ep in episodes:
        ep.reward = float(ep.sample % 2)
    record = trainer.learn(1, episodes)
    assert record["train/shared/updates"] == 16  # 32 turns in pairs: some pairs hold one role
    total = record["train/generator/grad_mass_share"] + record["train/aggregator/grad_mass_share"]
    assert total == pytest.approx(1.0, abs=1e-9)
