"""Matrix products in the layout a CPU without native half precision computes fast
(``marlow.algo.matmul``), and the backward passes that make them through it."""

from __future__ import annotations

import pytest
import torch

from marlow import models
from marlow.algo import matmul
from marlow.algo.estimators import head_logprobs_and_entropy
from marlow.policy.adapters import LoraLinear, low_factors


def draw(*shape: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def layout(t: torch.Tensor) -> str:
    return "row" if t.stride(-1) == 1 else "column"


@pytest.fixture
def no_native(monkeypatch):
    """This CPU as one without native bfloat16 and float16 products, whatever it has."""
    monkeypatch.setattr(matmul, "native_half", lambda dtype: False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_product_of_one_layout_gets_the_smaller_operand_in_the_other(no_native, dtype):
    g, w = draw(8, 48, dtype=dtype), draw(48, 16, dtype=dtype, seed=1)  # both row-major
    a, b = matmul.operands(g, w)  # g, 8 x 48, is the smaller
    assert (a is g, layout(a), b is w, layout(b)) == (False, "column", True, "row")
    assert torch.equal(a, g)
    wt, gt = w.t(), g.t()  # both column-major: the smaller, g.t(), made row-major
    a, b = matmul.operands(wt, gt)
    assert (a is wt, layout(a), b is gt, layout(b)) == (True, "column", False, "row")
    assert torch.equal(b, gt)
    big = draw(64, 48, dtype=dtype)  # now the first is the larger: the second is copied
    a, b = matmul.operands(big, w)
    assert a is big and layout(b) == "column" and torch.equal(b, w)
    for mixed in ((g, w.t().contiguous().t()), (g.t().contiguous().t(), w)):
        assert all(x is y for x, y in zip(matmul.operands(*mixed), mixed, strict=True))


def test_float32_native_and_other_devices_keep_their_operands(monkeypatch):
    g, w = draw(8, 48, dtype=torch.float32), draw(48, 16, dtype=torch.float32, seed=1)
    assert all(x is y for x, y in zip(matmul.operands(g, w), (g, w), strict=True))
    monkeypatch.setattr(matmul, "native_half", lambda dtype: True)
    g, w = g.bfloat16(), w.bfloat16()
    assert all(x is y for x, y in zip(matmul.operands(g, w), (g, w), strict=True))
    assert torch.equal(matmul.mm(g, w), torch.mm(g, w))


def test_mm_and_addmm_equal_the_float32_product_rounded_once(no_native):
    """Each sums in float32 and rounds once: within one bfloat16 step of the float32 product."""
    g, w, c = draw(32, 200), draw(200, 24, seed=1), draw(32, 24, seed=2)
    exact = g.float() @ w.float()
    tol = {"rtol": 2**-7, "atol": 1e-3}  # a bfloat16 step (8 bits of mantissa)
    torch.testing.assert_close(matmul.mm(g, w).float(), exact, **tol)
    torch.testing.assert_close(matmul.addmm_(c.clone(), g, w).float(), c.float() + exact, **tol)
    assert float(exact.abs().max()) > 10  # a real product


def test_the_update_backward_makes_every_half_product_in_a_fast_layout(no_native, monkeypatch):
    """A bfloat16 LoRA linear's backward and the LM head's chunked backward: every product
    through ``operands``, none left with both operands in one layout, and the gradients those
    of the plain products (native) up to bfloat16 round-off."""
    seen = []
    real = matmul.operands

    def spy(a, b):
        a2, b2 = real(a, b)
        seen.append((tuple(a.shape), tuple(b.shape), layout(a2) != layout(b2)))
        return a2, b2

    monkeypatch.setattr(matmul, "operands", spy)
    tokens, d_in, d_out, rank, vocab = 40, 24, 48, 4, 300
    x = draw(2, tokens // 2, d_in).requires_grad_()
    weight, a_f, b_f = (
        draw(d_out, d_in, seed=1),
        draw(rank, d_in, seed=2),
        draw(d_out, rank, seed=3),
    )
    a_f, b_f = a_f.float().requires_grad_(), b_f.float().requires_grad_()
    head = draw(vocab, d_out, seed=4)
    targets = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(5))

    def grads():
        for t in (x, a_f, b_f):
            t.grad = None
        out = LoraLinear.apply(x, weight, None, a_f, b_f, 0.5, *low_factors(a_f, b_f, 0.5, x.dtype))
        logp, _ = head_logprobs_and_entropy(
            out.reshape(tokens, d_out), head, None, targets, 1.0, 16
        )
        logp.sum().backward()
        return [t.grad.float().clone() for t in (x, a_f, b_f)]

    fast = grads()
    assert all(mixed for *_, mixed in seen), seen
    shapes = {(a, b) for a, b, _ in seen}
    assert ((tokens, d_out), (d_out, d_in)) in shapes  # the linear's input gradient, g @ W
    assert ((16, vocab), (vocab, d_out)) in shapes  # the head's, a chunk's dz @ W
    monkeypatch.setattr(matmul, "native_half", lambda dtype: True)
    plain = grads()
    for ours, theirs in zip(fast, plain, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0.02, atol=0.02)
        assert float(theirs.abs().max()) > 0.1


def test_a_half_base_on_a_cpu_without_native_products_is_said_once(monkeypatch):
    monkeypatch.setattr(matmul, "native_half", lambda dtype: False)
    cpu = torch.device("cpu")
    line = models.half_precision_note(torch.bfloat16, cpu)
    assert "dtype is bfloat16" in line and "dtype=float32" in line and "AVX-512 BF16" in line
    assert "FP16" in models.half_precision_note(torch.float16, cpu)
    assert models.half_precision_note(torch.float32, cpu) is None
    assert models.half_precision_note(torch.bfloat16, torch.device("cuda", 0)) is None
    monkeypatch.setattr(matmul, "native_half", lambda dtype: True)
    assert models.half_precision_note(torch.bfloat16, cpu) is None
