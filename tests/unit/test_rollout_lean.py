"""The lean Qwen3 sampling forward computes what the model's own forward computes."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from marlow.models import fuse_norms
from marlow.policy.adapters import (
    LoraSpec,
    activate,
    attach_adapters,
    lora_compute_dtype,
    merged,
)
from marlow.rollout.hf import HFEngine, _Transformers
from marlow.rollout.lean import LeanQwen3
from marlow.types import BASE, GenRequest, SamplingParams


@pytest.fixture
def qwen3(make_model):
    """``qwen3(dtype=..., **config fields)``: the tiny random Qwen3 of the other rollout tests."""

    def build(dtype=torch.float32, **overrides):
        return make_model(seed=0, **overrides).to(dtype)

    return build


def padded_batch(lengths: list[int], seed: int = 1):
    """Left-padded prompts of the given lengths: ids (B, P), mask (B, P), positions (B, P)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(1, 50, (n,), generator=gen)
        mask[r, width - n :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def run(forward, ids, mask, positions, steps: int, drop_at: int | None = None):
    """Prefill, then ``steps`` greedy tokens one at a time, the way the sampling loop feeds a
    forward; at ``drop_at`` rows 0 and 2 leave the batch. Every step's logits, in order."""
    b, width = ids.shape
    mask = torch.cat([mask, torch.zeros(b, steps, dtype=torch.long)], dim=1)
    logits = forward(ids, mask, positions, 0)
    out = [logits]
    nxt = positions[:, -1:] + 1
    for t in range(steps):
        if t == drop_at:
            keep = torch.tensor([r for r in range(mask.shape[0]) if r not in (0, 2)])
            forward.select(keep)
            logits, mask, nxt = logits[keep], mask[keep], nxt[keep]
        mask[:, width + t] = 1
        logits = forward(logits.argmax(-1)[:, None], mask, nxt, width + t)
        nxt = nxt + 1
        out.append(logits)
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dtype"),
    [
        (4, 2, torch.float32),
        (4, 4, torch.float32),
        (8, 2, torch.float32),
        (4, 2, torch.bfloat16),
    ],
)
@pytest.mark.parametrize(
    "lengths",
    [[5, 9, 3, 9, 1], [6, 6, 6], [3, 8, 4, 8]],
    ids=["padded", "unpadded", "unpadded-once-rows-0-2-leave"],
)
def test_lean_logits_equal_the_models_forward(qwen3, heads, kv_heads, dtype, lengths):
    """The same operations in the same order: the same bits, step after step."""
    model = qwen3(dtype, num_attention_heads=heads, num_key_value_heads=kv_heads)
    ids, mask, positions = padded_batch(lengths)
    steps = 7
    with torch.inference_mode():
        theirs = run(_Transformers(model), ids, mask, positions, steps, drop_at=3)
        lean = LeanQwen3(model, len(lengths), ids.shape[1] + steps)
        ours = run(lean, ids, mask, positions, steps, drop_at=3)
    assert len(ours) == len(theirs) == steps + 1
    for t, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"step {t}")
    assert not torch.allclose(ours[0][0], ours[0][1], atol=1e-2)  # rows differ: not vacuous


