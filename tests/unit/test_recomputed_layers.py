"""Checkpointed decoder layers (``marlow.models.checkpoint_layers``) recompute in the backward
through marlow's own autograd function: the same log-probs and LoRA gradients as the layers
without checkpointing, bit for bit, in float32 and bfloat16, with LoRA dropout drawn (the random
numbers replayed), for the first layer too (whose input, the frozen embedding's output, needs no
gradient); a call it cannot replay goes through ``torch.utils.checkpoint`` and still gives its
gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch
from peft.tuners.lora import LoraLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from marlow.models import checkpoint_layers, checkpointable_layers, fuse_norms, torch_checkpoint
from marlow.policy.adapters import (
    LoraSpec,
    attach_adapters,
    held_factors,
    lora_layers,
    use_adapter,
)
from marlow.training.batch import Chunk
from marlow.training.logprobs import score_chunk
from tests.conftest import build_tiny_qwen3


def lora_model(dtype: torch.dtype, dropout: float = 0.0):
    base = build_tiny_qwen3(hidden_size=32, num_hidden_layers=3).to(dtype)
    for p in base.parameters():
        p.requires_grad_(False)
    fuse_norms(base)  # as load_base computes them
    model = attach_adapters(base, ["policy"], LoraSpec(rank=4, alpha=8, dropout=dropout), seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B is zero at first, and with it A's gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def update_pass(model, chunk: Chunk, checkpointed: bool, seed: int = 0):
    """One update pass (as the trainer's: factors held, the loss's backward): the log-probs and
    every LoRA gradient."""
    checkpoint_layers(model, on=checkpointed)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the dropout's draws
    with use_adapter(model, "policy"), held_factors():
        scored = score_chunk(model, chunk, temperature=0.9, entropy=False)
        (-(scored.logp * scored.mask).sum() / scored.mask.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return scored.logp.detach(), grads


def chunk_of(model, rows: int = 3, width: int = 20, prompt: int = 6) -> Chunk:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (rows, width), generator=g)
    return Chunk.full_rows(ids, prompt)


@pytest.mark.parametrize(
    ("dtype", "dropout"),
    [(torch.float32, 0.0), (torch.bfloat16, 0.0), (torch.float32, 0.2), (torch.bfloat16, 0.2)],
)
def test_checkpointed_layers_give_the_same_values_and_gradients_bit_for_bit(dtype, dropout):
    model = lora_model(dtype, dropout).train()
    chunk = chunk_of(model)
    logp, grads = update_pass(model, chunk, checkpointed=False)
    logp_ck, grads_ck = update_pass(model, chunk, checkpointed=True)
    assert torch.equal(logp, logp_ck)
    assert grads.keys() == grads_ck.keys() and len(grads) == 3 * 7 * 2  # every layer's A and B
    assert all(torch.equal(grads[n], grads_ck[n]) for n in grads)
    first = [n for n in grads if ".layers.0." in n]
    assert first and all(grads[n].abs().sum() > 0 for n in first)
    if dropout:  # the draws matter: another seed gives other gradients
        _, other = update_pass(model, chunk, checkpointed=True, seed=1)
        assert not all(torch.equal(grads[n], other[n]) for n in grads)


@pytest.mark.parametrize("torchs", [False, True])
def test_a_checkpointed_forward_keeps_no_graph_of_the_layer(torchs):
    """The forward runs the layer without a graph, and the backward once with one; inside
    ``torch_checkpoint`` torch's checkpoint runs it with one (its hooks drop what it saves),
    to the same values."""
    model = lora_model(torch.float32).train()
    chunk = chunk_of(model)
    mlp = checkpointable_layers(model)[1].mlp
    runs: list[bool] = []
    hook = mlp.register_forward_pre_hook(lambda *_: runs.append(torch.is_grad_enabled()))
    try:
        with torch_checkpoint() if torchs else contextlib.nullcontext():
            logp, grads = update_pass(model, chunk, checkpointed=True)
    finally:
        hook.remove()
    assert runs == [torchs, True]
    logp_plain, grads_plain = update_pass(model, chunk, checkpointed=False)
    assert torch.equal(logp, logp_plain)
    assert all(torch.equal(grads[n], grads_plain[n]) for n in grads_plain)


def test_gradients_accumulate_over_micro_batches_as_without():
    model = lora_model(torch.float32).train()
    chunks = [chunk_of(model, rows=2, width=w) for w in (14, 20)]

    def two(checkpointed: bool):
        checkpoint_layers(model, on=checkpointed)
        model.zero_grad(set_to_none=True)
        with use_adapter(model, "policy"), held_factors():
            for chunk in chunks:
                scored = score_chunk(model, chunk, temperature=1.0, entropy=False)
                (-(scored.logp * scored.mask).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, ours = two(False), two(True)
    assert plain.keys() == ours.keys() and plain
    assert all(torch.equal(plain[n], ours[n]) for n in plain)


def test_a_call_it_cannot_replay_goes_through_torch_checkpoint_with_its_gradients():
    """A keyword tensor that needs a gradient (here the rotary angles) is not replayed by
    marlow's function: torch's checkpoint takes the call, and the angles get their gradient."""
    model = lora_model(torch.float32).train()
    layer = checkpointable_layers(model)[0]
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 32, generator=g)
    cos = torch.randn(2, 5, 16, generator=g)
    sin = torch.randn(2, 5, 16, generator=g)

    def run(checkpointed: bool):
        checkpoint_layers(model, on=checkpointed)
        angles = cos.clone().requires_grad_(), sin.clone().requires_grad_()
        with use_adapter(model, "policy"):
            out = layer(hidden, attention_mask=None, position_embeddings=angles)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        return out.detach(), angles[0].grad, angles[1].grad

    plain, ours = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert ours[1].abs().sum() > 0


class _TupleLayer(GradientCheckpointingLayer):
    """A layer returning (hidden, None), as decoder layers of older transformers did."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 8))

    def forward(self, hidden, scale=1.0):
        return torch.tanh(hidden * self.weight) * scale, None


