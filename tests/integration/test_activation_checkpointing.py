"""grpo.activation_checkpointing: decoder layers that keep only their input and run again in the
backward give the loss, the gradients, the updated weights and every metric of a step without
it, while autograd keeps a hidden state per layer instead of each layer's activations; sampling
and scoring without gradients never recompute."""

from __future__ import annotations

import pytest
import torch

from marlow.models import checkpoint_layers, checkpointable_layers
from marlow.training.trainer import Trainer
from tests.integration.reference import assert_same_step, learn_keeping_gradients


def one_step(cfg, out):
    """A step's learn on fixed episodes: its record, each adapter's gradients, its weights, and
    whether gradients were on each time the first decoder layer's MLP ran."""
    trainer = Trainer(cfg, out)
    episodes = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, 0.8, seed=5)
    for ep in episodes:
        ep.reward = float(ep.sample % 2)
    mlp = checkpointable_layers(trainer.model)[0].mlp  # called again by a recomputed layer
    forwards = []
    hook = mlp.register_forward_pre_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    record, grads, weights = learn_keeping_gradients(trainer, 1, episodes)
    hook.remove()
    return record, grads, weights, forwards


@pytest.mark.parametrize(
    ("fold", "dtype"), [("on", "float32"), ("off", "float32"), ("off", "bfloat16")]
)
def test_checkpointed_layers_train_exactly_as_without(small_config, tmp_path, fold, dtype):
    """bfloat16: the forward's LoRA computes in bfloat16 (``lora_in_base_dtype``), and so does
    its recompute in the backward, after the context has closed (the autocast the checkpoint
    restores, and the LoRA layers set as in the forward: ``recompute_as_forward``)."""

    def cfg(checkpointing: str):
        return small_config(
            dtype=dtype,
            workflow={"name": "voting"},
            policy={"routing": "ip"},
            rollout={"temperature": 0.8},
            optim={"lr": 5e-2},
            grpo={
                "batch_problems": 2,
                "group_size": 4,
                "minibatch_turns": 8,
                "activation_checkpointing": checkpointing,
                "fold_lora": fold,
            },
            diagnostics={"every": 1},
        )

    ours, our_grads, our_w, our_runs = one_step(cfg("on"), tmp_path / "on")
    plain, plain_grads, plain_w, plain_runs = one_step(cfg("off"), tmp_path / "off")
    # each forward that builds a graph ran without one, and once more with one in the backward
    with_graph = plain_runs.count(True)
    assert with_graph > 0
    assert our_runs.count(False) == plain_runs.count(False) + with_graph
    assert our_runs.count(True) == with_graph
    assert_same_step((ours, our_grads, our_w), (plain, plain_grads, plain_w))


def test_auto_checkpoints_a_hugging_face_model_and_not_a_tiny_one(small_config, tmp_path):
    from marlow.models import checkpoints_layers

    assert not checkpoints_layers(small_config())  # a tiny scale: compute-bound, small
    assert checkpoints_layers(small_config(model={"name": "Qwen/Qwen3-0.6B"}))
    assert not checkpoints_layers(
        small_config(model={"name": "Qwen/Qwen3-0.6B"}, grpo={"activation_checkpointing": "off"})
    )
    with Trainer(small_config(grpo={"activation_checkpointing": "on"}), tmp_path / "r") as t:
        layers = checkpointable_layers(t.model)
        assert all(layer._marlow_call["checkpointed"] for layer in layers)
        # marlow's checkpoint wraps the layer's call: transformers' own (inside it) stays off
        assert not any(layer.gradient_checkpointing for layer in layers)


def saved_bytes(model, ids) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of one forward."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.storage_offset())] = t.numel() * t.itemsize
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.sum()
    return sum(seen.values())


def test_a_checkpointed_forward_keeps_a_hidden_state_per_layer():
    from marlow.policy.adapters import LoraSpec, attach_adapters, use_adapter
    from tests.conftest import build_tiny_qwen3

    base = build_tiny_qwen3(hidden_size=32, num_hidden_layers=4)
    model = attach_adapters(base, ["policy"], LoraSpec(8, 16), seed=0).train()
    ids = torch.randint(0, 64, (2, 48))
    with use_adapter(model, "policy"):
        plain = saved_bytes(model, ids)
        assert checkpoint_layers(model) == 4
        kept = saved_bytes(model, ids)
    hidden = 2 * 48 * 32 * 4  # one float32 hidden state per token
    assert kept < plain / 4  # the check can fail: without, every layer's activations stay
    logits = 2 * 48 * 64 * 4
    assert kept <= (4 + 2) * hidden + logits  # 4 layers' inputs, the final norm's, the logits


def test_on_a_card_auto_keeps_every_layers_activations_where_plan_says_they_fit(
    small_config, tmp_path, monkeypatch
):
    """A Hugging Face model (the tiny world's folder) on a card: the trainer resolves
    checkpointing auto as ``marlow plan --gpu-mem`` predicts it, on either side of the edge
    where every layer's activations of the largest forward fill half the room beside the
    weights and adapters; it says which in the log."""
    import marlow.training.trainer as trainer_module
    from marlow.plan import GIB, plan_run
    from marlow.tiny.pretrain import pretrain_tiny
    from tests.conftest import PRETRAIN_STEPS

    folder = pretrain_tiny("tiny-s", steps=PRETRAIN_STEPS)  # the session's cached world
    cfg = small_config(model={"name": str(folder)}, grpo={"micro_tokens": 512})
    unchecked = plan_run(cfg, gpu_mem_gib=1e6)
    assert not unchecked.checkpointed and unchecked.auto_unchecked
    edge = unchecked.base_bytes + unchecked.adapter_bytes + 2 * unchecked.activation_bytes
    for card, checkpointed in ((edge + 2**20, False), (edge - 2**20, True)):
        assert plan_run(cfg, gpu_mem_gib=card / GIB).checkpointed == checkpointed
        monkeypatch.setattr(trainer_module, "card_memory", lambda _device, card=card: card)
        said: list[str] = []
        with Trainer(cfg, tmp_path / str(card), log=said.append) as t:
            layers = checkpointable_layers(t.model)
        calls = [getattr(layer, "_marlow_call", {}).get("checkpointed", False) for layer in layers]
        assert calls == [checkpointed] * len(layers)
        state = "on" if checkpointed else "off"
        assert any(
            line.startswith(f"grpo.activation_checkpointing auto: {state} ") for line in said
        )
