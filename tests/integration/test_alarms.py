"""Detectors during training: a terminal cliff is logged once in events.jsonl, and can stop a run."""

from __future__ import annotations

import json

import pytest
import torch

from marlow.diagnostics.sinks import read_metrics
from marlow.policy.adapters import adapter_parameters
from marlow.training.trainer import Trainer

ACCURACY = {0: 0.5, 1: 0.6, 2: 0.4, 3: 0.4, 4: 0.4, 5: 0.4}  # scripted validations: a cliff


def scripted(trainer):
    def validate(step):
        return {"val/all/accuracy": ACCURACY[step], "val/all/n_problems": 8.0}

    trainer.validate = validate
    return trainer


def events(out):
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("action", ["warn", "stop"])
def test_terminal_cliff_alarm(small_config, tmp_path, action):
    cfg = small_config(steps=5, val_every=1, ckpt_every=10, detect={"on_alarm": action})
    out = scripted(Trainer(cfg, tmp_path / "run")).run()
    logged = events(out)
    assert len(logged) == 1  # once, although the cliff persists in steps 4 and 5
    assert logged[0]["detector"] == "terminal_cliff" and logged[0]["step"] == 3
    assert logged[0]["fired_at"] == 2 and logged[0]["evidence"]["peak_step"] == 1
    steps = [r["step"] for r in read_metrics(out)]
    if action == "stop":
        assert steps == [0, 1, 2, 3]
        assert (out / "checkpoints" / "step_000003").is_dir()  # stopped runs keep their state
    else:
        assert steps == [0, 1, 2, 3, 4, 5]


def test_no_alarm_on_a_steady_run(small_config, tmp_path):
    cfg = small_config(steps=3, val_every=1, ckpt_every=10)
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.validate = lambda step: {"val/all/accuracy": 0.5 + 0.01 * step}
    assert events(trainer.run()) == []


def test_rollback_restores_the_best_validated_checkpoint(small_config, tmp_path):
    cfg = small_config(
        steps=5, val_every=1, ckpt_every=1, optim={"lr": 5e-2}, detect={"on_alarm": "rollback"}
    )
    trainer = scripted(Trainer(cfg, tmp_path / "run"))
    rollout = trainer.rollout

    def varied(*args, **kw):  # rewards with spread, so every step moves the adapter
        episodes = rollout(*args, **kw)
        for ep in episodes:
            ep.reward = float(ep.sample % 2)
        return episodes

    trainer.rollout = varied
    params = adapter_parameters(trainer.model, trainer.adapters[0])
    seen = {}

    def keep(step, _record):
        seen[step] = {k: v.detach().clone() for k, v in params.items()}

    out = trainer.run(on_step=keep)
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3]
    assert (out / "checkpoints" / "step_000003").is_dir()  # the state at the alarm is kept
    best = json.loads((out / "best.json").read_text())
    assert best == {"step": 1, "val_accuracy": 0.6, "checkpoint": "checkpoints/step_000001"}
    assert events(out)[-1] == {"step": 3, "action": "rollback", "to_step": 1}
    assert any(not torch.equal(seen[1][k], seen[3][k]) for k in params)  # training moved it
    for k, v in params.items():
        assert torch.equal(v.detach(), seen[1][k])  # and the model now holds step 1's adapter
