"""What is registered from outside the package is used like the built-in ones: a rollout backend
(``rollout.backend`` names it, a run trains with it; an unregistered name is one line) and a
policy loss (``grpo.policy_loss``)."""

from __future__ import annotations

import pytest

from marlow.algo.policy_loss import policy_loss, register_policy_loss
from marlow.config import ConfigError
from marlow.diagnostics.sinks import read_metrics
from marlow.rollout import register_backend
from marlow.rollout.hf import HFEngine
from marlow.training.trainer import Trainer


class CountingEngine:
    """A third backend: marlow's HF loop behind a counter of the calls it served."""

    calls = 0

    def __init__(self, model, tokenizer, *, max_batch: int):
        self.inner = HFEngine(model, tokenizer, max_batch=max_batch)

    def generate(self, requests, params):
        CountingEngine.calls += 1
        return self.inner.generate(requests, params)

    def score(self, requests, completions, temperature):
        return self.inner.score(requests, completions, temperature)

    def refresh(self, adapters):
        self.inner.refresh(adapters)

    def close(self):
        self.inner.close()


register_backend("counting-test", CountingEngine)


def test_a_backend_registered_from_outside_trains_a_run(small_config, tmp_path):
    cfg = small_config(rollout={"backend": "counting-test"}, workflow={"name": "voting"})
    with Trainer(cfg, tmp_path / "run") as trainer:
        assert isinstance(trainer.engine, CountingEngine)
        trainer.run()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]
    # Voting's two stages per rollout: validations at steps 0 and 2, training steps 1 and 2
    assert CountingEngine.calls == 2 * 4


def test_an_unregistered_backend_is_one_line_listing_the_registered(small_config, tmp_path):
    cfg = small_config(rollout={"backend": "sglang"})
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, tmp_path / "run")
    assert str(err.value).startswith("config field 'rollout.backend' is 'sglang'; valid: ")
    assert "counting-test, hf, vllm" in str(err.value)
    assert not (tmp_path / "run").exists()


CALLS = {"loss": 0}


@register_policy_loss("counting-ppo-test")
def counting_ppo(inputs, settings):
    """A policy loss registered from outside: ppo-clip, counted."""
    CALLS["loss"] += 1
    return policy_loss("ppo-clip")(inputs, settings)


def test_a_policy_loss_registered_from_outside_is_the_one_the_update_uses(small_config, tmp_path):
    from tests.integration.reference import vary_rewards

    cfg = small_config(grpo={"policy_loss": "counting-ppo-test"})
    with vary_rewards(Trainer(cfg, tmp_path / "run")) as trainer:
        trainer.run()
    assert CALLS["loss"] > 0  # every micro-batch of every update went through it
    record = read_metrics(tmp_path / "run")[1]
    losses = [v for k, v in record.items() if k.endswith("/loss")]
    assert losses and any(v != 0 for v in losses)
