"""HFEngine sampling and the LoRA adapter helpers, on a tiny random Qwen3 (no network)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from peft import PeftModel

from marlow.policy.adapters import (
    LoraSpec,
    activate,
    active_adapter,
    adapter_parameters,
    attach_adapters,
    load_adapter_weights,
    save_adapters,
    use_adapter,
)
from marlow.rollout import RolloutEngine, available_backends, get_backend, register_backend
from marlow.rollout.hf import HFEngine, _pick
from marlow.types import BASE, GenRequest, SamplingParams

PROMPTS = ["1+2=", "<|im_start|>12*34=", "9", "what is 7-5?\n", "(3)", "abc def", "0"]
SPEC = LoraSpec(rank=8, alpha=16)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def perturb_lora_b(model, name: str, seed: int, std: float = 0.3) -> None:
    """LoRA B starts at zero (adapter == base); give it weights so the adapter changes outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for path, p in adapter_parameters(model, name).items():
            if ".lora_B." in path:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def full_logprobs(
    model, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token from one unpadded forward, no cache."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # (P + L, V)
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.fixture
def two_adapters(make_model):
    """A PeftModel with adapters 'gen' and 'agg' (different, non-zero B), plus an untouched base."""
    base = make_model(seed=0)
    plain = copy.deepcopy(base)
    model = attach_adapters(base, ["gen", "agg"], SPEC, seed=0)
    perturb_lora_b(model, "gen", seed=1)
    perturb_lora_b(model, "agg", seed=2)
    return model, plain


# ---------------------------------------------------------------- sampling


def test_batched_greedy_equals_one_at_a_time(two_adapters, tokenizer):
    model, _ = two_adapters
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, seed=0)
    reqs = [GenRequest(encode(tokenizer, p), "gen") for p in PROMPTS]
    batched = engine.generate(reqs, params)
    chunked = HFEngine(model, tokenizer, max_batch=3).generate(reqs, params)
    for req, b, c in zip(reqs, batched, chunked, strict=True):
        (single,) = engine.generate([req], params)
        for other in (single, c):
            assert other.token_ids == b.token_ids
            assert other.finish_reason == b.finish_reason
            torch.testing.assert_close(
                torch.tensor(other.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
            )
    assert len({tuple(c.token_ids) for c in batched}) > 1  # prompts matter


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_sampler_logprobs_match_full_forward(two_adapters, tokenizer, temperature):
    """The logprobs the sampler records equal what the trainer recomputes, under each row's adapter."""
    model, _ = two_adapters
    adapters = ["gen", "agg", BASE, "agg", "gen", BASE, "gen"]
    reqs = [GenRequest(encode(tokenizer, p), a) for p, a in zip(PROMPTS, adapters, strict=True)]
    out = HFEngine(model, tokenizer).generate(reqs, SamplingParams(temperature, 16, seed=5))
    for req, comp in zip(reqs, out, strict=True):
        assert len(comp.token_ids) == len(comp.logprobs) > 0
        with use_adapter(model, req.adapter):
            expect = full_logprobs(model, req.prompt_ids, comp.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(comp.logprobs), expect, atol=1e-4, rtol=0)


def test_finish_reason_stop_when_model_is_forced_to_emit_eos(make_model, tokenizer):
    model = make_model(seed=0)
    eos = tokenizer.eos_token_id
    # A prompt-independent head: zero weights, bias pointing at eos -> eos is always sampled.
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-20.0)
        head.bias[eos] = 20.0
    model.lm_head = head
    reqs = [GenRequest(encode(tokenizer, p), BASE) for p in PROMPTS[:3]]
    for temperature in (0.0, 1.0):
        for comp in HFEngine(model, tokenizer).generate(reqs, SamplingParams(temperature, 8, 0)):
            assert comp.finish_reason == "stop"
            assert comp.token_ids == [eos]  # the stop token is kept...
            assert comp.text == ""  # ...but not decoded
            assert comp.logprobs[0] == pytest.approx(0.0, abs=1e-6)


