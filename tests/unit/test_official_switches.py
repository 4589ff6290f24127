"""Every switch between marlow's behaviour and the study's official code: hand-made
cases where the two choices give different, hand-computed results."""

from __future__ import annotations

import math

import pytest
import torch

from marlow.parsers import selection_of, verdict_of
from marlow.policy.routing import make_routing
from marlow.types import Problem, SamplingParams
from marlow.workflows import build_workflow
from marlow.workflows.engine import run_episodes
from marlow.workflows.spec import EpisodeRules
from tests.conftest import DATA
from tests.unit.test_workflows import TOK, ScriptedEngine, grade

P0 = Problem("p0", "2+3", "5")


def episodes(wf, script, problems=(P0,), n=1, style="tiny", **rules):
    """``n`` episodes per problem of ``wf`` answered by ``script``, under ``EpisodeRules(**rules)``."""
    return run_episodes(
        wf,
        list(problems),
        n,
        engine=ScriptedEngine(script),
        tokenizer=TOK,
        routing=make_routing("ip", wf.roles),
        grade=grade,
        task="math",
        style=style,
        sampling=SamplingParams(0.7, 16, 0),
        rules=EpisodeRules(**rules),
    )


# ---------------------------------------------------------------- parsers (workflow.parse)


@pytest.mark.parametrize(
    ("text", "n", "last_box", "first_match"),
    [
        ("\\boxed{2}", 3, 1, 1),
        ("I pick \\boxed{1}, no wait, \\boxed{3}", 3, 2, 0),  # first box vs last box
        ("Solution 2 is right; it gives \\boxed{42}", 3, None, 1),  # re-solved: digit fallback
        ("\\boxed{ 2 }", 3, 1, 1),  # spaces: last-box strips; first-match falls to the digit
        ("\\boxed{7} then 2", 3, None, None),  # first digit 7 is out of range: no further look
        ("\\boxed{9}\\boxed{2}", 3, 1, None),  # first box out of range -> digit 9 -> none
        ("candidate two", 3, None, None),
        ("12 apples, \\boxed{1}", 3, 0, 0),  # '12' is not a standalone digit 1-9
    ],
)
def test_selection_rules(text, n, last_box, first_match):
    assert selection_of(text, n) == last_box
    assert selection_of(text, n, "last-box") == last_box
    assert selection_of(text, n, "first-match") == first_match


@pytest.mark.parametrize(
    ("text", "last_box", "first_match"),
    [
        ("\\boxed{Correct}", True, True),
        ("\\boxed{incorrect}", False, False),
        ("\\boxed{Incorrect} The answer is \\boxed{12}", None, False),  # re-solved, boxed last
        ("\\boxed{Correct} ... \\boxed{Incorrect}", False, True),
        ("\\boxed{ Correct }", True, None),  # first-match: nothing else inside the braces
        ("it is correct", None, None),
    ],
)
def test_verdict_rules(text, last_box, first_match):
    assert verdict_of(text) is last_box
    assert verdict_of(text, "first-match") is first_match


def test_an_unknown_parse_rule_names_the_valid_ones():
    with pytest.raises(ValueError, match="last-box, first-match"):
        verdict_of("\\boxed{Correct}", "first")


def _voting(rule: str, pick: str):
    wf = build_workflow("voting")
    answers = ["\\boxed{7}", "\\boxed{5}", "\\boxed{7}"]

    def script(prompt, i, call):
        return pick if prompt.endswith("Pick:") else answers[i % 3]

    return episodes(wf, script, parse=rule)[0]


def test_the_parse_rule_decides_what_voting_answers():
    """'Candidate 2 is right: \\boxed{7}' -- the aggregator re-solves and boxes an answer."""
    pick = "Candidate 2 is right: \\boxed{7}"
    marlow = _voting("last-box", pick)
    official = _voting("first-match", pick)
    assert marlow.counters == {"selection_fallback": 1} and marlow.reward == 0.0  # candidate 1
    assert official.counters == {} and official.reward == 1.0  # candidate 2: \boxed{5}
    assert official.final_answer == "\\boxed{5}"


