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
