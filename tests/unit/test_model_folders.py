"""A local model folder in Hugging Face's format (a shrunk random Qwen3, the real tokenizer
format) that marlow cannot train with is refused in one line before its weights load."""

from __future__ import annotations

import pytest
import torch

from marlow.archs.stand_in import save_stand_in
from marlow.config import resolve
from marlow.models import ModelLoadError, load_base

SHRINK = {
    "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
}  # fmt: skip


@pytest.fixture
def folder(tmp_path):
    return save_stand_in("qwen3-0.6b", tmp_path / "m", dtype=torch.float32, overrides=SHRINK)


def config(folder):
    return resolve({"preset": "paper", "model": {"name": str(folder)}}).model


def test_a_chat_model_folder_loads_frozen(folder):
    model, tokenizer = load_base(config(folder))
    assert tokenizer.chat_template and not any(p.requires_grad for p in model.parameters())


def test_a_tokenizer_without_a_chat_template_is_refused_before_the_weights_load(folder):
    (folder / "chat_template.jinja").unlink()  # a base model's folder: no template
    (folder / "model.safetensors").unlink()  # never read: the template is checked first
    with pytest.raises(ModelLoadError) as err:
        load_base(config(folder))
    message = str(err.value)
    assert "its tokenizer has no chat template" in message and "chat_template.jinja" in message
    assert "\n" not in message and str(folder) in message
