"""Mitigations on hand-made gradients and rewards: coherence
damping of same-role slots, role-balanced gradient mass, the per-role KL settings, and
agent-wise advantage normalisation (Dr. MAS) as grpo.advantage_scope=role."""

from __future__ import annotations

import statistics

import pytest
import torch

from marlow.algo.turn_advantages import CreditRows, turn_advantages
from marlow.config import ConfigError, MitigateConfig, resolve
from marlow.diagnostics.metrics import Meter
from marlow.training.grpo import GradientParts, _mean_cosine, _mitigate
from marlow.workflows.validate import check_run_config


def parts_with(grads: dict) -> tuple[GradientParts, torch.Tensor]:
    """A GradientParts over one 2-vector parameter, fed one gradient per part in turn, as the
    update's backward passes accumulate them."""
    param = torch.zeros(2, requires_grad=True)
    own = GradientParts([param])
    for part, g in grads.items():
        own.enter(part)
        param.grad = (param.grad if param.grad is not None else torch.zeros(2)) + torch.tensor(g)
    return own, param


def test_mean_cosine():
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert _mean_cosine([e1, e1, 2 * e1]) == pytest.approx(1.0)
    assert _mean_cosine([e1, e2]) == pytest.approx(0.0)
    assert _mean_cosine([e1, -e1]) == pytest.approx(-1.0)
    assert _mean_cosine([e1, e2, e1]) == pytest.approx(1 / 3)  # pairs: 0, 1, 0


def test_aligned_slots_move_the_adapter_as_far_as_one_slot():
    grads = {
        ("generator", 0): [1.0, 0.0],
        ("generator", 1): [1.0, 0.0],
        ("generator", 2): [1.0, 0.0],
    }
    own, param = parts_with(grads)
    meter = Meter()
    changed = _mitigate(
        own, list(grads), ["generator"], False, MitigateConfig(coherence_threshold=0.5), meter
    )
    assert changed
    assert param.grad.tolist() == pytest.approx([1.0, 0.0])  # 3 x [1, 0] / (1 + 2 * 1)
    values = meter.result("train")
    assert values["train/generator/slot_coherence"] == pytest.approx(1.0)
    assert values["train/generator/slot_damping"] == pytest.approx(1 / 3)


def test_slots_below_the_threshold_are_left_alone():
    grads = {
        ("generator", 0): [1.0, 0.0],
        ("generator", 1): [0.0, 1.0],
        ("generator", 2): [1.0, 1.0],
    }
    own, param = parts_with(grads)
    meter = Meter()
    c = _mean_cosine([torch.tensor(g) for g in grads.values()])  # (0 + .707 + .707) / 3 = 0.471
    assert c == pytest.approx((2 * 0.5**0.5) / 3)
    changed = _mitigate(
        own, list(grads), ["generator"], False, MitigateConfig(coherence_threshold=0.5), meter
    )
    assert not changed and param.grad.tolist() == [2.0, 2.0]  # the plain sum, untouched
    assert meter.result("train")["train/generator/slot_damping"] == 1.0
    # above a lower threshold the same slots are damped by 1 / (1 + 2c)
    own, param = parts_with(grads)
    _mitigate(
        own, list(grads), ["generator"], False, MitigateConfig(coherence_threshold=0.4), Meter()
    )
    assert param.grad.tolist() == pytest.approx([2.0 / (1 + 2 * c)] * 2)


def test_role_balance_gives_each_role_the_mean_gradient_mass():
    grads = {"aggregator": [0.0, 1.0], "generator": [3.0, 0.0]}
    own, param = parts_with(grads)
    meter = Meter()
    changed = _mitigate(
        own,
        list(grads),
        ["aggregator", "generator"],
        True,
        MitigateConfig(role_balance=True),
        meter,
    )
    assert changed and param.grad.tolist() == pytest.approx([2.0, 2.0])  # target (3 + 1) / 2
    values = meter.result("train")  # measured before the mitigation: what the roles pushed
    assert values["train/generator/grad_mass_share"] == pytest.approx(0.75)
    assert values["train/aggregator/grad_norm_own"] == pytest.approx(1.0)


