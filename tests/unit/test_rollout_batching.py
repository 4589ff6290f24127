"""One sampling pass for every adapter of a call, and the static, compiled decode step: the
same tokens as a pass per adapter through the model's own forward, the same distribution, and
rows that do not depend on their batch-mates."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from marlow.models import _LIMIT, fuse_norms
from marlow.policy.adapters import LoraSpec, activate, attach_adapters
from marlow.prompts import render
from marlow.prompts.chat import chat_prompt_ids
from marlow.rollout.hf import HFEngine, _bucket, _Transformers
from marlow.rollout.lean import LeanQwen3
from marlow.tiny.pretrain import load_tiny
from marlow.tiny.shipped import ROOT, shipped_worlds
from marlow.types import BASE, GenRequest, SamplingParams

ADAPTERS = ("gen", "agg", "crit")
TEST_BLOCK = 16
"""Columns a block of the compiled step's flex attention in these tests (``lean.KV_BLOCK``, 128
in use): small, so that rows at other columns read other blocks. Not 8: on an AVX2 CPU, torch
2.13's compiled flex attention gives wrong outputs for blocks of 8 columns (16 and up agree
with scaled-dot-product attention)."""
QUESTIONS = ("12+30", "7*8", "100-45", "3+4+5")


def perturbed(model, std: float = 0.3, seed: int = 0):
    """Every LoRA B factor off zero, so that the adapters differ from the base and each other."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


@pytest.fixture
def mixed_ranks(make_model):
    """A random tiny Qwen3 with three adapters of ranks 4, 2 and 8 (scalings 2, 4 and 0.5),
    the third on the attention projections only; its RMSNorms fused, as a loaded base's are
    (``fuse_norms``), their weights off the ones they start at."""
    base = make_model(seed=0)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    fuse_norms(base)
    model = attach_adapters(base, ["gen"], LoraSpec(rank=4, alpha=8), seed=0)
    model.add_adapter("agg", LoraConfig(r=2, lora_alpha=8, target_modules="all-linear"))
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model.add_adapter("crit", LoraConfig(r=8, lora_alpha=4, target_modules=attn))
    return perturbed(model.eval())


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (n,), generator=gen)
    return [torch.randint(1, 50, (int(k),), generator=gen).tolist() for k in lengths]


def test_mixed_forward_gives_each_row_its_adapters_logits(mixed_ranks):
    """The lean forward over rows of three adapters and the base at once (different ranks and
    scalings, one adapter on some layers only; padded prompts; rows leaving the batch): each
    row's logits are its adapter's through PEFT's modules, within float32 round-off."""
    model = mixed_ranks
    names = (*ADAPTERS, BASE)
    own = [0, 1, 2, 3, 1, 0, 2]
    ids = torch.zeros(len(own), 9, dtype=torch.long)
    mask = torch.zeros(len(own), 9 + 4, dtype=torch.long)
    for r, p in enumerate(prompts(len(own))):
        p = p[:9]
        ids[r, 9 - len(p) :], mask[r, 9 - len(p) : 9] = torch.tensor(p), 1
    positions = (mask[:, :9].cumsum(-1) - 1).clamp(min=0)
    keep = torch.tensor([1, 2, 3, 5, 6])
    with torch.inference_mode():
        lean = LeanQwen3(model, len(own), 13, adapters=names, row_adapters=own)
        ours = [lean(ids, mask, positions, 0)]
        theirs = {}
        for i, name in enumerate(names):
            activate(model, name)
            forward = _Transformers(model)
            theirs[i] = [forward(ids, mask, positions, 0)]
            nxt, m = positions[:, -1:] + 1, mask.clone()
            for t in range(4):
                if t == 2:
                    forward.select(keep)
                    nxt, m = nxt[keep], m[keep]
                m[:, 9 + t] = 1
                theirs[i].append(forward(torch.full((len(nxt), 1), 5), m, nxt, 9 + t))
                nxt = nxt + 1
        nxt, m = positions[:, -1:] + 1, mask.clone()
        rows = torch.arange(len(own))
        for t in range(4):
            if t == 2:
                lean.select(keep)
                nxt, m, rows = nxt[keep], m[keep], rows[keep]
            m[:, 9 + t] = 1
            ours.append(lean(torch.full((len(rows), 1), 5), m, nxt, 9 + t))
            nxt = nxt + 1
    for step, logits in enumerate(ours):
        rows = torch.arange(len(own)) if step < 3 else keep
        for j, r in enumerate(rows.tolist()):
            expect = theirs[own[r]][step][j]
            torch.testing.assert_close(logits[j], expect, atol=2e-5, rtol=0, msg=f"{r}, {step}")
    gen, agg = ours[0][0], ours[0][1]  # not vacuous: the adapters change the logits
    assert not torch.allclose(theirs[0][0][1], theirs[1][0][1], atol=1e-3)
    assert not torch.allclose(gen, theirs[3][0][0], atol=1e-3) and agg.isfinite().all()


