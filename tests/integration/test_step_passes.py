"""A training step's passes of the model over its turns, counted by kind for a table of settings
on the tiny world (Voting: per step 24 generator turns and 8 aggregator turns; under SP all 32 on
one adapter).

Every forward ``Trainer.learn`` makes goes through ``marlow.training.logprobs.score_chunk`` (the
trainer's scoring) or the rollout engine's ``score`` (the adapter-sync check): a hook on the
decoder counts every forward of the step and holds the two to account for all of them. Each
``score_chunk`` call is named by the state it runs in:

* ``update``: gradient enabled (the update's forward; its backward follows);
* ``base``: every adapter disabled, before the step's updates (``score_base``);
  ``kl_to_base``: the same after them;
* ``logp_old``: the adapter active (or merged into the base, ``grpo.fold_lora``), no gradient,
  before the updates; ``probe``: its probe turn (``probe_logp``); ``chi2_update``: any other
  pass of the adapter after the updates (the post-update rescoring);

and ``sync`` is the rollout engine's scoring of a turn. A count is turns scored: k passes over
an adapter's N turns count k * N. Sampling is the rollout's alone: it makes none of these passes.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest
import torch

from marlow.policy.adapters import active_adapter
from marlow.training import grpo, logprobs
from marlow.training.trainer import Trainer
from marlow.types import BASE

TURNS = {"generator": 24, "aggregator": 8, "shared": 32}  # per step, checked below
TEMPERATURE = 0.7  # the tiny preset's sampling temperature
SETTINGS = dict(
    workflow={"name": "voting"},
    policy={"routing": "ip"},
    optim={"lr": 5e-2},
    grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 1000},  # one update: fused
)


class Passes:
    """Turns scored per (kind, adapter) and the temperatures of each kind, for as long as
    ``monkeypatch`` holds its wrappers."""

    def __init__(self, trainer: Trainer, monkeypatch) -> None:
        self.turns: dict[tuple[str, str], int] = {}
        self.temperatures: dict[str, set[float]] = {}
        self.chunks = 0
        self.entropies: set[tuple[str, str]] = set()  # the (kind, adapter) passes that made them
        self.after = False  # the step's updates are done
        self.merged: str | None = None
        real_chunk, real_merged = logprobs.score_chunk, grpo.merged
        real_score, real_end = trainer.engine.score, trainer.optim.end_step

        def score_chunk(model, chunk, temperature, share_prompts=True, entropy=True):
            kind = self._kind(model)
            self._add(kind, chunk.ids.shape[0], temperature)
            if entropy:
                self.entropies.add(kind)
            self.chunks += 1
            return real_chunk(model, chunk, temperature, share_prompts, entropy)

        @contextmanager
        def merged(model, name):
            self.merged = name
            try:
                with real_merged(model, name) as out:
                    yield out
            finally:
                self.merged = None

        def engine_score(requests, completions, temperature):
            for request in requests:
                self._add(("sync", request.adapter), 1, temperature)
            return real_score(requests, completions, temperature)

        def end_step():
            self.after = True
            return real_end()

        monkeypatch.setattr(logprobs, "score_chunk", score_chunk)
        monkeypatch.setattr(grpo, "merged", merged)
        monkeypatch.setattr(trainer.engine, "score", engine_score)
        monkeypatch.setattr(trainer.optim, "end_step", end_step)

    def _kind(self, model) -> tuple[str, str]:
        adapter = self.merged or active_adapter(model)
        if torch.is_grad_enabled():
            return "update", adapter
        if adapter == BASE:
            return ("kl_to_base" if self.after else "base"), adapter
        if _called_from("probe_logp"):
            return "probe", adapter
        return ("chi2_update" if self.after else "logp_old"), adapter

    def _add(self, key: tuple[str, str], turns: int, temperature: float) -> None:
        self.turns[key] = self.turns.get(key, 0) + turns
        self.temperatures.setdefault(key[0], set()).add(temperature)


def _called_from(name: str) -> bool:
    """Whether a function named ``name`` is on the stack above the wrapper that asks."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def step_passes(small_config, tmp_path, monkeypatch, step: int, **over):
    """(passes, record) of ``Trainer.learn(step)`` on one rollout under ``SETTINGS`` + ``over``
    (each section merged into ``SETTINGS``'s)."""
    settings = {k: {**SETTINGS.get(k, {}), **v} for k, v in over.items()}
    trainer = Trainer(small_config(**{**SETTINGS, **settings}), tmp_path / "run")
    with monkeypatch.context() as mp:
        passes = Passes(trainer, mp)
        episodes = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, TEMPERATURE, seed=5)
        assert passes.turns == {} and passes.chunks == 0  # sampling makes no scoring pass
        for ep in episodes:
            ep.reward = float(ep.sample % 2)
        decoder = trainer.model.get_base_model().get_decoder()
        forwards = []
        hook = decoder.register_forward_pre_hook(lambda *_: forwards.append(1))
        try:
            record = trainer.learn(step, episodes)
        finally:
            hook.remove()
    turns = {}
    for ep in episodes:
        for t in ep.turns:
            adapter = trainer.routing.adapter_for(t.role)
            turns[adapter] = turns.get(adapter, 0) + 1
    assert turns == {a: TURNS[a] for a in trainer.adapters}
    syncs = sum(n for (kind, _), n in passes.turns.items() if kind == "sync")
    assert len(forwards) == passes.chunks + syncs  # no forward outside the counted ones
    return passes, record


class Turns(int):
    """A count of turns, where a count in a case's table is otherwise passes over every turn of
    the adapter."""


