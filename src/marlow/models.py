"""Loading the frozen base model and its tokenizer: a tiny scale or a Hugging Face id/path.

A tiny scale name (``tiny-s``, ``tiny-m``, ``tiny-l``) is pre-trained on first use and cached
(``marlow.tiny.pretrain``), one model per task (the math and the code world each have their own
corpus). Anything else goes to ``from_pretrained``; when that fails offline the
error says so in one line instead of a deep traceback.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from marlow.config import ModelConfig


class ModelLoadError(RuntimeError):
    pass


def is_tiny(name: str) -> bool:
    from marlow.tiny.model import SCALES

    return name in SCALES


def prompt_style(name: str) -> str:
    """Tiny models read the terse ``tiny`` prompts; real chat models the ``chat`` ones."""
    return "tiny" if is_tiny(name) else "chat"


def load_base(config: ModelConfig, log: Callable[[str], None] | None = None, task: str = "math"):
    """(model, tokenizer) with every base weight frozen. ``task`` picks the tiny world's
    pre-training corpus (ignored for a Hugging Face model)."""
    if is_tiny(config.name):
        from marlow.tiny.pretrain import load_tiny, pretrain_tiny

        path = pretrain_tiny(config.name, steps=config.pretrain_steps, log=log, task=task)
        model, tokenizer = load_tiny(path)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        try:
            tokenizer = AutoTokenizer.from_pretrained(config.name, padding_side="left")
            model = AutoModelForCausalLM.from_pretrained(config.name, dtype=dtype)
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelLoadError(
                f"model.name {config.name!r} cannot be loaded (offline, or not a causal LM): "
                f"{first}. Use a local path, a cached hub id, or a tiny scale: tiny-s, tiny-m, tiny-l"
            ) from None
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()  # dropout off in the base; LoRA dropout is set by the adapter config
    return model, tokenizer