def requests(adapters, n: int = 24, seeded: bool = False) -> list[GenRequest]:
    return [
        GenRequest(p, adapters[i % len(adapters)], seed=1000 + i if seeded else None)
        for i, p in enumerate(prompts(n))
    ]


def same(a, b, atol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0
        )


def test_greedy_mixed_pass_samples_what_a_pass_per_adapter_samples(mixed_ranks, tokenizer):
    """Temperature 0, float32: one mixed pass gives the tokens of one pass per adapter through
    the model's own forward (the loop before adapters were batched together), rows stopping at
    different steps."""
    reqs = requests((*ADAPTERS, BASE), n=28)
    params = SamplingParams(0.0, 24, seed=0)
    stops = [7, 11, 23]
    ours = HFEngine(mixed_ranks, tokenizer, stop_ids=stops).generate(reqs, params)
    theirs = HFEngine(mixed_ranks, tokenizer, stop_ids=stops, lean=False).generate(reqs, params)
    same(ours, theirs)
    reasons = {c.finish_reason for c in ours}
    assert reasons == {"stop", "length"}
    assert len({tuple(c.token_ids) for c in ours}) > len(ours) // 2


def test_greedy_mixed_pass_on_the_tiny_world(tokenizer):
    """The same on the shipped tiny-m world, IP Voting's shape: three adapters of rank 8 whose
    rows share prompts (a group), float32."""
    (world,) = [w for w in shipped_worlds() if w.scale == "tiny-m" and w.task == "math"]
    base, tok = load_tiny(ROOT / world.folder)
    model = perturbed(
        attach_adapters(base, list(ADAPTERS), LoraSpec(rank=8, alpha=16), seed=0), std=0.05
    )
    questions = [render("tiny", "math", "generator", "answer", {"problem": q}) for q in QUESTIONS]
    reqs = [
        GenRequest(chat_prompt_ids(tok, q), a)
        for q in questions
        for a in ADAPTERS
        for _ in range(2)
    ]
    params = SamplingParams(0.0, 32, seed=0)
    ours = HFEngine(model, tok).generate(reqs, params)
    same(ours, HFEngine(model, tok, lean=False).generate(reqs, params))
    assert any(c.finish_reason == "stop" for c in ours)


def test_mixed_pass_draws_each_adapters_distribution(mixed_ranks, tokenizer):
    """Temperature 0.9: the first token of 3,000 rows of one prompt (1,500 under 'gen', 1,500
    under 'agg', in one pass) against each adapter's softmax, by a chi-square test; the same
    test tells the two adapters' distributions apart (it can fail)."""
    model = mixed_ranks
    prompt = prompts(1, seed=9)[0]
    n = 1500
    reqs = [GenRequest(prompt, a) for _ in range(n) for a in ("gen", "agg")]
    out = HFEngine(model, tokenizer, max_batch=4096, stop_ids=[0]).generate(
        reqs, SamplingParams(0.9, 1, seed=1)
    )
    probs = {}
    with torch.inference_mode():
        for a in ("gen", "agg"):
            activate(model, a)
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
            probs[a] = torch.softmax(logits / 0.9, -1)

    def chi2(tokens: list[int], p: torch.Tensor) -> tuple[float, int]:
        counts = torch.bincount(torch.tensor(tokens), minlength=p.numel()).double()
        big = p * len(tokens) >= 5  # cells expected at least 5 times; the rest pooled
        expect = torch.cat([p[big] * len(tokens), (p[~big].sum() * len(tokens))[None]])
        seen = torch.cat([counts[big], counts[~big].sum()[None]])
        return float(((seen - expect) ** 2 / expect).sum()), int(big.sum())

    for a in ("gen", "agg"):
        tokens = [c.token_ids[0] for c, r in zip(out, reqs, strict=True) if r.adapter == a]
        stat, cells = chi2(tokens, probs[a])
        other = chi2(tokens, probs["agg" if a == "gen" else "gen"])[0]
        # critical value of chi-square at p = 0.001 is below 2 * dof + 20 for these dof
        assert stat < 2 * cells + 20, (a, stat, cells)
        assert other > 2 * cells + 20, (a, other, cells)


def test_seeded_rows_do_not_depend_on_their_batch_mates_in_a_mixed_pass(mixed_ranks, tokenizer):
    """rollout.seeding=request in a mixed pass: each row samples what it samples alone."""
    reqs = requests(ADAPTERS, n=12, seeded=True)
    params = SamplingParams(1.0, 16, seed=3)
    engine = HFEngine(mixed_ranks, tokenizer)
    together = engine.generate(reqs, params)
    alone = [engine.generate([r], SamplingParams(1.0, 16, seed=99))[0] for r in reqs]
    same(together, alone)


