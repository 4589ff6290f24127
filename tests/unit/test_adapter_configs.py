"""Saved adapter configs are portable: the base named as the caller says, and
``target_modules`` as short names exactly when they pick the same modules."""

from __future__ import annotations

import json

import pytest
from peft import PeftModel

from marlow.policy.adapters import LoraSpec, attach_adapters, save_adapters

SPEC = LoraSpec(rank=4, alpha=8)


def lora_modules(model) -> list[str]:
    return sorted(n for n, _ in model.named_modules() if n.endswith("lora_A"))


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_all_linear_is_saved_as_short_names_that_load_the_same_modules(make_model, tmp_path):
    model = attach_adapters(make_model(seed=0), ["gen", "agg"], SPEC, seed=0)
    save_adapters(model, tmp_path, ["agg"], base_name="base")
    config = json.loads((tmp_path / "agg" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "base"
    assert config["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    reloaded = PeftModel.from_pretrained(make_model(seed=0), tmp_path / "agg")
    assert lora_modules(reloaded) == lora_modules(model)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_a_path_that_short_names_would_widen_stays_a_path(make_model, tmp_path):
    """LoRA on layer 0's q_proj only: "q_proj" would pick layer 1's too, so the path is kept."""
    spec = LoraSpec(rank=4, alpha=8, target_modules=["model.layers.0.self_attn.q_proj"])
    model = attach_adapters(make_model(seed=0), ["gen"], spec, seed=0)
    save_adapters(model, tmp_path, ["gen"])
    config = json.loads((tmp_path / "gen" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.0.self_attn.q_proj"]
    reloaded = PeftModel.from_pretrained(make_model(seed=0), tmp_path / "gen")
    assert lora_modules(reloaded) == lora_modules(model)
    assert len(lora_modules(model)) == 1


def test_without_a_base_name_peft_s_own_stays(make_model, tmp_path):
    model = attach_adapters(make_model(seed=0), ["gen"], SPEC, seed=0)
    save_adapters(model, tmp_path, ["gen"])
    config = json.loads((tmp_path / "gen" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] is None  # a model built from a config has no path