def test_finish_reason_length_and_stop_ids(make_model, tokenizer):
    model = make_model(seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, seed=0)
    req = GenRequest(encode(tokenizer, "1+2="), BASE)
    (free,) = HFEngine(model, tokenizer, stop_ids=[63]).generate([req], params)
    assert 63 not in free.token_ids  # the chosen stop id is never produced...
    assert free.finish_reason == "length" and len(free.token_ids) == 10  # ...so we run to the cap
    # Stop at the first occurrence of any listed id: the 4th greedy token, or an earlier one.
    stops = [free.token_ids[3], 63]
    (cut,) = HFEngine(model, tokenizer, stop_ids=stops).generate([req], params)
    first = min(i for i, t in enumerate(free.token_ids) if t in stops)
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: first + 1]
    assert cut.text == tokenizer.decode(cut.token_ids, skip_special_tokens=True)


def test_a_completion_also_ends_at_the_eos_ids_of_the_models_generation_config(
    make_model, tokenizer
):
    model = make_model(seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, seed=0)
    req = GenRequest(encode(tokenizer, "1+2="), BASE)
    model.generation_config.eos_token_id = None
    (free,) = HFEngine(model, tokenizer).generate([req], params)
    assert free.finish_reason == "length"  # the tokenizer's eos never comes
    # a model whose turn ends with another id than the tokenizer's eos (Gemma's <end_of_turn>)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, free.token_ids[3]]
    engine = HFEngine(model, tokenizer)
    assert engine.stop_ids == [tokenizer.eos_token_id, free.token_ids[3]]
    (cut,) = engine.generate([req], params)
    first = free.token_ids.index(free.token_ids[3])
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[: first + 1]


def test_default_stop_ids_take_each_eos_once_and_need_one():
    from types import SimpleNamespace as NS

    from marlow.rollout.base import default_stop_ids

    def model(eos):
        return NS(generation_config=NS(eos_token_id=eos))

    assert default_stop_ids(model([5, 7, 5]), NS(eos_token_id=5)) == [5, 7]
    assert default_stop_ids(model(7), NS(eos_token_id=None)) == [7]
    assert default_stop_ids(NS(), NS(eos_token_id=3)) == [3]  # no generation config
    with pytest.raises(ValueError, match="names an eos token"):
        default_stop_ids(model(None), NS(eos_token_id=None))


def test_finished_rows_do_not_disturb_running_rows(make_model, tokenizer):
    """One row stops early; the others keep generating exactly as they would alone."""
    model = make_model(seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, seed=0)
    reqs = [GenRequest(encode(tokenizer, p), BASE) for p in PROMPTS[:4]]
    alone = [HFEngine(model, tokenizer, stop_ids=[63]).generate([r], params)[0] for r in reqs]
    stops = [alone[0].token_ids[1], 63]  # row 0 stops by its 2nd token
    batched = HFEngine(model, tokenizer, stop_ids=stops).generate(reqs, params)
    assert batched[0].finish_reason == "stop" and len(batched[0].token_ids) <= 2
    for a, b in zip(alone, batched, strict=True):
        first = next((i for i, t in enumerate(a.token_ids) if t in stops), None)
        expect = a.token_ids if first is None else a.token_ids[: first + 1]
        assert b.token_ids == expect


