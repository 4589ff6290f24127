"""``marlow plan``'s memory model of the update (``marlow.plan.activations``) against what an
update pass really holds: the bytes of the tensors alive at once, counted op by op on the CPU
(the same autograd engine, and in float32 the same tensors kept, as on a GPU), for a small random
Qwen3 with a LoRA adapter on every linear, its layers checkpointed and not, its LM head's phase
the larger and its layers' phase the larger, each phase within 10% of the model's."""

from __future__ import annotations

import pytest
import torch

from marlow import plan
from marlow.algo import estimators
from marlow.archs import Shape
from marlow.models import checkpoint_layers, fuse_norms
from marlow.policy.adapters import LoraSpec, attach_adapters, use_adapter
from marlow.training.batch import Chunk
from marlow.training.logprobs import score_chunk
from marlow.training.memory import LiveBytes
from tests.conftest import build_tiny_qwen3


def measure(model, chunk: Chunk, monkeypatch) -> LiveBytes:
    """One update pass over ``chunk`` (``score_chunk`` without entropies, the loss, its
    backward) under :class:`LiveBytes`, the LM head's forward and backward marked."""
    counter = LiveBytes(model.state_dict().values())
    head = estimators._HeadLogprobs

    def marked(phase):
        def run(ctx, *args):
            counter.phase = "head"
            try:
                return phase(ctx, *args)
            finally:
                counter.phase = None

        return staticmethod(run)

    monkeypatch.setattr(head, "forward", marked(head.forward))
    monkeypatch.setattr(head, "backward", marked(head.backward))
    with counter:
        scored = score_chunk(model, chunk, temperature=1.0, entropy=False)
        (-(scored.logp * scored.mask).sum() / scored.mask.sum()).backward()
    return counter


@pytest.fixture(scope="module")
def small_qwen3():
    base = build_tiny_qwen3(
        vocab_size=8192,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        head_dim=32,
        max_position_embeddings=1024,
    )
    for p in base.parameters():
        p.requires_grad_(False)
    fuse_norms(base)  # as load_base computes them
    model = attach_adapters(base, ["policy"], LoraSpec(rank=8), seed=0)
    model.train()
    rows, width, prompt = 4, 256, 64
    ids = torch.randint(0, base.config.vocab_size, (rows, width))
    return model, Chunk.full_rows(ids, prompt)


@pytest.mark.parametrize("checkpointed", [True, False])
@pytest.mark.parametrize("chunk_mib", [8, 0.25])  # the head's phase the larger; the layers'
def test_plans_activations_are_what_an_update_pass_holds(
    small_qwen3, checkpointed, chunk_mib, monkeypatch
):
    model, chunk = small_qwen3
    chunk_bytes = int(chunk_mib * 2**20)
    monkeypatch.setattr(estimators, "HEAD_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(plan, "HEAD_CHUNK_BYTES", chunk_bytes)
    checkpoint_layers(model, on=checkpointed)
    try:
        with use_adapter(model, "policy"):
            counted = measure(model, chunk, monkeypatch)
    finally:
        checkpoint_layers(model, on=False)
        model.zero_grad(set_to_none=True)
    tokens = chunk.ids.numel()
    memory = plan.activations(
        Shape.of(model.config), 4, plan.lora_shapes(model, "policy"), True, checkpointed
    )
    head = tokens * (memory.kept + memory.head) + plan.head_chunk_bytes(memory.vocab, tokens)
    layer = tokens * (memory.kept + memory.layer)
    assert (head > layer) == (chunk_mib > 1)  # the phase each case is for
    assert counted.peaks["head"] == pytest.approx(head, rel=0.1)
    assert counted.peak == pytest.approx(memory.bytes(tokens), rel=0.1)
    if layer > head:  # the layers' phase, not the head's, makes the peak
        assert counted.peak > counted.peaks["head"]
        assert counted.peak == pytest.approx(layer, rel=0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_heads_chunks_are_what_its_passes_hold(dtype, temperature, monkeypatch):
    """The LM head alone, forward and backward over 3 full chunks, holds two chunks of float32
    logits at once (the logits, or their float32 copy, and their log-softmax) and the bfloat16
    logits only while their copy is made."""
    vocab, width, tokens = 4096, 64, 768
    monkeypatch.setattr(estimators, "HEAD_CHUNK_BYTES", 256 * 4 * vocab)  # 256 tokens a chunk
    monkeypatch.setattr(plan, "HEAD_CHUNK_BYTES", 256 * 4 * vocab)
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, width, dtype=dtype) / 8
    targets = torch.randint(0, vocab, (tokens,))
    counter = LiveBytes([hidden, weight, targets])
    with counter:
        logp, _ = estimators.head_logprobs_and_entropy(
            hidden, weight, None, targets, temperature, entropy=False
        )
        logp.sum().backward()
    shape = Shape(h=width, a=1, g=1, d=width, I=width, L=1, V=vocab)
    b = dtype.itemsize
    memory = plan.activations(shape, b, [], True, False)
    chunks = plan.head_chunk_bytes(memory.vocab, tokens)
    assert chunks == 2 * 256 * 4 * vocab
    small = tokens * (4 * 2 + 2 * b * width)  # logp, its gradient; the hidden state's gradient
    assert chunks <= counter.peak <= chunks + small


def test_the_fitting_tokens_are_the_edge_of_the_model():
    shape = Shape(h=1024, a=16, g=8, d=128, I=3072, L=28, V=151936)
    lora = [(1024, 64)] * 6 * 28 + [(3072, 64)] * 28
    for checkpointed in (True, False):
        memory = plan.activations(shape, 2, lora, True, checkpointed)
        room = 12 * 2**30
        most = memory.tokens_that_fit(room)
        assert memory.bytes(most) <= room < memory.bytes(most + 1)
    assert memory.tokens_that_fit(memory.bytes(1) - 1) == 0


def test_live_bytes_counts_each_storage_once_while_it_lives():
    weight = torch.ones(1000)  # made before: not counted, nor its views
    with LiveBytes([weight]) as counter:
        a = torch.zeros(2000)  # 8,000 bytes
        view = a[:10].view(2, 5)  # the same storage: not counted again
        counter.phase = "b"
        b = a * 2  # 16,000 at once
        del a, view, b
        counter.phase = None
        weight.t().sum()  # a view of the weight, then 4 bytes
    assert counter.peak == 16000 and counter.peaks == {"b": 16000}
    assert counter.now == 0 and counter.live == {}
