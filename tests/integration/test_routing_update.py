"""Under IP an adapter's weights change if and only if its roles had tokens with non-zero
advantage; adapters are matched by exact name (roles ``worker`` and ``workers`` stay apart).

Both hold for one update from a fresh optimizer with weight decay 0 (small_config): decoupled
decay, and Adam's momentum after a real update, move parameters even on a zero gradient, which is
the optimizer's doing, not the routing's.
"""

from __future__ import annotations

import torch

from marlow.policy.adapters import adapter_parameters
from marlow.training.trainer import Trainer

TWIN = """\
title: Twin workers
roles:
  worker: {kind: answer, prompts: {solve: "Q: {problem}\\nS: direct\\nSolve:"}}
  workers: {kind: answer, prompts: {solve: "Q: {problem}\\nS: direct\\nSolve:"}}
stages:
  - {role: worker, prompt: solve}
  - {role: workers, prompt: solve}
answer: last.workers
"""


def _workflow_file(folder) -> str:
    """A user-defined workflow, as a file: two roles whose names share a prefix."""
    path = folder / "twin-workers.yaml"
    path.write_text(TWIN)
    return str(path)


def _snapshot(model, names):
    return {
        n: {k: v.detach().clone() for k, v in adapter_parameters(model, n).items()} for n in names
    }


def _changed(before, model, name) -> bool:
    after = adapter_parameters(model, name)
    assert set(after) == set(before[name])
    return any(not torch.equal(before[name][k], after[k].detach()) for k in after)


def _episodes(trainer, rewards):
    problems = trainer.task.train_batch(0, 1, trainer.cfg.grpo.batch_problems)
    episodes = trainer.rollout(problems, trainer.cfg.grpo.group_size, 1.0, seed=1)
    for ep in episodes:
        ep.reward = rewards(ep)
    return episodes


def test_exact_names_and_update_iff_nonzero_advantage(small_config, tmp_path):
    cfg = small_config(
        workflow={"name": _workflow_file(tmp_path)},
        policy={"routing": "ip"},
        grpo={"role_weights": {"workers": 0.0}},
    )
    trainer = Trainer(cfg, tmp_path / "a")
    assert trainer.adapters == ["worker", "workers"]
    worker_keys = set(adapter_parameters(trainer.model, "worker"))
    workers_keys = set(adapter_parameters(trainer.model, "workers"))
    assert worker_keys and workers_keys and not worker_keys & workers_keys
    assert all(".worker." in k for k in worker_keys) and all(".workers." in k for k in workers_keys)

    # rewards vary within each group; the role weight zeroes the `workers` advantages only
    before = _snapshot(trainer.model, trainer.adapters)
    trainer.learn(1, _episodes(trainer, lambda ep: float(ep.sample % 2)))
    assert _changed(before, trainer.model, "worker")
    assert not _changed(before, trainer.model, "workers")

    # every group has equal rewards: zero advantage everywhere, no adapter moves. A fresh trainer:
    # after a real update Adam's momentum keeps moving weights even on a zero gradient.
    trainer = Trainer(cfg, tmp_path / "a2")
    before = _snapshot(trainer.model, trainer.adapters)
    record = trainer.learn(1, _episodes(trainer, lambda ep: 1.0))
    assert record["train/all/frac_reward_zero_std"] == 1.0
    assert not _changed(before, trainer.model, "worker")
    assert not _changed(before, trainer.model, "workers")


def test_voting_ip_moves_both_adapters_on_nonzero_advantage(small_config, tmp_path):
    trainer = Trainer(
        small_config(workflow={"name": "voting"}, policy={"routing": "ip"}), tmp_path / "b"
    )
    before = _snapshot(trainer.model, trainer.adapters)
    trainer.learn(1, _episodes(trainer, lambda ep: float(ep.sample == 0)))
    assert _changed(before, trainer.model, "generator")
    assert _changed(before, trainer.model, "aggregator")
