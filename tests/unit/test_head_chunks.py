"""Log-probs through the LM head chunk by chunk: the whole log-softmax's values and gradients,
without holding the (tokens, vocabulary) logits."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import Qwen3Config, Qwen3ForCausalLM

from marlow import models
from marlow.algo.estimators import (
    EAGER_HEAD,
    head_logprobs_and_entropy,
    recomputed_head,
    token_logprobs_and_entropy,
)
from marlow.algo.policy_loss import policy_loss_names
from marlow.policy.adapters import LoraSpec, attach_adapters
from marlow.training.batch import Chunk
from tests.conftest import build_tiny_qwen3
from tests.unit.scoring_checks import LossAndGrads, assert_same_scoring

QWEN3_VOCAB = 151_936


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_logprobs_equal_the_whole_log_softmax(temperature, dtype):
    """Values, entropies and the gradients of the hidden state, the head's weight and its bias,
    against token_logprobs_and_entropy on the whole logits; chunks of 5 over 37 tokens."""
    gen = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 1000
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.3).to(dtype).requires_grad_()
    bias = torch.randn(v, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    whole = torch.nn.functional.linear(hidden, weight, bias)[None]
    logp, ent = token_logprobs_and_entropy(whole, targets[None], temperature)
    (logp[0] * upstream).sum().backward()
    expect = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    ours, our_ent = head_logprobs_and_entropy(hidden, weight, bias, targets, temperature, 5)
    (ours * upstream).sum().backward()
    assert not our_ent.requires_grad and ours.dtype == our_ent.dtype == torch.float32
    torch.testing.assert_close(ours, logp[0], atol=3e-6, rtol=0)
    torch.testing.assert_close(our_ent, ent[0], atol=3e-6, rtol=0)
    # bfloat16: the head's gradient sums the chunks' bfloat16 products in another order
    tol = {"atol": 5e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    for t, e in zip((hidden, weight, bias), expect, strict=True):
        torch.testing.assert_close(t.grad, e, **tol)
    assert float(expect[0].abs().max()) > 0.1  # a real gradient


def _no_recompute(*args):
    raise AssertionError("a chunk's logits were computed again in the backward")


@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_heads_hidden_gradient_comes_from_the_forwards_slopes(dtype, temperature, entropy):
    """Where only the hidden state needs a gradient (the head frozen, as LoRA leaves it), each
    token's slope (the gradient of its log-prob with respect to its hidden state) is taken from
    the forward's softmax, and the backward scales the slopes: no chunk's logits are computed
    again, and autograd keeps nothing but the (N, H) slopes. Log-probs and entropies are the
    whole log-softmax's; the hidden state's gradient is as close to a float64 computation as
    float32 round-off (a bfloat16 rounding of the largest in bfloat16), on 37 tokens in chunks
    of 5."""
    gen = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 1000
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.3).to(dtype)
    bias = torch.randn(v, generator=gen).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    exact = hidden.detach().double().requires_grad_()
    z = torch.nn.functional.linear(exact, weight.double(), bias.double())
    z = z / temperature if temperature > 0 else z
    (
        torch.log_softmax(z, -1).gather(-1, targets[:, None])[:, 0] * upstream.double()
    ).sum().backward()
    whole = torch.nn.functional.linear(hidden, weight, bias)[None]
    logp, ent = token_logprobs_and_entropy(whole, targets[None], temperature)
    ops = EAGER_HEAD._replace(backward=_no_recompute)
    out = []
    saved = saved_shapes(
        lambda: out.extend(
            head_logprobs_and_entropy(hidden, weight, bias, targets, temperature, 5, entropy, ops)
        )
    )
    assert saved == [(n, h)]
    ours, our_ent = out
    (ours * upstream).sum().backward()
    torch.testing.assert_close(ours, logp[0], atol=3e-6, rtol=0)
    if entropy:
        torch.testing.assert_close(our_ent, ent[0], atol=3e-6, rtol=0)
    else:
        assert our_ent is None
    largest = float(exact.grad.abs().max())
    assert largest > 0.5  # a real gradient
    tol = 2e-6 if dtype == torch.float32 else 2**-7
    assert hidden.grad.dtype == dtype
    assert float((hidden.grad.double() - exact.grad).abs().max()) <= tol * largest


def test_the_slopes_serve_only_a_pass_whose_head_is_frozen():
    """A head whose weight or bias needs a gradient keeps the chunked backward (its logits'
    gradient is what the head's own gradient is made of), and so does a frozen one inside
    ``recomputed_head`` (what the GPU check times beside the slopes), with the slopes' values;
    a pass without gradients takes the plain forward."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 8, generator=gen).requires_grad_()
    weight, bias = torch.randn(40, 8, generator=gen), torch.randn(40, generator=gen)
    targets = torch.randint(0, 40, (9,), generator=gen)
    calls = []
    ops = EAGER_HEAD._replace(
        **{
            name: partial(lambda f, name, *a: calls.append(name) or f(*a), fn, name)
            for name, fn in EAGER_HEAD._asdict().items()
        }
    )
    grads = {}
    for needs in ("weight", "bias", None, "recomputed"):
        calls.clear()
        hidden.grad = None
        w = weight.clone().requires_grad_(needs == "weight")
        b = bias.clone().requires_grad_(needs == "bias")
        with recomputed_head() if needs == "recomputed" else nullcontext():
            logp, _ = head_logprobs_and_entropy(hidden, w, b, targets, 0.7, 4, False, ops)
            (logp * torch.arange(9.0)).sum().backward()
        assert set(calls) == ({"slopes"} if needs is None else {"forward", "backward"})
        grads[needs] = hidden.grad
    torch.testing.assert_close(grads[None], grads["recomputed"], atol=1e-6, rtol=1e-6)
    assert float(grads[None].abs().max()) > 0.5
    calls.clear()
    with torch.no_grad():
        head_logprobs_and_entropy(hidden, weight, bias, targets, 0.7, 4, False, ops)
    assert set(calls) == {"forward"}


def test_without_entropy_the_log_probs_and_gradients_are_the_same_bits():
    """``entropy=False`` (a pass that does not read them): no entropies, and the log-probs and
    every gradient bit for bit those of the pass that computes them; so for the whole logits."""
    gen = torch.Generator().manual_seed(1)
    n, h, v = 23, 16, 500
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.3).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    runs = []
    for entropy in (True, False):
        hidden.grad = weight.grad = None
        logp, ent = head_logprobs_and_entropy(hidden, weight, None, targets, 0.7, 5, entropy)
        logp.sum().backward()
        runs.append((logp.detach(), ent, hidden.grad.clone(), weight.grad.clone()))
        whole, whole_ent = token_logprobs_and_entropy(
            (hidden @ weight.T)[None], targets[None], 0.7, entropy
        )
        assert (ent is None) == (whole_ent is None) == (not entropy)
    (with_logp, ent, *with_grads), (logp, _, *grads) = runs
    assert ent.shape == (n,) and bool((ent > 0).all())
    assert torch.equal(logp, with_logp)
    for a, b in zip(grads, with_grads, strict=True):
        assert torch.equal(a, b)


