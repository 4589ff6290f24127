"""The real-scale smoke, slow: two Voting-IP steps on the CPU with the Qwen3-0.6B
architecture (random bfloat16 weights, a local tokenizer in the Qwen3 chat format: see
:mod:`marlow.archs.stand_in`), settings in ``configs/qwen3-0.6b-smoke.yaml``. Its cost is
measured in ``bench/qwen3_smoke.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from marlow.archs.stand_in import IM_END, SPECIAL_IDS, build_tokenizer, save_stand_in
from marlow.config import load_config
from marlow.plan import plan_run
from marlow.policy.adapters import adapter_parameters
from marlow.tiny.model import n_parameters
from marlow.training.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "qwen3-0.6b-smoke.yaml"


def test_the_stand_in_tokenizer_decodes_every_id_and_speaks_qwen3_chat():
    tok = build_tokenizer(151936)
    assert len(tok) == 151936
    assert None not in tok.convert_ids_to_tokens(list(range(151936)))  # every sampled id decodes
    assert {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_IDS} == SPECIAL_IDS
    text = tok.apply_chat_template(
        [{"role": "user", "content": "2+2? ünï"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert text == (
        "<|im_start|>user\n2+2? ünï<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.eos_token == IM_END


@pytest.mark.slow
def test_two_voting_ip_steps_on_the_qwen3_0_6b_architecture(tmp_path):
    folder = save_stand_in("qwen3-0.6b", tmp_path / "qwen3-0.6b-random")
    cfg = load_config(CONFIG, [f"model.name={folder}"])
    trainer = Trainer(cfg, tmp_path / "run")
    plan = plan_run(cfg)  # the meta-device plan of the same run counts what was really built

    base = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    assert {p.dtype for p in base} == {torch.bfloat16}
    assert n_parameters(trainer.base) - sum(a.trainable for a in plan.adapters) == plan.parameters
    assert trainer.adapters == ["generator", "aggregator"]
    for adapter, planned in zip(trainer.adapters, plan.adapters, strict=True):
        params = adapter_parameters(trainer.model, adapter).values()
        assert {p.dtype for p in params} == {torch.float32}
        assert sum(p.numel() for p in params) == planned.trainable

    trainer.run()

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = {r["step"]: r for r in map(json.loads, lines)}
    assert sorted(records) == [0, 1, 2]
    for step in (1, 2):
        r = records[step]
        for role in ("generator", "aggregator"):
            assert math.isfinite(r[f"train/{role}/entropy"]), (step, role)
            assert r[f"train/{role}/length_max"] <= cfg.rollout.max_new_tokens
        assert r["time/rollout_s"] > 0 and r["time/learn_s"] > 0
    assert "val/all/accuracy" in records[2]
    adapters = tmp_path / "run" / "checkpoints" / "step_000002" / "adapters"
    assert sorted(p.name for p in adapters.iterdir()) == ["aggregator", "generator"]