def test_the_host_reading_stops_every_k_tokens_changes_no_sample(mixed_ranks, tokenizer):
    """Rows that stop between two reads are fed pads until the next: the samples, log-probs,
    lengths and finish reasons are those of a read after every token."""
    reqs = requests((*ADAPTERS, BASE), n=20, seeded=True)
    params = SamplingParams(1.0, 30, seed=0)
    stops = [7, 11, 23]
    every = HFEngine(mixed_ranks, tokenizer, stop_ids=stops, read_every=1).generate(reqs, params)
    fifth = HFEngine(mixed_ranks, tokenizer, stop_ids=stops, read_every=5).generate(reqs, params)
    same(every, fifth, atol=0)
    assert {c.finish_reason for c in every} == {"stop", "length"}
    with pytest.raises(ValueError, match="read_every"):
        HFEngine(mixed_ranks, tokenizer, read_every=0)


@pytest.mark.parametrize("mode", ["eager", "graphed", "blocks"])
def test_waiting_rows_take_the_places_of_rows_that_stop(mixed_ranks, tokenizer, monkeypatch, mode):
    """A call of more rows than ``max_batch``: rows that stop are replaced by waiting ones,
    prefilled into their places and sampling at their own columns, rows of one adapter in
    places another's held. Greedy and seeded, every row samples what it samples with the whole
    call in one batch (log-probs within round-off); the working batch never grows past
    ``max_batch`` (its bucket, compiled); the call takes fewer decode steps than batches of
    ``max_batch`` one after the other. Compiled: the CUDA path's replays on the CPU, attending
    over spans of 8 columns, or (``attention_by_blocks``) by blocks of 16 columns (each row
    reads the blocks up to its own column's)."""
    from marlow.rollout import lean

    compile = mode != "eager"
    monkeypatch.setattr(lean, "_BY_BLOCKS", mode == "blocks")
    if compile:
        monkeypatch.setattr(lean, "_GAVE_UP", set())
        monkeypatch.setattr(lean, "_graphs_on", lambda device: True)
        monkeypatch.setattr(lean, "SPAN_STEP", 8)
        monkeypatch.setattr(lean, "KV_BLOCK", TEST_BLOCK)  # rows at other columns read other blocks
    seen = {"rows": set(), "steps": 0, "admitted": []}
    call, admit = LeanQwen3.__call__, LeanQwen3.admit

    def counted(self, ids, *a, **kw):
        seen["rows"].add(ids.shape[0])
        seen["steps"] += 1
        return call(self, ids, *a, **kw)

    def admitted(self, slots, *a, **kw):
        seen["admitted"].append(len(slots))
        return admit(self, slots, *a, **kw)

    monkeypatch.setattr(LeanQwen3, "__call__", counted)
    monkeypatch.setattr(LeanQwen3, "admit", admitted)
    reqs = requests((*ADAPTERS, BASE), n=30, seeded=True)
    stops = [7, 11, 23]
    kw = {"stop_ids": stops, "compile": compile, "read_every": 3 if compile else None}
    assert HFEngine(mixed_ranks, tokenizer, compile=compile).refill is None  # auto: compiled
    for params in (SamplingParams(0.0, 40, seed=0), SamplingParams(1.0, 40, seed=0)):
        whole = HFEngine(mixed_ranks, tokenizer, max_batch=64, **kw).generate(reqs, params)
        seen.update(rows=set(), steps=0, admitted=[])
        refill = None if compile else True  # auto refills where the step is compiled
        engine = HFEngine(mixed_ranks, tokenizer, max_batch=6, refill=refill, **kw)
        refilled = engine.generate(reqs, params)
        same(refilled, whole)
        assert {c.finish_reason for c in refilled} == {"stop", "length"}
        # and what the model's own forward gives each whole sequence, unpadded, alone
        scored = HFEngine(mixed_ranks, tokenizer).score(
            reqs, [c.token_ids for c in refilled], params.temperature
        )
        for c, logp in zip(refilled, scored, strict=True):
            torch.testing.assert_close(
                torch.tensor(c.logprobs), torch.tensor(logp), atol=1e-4, rtol=0
            )
        assert max(seen["rows"]) == (8 if compile else 6)
        assert seen["admitted"][0] == 6 and len(seen["admitted"]) >= 5
        assert sum(seen["admitted"]) == len(reqs)
        refill_steps = seen["steps"]
        seen["steps"] = 0
        chunked = HFEngine(mixed_ranks, tokenizer, max_batch=6, refill=False, **kw)
        same(chunked.generate(reqs, params), whole)
        assert refill_steps < seen["steps"]
        # the model's own forward takes its rows once: batches, whatever refill says
        own = HFEngine(mixed_ranks, tokenizer, max_batch=6, lean=False, refill=True, **kw)
        same(own.generate(reqs, params), whole)
    assert not lean._GAVE_UP


