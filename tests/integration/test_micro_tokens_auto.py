"""grpo.micro_tokens=auto in a run: 8,192 off CUDA, and on a card the figure ``marlow plan``
gives for that card's memory (the trainer sizes it from its own model, plan from the config);
the run's config.yaml keeps ``auto``."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from marlow.config import dump_config
from marlow.plan import GIB, plan_run
from marlow.training.trainer import Trainer


def test_auto_is_8192_on_the_cpu_and_plans_figure_on_a_card(small_config, tmp_path, monkeypatch):
    cfg = small_config(workflow={"name": "voting"}, policy={"routing": "ip"})
    assert cfg.grpo.micro_tokens == "auto"
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        assert trainer.grpo.micro_tokens == 8192
        assert "micro_tokens: auto" in dump_config(trainer.cfg)  # what config.yaml holds
        # a card small enough that the tiny model's activations, not the cap, size it
        planned = plan_run(cfg, gpu_mem_gib=1.0)
        per_token = planned.activation_bytes / planned.forward_tokens
        card = planned.base_bytes + planned.adapter_bytes + 2 * 5000 * per_token
        expect = plan_run(cfg, gpu_mem_gib=card / GIB).micro_tokens
        assert expect in (4096, 5120)  # about 5,000 tokens' activations in half the room
        logged = []
        trainer.log = logged.append
        trainer.device = torch.device("cuda")
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=int(card))
        )
        assert trainer._update_settings(cfg, checkpointed=False) == (expect, False)
        assert logged and f"grpo.micro_tokens auto: {expect:,} tokens" in logged[0]
    finally:
        trainer.close()
