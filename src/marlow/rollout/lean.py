"""A lean forward for sampling from Qwen3 bases: on plain weights, under one LoRA adapter, or
under several at once (each row its own), with a KV cache allocated once per call and a decode
step that can be compiled.

Why: the sampling loop runs one forward per new token, and for a small model much of a forward
through the transformers modules is Python: ~60 module calls, a causal mask rebuilt, the rotary
angles recomputed and every layer's KV cache concatenated one column longer, per token. This
forward does the same arithmetic with less of that: on the tiny world, sampling a merged LoRA
adapter took 31,680 instead of 19,251 tokens/s at 32 rows and 75,131 instead of 56,663 at 256
rows; tiny-l (3.2M parameters) 20,985 instead of 16,894 at 256 rows (``bench/rollout_speed.py
--threads 2``, this 2-core EPYC). It is used only where it computes what transformers computes:

- the model is a transformers ``Qwen3ForCausalLM`` with the default RoPE, a SiLU MLP and full
  attention in every layer, whose linear layers and embedding are plain torch ones (not
  quantised, not replaced);
- each adapter the call names is the base itself (:data:`marlow.types.BASE`, which is also what
  an adapter folded in by :func:`marlow.policy.adapters.merged` looks like), or plain LoRA on
  linear layers (no DoRA, no LoRA bias, none on the embedding), whose update it adds as the
  model's forward does: the input cast to the factors' dtype, ``B(A(x)) * scaling`` added, the
  sum cast back.
  The factors are first cast to :func:`marlow.policy.adapters.lora_compute_dtype` (a bfloat16
  base's dtype; float32 over a float32 base), the arithmetic the trainer's scoring runs under
  :func:`marlow.policy.adapters.lora_in_base_dtype`.

Several adapters in one call: each linear's LoRA factors are stacked, A as
(sum of ranks, in) and B as (out, sum of ranks), one GEMM each for every row of the batch, and a
per-row 0/1 mask over the stacked rank keeps only the row's own adapter's columns before B
(Punica's and vLLM's idea, in plain torch); the row's scaling multiplies B's output, as PEFT
multiplies it. A row of one adapter then gets its own update plus exact zeros from the others',
summed in another blocking order by the GEMM: equal to PEFT's within float round-off (tests).
A call of one adapter, or of the base, takes the model's own arithmetic (no mask): PEFT's in
float32, and over a bfloat16 base that of the trainer's scoring under ``lora_in_base_dtype``
(:class:`marlow.policy.adapters.LoraLinear`: the scaling in B, the sum made by the low-rank
product, :func:`marlow.policy.adapters.add_low_rank`). Its logits equal the model's forward bit
for bit, in float32 and bf16, padded or not, after rows leave the batch
(``tests/unit/test_rollout_lean.py``, torch 2.13, transformers 5.24).

The compiled step computes the linears that read one input together, a group each
(:class:`_Group`, :data:`GROUPS`): a layer's q, k and v; its o; its gate and up; its down. Their
base weights are packed one after the other in one buffer whose row blocks the model's own
weights become (:func:`_packed`, as vLLM keeps a layer's q, k and v as one weight), followed by
the call's stacked LoRA A factors where every member has LoRA of one layout: one GEMM computes
the base outputs and the low-rank ones, then the rows' mask, one batched GEMM of the members' B
factors zero-padded to the widest member's outputs. A layer then runs 8 matrix products
instead of 21 (``bench/lean_lora.py`` counts them), for a GPU's graphed step is bound by its
count of small kernels more than by its bytes. The base costs the largest call's A factors
more, no copy of its weights. Its outputs equal one layer at a time within float round-off;
the eager step keeps one layer at a time, so that a call of one adapter stays bit-equal to
transformers'.

It follows transformers' operations in the same order with the same kernels (RMSNorm in float32,
or through torch's ``rms_norm`` where :func:`marlow.models.fuse_norms` made the model's so,
rotary angles as ``position * inv_freq``, scaled-dot-product attention: causal with the padding
mask over the prompt, the query heads grouped onto their key/value head for one new token, the
SDPA call transformers makes, the head on the last position kept as a (rows, 1, width) batch).

The KV cache is one buffer per layer of (rows, 2 x kv heads, columns, head dim), the keys'
heads then the values', so that a step writes both at once. A forward is
:func:`_forward`, one :func:`_layer` per decoder layer. Eager, the cache grows by doubling as
columns are written and a decode step (one new token per row) attends over the columns written so
far, as transformers does (grown columns are zeroed: a row admitted later attends, masked, over
columns it has not written, and a weight of 0 times a NaN left in memory would be NaN).
``compiled`` runs the decode steps at fixed shapes: the cache allocated
once for the call's ``length`` columns and zeroed, each step attending over a fixed span of
columns with the mask (columns not yet written are masked), each layer in three parts through
``torch.compile`` (:func:`_compiled_parts`): the projections before the cache write, the attention,
the rest after it (every layer has the same shapes and only the rows' dimension varies, and the
span's for the attention, so one compilation serves every layer and batch, the flex attention's one
per batch size, and fuses each part's elementwise work into a few kernels). On CUDA the whole step
is then captured as a CUDA graph (:class:`_Graph`: its inputs copied into static buffers, the step
one launch), when the call first decodes and again when its rows change (a compaction). It attends
by SDPA over a span, every row reading all of it: the columns up to the next multiple of
:data:`SPAN_STEP` past the largest column a row writes at, so early steps do not read the whole
cache, a graph captured again when the span changes (a graph keeps its span until the span needed
would halve: rows admitted later, at smaller columns, lower it). Inside :func:`attention_by_blocks`
its attention is flex attention over blocks of :data:`KV_BLOCK` columns instead
(:func:`_attend_blocks`): each row reads the blocks up to its own column's and no further, so the
step spans the whole cache, one graph serves every step of a batch size, and rows refilled at small
columns beside long ones (and filler rows) read only their own; slower on a GPU as measured so far
(:func:`_compiled_parts`), it is what the GPU check times beside the default. Off CUDA a step
attends by SDPA over all ``length`` columns (:func:`_compiled_parts` says why), so every step of a
call has the same shapes. Both write each row's new key and value at its column given as a tensor
(rows admitted at other steps write at other columns: :meth:`LeanQwen3.admit`), so no step reads
the device.

Why this shape on CUDA, from the GPU check on one H100 (``bench/gpu_check.py``: the Qwen3-0.6B
stand-in, 16 rows, 512 new tokens): the whole step through ``torch.compile`` under
``mode="reduce-overhead"`` took 59 s to compile per shape, then 5.2 ms a step; CUDA graphs of the
eager step cost seconds to capture, but a call took 10 ms a step (its five captures included), a
step of a 4-adapter 64-row batch 11 ms, as if bound by the number of kernels: an eager step is
about 3,300 aten operations (the 0.6B's 28 layers with LoRA, under a dispatch counter), each a
kernel of a few microseconds even when replayed. Compiling one layer fuses its elementwise
operations (19 generated kernels a layer on the CPU, where a layer compiles in 3 s). Compiled
whole, a layer was compiled again for each new batch, span and last span of a call, and reached
torch.compile's limit of 8 compilations, past which it runs eager without a word: hence the
parts, of which only the attention sees the span, and none the cache. With them, on one H200, a
64-row call of 4 adapters mixed took 8.3 ms a step, and its profile showed half of the device's time in the
float32 LoRA factors' GEMMs (no tensor cores: ``sgemm`` and split-K kernels), the bfloat16 base
GEMMs an eighth: hence the factors in the base's dtype, with which the same call took 6.5 ms a
step (``bench/results/gpu_check_compiled_update.json``), its profile about 1,310 kernels a step
of 3 to 4 microseconds each, 21 matrix products a layer among them: hence the grouped
products, with which the same call took 4.5 ms a step (14,347 tokens/s) and one of 256 rows 9.0
ms (28,520; ``bench/results/gpu_check.json``). In the earlier profile the attention (cuDNN's
flash kernel, over the two query heads of each key head and the mask) took 23 microseconds a
layer, about a seventh of the step's device time: the 64 rows' span of 128 columns (34 MB of
keys and values a layer) at 1.5 TB/s, a third of the card's measured copy bandwidth; at 256
rows and longer contexts the attention's reads are most of a step's bytes (the check's bound).
Hence flex attention's decoding kernel, made for one query a row and reading each row's own
blocks: compiled with the rows symbolic it ran the general kernel instead and was slower than
SDPA (:func:`_compiled_parts`), and with them static (:func:`_fix_rows`) it is not measured on a
GPU yet.
"""