def test_without_mitigation_the_gradient_is_the_sum_and_only_measured():
    grads = {"aggregator": [0.0, 1.0], "generator": [3.0, 0.0]}
    own, param = parts_with(grads)
    meter = Meter()
    assert not _mitigate(
        own, list(grads), ["aggregator", "generator"], True, MitigateConfig(), meter
    )
    assert param.grad.tolist() == [3.0, 1.0]
    assert meter.result("train")["train/aggregator/grad_mass_share"] == pytest.approx(0.25)


def test_kl_coef_names_roles_of_the_workflow_and_finite_weights():
    check_run_config(resolve({"mitigate": {"kl_coef": {"aggregator": 0.05}}}))
    every = resolve({"mitigate": {"kl_coef": {"*": 0.1, "aggregator": 0.05}}})
    check_run_config(every)  # '*': every role not named, in any workflow
    assert every.mitigate.kl_weight("generator") == 0.1
    assert every.mitigate.kl_weight("aggregator") == 0.05
    assert resolve({}).mitigate.kl_weight("generator") == 0.0
    with pytest.raises(
        ConfigError, match="mitigate.kl_coef.*evaluator.*valid: generator, aggregator"
    ):
        check_run_config(resolve({"mitigate": {"kl_coef": {"evaluator": 0.05}}}))
    with pytest.raises(ConfigError, match="mitigate.kl_coef"):
        resolve({"mitigate": {"kl_coef": {"aggregator": -1.0}}})
    with pytest.raises(ConfigError, match="mitigate.coherence_threshold"):
        resolve({"mitigate": {"coherence_threshold": 1.5}})


def test_agent_wise_normalisation_is_the_role_scope_under_role_credit():
    """Dr. MAS (Feng et al. 2026): agent k's advantage is (R - mu_k) / sigma_k, mu_k and sigma_k
    over agent k's own turns in the problem's group. Two episodes of one problem; the generator
    (three slots) earns rewards around 0.5, the aggregator 0 or 1."""
    gen = {(0, 0): 1.0, (0, 1): 0.0, (0, 2): 1.0, (1, 0): 0.0, (1, 1): 0.0, (1, 2): 1.0}
    agg = {0: 1.0, 1: 0.0}
    rows = CreditRows(
        episode=[], group=[], role=[], slot=[], round=[], episode_reward=[], own_reward=[]
    )
    for (e, slot), r in gen.items():
        for col, v in zip(
            ("episode", "group", "role", "slot", "round", "episode_reward", "own_reward"),
            (e, 0, "generator", slot, 0, agg[e], r),
            strict=True,
        ):
            getattr(rows, col).append(v)
    for e, r in agg.items():
        for col, v in zip(
            ("episode", "group", "role", "slot", "round", "episode_reward", "own_reward"),
            (e, 0, "aggregator", 0, 0, r, r),
            strict=True,
        ):
            getattr(rows, col).append(v)
    adv, _, _ = turn_advantages(rows, "role", eps=1e-6)
    mu, sd = statistics.fmean(gen.values()), statistics.stdev(gen.values())
    want_gen = [(r - mu) / (sd + 1e-6) for r in gen.values()]
    mu_a, sd_a = statistics.fmean(agg.values()), statistics.stdev(agg.values())
    want_agg = [(r - mu_a) / (sd_a + 1e-6) for r in agg.values()]
    assert adv.tolist() == pytest.approx(want_gen + want_agg)
    # scope=problem under role credit is per slot (each slot its own two turns): not agent-wise
    pooled, _, _ = turn_advantages(rows, "problem", eps=1e-6)
    assert pooled.tolist() != pytest.approx(adv.tolist())