def test_the_parse_rule_decides_the_evaluator_reward_under_role_credit():
    """An evaluator that says Incorrect, then re-solves and boxes a number last: under last-box
    the verdict is unparseable (reward 0), under first-match it is a right Incorrect (1)."""
    wf = build_workflow("eval_opt", rounds=1)

    def script(prompt, i, call):
        if call == 0:
            return "\\boxed{6}"  # wrong answer to 2+3
        if call == 1:
            return "\\boxed{Incorrect} since 2+3 = \\boxed{5}"
        return "\\boxed{5}"

    rewards = {}
    for rule in ("last-box", "first-match"):
        (ep,) = episodes(wf, script, credit="role", parse=rule)
        rewards[rule] = [(t.role, t.reward) for t in ep.turns]
    assert rewards["last-box"][1] == ("evaluator", 0.0)
    assert rewards["first-match"][1] == ("evaluator", 1.0)


# ------------------------------------------------ mini-batch unit (grpo.minibatch_unit)


@pytest.mark.parametrize(("unit", "updates"), [("turns", 8), ("prompts", 2)])
def test_the_minibatch_unit_sets_the_number_of_updates(small_config, tmp_path, unit, updates):
    """Voting under SP, 2 problems x 4 episodes x 4 turns = 32 turns, M = 4: in turns, 8
    updates of 4 turns; in prompts (verl's count), 4 x 4 = 16 turns per update, 2 updates."""
    from marlow.training.trainer import Trainer

    cfg = small_config(
        workflow={"name": "voting"},
        policy={"routing": "sp"},
        grpo={"batch_problems": 2, "group_size": 4, "minibatch_turns": 4, "minibatch_unit": unit},
    )
    assert cfg.grpo.update_turns == {"turns": 4, "prompts": 16}[unit]
    trainer = Trainer(cfg, tmp_path / "run")
    episodes = trainer.rollout(trainer.task.train_batch(0, 1, 2), 4, 0.7, seed=3)
    for ep in episodes:
        ep.reward = float(ep.sample % 2)  # every group has a spread: no update is skipped
    assert sum(len(ep.turns) for ep in episodes) == 32
    record = trainer.learn(1, episodes)
    assert record["train/shared/updates"] == updates


# ------------------------------------------------ LR schedule (optim.schedule_stepping)


def test_shared_uncapped_schedule_climbs_back_after_the_end():
    """verl's cosine is not capped: with two adapters on one shared clock (t advances 2 per
    step), S = 10, W = 0: the rate is lr0 * 0.5 * (1 + cos(pi * 2k / 10)) at step k -- 0 at step
    5, back to lr0 at step 10; per-role-update holds 0 from step 5 on."""
    from marlow.training.optim import AdapterOptimizers

    def rates(stepping: str) -> list[float]:
        params = {n: [torch.nn.Parameter(torch.ones(2))] for n in ("generator", "aggregator")}
        opt = AdapterOptimizers(
            params,
            lr=1.0,
            warmup=0,
            total=10,
            weight_decay=0.0,
            betas=(0.9, 0.999),
            grad_clip=1.0,
            stepping=stepping,
        )
        seen = []
        for _ in range(11):
            for name, ps in params.items():
                ps[0].grad = torch.ones(2)
                opt.update(name)
                if name == "generator":
                    seen.append(opt.optimizers[name].param_groups[0]["lr"])
                opt.end_role_update(name)
            opt.end_step()
        return seen

    uncapped = [0.5 * (1 + math.cos(math.pi * 2 * k / 10)) for k in range(11)]
    assert rates("shared-uncapped") == pytest.approx(uncapped, abs=1e-12)
    assert rates("shared-uncapped")[10] == pytest.approx(1.0)
    capped = rates("per-role-update")
    assert capped[:5] == pytest.approx(uncapped[:5], abs=1e-12)
    assert capped[5:] == [0.0] * 6


# ------------------------------------ advantage groups (grpo.advantage_scope=trajectory)


