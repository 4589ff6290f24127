"""The workflow engine on scripted completions: answer rules, fallbacks, counters, batching."""

from __future__ import annotations

import pytest

from marlow.policy.routing import make_routing
from marlow.prompts.chat import chat_prompt_ids
from marlow.rewards import grade_math
from marlow.tiny.tokenizer import build_tokenizer
from marlow.types import Completion, Problem, SamplingParams
from marlow.workflows import build_workflow, workflow_names
from marlow.workflows.engine import run_episodes

TOK = build_tokenizer()


class ScriptedEngine:
    """Answers each prompt with ``script(role_cue, prompt_text, call_index)``; records calls."""

    def __init__(self, script):
        self.script = script
        self.calls: list[list] = []

    def generate(self, requests, params):
        self.calls.append(list(requests))
        out = []
        for i, r in enumerate(requests):
            rendered = TOK.decode(
                r.prompt_ids, skip_special_tokens=True
            )  # "user\n...\nassistant\n"
            prompt = rendered.removeprefix("user\n").removesuffix("\nassistant\n")
            text = self.script(prompt, i, len(self.calls) - 1)
            ids = TOK(text, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
            out.append(Completion(ids, [-0.5] * len(ids), "stop", text))
        return out


def grade(text, problem):
    return grade_math(text, problem.answer)


def run(name, script, problems, n=2, routing="ip", **params):
    wf = build_workflow(name, **params)
    engine = ScriptedEngine(script)
    eps = run_episodes(
        wf,
        problems,
        n,
        engine=engine,
        tokenizer=TOK,
        routing=make_routing(routing, wf.roles),
        grade=grade,
        task="math",
        style="tiny",
        sampling=SamplingParams(0.7, 16, 0),
    )
    return eps, engine


PROBLEMS = [Problem("p0", "2+3", "5"), Problem("p1", "4+4", "8")]


def test_voting_selects_candidate_and_tracks_pass_and_majority():
    answers = {0: "\\boxed{5}", 1: "\\boxed{7}", 2: "\\boxed{7}"}

    def script(prompt, i, call):
        if prompt.endswith("Pick:"):
            return "\\boxed{1}" if "2+3" in prompt else "\\boxed{9}"  # 9: out of range
        return answers[i % 3]

    eps, engine = run("voting", script, PROBLEMS)
    assert len(engine.calls) == 2  # one generation call per stage
    assert len(engine.calls[0]) == 2 * 2 * 3 and len(engine.calls[1]) == 2 * 2
    p0, p1 = eps[0], eps[2]
    assert p0.final_answer == "\\boxed{5}" and p0.reward == 1.0 and p0.correct
    assert p0.info == {"pass_at_n": 1.0, "majority_correct": 0.0}  # 7 wins the vote 2:1
    assert p1.counters == {"selection_fallback": 1} and p1.final_answer == "\\boxed{5}"
    assert p1.reward == 0.0 and p1.info["pass_at_n"] == 0.0
    assert [t.slot for t in p0.turns] == [0, 1, 2, 0]
    # candidates reach the aggregator numbered, in slot order
    assert "1) \\boxed{5}\n2) \\boxed{7}\n3) \\boxed{7}\nPick:" in p0.turns[-1].prompt_text


def test_turns_store_the_exact_prompt_ids_and_policy():
    eps, _ = run("voting", lambda p, i, c: "\\boxed{1}", PROBLEMS[:1], n=1, routing="sp")
    for t in eps[0].turns:
        assert t.prompt_ids == chat_prompt_ids(TOK, t.prompt_text)
        assert t.adapter == "shared"


@pytest.mark.parametrize(
    ("verdicts", "gens", "rounds_used"),
    [
        (["Correct"], 1, 0),  # accepted at once
        (["Incorrect", "Correct"], 2, 1),  # one revision then accepted
        (["Incorrect"] * 5, 4, 3),  # rounds run out: 3 revisions, 3 verdicts
        (["maybe", "Correct"], 2, 1),  # unparseable verdict counts as Incorrect
    ],
)
def test_eval_opt_revision_loop(verdicts, gens, rounds_used):
    state = {"eval": 0}

    def script(prompt, i, call):
        if prompt.endswith("Check:"):
            v = verdicts[min(state["eval"], len(verdicts) - 1)]
            state["eval"] += 1
            return f"ok; \\boxed{{{v}}}"
        return f"\\boxed{{{call}}}"  # each generator call answers its call index

    eps, _ = run("eval_opt", script, PROBLEMS[:1], n=1, rounds=3)
    ep = eps[0]
    roles = [t.role for t in ep.turns]
    assert roles.count("generator") == gens
    assert roles.count("evaluator") == min(gens, 3)  # no verdict after the last revision
    assert ep.info["rounds_used"] == rounds_used
    # final answer = the last generator turn; generator calls are stage calls 0, 2, 4, 6
    assert ep.final_answer == f"\\boxed{{{2 * (gens - 1)}}}"
    if verdicts[0] == "maybe":
        assert ep.counters["verdict_unparsed"] == 1
        assert "C: ok; \\boxed{maybe}\nFix:" in ep.turns[2].prompt_text


def test_orch_workers_fill_missing_strategies_and_follow_them():
    def script(prompt, i, call):
        if prompt.endswith("Plan 3:"):
            return "STRATEGY 1: split tens\nSTRATEGY 3: check inverse\nnoise"
        if prompt.endswith("Final:"):
            return "\\boxed{5}"
        return "\\boxed{4}"

    eps, engine = run("orch_workers", script, PROBLEMS[:1], n=1)
    ep = eps[0]
    workers = [t for t in ep.turns if t.role == "worker"]
    assert [w.prompt_text.split("S: ")[1].split("\n")[0] for w in workers] == [
        "split tens",
        "direct",
        "check inverse",
    ]
    assert ep.counters == {"strategies_parsed": 2, "strategy_missing": 1}
    assert ep.final_answer == "\\boxed{5}" and ep.reward == 1.0
    assert [len(c) for c in engine.calls] == [1, 3, 1]


def test_unknown_workflow_lists_valid_names():
    with pytest.raises(ValueError, match="valid: eval_opt, orch_workers, single, test_fix, voting"):
        build_workflow("debate")
    assert workflow_names() == ["eval_opt", "orch_workers", "single", "test_fix", "voting"]
