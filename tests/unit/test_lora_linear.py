"""marlow's fused LoRA linear (``marlow.policy.adapters.LoraLinear``): PEFT's values and
gradients with fewer passes over the tokens, taken by every plain LoRA linear while the trainer
scores a bfloat16 base (``lora_in_base_dtype``), and PEFT's own forward everywhere else."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from marlow.models import checkpoint_layers, completion_logprobs
from marlow.policy import adapters
from marlow.policy.adapters import (
    LoraLinear,
    LoraSpec,
    attach_adapters,
    held_factors,
    lora_in_base_dtype,
    low_factors,
    use_adapter,
)
from tests.conftest import build_tiny_qwen3


def reference(x, weight, bias, a, b, scaling):
    """PEFT's arithmetic: the base, then ``B(A(x)) * scaling`` added."""
    dtype = x.dtype
    return nn.functional.linear(x, weight, bias) + (x @ a.to(dtype).t() @ b.to(dtype).t()) * scaling


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scaling", [0.5, 0.3])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_lora_linear_has_peft_s_values_and_gradients(dtype, scaling, bias):
    """Forward and every gradient (input, A, B) against PEFT's formula: bit for bit in float32
    where the scaling is a power of two (the paper's 32 / 64), within round-off otherwise; float32
    factors over a float64 base get their gradients in float32."""
    torch.manual_seed(0)
    base = nn.Linear(24, 40, bias=bias).to(dtype).requires_grad_(False)
    a = torch.randn(8, 24, requires_grad=True)
    b = torch.randn(40, 8, requires_grad=True)
    x = torch.randn(3, 5, 24, dtype=dtype, requires_grad=True)
    grad = torch.randn(3, 5, 40, dtype=dtype)
    want = reference(x, base.weight, base.bias, a, b, scaling)
    want.backward(grad)
    wanted = [t.grad for t in (x, a, b)]
    x.grad = a.grad = b.grad = None
    got = LoraLinear.apply(
        x, base.weight, base.bias, a, b, scaling, *low_factors(a, b, scaling, dtype)
    )
    got.backward(grad)
    assert got.shape == want.shape and got.dtype == dtype
    assert a.grad.dtype == b.grad.dtype == torch.float32
    exact = dtype == torch.float32 and scaling == 0.5
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    for ours, theirs in zip([got, x.grad, a.grad, b.grad], [want, *wanted], strict=True):
        if exact:
            assert torch.equal(ours, theirs)
        else:
            torch.testing.assert_close(ours, theirs, atol=tol * 10, rtol=tol)