def test_trajectory_groups_reproduce_the_official_eval_opt_advantages():
    """4 right one-turn episodes and 4 wrong three-turn ones (generator turns of one problem):
    the official code's group holds 16 items (4 ones, 12 zeros): A = 0.75 / 0.4472 = +1.677 and
    -0.25 / 0.4472 = -0.559 (unbiased std); marlow's per-problem scope: 8 items, +-0.935."""
    from marlow.algo.turn_advantages import CreditRows, turn_advantages

    turns = [(e, 1.0) for e in range(4)] + [(e, 0.0) for e in range(4, 8) for _ in range(3)]
    n = len(turns)
    rows = CreditRows(
        episode=[e for e, _ in turns],
        group=[0] * n,
        role=["generator"] * n,
        slot=[0] * n,
        round=[0] * 4 + [r for _ in range(4) for r in (0, 1, 2)],
        episode_reward=[r for _, r in turns],
        own_reward=[None] * n,
        trajectory=["generator"] * n,
    )
    official, _, _ = turn_advantages(rows, "trajectory", eps=0.0)
    std = math.sqrt((4 * 0.75**2 + 12 * 0.25**2) / 15)
    assert official[:4].tolist() == pytest.approx([0.75 / std] * 4, abs=1e-12)
    assert official[4:].tolist() == pytest.approx([-0.25 / std] * 12, abs=1e-12)
    assert round(0.75 / std, 2) == 1.68 and round(-0.25 / std, 2) == -0.56
    marlow, _, _ = turn_advantages(rows, "problem", eps=0.0)
    assert marlow[:4].tolist() == pytest.approx([0.935414] * 4, abs=1e-6)
    assert marlow[4:].tolist() == pytest.approx([-0.935414] * 12, abs=1e-6)


def test_trajectory_names_keep_voters_apart_and_pool_workers_and_rounds():
    wfs = {name: build_workflow(name) for name in ("voting", "eval_opt", "orch_workers")}
    names = {
        name: sorted({st.trajectory_of(slot) for st in wf.stages for slot in range(st.slots)})
        for name, wf in wfs.items()
    }
    assert names["voting"] == ["aggregator", "generator0", "generator1", "generator2"]
    assert names["eval_opt"] == ["evaluator", "generator"]
    assert names["orch_workers"] == ["orchestrator", "synthesizer", "worker"]
    # the names reach the turns, and the groups: two problems x voting's 4 trajectories
    from marlow.algo.turn_advantages import turn_advantages
    from marlow.training.batch import credit_rows

    eps = _voting_episodes()
    turns, rows = credit_rows(eps)
    assert [t.trajectory for t in eps[0].turns] == [
        "generator0",
        "generator1",
        "generator2",
        "aggregator",
    ]
    adv, zero_std, _ = turn_advantages(rows, "trajectory", eps=1e-6)
    assert len(adv) == len(turns) == 2 * 2 * 4
    # rewards: episode reward broadcast to every turn; problem 0's episodes differ (1 and 0)
    assert zero_std == pytest.approx(4 / 8)  # problem 1: both episodes wrong, 4 flat groups


def _voting_episodes():
    wf = build_workflow("voting")

    def script(prompt, i, call):
        if prompt.endswith("Pick:"):
            return f"\\boxed{{{1 + i % 2}}}"  # episode 0 picks 1, episode 1 picks 2
        return ["\\boxed{5}", "\\boxed{6}", "\\boxed{7}"][i % 3]

    return episodes(wf, script, (P0, Problem("p1", "4+4", "9")), n=2)


# --------------------------- code reward (task.code_reward) and code block (task.code_block)

