"""Local model folders in Hugging Face's format (a shrunk random Qwen3, the real tokenizer
format) as other models ship them: one without a chat template (a base model) is refused in one
line before its weights load; one without a pad token (as Llama 3's) trains."""

from __future__ import annotations

import json

import pytest
import torch

from marlow.api import make_config, train
from marlow.archs.stand_in import save_stand_in
from marlow.config import resolve
from marlow.models import ModelLoadError, load_base, pad_id

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


def test_a_tokenizer_without_a_pad_token_trains_padding_with_its_eos(folder, tmp_path):
    settings = folder / "tokenizer_config.json"
    kept = {k: v for k, v in json.loads(settings.read_text()).items() if k != "pad_token"}
    settings.write_text(json.dumps(kept))
    _, tokenizer = load_base(config(folder))
    assert tokenizer.pad_token_id is None and pad_id(tokenizer) == tokenizer.eos_token_id
    rows = [{"id": f"r{i}", "question": f"{i}+{i}", "answer": str(2 * i)} for i in range(6)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = tmp_path / "reward.py"
    reward.write_text("def varied(prompts, completions, **kw):\n"
                      "    return [float(len(c) % 2) for c in completions]\n")  # fmt: skip
    cfg = make_config(
        preset="paper", steps=1, val_every=1, ckpt_every=1, dtype="float32", device="cpu",
        model={"name": str(folder)},
        task={"source": str(data), "prompt_field": "question", "answer_field": "answer",
              "reward": f"{reward}:varied", "val_size": 2, "family": "general"},
        workflow={"name": "single"},
        grpo={"batch_problems": 2, "group_size": 2},
        rollout={"max_new_tokens": 6},
        diagnostics={"signature_problems": 2},
    )  # fmt: skip
    run = train(cfg, out=tmp_path / "run")
    assert (run.path / "checkpoints" / "step_000001" / "DONE").is_file()
    assert run.metrics.series("step")[-1] == (1, 1.0)  # step 1 learned and was recorded
