"""transformers' rotary embedding through marlow's (``marlow.models.fuse_rotary``): the same values
and gradients bit for bit, in every architecture it replaces, through a whole LoRA update pass
too; transformers' own where the roll would not be exact."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

from marlow.models import (
    ROTARY_MODULES,
    _FusedRotary,
    checkpoint_layers,
    fuse_norms,
    fuse_rotary,
    rotate,
    signed_sin,
    transformers_rotary,
)
from marlow.policy.adapters import LoraSpec, attach_adapters
from marlow.training.batch import Chunk
from marlow.training.logprobs import score_chunk
from tests.conftest import build_tiny_qwen3


def _module(name: str):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _original(name: str):
    fuse_rotary()
    fused = _module(name).apply_rotary_pos_emb
    assert isinstance(fused, _FusedRotary)
    return fused, fused.original


def _angles(rows: int, length: int, dim: int, dtype: torch.dtype):
    """cos and sin (rows, length, dim) as transformers' rotary tables make them."""
    inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim))
    pos = torch.arange(length).float()[None, :, None] + torch.arange(rows).float()[:, None, None]
    angles = torch.cat([pos * inv, pos * inv], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply(fn, q, k, cos, sin, grads, unsqueeze_dim=1):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, ke = fn(q, k, cos, sin, unsqueeze_dim)
    ((qe * grads[0]).sum() + (ke * grads[1]).sum()).backward()
    return qe.detach(), ke.detach(), q.grad, k.grad


@pytest.mark.parametrize("name", ROTARY_MODULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_are_transformers_bit_for_bit(name, dtype):
    fused, original = _original(name)
    g = torch.Generator().manual_seed(0)
    rows, length, heads, kv, dim = 2, 24, 4, 2, 16
    # as the attention hands them over: (b, heads, s, d) views of (b, s, heads, d) projections
    q = torch.randn(rows, length, heads, dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(rows, length, kv, dim, generator=g).to(dtype).transpose(1, 2)
    cos, sin = _angles(rows, length, dim, dtype)
    grads = (
        torch.randn(q.shape, generator=g).to(dtype),
        torch.randn(k.shape, generator=g).to(dtype),
    )
    ours, theirs = _apply(fused, q, k, cos, sin, grads), _apply(original, q, k, cos, sin, grads)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    # the other layout transformers' callers use: (b, s, heads, d), unsqueezed at 2
    q2, k2 = q.transpose(1, 2), k.transpose(1, 2)
    grads2 = tuple(t.transpose(1, 2) for t in grads)
    ours = _apply(fused, q2, k2, cos, sin, grads2, unsqueeze_dim=2)
    theirs = _apply(original, q2, k2, cos, sin, grads2, unsqueeze_dim=2)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_rotate_is_the_rotation_and_its_backward_differentiates_again():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    cos, sin = _angles(3, 5, 8, torch.float64)
    half = x[..., 4:], x[..., :4]
    expected = x * cos + torch.cat((-half[0], half[1]), dim=-1) * sin
    assert torch.equal(rotate(x, cos, signed_sin(sin)), expected)
    fused, _ = _original("qwen3")
    k = torch.randn(3, 2, 5, 8, generator=g, dtype=torch.float64)
    q = torch.randn(3, 2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)

    def rotary(t):
        return fused(t, k, cos, sin)[0]

    assert torch.autograd.gradcheck(rotary, (q,))
    assert torch.autograd.gradgradcheck(rotary, (q,))


def test_odd_heads_and_angles_with_a_gradient_fall_back_to_transformers():
    fused, original = _original("qwen3")
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 3, 6, 7, generator=g), torch.randn(2, 1, 6, 7, generator=g)
    cos, sin = _angles(2, 6, 7 + 1, torch.float32)
    cos, sin = cos[..., :7], sin[..., :7]  # odd: no exact roll of halves
    grads = (torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g))
    ours, theirs = _apply(fused, q, k, cos, sin, grads), _apply(original, q, k, cos, sin, grads)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    q, k = torch.randn(2, 3, 6, 8, generator=g), torch.randn(2, 1, 6, 8, generator=g)
    cos, sin = (t.requires_grad_() for t in _angles(2, 6, 8, torch.float32))
    got = [fused(q, k, cos, sin)[0].sum(), original(q, k, cos, sin)[0].sum()]
    cos_grads = [torch.autograd.grad(v, cos)[0] for v in got]
    assert torch.equal(*cos_grads) and cos_grads[0].abs().sum() > 0


def test_fuse_rotary_replaces_transformers_own_once_and_no_one_elses(monkeypatch):
    fuse_rotary()
    assert fuse_rotary() == 0
    assert all(isinstance(_module(n).apply_rotary_pos_emb, _FusedRotary) for n in ROTARY_MODULES)
    originals = {name: _original(name)[1] for name in ROTARY_MODULES}
    for name, original in originals.items():  # transformers' own again
        monkeypatch.setattr(_module(name), "apply_rotary_pos_emb", original)

    def foreign(q, k, cos, sin, unsqueeze_dim=1):  # another library's replacement
        return q, k

    monkeypatch.setattr(_module("llama"), "apply_rotary_pos_emb", foreign)
    assert fuse_rotary() == len(ROTARY_MODULES) - 1
    assert _module("llama").apply_rotary_pos_emb is foreign


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_lora_update_pass_is_bit_for_bit_transformers(checkpointed):
    """A bfloat16 Qwen3 with LoRA on every linear, its norms fused as a loaded base's: the
    log-probs of a micro-batch and every LoRA gradient, with the fused rotary and with
    transformers' own, layers checkpointed (the backward recomputes through it) or not."""
    fuse_rotary()
    base = build_tiny_qwen3(vocab_size=96).to(torch.bfloat16)
    fuse_norms(base)
    model = attach_adapters(base, ["policy"], LoraSpec(rank=4), seed=0)
    with torch.no_grad():  # B starts at zero: give the adapter a say in the gradients
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.train()
    checkpoint_layers(model, checkpointed)
    ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(3))
    chunk = Chunk.full_rows(ids, 5)
    results = []
    for own in (False, True):
        with transformers_rotary() if own else contextlib.nullcontext():
            fused = isinstance(_module("qwen3").apply_rotary_pos_emb, _FusedRotary)
            assert fused is not own
            model.zero_grad(set_to_none=True)
            scored = score_chunk(model, chunk, temperature=1.0, entropy=False)
            (-(scored.logp * scored.mask).sum() / scored.mask.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((scored.logp.detach(), grads))
    assert isinstance(_module("qwen3").apply_rotary_pos_emb, _FusedRotary)  # fused again
    (logp, grads), (logp_hf, grads_hf) = results
    assert torch.equal(logp, logp_hf)
    assert grads.keys() == grads_hf.keys() and len(grads) == 2 * 7 * 2
    assert all(torch.equal(grads[n], grads_hf[n]) for n in grads)
    assert any(grads[n].abs().sum() > 0 for n in grads if "lora_A" in n)


def test_the_signed_table_is_shared_only_by_calls_with_the_same_angles():
    fused, original = _original("qwen3")
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 1, 6, 8, generator=g)
    cos, sin = _angles(1, 6, 8, torch.float32)
    first = fused(q, k, cos, sin)  # its graph keeps the table, as a layer's saved tensors do
    table = fused.last[3]()
    assert table is not None
    second = fused(q, k, cos, sin)
    assert fused.last[3]() is table  # the next layer's call: the same table
    sin.mul_(-0.5)  # the same tensor changed in place, its table still kept: a table anew
    third = fused(q, k, cos, sin)
    assert fused.last[3]() is not table
    assert all(torch.equal(a, b) for a, b in zip(third, original(q, k, cos, sin), strict=True))
    del first, second, third, table
    assert fused.last[3]() is None  # never kept by the reference alone
    cos2, sin2 = _angles(1, 6, 8, torch.float32)
    for angles in ((cos, sin), (cos2, sin2 * 2)):
        got, expected = fused(q, k, *angles), original(q, k, *angles)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    with torch.inference_mode():  # angles made there keep no version: no table kept
        cos3, sin3 = _angles(1, 6, 8, torch.float32)
        got, expected = fused(q, k, cos3, sin3), original(q, k, cos3, sin3)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert fused.last[0]() is not sin3