DOUBLE = {"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["2", "4", "6", "9"]}  # 3 of 4
HALF_RIGHT = "```python\nprint(2 * int(input()))\n```"


def test_code_reward_pass_rate_or_all_pass():
    from marlow.tasks.base import CodeGrader

    problem = Problem("c0", "double it", "", meta={"tests": DOUBLE})
    assert CodeGrader(2.0)(HALF_RIGHT, problem) == pytest.approx(0.75)
    assert CodeGrader(2.0, reward="all_pass")(HALF_RIGHT, problem) == 0.0
    every = {"inputs": ["1\n", "5\n"], "outputs": ["2", "10"]}
    whole = Problem("c1", "double it", "", meta={"tests": every})
    assert CodeGrader(2.0, reward="all_pass")(HALF_RIGHT, whole) == 1.0
    with pytest.raises(ValueError, match="pass_rate, all_pass"):
        CodeGrader(2.0, reward="fraction")


@pytest.mark.parametrize(
    ("completion", "fallback", "last_block"),
    [
        ("print(2 * int(input()))", "print(2 * int(input()))", None),  # no block: 0 officially
        (
            "```python\nprint(1)\n```\nthen\n```text\nnot code\n```",
            "print(1)\n",  # marlow prefers the last python-tagged block
            "not code\n",  # the official code: the last block, whatever its language
        ),
        ("```\nprint(3)\n```", "print(3)\n", "print(3)\n"),
    ],
)
def test_code_block_rules(completion, fallback, last_block):
    from marlow.parsers.code import extract_code

    assert extract_code(completion) == fallback
    assert extract_code(completion, "last-block") == last_block


def test_an_unfenced_program_scores_only_under_the_fallback_rule():
    from marlow.tasks.base import CodeGrader

    every = {"inputs": ["1\n", "5\n"], "outputs": ["2", "10"]}
    problem = Problem("c2", "double it", "", meta={"tests": every})
    bare = "print(2 * int(input()))"
    assert CodeGrader(2.0)(bare, problem) == 1.0
    assert CodeGrader(2.0, block_rule="last-block")(bare, problem) == 0.0


# ------------------------------------ Eval-Opt rounds (workflow.rounds_count)


@pytest.mark.parametrize(
    ("count", "rounds", "sequence"),
    [
        ("revisions", 3, "G E G E G E G"),
        ("judge-calls", 3, "G E G E G E"),  # the official math setting (max_iterations 3)
        ("revisions", 2, "G E G E G"),
        ("judge-calls", 2, "G E G E"),  # the official code setting (max_iterations 2)
        ("judge-calls", 1, "G E"),
    ],
)
def test_what_eval_opt_rounds_count(count, rounds, sequence):
    wf = build_workflow("eval_opt", count, rounds=rounds)
    assert " ".join(st.role[0].upper() for st in wf.stages) == sequence
    # an episode whose every verdict is Incorrect runs every stage, the last verdict included
    (ep,) = episodes(
        wf,
        lambda prompt, i, call: "\\boxed{Incorrect}" if call % 2 else "\\boxed{6}",
        credit="role",
    )
    assert " ".join(t.role[0].upper() for t in ep.turns) == sequence
    if count == "judge-calls":  # the final evaluator turn is trained: a right Incorrect earns 1
        assert ep.turns[-1].role == "evaluator" and ep.turns[-1].reward == 1.0


def test_a_workflow_parameter_may_not_be_named_rounds_count(tmp_path):
    from marlow.workflows.load import load_workflow
    from marlow.workflows.schema import WorkflowFileError

    text = (
        "params:\n  rounds_count: {default: 1}\nroles:\n  generator: {kind: answer}\n"
        "stages:\n  - {role: generator, prompt: generator/answer}\nanswer: last.generator\n"
    )
    (tmp_path / "w.yaml").write_text(text)
    with pytest.raises(WorkflowFileError, match="params.rounds_count"):
        load_workflow(tmp_path / "w.yaml")


# ------------------------------------ Orch-Workers worker count (workflow.workers)


@pytest.mark.parametrize(
    ("plan", "fixed", "parsed"),
    [
        # two STRATEGY items: fixed runs 3 workers (the third generic), parsed runs 2
        ("STRATEGY 1: direct\nSTRATEGY 2: check inverse", 3, ["direct", "check inverse"]),
        # a numbered list: marlow parses nothing (3 generic), the official code reads 3 items
        (
            "1. direct\n2) show carries\n3. check inverse",
            3,
            ["direct", "show carries", "check inverse"],
        ),
        # prose: lines longer than 10 characters, at most n
        (
            "work the columns\nok\ncheck by the inverse\nleft to right again\nmore",
            3,
            ["work the columns", "check by the inverse", "left to right again"],
        ),
        ("hm", 3, ["hm"]),  # nothing else: the whole text, one worker
        ("STRATEGY 2: b\nSTRATEGY 1: a", 3, ["a", "b"]),  # sorted by number
    ],
)
def test_orch_workers_run_one_worker_per_parsed_strategy(plan, fixed, parsed):
    from marlow.parsers import plan_of

    assert plan_of(plan, 3) == parsed
    wf = build_workflow("orch_workers")
    for workers, expect in (("fixed", fixed), ("parsed", len(parsed))):

        def script(prompt, i, call):
            return plan if call == 0 else "\\boxed{5}"

        (ep,) = episodes(wf, script, workers=workers)
        worker_turns = [t for t in ep.turns if t.role == "worker"]
        assert len(worker_turns) == expect, workers
        if workers == "parsed":  # each worker got its own parsed strategy, in order
            for t, strategy in zip(worker_turns, parsed, strict=True):
                assert strategy in t.prompt_text


# ------------------------------------ prompt cap (rollout.max_prompt_tokens)


def test_a_prompt_over_the_cap_ends_the_episode_before_that_stage():
    wf = build_workflow("eval_opt", rounds=2)

    def script(prompt, i, call):
        return "\\boxed{Incorrect}" if call % 2 else "\\boxed{6}"

    def run(cap):
        (ep,) = episodes(wf, script, max_prompt_tokens=cap)
        return ep

    free = run(None)
    lengths = [len(t.prompt_ids) for t in free.turns]
    assert [t.role for t in free.turns] == ["generator", "evaluator"] * 2 + ["generator"]
    revise = lengths[2]  # the first revision's prompt: the longest so far
    assert revise > max(lengths[:2])
    capped = run(revise - 1)
    assert [t.role for t in capped.turns] == ["generator", "evaluator"]
    assert capped.counters.get("prompt_cap") == 1
    assert capped.final_answer == "\\boxed{6}" and capped.reward == 0.0  # its last answer
    assert run(revise).counters.get("prompt_cap") is None  # a prompt of exactly the cap runs
    first = run(lengths[0] - 1)  # even the first prompt is too long: no turn, empty answer
    assert first.turns == [] and first.final_answer == "" and first.counters == {"prompt_cap": 1}


# ------------------------------------ data (task.hub_config, task.val_source)


def test_hub_config_reaches_the_hub_loader(monkeypatch):
    """DAPO's hub config: 'all' unless task.hub_config says otherwise (the official code: en)."""
    from marlow.config import resolve
    from marlow.tasks import base, loaders

    seen = []

    def fake_hub(hub_id, config, split):
        seen.append(config)
        return iter([{"prompt": f"What is {i}+1?", "solution": str(i + 1)} for i in range(30)])

    monkeypatch.setattr(loaders, "_read_hub", fake_hub)
    for hub_config, expect in ((None, "all"), ("en", "en")):
        task = {"source": "owner/dapo", "dataset": "dapo", "val_size": 5}
        if hub_config:
            task["hub_config"] = hub_config
        cfg = resolve({"preset": "tiny", "task": task})
        built = base.build_task(cfg.task)
        assert len(built.val_problems()) == 5 and seen[-1] == expect


def test_val_source_validates_on_its_own_problems_and_trains_on_the_whole_source():
    from marlow.config import resolve
    from marlow.tasks import base
    from marlow.tasks.loaders import load

    gsm8k, _ = load("gsm8k", DATA / "gsm8k_test.jsonl")
    math500, _ = load("math500", DATA / "math500_test.jsonl")
    task = {"source": str(DATA / "gsm8k_test.jsonl"), "dataset": "gsm8k", "val_size": 20}
    split = base.build_task(resolve({"preset": "tiny", "task": task}).task)
    assert len(split.val_problems()) == 20
    own = {**task, "val_source": str(DATA / "math500_test.jsonl"), "val_dataset": "math500"}
    built = base.build_task(resolve({"preset": "tiny", "task": own}).task)
    assert [p.id for p in built.val_problems()] == [p.id for p in math500[:20]]
    assert sorted(p.id for p in built._train) == sorted(p.id for p in gsm8k)


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"val_dataset": "math500"}, "task.val_dataset is only read with task.val_source"),
        ({"source": "x.jsonl", "dataset": "gsm8k", "val_source": "y.jsonl"}, "valid: gsm8k"),
        ({"val_source": "y.jsonl", "val_dataset": "math500"}, "needs a dataset source"),
        (
            {"source": "x.jsonl", "dataset": "gsm8k", "hub_config": "en"},
            "only for task.dataset dapo",
        ),
    ],
)
def test_bad_data_switches_fail_in_one_line(task, message):
    from marlow.config import ConfigError, resolve

    with pytest.raises(ConfigError, match=message):
        resolve({"preset": "tiny", "task": task})


