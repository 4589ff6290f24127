"""Invariants of the trainer on the tiny model.

* The Single workflow under SP gives the same loss and the same update as a plain single-agent
  GRPO step on the same samples, written here independently with plain PyTorch.
* A run stopped after step k and resumed equals the uninterrupted run at a later step.
"""

from __future__ import annotations

import pytest
import torch

from marlow.policy.adapters import adapter_parameters, use_adapter
from marlow.training.trainer import Trainer
from tests.integration.reference import completion_logp

ADAM_EPS = 1e-8  # torch's default, as the trainer's AdamW


def plain_grpo_step(model, episodes, params, *, lr, temperature, clip, eps=1e-6):
    """Textbook single-agent GRPO, one on-policy update, seq-mean-token-mean, no padding."""
    rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float64)
    groups = torch.tensor([ep.group for ep in episodes])
    adv = torch.zeros_like(rewards)
    for g in groups.unique():
        r = rewards[groups == g]
        adv[groups == g] = 0.0 if r.max() == r.min() else (r - r.mean()) / (r.std() + eps)
    per_turn = []
    for ep, a in zip(episodes, adv.tolist(), strict=True):
        (turn,) = ep.turns
        logp = completion_logp(model, turn, temperature)
        ratio = torch.exp(logp - logp.detach())  # = 1 on-policy, gradient of logp
        per_turn.append(-(ratio * a).mean())  # clipping is inactive at ratio 1
    loss = torch.stack(per_turn).mean()
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    grads = [p.grad.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0, eps=ADAM_EPS)
    opt.step()
    return float(loss.detach()), norm, grads


def test_single_sp_equals_plain_grpo(small_config, tmp_path, one_row_a_sequence):
    cfg = small_config(
        workflow={"name": "single"},
        policy={"routing": "sp"},
        grpo={"batch_problems": 3, "group_size": 4, "minibatch_turns": 64},
        rollout={"temperature": 0.8},
    )
    trainer = Trainer(cfg, tmp_path / "a")
    problems = trainer.task.train_batch(0, 1, 3)
    episodes = trainer.rollout(problems, 4, 0.8, seed=3)
    for ep in episodes:  # rewards with variance in every group, one all-equal group
        ep.reward = float(ep.sample % 2) if ep.group < 2 else 1.0
    named = adapter_parameters(trainer.model, "shared")
    params = list(named.values())
    start = {k: v.detach().clone() for k, v in named.items()}

    with use_adapter(trainer.model, "shared"):
        ref_loss, ref_norm, ref_grads = plain_grpo_step(
            trainer.model,
            episodes,
            params,
            lr=cfg.optim.lr,
            temperature=0.8,
            clip=cfg.optim.grad_clip,
        )
    ref = {k: v.detach().clone() for k, v in named.items()}
    assert any(not torch.equal(ref[k], start[k]) for k in ref)  # the step did something
    with torch.no_grad():
        for k, v in named.items():
            v.copy_(start[k])
            v.grad = None

    record = trainer.learn(1, episodes)
    assert record["train/shared/updates"] == 1
    assert record["train/shared/loss"] == pytest.approx(ref_loss, abs=1e-6)
    assert record["train/shared/grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert record["train/all/frac_reward_zero_std"] == pytest.approx(1 / 3)
    # Adam's first step is lr * g / (|g| + eps): where |g| is within a few eps of 0, an absolute
    # round-off of 1e-10 in g (sums cancelling to nearly nothing, added in another order on
    # another CPU) moves the step by 1 % of lr, so those elements' steps say nothing. Past
    # 1,000 eps the step moves by lr * round-off * eps / g^2 (under 1e-6 of lr): compared there
    # within 1e-4 of lr (the reference's temperature 2 % off moved 25 elements by up to 2 lr).
    lr = cfg.optim.lr
    compared = 0
    for (k, v), g in zip(named.items(), ref_grads, strict=True):
        clear = (g.abs() > 1e3 * ADAM_EPS) | (g == 0)  # zero: LoRA's A under a B of zeros
        compared += int(clear.sum())
        torch.testing.assert_close(v.detach()[clear], ref[k][clear], atol=1e-4 * lr, rtol=0)
    assert compared > 0.9 * sum(g.numel() for g in ref_grads)


class Stop(Exception):
    pass


def test_resumed_run_equals_uninterrupted(small_config, tmp_path):
    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": "ip"},
        steps=4,
        ckpt_every=2,
        val_every=2,
        grpo={"minibatch_turns": 8},
        optim={"warmup_steps": 1, "weight_decay": 0.01},
    )
    full = Trainer(cfg, tmp_path / "full").run()

    def stop_at_3(step, record):
        if step == 3:
            raise Stop

    with pytest.raises(Stop):
        Trainer(cfg, tmp_path / "cut").run(on_step=stop_at_3)
    resumed = Trainer(cfg, tmp_path / "cut")
    resumed.run(resume=True)
    assert resumed.step == 4

    reference = Trainer(cfg, tmp_path / "ref")
    from marlow.training import checkpoint

    checkpoint.load(
        full / "checkpoints" / "step_000004", reference.model, reference.adapters, reference.optim
    )
    for adapter in reference.adapters:
        a = adapter_parameters(reference.model, adapter)
        b = adapter_parameters(resumed.model, adapter)
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    full_lines = (full / "metrics.jsonl").read_text().splitlines()
    cut_lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert len(full_lines) == len(cut_lines) == 5  # steps 0..4, the redone step 3 not duplicated