def test_lean_follows_a_merged_adapter_and_the_base(qwen3):
    """Inside merged() the lean forward reads the folded weights; with the base active, the base."""
    base = qwen3()
    model = attach_adapters(base, ["gen"], LoraSpec(rank=4, alpha=8), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    ids, mask, positions = padded_batch([4, 7, 2])
    with torch.inference_mode():
        activate(model, "gen")
        adapted = run(_Transformers(model), ids, mask, positions, 4)
        with merged(model, "gen"):
            assert LeanQwen3.supports(model)
            folded = run(LeanQwen3(model, 3, ids.shape[1] + 4), ids, mask, positions, 4)
        activate(model, BASE)
        plain = run(LeanQwen3(model, 3, ids.shape[1] + 4), ids, mask, positions, 4)
        reference = run(_Transformers(model), ids, mask, positions, 4)
    for a, b in zip(folded, adapted, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    for a, b in zip(plain, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert not torch.allclose(folded[0], plain[0], atol=1e-3)  # the adapter changes the output


def test_supports_only_what_it_computes(qwen3):
    assert LeanQwen3.supports(qwen3())
    assert not LeanQwen3.supports(qwen3(rope_parameters={"rope_type": "linear", "factor": 2.0}))
    assert not LeanQwen3.supports(
        qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    )
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=96,
        )
    )
    assert not LeanQwen3.supports(llama)
    replaced = qwen3()
    replaced.model.layers[1].mlp.up_proj = torch.nn.Sequential(torch.nn.Linear(64, 128))
    assert not LeanQwen3.supports(replaced)
    with pytest.raises(ValueError, match="plain weights"):
        LeanQwen3(replaced, 1, 8)


def test_engine_samples_the_same_with_and_without_the_lean_forward(qwen3, tokenizer, monkeypatch):
    """Through the engine (merged adapters and the base, seeded temperature sampling, rows that
    stop early and leave the batch): the same tokens and log-probs either way, and the lean
    forward is the one that ran."""
    model = attach_adapters(qwen3(), ["gen", "agg"], LoraSpec(rank=4, alpha=8), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    gen = torch.Generator().manual_seed(3)
    reqs = [
        GenRequest(torch.randint(1, 50, (int(n),), generator=gen).tolist(), adapter)
        for n, adapter in zip(
            torch.randint(1, 12, (24,), generator=gen), ["gen", "agg", BASE] * 8, strict=True
        )
    ]
    params = SamplingParams(0.9, 20, seed=4)
    stops = [7, 11]
    calls = {"lean": 0, "prefill": 0}
    lean_call, lean_admit = LeanQwen3.__call__, LeanQwen3.admit

    def counted(self, ids, *a, **kw):
        calls["lean"] += 1
        return lean_call(self, ids, *a, **kw)

    def admitted(self, *a, **kw):
        calls["prefill"] += 1
        return lean_admit(self, *a, **kw)

    reference = HFEngine(model, tokenizer, merge=True, lean=False, stop_ids=stops).generate(
        reqs, params
    )
    assert calls["lean"] == 0
    monkeypatch.setattr(LeanQwen3, "__call__", counted)
    monkeypatch.setattr(LeanQwen3, "admit", admitted)
    ours = HFEngine(model, tokenizer, merge=True, stop_ids=stops).generate(reqs, params)
    assert calls["lean"] > 0
    assert any(c.finish_reason == "stop" for c in ours)
    assert any(c.finish_reason == "length" for c in ours)
    for a, b in zip(ours, reference, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
    # unmerged adapters run lean too, every adapter in one batch; with a seed per request a
    # row's draws do not depend on its batch, so they sample what the model's own forward
    # samples one adapter at a time (the log-probs within the stacked factors' round-off)
    seeded = [GenRequest(r.prompt_ids, r.adapter, seed=i) for i, r in enumerate(reqs)]
    calls["prefill"] = 0
    unmerged = HFEngine(model, tokenizer, merge=False, stop_ids=stops).generate(seeded, params)
    assert calls["prefill"] == 1  # one pass for the three adapters
    own = HFEngine(model, tokenizer, merge=False, lean=False, stop_ids=stops)
    for a, b in zip(unmerged, own.generate(seeded, params), strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )


def lora_model(qwen3, dtype=torch.float32):
    """The tiny Qwen3 with two LoRA adapters whose B factors are moved off zero."""
    model = attach_adapters(qwen3(dtype), ["gen", "agg"], LoraSpec(rank=4, alpha=8), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_computes_an_unmerged_lora_adapter_as_peft_does(qwen3, dtype, fused):
    """Each active adapter through the lean forward: the model's (PEFT's) logits, bit for bit,
    float32 LoRA factors over a float32 or bfloat16 base, padded rows leaving the batch; over the
    bfloat16 base both compute LoRA in bfloat16 (the model's forward under
    ``lora_in_base_dtype``, as the trainer scores: marlow's fused LoRA linear). ``fused``: the
    model's RMSNorms compute through torch's rms_norm (``fuse_norms``, as a loaded base's do),
    and the lean forward's as well."""
    model = lora_model(qwen3, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not the ones they start at: their product rounds
                p.uniform_(0.5, 1.5)
    if fused:
        assert fuse_norms(model) == 2 * 4 + 1
    ids, mask, positions = padded_batch([5, 9, 3, 9, 1])
    logits = {}
    with torch.inference_mode():
        for adapter in ("gen", "agg", BASE):
            activate(model, adapter)
            assert LeanQwen3.supports(model)
            theirs = run(_Transformers(model), ids, mask, positions, 5, drop_at=2)
            ours = run(LeanQwen3(model, 5, ids.shape[1] + 5), ids, mask, positions, 5, drop_at=2)
            for t, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"{adapter} step {t}")
            logits[adapter] = ours[0]
    assert not torch.allclose(logits["gen"], logits["agg"], atol=1e-3)  # not vacuous
    assert not torch.allclose(logits["gen"], logits[BASE], atol=1e-3)


def test_lora_computes_in_a_low_precision_bases_dtype(qwen3):
    """Over a bfloat16 base, the lean forward's factors are bfloat16 (eager or compiled), as
    ``lora_in_base_dtype`` makes PEFT's LoRA compute: each adapter still moves the logits as
    PEFT's float32 factors do, within bfloat16 round-off, far less than the adapter's own effect.
    Over a float32 base they stay float32."""
    model = lora_model(qwen3, torch.bfloat16)
    assert lora_compute_dtype(torch.bfloat16) == torch.bfloat16
    assert lora_compute_dtype(torch.float16) == torch.float16
    assert lora_compute_dtype(torch.float32) == torch.float32
    ids, mask, positions = padded_batch([5, 9, 3])
    length = ids.shape[1] + 1
    single = LeanQwen3(lora_model(qwen3), 3, length, compiled=True)
    assert single.w.layers[0]["q"].a.dtype == torch.float32
    with torch.inference_mode():
        activate(model, "gen")
        for compiled in (False, True):
            lean = LeanQwen3(model, 3, length, compiled=compiled)
            factors = (lean.w.layers[0]["q"].a, lean.w.layers[-1]["down"].b)
            assert [t.dtype for t in factors] == [torch.bfloat16] * 2
        ours = LeanQwen3(model, 3, length)(ids, mask, positions, 0)
        peft = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        activate(model, BASE)
        base = _Transformers(model)(ids, mask, positions, 0)
    error, effect = (ours - peft).abs().max(), (peft - base).abs().max()
    assert 0 < error < effect / 10, (error, effect)


def test_an_adapter_the_lean_forward_does_not_compute_takes_the_models_forward(qwen3):
    model = lora_model(qwen3)
    activate(model, "gen")
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    q_proj.use_dora["gen"] = True  # DoRA: a magnitude the lean forward does not apply
    assert not LeanQwen3.supports(model)
    activate(model, "agg")  # another adapter's layers are plain LoRA
    assert LeanQwen3.supports(model)


def test_the_kv_cache_grows_with_the_columns_written_unless_compiled(qwen3):
    """Eager, a call made for 1,000 columns whose rows stop after a few tokens holds a few
    columns; compiled, the cache holds the call's columns from the start, zeroed (its steps read
    the unwritten columns, masked). A column past the call's length is refused."""
    model = qwen3()
    ids, mask, positions = padded_batch([5, 3])
    lean = LeanQwen3(model, 2, 1000)
    with torch.inference_mode():
        run(lean, ids, mask, positions, steps=6)
    written = ids.shape[1] + 6
    assert all(written <= b.shape[2] <= 2 * written for b in lean.cache)
    static = LeanQwen3(model, 2, 40, compiled=True)
    assert all(b.shape[2] == 40 and not b.any() for b in static.cache)
    with pytest.raises(ValueError, match="past the 12"):
        run(LeanQwen3(model, 2, 12), ids, mask, positions, steps=8)