# ------------------------------------ Eval-Opt context (workflow.context)


def test_conversation_context_sends_the_episode_so_far_before_each_prompt():
    from marlow.prompts.chat import chat_prompt_ids, chat_prompt_text

    wf = build_workflow("eval_opt", rounds=1)

    def script(prompt, i, call):
        return ["\\boxed{6}", "\\boxed{Incorrect}", "\\boxed{5}"][call]

    turns = {}
    for context in ("latest", "conversation"):
        (ep,) = episodes(wf, script, context=context)
        turns[context] = ep.turns
    latest, conv = turns["latest"], turns["conversation"]
    # the same calls with the same own prompts; only what precedes them differs
    assert [t.prompt_text for t in latest] == [t.prompt_text for t in conv]
    for t in latest:
        assert t.prompt_ids == chat_prompt_ids(TOK, t.prompt_text)
    first = conv[0].prompt_text
    assert conv[0].prompt_ids == latest[0].prompt_ids  # nothing before the first call
    history = [("user", first), ("assistant", "\\boxed{6}")]
    assert conv[1].prompt_ids == chat_prompt_ids(TOK, conv[1].prompt_text, history)
    history.append(("assistant", "\\boxed{Incorrect}"))
    assert conv[2].prompt_ids == chat_prompt_ids(TOK, conv[2].prompt_text, history)
    rendered = chat_prompt_text(TOK, conv[2].prompt_text, history)
    assert rendered.count("<|im_start|>assistant\n") == 3  # two outputs, then the header
    assert rendered.index("\\boxed{6}") < rendered.index("\\boxed{Incorrect}")