def table(adapters: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    """Expected turns scored per (kind, adapter) from a case's passes per adapter: ``base`` and
    ``kl_to_base`` counted under ``BASE``, whose passes they are."""
    out: dict[tuple[str, str], int] = {}
    for adapter, kinds in adapters.items():
        for kind, n in kinds.items():
            key = (kind, BASE if kind in ("base", "kl_to_base") else adapter)
            out[key] = out.get(key, 0) + (n if isinstance(n, Turns) else n * TURNS[adapter])
    return {k: v for k, v in out.items() if v}


PROBE = {"probe": Turns(1), "sync": Turns(1)}  # each step, per adapter: trainer, engine side
IP = ("generator", "aggregator")

CASES = {
    # name: (step, settings over SETTINGS, passes per adapter, optimizer updates per adapter);
    # step 1 is a diagnostics step, step 2 is not (diagnostics.every: 5)
    "default": (2, {}, dict.fromkeys(IP, {"update": 1, **PROBE}), dict.fromkeys(IP, 1)),
    "sp": (2, {"policy": {"routing": "sp"}}, {"shared": {"update": 1, **PROBE}}, {"shared": 1}),
    "diagnostics": (
        1,
        {},
        dict.fromkeys(IP, {"update": 1, "chi2_update": 1, "kl_to_base": 1, **PROBE}),
        dict.fromkeys(IP, 1),
    ),
    "diagnostics every step": (
        2,
        {"diagnostics": {"every": 1}},
        dict.fromkeys(IP, {"update": 1, "chi2_update": 1, "kl_to_base": 1, **PROBE}),
        dict.fromkeys(IP, 1),
    ),
    "diagnostics, kl_to_base off": (
        1,
        {"diagnostics": {"kl_to_base": False}},
        dict.fromkeys(IP, {"update": 1, "chi2_update": 1, **PROBE}),
        dict.fromkeys(IP, 1),
    ),
    "sp diagnostics": (
        1,
        {"policy": {"routing": "sp"}},
        {"shared": {"update": 1, "chi2_update": 1, "kl_to_base": 1, **PROBE}},
        {"shared": 1},
    ),
    # 12 turns a mini-batch: the generator's 24 take 2 updates (logp_old apart), the
    # aggregator's 8 one (fused)
    "two updates": (
        2,
        {"grpo": {"minibatch_turns": 12}},
        {
            "generator": {"logp_old": 1, "update": 1, **PROBE},
            "aggregator": {"update": 1, **PROBE},
        },
        {"generator": 2, "aggregator": 1},
    ),
    "two epochs": (
        2,
        {"grpo": {"epochs": 2}},
        dict.fromkeys(IP, {"logp_old": 1, "update": 2, **PROBE}),
        dict.fromkeys(IP, 2),
    ),
    "lora dropout": (
        2,
        {"policy": {"lora_dropout": 0.1}},
        dict.fromkeys(IP, {"logp_old": 1, "update": 1, **PROBE}),
        dict.fromkeys(IP, 1),
    ),
    "kl_coef": (
        2,
        {"mitigate": {"kl_coef": {"*": 0.05}}},
        dict.fromkeys(IP, {"base": 1, "update": 1, **PROBE}),
        dict.fromkeys(IP, 1),
    ),
    # kl_to_base reads the base log-probs scored for the KL penalty: no second base pass
    "kl_coef, diagnostics": (
        1,
        {"mitigate": {"kl_coef": {"*": 0.05}}},
        dict.fromkeys(IP, {"base": 1, "update": 1, "chi2_update": 1, **PROBE}),
        dict.fromkeys(IP, 1),
    ),
    # SP: the aggregator's KL penalty scores the base on the aggregator's turns alone, ...
    "sp, kl_coef on one role": (
        2,
        {"policy": {"routing": "sp"}, "mitigate": {"kl_coef": {"aggregator": 0.05}}},
        {"shared": {"base": Turns(TURNS["aggregator"]), "update": 1, **PROBE}},
        {"shared": 1},
    ),
    # ... but on every turn when kl_to_base reads them too
    "sp, kl_coef on one role, diagnostics": (
        1,
        {"policy": {"routing": "sp"}, "mitigate": {"kl_coef": {"aggregator": 0.05}}},
        {"shared": {"base": 1, "update": 1, "chi2_update": 1, **PROBE}},
        {"shared": 1},
    ),
    # the aggregator's KL penalty: its base pass; kl_to_base scores the generator's after
    "kl_coef on one role, diagnostics": (
        1,
        {"mitigate": {"kl_coef": {"aggregator": 0.05}}},
        {
            "generator": {"update": 1, "chi2_update": 1, "kl_to_base": 1, **PROBE},
            "aggregator": {"base": 1, "update": 1, "chi2_update": 1, **PROBE},
        },
        dict.fromkeys(IP, 1),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_a_step_makes_the_passes_its_settings_need(small_config, tmp_path, monkeypatch, name):
    step, over, expected, updates = CASES[name]
    passes, record = step_passes(small_config, tmp_path, monkeypatch, step, **over)
    assert passes.turns == table(expected)
    assert {a: record[f"train/{a}/updates"] for a in updates} == updates
    # the probe and the sync check at temperature 1 (marlow.training.sync), the rest as sampled
    for kind, temperatures in passes.temperatures.items():
        assert temperatures == ({1.0} if kind in PROBE else {TEMPERATURE}), kind
    # the entropies come from the logp_old pass (the update's forward where it gives logp_old)
    # and from no other: each costs passes over the vocabulary-wide logits
    assert passes.entropies == {
        ("logp_old" if "logp_old" in kinds else "update", adapter)
        for adapter, kinds in expected.items()
    }
    for role in ("generator", "aggregator"):  # every role's entropy is still measured
        assert record[f"train/{role}/entropy"] > 0, role
