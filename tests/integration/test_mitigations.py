"""Mitigations inside a real update: the per-role KL penalty's gradient equals the
plain-PyTorch gradient of beta * k3 against the base, for its role only; coherence damping and
role balance change only what they should."""

from __future__ import annotations

import pytest
import torch

from marlow.policy.adapters import adapter_parameters, use_adapter
from marlow.training.trainer import Trainer
from marlow.types import BASE
from tests.integration.reference import completion_logp

BETA = 0.7


def captured_grads(trainer, adapter: str) -> dict[str, torch.Tensor]:
    """Wrap the optimizer step: keep the adapter's gradient as the update hands it over."""
    seen: dict[str, torch.Tensor] = {}
    update = trainer.optim.update
    named = adapter_parameters(trainer.model, adapter)

    def spy(name):
        if name == adapter:
            for key, p in named.items():
                seen[key] = p.grad.detach().clone()
        return update(name)

    trainer.optim.update = spy
    return seen


def test_the_kl_penalty_is_beta_times_k3_of_its_role_only(small_config, tmp_path):
    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": "ip"},
        optim={"lr": 5e-2},
        rollout={"temperature": 0.8},
        grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 1000},
        mitigate={"kl_coef": {"generator": BETA}},
    )
    trainer = Trainer(cfg, tmp_path / "run")
    first = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, 0.8, seed=3)
    for ep in first:
        ep.reward = float(ep.sample % 2)
    trainer.learn(1, first)  # the adapters leave the base
    episodes = trainer.rollout(trainer.task.train_batch(1, 1, 2), 4, 0.8, seed=4)
    for ep in episodes:
        ep.reward = 1.0  # every advantage 0: the surrogate gives no gradient
    gen = captured_grads(trainer, "generator")
    agg = captured_grads(trainer, "aggregator")
    # the reference, at the parameters the update starts from
    turns = [t for ep in episodes for t in ep.turns if t.role == "generator"]
    named = adapter_parameters(trainer.model, "generator")
    for p in named.values():
        p.grad = None
    total = 0.0
    for t in turns:
        with torch.no_grad(), use_adapter(trainer.model, BASE):
            base = completion_logp(trainer.model, t, 0.8)
        with use_adapter(trainer.model, "generator"):
            new = completion_logp(trainer.model, t, 0.8)
        d = base - new
        total = total + BETA * (d.exp() - d - 1).mean() / len(turns)
    total.backward()
    want = {k: p.grad.detach().clone() for k, p in named.items()}
    for p in named.values():
        p.grad = None  # the update accumulates into .grad from its own backward passes only
    trainer.learn(2, episodes)
    assert want and all(float(w.abs().max()) > 0 for w in want.values())
    for key, w in want.items():
        torch.testing.assert_close(gen[key], w, rtol=2e-4, atol=1e-7)
    assert all(float(g.abs().max()) == 0.0 for g in agg.values())  # no penalty, no advantage


@pytest.mark.parametrize("mitigate", [{"coherence_threshold": 0.01}, {"role_balance": True}])
def test_a_mitigation_changes_the_update_and_records_itself(small_config, tmp_path, mitigate):
    routing = "ip" if "coherence_threshold" in mitigate else "sp"
    records = {}
    for on in (False, True):
        cfg = small_config(
            workflow={"name": "voting"},
            policy={"routing": routing},
            grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 1000},
            mitigate=mitigate if on else {},
        )
        trainer = Trainer(cfg, tmp_path / f"run-{on}")
        episodes = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, 0.8, seed=3)
        for ep in episodes:
            ep.reward = float(ep.sample % 2)
        records[on] = trainer.learn(1, episodes)
    adapter = "generator" if routing == "ip" else "shared"
    off, on = (
        records[False][f"train/{adapter}/grad_norm"],
        records[True][f"train/{adapter}/grad_norm"],
    )
    assert on != pytest.approx(off, rel=1e-6)
    if routing == "ip":
        assert 0 < records[True]["train/generator/slot_damping"] < 1  # aligned beyond 0.01
        assert "train/generator/slot_coherence" not in records[False]
        # the aggregator has one slot: its update is the same with or without the mitigation
        assert records[True]["train/aggregator/grad_norm"] == pytest.approx(
            records[False]["train/aggregator/grad_norm"], rel=1e-9
        )
    else:  # the measured shares are the roles' own pushes, before the balance
        for role in ("generator", "aggregator"):
            key = f"train/{role}/grad_mass_share"
            assert records[True][key] == pytest.approx(records[False][key], rel=1e-9)


def _second_step(cfg, out, monkeypatch, every_row: bool):
    """Step 2's (record, gradient, updated weights, turns scored under the base) after a step 1
    that moved the adapter off the base; ``every_row``: score the base on every turn."""
    from marlow.training import trainer as trainer_module

    trainer = Trainer(cfg, out)
    for step in (1, 2):
        episodes = trainer.rollout(trainer.task.train_batch(step, 1, 2), 4, 0.8, seed=step)
        for ep in episodes:
            ep.reward = float(ep.sample % 2)
        if step == 1:
            trainer.learn(1, episodes)
    score_base, scored = trainer_module.score_base, []

    def base(model, batch, temperature, micro_tokens, rows=None):
        rows = None if every_row else rows
        scored.append(len(batch) if rows is None else len(rows))
        return score_base(model, batch, temperature, micro_tokens, rows)

    with monkeypatch.context() as mp:
        mp.setattr(trainer_module, "score_base", base)
        grads = captured_grads(trainer, "shared")
        record = trainer.learn(2, episodes)
    return record, grads, adapter_parameters(trainer.model, "shared"), scored


def test_the_kl_penalty_scores_the_base_on_its_roles_turns_alone(
    small_config, tmp_path, monkeypatch
):
    """Under SP with the penalty on the aggregator alone, a step without kl_to_base scores the
    base on the aggregator's turns only (8 of 32); the update's gradients, its weights and every
    metric are those of a base pass over every turn (within 1e-6)."""
    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": "sp"},
        optim={"lr": 5e-2},
        rollout={"temperature": 0.8},
        grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 1000},
        diagnostics={"every": 5},  # step 2 has no kl_to_base
        mitigate={"kl_coef": {"aggregator": BETA}},
    )
    record, grads, weights, scored = _second_step(cfg, tmp_path / "a", monkeypatch, False)
    every, every_grads, every_weights, every_scored = _second_step(
        cfg, tmp_path / "b", monkeypatch, True
    )
    assert scored == [8] and every_scored == [32]
    keys = {k for k in every if not k.startswith("time/")}
    assert keys == {k for k in record if not k.startswith("time/")}
    for k in sorted(keys):
        assert record[k] == pytest.approx(every[k], abs=1e-6, rel=1e-6), k
    assert any(float(g.abs().max()) > 1e-4 for g in every_grads.values())  # a real gradient
    for name, g in every_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(weights[name], every_weights[name], atol=1e-6, rtol=0)
