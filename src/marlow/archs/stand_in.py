"""A stand-in for a shipped architecture: its published shape with random weights, and a tokenizer
in the Qwen3 chat format built locally, saved as an ordinary Hugging Face folder that
``model.name`` can point at. It runs every real-scale code path (a 151,936-token vocabulary, 28+
layers, bfloat16) without the hub; what it generates is noise.

The tokenizer, and where it departs from Qwen3's:

* **Every id the model can sample decodes**: it has exactly ``vocab_size`` ids. Qwen3's own
  tokenizer has 151,669 (ids 151,669-151,935 are padding rows of the embedding with no token);
  here ids 0-255 are the 256 bytes (byte-level, as Qwen3's BPE: any text encodes, one token per
  byte, since there are no merges), the special tokens sit at Qwen3's ids (``<|endoftext|>``
  151643 = pad, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645 = eos, ``<think>`` 151667,
  ``</think>`` 151668), and every other id is a filler token of two or three letters or spaces
  (unreachable by encoding, decodable, so sampled noise reads as letter soup).
* **Chat template**: Qwen3's format for what marlow sends (one user message, a generation
  prompt): ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
  ``<|im_start|>assistant\\n``, and with ``enable_thinking=False`` the empty thinking block
  ``<think>\\n\\n</think>\\n\\n`` that Qwen3's template appends. System prompts, tools and
  earlier reasoning content are not handled (marlow sends none). Written for marlow, not copied.
"""

from __future__ import annotations

import itertools
import string
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from marlow.archs import arch_config
from marlow.tiny.pretrain import quiet_hf

PAD, IM_START, IM_END, THINK, END_THINK = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
)
SPECIAL_IDS = {PAD: 151643, IM_START: 151644, IM_END: 151645, THINK: 151667, END_THINK: 151668}
"""Qwen3's ids of the special tokens the chat format uses."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of exactly ``vocab_size`` ids in the Qwen3 chat format (module
    docstring)."""
    if vocab_size <= max(SPECIAL_IDS.values()):
        raise ValueError(f"vocab_size must exceed {max(SPECIAL_IDS.values())}, got {vocab_size}")
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update(SPECIAL_IDS)
    taken = set(SPECIAL_IDS.values())
    symbols = "\u0120" + string.ascii_letters  # byte-level space, then the letters
    fillers = ("".join(chars) for n in (2, 3) for chars in itertools.product(symbols, repeat=n))
    for i in range(256, vocab_size):
        if i not in taken:
            vocab[next(fillers)] = i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_IDS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,
        padding_side="left",  # given here, or transformers 5 loses it on save/load
        chat_template=CHAT_TEMPLATE,
    )


def save_stand_in(
    arch: str,
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> Path:
    """Write ``arch`` (a shipped architecture) with random weights in ``dtype`` and the tokenizer
    above to ``folder`` (``config.json``, ``model.safetensors``, tokenizer files); returns it.
    ``overrides`` replace fields of the architecture's config (a shrunken stand-in for a quick
    run: fewer layers, a narrower width; the vocabulary must keep Qwen3's special ids).
    ``device``: where the random weights are drawn (a GPU draws a 4B's in a second, where a CPU
    takes minutes); the same seed draws other weights on another device."""
    folder = Path(folder)
    config = Qwen3Config(**{**arch_config(arch), **(overrides or {})})
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype)
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = (
        SPECIAL_IDS[IM_END],
        SPECIAL_IDS[PAD],
        None,
    )
    with quiet_hf():
        model.save_pretrained(folder)
    build_tokenizer(config.vocab_size).save_pretrained(folder)
    return folder
