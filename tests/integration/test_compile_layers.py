"""grpo.compile: decoder layers through torch.compile give the loss, the gradients, the updated
weights and every metric of a step through eager layers (float32, within round-off), in every
pass of the step (the update with and without checkpointing, the scoring without gradients, the
base's for the KL anchor and the diagnostics, the adapter-sync probe), whole (no graph break)
and never falling back to eager."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from marlow import models
from marlow.training.trainer import Trainer
from tests.integration.reference import assert_same_step, learn_keeping_gradients


def one_step(cfg, out):
    """A step's learn on fixed episodes (:func:`learn_keeping_gradients`)."""
    trainer = Trainer(cfg, out)
    episodes = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, 0.8, seed=5)
    for ep in episodes:
        ep.reward = float(ep.sample % 2)
    return learn_keeping_gradients(trainer, 1, episodes)


def gave_up(err: Exception) -> None:
    raise AssertionError(f"a compiled layer fell back to eager: {err}")


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["on", "off"])
def test_compiled_layers_train_as_eager_ones(small_config, tmp_path, checkpointing, monkeypatch):
    def cfg(compile: str):
        return small_config(
            workflow={"name": "voting"},
            policy={"routing": "ip"},
            rollout={"temperature": 0.8},
            optim={"lr": 1e-2},
            grpo={
                "batch_problems": 2,
                "group_size": 4,
                "minibatch_turns": 8,
                "activation_checkpointing": checkpointing,
                "fold_lora": "off",
                "compile": compile,
            },
            mitigate={"kl_coef": {"*": 0.01}},
            diagnostics={"every": 1, "kl_to_base": True},
        )

    monkeypatch.setattr(models, "_give_up_compiling", gave_up)
    torch._dynamo.reset()  # so that the graphs counted are this test's
    counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        ours = one_step(cfg("on"), tmp_path / "on")
    assert counters["stats"]["unique_graphs"] >= 3  # update (2: first layer, others), no grad
    assert not counters["graph_break"]
    plain = one_step(cfg("off"), tmp_path / "off")
    # float32 round-off: the metrics and gradients agree to 1e-4 (measured: chi2_update of the
    # generator 1.2e-5 apart relatively); AdamW moves a weight by up to the learning rate
    # whatever its gradient's size, so a gradient element at round-off's scale can move its
    # weight by a different share of it: the weights to a tenth of the learning rate
    (record, grads, weights), their_weights = ours, plain[2]
    assert_same_step((record, grads, their_weights), plain, tol=1e-4)
    for adapter, expect in their_weights.items():
        for name, w in expect.items():
            torch.testing.assert_close(weights[adapter][name], w, atol=1e-3, rtol=0)


def test_a_bfloat16_run_compiles_its_layers_in_the_first_step_only(small_config, tmp_path):
    """Over a bfloat16 base every pass of a Voting-IP step goes through the compiled layers
    (both adapters, the base, with and without gradients, the probes), and the steps after the
    first compile nothing more: no guard of the layers' graphs depends on a layer, a pass or a
    step (an object set on each module, the LoRA factors held for a pass, a held block). Dynamo
    alone: its guards decide, no code is generated."""
    from functools import partial

    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": "ip"},
        dtype="bfloat16",
        grpo={
            "batch_problems": 2,
            "group_size": 4,
            "minibatch_turns": 8,
            "activation_checkpointing": "on",
            "fold_lora": "off",
            "compile": "on",
        },
        mitigate={"kl_coef": {"*": 0.01}},
        diagnostics={"every": 1, "kl_to_base": True},
    )
    graphs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "_COMPILED_HEAD", [])  # made anew with the eager backend
        mp.setattr(torch, "compile", partial(torch.compile, backend="eager"))
        mp.setattr(models, "_give_up_compiling", gave_up)
        torch._dynamo.reset()
        counters.clear()
        with (
            torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
            Trainer(cfg, tmp_path / "run") as trainer,
        ):
            for step in range(3):
                trainer.train_step(step)
                graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"]
    # the layers 8 graphs, as measured, shared by both adapters (12 when each adapter was
    # guarded by its name): with the adapters and the base (disabled), with gradients and
    # without, in training and evaluation mode, with an attention mask and without, and one row
    # (the sync probe); the head's chunks 3: the forward with entropies and without (the sync
    # probe's temperature 1 shares the run's), and the update's forward with the slopes (one
    # for its passes with entropies and without)
    assert graphs[0] <= 11 and graphs == [graphs[0]] * 3
