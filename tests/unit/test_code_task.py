"""The code task: config, the batched and cached grader, and the workflows on code answers."""

from __future__ import annotations

import pickle

import pytest

from marlow.config import ConfigError, resolve
from marlow.policy.routing import make_routing
from marlow.rewards import code as code_reward
from marlow.tasks import build_task
from marlow.tasks.base import CodeGrader
from marlow.tiny import codegen
from marlow.tiny.tokenizer import build_tokenizer
from marlow.types import Completion, SamplingParams
from marlow.workflows import build_workflow
from marlow.workflows.engine import run_episodes
from marlow.workflows.spec import EpisodeRules
from marlow.workflows.votes import majority_index
from tests.conftest import DATA

TOK = build_tokenizer()


def task_config(**task):
    return resolve({"preset": "tiny", "task": task}).task


def test_config_errors_name_the_field_and_the_choices():
    with pytest.raises(ConfigError, match="'task.name' is 'chess'; valid: math, code, custom"):
        task_config(name="chess")
    with pytest.raises(
        ConfigError, match="task.dataset.*for task code.*valid: humaneval, deepcoder"
    ):
        task_config(name="code", source="x.jsonl", dataset="gsm8k")
    with pytest.raises(ConfigError, match="valid: gsm8k, math500, dapo"):
        task_config(name="math", source="x.jsonl", dataset="humaneval")
    with pytest.raises(ConfigError, match="task.subset.*valid: primeintellect, taco"):
        task_config(name="code", source="x.jsonl", dataset="deepcoder")
    with pytest.raises(ConfigError, match="task.subset is only for"):
        task_config(name="code", source="x.jsonl", dataset="humaneval", subset="taco")
    with pytest.raises(ConfigError, match="at most 1000 validation problems"):
        task_config(name="code", val_size=1001)
    with pytest.raises(ConfigError, match="task.dataset is only for a file"):
        task_config(name="code", dataset="humaneval")
    assert task_config(name="code").name == "code"


def test_tiny_code_task_streams_code_problems_with_tests():
    task = build_task(task_config(name="code", val_size=12))
    batch = task.train_batch(0, 1, 5)
    assert len(batch) == 5 and all("tests" in p.meta for p in batch)
    assert [p.id for p in task.train_batch(0, 1, 5)] == [p.id for p in batch]
    assert [p.id for p in task.train_batch(0, 2, 5)] != [p.id for p in batch]
    val = task.val_problems()
    assert [p.id for p in val] == [p.id for p in codegen.val_problems(12)]
    grade = task.grader()
    assert isinstance(grade, CodeGrader) and grade.timeout_s == 2.0
    assert pickle.loads(pickle.dumps(grade)).timeout_s == 2.0


def test_humaneval_file_loads_as_a_code_task():
    task = build_task(
        task_config(
            name="code",
            source=str(DATA / "HumanEval.jsonl.gz"),
            dataset="humaneval",
            val_size=150,
        )
    )
    val = task.val_problems()
    assert len(val) == 150 and "check" in val[0].meta["tests"]
    p = val[0]
    solution = f"```python\n{p.prompt}{p.meta['canonical_solution']}\n```"
    grade = task.grader()
    assert grade.timeout_s == 6.0
    assert grade(solution, p) == 1.0
    assert grade("```python\npass\n```", p) == 0.0


def test_grader_batches_dedups_and_caches(monkeypatch):
    problem = next(p for p in codegen.val_problems(40) if p.meta["bug"] is not None)
    spec = codegen.spec_of(problem)
    right, bug = codegen.fence(spec.right), codegen.fence(spec.bug)
    calls: list[int] = []
    real = code_reward.score_code_batch

    def counting(items, **kw):
        calls.append(len(items))
        assert kw["suite"] is True
        return real(items, **kw)

    monkeypatch.setattr(code_reward, "score_code_batch", counting)
    grade = CodeGrader(2.0)
    grade.prefetch([(right, problem), (bug, problem), (right, problem), ("no code", problem)])
    assert calls == [2]  # one batch, each distinct program once, no run for a text without code
    assert grade(right, problem) == 1.0 and grade(bug, problem) < 1.0
    assert grade("no code", problem) == 0.0
    assert calls == [2]  # served from the cache
    grade(codegen.fence(spec.typos[0]) + "\n", problem)
    assert len(calls) == 2  # a miss grades on its own
    small = CodeGrader(2.0, cache_size=1)
    small.prefetch([(right, problem), (bug, problem)])
    assert len(small._cache) == 1