def test_conversation_context_leaves_workflows_without_a_shared_history_alone():
    """The official Voting builds each prompt alone: voting.yaml does not declare a shared
    conversation, so workflow.context=conversation changes none of its prompts."""
    assert build_workflow("eval_opt").conversation and not build_workflow("voting").conversation
    wf = build_workflow("voting")
    ids = {}
    for context in ("latest", "conversation"):
        (ep,) = episodes(
            wf,
            lambda p, i, c: "\\boxed{1}" if p.endswith("Pick:") else "\\boxed{5}",
            context=context,
        )
        ids[context] = [t.prompt_ids for t in ep.turns]
    assert ids["latest"] == ids["conversation"]


def test_each_switch_field_takes_exactly_its_modules_choices():
    """The config's Literal of each switch and the tuple its module checks are one list."""
    from typing import get_args

    from marlow.algo.turn_advantages import SCOPES
    from marlow.config import GRPOConfig, TaskConfig, WorkflowConfig
    from marlow.parsers import PARSE_RULES
    from marlow.parsers.code import BLOCK_RULES
    from marlow.tasks.base import CODE_REWARDS
    from marlow.workflows.load import ROUNDS_COUNTS

    def choices(model, name):
        return get_args(model.model_fields[name].annotation)

    assert choices(WorkflowConfig, "parse") == PARSE_RULES
    assert choices(WorkflowConfig, "rounds_count") == ROUNDS_COUNTS
    assert choices(TaskConfig, "code_block") == BLOCK_RULES
    assert choices(TaskConfig, "code_reward") == CODE_REWARDS
    assert choices(GRPOConfig, "advantage_scope") == SCOPES


def test_the_prompt_cap_keeps_every_call_inside_the_models_positions():
    """A shared conversation grows every turn; a run caps prompts at the model's positions minus
    the completion's room, so no call runs the model past them (the tiny model has 512)."""
    from marlow.config import ConfigError

    rules = EpisodeRules(context="conversation")
    assert rules.within_context(512, 96).max_prompt_tokens == 416
    assert EpisodeRules(max_prompt_tokens=100).within_context(512, 96).max_prompt_tokens == 100
    assert rules.within_context(None, 96) == rules
    with pytest.raises(ConfigError, match="rollout.max_new_tokens"):
        rules.within_context(64, 64)
    wf = build_workflow("eval_opt", rounds=3)
    long = "\\boxed{6} " + "x" * 60  # a long wrong answer; the critique says Incorrect
    script = lambda p, i, c: long if c % 2 == 0 else "\\boxed{Incorrect}"  # noqa: E731
    free = episodes(wf, script, context="conversation")[0]
    assert max(len(t.prompt_ids) for t in free.turns) > 200 - 16  # past the room uncapped
    (ep,) = episodes(wf, script, **vars(rules.within_context(200, 16)))
    assert ep.turns and all(len(t.prompt_ids) <= 200 - 16 for t in ep.turns)
    assert ep.counters.get("prompt_cap") == 1  # it ended where the next prompt would pass


def test_a_prompt_past_the_positions_is_tokenized_without_a_warning():
    """The engine caps such a prompt itself (counted); the tokenizer's "longer than the
    specified maximum sequence length" warning was noise in marlow's output."""
    import io
    import logging

    from transformers.utils import logging as hf_logging

    from marlow.prompts.chat import chat_prompt_ids

    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    hf_logging.get_logger().addHandler(handler)
    try:
        assert TOK.model_max_length == 512  # the tiny tokenizer knows its model's positions
        ids = chat_prompt_ids(TOK, "Q: " + "1+1 " * 200)
    finally:
        hf_logging.get_logger().removeHandler(handler)
    assert len(ids) > 512 and seen.getvalue() == ""
