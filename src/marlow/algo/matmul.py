"""Matrix products whose operands are laid out the way the machine's GEMM computes fast.

On a CPU without native half-precision matrix products (x86 without AVX-512 BF16 or AMX, such as
AVX2 machines; torch routes a product to oneDNN only where ``torch.ops.mkldnn`` says the CPU
supports the dtype), torch computes a bfloat16 or float16 product in its own reference GEMM,
whose speed depends on how the two operands are laid out: with the first row-major and the
second column-major (``x @ W.T``, a linear's forward) it ran at 17-24 GFLOP/s on a 2-core AMD
EPYC (Zen 3, AVX2) with torch 2.13, but with both row-major (``g @ W``, a linear's input
gradient in the backward) or both column-major at 0.5-0.9 GFLOP/s (``bench/half_matmul.py``):
the input gradient of a bfloat16 Qwen3-0.6B LM head over one chunk of 64 tokens
(``(64, 151936) @ (151936, 1024)``) took 174 s there, 1.1 s through :func:`mm`, 0.3 s
in float32. :func:`mm` and :func:`addmm_` copy the smaller operand into the other layout where
both share one in a half-precision product on such a CPU (a copy of one operand, then the fast
kernel), and are the plain product everywhere else: float32, a GPU, a CPU with native support.

The copy changes only the order in which the product's float32 accumulator sums, so the result
equals the plain product up to bfloat16 round-off (tests). A choice of marlow: the operand copied
is the one with fewer elements. Under ``torch.compile`` with the tokens' count symbolic, where
which is smaller is not known without a guard on that count, the second operand is copied (in a
backward product, the weight): a guard would compile each graph again whenever a pass's tokens
crossed the line.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

_HALF = (torch.bfloat16, torch.float16)


def _probe(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    check = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch without the probe: assume none
        return False


_NATIVE = {dtype: _probe(dtype) for dtype in _HALF}  # asked once: a compiled backward reads it


def native_half(dtype: torch.dtype) -> bool:
    """Whether torch computes ``dtype`` (bfloat16 or float16) matrix products on this CPU in
    oneDNN, with the CPU's native instructions for it (as torch said when marlow was imported)."""
    return _NATIVE[dtype]


def slow_half(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``dtype`` products on ``device`` run in torch's own reference GEMM: bfloat16 or
    float16 on a CPU without native support for it (module docstring)."""
    return device.type == "cpu" and dtype in _HALF and not native_half(dtype)


def _row_major(t: Tensor) -> bool:
    return t.stride(-1) == 1


def _other_layout(t: Tensor) -> Tensor:
    """``t``'s values in the other layout: row-major made column-major, or the reverse."""
    return t.t().contiguous().t() if _row_major(t) else t.contiguous()


def operands(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(a, b)`` for the product ``a @ b`` of two matrices, the smaller re-laid out where both
    share a layout in a half-precision product on a CPU without native support (module
    docstring); else as given."""
    if not slow_half(a.dtype, a.device):  # first: the one check a GPU's products make
        return a, b
    if a.dim() != 2 or b.dim() != 2 or _row_major(a) != _row_major(b):
        return a, b
    if statically_known_true(a.numel() <= b.numel()):  # no guard on symbolic sizes
        return _other_layout(a), b
    return a, _other_layout(b)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of two matrices, computed fast on every machine (module docstring)."""
    return torch.mm(*operands(a, b))


def addmm_(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``c += a @ b`` in place (``c.addmm_(a, b)``: the sum made by the product), computed fast
    on every machine (module docstring); returns ``c``."""
    return c.addmm_(*operands(a, b))