def test_a_sandbox_failure_scores_zero_is_counted_and_never_cached(monkeypatch):
    problem = next(p for p in codegen.val_problems(40) if p.meta["bug"] is not None)
    right = codegen.fence(codegen.spec_of(problem).right)
    real = code_reward.score_code_batch
    broken = {"on": True}

    def flaky(items, **kw):
        if broken["on"]:  # as when the sandbox cannot set up: no verdict on the program
            failed = code_reward.TestOutcome(False, "sandbox_error", "unshare failed")
            return [code_reward.CodeScore(0.0, [failed]) for _ in items]
        return real(items, **kw)

    monkeypatch.setattr(code_reward, "score_code_batch", flaky)
    grade = CodeGrader(2.0)
    grade.prefetch([(right, problem)])
    assert grade(right, problem) == 0.0 and grade.sandbox_errors == 1
    assert grade.last_sandbox_error == "unshare failed"
    broken["on"] = False
    assert grade(right, problem) == 1.0  # graded again, not served a cached 0
    assert grade.sandbox_errors == 1


def test_the_greedy_report_counts_programs_the_sandbox_failed_on(monkeypatch):
    from marlow.worlds import tinyeval

    problems = codegen.val_problems(6)
    rights = [codegen.fence(codegen.spec_of(p).right) for p in problems]
    scores = tinyeval.answer_scores(rights, problems, "code")
    assert scores["sandbox_errors"] == 0 and scores["accuracy"] == 1.0
    real = code_reward.score_code_batch

    def half_broken(items, **kw):  # the sandbox fails to set up for the first program only
        scores = real(items, **kw)
        failed = code_reward.TestOutcome(False, "sandbox_error", "unshare failed")
        return [code_reward.CodeScore(0.0, [failed])] + scores[1:]

    monkeypatch.setattr(code_reward, "score_code_batch", half_broken)
    scores = tinyeval.answer_scores(rights, problems, "code")
    assert scores["sandbox_errors"] == 1 and scores["accuracy"] == 5 / 6


class ScriptedEngine:
    def __init__(self, script):
        self.script = script

    def generate(self, requests, params):
        out = []
        for i, r in enumerate(requests):
            rendered = TOK.decode(r.prompt_ids, skip_special_tokens=True)
            prompt = rendered.removeprefix("user\n").removesuffix("\nassistant\n")
            text = self.script(prompt, i)
            ids = TOK(text, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
            out.append(Completion(ids, [-0.5] * len(ids), "stop", text))
        return out


def run(name, script, problems, n=2, **params):
    wf = build_workflow(name, **params)
    return run_episodes(
        wf,
        problems,
        n,
        engine=ScriptedEngine(script),
        tokenizer=TOK,
        routing=make_routing("ip", wf.roles),
        grade=CodeGrader(2.0),
        task="code",
        style="tiny",
        sampling=SamplingParams(0.7, 16, 0),
        rules=EpisodeRules(credit="role"),
    )


def test_voting_on_code_votes_with_programs_and_grades_each_candidate():
    problem = next(p for p in codegen.val_problems(40) if p.meta["bug"] is not None)
    spec = codegen.spec_of(problem)
    right, bug = codegen.fence(spec.right), codegen.fence(spec.bug)
    candidates = [right, bug, bug.replace("\n", "\n\n")]  # the bug twice (blank line ignored)

    def script(prompt, i):
        return "\\boxed{1}" if prompt.endswith("Pick:") else candidates[i % 3]

    eps = run("voting", script, [problem])
    ep = eps[0]
    assert ep.final_answer == right and ep.reward == 1.0 and ep.correct
    assert ep.info == {"pass_at_n": 1.0, "majority_correct": 0.0}
    assert [t.reward for t in ep.turns[:3]] == [1.0, ep.turns[1].reward, ep.turns[2].reward]
    assert ep.turns[1].reward < 1.0 and ep.turns[1].reward == ep.turns[2].reward
    assert majority_index(candidates, key=code_reward.code_key) == 1


def test_eval_opt_and_orch_workers_on_code():
    problem = next(p for p in codegen.val_problems(40) if p.meta["bug"] is not None)
    spec = codegen.spec_of(problem)
    right, bug = codegen.fence(spec.right), codegen.fence(spec.bug)

    def eval_opt(prompt, i):
        if prompt.endswith("Check:"):
            return "fix: it; \\boxed{Incorrect}"
        return right if prompt.endswith("Fix:") else bug

    ep = run("eval_opt", eval_opt, [problem], rounds=1)[0]
    assert [t.role for t in ep.turns] == ["generator", "evaluator", "generator"]
    assert ep.final_answer == right and ep.reward == 1.0
    assert ep.turns[1].reward == 1.0  # the Incorrect verdict on the bug was right

    def orch(prompt, i):
        if prompt.endswith("Plan 3:"):
            return "STRATEGY 1: check edges\nSTRATEGY 2: direct"
        if prompt.endswith("Final:"):
            return "use 2;\n" + right
        return bug

    ep = run("orch_workers", orch, [problem])[0]
    assert ep.counters["strategy_missing"] == 1
    assert ep.final_answer.endswith(right) and ep.reward == 1.0


def test_a_models_code_draws_no_syntax_warning_onto_the_users_terminal():
    import warnings

    from marlow.parsers.code import parses_as_python

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning that escapes fails the test
        assert parses_as_python("x = 1if True else 2\n")
        assert not parses_as_python("def f(:\n")
