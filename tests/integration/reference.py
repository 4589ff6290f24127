"""Plain-PyTorch reference pieces the integration tests compare the trainer against."""

from __future__ import annotations

import torch

VOTING_IP = dict(  # Voting-IP: two adapters, so a run restores or checks more than one optimizer
    steps=3,
    val_every=3,
    workflow={"name": "voting"},
    policy={"routing": "ip"},
    grpo={"batch_problems": 2, "group_size": 3, "minibatch_turns": 8},
    rollout={"max_new_tokens": 16},
)


def completion_logp(model, turn, temperature: float) -> torch.Tensor:
    """(L,) log-probs of a turn's completion tokens, one unpadded forward, temperature-scaled."""
    ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
    p, n = len(turn.prompt_ids), len(turn.completion_ids)
    logits = model(input_ids=ids).logits[0, p - 1 : p + n - 1] / temperature
    targets = torch.tensor(turn.completion_ids)[:, None]
    return torch.log_softmax(logits.float(), -1).gather(-1, targets)[:, 0]


def vary_rewards(trainer):
    """Training episodes rewarded 0, 1, 0, ... by sample index, so every group has a spread and
    every step changes the adapters (the barely pre-trained test model almost never answers).
    A function of the episode alone: a resumed run sees the same rewards."""
    rollout = trainer.rollout

    def varied(problems, n, temperature, seed, **kw):
        episodes = rollout(problems, n, temperature, seed, **kw)
        if n > 1:  # training, not validation
            for ep in episodes:
                ep.reward = float(ep.sample % 2)
        return episodes

    trainer.rollout = varied
    return trainer


def learn_keeping_gradients(trainer, step: int, episodes):
    """``trainer.learn(step, episodes)`` with each adapter's gradients kept as its optimizer
    update takes them: (the step's record, adapter -> gradients, adapter -> weights after)."""
    from marlow.policy.adapters import adapter_parameters

    grads = {}
    update = trainer.optim.update

    def keep(adapter):
        params = adapter_parameters(trainer.model, adapter)
        grads[adapter] = {k: p.grad.detach().clone() for k, p in params.items()}
        return update(adapter)

    trainer.optim.update = keep
    try:
        record = trainer.learn(step, episodes)
    finally:
        trainer.optim.update = update
    weights = {a: adapter_parameters(trainer.model, a) for a in trainer.adapters}
    return record, grads, weights


def assert_same_step(ours, theirs, tol: float = 1e-6) -> None:
    """Two :func:`learn_keeping_gradients` results agree: the same metrics (the phases' seconds
    aside), every gradient and every updated weight within ``tol``; and the gradients are real."""
    import pytest

    (record, grads, weights), (their_record, their_grads, their_weights) = ours, theirs
    keys = {k for k in their_record if not k.startswith("time/")}
    assert keys == {k for k in record if not k.startswith("time/")}
    for k in sorted(keys):
        assert record[k] == pytest.approx(their_record[k], abs=tol, rel=tol), k
    assert grads.keys() == their_grads.keys()
    for adapter, expect in their_grads.items():
        assert any(float(g.abs().max()) > 1e-4 for g in expect.values())  # a real gradient
        for name, g in expect.items():
            torch.testing.assert_close(grads[adapter][name], g, atol=tol, rtol=tol)
            mine, theirs_w = weights[adapter][name], their_weights[adapter][name]
            torch.testing.assert_close(mine, theirs_w, atol=tol, rtol=0)
