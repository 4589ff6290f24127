"""marlow.models.compile_layers: decoder layers through torch.compile score and backpropagate as
the eager ones (float32 within round-off; bfloat16 no farther from float32's than eager), over
every adapter and the base, checkpointed or not; the sampling loop through the model's modules
runs them eager; a compilation that fails warns once and leaves them eager."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch._dynamo.utils import counters

from marlow import models
from marlow.algo import matmul
from marlow.config import ConfigError
from marlow.models import checkpoint_layers, compile_layers, completion_logprobs, fuse_norms
from marlow.policy.adapters import LoraSpec, attach_adapters, use_adapter
from marlow.types import BASE
from tests.conftest import build_tiny_qwen3

ADAPTERS = ("gen", "agg")


def lora_model(dtype=torch.float32, **config):
    """A random Qwen3 (2 layers, else ``config``'s) in ``dtype`` with two adapters (float32
    factors, as a run's), whose B factors are not zero."""
    base = build_tiny_qwen3(**config).to(dtype)
    model = attach_adapters(base, list(ADAPTERS), LoraSpec(8, 16), seed=0)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            assert p.dtype == torch.float32
            torch.nn.init.normal_(p, std=0.1)
    return model.train()


def rows(seed: int, n: int, length: int, padded: bool = True):
    """Right-padded rows (the first cut short, where ``padded``) and their completions, as the
    trainer scores."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 64, (n, length), generator=g)
    attention = torch.ones_like(ids)
    attention[0, length - 3 :] = 0 if padded else 1
    prompt = torch.full((n,), length // 2)
    targets = ids[:, length // 2 :]
    return ids, attention, prompt, targets, attention[:, length // 2 :].bool()


def passes(model, adapters=ADAPTERS, base: bool = True) -> list:
    """Each of ``adapters``' and (``base``) the base's log-probs, entropies and (adapters) LoRA
    gradients, on micro-batches of two shapes."""
    out = []
    for i, adapter in enumerate((*adapters, BASE) if base else adapters):
        for n, length in ((3, 20), (5, 27)):
            batch = rows(10 * i + n, n, length)
            model.zero_grad(set_to_none=True)
            with use_adapter(model, adapter):
                logp, ent = completion_logprobs(model, *batch, 0.8)
                if adapter != BASE:
                    (-(logp * batch[-1]).sum()).backward()
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
            out.append((logp.detach(), ent, grads))
    return out


def assert_close_passes(ours, theirs, tol: float) -> None:
    for (logp, ent, grads), (their_logp, their_ent, their_grads) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(logp, their_logp, atol=tol, rtol=tol)
        torch.testing.assert_close(ent, their_ent, atol=tol, rtol=tol)
        assert grads.keys() == their_grads.keys()
        for k, g in their_grads.items():
            torch.testing.assert_close(grads[k], g, atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
def test_compiled_layers_score_and_backprop_as_eager_ones(checkpointed, monkeypatch):
    monkeypatch.setattr(models, "_GAVE_UP", [])
    model = lora_model()
    if checkpointed:
        checkpoint_layers(model)
    eager = passes(model)
    assert any(g for _, _, g in eager)  # gradients to compare
    assert compile_layers(model) == 2
    torch._dynamo.reset()  # so that the graphs counted are this test's
    counters.clear()
    compiled = passes(model)
    # per adapter with gradients (the first layer's input needs none, the others' do), the
    # base's without; the second shape compiles nothing more (dynamic shapes)
    assert counters["stats"]["unique_graphs"] >= 5 and not counters["graph_break"]
    assert not models._GAVE_UP
    assert_close_passes(compiled, eager, 1e-4)  # measured: 1.2e-5 apart at most
    compile_layers(model, on=False)
    counters.clear()
    assert_close_passes(passes(model), eager, 0.0)  # eager again: the same bits
    assert not counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_bfloat16_layers_are_no_farther_from_float32_than_eager_ones(monkeypatch):
    """Checkpointed, as a run's over a Hugging Face model: a fused kernel rounds to bfloat16
    once where eager rounds after every operation. The recompute runs after
    ``lora_in_base_dtype`` closed and must compute LoRA in bfloat16 as the forward did, or the
    compiled recompute saves other tensors and the checkpoint refuses them (a CheckpointError
    before ``recompute_as_forward``). Not checkpointed, no farther either: its forward is the
    graph with gradients (the recompute's), which the compiler fuses otherwise than the
    checkpointed forward's without them, so the two round differently in bfloat16."""
    monkeypatch.setattr(models, "_GAVE_UP", [])
    # one adapter, not the base: each compiles apart (the default run's time)
    run = partial(passes, adapters=ADAPTERS[:1], base=False)
    exact = run(lora_model())
    model = lora_model(torch.bfloat16)
    checkpoint_layers(model)
    eager = run(model)
    compile_layers(model)
    torch._dynamo.reset()  # the first compilation is the checkpointed forward's
    counters.clear()
    compiled = run(model)
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]
    assert not models._GAVE_UP

    def gap(run) -> float:  # the largest relative error of a log-prob or a gradient
        worst = 0.0
        for (logp, _, grads), (ref_logp, _, ref_grads) in zip(run, exact, strict=True):
            worst = max(worst, float((logp - ref_logp).abs().max() / ref_logp.abs().max()))
            for k, g in ref_grads.items():
                worst = max(worst, float((grads[k] - g).norm() / g.norm()))
        return worst

    assert gap(eager) > 0  # bfloat16 is not float32
    assert gap(compiled) <= 1.5 * gap(eager)
    checkpoint_layers(model, on=False)
    counters.clear()
    unchecked = run(model)
    assert not counters["stats"]["unique_graphs"]  # the recompute's graphs, compiled before
    assert gap(unchecked) <= 1.5 * gap(eager)


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "slow-bf16"])
def test_compiled_bfloat16_layers_share_their_compilations(monkeypatch, native):
    """Over a bfloat16 base the norms and the LoRA linears compute through marlow's forwards
    (``fuse_norms``, ``lora_in_base_dtype``), by their class (``marlow.forwards``): every layer
    shares one compilation per kind of pass, however many layers, and a later pass (a new
    ``lora_in_base_dtype`` block, new factors held) compiles nothing more. Before, an object set
    on each module was guarded by its identity: a compilation per layer and per block, until
    torch's limit, then eager. Dynamo alone (its guards decide; no code generated).

    On both kinds of CPU, whichever this one is: with native bfloat16 products (AVX-512 BF16,
    AMX) and without (AVX2), where :func:`marlow.algo.matmul.operands` re-lays out an operand of
    each backward product without a guard on the tokens' count (with one, 7 graphs here)."""
    monkeypatch.setattr(matmul, "_NATIVE", {**matmul._NATIVE, torch.bfloat16: native})
    monkeypatch.setattr(models, "_GAVE_UP", [])
    monkeypatch.setattr(models, "_COMPILED_HEAD", [])  # made anew with the eager backend
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
    run = partial(passes, adapters=ADAPTERS[:1], base=False)
    graphs = []
    for layers in (2, 3):
        model = lora_model(torch.bfloat16, num_hidden_layers=layers)
        assert fuse_norms(model) == 2 * layers + 1 + 2 * layers  # with q_norm and k_norm
        checkpoint_layers(model)
        compile_layers(model)
        torch._dynamo.reset()
        counters.clear()
        run(model)
        graphs.append(counters["stats"]["unique_graphs"])
        run(model)
        assert counters["stats"]["unique_graphs"] == graphs[-1]  # nothing compiled again
        assert not counters["graph_break"] and not models._GAVE_UP
    # the checkpointed forward without a graph, and its recompute with one where the layer's
    # input needs no gradient (the first, after the frozen embedding) and where it does; and
    # the frozen LM head's chunk forward with its slopes (compiled_head)
    assert graphs == [4, 4]


