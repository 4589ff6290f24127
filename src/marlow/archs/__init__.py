"""The paper's models as architectures only: the published ``config.json`` of Qwen3-0.6B, 1.7B and
4B (no weights), so ``marlow plan`` can size them without the Hugging Face hub.

Each ``<name>.json`` here holds the values of ``huggingface.co/Qwen/<Model>/raw/main/config.json``
(transformers 4.51.0 field names, as published). The hub cannot be reached from where these were
written, so each was taken from copies that agree with one another field by field:

* ``qwen3-0.6b.json``: the copy at huggingface.co/TensorStack/TextEncoder/blob/main/Qwen-3-06B/
  config.json (726 bytes, the published file's size; ours adds a final newline), and the same
  text quoted as "Constants for Qwen/Qwen3-0.6B (https://huggingface.co/Qwen/Qwen3-0.6B/raw/main/
  config.json)" in a public Rust kernel project.
* ``qwen3-4b.json``: the ``QWEN3_4B_CONFIG_JSON`` text inlined in kohya-ss/musubi-tuner
  ``src/musubi_tuner/zimage/zimage_utils.py`` (Z-Image's Qwen3-4B text encoder), line for line,
  and huggingface.co/MultiRL/qwen3_4b_instruct_sft/blob/main/config.json (a fine-tune that keeps
  the base's values).
* ``qwen3-1.7b.json``: no verbatim copy was found, so it is the 0.6B file (whose family-wide
  fields, e.g. rope_theta 1e6, rms_norm_eps 1e-6, 40960 positions, token ids, are the same in the
  0.6B and 4B files) with the 1.7B shape fields from the KerasHub conversion's card
  (huggingface.co/keras/qwen3_1.7b_en: 28 layers, 16 query / 8 key-value heads, hidden 2048,
  head_dim 128, intermediate 6144, vocabulary 151936, tied embeddings, RoPE 1e6, eps 1e-6) and a
  planner's "Qwen/Qwen3-1.7B (config.json, fields the planner reads)" table (same values, plus
  max_position_embeddings 40960); max_window_layers equals the layer count as in the 0.6B and 4B
  files.

Published sizes (the Qwen3 model cards, "Number of Parameters" / "(Non-Embedding)"): 0.6B / 0.44B,
1.7B / 1.4B, 4.0B / 3.6B; ``tests/unit/test_plan.py`` checks the counts of these files against
them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marlow.config import ConfigError

ARCH_DIR = Path(__file__).parent
HUB_IDS = {
    "Qwen/Qwen3-0.6B": "qwen3-0.6b",
    "Qwen/Qwen3-1.7B": "qwen3-1.7b",
    "Qwen/Qwen3-4B": "qwen3-4b",
}
"""The hub id each shipped architecture was published under."""


def arch_names() -> list[str]:
    """The shipped architectures, e.g. ``qwen3-0.6b``."""
    return list(HUB_IDS.values())


def shipped_arch(name: str) -> str | None:
    """The shipped architecture ``name`` refers to (its own name or its hub id, any case), or
    None."""
    key = name.strip().lower()
    for hub_id, arch in HUB_IDS.items():
        if key in (hub_id.lower(), arch):
            return arch
    return None


def arch_config(arch: str) -> dict[str, Any]:
    """The published ``config.json`` values of a shipped architecture."""
    if arch not in arch_names():
        raise ValueError(f"no shipped architecture {arch!r}; valid: {', '.join(arch_names())}")
    return json.loads((ARCH_DIR / f"{arch}.json").read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder architecture that marlow's cost and memory formulas read
    (``marlow.plan``'s memory model, :mod:`marlow.shared_prompts`' cost rule; letters as in
    ``marlow.plan``'s docstring)."""

    h: int  # hidden size
    a: int  # query heads
    g: int  # key-value heads
    d: int  # head size
    I: int  # noqa: E741  (the MLP width; the formulas' letter)
    L: int  # decoder layers
    V: int  # vocabulary

    @classmethod
    def of(cls, config: Any) -> Shape:
        """The numbers of a decoder config in Qwen3/Llama field names (``head_dim`` defaults to
        hidden / heads, key-value heads to the query heads) of a transformers config;
        ConfigError when one is missing."""
        needed = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
        missing = [f for f in (*needed, "vocab_size") if not getattr(config, f, None)]
        if missing:
            raise ConfigError(
                f"config field 'model.name': its config.json ({config.model_type}) has no "
                f"{', '.join(missing)}; plan's formulas read decoder configs with "
                f"{', '.join(needed)} and vocab_size, as Qwen3 and Llama have"
            )
        heads = config.num_attention_heads
        return cls(
            config.hidden_size,
            heads,
            getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads,
            config.intermediate_size,
            config.num_hidden_layers,
            config.vocab_size,
        )
