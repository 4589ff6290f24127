"""Adapter-sync checks that fail loudly.

After every update the trainer has the rollout engine score one probe turn per adapter and
compares with its own log-probs (``marlow.training.sync``). The HF engine scores through the
trainer's own model: both score the probe turn alone at temperature 1, so its drift is exactly 0. Engines broken on purpose, one serving a stale deep copy of the model
and one answering every adapter with another's weights, stop the run at step 1 with one line
naming the adapter and the step; through the CLI that line is an exit code 2. The runs are on the
device tests' device (the CPU unless MARLOW_TEST_DEVICE names another: ``tests/conftest.py``).
"""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from marlow.cli import app
from marlow.config import dump_config
from marlow.rollout.hf import HFEngine
from marlow.training.sync import TOLERANCE, AdapterSyncError, check_sync
from marlow.training.trainer import Trainer
from tests.conftest import TEST_DEVICE, shrunk_config
from tests.integration.reference import VOTING_IP, vary_rewards

# Step 1 runs the sampled diagnostics (all turns rescored), step 2 only the probe turn.
SETTINGS = {
    **VOTING_IP,
    "device": TEST_DEVICE,
    "steps": 2,
    "val_every": 2,
    "diagnostics": {"every": 2},
}


class SwappedEngine(HFEngine):
    """Scores each adapter's turns with the other adapter's weights (a wrong LoRA request)."""

    def score(self, requests, completions, temperature):
        swap = {"generator": "aggregator", "aggregator": "generator"}
        wrong = [type(r)(r.prompt_ids, swap[r.adapter]) for r in requests]
        return super().score(wrong, completions, temperature)


def trainer(tmp_path) -> Trainer:
    return vary_rewards(Trainer(shrunk_config(**SETTINGS), tmp_path / "run"))


def test_the_hf_engine_serves_every_update_exactly(tiny_cache, tmp_path):
    t = trainer(tmp_path)
    t.run()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if json.loads(x)["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for adapter in ("aggregator", "generator"):
        # both sides score the probe turn alone, at temperature 1, through the same model (on
        # the diagnostics step 1 too): bit for bit
        assert steps[0][f"train/{adapter}/engine_drift"] == 0.0
        assert steps[1][f"train/{adapter}/engine_drift"] == 0.0
    # each step's peak device memory per phase, on CUDA alone (marlow.training.memory)
    for record in steps:
        memory = {k: v for k, v in record.items() if k.startswith("memory/")}
        if t.device.type != "cuda":
            assert memory == {}
            continue
        assert set(memory) == {
            f"memory/{phase}_{kind}_gib"
            for phase in ("rollout", "learn")
            for kind in ("peak_allocated", "peak_reserved", "start_allocated")
        }
        for phase in ("rollout", "learn"):
            allocated = memory[f"memory/{phase}_peak_allocated_gib"]
            assert 0 < allocated <= memory[f"memory/{phase}_peak_reserved_gib"], memory
            assert 0 < memory[f"memory/{phase}_start_allocated_gib"] <= allocated, memory


@pytest.mark.parametrize("broken", ["stale-copy", "swapped-adapters"])
def test_an_engine_out_of_sync_stops_the_run_at_step_1(tiny_cache, tmp_path, broken):
    t = trainer(tmp_path)
    if broken == "stale-copy":  # the weights as they were before any update
        t.engine = HFEngine(copy.deepcopy(t.model), t.tokenizer, max_batch=t.engine.max_batch)
    else:
        t.engine = SwappedEngine(t.model, t.tokenizer, max_batch=t.engine.max_batch)
    with pytest.raises(AdapterSyncError, match=r"stopped at step 1: .* adapter 'aggregator'") as e:
        t.run()
    message = str(e.value)
    assert "\n" not in message and "tolerance 0.0001 for dtype=float32" in message
    drift = float(message.split(" by ")[1].split(" ")[0])
    assert drift > 10 * TOLERANCE["float32"], drift  # far outside the round-off it allows
    assert not (tmp_path / "run" / "checkpoints" / "step_000001").exists()


def test_the_cli_reports_a_sync_failure_in_one_line(tiny_cache, tmp_path, monkeypatch):
    def stale_engine(config, model, tokenizer, device):
        return HFEngine(copy.deepcopy(model), tokenizer, max_batch=config.rollout.max_batch)

    monkeypatch.setattr("marlow.workflows.agents.engine_for_run", stale_engine)
    monkeypatch.setattr(Trainer, "rollout", _varied(Trainer.rollout))
    config = tmp_path / "c.yaml"
    config.write_text(dump_config(shrunk_config(**SETTINGS)))
    result = CliRunner().invoke(app, ["train", str(config), "--out", str(tmp_path / "run")])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert lines[-1].startswith("error: stopped at step 1") and "'aggregator'" in lines[-1]
    assert "Traceback" not in result.output


def _varied(rollout):
    """``vary_rewards`` for every Trainer of a CLI run."""

    def varied(self, problems, n, temperature, seed, **kw):
        episodes = rollout(self, problems, n, temperature, seed, **kw)
        if n > 1:
            for ep in episodes:
                ep.reward = float(ep.sample % 2)
        return episodes

    return varied


def test_the_check_takes_the_worst_rank_and_refuses_nan():
    assert check_sync([{"g": 0.0}, {"g": 2e-5}], "float32", 3) == {"train/g/engine_drift": 2e-5}
    assert check_sync([{"g": 0.015}], "bfloat16", 3) == {"train/g/engine_drift": 0.015}
    with pytest.raises(AdapterSyncError, match="step 3: .* adapter 'g'"):
        check_sync([{"g": 0.0}, {"g": 2e-4}], "float32", 3)
    with pytest.raises(AdapterSyncError, match="adapter 'g'"):
        check_sync([{"g": float("nan")}], "bfloat16", 3)


def test_a_run_with_rows_refilled_records_the_trainers_log_probs(tiny_cache, tmp_path, monkeypatch):
    """rollout.refill=on with 2 rows at a time: each stage's 6 episodes (validation's more)
    are admitted as earlier ones stop, and every sampled turn's recorded log-probs are the
    trainer's own (|logp_old - logp_sampler| at float32 round-off, per role) and the probe turn's
    drift exactly 0, as without refilling; the run's config keeps the setting."""
    rollout = {**SETTINGS["rollout"], "max_batch": 2, "refill": "on"}
    cfg = shrunk_config(**{**SETTINGS, "rollout": rollout})
    t = vary_rewards(Trainer(cfg, tmp_path / "run"))
    passes = []
    sample = HFEngine._sample

    def counted(self, batch, *args):
        out = sample(self, batch, *args)
        passes.append((len(batch), len(out)))
        return out

    monkeypatch.setattr(HFEngine, "_sample", counted)
    t.run()
    assert passes and all(n == taken for n, taken in passes)  # one pass takes them all
    assert max(n for n, _ in passes) > 2  # more rows than max_batch in one pass
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if json.loads(x)["step"] > 0]
    for record in steps:
        for role in ("aggregator", "generator"):
            assert record[f"train/{role}/rollout_abs_dlogp"] < 1e-5
            assert record[f"train/{role}/engine_drift"] == 0.0
    assert "refill: 'on'" in (tmp_path / "run" / "config.yaml").read_text()