def test_same_seed_same_samples_other_seed_different(two_adapters, tokenizer):
    model, _ = two_adapters
    engine = HFEngine(model, tokenizer)
    reqs = [GenRequest(encode(tokenizer, p), a) for p in PROMPTS for a in ("gen", BASE)]
    run = lambda seed: engine.generate(reqs, SamplingParams(1.0, 16, seed))  # noqa: E731
    first, again, other = run(7), run(7), run(8)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_seeded_requests_sample_the_same_alone_or_in_any_batch(two_adapters, tokenizer):
    """rollout.seeding=request: a request's sample depends on its own seed only, so a problem
    sharded to another data-parallel rank (other batch mates, another place) draws the same."""
    model, _ = two_adapters
    engine = HFEngine(model, tokenizer)
    reqs = [
        GenRequest(encode(tokenizer, p), a, seed=1000 + 10 * i + j)
        for i, p in enumerate(PROMPTS)
        for j, a in enumerate(("gen", BASE))
    ]
    params = SamplingParams(1.0, 16, seed=3)
    together = engine.generate(reqs, params)
    alone = [engine.generate([r], SamplingParams(1.0, 16, seed=99))[0] for r in reqs]
    shuffled = list(reversed(reqs))
    apart = list(reversed(HFEngine(model, tokenizer, max_batch=3).generate(shuffled, params)))
    for a, b, c in zip(together, alone, apart, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    other = engine.generate([replace(r, seed=r.seed + 1) for r in reqs], params)
    assert [c.token_ids for c in other] != [c.token_ids for c in together]
    mixed = [reqs[0], GenRequest(reqs[1].prompt_ids, reqs[1].adapter)]
    with pytest.raises(ValueError, match="every request of a call has a seed or none"):
        engine.generate(mixed, params)


@pytest.mark.parametrize("merge", [True, False], ids=["lean", "model-forward"])
def test_rows_sharing_a_prompt_prefill_it_once_and_sample_as_alone(
    two_adapters, tokenizer, monkeypatch, merge
):
    """A group's rows (one prompt, several samples) share one prefill: the first forward of the
    call sees each distinct prompt once, and every row samples what it samples alone."""
    from marlow.rollout import hf

    model, _ = two_adapters
    reqs = [
        GenRequest(encode(tokenizer, p), "gen", seed=500 + 10 * i + j)
        for j in range(4)
        for i, p in enumerate(PROMPTS[:3])
    ]  # interleaved: prompt 0, 1, 2, 0, 1, 2, ...
    first_rows = []
    for cls in (hf._Transformers, hf.LeanQwen3):
        admit = cls.admit

        def spy(self, slots, ids, *args, _admit=admit):
            first_rows.append(ids.shape[0])
            return _admit(self, slots, ids, *args)

        monkeypatch.setattr(cls, "admit", spy)
    params = SamplingParams(1.0, 12, seed=0)
    engine = HFEngine(model, tokenizer, merge=merge)
    together = engine.generate(reqs, params)
    assert first_rows == [3]  # three distinct prompts, twelve rows
    alone = [engine.generate([r], params)[0] for r in reqs]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
    assert len({tuple(c.token_ids) for c in together[::3]}) > 1  # a group's samples differ


def test_rows_that_stop_at_different_steps_leave_the_others_as_they_were(two_adapters, tokenizer):
    """Stopped rows leave the working batch (with their KV cache) in several waves; every row
    still samples exactly what it samples alone, and keeps its length and finish reason."""
    model, _ = two_adapters
    reqs = [
        GenRequest(encode(tokenizer, p), a, seed=500 + 7 * i + j)
        for i, p in enumerate(PROMPTS)
        for j, a in enumerate(("gen", "agg", BASE))
    ]
    params = SamplingParams(1.0, 24, seed=0)
    free = HFEngine(model, tokenizer, stop_ids=[63]).generate(reqs, params)
    counts: dict[int, int] = {}
    for c in free:
        for t in c.token_ids[1:]:
            counts[t] = counts.get(t, 0) + 1
    stops = sorted(counts, key=lambda t: -counts[t])[:3]  # frequent tokens: rows stop early
    engine = HFEngine(model, tokenizer, stop_ids=stops)
    together = engine.generate(reqs, params)
    alone = [engine.generate([r], params)[0] for r in reqs]
    lengths = {len(c.token_ids) for c in together}
    assert len(lengths) >= 4, lengths  # the rows really stopped at different steps
    assert {c.finish_reason for c in together} == {"stop", "length"}
    for a, b in zip(together, alone, strict=True):
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def test_sampling_by_inversion_draws_the_categorical_distribution():
    """The seeded path's first-token frequencies match softmax(logits / T) (chi-square test on
    20,000 draws; the call-seeded path is torch.multinomial)."""
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.0, -9.0, 0.0]]).repeat(20_000, 1)
    u = torch.rand(20_000, generator=torch.Generator().manual_seed(0))
    tok, lp = _pick(logits, 0.8, torch.Generator(), u)
    expect = torch.softmax(logits[0] / 0.8, -1)
    counts = torch.bincount(tok, minlength=6).double()
    stat = float((((counts - 20_000 * expect) ** 2) / (20_000 * expect)).sum())
    assert stat < 20.5  # chi-square, 5 degrees of freedom: p = 0.001
    assert counts[4] <= 2  # an id of mass 4e-6 is all but never drawn
    torch.testing.assert_close(
        lp, torch.log_softmax(logits / 0.8, -1).gather(-1, tok[:, None])[:, 0]
    )