@pytest.mark.parametrize("names", [(*ADAPTERS, BASE), ("agg",)], ids=["mixed", "one"])
def test_the_compiled_step_groups_lora_products_of_layers_that_read_one_input(
    mixed_ranks, make_model, monkeypatch, names
):
    """The compiled step computes a layer's q, k and v together (one GEMM of their packed base
    weights and A factors, one batched GEMM of their B factors), its gate and up, its o, its
    down: each output equals its layer's own within float32 round-off, for rows of mixed
    adapters (per-row masks and scalings) and for one adapter. Where LoRA layouts differ (an
    adapter on q and v only) the base weights alone are packed, each layer keeping its own LoRA;
    the eager step never groups."""
    from marlow.rollout import lean

    monkeypatch.setattr(lean, "_GAVE_UP", set())
    own = [i % len(names) for i in range(7)]
    forward = LeanQwen3(mixed_ranks, 7, 16, adapters=names, row_adapters=own, compiled=True)
    assert not any(
        "qkv" in layer for layer in LeanQwen3(mixed_ranks, 7, 16, adapters=names).w.layers
    )
    for layer in forward.w.layers:
        for key, members in lean.GROUPS.items():
            group = layer[key]
            assert group.fused and group.sizes == tuple(layer[m].weight.shape[0] for m in members)
            linears = [layer[m] for m in members]
            width = linears[0].weight.shape[1]
            x = torch.randn(7, 3, width, generator=torch.Generator().manual_seed(width))
            ours = lean._linears(x, linears, group, forward.lora)
            theirs = [lean._linear(x, m, forward.lora) for m in linears]
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
            lora = [lean._linear(x, m, forward.lora) - lean.F.linear(x, m.weight) for m in linears]
            assert min(float(t.detach().abs().max()) for t in lora) > 1e-2  # LoRA moves each
    partial = attach_adapters(make_model(seed=0), ["gen"], LoraSpec(rank=4), seed=0)
    partial.add_adapter("qv", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    activate(partial, "qv")
    with torch.no_grad():  # B is zero at first: make q's and v's LoRA move their outputs
        for name, p in partial.named_parameters():
            if "lora_B.qv" in name:
                p.normal_(generator=torch.Generator().manual_seed(1))
    qv = LeanQwen3(partial, 2, 8, compiled=True)
    layer = qv.w.layers[0]
    # k, o, gate, up and down have no LoRA: q and v their own, every base weight packed
    assert all(layer[key].b is None and not layer[key].fused for key in lean.GROUPS)
    linears = [layer[m] for m in lean.GROUPS["qkv"]]
    x = torch.randn(2, 3, linears[0].weight.shape[1], generator=torch.Generator().manual_seed(0))
    ours = lean._linears(x, linears, layer["qkv"], qv.lora)
    for a, b, m in zip(ours, [lean._linear(x, m, qv.lora) for m in linears], linears, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
        assert (m.a is None) == torch.equal(b, lean.F.linear(x, m.weight))  # q and v: LoRA


def test_the_compiled_step_packs_each_layers_base_weights_and_its_lora_a_factors(make_model):
    """A compiled call moves the base weights of a layer's linears that read one input (q, k
    and v; gate and up; o; down) into one buffer a group, in order, with room after them for the
    call's LoRA A factors, so that one GEMM computes both: the same values and parameter
    objects, no copy at the next call, packed again after the model moves to another dtype.
    A call whose factors another call overwrote writes its own back before it computes, and
    training takes gradients through the weights (the buffer is not an inference tensor, and
    writing the factors does not mark the weights modified)."""
    from marlow.rollout import lean

    model = attach_adapters(make_model(seed=0), ["gen", "crit"], LoraSpec(rank=4), seed=0)
    with torch.no_grad():  # B is zero at first: make each adapter move the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    activate(model, "gen")
    body = model.base_model.model.model

    def groups(layer):  # each group's base weights, in lean.GROUPS' order
        attn, mlp = layer.self_attn, layer.mlp
        return [
            [attn.q_proj, attn.k_proj, attn.v_proj],
            [attn.o_proj],
            [mlp.gate_proj, mlp.up_proj],
            [mlp.down_proj],
        ]

    params = [[m.base_layer.weight for m in g] for layer in body.layers for g in groups(layer)]
    before = [[t.detach().clone() for t in group] for group in params]
    ids = torch.tensor([[3, 5, 7, 9], [4, 4, 6, 8]])
    mask, positions = torch.ones_like(ids), torch.arange(4).expand(2, -1)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        eager = [
            LeanQwen3(model, 2, 8, adapters=(name,))(ids, mask, positions, 0)
            for name in ("gen", "crit")
        ]
    with torch.inference_mode():
        first = LeanQwen3(model, 2, 8, adapters=("gen",), compiled=True)
    after = [[m.base_layer.weight for m in g] for layer in body.layers for g in groups(layer)]
    assert all(
        a is b for x, y in zip(params, after, strict=True) for a, b in zip(x, y, strict=True)
    )
    packed = [layer[key] for layer in first.w.layers for key in lean.GROUPS]
    pointers = []
    for weights, old, group in zip(params, before, packed, strict=True):
        rows = sum(group.sizes)
        assert group.fused and torch.equal(group.weight[:rows], torch.cat(old))
        assert torch.equal(group.weight[rows:], group.a)  # the call's A factors after them
        start = 0
        for w in weights:  # each weight is its block of the one buffer
            assert w.data_ptr() == group.weight.data_ptr() + start * w.stride(0) * w.element_size()
            start += w.shape[0]
        pointers.append(group.weight.data_ptr())
    # another call of another adapter of the same ranks: no copy, its own factors written
    second = LeanQwen3(model, 2, 8, adapters=("crit",), compiled=True)
    again = [layer[key].weight.data_ptr() for layer in second.w.layers for key in lean.GROUPS]
    assert again == pointers
    with torch.inference_mode():
        for lean_call, want in ((first, eager[0]), (second, eager[1]), (first, eager[0])):
            got = lean_call(ids, mask, positions, 0)  # the prompt, through the groups
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=0, rtol=0)
    # training: a forward, a compiled call writing its factors, then the backward
    loss = model(input_ids=ids).logits.square().mean()
    LeanQwen3(model, 2, 8, adapters=("crit",), compiled=True)
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_A.gen" in n]
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads)
    # a model moved to another dtype is packed again at its next call
    model.double()
    moved = LeanQwen3(model, 2, 8, compiled=True).w.layers[0]["qkv"].weight
    assert moved.dtype == torch.float64
    assert body.layers[0].self_attn.q_proj.base_layer.weight.data_ptr() == moved.data_ptr()


