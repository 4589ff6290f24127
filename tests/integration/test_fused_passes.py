"""Fewer passes, same numbers: when an adapter's step is one update, logp_old taken from the update
forward (no separate scoring pass) gives the loss, the gradients, the updated weights and every
metric of the separate pass within 1e-6."""

from __future__ import annotations

import pytest
import torch

from marlow import models
from marlow.training import trainer as trainer_module
from marlow.training.trainer import Trainer
from tests.integration.reference import assert_same_step, learn_keeping_gradients


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
        record, grads, weights = learn_keeping_gradients(trainer, 1, episodes)
    return record, grads, weights, calls, scored


def apart_at_round_off(ours, theirs, grad, name: str) -> None:
    """Updated weights that agree but where the gradient is small enough for its round-off to
    show. AdamW's first step moves an element by lr * g / (|g| + eps): a gradient apart by dg
    moves it by about lr * eps * dg / (|g| + eps)^2, which at lr 5e-2 and eps 1e-8 passes 1e-6
    for dg of 2.6e-9 where |g| is 1e-6 and of 2e-7 where it is 1e-5 (the gradients agree to
    1e-6): so elements whose |g| is under 1e-5 may be apart. Measured (one thread): up to 4 of
    2,048 elements of a tensor apart when the file runs alone; in a whole ``make test``, where
    other tests had run first in the process, 3 of 1,024 once, and once an
    element whose |g| was 1.1e-6. The bound on their count is 1%."""
    apart = (ours - theirs).abs() > 1e-6
    assert int(apart.sum()) <= 0.01 * apart.numel(), name
    assert bool((grad[apart].abs() < 1e-5).all()), name


@pytest.mark.parametrize("routing", ["ip", "sp"])
def test_fused_logp_old_equals_the_separate_pass(
    small_config, tmp_path, monkeypatch, routing, one_row_a_sequence
):
    """The separate pass and the update cut the rows into micro-batches differently: rows
    forward their own prompts (``one_row_a_sequence``)."""
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
    assert {"chi2_update", "kl_to_base", "loss", "grad_norm", "entropy", "chi2_rollout"} <= {
        k.rsplit("/", 1)[1] for k in full if not k.startswith("time/")
    }
    assert_same_step((fast, fast_grads, fast_w), (full, full_grads, full_w))


@pytest.mark.parametrize("routing", ["ip", "sp"])
def test_folded_lora_trains_like_peft(small_config, tmp_path, monkeypatch, routing):
    """grpo.fold_lora: the update and logp_old pass with each LoRA folded into one weight give
    PEFT's loss, gradients, updated weights and metrics up to float round-off. One update (as in
    the test above): over many AdamW updates at this rate round-off is amplified (a gradient
    element near zero moves its weight by +-lr whichever its sign), so only one step is exact."""
    cfgs = {
        fold: small_config(
            workflow={"name": "voting"},
            policy={"routing": routing},
            rollout={"temperature": 0.8},
            optim={"lr": 5e-2},
            grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 1000, "fold_lora": fold},
            diagnostics={"every": 1},
        )
        for fold in ("on", "off")
    }
    folded, f_grads, f_w, _, f_scored = one_step(cfgs["on"], tmp_path / "a", monkeypatch, False)
    peft, p_grads, p_w, _, p_scored = one_step(cfgs["off"], tmp_path / "b", monkeypatch, False)
    assert len(f_scored) == len(p_scored) > 0  # logp_old from its own (merged) pass
    keys = {k for k in peft if not k.startswith("time/")}
    assert keys == {k for k in folded if not k.startswith("time/")}
    for k in sorted(keys):
        assert folded[k] == pytest.approx(peft[k], abs=1e-5, rel=1e-4), k  # chi2 amplifies
    for adapter, grads in p_grads.items():
        assert any(float(g.abs().max()) > 1e-4 for g in grads.values())  # a real gradient
        for name, g in grads.items():
            torch.testing.assert_close(f_grads[adapter][name], g, atol=1e-6, rtol=1e-5)
            apart_at_round_off(f_w[adapter][name], p_w[adapter][name], g, name)


def test_fold_lora_on_refuses_an_adapter_it_cannot_fold(small_config, tmp_path):
    from marlow.config import ConfigError

    cfg = small_config(policy={"lora_dropout": 0.1}, grpo={"fold_lora": "on"})
    with pytest.raises(ConfigError, match="grpo.fold_lora=on: adapter .* cannot be folded"):
        Trainer(cfg, tmp_path / "run")
    auto = Trainer(small_config(policy={"lora_dropout": 0.1}), tmp_path / "auto")
    assert not any(auto.fold.values())  # auto falls back to PEFT's forward
    plain = Trainer(small_config(), tmp_path / "plain")
    assert plain.fold and all(plain.fold.values())  # float32 on the CPU: folded


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_the_chunked_head_trains_like_the_whole_logits(
    small_config, tmp_path, monkeypatch, temperature
):
    """Log-probs through the LM head chunk by chunk (the default for Qwen3) against the model's
    whole logits, on the tiny world: one Voting-IP update's loss, gradients, updated weights and
    every metric within float round-off (one update, as the test above, and its tolerances)."""

    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": "ip"},
        rollout={"temperature": temperature},
        optim={"lr": 5e-2},
        grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 1000},
        diagnostics={"every": 1},
    )
    chunked, grads, weights, _, _ = one_step(cfg, tmp_path / "a", monkeypatch, True)
    with monkeypatch.context() as mp:
        mp.setattr(models, "decoder_and_head", lambda model: None)
        whole, whole_grads, whole_weights, _, _ = one_step(cfg, tmp_path / "b", monkeypatch, True)
    keys = {k for k in whole if not k.startswith("time/")}
    assert keys == {k for k in chunked if not k.startswith("time/")}
    for k in sorted(keys):
        assert chunked[k] == pytest.approx(whole[k], abs=1e-5, rel=1e-4), k  # chi2 amplifies
    for adapter, expect in whole_grads.items():
        assert any(float(g.abs().max()) > 1e-4 for g in expect.values())
        for name, g in expect.items():
            torch.testing.assert_close(grads[adapter][name], g, atol=1e-6, rtol=1e-5)
            apart_at_round_off(weights[adapter][name], whole_weights[adapter][name], g, name)
