"""A lean forward for sampling from Qwen3 bases on plain weights.

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
- no adapter is active: the base itself, or an adapter folded into it by
  :func:`marlow.policy.adapters.merged` (each LoRA layer then returns its base layer's output).

It follows transformers' operations in the same order with the same kernels (RMSNorm in float32,
rotary angles as ``position * inv_freq``, scaled-dot-product attention: causal with the padding
mask over the prompt, the query heads grouped onto their key/value head for one new token, the
SDPA call transformers makes) and its logits equal transformers' bit for bit, in float32 and
bf16, padded or not, after rows leave the batch (``tests/unit/test_rollout_lean.py``, torch 2.13,
transformers 5.24). Should a later transformers change its order, the two would differ by float
round-off, like merged and unmerged adapters, and that test says so.

The KV cache is one buffer per layer of (rows, kv heads, columns, head dim), grown by doubling as
the call goes (at most twice the columns written); the rotary angles are one table for every
position of the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM

from marlow.policy.adapters import active_adapter
from marlow.types import BASE

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


def _plain(module: torch.nn.Module) -> torch.nn.Module:
    """The layer a (possibly LoRA-wrapped) layer wraps; with the adapters disabled, its output."""
    return getattr(module, "base_layer", module)


def _parts(model: torch.nn.Module) -> dict | None:
    """The modules the lean forward reads, or None where it would not compute the model's
    forward: not a transformers Qwen3 causal LM, a RoPE other than the default, sliding-window
    layers, an adapter active (unmerged LoRA), or a layer that is not a plain linear / embedding
    (a quantised or replaced one)."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(causal_lm, Qwen3ForCausalLM) or active_adapter(model) != BASE:
        return None
    cfg = causal_lm.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or cfg.hidden_act != "silu":
        return None
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return None
    body = causal_lm.model
    layers = [
        {
            "ln1": layer.input_layernorm,
            "q": _plain(layer.self_attn.q_proj),
            "k": _plain(layer.self_attn.k_proj),
            "v": _plain(layer.self_attn.v_proj),
            "qn": layer.self_attn.q_norm,
            "kn": layer.self_attn.k_norm,
            "o": _plain(layer.self_attn.o_proj),
            "ln2": layer.post_attention_layernorm,
            "gate": _plain(layer.mlp.gate_proj),
            "up": _plain(layer.mlp.up_proj),
            "down": _plain(layer.mlp.down_proj),
        }
        for layer in body.layers
    ]
    head = _plain(causal_lm.get_output_embeddings())
    linears = [head, *(m for parts in layers for k, m in parts.items() if k in LINEARS)]
    if type(_plain(body.embed_tokens)) is not torch.nn.Embedding or any(
        type(m) is not torch.nn.Linear for m in linears
    ):
        return None
    return {
        "embed": _plain(body.embed_tokens),
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


def _linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


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
        return _linear(_rms(x[:, -1], self.norm), self.head).float()

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