def test_admitted_rows_change_the_adapter_masks_in_place(mixed_ranks):
    """A CUDA graph replays the step over the tensors it was captured with: rows admitted into
    places of another adapter update the per-row LoRA masks and scalings in place."""
    names = (*ADAPTERS, BASE)
    with torch.inference_mode():
        lean = LeanQwen3(mixed_ranks, 4, 16, adapters=names, row_adapters=[0, 1, 2, 3])
        before = [(m.data_ptr(), m.clone(), s.data_ptr()) for m, s in lean.lora]
        ids = torch.tensor([[5, 6, 7]])
        mask, positions = torch.ones_like(ids), torch.arange(3)[None]
        lean.admit(torch.tensor([0, 2]), ids, mask, positions, [3], torch.tensor([0, 0]))
    assert lean.row_adapters.tolist() == [3, 1, 3, 3]
    for (ptr, old, scaling_ptr), (m, s) in zip(before, lean.lora, strict=True):
        assert m.data_ptr() == ptr and s.data_ptr() == scaling_ptr
        assert torch.equal(m[[1, 3]], old[[1, 3]]) and torch.equal(m[0], old[3])
        assert not torch.equal(m[0], old[0]) and torch.equal(s[0], s[3])


def graphed_pair(model, length: int, monkeypatch) -> LeanQwen3:
    """A compiled forward of ``length`` columns and two rows, their 3-token prompts admitted,
    whose decode steps run the CUDA path's graphed step on the CPU (spans of 8 columns)."""
    from marlow.rollout import lean

    monkeypatch.setattr(lean, "_GAVE_UP", set())
    monkeypatch.setattr(lean, "_graphs_on", lambda device: True)
    monkeypatch.setattr(lean, "SPAN_STEP", 8)
    forward = LeanQwen3(model, 2, length, compiled=True)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    forward.admit(torch.arange(2), ids, torch.ones_like(ids), torch.arange(3).expand(2, 3),
                  [0, 0], torch.arange(2))  # fmt: skip
    return forward


def test_a_graphed_step_shrinks_its_span_only_when_it_would_halve(mixed_ranks, monkeypatch):
    """Attending over the span (as graphed steps do but inside ``attention_by_blocks``), rows admitted at small columns can lower the largest column a step writes at: the
    graph keeps its span (the extra columns masked) until the span needed is half of it or
    less."""
    spans = []
    with torch.inference_mode():
        forward = graphed_pair(mixed_ranks, 64, monkeypatch)
        mask = torch.ones(2, 64, dtype=torch.long)
        for at in (17, 12, 9, 5, 20):  # spans needed: 24, 16, 16, 8, 24
            columns = torch.tensor([at, 3])
            out = forward(torch.tensor([[1], [2]]), mask, torch.tensor([[at], [3]]), at, columns)
            assert out.isfinite().all()
            spans.append(forward.graph.span)
    assert spans == [24, 24, 24, 8, 24]


