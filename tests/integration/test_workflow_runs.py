"""Every workflow x {SP, IP} runs two steps on the tiny model and writes its run folder."""

from __future__ import annotations

import json

import pytest

from marlow.diagnostics.sinks import read_metrics
from marlow.training.trainer import Trainer

ROLES = {
    "single": ["generator"],
    "eval_opt": ["generator", "evaluator"],
    "voting": ["generator", "aggregator"],
    "orch_workers": ["orchestrator", "worker", "synthesizer"],
}


@pytest.mark.parametrize("routing", ["sp", "ip"])
@pytest.mark.parametrize("workflow", list(ROLES))
def test_two_steps_write_the_run_folder(small_config, tmp_path, workflow, routing):
    params = {"rounds": 1} if workflow == "eval_opt" else {}
    cfg = small_config(workflow={"name": workflow, "params": params}, policy={"routing": routing})
    out = Trainer(cfg, tmp_path / "run").run()
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "val/all/accuracy" in records[0] and "val/all/accuracy" in records[2]
    adapters = ["shared"] if routing == "sp" else ROLES[workflow]
    for role in ROLES[workflow]:
        for metric in (
            "entropy",
            "perplexity",
            "chi2_rollout",
            "chi2_update",
            "clipfrac_low",
            "clipfrac_high",
            "length_mean",
            "truncation_rate",
            "reward",
        ):
            assert f"train/{role}/{metric}" in records[1], (role, metric)
    for adapter in adapters:
        assert records[1][f"train/{adapter}/updates"] >= 1
        assert f"train/{adapter}/grad_norm" in records[1]
        folder = out / "checkpoints" / "step_000002" / "adapters" / adapter
        assert (folder / "adapter_config.json").exists()
        assert (folder / "adapter_model.safetensors").exists()
    assert sorted(
        p.name for p in (out / "checkpoints" / "step_000002" / "adapters").iterdir()
    ) == sorted(adapters)
    assert (out / "config.yaml").read_text().count(f"name: {workflow}") == 1
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["turns"] for s in samples)
    assert {t["role"] for s in samples for t in s["turns"]} <= set(ROLES[workflow])


@pytest.mark.parametrize("workflow", ["eval_opt", "orch_workers"])
def test_role_credit_rewards_every_turn_and_trains(small_config, tmp_path, workflow):
    cfg = small_config(
        workflow={"name": workflow}, policy={"routing": "ip"}, grpo={"credit": "role"}
    )
    trainer = Trainer(cfg, tmp_path / "run")
    problems = trainer.task.train_batch(cfg.seed, 1, 3)
    episodes = trainer.rollout(problems, 4, 1.0, seed=5)
    for ep in episodes:
        assert all(t.reward is not None for t in ep.turns)
        for t in ep.turns:
            if t.role in ("evaluator",):
                assert t.reward in (0.0, 1.0)
            elif t.role in ("orchestrator", "synthesizer"):
                assert t.reward == ep.reward
    record = trainer.learn(1, episodes)
    assert all(record[f"train/{a}/updates"] >= 1 for a in trainer.adapters)


@pytest.mark.parametrize("workflow", ["eval_opt", "orch_workers", "voting"])
def test_every_official_switch_together_trains_on_the_tiny_world(small_config, tmp_path, workflow):
    """The official preset's switches over the tiny world: two steps run, and the run records
    every switch in its config."""
    from marlow.config.presets import PRESETS

    official = {k: v for k, v in PRESETS["official"].items() if k in ("grpo", "optim", "workflow")}
    cfg = small_config(
        workflow={"name": workflow, **official["workflow"]},
        grpo={**official["grpo"], "minibatch_turns": 2},
        optim=official["optim"],
        task={"format_penalty": 0.0},
    )
    assert cfg.grpo.advantage_scope == "trajectory" and cfg.workflow.workers == "parsed"
    out = Trainer(cfg, tmp_path / "run").run()
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    for adapter in ROLES[workflow]:
        assert records[1][f"train/{adapter}/updates"] >= 1
    saved = (out / "config.yaml").read_text()
    assert "rounds_count: judge-calls" in saved and "schedule_stepping: shared-uncapped" in saved