def saved_shapes(fn) -> list[tuple[int, ...]]:
    """The shapes of every tensor autograd saves for the backward while ``fn`` runs."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_no_tokens_by_vocabulary_tensor_is_kept_for_the_backward():
    n, h, v = 300, 8, 5000
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h)
    targets = torch.randint(0, v, (n,))
    whole = saved_shapes(
        lambda: token_logprobs_and_entropy((hidden @ weight.T)[None], targets[None], 0.7)
    )
    assert any(s[-1] == v and len(s) == 3 and s[1] == n for s in whole)  # the check can fail
    ours = saved_shapes(lambda: head_logprobs_and_entropy(hidden, weight, None, targets, 0.7, 64))
    assert max(s[0] * s[-1] for s in ours if len(s) == 2) <= v * h  # the weight, nothing bigger


@pytest.fixture(scope="module")
def real_vocab():
    """A random one-layer Qwen3 of width 32 with Qwen3's vocabulary, a LoRA adapter moved off
    zero, and a micro-batch of 3 turns (prompts of 5-9 tokens, completions of 2-6)."""
    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = attach_adapters(Qwen3ForCausalLM(config), ["policy"], LoraSpec(8, 16), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    prompts, completions = [5, 9, 7], [6, 2, 4]
    width, longest = max(p + c for p, c in zip(prompts, completions, strict=True)), max(completions)
    ids = torch.zeros(3, width, dtype=torch.long)
    attention = torch.zeros(3, width, dtype=torch.long)
    targets = torch.zeros(3, longest, dtype=torch.long)
    mask = torch.zeros(3, longest, dtype=torch.bool)
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        row = torch.randint(0, QWEN3_VOCAB, (p + c,), generator=gen)
        ids[r, : p + c], attention[r, : p + c] = row, 1
        targets[r, :c], mask[r, :c] = row[p:], True
    chunk = Chunk([0, 1, 2], ids, attention, torch.tensor(prompts), targets, mask)
    return model, chunk


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("loss_name", policy_loss_names())
def test_scoring_through_the_head_equals_the_whole_logits(
    real_vocab, monkeypatch, temperature, loss_name
):
    """score_chunk on a Qwen3 of the real vocabulary: the chunked head (forced into chunks of 4
    tokens) gives the log-probs, entropies, every registered policy loss and the adapter's
    gradients of scoring the model's whole logits."""
    model, chunk = real_vocab
    assert models.decoder_and_head(model) is not None  # the chunked path applies
    run = LossAndGrads(model, chunk, "policy", loss_name, temperature)
    chunks = []  # every chunked call's tokens: the chunked path ran
    real = models.head_logprobs_and_entropy
    with monkeypatch.context() as mp:
        mp.setattr(
            models,
            "head_logprobs_and_entropy",
            lambda *a, **k: chunks.append(len(a[0])) or real(*a, chunk_tokens=4, **k),
        )
        ours = run()
    with monkeypatch.context() as mp:
        mp.setattr(models, "decoder_and_head", lambda m: None)
        theirs = run()
    assert chunks == [int(chunk.mask.sum())]  # the real completion tokens alone, once
    assert_same_scoring(ours, theirs, chunk.mask, logp_atol=2e-5)