@pytest.mark.parametrize("needs_grad", [False, True])
def test_a_layer_returning_a_tuple_and_a_second_backward_with_the_graph_kept(needs_grad):
    layer = _TupleLayer().train()
    hidden = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))

    def run(checkpointed: bool):
        checkpoint_layers(layer, on=checkpointed)
        layer.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_(needs_grad)
        out, none = layer(x, scale=2.0)
        assert none is None
        loss = out.square().sum()
        loss.backward(retain_graph=True)
        loss.backward()  # the graph kept: the layer recomputed once more
        return out.detach(), layer.weight.grad.clone(), x.grad

    plain, ours = run(False), run(True)
    assert torch.equal(plain[0], ours[0]) and torch.equal(plain[1], ours[1])
    assert ours[1].abs().sum() > 0
    assert (ours[2] is None) is not needs_grad
    if needs_grad:
        assert torch.equal(plain[2], ours[2])


def test_lora_layers_are_those_of_modules_in_their_order():
    """The walk a checkpointed layer's call makes to find its LoRA layers (not through their
    own submodules) finds what ``modules()`` does, in its order, for a model and a layer."""
    model = attach_adapters(
        build_tiny_qwen3(hidden_size=32, num_hidden_layers=2), ["voter", "judge"], LoraSpec(4), 0
    )
    for module in (model, checkpointable_layers(model)[1], checkpointable_layers(model)[0].mlp):
        expect = [m for m in module.modules() if isinstance(m, LoraLayer)]
        found = lora_layers(module)
        assert len(found) == len(expect) > 0
        assert all(a is b for a, b in zip(found, expect, strict=True))
    q = checkpointable_layers(model)[0].self_attn.q_proj
    assert lora_layers(q) == [q] and lora_layers(q.base_layer) == []