def test_compiled_bfloat16_layers_serve_every_adapter_with_the_same_compilations(monkeypatch):
    """The compiled layers read each LoRA linear's factors as tensors found before the call
    (``active_factors``), not by the adapter's name: a second adapter, and the first again
    after it, compile nothing more, and each computes with its own factors, the values of the
    eager layers bit for bit (Dynamo's graphs run eager). Before, each adapter was guarded by
    its name and compiled apart."""
    monkeypatch.setattr(models, "_GAVE_UP", [])
    monkeypatch.setattr(models, "_COMPILED_HEAD", [])  # made anew with the eager backend
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
    model = lora_model(torch.bfloat16)
    checkpoint_layers(model)
    order = (*ADAPTERS, ADAPTERS[0])
    eager = passes(model, adapters=order, base=False)
    compile_layers(model)
    torch._dynamo.reset()
    counters.clear()
    first = passes(model, adapters=ADAPTERS[:1], base=False)
    one = counters["stats"]["unique_graphs"]
    compiled = passes(model, adapters=order, base=False)
    assert counters["stats"]["unique_graphs"] == one  # the other adapter compiled nothing
    assert not counters["graph_break"] and not models._GAVE_UP
    assert_close_passes(first, eager[:2], 0.0)
    assert_close_passes(compiled, eager, 0.0)
    # and the adapters do differ: each read its own factors
    assert not torch.equal(eager[0][0], eager[2][0])