def compiled_against_eager(dtype, temperature, monkeypatch, frozen=False) -> tuple[list, list]:
    """Log-probs, entropies and the gradients of the hidden state, weight and bias (``frozen``:
    the hidden state's alone, through the slopes) through ``models.compiled_head()`` (inductor,
    made anew) and through the eager chunks; chunks of 5 over 37 tokens (the last of 2: dynamic
    shapes), a vocabulary of 1,000."""
    monkeypatch.setattr(models, "_COMPILED_HEAD", [])
    monkeypatch.setattr(models, "_GAVE_UP", [])
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(1)
    n, h, v = 37, 16, 1000
    inputs = (
        torch.randn(n, h, generator=gen).to(dtype),
        (torch.randn(v, h, generator=gen) * 0.3).to(dtype),
        torch.randn(v, generator=gen).to(dtype),
    )
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    results = []
    for ops in (models.compiled_head(), None):
        leaves = [t.clone().requires_grad_(i == 0 or not frozen) for i, t in enumerate(inputs)]
        logp, ent = head_logprobs_and_entropy(*leaves, targets, temperature, 5, ops=ops)
        (logp * upstream).sum().backward()
        results.append([logp.detach(), ent, *(t.grad for t in leaves if t.requires_grad)])
    # compiled for real (the forward and the gradient, or the forward with the slopes), not
    # fallen back to eager
    assert counters["stats"]["unique_graphs"] == (1 if frozen else 2) and not models._GAVE_UP
    return results[0], results[1]


@pytest.mark.parametrize("frozen", [False, True], ids=["head-trained", "head-frozen"])
@pytest.mark.parametrize(
    "dtype, temperature", [(torch.float32, 0.7), (torch.bfloat16, 1.0), (torch.float32, 0.0)]
)
def test_the_compiled_head_gives_the_eager_heads_values(dtype, temperature, frozen, monkeypatch):
    """``compile_layers``' head (``models.compiled_head``): float32 round-off apart, the eager
    chunks' log-probs, entropies and gradients, through the chunked backward and through the
    slopes; in bfloat16 the logits' gradient is rounded to bfloat16 once either way, so the
    products that follow agree to its rounding."""
    ours, eager = compiled_against_eager(dtype, temperature, monkeypatch, frozen)
    torch.testing.assert_close(ours[0], eager[0], atol=2e-5, rtol=0)  # log-probs
    torch.testing.assert_close(ours[1], eager[1], atol=2e-5, rtol=0)  # entropies
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.01}
    for got, want in zip(ours[2:], eager[2:], strict=True):
        torch.testing.assert_close(got, want, **tol)
    assert float(eager[2].abs().max()) > 0.1  # a real gradient


def test_the_compiled_head_serves_temperature_1_with_the_runs_compilations(monkeypatch):
    """Compiled, the chunks divide by the temperature at 1 too (no bit changes), so the sync
    probe's temperature 1 compiles nothing beside the run's 0.8; eager skips that pass. The
    values at 1 are the eager head's bit for bit (Dynamo's graphs run eager)."""
    monkeypatch.setattr(models, "_COMPILED_HEAD", [])
    monkeypatch.setattr(models, "_GAVE_UP", [])
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(11, 16, generator=gen), torch.randn(50, 16, generator=gen)
    targets = torch.randint(0, 50, (11,), generator=gen)
    seen = {}
    for temperature in (0.8, 1.0):
        for ops in (models.compiled_head(), None):
            leaf = hidden.clone().requires_grad_()
            logp, _ = head_logprobs_and_entropy(
                leaf, weight, None, targets, temperature, 4, ops=ops
            )
            logp.sum().backward()
            seen[temperature, ops is None] = (logp.detach(), leaf.grad)
        assert counters["stats"]["unique_graphs"] == 1  # the forward with the slopes, at 0.8
        for ours, eager in zip(seen[temperature, False], seen[temperature, True], strict=True):
            assert torch.equal(ours, eager)
    assert not torch.equal(seen[0.8, True][0], seen[1.0, True][0])


def test_compile_layers_gives_the_head_its_compiled_chunks(monkeypatch):
    """A model whose head scoring takes chunk by chunk scores through the compiled chunks once
    its layers are compiled, and through the eager ones again once they are not."""
    monkeypatch.setattr(models, "_COMPILED_HEAD", [])
    model = attach_adapters(build_tiny_qwen3(num_hidden_layers=1), ["gen"], LoraSpec(2), seed=0)
    _, head = models.decoder_and_head(model)
    models.compile_layers(model)
    assert head._marlow_head_ops is models.compiled_head()
    models.compile_layers(model, on=False)
    assert head._marlow_head_ops is None