from __future__ import annotations

import contextlib
import inspect
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.weak import WeakIdKeyDictionary
from transformers import Qwen3ForCausalLM

from marlow.models import compile_limit, fused_norm, rms_norm, rotate, signed_sin
from marlow.policy.adapters import (
    active_adapter,
    add_low_rank,
    lora_compute_dtype,
    plain_lora,
)
from marlow.types import BASE


def _plain(module: torch.nn.Module) -> torch.nn.Module:
    """The layer a (possibly LoRA-wrapped) layer wraps; with the adapters disabled, its output."""
    return getattr(module, "base_layer", module)


@dataclass(frozen=True)
class _Linear:
    """A linear layer as the lean forward computes it: the base weight and bias, and the call's
    adapters' LoRA factors stacked (``a`` (rank sum, in), ``b`` (out, rank sum); None: no adapter
    of the call has this layer) with the index of their layout (:class:`_Layout`)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    layout: int = -1


@dataclass(frozen=True)
class _Layout:
    """How a layer's stacked factors divide among the call's adapters: ``ranks[i]`` columns for
    adapter i (0: it has no LoRA on the layer), in order, and each adapter's scaling."""

    ranks: tuple[int, ...]
    scalings: tuple[float, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Group:
    """Linear layers that read one input (a layer's q, k and v; its gate and up; its o, or its
    down, alone), computed together by the compiled step (:func:`_linears`). ``weight``: their
    base weights packed one after the other (:func:`_packed`), then, where ``fused``, their
    LoRA A factors (``a``'s rows), so that one GEMM computes the base outputs and the low-rank
    ones; None: a GEMM each. Where every member has LoRA of one layout: ``a`` (members x rank
    sum, in), every member's stacked A one after the other, and ``b`` (members, rank sum, largest
    out), each member's B transposed and zero-padded to the largest member's outputs (None:
    each member's own LoRA, if any). ``sizes``: each member's outputs."""

    sizes: tuple[int, ...]
    weight: torch.Tensor | None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    layout: int = -1
    fused: bool = False


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    eps: float
    fused: bool  # computed through marlow.models.rms_norm (marlow.models.fuse_norms)


@dataclass(frozen=True)
class _Weights:
    """Everything a forward reads but the cache: the layers, the head and the shapes."""

    embed: torch.Tensor
    layers: tuple[dict, ...]
    norm: _Norm
    head: _Linear
    heads: int
    kv_heads: int
    head_dim: int


class _Unsupported(Exception):  # noqa: N818 - a layer the lean forward does not compute
    pass


def _check_plain_lora(module: torch.nn.Module, adapter: str) -> None:
    """Raise :class:`_Unsupported` unless ``module`` is a plain LoRA linear for ``adapter``
    (:func:`marlow.policy.adapters.plain_lora`) casting its input as PEFT does."""
    if not plain_lora(module, adapter) or not getattr(module, "cast_input_dtype_enabled", True):
        raise _Unsupported


def _lora(
    module: torch.nn.Module,
    adapters: Sequence[str],
    layouts: list[_Layout],
    stack: bool = True,
    dtype: torch.dtype | None = None,
) -> _Linear:
    """``module`` as :class:`_Linear` under the call's ``adapters`` (a new layout is appended to
    ``layouts``), the stacked factors cast to ``dtype`` (None: theirs); a LoRA layer of another
    kind than plain raises :class:`_Unsupported`."""
    base = _plain(module)
    if type(base) is not torch.nn.Linear:
        raise _Unsupported
    lora_a = getattr(module, "lora_A", None) or {}
    present = [n for n in adapters if n != BASE and n in lora_a]
    if not present:
        return _Linear(base.weight, base.bias)
    for name in present:
        _check_plain_lora(module, name)
    a = [module.lora_A[n].weight for n in present]
    b = [module.lora_B[n].weight for n in present]
    if len({t.dtype for t in a + b}) > 1:
        raise _Unsupported
    layout = _Layout(
        tuple(module.lora_A[n].weight.shape[0] if n in present else 0 for n in adapters),
        tuple(float(module.scaling[n]) if n in present else 0.0 for n in adapters),
        dtype or a[0].dtype,
    )
    if layout not in layouts:
        layouts.append(layout)
    if not stack:  # checked only (LeanQwen3.supports): no copy of the factors
        return _Linear(base.weight, base.bias, a[0], b[0], layouts.index(layout))
    a_all = a[0] if len(a) == 1 else torch.cat(a, dim=0)
    b_all = b[0] if len(b) == 1 else torch.cat(b, dim=1)
    a_all, b_all = a_all.to(layout.dtype), b_all.to(layout.dtype)
    return _Linear(base.weight, base.bias, a_all, b_all, layouts.index(layout))


def _parts(
    model: torch.nn.Module,
    adapters: Sequence[str],
    stack: bool = True,
) -> tuple[_Weights, list] | None:
    """The weights the lean forward reads under ``adapters`` and the layouts of their stacked
    LoRA factors, or None where it would not compute the model's forward: not a transformers
    Qwen3 causal LM, a RoPE other than the default, sliding-window layers, a layer that is not a
    plain linear / embedding (a quantised or replaced one), an adapter on the embedding, or an
    adapter that is not plain LoRA on linear layers (DoRA, a LoRA bias, several names at once).
    ``stack`` False: the checks alone, the factors not copied into stacks (the weights then do
    not compute the call). The stacked LoRA factors are cast to
    :func:`marlow.policy.adapters.lora_compute_dtype` of the base's dtype."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(causal_lm, Qwen3ForCausalLM):
        return None
    if any("," in name for name in adapters):  # several adapters active at once
        return None
    cfg = causal_lm.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or cfg.hidden_act != "silu":
        return None
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return None
    body = causal_lm.model
    embed = body.embed_tokens
    if type(_plain(embed)) is not torch.nn.Embedding or any(
        name in getattr(embed, "lora_embedding_A", {}) for name in adapters if name != BASE
    ):
        return None
    layouts: list[_Layout] = []
    dtype = lora_compute_dtype(_plain(embed).weight.dtype)
    lora = partial(_lora, adapters=adapters, layouts=layouts, stack=stack, dtype=dtype)
    try:
        layers = tuple(
            {
                "ln1": _norm(layer.input_layernorm),
                "q": lora(layer.self_attn.q_proj),
                "k": lora(layer.self_attn.k_proj),
                "v": lora(layer.self_attn.v_proj),
                "qn": _norm(layer.self_attn.q_norm),
                "kn": _norm(layer.self_attn.k_norm),
                "o": lora(layer.self_attn.o_proj),
                "ln2": _norm(layer.post_attention_layernorm),
                "gate": lora(layer.mlp.gate_proj),
                "up": lora(layer.mlp.up_proj),
                "down": lora(layer.mlp.down_proj),
            }
            for layer in body.layers
        )
        head = lora(causal_lm.get_output_embeddings())
    except _Unsupported:
        return None
    weights = _Weights(
        embed=_plain(embed).weight,
        layers=layers,
        norm=_norm(body.norm),
        head=head,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
    )
    return weights, [layouts, body.rotary_emb.inv_freq]


def _norm(module: torch.nn.Module) -> _Norm:
    return _Norm(module.weight, float(module.variance_epsilon), fused_norm(module))


def _rms(x: torch.Tensor, norm: _Norm) -> torch.Tensor:
    """Qwen3's RMSNorm as the model computes it: through :func:`marlow.models.rms_norm` where
    :func:`marlow.models.fuse_norms` made it so, else transformers' arithmetic (in float32,
    scaled in the input's dtype)."""
    if norm.fused and x.dtype == norm.weight.dtype:
        return rms_norm(x, norm.weight, norm.eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(x.dtype)


def _linear(x: torch.Tensor, layer: _Linear, lora: Sequence[tuple]) -> torch.Tensor:
    """The base layer's output, plus the LoRA update as the model computes it
    (:func:`_with_lora`)."""
    return _with_lora(F.linear(x, layer.weight, layer.bias), x, layer, lora)


def _with_lora(
    out: torch.Tensor, x: torch.Tensor, layer: _Linear, lora: Sequence[tuple]
) -> torch.Tensor:
    """``out``, the base layer's output of ``x``, plus the LoRA update as PEFT computes it: the
    input cast to the factors' dtype, ``B(A(x)) * scaling`` added, the sum cast back to the base
    output's dtype; where every row has the one adapter and the factors are a bfloat16 (or
    float16) base's dtype, as :class:`marlow.policy.adapters.LoraLinear` computes it in the
    trainer's scoring (the scaling in B, the sum made by the product). ``lora[layer.layout]`` is
    (mask, scaling): the rows' 0/1 mask over the stacked rank (rows, 1, rank sum) or None when
    every row has the one adapter, and the scaling (a float, or per row (rows, 1, 1))."""
    if layer.a is None:
        return out
    mask, scaling = lora[layer.layout]
    low = F.linear(x.to(layer.a.dtype), layer.a)
    if mask is None and isinstance(scaling, float) and layer.a.dtype == out.dtype != torch.float32:
        return add_low_rank(out, low, layer.b * scaling)  # as LoraLinear under lora_in_base_dtype
    if mask is not None:
        low = low * mask
    return (out + F.linear(low, layer.b) * scaling).to(out.dtype)


GROUPS = {
    "qkv": ("q", "k", "v"),
    "o_group": ("o",),
    "gate_up": ("gate", "up"),
    "down_group": ("down",),
}
"""The :class:`_Group` of each layer's linears that read one input, by its key in the layer."""


def _group(members: Sequence[_Linear]) -> _Group:
    """``members`` (which read one input) as one :class:`_Group`: their base weights packed
    where :func:`_packed` can, followed by their A factors where every member has LoRA of one
    layout in the weights' dtype (written there by :meth:`LeanQwen3._claim`)."""
    sizes = tuple(m.weight.shape[0] for m in members)
    first = members[0]
    lora = all(m.a is not None and m.layout == first.layout for m in members)
    a = torch.cat([m.a for m in members]) if lora else None
    weight, fused = None, False
    if all(m.bias is None for m in members):
        fused = a is not None and a.dtype == first.weight.dtype  # A after the base weights
        weight = _packed([m.weight for m in members], a.shape[0] if fused else 0)
        fused = fused and weight is not None
    if not lora:
        return _Group(sizes, weight)
    b = first.b.new_zeros(len(members), first.b.shape[1], max(sizes))
    for i, m in enumerate(members):
        b[i, :, : sizes[i]] = m.b.T
    return _Group(sizes, weight, a, b, first.layout, fused)


_WROTE: dict[tuple, weakref.ReferenceType] = {}
"""A packed buffer's first spare rows (device, address) -> the call (:class:`LeanQwen3`) that
last wrote its A factors there (:meth:`LeanQwen3._claim`)."""

_PACKS = WeakIdKeyDictionary()
"""Each packed group's first weight -> (device, storage address) of the buffer :func:`_packed`
made for it, whose rows past the weights are marlow's to write (its rows: the storage's size)."""


def _packed(weights: Sequence[torch.Tensor], spare: int = 0) -> torch.Tensor | None:
    """``weights`` (each (out, in): a layer's q, k and v, its gate and up, its o or its down)
    as one matrix whose row blocks they are, in order, followed by ``spare`` free rows (for the
    call's LoRA A factors: one GEMM computes the base outputs and the low-rank ones); None where
    they differ in input width, dtype or device.

    Where they are not yet row blocks of a buffer made here with room for ``spare`` rows more,
    they are moved into a new one: each weight's ``.data`` becomes its block (the same values,
    the same parameter objects, their old memory freed), the way vLLM keeps a layer's q, k and v
    as one weight. The base then costs the spare rows more (the largest call's A factors so far:
    a call of more packs again), and later calls find the weights packed (a model moved to
    another device or dtype, or a weight replaced, is packed again at its next compiled call;
    the buffers made here are known by :data:`_PACKS`). The buffer is made outside inference
    mode, so that training takes gradients through the weights as before; the matrix returned
    has its own version counter, so that writing the spare rows does not mark the weights
    modified for autograd."""
    first = weights[0]
    width, dtype, device = first.shape[1], first.dtype, first.device
    if any(
        w.dim() != 2 or (w.shape[1], w.dtype, w.device) != (width, dtype, device) for w in weights
    ):
        return None
    rows = sum(w.shape[0] for w in weights)
    storage = first.untyped_storage()
    room = storage.nbytes() // (width * first.element_size())  # the buffer's rows
    ours = _PACKS.get(first) == (device, storage.data_ptr())
    if not (ours and room >= rows + spare and _adjacent(weights, storage.data_ptr())):
        with torch.inference_mode(False), torch.no_grad():
            buffer = first.new_zeros((rows + spare, width))
            start = 0
            for w in weights:
                buffer[start : start + w.shape[0]] = w.detach()
                w.data = buffer[start : start + w.shape[0]]
                start += w.shape[0]
        _PACKS[first] = (device, first.untyped_storage().data_ptr())
    with torch.inference_mode(False):
        matrix = torch.empty(0, dtype=dtype, device=device)
        return matrix.set_(first.untyped_storage(), 0, (rows + spare, width), (width, 1))


def _adjacent(weights: Sequence[torch.Tensor], storage: int) -> bool:
    """Whether ``weights`` are contiguous and, in order, the first rows of the storage at
    address ``storage``."""
    offset = 0
    for w in weights:
        if not w.is_contiguous() or w.untyped_storage().data_ptr() != storage:
            return False
        if w.storage_offset() != offset:
            return False
        offset += w.numel()
    return True


def _linears(
    x: torch.Tensor, members: Sequence[_Linear], group: _Group | None, lora: Sequence[tuple]
) -> list[torch.Tensor]:
    """Each of ``members``' outputs of ``x`` (b, q, in), as :func:`_linear` computes them, or
    where ``group`` is given, together: one GEMM of the packed base weights (and, fused, of the
    A factors after them, else one GEMM of every member's A), the rows' mask, one batched GEMM of
    every member's B, the scaling. The same arithmetic as one member at a time but for the order
    in which the GEMMs sum (float round-off), in two or three kernels instead of three a member:
    on a GPU a decode step is bound by its count of small kernels."""
    if group is None:
        return [_linear(x, m, lora) for m in members]
    rows = sum(group.sizes)
    if group.weight is None:
        outs = [F.linear(x, m.weight, m.bias) for m in members]
    else:
        both = F.linear(x, group.weight)
        outs = list(both[..., :rows].split(group.sizes, dim=-1))
    if group.b is None:
        return [_with_lora(out, x, m, lora) for out, m in zip(outs, members, strict=True)]
    mask, scaling = lora[group.layout]
    b, q, _ = x.shape
    k, rank, width = group.b.shape
    if group.fused:
        low = both[..., rows:].reshape(b, q, k, rank)
    else:
        low = F.linear(x.to(group.a.dtype), group.a).view(b, q, k, rank)
    if mask is not None:
        low = low * mask[:, :, None, :]  # (b, 1, 1, rank sum): each member alike
    up = torch.bmm(low.reshape(b * q, k, rank).transpose(0, 1), group.b)  # (k, b * q, width)
    up = up.view(k, b, q, width) * scaling
    return [
        (out + up[i, :, :, :n]).to(out.dtype)
        for i, (out, n) in enumerate(zip(outs, group.sizes, strict=True))
    ]


def _forward(
    w: _Weights,
    cache: list[torch.Tensor],
    lora: Sequence[tuple],
    rope: tuple[torch.Tensor, torch.Tensor],
    ids: torch.Tensor,
    positions: torch.Tensor,
    columns: torch.Tensor,
    valid: torch.Tensor | None,
    span: int,
    parts: _Parts | None = None,
) -> torch.Tensor:
    """The next ``q`` tokens of every row (``ids`` (b, q), at ``positions`` (b, q)) written into
    the cache at ``columns`` (q,) (or, one token a row, at each row's own column: (b, 1)),
    attending over the cache's first ``span`` columns (``valid``
    (b, span): False masks a column; None: every column is real); the last token's logits (b, V)
    in float32. Each layer is :func:`_layer`, its parts ``parts`` (default eager; the compiled
    step passes its ``torch.compile``'d ones: every layer has the same shapes, so one
    compilation serves all)."""
    cos, sin_signed = rope[0][positions][:, None], rope[1][positions][:, None]  # (b, 1, q, hd)
    mask = valid
    if parts is not None and parts.blocks:  # each row reads its own blocks of columns
        mask = _row_blocks(valid, columns, span)
        _fix_rows(*mask)  # flex attention's decoding kernel takes a static batch
        _vary(mask[0], dims=(1,))  # the span
        _vary(mask[2], dims=(3,))  # the span's blocks
    elif valid is not None and ids.shape[1] == 1:
        # one token a row: the mask made additive once a step, as attention would make it in
        # every layer (the same -inf and 0, so the same bits; a kernel a layer fewer)
        mask = torch.zeros(valid.shape, dtype=w.embed.dtype, device=valid.device)
        mask.masked_fill_(~valid, float("-inf"))
    if columns.dim() == 2:  # each row's column, as the index of the cache write (_layer)
        columns = columns[:, None, :, None].expand(-1, 2 * w.kv_heads, -1, w.head_dim)
    x = F.embedding(ids, w.embed)
    if parts is not None:  # compiled: the rows' dimension is the only symbolic size
        _vary(x, cos, sin_signed, *(t for pair in lora for t in pair))
    for i, layer in enumerate(w.layers):
        x = _layer(x, layer, cache[i], lora, cos, sin_signed, columns, mask, span, parts)
    # as transformers: the norm over every position, then the head on the last one kept
    # (b, 1, hidden): the same kernels, so the same bits
    return _linear(_rms(x, w.norm)[:, -1:], w.head, lora)[:, -1].float()


def _layer(
    x: torch.Tensor,
    layer: dict,
    cache: torch.Tensor,
    lora: Sequence[tuple],
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    columns: torch.Tensor,
    mask: torch.Tensor | tuple | None,
    span: int,
    parts: _Parts | None = None,
) -> torch.Tensor:
    """One decoder layer of :func:`_forward` over ``x`` (b, q, hidden), its ``cache`` (b, 2 x kv
    heads, columns, hd: the keys' heads, then the values') written at ``columns`` ((q,), or
    each row's own expanded to the new keys and values' shape (b, 2 x kv heads, 1, hd)):
    :func:`_projections`, the cache write (one for the keys and the values), the attention over the first ``span`` columns under ``mask`` (what
    ``parts.attend`` takes: :func:`_attend`'s or :func:`_attend_blocks`'), then :func:`_rest`
    (``parts``: the three, default eager). The cache write stays out of the compiled parts, and
    the attention is compiled apart from the two others, so that they have the shapes of the
    rows alone, whatever column a step writes and however many it attends over."""
    if parts is None:
        projections, attend, rest = _projections, _attend, _rest
    else:
        projections, attend, rest = parts.projections, parts.attend, parts.rest
    query, new = projections(x, layer, lora, cos, sin_signed)
    if columns.dim() == 1:  # every row's tokens at the same columns
        cache.index_copy_(2, columns, new)
    else:  # one token a row, each at its own column: (b, 2 x kv heads, 1, hd), from _forward
        cache.scatter_(2, columns, new)
    kv_heads = cache.shape[1] // 2
    keys, values = cache[:, :kv_heads, :span], cache[:, kv_heads:, :span]
    if parts is not None and parts.blocks:  # the span is symbolic to the compiled attention
        _fix_rows(query, keys, values)
        _vary(keys, values, dims=(2,))
    out = attend(query, keys, values, mask)
    if parts is not None:
        _vary(out)
    return rest(x, out, layer, lora)


def _fix_rows(*tensors: torch.Tensor) -> None:
    """Tell ``torch.compile`` that the rows (the first size) of each of ``tensors`` are static:
    the flex attention's inputs, compiled once per batch size (a step's other sizes symbolic).
    Inductor lowers a flex attention of one query a row to its decoding kernel (split over the
    columns) only where the batch is static; with the rows symbolic it took the general kernel,
    which pads each row's one query to a block of queries: on an H200 that attention took 267
    us a layer at 256 rows over about 60 columns, where reading their keys and values once
    takes about 15 (``bench/gpu_check.py``'s profile)."""
    for t in tensors:
        torch._dynamo.mark_static(t, 0)


def _vary(*tensors, dims: tuple[int, ...] = (0,)) -> None:
    """Tell ``torch.compile`` that the sizes ``dims`` (default: the first, the rows) of each
    tensor among ``tensors`` may change from call to call, and no other size: compiled with
    them symbolic from the start, a part serves every batch (but one row) and span with one
    compilation. A part is compiled at the first layer that calls it, so the step's inputs are
    marked once a step and each layer's own inputs once a layer (what the compiled parts return
    needs none: the compiled graph's guards take any size of a symbolic dimension)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(t, dim)


def _projections(
    x: torch.Tensor, layer: dict, lora: Sequence[tuple], cos: torch.Tensor, sin_signed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's query (b, heads, q, hd) and its keys and values one after the other (b, 2 x kv
    heads, q, hd: one write into the cache) of ``x`` (b, q, hidden): the input norm, the three
    projections, the query and key norms and the rotary angles."""
    b, q, _ = x.shape
    hd = layer["qn"].weight.shape[-1]
    h = _rms(x, layer["ln1"])
    members = (layer["q"], layer["k"], layer["v"])
    query, key, value = _linears(h, members, layer.get("qkv"), lora)
    query = _rms(query.view(b, q, -1, hd), layer["qn"]).transpose(1, 2)
    key = _rms(key.view(b, q, -1, hd), layer["kn"]).transpose(1, 2)
    value = value.view(b, q, -1, hd).transpose(1, 2)
    return rotate(query, cos, sin_signed), torch.cat((rotate(key, cos, sin_signed), value), dim=1)


def _rest(x: torch.Tensor, out: torch.Tensor, layer: dict, lora: Sequence[tuple]) -> torch.Tensor:
    """The rest of a layer after its attention's ``out`` (b, heads, q, hd): the output
    projection and the residual, the norm, the MLP and its residual."""
    b, q, _ = x.shape
    attended = out.transpose(1, 2).reshape(b, q, -1)
    x = x + _linears(attended, (layer["o"],), layer.get("o_group"), lora)[0]
    h = _rms(x, layer["ln2"])
    gate, up = _linears(h, (layer["gate"], layer["up"]), layer.get("gate_up"), lora)
    return x + _linears(F.silu(gate) * up, (layer["down"],), layer.get("down_group"), lora)[0]


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of ``query`` (b, heads, q, hd) over the columns (b, kv heads, span, hd), causal,
    masking the columns ``valid`` (b, span) marks False (None: every column is real; with one
    query a row, :func:`_forward` has made it additive: -inf where masked, else 0)."""
    b, heads, q, hd = query.shape
    kv_heads = keys.shape[1]
    group, scale = heads // kv_heads, hd**-0.5
    if valid is None:
        return F.scaled_dot_product_attention(
            query, keys, values, is_causal=q > 1, scale=scale, enable_gqa=group > 1
        )
    if q == 1:  # each key/value head with its group of query heads, one mask for all
        grouped = query.reshape(b, kv_heads, group, hd)
        out = F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=valid[:, None, None, :], scale=scale
        )
        return out.reshape(b, heads, 1, hd)
    # the prompt: causal and not padding; a padding position sees only itself
    seen = torch.ones(q, q, dtype=torch.bool, device=query.device).tril()
    seen = valid[:, None, None, :] & seen
    seen |= torch.eye(q, dtype=torch.bool, device=query.device)
    return F.scaled_dot_product_attention(
        query,
        keys.repeat_interleave(group, dim=1),
        values.repeat_interleave(group, dim=1),
        attn_mask=seen,
        scale=scale,
    )


KV_BLOCK = 128
"""A compiled decode step reads each row's keys and values in blocks of this many columns, up to
the block of the row's own column (:func:`_attend_blocks`)."""

_NO_Q_BLOCKS = (
    {"compute_q_blocks": False}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    else {}
)
"""Where torch's :meth:`BlockMask.from_kv_blocks` can skip it, a decode step's block mask is made
without the index only a backward reads; torch 2.11 and 2.13 take ``compute_q_blocks``, 2.6 to
2.8 do not (where passing it made the compiled flex attention fail and be given up)."""


def _row_blocks(
    valid: torch.Tensor, columns: torch.Tensor, span: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mask of :func:`_attend_blocks` for rows writing at ``columns`` (b, 1) and attending
    over ``span`` columns: ``valid`` (b, span) as it is, each row's count of blocks (b, 1, 1:
    those up to its own column's), and the blocks' indices in order (b, 1, 1, blocks of the
    span), as :class:`~torch.nn.attention.flex_attention.BlockMask` takes them (int32)."""
    blocks = -(-span // KV_BLOCK)
    count = (columns // KV_BLOCK + 1).clamp_(max=blocks).to(torch.int32).view(-1, 1, 1)
    order = torch.arange(blocks, dtype=torch.int32, device=valid.device)
    return valid, count, order.expand(valid.shape[0], 1, 1, blocks).contiguous()


def _attend_blocks(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Attention of one new token a row (``query`` (b, heads, 1, hd)) over each row's own columns
    of ``keys`` and ``values`` (b, kv heads, span, hd), by flex attention: a row reads only its
    first blocks of :data:`KV_BLOCK` columns (``mask`` from :func:`_row_blocks`: its count of
    blocks and their indices), and among them the columns ``valid`` marks False are masked.
    The attention :func:`_attend` computes, within float round-off (another kernel, summing in
    another order), but a row's reads end at its own column's block, not at the span: rows
    refilled at small columns beside a long one, or padded to a bucket, no longer read the
    long one's columns. Compiled (the rows static: :func:`_fix_rows`), this is flex attention's
    decoding kernel (split over the columns, as for one query a row); eager, a slow reference,
    never used for sampling."""
    valid, count, indices = mask

    def keep(b, h, q, kv):
        return valid[b, kv]

    blocks = BlockMask.from_kv_blocks(
        count,
        indices,
        BLOCK_SIZE=KV_BLOCK,
        mask_mod=keep,
        seq_lengths=(1, keys.shape[2]),
        **_NO_Q_BLOCKS,
    )
    heads, kv_heads, hd = query.shape[1], keys.shape[1], query.shape[-1]
    return flex_attention(
        query, keys, values, block_mask=blocks, scale=hd**-0.5, enable_gqa=heads != kv_heads
    )


@dataclass(frozen=True)
class _Parts:
    """A decoder layer's three parts as a compiled decode step runs them (:func:`_layer`): the
    projections, the attention, the rest; ``blocks``: whether the attention is
    :func:`_attend_blocks` (its mask from :func:`_row_blocks`) rather than :func:`_attend` (with
    an additive mask)."""

    projections: Callable
    attend: Callable
    rest: Callable
    blocks: bool


SPAN_STEP = 128
"""A graphed decode step attends over the cache's columns up to the next multiple of this past
its own column (or the call's length): one capture per span a call reaches."""

_COMPILED: dict[tuple[str, str], Callable] = {}
"""The ``torch.compile``'d parts of :func:`_layer`, by device type and function name."""
_GAVE_UP: set[tuple[str, str]] = set()
"""What failed in this process, as (device type, "compile", "attention" or "graphs"): not tried
again."""


_BY_BLOCKS = False
"""Whether new graphed decode steps attend by flex attention over each row's own blocks
(:func:`attention_by_blocks`) rather than by SDPA over their span."""


@contextlib.contextmanager
def attention_by_blocks():
    """Within it, new graphed decode steps (CUDA) attend by flex attention over each row's own
    blocks of columns (:func:`_attend_blocks`) instead of by SDPA over their span (in which
    every row reads each of its columns): what flex attention gives, timed side by side
    (``bench/gpu_check.py``'s sampler part)."""
    global _BY_BLOCKS
    before, _BY_BLOCKS = _BY_BLOCKS, True
    try:
        yield
    finally:
        _BY_BLOCKS = before


def given_up(device: torch.device) -> list[str]:
    """What compiled decode steps on ``device``'s type have given up in this process (after a
    warning each): "compile" (the compiled layers), "attention" (the compiled flex attention),
    "graphs" (the CUDA graphs)."""
    return sorted(what for kind, what in _GAVE_UP if kind == device.type)


def _graphs_on(device: torch.device) -> bool:
    """Whether compiled decode steps on ``device`` are captured as CUDA graphs."""
    return device.type == "cuda"


def _compiled_parts(device: torch.device) -> _Parts | None:
    """:func:`_projections`, :func:`_attend_blocks` and :func:`_rest` through ``torch.compile``,
    each compiled once per device type (:func:`_compile_once`), or None (the eager parts) where
    compiling failed before. The attention is :func:`_attend`, eager (SDPA over the span),
    unless the step is graphed (CUDA) inside :func:`attention_by_blocks`, where it is flex
    attention (given up alone where it fails). By measurement: on an H200 the graphed step
    sampled 14,347 tokens/s through SDPA over the span against 8,651 through flex attention at
    64 rows of 4 adapters, 28,520 against 11,060 at 256 (``bench/results/gpu_check.json``; flex
    attention then compiled with the rows symbolic, so not by its decoding kernel:
    :func:`_fix_rows`); on the CPU, ``bench/lean_lora.py``'s mixed pass took 41.9 ms a position
    through flex attention against 35.6 through SDPA.

    They are compiled with dynamic shapes: every layer of a model has the same shapes, and the
    rows are the only size that changes between steps and calls (and the span, for the
    attention), so one compilation serves every layer and batch (a batch of one row apart; the
    flex attention compiles once per batch size, :func:`_fix_rows`), and
    a call with other adapters (one, or several mixed) compiles the projections and the rest
    once more. Compiled with the shapes of their first call instead, they were compiled again
    for each new batch, and the whole layer (its cache and span inside) went on to hit
    torch.compile's limit of 8 compilations within a call's first few spans, after which it ran
    eager without a word."""
    if (device.type, "compile") in _GAVE_UP:
        return None
    blocks = _graphs_on(device) and _BY_BLOCKS and (device.type, "attention") not in _GAVE_UP
    return _Parts(
        _compile_once(device, _projections, "compile"),
        _compile_once(device, _attend_blocks, "attention") if blocks else _attend,
        _compile_once(device, _rest, "compile"),
        blocks,
    )


class _PartFailed(Exception):  # noqa: N818 - carries what to give up (_fall_back)
    """A compiled part of a decode step raised (its ``__cause__``); ``what``: the name under
    which :func:`_give_up` gives it up."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _compile_once(device: torch.device, part: Callable, what: str) -> Callable:
    """``part`` through ``torch.compile`` (once per device type: :data:`_COMPILED`), called so
    that what it raises but a memory error comes out as :class:`_PartFailed` ``what``."""
    key = (device.type, part.__name__)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(part, fullgraph=True)
    return partial(_tagged, _COMPILED[key], what)


def _tagged(compiled: Callable, what: str, *args) -> torch.Tensor:
    # the flex attention compiles once per batch size (_fix_rows); the others once
    limit = compile_limit() if what == "attention" else contextlib.nullcontext()
    try:
        with limit:
            return compiled(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:
        raise _PartFailed(what) from err


def _fall_back(device: torch.device, err: Exception) -> _Parts | None:
    """A compiled decode step raised ``err`` on ``device``: where a compiled part raised it
    (:class:`_PartFailed`), that part given up (:func:`_give_up`: the flex attention alone, or
    the compiled layers) and the parts to run instead; any other error raised again. The
    finished frames of ``err``'s tracebacks, its causes' included, are cleared once it is
    given up: on torch 2.6 the compiler's failure left them in a reference cycle, through which
    the sampling call's forward and KV cache outlived the call until Python's cyclic collector
    ran (``tests/unit/test_rollout_batching.py``, ``make test-torch TORCH=2.6.0``)."""
    if not isinstance(err, _PartFailed):
        raise err
    _give_up(device, err.what, err.__cause__)
    chained, seen = err, set()
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)  # the running ones are left as they are
        chained = chained.__cause__ or chained.__context__
    return _compiled_parts(device)


GIVEN_UP = {
    "compile": "compiled layers",
    "attention": "compiled flex attention",
    "graphs": "CUDA graphs",
}
"""What each of :data:`_GAVE_UP`'s names (:func:`given_up`) is, in :func:`_give_up`'s warning
and in the GPU check's docs section."""


def _give_up(device: torch.device, what: str, err: Exception) -> None:
    """``what`` (a key of :data:`GIVEN_UP`) failed on ``device`` (not for memory): say so once,
    and do without it from now on."""
    _GAVE_UP.add((device.type, what))
    if what == "attention":
        instead = "attention over the whole span"
    else:
        instead = "eager layers" if what == "compile" and _graphs_on(device) else "the eager step"
    warnings.warn(
        f"marlow: the decode step's {GIVEN_UP[what]} failed on {device.type} "
        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); sampling with "
        f"{instead} from now on (rollout.compile=off skips the attempt)",
        RuntimeWarning,
        stacklevel=4,
    )


class _Graph:
    """The decode step of ``lean`` at its current rows and ``span`` columns (:func:`_forward`,
    its layers compiled: :func:`_compiled_parts`), run from static input buffers. Its first call
    runs the step once (which compiles what needs compiling; where that fails, the step's layers
    run eager from then on); on CUDA that run is on a side stream, and the step is then captured
    as a CUDA graph and replayed (the run wrote the step's key and value: the replay writes the
    same again); elsewhere the step runs over the same buffers (the CPU tests run this path). The
    logits it returns are its own buffer, overwritten by the next replay.

    It holds its forward by a weak reference: the forward holds it (``LeanQwen3.graph``), and a
    cycle between them would keep the call's KV cache and the graph's memory until Python's
    cyclic collector ran, past the sampling call and into the learn phase (on an H200 the learn
    phases of runs peaked 2 to 3 GiB above plan's prediction, about that size)."""

    def __init__(self, lean: LeanQwen3, rows: int, span: int, device: torch.device) -> None:
        self.lean, self.span, self.device = weakref.proxy(lean), span, device
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.columns = torch.zeros((rows, 1), dtype=torch.long, device=device)  # each row's
        self.valid = torch.zeros((rows, span), dtype=torch.bool, device=device)
        self.parts = _compiled_parts(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.ready = False

    def run(self) -> torch.Tensor:
        args = (self.ids, self.positions, self.columns, self.valid, self.span, self.parts)
        return self.lean._step(*args)

    def __call__(self, ids, mask, positions, columns: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.columns.copy_(columns)
        self.valid.copy_(mask[:, : self.span])
        if not self.ready:
            self._prepare()
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.logits

    def _prepare(self) -> None:
        cuda = self.device.type == "cuda"  # else replayed by running (_graphs_on: tests)
        here = torch.cuda.current_stream(self.device) if cuda else None
        side = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            side.wait_stream(here)
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            while True:  # compiles, and initialises what a capture may not (cuBLAS handles)
                try:
                    self.run()
                    break
                except torch.OutOfMemoryError:
                    raise
                except Exception as err:
                    self.parts = _fall_back(self.device, err)
        if cuda:
            here.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self.run()
            self.graph = graph
        self.ready = True


class LeanQwen3:
    """The forward of a Qwen3 causal LM (:meth:`supports`) for one sampling call of ``rows`` rows
    and at most ``length`` positions (prompt + new tokens), with its own KV cache.

    ``adapters``: the adapters the call samples (default: the model's active one);
    ``row_adapters``: each row's index into them (default: all the first). ``compiled``: decode
    steps at fixed shapes, replayed from CUDA graphs on CUDA and through ``torch.compile``
    elsewhere (see the module's docstring); a graphed step's logits are overwritten by the next.

    Called with the next ``q`` tokens of every row (``ids`` (b, q)), their positions
    (b, q), the attention mask of every column (b, >= at + q, or ``length`` when compiled; 1 = a
    real token) and ``at``, the column of the first of them (with ``columns`` (b,), one new token
    a row, each at its own column, ``at`` the largest); it returns the last token's logits (b, V)
    in float32. :meth:`select` keeps only some rows (cache included); :meth:`admit` prefills new
    rows' prompts into some rows' places."""

    @staticmethod
    def supports(model: torch.nn.Module, adapters: Sequence[str] | None = None) -> bool:
        """Whether :class:`LeanQwen3` computes this model's forward under ``adapters`` (default:
        the active adapter) (:func:`_parts`)."""
        return _parts(model, adapters or (active_adapter(model),), stack=False) is not None

    @classmethod
    def for_model(cls, model: torch.nn.Module, rows: int, length: int, **kw) -> LeanQwen3 | None:
        """The lean forward of ``model``, or None where it is not supported."""
        adapters = tuple(kw.pop("adapters", None) or (active_adapter(model),))
        if not cls.supports(model, adapters):
            return None
        return cls(model, rows, length, adapters=adapters, **kw)

    def __init__(
        self,
        model: torch.nn.Module,
        rows: int,
        length: int,
        *,
        adapters: Sequence[str] | None = None,
        row_adapters: Sequence[int] | torch.Tensor | None = None,
        compiled: bool = False,
    ) -> None:
        adapters = tuple(adapters or (active_adapter(model),))
        parts = _parts(model, adapters)
        if parts is None:
            raise ValueError("LeanQwen3 needs a Qwen3 model on plain weights (LeanQwen3.supports)")
        self.w, (layouts, inv_freq) = parts
        dtype, device = self.w.embed.dtype, self.w.embed.device
        self.length = length
        # the fixed shapes need CUDA graphs on CUDA, and the compiled layers elsewhere
        needs = "graphs" if _graphs_on(device) else "compile"
        self.compiled = compiled and (device.type, needs) not in _GAVE_UP
        if self.compiled:  # the layers that read one input, together
            layers = (
                {**layer, **{key: _group([layer[m] for m in ms]) for key, ms in GROUPS.items()}}
                for layer in self.w.layers
            )
            self.w = replace(self.w, layers=tuple(layers))
        # the stacked A factors fused after their base weights, written there by _claim
        self._tails = tuple(
            (group.weight[sum(group.sizes) :], group.a)
            for layer in self.w.layers
            for key in GROUPS
            if (group := layer.get(key)) is not None and group.fused
        )
        self._claim()
        # Compiled: the call's columns allocated at once (fixed shapes) and zeroed (a step reads
        # the columns not yet written too, masked with weight 0, and 0 times a NaN left in memory
        # would still be NaN). Eager: grown by doubling up to ``length`` as columns are written
        # (at most twice the columns written, so a call whose rows stop early never holds the
        # cache of ``length`` columns, and a compaction copies what was written), the new
        # columns zeroed too (a row admitted later reads, masked, columns it has not written).
        shape = (rows, 2 * self.w.kv_heads, length if self.compiled else 0, self.w.head_dim)
        self.cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.w.layers]
        if row_adapters is None:
            row_adapters = torch.zeros(rows, dtype=torch.long)
        self.row_adapters = torch.as_tensor(row_adapters, dtype=torch.long).to(device)
        self.layouts = layouts
        self.lora = [self._rows_of(layout, self.row_adapters) for layout in layouts]
        # Whether some column is padding (transformers then passes a mask): fixed until rows
        # leave or are admitted, since until then the rows still sampling write every column
        # after their prompts (a row that stopped may stay where it stopped: only its own
        # attention reads past it); read from the device only then.
        self.padded: bool | None = None
        angles = torch.arange(length, device=device).float()[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)  # (length, head_dim)
        # the tables marlow.models.rotate takes (as the trainer's fused rotary: the same values)
        self.rope = (angles.cos().to(dtype), signed_sin(angles.sin().to(dtype)))
        self.graph: _Graph | None = None  # the graphed step at the current rows and span

    @staticmethod
    def _rows_of(layout: _Layout, row_adapters: torch.Tensor) -> tuple:
        """(mask, scaling) of :func:`_linear` for rows of ``row_adapters`` (each row's index
        into the call's adapters) under ``layout``: no mask and the one scaling when the call
        has one adapter, else per row."""
        if len(layout.ranks) == 1:
            return None, layout.scalings[0]
        owner = torch.cat(
            [torch.full((r,), i, dtype=torch.long) for i, r in enumerate(layout.ranks)]
        ).to(row_adapters.device)  # (rank sum,): the adapter of each stacked column
        mask = (row_adapters[:, None] == owner[None, :]).to(layout.dtype)[:, None, :]
        # in float32 at least: a bfloat16 scaling such as 1/3 would be off by a fixed 0.2%
        wide = torch.promote_types(layout.dtype, torch.float32)
        scaling = torch.tensor(layout.scalings, dtype=wide, device=mask.device)
        return mask, scaling[row_adapters][:, None, None]

    def _claim(self) -> None:
        """Write this call's LoRA A factors into the packed weights' spare rows after the base's
        (:func:`_packed`), unless this call wrote them last: another call over the same model
        (other adapters, or factors trained since) writes its own there. A captured CUDA graph
        reads them where they are, so a replay after another call's computes this call's."""
        if not self._tails:
            return
        first = self._tails[0][0]
        key = (first.device, first.data_ptr())
        last = _WROTE.get(key)
        if last is not None and last() is self:
            return
        with torch.no_grad():
            for tail, a in self._tails:
                tail.copy_(a)
        _WROTE[key] = weakref.ref(self)

    def admit(
        self,
        slots: torch.Tensor,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        row_adapters: Sequence[int] | torch.Tensor,
        expand: torch.Tensor,
    ) -> torch.Tensor:
        """Prefill new prompts and put them in the working rows ``slots`` (s,), in place of
        whatever those rows held; the slots' last-token logits (s, V) in float32.

        ``ids``, ``mask`` and ``positions`` (k, q): k distinct prompts left-padded to q columns
        (as :meth:`__call__` takes a prompt), ``row_adapters`` (k,) each one's adapter index;
        ``expand`` (s,): the prompt each slot takes (rows of a GRPO group share one prefill).
        The prompts are forwarded eagerly over a cache of their own, whose q columns are then
        copied into the slots' columns 0..q-1: a slot's next token goes at column q, whatever
        column the other rows are at (they write at their own: :meth:`__call__`'s
        ``columns``). The call's weights and stacked factors are reused, not stacked again."""
        k, q = ids.shape
        self._claim()
        if q > self.length:
            raise ValueError(f"a prompt of {q} columns past the {self.length} of this call")
        own = torch.as_tensor(row_adapters, dtype=torch.long).to(self.row_adapters.device)
        shape = (k, 2 * self.w.kv_heads, q, self.w.head_dim)
        cache = [self.cache[0].new_empty(shape) for _ in self.w.layers]
        lora = [self._rows_of(layout, own) for layout in self.layouts]
        valid = mask.bool()
        columns = torch.arange(q, device=ids.device)
        every = bool(valid.all())  # transformers' choice: no mask where nothing is padding
        logits = _forward(
            self.w, cache, lora, self.rope, ids, positions, columns,
            None if every else valid, q,
        )  # fmt: skip
        self._reserve(q)
        for layer, fresh in zip(self.cache, cache, strict=True):
            layer[slots, :, :q] = fresh[expand]
        self.row_adapters[slots] = own[expand]
        for (mask_now, scaling_now), layout in zip(self.lora, self.layouts, strict=True):
            if mask_now is not None:  # in place: a captured CUDA graph reads these tensors
                mask_new, scaling_new = self._rows_of(layout, self.row_adapters)
                mask_now.copy_(mask_new)
                scaling_now.copy_(scaling_new)
        self.padded = None
        return logits[expand]

    def select(self, keep: torch.Tensor) -> None:
        self.cache = [layer[keep] for layer in self.cache]
        self.row_adapters = self.row_adapters[keep]
        self.lora = [
            (None if m is None else m[keep], s[keep] if isinstance(s, torch.Tensor) else s)
            for m, s in self.lora
        ]
        self.padded = None  # the rows left may all be unpadded
        self.graph = None  # its cache and masks were the rows' before

    def _reserve(self, end: int) -> None:
        """Room for columns up to ``end`` in every layer's buffers (eager: grown by doubling)."""
        capacity = self.cache[0].shape[2]
        if end <= capacity:
            return
        grown = min(self.length, max(end, 2 * capacity))
        for i, old in enumerate(self.cache):
            new = old.new_zeros((*old.shape[:2], grown, old.shape[3]))
            new[:, :, :capacity] = old
            self.cache[i] = new

    def __call__(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        at: int,
        columns: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, q = ids.shape
        self._claim()
        if q > 1 and (at != 0 or columns is not None):
            raise ValueError("several tokens at once only from column 0 (the prompt)")
        end = at + q
        if end > self.length:
            raise ValueError(f"column {end} past the {self.length} this call was made for")
        device = ids.device
        if q == 1 and self.compiled:  # fixed shapes: unwritten columns masked
            if columns is None:
                columns = torch.full((b,), at, dtype=torch.long, device=device)
            try:
                logits = self._compiled(ids, mask, positions, at, columns[:, None])
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # the compiler's or a graph's: the eager step computes it
                _give_up(device, "graphs" if _graphs_on(device) else "compile", err)
                logits = None
            if logits is not None:
                return logits
            self.compiled, self.graph = False, None
        self._reserve(end)
        valid = mask[:, :end].bool()  # (b, end)
        if self.padded is None:
            self.padded = not bool(valid.all())
        # transformers' choice of attention call: no mask where no column is padding
        columns = torch.arange(at, end, device=device) if columns is None else columns[:, None]
        return self._step(ids, positions, columns, valid if self.padded else None, end)

    def _compiled(self, ids, mask, positions, at: int, columns) -> torch.Tensor | None:
        """One decode step at fixed shapes, each row writing at its column of ``columns`` (b, 1)
        (the largest is ``at``): the graphed step of its span (CUDA: the whole cache where the
        attention is flex attention, which reads each row's own blocks), or the
        ``torch.compile``'d one over every column (None where compiling has been given up: the
        eager step computes it)."""
        device = ids.device
        if not _graphs_on(device):
            valid = mask[:, : self.length].bool()
            parts = _compiled_parts(device)
            while parts is not None:
                try:
                    return self._step(ids, positions, columns, valid, self.length, parts)
                except torch.OutOfMemoryError:
                    raise
                except Exception as err:
                    parts = _fall_back(device, err)
            return None  # compiling given up: the eager step
        # the parts the current graph runs (they change only by a fallback), else the next's
        parts = self.graph.parts if self.graph is not None else _compiled_parts(device)
        if parts is not None and parts.blocks:
            # each row reads only its own blocks of columns: the span is the whole cache, so
            # the call's rows take one graph (and the compiled attention one shape) for good
            span = self.length
        else:
            span = min(self.length, (at // SPAN_STEP + 1) * SPAN_STEP)
        if self.graph is not None and span < self.graph.span < 2 * span:
            # rows admitted in stopped rows' places can lower the largest column: the step
            # keeps its span (more columns masked) until it would halve, so that admissions
            # near a span's edge do not capture a graph down and up again
            span = self.graph.span
        if self.graph is None or self.graph.span != span:
            self.graph = None  # its memory goes before the next one's is taken
            self.graph = _Graph(self, ids.shape[0], span, device)
        return self.graph(ids, mask, positions, columns)

    def _step(self, ids, positions, columns, valid, span, parts=None) -> torch.Tensor:
        """:func:`_forward` over this call's weights and cache, its layers' parts ``parts``
        (None: eager)."""
        return _forward(
            self.w,
            self.cache,
            self.lora,
            self.rope,
            ids,
            positions,
            columns,
            valid,
            span,
            parts,
        )