def bf16_adapted(rank=4, alpha=8, dropout=0.0):
    """The tiny random Qwen3 in bfloat16 with adapter ``policy``, its B moved off zero."""
    model = attach_adapters(
        build_tiny_qwen3().to(torch.bfloat16), ["policy"], LoraSpec(rank, alpha, dropout), seed=0
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


def score(model, keep_grads=False):
    """Training-mode log-probs of a padded batch of completions, and each LoRA factor's gradient
    of their sum (``keep_grads``: added to the gradients already there, as a mini-batch's next
    micro-batch's)."""
    torch.manual_seed(1)
    ids = torch.randint(4, 64, (3, 12))
    attention = torch.ones_like(ids)
    attention[0, -3:] = 0
    prompt = torch.tensor([4, 5, 3])
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[0, -3:] = False
    targets = ids[:, 4:12]
    model.train()
    if not keep_grads:
        model.zero_grad()
    with use_adapter(model, "policy"):
        logp, _ = completion_logprobs(model, ids, attention, prompt, targets, mask, 1.0)
        logp.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


def peft_forward_only(monkeypatch):
    """Make every LoRA linear compute through PEFT's own forward, as before the fused one."""
    monkeypatch.setattr(
        adapters._ThroughLoraLinear,
        "forward",
        lambda self, x, *a, **k: adapters.LoraLinearLayer.forward(self, x, *a, **k),
    )


def test_scoring_a_bfloat16_base_computes_each_lora_linear_fused(monkeypatch):
    """Every LoRA linear of the scoring forward goes through LoraLinear, once each, and the layers
    compute through PEFT's forward again afterwards. Against the float32 model's log-probs and
    gradients, the fused bfloat16 ones are as close as PEFT's bfloat16 ones (each rounds
    differently: the fused sum rounds once), far closer than the adapter's own effect."""
    model = bf16_adapted()
    truth, true_grads = score(copy.deepcopy(model).float())
    layers = [m for m in model.modules() if isinstance(m, adapters.LoraLinearLayer)]
    calls = []
    apply = LoraLinear.apply
    monkeypatch.setattr(LoraLinear, "apply", lambda *args: calls.append(1) or apply(*args))
    ours, our_grads = score(model)
    assert len(calls) == len(layers) == 14  # 7 linears, 2 layers
    assert not any("forward" in m.__dict__ for m in layers)
    assert all(type(m) is adapters.LoraLinearLayer for m in layers)  # their own class again
    peft_forward_only(monkeypatch)
    calls.clear()
    theirs, their_grads = score(model)
    assert not calls
    ours_off, theirs_off = (ours - truth).abs(), (theirs - truth).abs()
    assert ours_off.max() < 0.1 and ours_off.mean() < 1.25 * theirs_off.mean()
    assert set(our_grads) == set(their_grads) == set(true_grads) and our_grads
    for name, grad in our_grads.items():
        true = true_grads[name]
        ours_rel = ((grad.float() - true).norm() / true.norm()).item()
        theirs_rel = ((their_grads[name].float() - true).norm() / true.norm()).item()
        assert ours_rel < 0.05 and ours_rel < 1.5 * theirs_rel + 0.005, name
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    base, _ = score(model)
    assert (ours - base).abs().max() > 0.5  # the adapter's effect: the comparison is not vacuous


def test_a_checkpointed_recompute_computes_through_the_fused_forward():
    """The backward's recompute of a checkpointed layer runs after lora_in_base_dtype has closed,
    as the forward did (recompute_as_forward): the same gradients bit for bit as the layers not
    checkpointed (PEFT's forward there would be another computation)."""
    model = bf16_adapted()
    plain_logp, plain = score(model)
    checkpoint_layers(model, on=True)
    logp, grads = score(model)
    assert torch.equal(logp, plain_logp)
    assert set(grads) == set(plain) and grads
    for name, grad in grads.items():
        assert torch.equal(grad, plain[name]), name


def test_other_lora_layers_compute_through_peft(monkeypatch):
    """PEFT's forward where the fused one would not compute the same: LoRA dropout drawn in
    training (not in eval), the adapters disabled, a float32 base (nothing changes there)."""
    calls = []
    apply = LoraLinear.apply
    monkeypatch.setattr(LoraLinear, "apply", lambda *args: calls.append(1) or apply(*args))
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    dropped = bf16_adapted(dropout=0.5)
    layer = dropped.base_model.model.model.layers[0].self_attn.q_proj
    with use_adapter(dropped, "policy"), lora_in_base_dtype(dropped):
        dropped.train()
        layer(x)
        assert not calls
        dropped.eval()
        layer(x)
        assert len(calls) == 1
        with dropped.disable_adapter():
            assert torch.equal(layer(x), layer.get_base_layer()(x))
    assert len(calls) == 1
    float32 = attach_adapters(build_tiny_qwen3(), ["policy"], LoraSpec(4, 8), seed=0)
    with use_adapter(float32, "policy"), lora_in_base_dtype(float32):
        float32.model.model.layers[0].self_attn.q_proj(torch.randn(2, 5, 64))
    assert len(calls) == 1


def test_the_factors_kept_on_a_layer_follow_every_switch_of_its_adapter():
    """A LoRA linear keeps the factors it computes with (``active_factors``) until its adapter
    changes: through ``activate``, through PEFT's own ``set_adapter`` and ``disable_adapter``,
    and a merge through PEFT (then PEFT's forward). Each time the layer's output is the active
    adapter's, as PEFT's forward computes it."""
    model = attach_adapters(
        build_tiny_qwen3().to(torch.bfloat16), ["gen", "agg"], LoraSpec(4, 8), seed=0
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, 64).to(torch.bfloat16)

    def peft(name):  # PEFT's own arithmetic of adapter ``name`` (float32 LoRA, cast back)
        with torch.no_grad():
            low = layer.lora_B[name](layer.lora_A[name](x.float())) * layer.scaling[name]
            return (layer.get_base_layer()(x).float() + low).to(x.dtype)

    def ours():
        with torch.no_grad(), lora_in_base_dtype(model):
            return layer(x)

    assert not torch.allclose(peft("gen"), peft("agg"), atol=0.1)
    seen = []
    for switch in (
        lambda: adapters.activate(model, "gen"),
        lambda: adapters.activate(model, "agg"),
        lambda: model.base_model.set_adapter("gen"),
        lambda: model.base_model.set_adapter("agg"),
        lambda: adapters.activate(model, "gen"),
    ):
        switch()
        name = adapters.active_adapter(model)
        out = ours()
        assert adapters.active_factors(layer)[0] is layer.lora_A[name].weight
        torch.testing.assert_close(out, peft(name), atol=0.05, rtol=0.02)
        seen.append(name)
    assert seen == ["gen", "agg", "gen", "agg", "gen"]
    with model.disable_adapter():
        assert adapters.active_factors(layer) is None
        assert torch.equal(ours(), layer.get_base_layer()(x))
    assert adapters.active_factors(layer)[0] is layer.lora_A["gen"].weight
    layer.merge(adapter_names=["gen"])
    assert adapters.active_factors(layer) is None  # merged: PEFT's forward
    layer.unmerge()
    assert adapters.active_factors(layer)[0] is layer.lora_A["gen"].weight
    layer.scaling["gen"] = 0.5  # PEFT's set_scale
    assert adapters.active_factors(layer)[2] == 0.5
    torch.testing.assert_close(ours(), peft("gen"), atol=0.05, rtol=0.02)
    layer.lora_B["gen"] = nn.Linear(4, layer.out_features, bias=False)  # a new factor
    assert adapters.active_factors(layer)[1] is layer.lora_B["gen"].weight
    torch.testing.assert_close(ours(), peft("gen"), atol=0.05, rtol=0.02)


def test_held_factors_are_cast_once_a_block_and_anew_when_changed():
    """Inside held_factors each factor pair's low-precision copies are made once and shared
    (a checkpointed pass's forward and recompute, the micro-batches of a mini-batch), with the
    same values as each forward's own cast; a factor changed in place is cast anew; outside a
    block, every call casts."""
    a = torch.randn(4, 6, requires_grad=True)
    b = torch.randn(5, 4, requires_grad=True)
    fresh = low_factors(a, b, 0.3, torch.bfloat16)
    assert fresh[0] is not low_factors(a, b, 0.3, torch.bfloat16)[0]  # no block: anew
    assert torch.equal(fresh[0], a.detach().bfloat16())
    assert torch.equal(fresh[1], b.detach().bfloat16() * 0.3)
    assert not fresh[0].requires_grad and fresh[1].dtype == torch.bfloat16
    with held_factors():
        first = low_factors(a, b, 0.3, torch.bfloat16)
        assert all(torch.equal(x, y) for x, y in zip(first, fresh, strict=True))
        again = low_factors(a, b, 0.3, torch.bfloat16)
        assert again[0] is first[0] and again[1] is first[1]
        assert low_factors(a, b, 0.5, torch.bfloat16)[1] is not first[1]  # another scaling
        with torch.no_grad():
            a.add_(1.0)  # as an optimizer step would
        moved = low_factors(a, b, 0.3, torch.bfloat16)
        assert moved[0] is not first[0] and torch.equal(moved[0], a.detach().bfloat16())
        with held_factors():  # a block of its own
            assert low_factors(a, b, 0.3, torch.bfloat16)[0] is not moved[0]
        assert low_factors(a, b, 0.3, torch.bfloat16)[0] is moved[0]
    assert not adapters._HELD


@pytest.mark.parametrize("checkpointed", [False, True])
def test_an_update_with_held_factors_is_bit_for_bit_and_casts_once(monkeypatch, checkpointed):
    """Two micro-batches of one mini-batch in a held_factors block (the trainer's update): the
    same log-probs and gradients bit for bit as without, with each LoRA linear's factors cast
    once for the block where each forward (and a checkpoint's recompute) cast its own."""
    model = bf16_adapted()
    checkpoint_layers(model, on=checkpointed)
    casts = []
    low = adapters.low_factors

    def counted(a, b, scaling, dtype):
        out = low(a, b, scaling, dtype)
        casts.append(out)  # kept alive: their ids stay theirs
        return out

    monkeypatch.setattr(adapters, "low_factors", counted)
    layers = 14  # 7 linears, 2 layers
    results = []
    for held in (False, True):
        casts.clear()
        with held_factors() if held else contextlib.nullcontext():
            model.zero_grad()
            passes = [score(model, keep_grads=True) for _ in range(2)]
        distinct = {(id(a), id(b)) for a, b in casts}
        results.append(([p[0] for p in passes], passes[-1][1]))
        calls = layers * 2 * (2 if checkpointed else 1)  # forwards, recomputes
        assert len(casts) == calls
        assert len(distinct) == (layers if held else calls)
    (logps, grads), (held_logps, held_grads) = results
    assert all(torch.equal(x, y) for x, y in zip(logps, held_logps, strict=True))
    assert set(grads) == set(held_grads) and grads
    assert all(torch.equal(grads[n], held_grads[n]) for n in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_low_rank_sums_in_place_into_a_contiguous_output(dtype):
    """The LoRA update is added by the product into the base output itself where that is
    contiguous (no copy of it first, as ``torch.addmm`` makes), with ``torch.addmm``'s values;
    a strided output is left as it was and the sum made apart."""
    g = torch.Generator().manual_seed(0)
    out, low, b = (torch.randn(*s, generator=g).to(dtype) for s in ((2, 5, 12), (2, 5, 4), (12, 4)))
    expect = torch.addmm(out.reshape(10, 12), low.reshape(10, 4), b.t()).view(2, 5, 12)
    mine = out.clone()
    summed = adapters.add_low_rank(mine, low, b)
    assert summed.data_ptr() == mine.data_ptr() and torch.equal(summed, expect)
    wide = torch.cat([out, out], dim=-1)
    strided = wide[..., :12]  # a view, not contiguous: a column block of a wider output
    before = wide.clone()
    summed = adapters.add_low_rank(strided, low, b)
    assert torch.equal(summed, expect) and torch.equal(wide, before)