def test_requests_are_routed_to_their_adapter(two_adapters, tokenizer):
    model, plain = two_adapters
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, seed=0)
    adapters = ["gen", "agg", BASE, "agg", "gen", BASE, "agg"]
    reqs = [GenRequest(encode(tokenizer, p), a) for p, a in zip(PROMPTS, adapters, strict=True)]
    mixed = engine.generate(reqs, params)
    for name in ("gen", "agg"):
        mine = [i for i, r in enumerate(reqs) if r.adapter == name]
        alone = engine.generate([reqs[i] for i in mine], params)
        assert [mixed[i].token_ids for i in mine] == [c.token_ids for c in alone]
    base_rows = [i for i, r in enumerate(reqs) if r.adapter == BASE]
    on_plain = HFEngine(plain, tokenizer).generate([reqs[i] for i in base_rows], params)
    assert [mixed[i].token_ids for i in base_rows] == [c.token_ids for c in on_plain]
    # The adapters really differ, so the checks above test routing.
    same_prompt = [GenRequest(reqs[0].prompt_ids, a) for a in ("gen", "agg", BASE)]
    assert len({tuple(c.token_ids) for c in engine.generate(same_prompt, params)}) == 3


def test_generate_restores_adapter_and_mode_and_validates(two_adapters, tokenizer):
    model, _ = two_adapters
    engine = HFEngine(model, tokenizer)
    activate(model, "agg")
    model.train()
    engine.generate([GenRequest(encode(tokenizer, "1"), "gen")], SamplingParams(0.7, 4, 0))
    assert active_adapter(model) == "agg" and model.training
    with pytest.raises(ValueError, match="unknown adapter 'zzz'"):
        engine.generate([GenRequest([5], "zzz")], SamplingParams())
    with pytest.raises(ValueError, match="empty prompt_ids"):
        engine.generate([GenRequest([], "gen")], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([GenRequest([5], "gen")], SamplingParams(temperature=-1.0))
    assert engine.generate([], SamplingParams()) == []


def test_backend_registry():
    assert get_backend("hf") is HFEngine
    assert "hf" in available_backends()
    with pytest.raises(ValueError, match="valid: .*hf"):
        get_backend("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_backend("hf", HFEngine)
    assert issubclass(HFEngine, RolloutEngine)  # structural check of the Protocol


# ---------------------------------------------------------------- adapters


def test_attach_freezes_base_and_is_deterministic(make_model):
    m1 = attach_adapters(make_model(seed=0), ["x", "y"], SPEC, seed=3)
    m2 = attach_adapters(make_model(seed=0), ["x", "y"], SPEC, seed=3)
    for path, p in m1.named_parameters():
        assert p.requires_grad == (".lora_" in path), path
    p1, p2 = adapter_parameters(m1, "x"), adapter_parameters(m2, "x")
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    a_x = [p for k, p in p1.items() if ".lora_A." in k]
    a_y = [p for k, p in adapter_parameters(m1, "y").items() if ".lora_A." in k]
    assert not torch.equal(a_x[0], a_y[0])  # each adapter gets its own init
    with pytest.raises(ValueError, match="reserved"):
        attach_adapters(make_model(seed=0), ["x", BASE], SPEC, seed=0)
    with pytest.raises(ValueError, match="lora_"):
        attach_adapters(make_model(seed=0), ["a"], SPEC, seed=0)  # PEFT would mangle it on load
    with pytest.raises(ValueError, match="unique"):
        attach_adapters(make_model(seed=0), ["x", "x"], SPEC, seed=0)


def test_fresh_adapter_equals_base(make_model, tokenizer):
    plain = make_model(seed=0)
    model = attach_adapters(copy.deepcopy(plain), ["x"], SPEC, seed=0)
    ids = torch.tensor([encode(tokenizer, "12+3=")])
    with torch.no_grad(), use_adapter(model, "x"):
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_adapter_parameters_match_exact_names(make_model):
    model = attach_adapters(make_model(seed=0), ["worker", "workers"], SPEC, seed=0)
    worker, workers = adapter_parameters(model, "worker"), adapter_parameters(model, "workers")
    assert set(worker).isdisjoint(workers)
    assert len(worker) == len(workers) == 2 * 7 * model.config.num_hidden_layers  # A, B x 7 linears
    assert all(".worker." in k for k in worker) and not any(".workers." in k for k in worker)
    assert all(".workers." in k for k in workers)
    all_lora = {n for n, _ in model.named_parameters() if ".lora_" in n}
    assert all_lora == set(worker) | set(workers)
    with pytest.raises(ValueError, match="unknown adapter 'work'"):
        adapter_parameters(model, "work")


def test_activate_keeps_all_adapters_trainable_and_routes_gradients(make_model, tokenizer):
    model = attach_adapters(make_model(seed=0), ["worker", "workers"], SPEC, seed=0)
    perturb_lora_b(model, "worker", seed=1)
    model.set_adapter("workers")  # PEFT's own switch turns requires_grad off on 'worker'...
    activate(model, "worker")  # ...and ours turns it back on
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)
    ids = torch.tensor([encode(tokenizer, "1+2=3")])
    model(input_ids=ids).logits.sum().backward()
    assert all(p.grad is not None for p in adapter_parameters(model, "worker").values())
    assert all(p.grad is None for p in adapter_parameters(model, "workers").values())
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)

    with use_adapter(model, BASE):
        assert active_adapter(model) == BASE
        with use_adapter(model, "workers"):
            assert active_adapter(model) == "workers"
        assert active_adapter(model) == BASE
    assert active_adapter(model) == "worker"
    with pytest.raises(ValueError, match="valid"):
        activate(model, "nobody")

    # A switch is a flag flip: no parameter is replaced, moved or written (merging LoRA into the
    # base, or re-creating adapters, would be). Its time is measured in bench/adapter_switch.py.
    before = {n: (p, p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    for name in ("workers", BASE, "worker", BASE):
        activate(model, name)
        after = dict(model.named_parameters())
        assert after.keys() == before.keys()
        for n, (p, ptr, value) in before.items():
            assert after[n] is p and p.data_ptr() == ptr and torch.equal(p, value), n


def test_save_load_round_trip_keeps_parameter_identity(make_model, tmp_path):
    model = attach_adapters(make_model(seed=0), ["worker", "workers"], SPEC, seed=0)
    perturb_lora_b(model, "worker", seed=1)
    perturb_lora_b(model, "workers", seed=2)
    saved = {
        a: {k: p.detach().clone() for k, p in adapter_parameters(model, a).items()}
        for a in ("worker", "workers")
    }
    save_adapters(model, tmp_path / "adapters", ["worker", "workers"])
    for a in ("worker", "workers"):
        assert sorted(p.name for p in (tmp_path / "adapters" / a).iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    params = {a: adapter_parameters(model, a) for a in saved}
    with torch.no_grad():
        for a in saved:
            for p in params[a].values():
                p.add_(1.0)
    load_adapter_weights(model, tmp_path / "adapters", ["worker", "workers"])
    for a in saved:
        after = adapter_parameters(model, a)
        assert all(after[k] is params[a][k] for k in after)  # optimizers keep valid references
        assert all(torch.equal(after[k], saved[a][k]) for k in after), a
        assert all(p.requires_grad for p in after.values())
    save_adapters(model, tmp_path / "adapters", ["worker"])  # overwriting an existing save works

    other = attach_adapters(make_model(seed=0), ["worker"], LoraSpec(rank=4), seed=0)
    with pytest.raises(ValueError, match="rank"):
        load_adapter_weights(other, tmp_path / "adapters", ["worker"])  # rank 8 into rank 4


@pytest.mark.filterwarnings(
    "ignore:.*is_gradient_checkpointing.*:FutureWarning"
)  # peft 0.21 x tf 5
def test_saved_adapter_loads_with_peft_from_pretrained(make_model, tokenizer, tmp_path):
    model = attach_adapters(make_model(seed=0), ["worker", "workers"], SPEC, seed=0)
    perturb_lora_b(model, "workers", seed=2)
    save_adapters(model, tmp_path, ["workers"])
    reloaded = PeftModel.from_pretrained(make_model(seed=0), tmp_path / "workers").eval()
    ids = torch.tensor([encode(tokenizer, "what is 7-5?")])
    with torch.no_grad(), use_adapter(model, "workers"):
        ours = model(input_ids=ids).logits
    with torch.no_grad():
        theirs = reloaded(input_ids=ids).logits
        base = make_model(seed=0)(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert not torch.allclose(theirs, base, atol=1e-3)  # the adapter is not a no-op


def test_merged_adapter_samples_what_the_adapter_samples_and_leaves_the_base_exact(
    two_adapters, tokenizer
):
    """rollout.merge_lora: the LoRA folded into the base weights for sampling gives the same
    tokens as the unmerged adapter (log-probs to round-off); afterwards the base weights are the
    very same tensors, bit for bit, and every LoRA parameter is still trainable."""
    from marlow.policy.adapters import can_merge, merged

    model, plain = two_adapters
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    identity = {k: id(v) for k, v in model.named_parameters()}
    reqs = [
        GenRequest(encode(tokenizer, p), a, seed=900 + i)
        for i, p in enumerate(PROMPTS)
        for a in ("gen", "agg", BASE)
    ]
    params = SamplingParams(1.0, 16, seed=0)
    unmerged = HFEngine(model, tokenizer).generate(reqs, params)
    folded = HFEngine(model, tokenizer, merge=True).generate(reqs, params)
    for a, b in zip(unmerged, folded, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
    assert {k: id(v) for k, v in model.named_parameters()} == identity
    for k, v in model.named_parameters():
        assert torch.equal(v, before[k]), k
        assert v.requires_grad == (".lora_" in k), k
    assert active_adapter(model) == "gen"  # the fixture's active adapter, restored
    # inside the block the model is the adapter, as one plain forward
    ids = torch.tensor([encode(tokenizer, PROMPTS[1])])
    assert can_merge(model, "agg")
    with torch.no_grad():
        with use_adapter(model, "agg"):
            want = model(input_ids=ids).logits
        with merged(model, "agg"):
            got = model(input_ids=ids).logits
            assert active_adapter(model) == BASE
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, plain(input_ids=ids).logits, atol=1e-3)  # not the base


def test_folded_adapter_trains_like_the_adapter(two_adapters, make_model, tokenizer):
    """grpo.fold_lora: each LoRA layer as one matmul with x @ (W + s B A).T gives PEFT's outputs
    and A/B gradients to round-off; afterwards the layers compute as PEFT's again, the previous
    adapter is active, and an adapter with LoRA dropout cannot be folded."""
    from marlow.policy.adapters import can_fold, folded

    model, _ = two_adapters
    ids = torch.tensor([encode(tokenizer, p) for p in ("12*34=", "abc de", "(3)+9=")])
    params = adapter_parameters(model, "agg")

    def loss_and_grads(context):
        for p in params.values():
            p.grad = None
        with context:
            logits = model(input_ids=ids).logits
        loss = torch.log_softmax(logits, -1)[..., 5].sum()  # any scalar of every position
        loss.backward()
        return float(loss.detach()), {k: p.grad.clone() for k, p in params.items()}

    assert can_fold(model, "agg")
    want, want_grads = loss_and_grads(use_adapter(model, "agg"))
    got, got_grads = loss_and_grads(folded(model, "agg"))
    assert got == pytest.approx(want, rel=1e-6)
    for k, g in want_grads.items():
        assert float(g.norm()) > 0, k  # every LoRA tensor gets a gradient: not vacuous
        assert float((got_grads[k] - g).norm() / g.norm()) < 1e-5, k
    assert active_adapter(model) == "gen"
    assert all("forward" not in m.__dict__ for m in model.modules())
    with torch.no_grad():
        with use_adapter(model, "agg"):
            again = model(input_ids=ids).logits
        with folded(model, "agg"):
            inside = model(input_ids=ids).logits
            with use_adapter(model, "gen"):  # another adapter inside the block: PEFT's forward
                other = model(input_ids=ids).logits
        with use_adapter(model, "gen"):
            gen = model(input_ids=ids).logits
    torch.testing.assert_close(inside, again, atol=1e-5, rtol=0)
    torch.testing.assert_close(other, gen, atol=0, rtol=0)
    assert not torch.allclose(inside, gen, atol=1e-3)

    dropped = attach_adapters(make_model(seed=0), ["p"], replace(SPEC, dropout=0.1), seed=0)
    assert not can_fold(dropped, "p")
    with pytest.raises(ValueError, match="cannot fold"), folded(dropped, "p"):
        pass