def test_a_graphed_forward_and_its_cache_go_when_the_call_drops_them(mixed_ranks, monkeypatch):
    """A sampling call's forward and its graphed step refer to each other; were that a strong
    cycle, the call's KV cache would outlive the call until Python's cyclic collector ran (on
    a GPU, into the learn phase). With the collector off, dropping the forward frees both."""
    import gc
    import weakref

    with torch.inference_mode():
        forward = graphed_pair(mixed_ranks, 16, monkeypatch)
        mask = torch.ones(2, 16, dtype=torch.long)
        out = forward(torch.tensor([[1], [2]]), mask, torch.tensor([[3], [3]]), 3,
                      torch.tensor([3, 3]))  # fmt: skip
        assert out.isfinite().all() and forward.graph is not None
    gone = [weakref.ref(x) for x in (forward, forward.graph, forward.cache[0])]
    was = gc.isenabled()
    gc.disable()
    try:
        del forward
        assert [r() is None for r in gone] == [True, True, True]
    finally:
        if was:
            gc.enable()


def test_batch_sizes_of_the_compiled_step():
    sizes = sorted({_bucket(n) for n in range(1, 300)})
    assert sizes == [2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384]
    assert all(n <= _bucket(n) <= max(n * 3 // 2, n + 1) or n <= 16 for n in range(1, 300))
    assert all(_bucket(n) < 2 * n for n in range(2, 300)) and _bucket(1) == 2


@pytest.mark.parametrize("graphs", [None, "blocks", "span"], ids=["compiled", "blocks", "spans"])
def test_the_compiled_step_samples_what_the_eager_step_samples(
    mixed_ranks, tokenizer, monkeypatch, graphs
):
    """Decode steps at fixed shapes, their layers compiled: 21 rows padded to 24 with fillers,
    compactions into smaller batch sizes, stop flags read every 4 tokens; the CPU's (the cache's
    full length attended with a mask) or the CUDA path's replays run on the CPU (a graph's step
    over its static buffers): attending over spans of 8 columns, a call moving through several,
    each a new capture; or (``attention_by_blocks``) each row's flex attention reading its
    blocks of 16 columns up to its own, one graph a batch size over the call's whole cache. The
    eager loop's tokens, greedy and seeded, log-probs within round-off, nothing fallen back to
    the eager step; a second call of other lengths compiles nothing that fails."""
    from marlow.rollout import lean

    monkeypatch.setattr(lean, "_GAVE_UP", set())
    monkeypatch.setattr(
        lean, "KV_BLOCK", TEST_BLOCK
    )  # a row's attention reads its blocks, not the span
    captured = []
    monkeypatch.setattr(lean, "_BY_BLOCKS", graphs == "blocks")
    if graphs:
        monkeypatch.setattr(lean, "_graphs_on", lambda device: True)
        monkeypatch.setattr(lean, "SPAN_STEP", 8)
        graph_init = lean._Graph.__init__

        def counted(self, owner, rows, span, device):
            captured.append((id(owner), rows, span))
            graph_init(self, owner, rows, span, device)

        monkeypatch.setattr(lean._Graph, "__init__", counted)
    reqs = requests((*ADAPTERS, BASE), n=21, seeded=True)
    stops = [7, 11, 23]
    eager = HFEngine(mixed_ranks, tokenizer, stop_ids=stops)
    compiled = HFEngine(mixed_ranks, tokenizer, stop_ids=stops, compile=True, read_every=4)
    for params in (SamplingParams(0.0, 40, seed=0), SamplingParams(1.0, 40, seed=0)):
        out = compiled.generate(reqs, params)
        same(out, eager.generate(reqs, params))
        assert {c.finish_reason for c in out} == {"stop", "length"}
    shorter = [GenRequest(r.prompt_ids[:3], r.adapter, r.seed) for r in reqs[:9]]
    params = SamplingParams(0.0, 10, seed=0)
    import gc

    gc.collect()
    gc.disable()  # no forward of a finished call is left for the cyclic collector to free
    try:
        same(compiled.generate(shorter, params), eager.generate(shorter, params))
        # type(), not isinstance: isinstance reads every object's __class__, and torch's
        # deprecated module aliases warn when read
        assert not [x for x in gc.get_objects() if type(x) in (LeanQwen3, lean._Graph)]
    finally:
        gc.enable()
    assert not lean._GAVE_UP
    if graphs:
        spans = {span for _, _, span in captured}
        if graphs == "span":
            assert len(spans) >= 3 and all(span % 8 == 0 for span in spans)
        else:  # each call's whole cache (its columns rounded up to 64): one graph a batch size
            assert spans == {64} and len(captured) == len(set(captured))
        batches = {rows for _, rows, _ in captured}
        assert 24 in batches and len(batches) > 1  # and smaller batches after compactions


@pytest.mark.parametrize("blocks", [False, True], ids=["span", "blocks"])
def test_the_compiled_parts_compile_once_per_adapter_mix(
    mixed_ranks, tokenizer, monkeypatch, blocks
):
    """The CUDA path's replays on the CPU, across batches of 24, 16, 48 and 1 row and spans of 8
    columns up to 40: the projections and the rest of a layer are compiled once for the mixed
    adapters and once for one adapter, never again for a new batch or span (with
    torch.compile's limit of compilations at 2, a third one raises instead of running eager);
    the attention over the span is not compiled, and the flex attention (``attention_by_blocks``,
    blocks of 16 columns) once per batch size, its rows static (what its decoding kernel
    takes) and never again for a new span or count of blocks."""
    from torch._dynamo.utils import counters

    from marlow.rollout import lean

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(lean, "_GAVE_UP", set())
    monkeypatch.setattr(lean, "_COMPILED", {})
    monkeypatch.setattr(lean, "_BY_BLOCKS", blocks)
    monkeypatch.setattr(lean, "_graphs_on", lambda device: True)
    monkeypatch.setattr(lean, "SPAN_STEP", 8)
    monkeypatch.setattr(lean, "KV_BLOCK", TEST_BLOCK)
    rows, call = set(), LeanQwen3.__call__

    def counted(self, ids, *a, **kw):
        if ids.shape[1] == 1:  # a decode step: the compiled parts
            rows.add(ids.shape[0])
        return call(self, ids, *a, **kw)

    monkeypatch.setattr(LeanQwen3, "__call__", counted)
    never = [mixed_ranks.config.vocab_size]  # no row stops: the batches stay whole
    engine = HFEngine(mixed_ranks, tokenizer, stop_ids=never, compile=True, read_every=4)
    params = SamplingParams(1.0, 30, seed=0)
    fail = (
        "fail_on_recompile_limit_hit" if _LIMIT == "recompile_limit" else "fail_on_cache_limit_hit"
    )
    with torch._dynamo.config.patch(**{_LIMIT: 2, fail: True}):  # names of torch < 2.7 too
        for n, adapters in ((21, (*ADAPTERS, BASE)), (9, ADAPTERS), (40, ADAPTERS), (1, ("gen",))):
            engine.generate(requests(adapters, n=n), params)
    assert not lean._GAVE_UP
    assert rows == {24, 16, 48, 2}
    assert counters["stats"]["unique_graphs"] == 4 + (len(rows) if blocks else 0)


@pytest.fixture
def broken_compiler(monkeypatch):
    """The CPU's compiled layer replaced by one that raises, counting its calls; nothing given up
    yet."""
    from marlow.rollout import lean

    def broken(*args):
        broken.calls += 1
        raise RuntimeError("inductor: no C++ compiler")

    broken.calls = 0
    monkeypatch.setattr(lean, "_GAVE_UP", set())
    for part in ("_projections", "_rest"):
        monkeypatch.setitem(lean._COMPILED, ("cpu", part), broken)
    return broken


@pytest.mark.parametrize("graphs", [False, True], ids=["compiled", "graphed"])
def test_a_compiled_step_that_fails_leaves_the_call_to_the_eager_step(
    mixed_ranks, tokenizer, monkeypatch, broken_compiler, graphs
):
    """A compiler or CUDA-graph failure is not a run's end: one warning, the call finishes with
    the eager step, or inside graphs with eager layers (the fixed-shape step kept), sampling the
    same tokens, and later calls do not try again; memory errors pass."""
    from marlow.rollout import lean

    if graphs:  # the CUDA path's replays, run on the CPU
        monkeypatch.setattr(lean, "_graphs_on", lambda device: True)
        monkeypatch.setattr(lean, "SPAN_STEP", 8)
    reqs = requests((*ADAPTERS, BASE), n=8)
    params = SamplingParams(0.0, 12, seed=0)
    engine = HFEngine(mixed_ranks, tokenizer, compile=True)
    instead = "eager layers" if graphs else "the eager step"
    with pytest.warns(RuntimeWarning, match=f"compiled layers failed on cpu .*no C.*{instead}"):
        out = engine.generate(reqs, params)
    same(out, HFEngine(mixed_ranks, tokenizer).generate(reqs, params))
    assert broken_compiler.calls == 1 and sorted(lean._GAVE_UP) == [("cpu", "compile")]
    same(engine.generate(reqs, params), out)
    assert broken_compiler.calls == 1

    def short_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    lean._GAVE_UP.clear()
    for part in ("_projections", "_rest"):
        monkeypatch.setitem(lean._COMPILED, ("cpu", part), short_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        engine.generate(reqs, params)


def test_a_compiled_step_reads_each_row_up_to_its_own_columns_block(monkeypatch):
    """The compiled step's attention (flex attention, compiled) reads each row's keys and values
    in blocks of ``KV_BLOCK`` columns up to its own column's block and no further: rows at
    scattered columns of one span, a padded prompt among them, the cache past each row's last
    block filled with NaN (a read of it would be NaN), equal to scaled-dot-product attention
    over each row's columns within float32 round-off, query heads grouped on their key heads."""
    from marlow.rollout import lean

    block = TEST_BLOCK  # as the graphed replays' tests have it (test_device.py: 128 on CUDA)
    monkeypatch.setattr(lean, "KV_BLOCK", block)
    rows, heads, kv_heads, hd, span = 5, 4, 2, 16, 3 * block - 5
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(rows, heads, 1, hd, generator=gen)
    keys, values = (torch.randn(rows, kv_heads, span, hd, generator=gen) for _ in range(2))
    columns = torch.tensor([[0], [block - 1], [block], [span - 1], [2 * block + 1]])
    valid = torch.arange(span)[None] <= columns
    valid[2, 1:4] = False  # a left-padded prompt's pads
    reads = {}
    for i, column in enumerate(columns[:, 0].tolist()):
        reads[i] = (column // block + 1) * block
        keys[i, :, reads[i] :] = values[i, :, reads[i] :] = float("nan")
    assert sorted(set(reads.values())) == [block, 2 * block, 3 * block]
    attend = torch.compile(lean._attend_blocks, fullgraph=True)
    out = attend(query, keys, values, lean._row_blocks(valid, columns, span))
    additive = torch.zeros(rows, span).masked_fill_(~valid, float("-inf"))
    expected = lean._attend(query, keys.nan_to_num(), values.nan_to_num(), additive)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_a_failing_flex_attention_leaves_the_compiled_layers(mixed_ranks, tokenizer, monkeypatch):
    """Where only the compiled flex attention fails (the CUDA path's replays, on the CPU): one
    warning naming it, the step attends over its whole span with scaled-dot-product attention,
    its compiled projections and rest kept (run from then on), the eager step's tokens, and
    later calls do not try it again."""
    from marlow.rollout import lean

    monkeypatch.setattr(lean, "_GAVE_UP", set())
    monkeypatch.setattr(lean, "_graphs_on", lambda device: True)
    monkeypatch.setattr(lean, "_BY_BLOCKS", True)
    monkeypatch.setattr(lean, "SPAN_STEP", 8)
    calls = {"attention": 0, "projections": 0}

    def broken(*args):
        calls["attention"] += 1
        raise RuntimeError("triton: no kernel for this head size")

    def projections(*args):
        calls["projections"] += 1
        return lean._projections(*args)

    monkeypatch.setitem(lean._COMPILED, ("cpu", "_attend_blocks"), broken)
    monkeypatch.setitem(lean._COMPILED, ("cpu", "_projections"), projections)
    monkeypatch.setitem(lean._COMPILED, ("cpu", "_rest"), lean._rest)
    reqs = requests((*ADAPTERS, BASE), n=8)
    params = SamplingParams(0.0, 12, seed=0)
    engine = HFEngine(mixed_ranks, tokenizer, compile=True)
    with pytest.warns(RuntimeWarning, match="flex attention failed on cpu .*no kernel.*whole span"):
        out = engine.generate(reqs, params)
    same(out, HFEngine(mixed_ranks, tokenizer).generate(reqs, params))
    assert calls["attention"] == 1 and sorted(lean._GAVE_UP) == [("cpu", "attention")]
    assert lean.given_up(torch.device("cpu")) == ["attention"]
    layers = mixed_ranks.config.num_hidden_layers
    assert calls["projections"] >= layers * 11  # the 11 steps after the prompt's, and the first
    same(engine.generate(reqs, params), out)
    assert calls["attention"] == 1


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_within_attention_by_blocks_the_graphed_step_reads_each_rows_blocks(
    mixed_ranks, tokenizer, monkeypatch
):
    """``attention_by_blocks`` (the GPU check's side-by-side timing): inside it, new graphed
    steps (the CUDA path's replays, on the CPU) attend by flex attention over each row's blocks,
    sampling the same tokens; outside it, by SDPA over the span, flex attention never called."""
    from marlow.rollout import lean

    monkeypatch.setattr(lean, "_GAVE_UP", set())
    monkeypatch.setattr(lean, "_graphs_on", lambda device: True)
    monkeypatch.setattr(lean, "SPAN_STEP", 8)
    monkeypatch.setattr(lean, "KV_BLOCK", TEST_BLOCK)
    calls = []

    def flex(*args):
        calls.append(args[0].shape[0])
        return lean._attend_blocks(*args)

    monkeypatch.setitem(lean._COMPILED, ("cpu", "_attend_blocks"), flex)
    reqs = requests((*ADAPTERS, BASE), n=6)
    params = SamplingParams(0.0, 10, seed=0)
    engine = HFEngine(mixed_ranks, tokenizer, compile=True)
    over_span = engine.generate(reqs, params)
    assert not calls
    with lean.attention_by_blocks():
        same(engine.generate(reqs, params), over_span)
    assert not lean._BY_BLOCKS
    assert len(calls) >= 9 * mixed_ranks.config.num_hidden_layers  # each step after the first
