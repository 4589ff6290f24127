"""Training runs that sample on vLLM: Voting IP and SP end, every step's
adapter-sync check passes within float32's tolerance, a sync broken on purpose stops the run in
one line, and the rewards of a vLLM-rollout run match an HF-rollout run's in distribution.
"""

from __future__ import annotations

import json
import random

import pytest

from marlow.rollout.vllm import VLLMEngine
from marlow.training.sync import TOLERANCE, AdapterSyncError
from marlow.training.trainer import Trainer
from tests.conftest import shrunk_config

pytestmark = pytest.mark.vllm

VOTING = dict(
    steps=3,
    val_every=3,
    workflow={"name": "voting"},
    grpo={"batch_problems": 4, "group_size": 4, "minibatch_turns": 16},
    rollout={"max_new_tokens": 16, "vllm": {"kv_cache_gib": 0.25}},
    task={"val_size": 16},
)


def digit_rewards(trainer: Trainer, seen: list[float]) -> Trainer:
    """Reward each training episode with the share of digits in its last turn's completion: a
    function of what was sampled with spread in every group (the barely pre-trained world almost
    never answers, so its real rewards would all be equal), recorded in ``seen``."""
    rollout = trainer.rollout

    def scored(problems, n, temperature, seed, **kw):
        episodes = rollout(problems, n, temperature, seed, **kw)
        for ep in episodes:
            text = ep.turns[-1].completion_text
            reward = sum(ch.isdigit() for ch in text) / max(len(text), 1)
            if n > 1:
                ep.reward = reward
            seen.append(reward)
        return episodes

    trainer.rollout = scored
    return trainer


def _run(tmp_path, name: str, backend: str, routing: str) -> tuple[list[dict], list[float]]:
    cfg = shrunk_config(**VOTING, policy={"routing": routing})
    cfg = cfg.model_copy(
        update={"rollout": cfg.rollout.model_copy(update={"backend": backend})}, deep=True
    )
    rewards: list[float] = []
    with Trainer(cfg, tmp_path / name) as trainer:
        digit_rewards(trainer, rewards).run()
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines], rewards


def _permutation_p(a: list[float], b: list[float], rounds: int = 20_000) -> float:
    """Two-sided permutation test of equal means (seeded: the same data give the same p)."""
    rng = random.Random(0)
    observed = abs(sum(a) / len(a) - sum(b) / len(b))
    pooled = a + b
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        x, y = pooled[: len(a)], pooled[len(a) :]
        hits += abs(sum(x) / len(x) - sum(y) / len(y)) >= observed - 1e-12
    return (hits + 1) / (rounds + 1)


@pytest.mark.parametrize("routing", ["ip", "sp"])
def test_voting_on_vllm_ends_in_sync_and_rewards_match_hf(tiny_cache, tmp_path, routing):
    """Same config, seed and problems on both backends; the samples come from different random
    streams, so the per-episode rewards (train and validation, 3 steps) are compared as
    distributions: a permutation test of equal means at p > 0.01."""
    metrics, ours = _run(tmp_path, "vllm", "vllm", routing)
    steps = [r for r in metrics if r["step"] > 0 and "train/all/reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    adapters = ["generator", "aggregator"] if routing == "ip" else ["shared"]
    for record in steps:
        for adapter in adapters:
            drift = record[f"train/{adapter}/engine_drift"]
            assert 0 <= drift < TOLERANCE["float32"], (record["step"], adapter, drift)
        for role in ("generator", "aggregator"):
            gap = record[f"train/{role}/rollout_abs_dlogp"]
            assert 0 <= gap < 1e-4, (record["step"], role, gap)  # float32: round-off only
    assert (tmp_path / "vllm" / "checkpoints" / "step_000003").is_dir()
    _, theirs = _run(tmp_path, "hf", "hf", routing)
    assert len(ours) == len(theirs) == 3 * 16 + 2 * 16  # 3 steps of 16 episodes, 2 validations
    assert len(set(ours)) > 5  # the rewards have spread: the test can tell distributions apart
    assert _permutation_p(ours, theirs) > 0.01


def test_a_sync_broken_on_purpose_stops_the_run_in_one_line(tiny_cache, tmp_path, monkeypatch):
    """An engine that never reloads updated adapters serves the pre-update weights: the sync
    check stops the run at step 1, naming the adapter, before any checkpoint of step 1."""
    monkeypatch.setattr(VLLMEngine, "refresh", lambda self, adapters: None)
    with pytest.raises(AdapterSyncError, match=r"stopped at step 1: .* adapter '") as err:
        _run(tmp_path, "broken", "vllm", "ip")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "broken" / "checkpoints" / "step_000001").exists()