def test_sampling_through_the_models_modules_runs_compiled_layers_eager(tokenizer, monkeypatch):
    from marlow.rollout.hf import HFEngine
    from marlow.types import GenRequest, SamplingParams

    monkeypatch.setattr(models, "_GAVE_UP", [])
    model = lora_model().eval()
    engine = HFEngine(model, tokenizer, lean=False, stop_ids=[3])
    requests = [GenRequest([5, 6, 7 + i], adapter) for i, adapter in enumerate(ADAPTERS * 2)]
    params = SamplingParams(0.0, 12, seed=0)
    before = engine.generate(requests, params)
    compile_layers(model)
    counters.clear()
    after = engine.generate(requests, params)
    assert not counters["stats"]["unique_graphs"]  # nothing compiled: the cache grows per token
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before]


def test_a_failed_compilation_warns_once_and_runs_eager(monkeypatch):
    monkeypatch.setattr(models, "_GAVE_UP", [])

    def broken(fn, **_):
        def call(*args, **kwargs):
            raise torch._dynamo.exc.TorchDynamoException("backend raised:\nno compiler here\nmore")

        return call

    model = lora_model()
    eager = passes(model)
    monkeypatch.setattr(models, "_COMPILED_HEAD", [])
    monkeypatch.setattr(torch, "compile", broken)
    compile_layers(model)
    with pytest.warns(
        RuntimeWarning, match="compiling the decoder layers or the LM head failed"
    ) as seen:
        ours = passes(model)
    assert len(seen) == 1 and "no compiler here" in str(seen[0].message)
    assert "more" not in str(seen[0].message)  # one line: the first that says what failed
    assert_close_passes(ours, eager, 0.0)


def test_compile_layers_needs_decoder_layers_and_only_on_compiles(small_config):
    with pytest.raises(ValueError, match="no decoder layers that can be compiled"):
        compile_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert not models.compiles_layers(small_config())  # auto: off, CUDA included
    assert models.compiles_layers(small_config(grpo={"compile": "on"}))
    assert not models.compiles_layers(small_config(grpo={"compile": "off"}))
    # a folded layer's forward is made anew every step: never both
    assert not models.compiles_layers(small_config(grpo={"fold_lora": "on"}))
    with pytest.raises(ConfigError, match="grpo.fold_lora and grpo.compile are both on"):
        small_config(grpo={"fold_lora": "on", "compile": "on"})


def test_compiled_layers_turn_auto_folding_off(small_config, tmp_path):
    """A float32 run on the CPU folds its LoRA by default, unless its layers are compiled."""
    from marlow.training.trainer import Trainer

    with Trainer(small_config(), tmp_path / "plain") as t:
        assert all(t.fold.values())
    with Trainer(small_config(grpo={"compile": "on"}), tmp_path / "compiled") as t:
        assert not any(t.fold.values())
        layers = models.checkpointable_layers(t.model)
        assert all(layer._marlow_call["compiled"] is not None for layer in layers)
