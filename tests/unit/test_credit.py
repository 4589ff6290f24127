"""Per-role credit: each turn's own reward, and advantages grouped per slot."""

from __future__ import annotations

import pytest

from marlow.algo.turn_advantages import CreditRows, turn_advantages
from marlow.rewards.math import grade_math
from marlow.training.batch import credit_rows
from marlow.types import Episode, Turn
from marlow.workflows import build_workflow, workflow_names
from marlow.workflows.role_rewards import assign_role_rewards

KIND = {r: k for w in workflow_names() for r, k in build_workflow(w).kinds.items()}


def advantages(episodes, scope, eps):
    """{id(turn): advantage} and frac_reward_zero_std, through the batch record's columns."""
    turns, rows = credit_rows(episodes)
    adv, frac, _ = turn_advantages(rows, scope, eps)
    return {id(t): a for t, a in zip(turns, adv.tolist(), strict=True)}, frac


def turn(role: str, text: str, slot: int = 0, rnd: int = 0) -> Turn:
    return Turn(
        role=role,
        slot=slot,
        round=rnd,
        adapter="p",
        prompt_text="",
        prompt_ids=[1],
        completion_ids=[2],
        sampler_logprobs=[0.0],
        finish_reason="stop",
        completion_text=text,
        kind=KIND[role],
    )


def grade(text: str) -> float:
    return grade_math(text, "12")


def test_voters_get_their_own_grade_and_the_aggregator_the_episode_reward():
    turns = [
        turn("generator", "\\boxed{12}", 0),
        turn("generator", "\\boxed{13}", 1),
        turn("generator", "no answer", 2),
        turn("aggregator", "\\boxed{2}"),
    ]
    assign_role_rewards(turns, episode_reward=0.0, grade=grade)
    assert [t.reward for t in turns] == [1.0, 0.0, -0.1, 0.0]


@pytest.mark.parametrize(
    ("answer", "verdict", "expected"),
    [
        ("\\boxed{13}", "\\boxed{Incorrect}", 1.0),
        ("\\boxed{13}", "\\boxed{Correct}", 0.0),
        ("\\boxed{12}", "\\boxed{Correct}", 1.0),
        ("\\boxed{12}", "\\boxed{Incorrect}", 0.0),
        ("\\boxed{12}", "looks fine", 0.0),
    ],
)
def test_an_evaluator_is_rewarded_for_a_right_verdict_on_the_answer_it_reviewed(
    answer, verdict, expected
):
    turns = [
        turn("generator", "\\boxed{1}"),
        turn("evaluator", "\\boxed{Incorrect}"),
        turn("generator", answer, rnd=1),
        turn("evaluator", verdict, rnd=1),
    ]
    assign_role_rewards(turns, episode_reward=1.0, grade=grade)
    assert turns[1].reward == 1.0  # the first answer was wrong and was called Incorrect
    assert turns[3].reward == expected


def test_role_credit_advantages_are_normalised_per_slot():
    episodes = []
    for sample, (v0, v1, agg) in enumerate([(1.0, 0.0, 1.0), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)]):
        ts = [turn("generator", "", 0), turn("generator", "", 1), turn("aggregator", "")]
        for t, r in zip(ts, (v0, v1, agg), strict=True):
            t.reward = r
        episodes.append(Episode(problem_id="p", group=0, sample=sample, turns=ts, reward=agg))
    adv, _ = advantages(episodes, "problem", eps=1e-6)
    # slot 0 rewards (1, 0, 1): mean 2/3, sample std sqrt(1/3)
    s = (1 / 3) ** 0.5
    assert adv[id(episodes[1].turns[0])] == pytest.approx((0 - 2 / 3) / (s + 1e-6))
    # slot 1 rewards (0, 0, 1) are normalised apart from slot 0
    assert adv[id(episodes[2].turns[1])] == pytest.approx((1 - 1 / 3) / (s + 1e-6))
    assert adv[id(episodes[0].turns[1])] == pytest.approx((0 - 1 / 3) / (s + 1e-6))


def test_own_reward_is_reported_per_role():
    from marlow.diagnostics.metrics import Meter, episode_metrics

    turns = [
        turn("generator", "\\boxed{12}", 0),
        turn("generator", "\\boxed{13}", 1),
        turn("aggregator", "\\boxed{1}"),
    ]
    assign_role_rewards(turns, episode_reward=1.0, grade=grade)
    meter = Meter()
    episode_metrics(
        meter, [Episode(problem_id="p", group=0, sample=0, turns=turns, reward=1.0, correct=True)]
    )
    out = meter.result("train")
    assert out["train/generator/own_reward"] == 0.5 and out["train/aggregator/own_reward"] == 1.0
    assert out["train/generator/reward"] == 1.0 and "train/all/own_reward" not in out


def _role_credit_episodes(own: list[tuple[float, float, float]], episode_reward: float):
    """One problem; each episode: generators at slots 0 and 1, then the aggregator, with the
    given own rewards and the same episode reward for every episode."""
    episodes = []
    for sample, rewards in enumerate(own):
        ts = [turn("generator", "", 0), turn("generator", "", 1), turn("aggregator", "")]
        for t, r in zip(ts, rewards, strict=True):
            t.reward = r
        episodes.append(
            Episode(problem_id="p", group=0, sample=sample, turns=ts, reward=episode_reward)
        )
    return episodes


