"""A lean forward for sampling from Qwen3 bases, on plain weights or under a LoRA adapter.

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
- the base itself; an adapter folded into it by :func:`marlow.policy.adapters.merged` (each
  LoRA layer then returns its base layer's output); or one active adapter that is plain LoRA on
  linear layers (no DoRA, no LoRA bias, none on the embedding), whose update it adds as PEFT
  does: the input cast to the factors' dtype, ``B(A(x)) * scaling`` added, the sum cast back.
  That last case is what a GPU samples (``rollout.merge_lora`` is off there): with LoRA rank 64
  on every linear of a 28-layer Qwen3 of width 64 (bf16, 16 rows), whose forward is all Python
  and kernel launches as a real model's is on a GPU, a sampled position took 13.7 instead of
  20.4 ms through PEFT's modules (``bench/lean_lora.py``, one thread of this 2-core EPYC).

It follows transformers' operations in the same order with the same kernels (RMSNorm in float32,
rotary angles as ``position * inv_freq``, scaled-dot-product attention: causal with the padding
mask over the prompt, the query heads grouped onto their key/value head for one new token, the
SDPA call transformers makes, the head on the last position kept as a (rows, 1, width) batch)
and its logits equal transformers' (and PEFT's) bit for bit, in float32 and bf16, padded or not,
after rows leave the batch (``tests/unit/test_rollout_lean.py``, torch 2.13,
transformers 5.24). Should a later transformers change its order, the two would differ by float
round-off, like merged and unmerged adapters, and that test says so.

The KV cache is one buffer per layer of (rows, kv heads, columns, head dim), grown by doubling as
the call goes (at most twice the columns written); the rotary angles are one table for every
position of the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM

from marlow.policy.adapters import active_adapter
from marlow.types import BASE


def _plain(module: torch.nn.Module) -> torch.nn.Module:
    """The layer a (possibly LoRA-wrapped) layer wraps; with the adapters disabled, its output."""
    return getattr(module, "base_layer", module)


@dataclass(frozen=True)
class _Linear:
    """A linear layer as the lean forward computes it: the base layer, and the active adapter's
    LoRA factors and scaling where it has them (``a`` None: the base alone)."""

    base: torch.nn.Linear
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    scaling: float = 1.0


class _Unsupported(Exception):  # noqa: N818 - a layer the lean forward does not compute
    pass


def _lora(module: torch.nn.Module, adapter: str) -> _Linear:
    """``module`` as :class:`_Linear` under ``adapter`` (BASE: its base layer): a plain LoRA
    linear (no DoRA, no LoRA bias, no transposed weight, no variant, not merged) gives its
    factors; a LoRA layer of another kind raises :class:`_Unsupported`."""
    base = _plain(module)
    if type(base) is not torch.nn.Linear:
        raise _Unsupported
    lora_a = getattr(module, "lora_A", None)
    if adapter == BASE or lora_a is None or adapter not in lora_a:
        return _Linear(base)
    if (
        getattr(module, "merged", False)
        or module.use_dora.get(adapter, False)
        or getattr(module, "lora_bias", {}).get(adapter, False)
        or getattr(module, "fan_in_fan_out", False)
        or adapter in getattr(module, "lora_variant", {})
        or not getattr(module, "cast_input_dtype_enabled", True)
    ):
        raise _Unsupported
    a, b = module.lora_A[adapter], module.lora_B[adapter]
    if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear or b.bias is not None:
        raise _Unsupported
    return _Linear(base, a.weight, b.weight, module.scaling[adapter])


def _parts(model: torch.nn.Module) -> dict | None:
    """The modules the lean forward reads, or None where it would not compute the model's
    forward: not a transformers Qwen3 causal LM, a RoPE other than the default, sliding-window
    layers, a layer that is not a plain linear / embedding (a quantised or replaced one), an
    adapter on the embedding, or an active adapter that is not plain LoRA on linear layers
    (DoRA, a LoRA bias, several adapters at once)."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(causal_lm, Qwen3ForCausalLM):
        return None
    adapter = active_adapter(model)
    if "," in adapter:  # several adapters active at once
        return None
    cfg = causal_lm.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or cfg.hidden_act != "silu":
        return None
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return None
    body = causal_lm.model
    embed = body.embed_tokens
    if type(_plain(embed)) is not torch.nn.Embedding or (
        adapter != BASE and adapter in getattr(embed, "lora_embedding_A", {})
    ):
        return None
    try:
        layers = [
            {
                "ln1": layer.input_layernorm,
                "q": _lora(layer.self_attn.q_proj, adapter),
                "k": _lora(layer.self_attn.k_proj, adapter),
                "v": _lora(layer.self_attn.v_proj, adapter),
                "qn": layer.self_attn.q_norm,
                "kn": layer.self_attn.k_norm,
                "o": _lora(layer.self_attn.o_proj, adapter),
                "ln2": layer.post_attention_layernorm,
                "gate": _lora(layer.mlp.gate_proj, adapter),
                "up": _lora(layer.mlp.up_proj, adapter),
                "down": _lora(layer.mlp.down_proj, adapter),
            }
            for layer in body.layers
        ]
        head = _lora(causal_lm.get_output_embeddings(), adapter)
    except _Unsupported:
        return None
    return {
        "embed": _plain(embed),
        "norm": body.norm,
        "head": head,
        "layers": layers,
        "inv_freq": body.rotary_emb.inv_freq,
    }


