"""Non-finite never lands: NaN injected into a gradient and through ``optim.lr=1e30``; each
skipped update is undone and counted, a streak stops the run with its last good checkpoint
intact, and no checkpoint is ever written or loaded with a non-finite value. A NaN reward is no
reward: its episode is left out, not trained on."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from marlow.diagnostics.sinks import read_metrics
from marlow.policy.adapters import adapter_parameters
from marlow.training import checkpoint
from marlow.training.nonfinite import NonFiniteRun
from marlow.training.trainer import Trainer
from tests.integration.reference import VOTING_IP, vary_rewards

SETTINGS = {**VOTING_IP, "train": {"keep_checkpoints": None}}  # every step's checkpoint
ADAPTERS = ("aggregator", "generator")


def weights(run, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """The adapters of a checkpoint, loaded (and so verified finite) by the checkpoint reader."""
    from safetensors.torch import load_file

    path = checkpoint.checkpoint_dir(run, step)
    assert checkpoint.verify(path) is None
    return {a: load_file(path / "adapters" / a / "adapter_model.safetensors") for a in ADAPTERS}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def skips(run) -> dict[int, dict[str, float]]:
    return {
        r["step"]: {a: r[f"train/{a}/nonfinite_skips"] for a in ADAPTERS}
        for r in read_metrics(run)
        if r["step"] > 0
    }


def events(run, action: str) -> list[dict]:
    lines = (run / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("action") == action]


def test_a_nan_reward_leaves_its_episode_out_and_nothing_is_skipped(small_config, tmp_path):
    """A NaN reward is no reward (``marlow.types.NoReward``): its episode is left out of its
    group and counted, and the step trains on the others; no update is undone."""
    trainer = vary_rewards(Trainer(small_config(**SETTINGS), tmp_path / "run"))
    rollout, calls = trainer.rollout, itertools.count(1)

    def poisoned(problems, n, temperature, seed, **kw):  # one NaN reward, in step 2
        episodes = rollout(problems, n, temperature, seed, **kw)
        if n > 1 and next(calls) == 2:
            episodes[0].reward = math.nan
        return episodes

    trainer.rollout = poisoned
    run = trainer.run()
    assert skips(run) == {s: dict.fromkeys(ADAPTERS, 0.0) for s in (1, 2, 3)}
    assert not (run / "events.jsonl").exists()  # no skip, no event of any kind
    records = {r["step"]: r for r in read_metrics(run)}
    assert records[2]["train/all/reward_nonfinite"] == 1
    assert records[2]["train/generator/reward_nonfinite"] == 3  # Voting's three candidates
    assert "train/all/reward_nonfinite" not in records[1]
    w1, w2, w3 = (weights(run, s) for s in (1, 2, 3))
    for a in ADAPTERS:
        assert not same(w1[a], w2[a])  # step 2 trained on the other episodes
        assert not same(w2[a], w3[a])


def test_a_nan_gradient_skips_that_adapter_and_a_streak_stops_the_run(small_config, tmp_path):
    cfg = small_config(**{**SETTINGS, "train": {"keep_checkpoints": None, "max_nonfinite": 2}})
    trainer = vary_rewards(Trainer(cfg, tmp_path / "run"))
    now = {"step": 0}
    train_step = trainer.train_step

    def tracked(step):
        now["step"] = step
        return train_step(step)

    trainer.train_step = tracked
    param = next(iter(adapter_parameters(trainer.model, "generator").values()))
    param.register_hook(lambda g: torch.full_like(g, math.nan) if now["step"] >= 2 else g)
    with pytest.raises(NonFiniteRun) as stop:
        trainer.run()
    message = str(stop.value)
    assert "\n" not in message
    assert "stopped at step 3: adapter 'generator'" in message and "gradient norm is nan" in message
    assert "the last checkpoint, step_000002, is intact" in message
    run = tmp_path / "run"
    assert skips(run) == {
        1: {"aggregator": 0.0, "generator": 0.0},
        2: {"aggregator": 0.0, "generator": 1.0},
        3: {"aggregator": 0.0, "generator": 1.0},
    }
    assert [p.name for p in checkpoint.all_done(run)] == ["step_000001", "step_000002"]
    w1, w2 = weights(run, 1), weights(run, 2)
    assert same(w1["generator"], w2["generator"])  # its step-2 update never landed
    assert not same(w1["aggregator"], w2["aggregator"])  # the other adapter trained on
    assert events(run, "nonfinite_stop") == [
        {"step": 3, "action": "nonfinite_stop", "adapter": "generator"}
    ]


def test_an_exploding_learning_rate_never_lands(small_config, tmp_path):
    """lr=1e30: finite weights of 1e30 whose forward is NaN. Every update is undone (the
    generator's on its next mini-batch's NaN loss, the aggregator's on its NaN log-probs after
    the update), so every checkpoint holds the starting adapters."""
    cfg = small_config(**{**SETTINGS, "optim": {"lr": 1e30}, "train": {"keep_checkpoints": None}})
    trainer = vary_rewards(Trainer(cfg, tmp_path / "run"))
    start = {
        a: {k: v.detach().clone() for k, v in adapter_parameters(trainer.model, a).items()}
        for a in ADAPTERS
    }
    with pytest.raises(NonFiniteRun, match="stopped at step 3") as stop:
        trainer.run()
    assert "\n" not in str(stop.value) and "step_000002, is intact" in str(stop.value)
    run = tmp_path / "run"
    assert skips(run) == {s: dict.fromkeys(ADAPTERS, 1.0) for s in (1, 2, 3)}
    for step in (1, 2):
        loaded = Trainer(cfg, tmp_path / f"check{step}")
        checkpoint.load(
            checkpoint.checkpoint_dir(run, step), loaded.model, loaded.adapters, loaded.optim
        )
        for a in ADAPTERS:
            now = adapter_parameters(loaded.model, a)
            assert all(torch.equal(now[k], start[a][k]) for k in now)


def test_a_non_finite_checkpoint_is_never_written(small_config, tmp_path):
    trainer = Trainer(small_config(**SETTINGS), tmp_path / "run")
    with torch.no_grad():
        next(iter(adapter_parameters(trainer.model, "aggregator").values()))[0, 0] = math.inf
    with pytest.raises(
        checkpoint.CheckpointError, match="adapter 'aggregator' weight .* is not finite"
    ):
        checkpoint.save(tmp_path / "run", 1, trainer.model, trainer.adapters, trainer.optim)
    assert not (tmp_path / "run" / "checkpoints").exists()