def test_frac_reward_zero_std_counts_the_groups_that_define_the_advantages():
    # Every episode reward is 1.0, so the old count (episode rewards per problem) said 1.0. The
    # advantages come from the own rewards per slot: slot 0 (1, 0) varies, slot 1 (1, 1) and the
    # aggregator (1, 1) are flat -> 2 of 3 groups give no gradient.
    episodes = _role_credit_episodes([(1.0, 1.0, 1.0), (0.0, 1.0, 1.0)], episode_reward=1.0)
    adv, frac = advantages(episodes, "problem", eps=1e-6)
    assert frac == pytest.approx(2 / 3, abs=1e-12)
    assert adv[id(episodes[0].turns[0])] > 0 and adv[id(episodes[0].turns[1])] == 0
    # Broadcast credit, two problems: one with rewards (1, 0), one flat (1, 1) -> 1 / 2.
    for ep in episodes:
        for t in ep.turns:
            t.reward = None
    flat = [Episode("q", 1, s, [turn("generator", "")], reward=1.0) for s in range(2)]
    episodes[1].reward = 0.0
    assert advantages([*episodes, *flat], "problem", eps=1e-6)[1] == 0.5
    # Per-slot scope on broadcast rewards: the same two groups per role-slot as per problem.
    assert advantages([*episodes, *flat], "slot", eps=1e-6)[1] == pytest.approx(1 / 4)


def test_role_scope_is_honoured_under_role_credit():
    # Own generator rewards: slot 0 (1, 0), slot 1 (0, 0). Per slot, slot 1 is flat (A = 0);
    # per role, the four generator turns (1, 0, 0, 0) are one group: mean 1/4,
    # Bessel std sqrt((9/16 + 3 * 1/16) / 3) = 1/2, so slot 1's turns get (0 - 1/4) / (1/2 + eps).
    episodes = _role_credit_episodes([(1.0, 0.0, 1.0), (0.0, 0.0, 0.0)], episode_reward=0.0)
    per_slot, _ = advantages(episodes, "slot", eps=1e-6)
    per_role, _ = advantages(episodes, "role", eps=1e-6)
    assert per_slot[id(episodes[0].turns[1])] == 0.0
    assert per_role[id(episodes[0].turns[1])] == pytest.approx(-0.25 / (0.5 + 1e-6), abs=1e-12)
    assert per_role[id(episodes[0].turns[0])] == pytest.approx(0.75 / (0.5 + 1e-6), abs=1e-12)
    assert advantages(episodes, "problem", eps=1e-6)[0] == per_slot


def test_credit_is_a_pure_function_of_its_columns():
    # Two problems, broadcast credit, scope problem: episodes 0 and 1 (problem 0) rewarded 1 and
    # 0, episode 2 (problem 1) alone. Every turn of an episode shares its advantage; the lone
    # episode follows verl (A = R / (1 + eps)); the role weight scales the aggregator's turns and
    # same-role weighting divides by the 2 generator turns of each episode.
    rows = CreditRows(
        episode=[0, 0, 0, 1, 1, 1, 2],
        group=[0, 0, 0, 0, 0, 0, 1],
        role=["generator", "generator", "aggregator"] * 2 + ["generator"],
        slot=[0, 1, 0] * 2 + [0],
        round=[0] * 7,
        episode_reward=[1.0] * 3 + [0.0] * 3 + [0.5],
        own_reward=[None] * 7,
    )
    a = 0.5 / ((0.5**0.5) + 1e-6)  # (1 - 1/2) / (Bessel std of (1, 0) + eps)
    adv, frac, _ = turn_advantages(rows, "problem", 1e-6)
    assert adv.tolist() == pytest.approx([a, a, a, -a, -a, -a, 0.5 / (1 + 1e-6)], abs=1e-12)
    assert frac == 0.0
    weighted, _, _ = turn_advantages(
        rows, "problem", 1e-6, same_role_weighting=True, role_weights={"aggregator": 2.0}
    )
    assert weighted.tolist()[:3] == pytest.approx([a / 2, a / 2, 2 * a], abs=1e-12)
    with pytest.raises(ValueError, match="valid: problem, role, slot"):
        turn_advantages(rows, "episode", 1e-6)


def test_zero_std_fractions_of_shards_merge_weighted_by_their_groups():
    """Data-parallel ranks hold whole problems; under the slot scope a problem's groups vary
    (Eval-Opt: a revision round some episodes reach). Weighted by groups, the ranks' fractions
    give the whole batch's; weighted by problems they would not."""

    def rows_of(problems):
        cols = {
            k: []
            for k in ("episode", "group", "role", "slot", "round", "episode_reward", "own_reward")
        }
        for g, rounds, rewards in problems:
            for e, (r, reach) in enumerate(zip(rewards, rounds, strict=True)):
                for rnd in range(reach + 1):
                    for col, v in zip(
                        cols, (g * 10 + e, g, "generator", 0, rnd, r, None), strict=True
                    ):
                        cols[col].append(v)
        return CreditRows(**cols)

    flat = (0, [0, 0], [1.0, 1.0])  # one round, equal rewards: 1 group, flat
    deep = (1, [2, 2], [0.0, 1.0])  # three rounds each: 3 groups, none flat
    _, whole, groups = turn_advantages(rows_of([flat, deep]), "slot", 1e-6)
    assert (whole, groups) == (1 / 4, 4)
    parts = [turn_advantages(rows_of([p]), "slot", 1e-6) for p in (flat, deep)]
    merged = sum(f * n for _, f, n in parts) / sum(n for _, _, n in parts)
    assert merged == pytest.approx(whole)
    assert sum(f for _, f, _ in parts) / 2 != pytest.approx(whole)  # per problem: 0.5