def _rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """Qwen3's RMSNorm: in float32, scaled in the input's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _linear(x: torch.Tensor, layer: _Linear) -> torch.Tensor:
    """The base layer's output, plus the LoRA update as PEFT computes it: the input cast to the
    factors' dtype, ``B(A(x)) * scaling`` added, the sum cast back to the base output's dtype."""
    out = F.linear(x, layer.base.weight, layer.base.bias)
    if layer.a is None:
        return out
    update = F.linear(F.linear(x.to(layer.a.dtype), layer.a), layer.b) * layer.scaling
    return (out + update).to(out.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanQwen3:
    """The forward of a Qwen3 causal LM (:meth:`supports`) for one sampling call of ``rows`` rows
    and at most ``length`` positions (prompt + new tokens), with its own KV cache.

    Called with the next ``q`` tokens of every row (``ids`` (b, q)), their positions
    (b, q), the attention mask of every column so far (b, >= at + q; 1 = a real token) and ``at``,
    the column of the first of them; it returns the last token's logits (b, V) in float32.
    :meth:`select` keeps only some rows (cache included)."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether :class:`LeanQwen3` computes this model's forward as it stands, its active
        adapter included (:func:`_parts`)."""
        return _parts(model) is not None

    @classmethod
    def for_model(cls, model: torch.nn.Module, rows: int, length: int) -> LeanQwen3 | None:
        """The lean forward of ``model`` as it stands, or None where it is not supported."""
        parts = _parts(model)
        return None if parts is None else cls(model, rows, length, parts)

    def __init__(
        self, model: torch.nn.Module, rows: int, length: int, parts: dict | None = None
    ) -> None:
        parts = parts or _parts(model)
        if parts is None:
            raise ValueError("LeanQwen3 needs a Qwen3 model on plain weights (LeanQwen3.supports)")
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.embed, self.norm, self.head = parts["embed"], parts["norm"], parts["head"]
        self.layers = parts["layers"]
        dtype, device = self.embed.weight.dtype, self.embed.weight.device
        self.length = length
        # The KV cache: one buffer per layer, (rows, kv heads, capacity, head dim), grown by
        # doubling up to ``length`` as columns are written, so a call whose rows stop early never
        # holds the cache of ``length`` columns. Every column a forward reads was written by it or
        # an earlier one: the buffers need no zeroing.
        shape = (rows, self.kv_heads, 0, self.head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        # Whether some prompt column is padding (transformers then passes a mask): fixed until
        # rows leave, since every column after the prompt is real; read from the device only then.
        self.padded: bool | None = None
        angles = torch.arange(length, device=device).float()[:, None] * parts["inv_freq"]
        angles = torch.cat((angles, angles), dim=-1)  # (length, head_dim)
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def select(self, keep: torch.Tensor) -> None:
        self.keys = [k[keep] for k in self.keys]
        self.values = [v[keep] for v in self.values]
        self.padded = None  # the rows left may all be unpadded

    def _reserve(self, end: int) -> None:
        """Room for columns up to ``end`` in every layer's buffers."""
        capacity = self.keys[0].shape[2]
        if end <= capacity:
            return
        if end > self.length:
            raise ValueError(f"column {end} past the {self.length} this call was made for")
        grown = min(self.length, max(end, 2 * capacity))
        for cache in (self.keys, self.values):
            for i, old in enumerate(cache):
                new = old.new_empty((*old.shape[:2], grown, old.shape[3]))
                new[:, :, :capacity] = old
                cache[i] = new

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, at: int
    ) -> torch.Tensor:
        b, q = ids.shape
        if q > 1 and at != 0:
            raise ValueError("several tokens at once only from column 0 (the prompt)")
        end = at + q
        self._reserve(end)
        valid = mask[:, :end].bool()  # (b, end)
        if self.padded is None:
            self.padded = not bool(valid.all())
        # transformers' choice of attention call: no mask where no column is padding
        valid = valid if self.padded else None
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (b, 1, q, hd)
        hd = self.head_dim
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            h = _rms(x, layer["ln1"])
            query = _rms(_linear(h, layer["q"]).view(b, q, -1, hd), layer["qn"]).transpose(1, 2)
            key = _rms(_linear(h, layer["k"]).view(b, q, -1, hd), layer["kn"]).transpose(1, 2)
            value = _linear(h, layer["v"]).view(b, q, -1, hd).transpose(1, 2)
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
            self.keys[i][:, :, at:end] = key
            self.values[i][:, :, at:end] = value
            out = self._attend(query, self.keys[i][:, :, :end], self.values[i][:, :, :end], valid)
            x = x + _linear(out.transpose(1, 2).reshape(b, q, -1), layer["o"])
            h = _rms(x, layer["ln2"])
            x = x + _linear(
                F.silu(_linear(h, layer["gate"])) * _linear(h, layer["up"]), layer["down"]
            )
        # as transformers: the norm over every position, then the head on the last one kept
        # (b, 1, hidden): the same kernels, so the same bits
        return _linear(_rms(x, self.norm)[:, -1:], self.head)[:, -1].float()

    def _attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of ``query`` (b, heads, q, hd) over the columns so far (b, kv heads, end, hd),
        causal, masking the columns ``valid`` (b, end) marks False (None: every column is real)."""
        b, _, q, hd = query.shape
        group, scale = self.heads // self.kv_heads, hd**-0.5
        if valid is None:
            return F.scaled_dot_product_attention(
                query, keys, values, is_causal=q > 1, scale=scale, enable_gqa=group > 1
            )
        if q == 1:  # each key/value head with its group of query heads, one mask for all
            grouped = query.reshape(b, self.kv_heads, group, hd)
            out = F.scaled_dot_product_attention(
                grouped, keys, values, attn_mask=valid[:, None, None, :], scale=scale
            )
            return out.reshape(b, self.heads, 1, hd)
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
