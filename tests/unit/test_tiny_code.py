"""The tiny code world: problems and hidden tests, the role corpus, the pre-training cache key."""

from __future__ import annotations

import itertools
import random

import pytest

from marlow.parsers import selection_of, strategies_of, verdict_of
from marlow.parsers.code import code_key, extract_code
from marlow.prompts import TEMPLATES, render
from marlow.rewards.code import score_code_batch
from marlow.tiny import codegen
from marlow.tiny.codecorpus import (
    MAKERS,
    CodeCorpusConfig,
    examples,
    expected_pass_rate,
    make_example,
)
from marlow.tiny.corpus import ROLES, CorpusConfig
from marlow.tiny.pretrain import cache_key, pretrain_tiny
from marlow.types import Problem


def one_per_family(k: int = 2, seed: int = 0) -> list[Problem]:
    rng = random.Random(seed)
    return [
        codegen.make_problem(codegen.sample_spec(rng, fam))
        for fam in codegen.FAMILY_WEIGHTS
        for _ in range(k)
    ]


def test_reference_passes_every_hidden_test_and_every_slip_fails_one():
    problems = one_per_family(k=2)
    items, owners = [], []
    for p in problems:
        spec = codegen.spec_of(p)
        for kind, code in [("right", spec.right), ("bug", spec.bug)] + [
            ("typo", t) for t in spec.typos
        ]:
            if code is not None:
                items.append((codegen.fence(code), p.meta["tests"]))
                owners.append((p, kind))
    scores = score_code_batch(items, suite=True, timeout_s=2.0)
    for (p, kind), score in zip(owners, scores, strict=True):
        if kind == "right":
            assert score.reward == 1.0, (p.prompt, [t.status for t in score.tests])
        else:
            assert score.reward < 1.0, (p.prompt, kind, score.code)
    bugs = {p.meta["family"] for p, kind in owners if kind == "bug"}
    assert bugs == set(codegen.SLIP_KINDS)  # every slip kind was exercised


def test_suite_mode_agrees_with_one_process_per_test():
    problems = one_per_family(k=1, seed=3)
    items = []
    for p in problems:
        spec = codegen.spec_of(p)
        items += [(codegen.fence(c), p.meta["tests"]) for c in (spec.right, spec.bug) if c]
    one = score_code_batch(items, timeout_s=2.0)
    suite = score_code_batch(items, suite=True, timeout_s=2.0)
    assert [s.reward for s in one] == [s.reward for s in suite]
    assert [[t.passed for t in s.tests] for s in one] == [
        [t.passed for t in s.tests] for s in suite
    ]


def test_problem_formats_are_deepcoder_ones():
    for p in one_per_family(k=1):
        tests = p.meta["tests"]
        assert len(tests["inputs"]) == len(tests["outputs"]) == codegen.N_TESTS
        if p.meta["fn_name"] is None:  # stdin/stdout: strings
            assert "fn_name" not in tests
            assert all(isinstance(x, str) for x in tests["inputs"] + tests["outputs"])
        else:  # function call: argument lists, outputs by value
            assert tests["fn_name"] == p.meta["fn_name"] and p.prompt.startswith(tests["fn_name"])
            assert all(isinstance(x, list) for x in tests["inputs"])
            assert all(isinstance(x, int) for x in tests["outputs"])


def test_problems_and_splits_are_deterministic_and_disjoint():
    a = list(itertools.islice(codegen.train_problems(0), 200))
    b = list(itertools.islice(codegen.train_problems(0), 200))
    c = list(itertools.islice(codegen.train_problems(1), 200))
    assert [p.id for p in a] == [p.id for p in b] and [p.meta for p in a] == [p.meta for p in b]
    assert [p.id for p in a] != [p.id for p in c]
    val = codegen.val_problems(50)
    assert [p.id for p in codegen.val_problems(20)] == [p.id for p in val[:20]]
    assert len({p.prompt for p in val}) == 50
    assert all(codegen.is_val(p.prompt) for p in val)
    assert not any(codegen.is_val(p.prompt) for p in a)
    # tests are a pure function of the statement text
    again = codegen.make_problem(codegen.spec_of(val[0]))
    assert again.meta["tests"] == val[0].meta["tests"] and again.id == val[0].id
    with pytest.raises(ValueError, match="0..1000"):
        codegen.val_problems(codegen.MAX_VAL + 1)
    with pytest.raises(ValueError, match="valid: lin, par"):
        codegen.sample_spec(random.Random(0), "loops")


def test_code_templates_exist_in_both_styles():
    for style in ("tiny", "chat"):
        for role, variant in ROLES:
            assert ("code", role, variant) in TEMPLATES[style], (style, role, variant)


FIELDS = {
    "generator/answer": (),
    "generator/revise": ("answer", "critique"),
    "evaluator/review": ("answer",),
    "aggregator/select": ("candidates",),
    "orchestrator/plan": (),
    "worker/solve": ("strategy",),
    "synthesizer/conclude": ("solutions",),
}


@pytest.mark.parametrize("key", list(MAKERS))
def test_every_role_example_renders_and_parses(key):
    """Each example's prompt is a template rendering, and its completion has the format the
    workflow's parser reads (no parse fallback is ever counted)."""
    role, variant = key.split("/")
    rng = random.Random(1)
    cfg = CodeCorpusConfig()
    template = TEMPLATES["tiny"][("code", role, variant)]
    head = template.split("{problem}")[0]
    for problem in itertools.islice(codegen.train_problems(5), 40):
        ex = make_example(role, variant, problem, rng, cfg)
        assert ex.prompt.startswith(head + problem.prompt)
        tail = template.rsplit("}", 1)[1]
        assert ex.prompt.endswith(tail)
        if not FIELDS[key]:
            assert ex.prompt == render(
                "tiny", "code", role, variant, {"problem": problem.prompt, "n": 3}
            )
        if role in ("generator", "worker", "synthesizer"):
            code = extract_code(ex.completion)
            assert code is not None and compile(code, "x", "exec")
            assert ex.completion.rstrip().endswith("```")
        elif role == "evaluator":
            assert verdict_of(ex.completion) is not None
        elif role == "aggregator":
            assert selection_of(ex.completion, 3) is not None
        else:
            assert any(s is not None for s in strategies_of(ex.completion, 3))


def test_corpus_labels_agree_with_the_hidden_tests():
    """``Example.correct`` of an answering role is exactly "passes every hidden test"."""
    rng = random.Random(2)
    cfg = CodeCorpusConfig()
    exs = []
    for i, problem in enumerate(itertools.islice(codegen.train_problems(7), 36)):
        key = ("generator/answer", "generator/revise", "worker/solve", "synthesizer/conclude")[
            i % 4
        ]
        ex = make_example(*key.split("/"), problem, rng, cfg)
        exs.append((ex, problem))
    scores = score_code_batch(
        [(ex.completion, p.meta["tests"]) for ex, p in exs], suite=True, timeout_s=2.0
    )
    assert [s.reward >= 1.0 for s in scores] == [ex.correct for ex, _ in exs]
    assert 0 < sum(ex.correct for ex, _ in exs) < len(exs)


def test_generator_skill_matches_the_config_and_slips_are_systematic():
    cfg = CodeCorpusConfig()
    exs = list(itertools.islice(examples(cfg, seed=3, role="generator/answer"), 3000))
    problems = list(itertools.islice(codegen.train_problems(3), 3000))
    assert [e.prompt.split("P: ")[1] for e in exs] == [p.prompt for p in problems]
    got = sum(e.correct for e in exs) / len(exs)
    want = sum(expected_pass_rate(codegen.spec_of(p), cfg) for p in problems) / len(problems)
    assert abs(got - want) < 0.03, (got, want)
    # on slip-prone problems the most common program is the slip (greedy headroom)
    bug_share = [
        extract_code(e.completion).strip() == p.meta["bug"]
        for e, p in zip(exs, problems, strict=True)
        if p.meta["bug"] is not None
    ]
    assert 0.55 < sum(bug_share) / len(bug_share) < 0.65


def test_code_key_normalises_for_voting():
    a = "```python\ndef f(x):\n    return  3*x\n\n```"
    b = "sure:\n```python\ndef f(x):\n    return 3*x\n```"
    assert code_key(a) == code_key(b) == "def f(x):\n    return 3*x"
    assert code_key("no code here at all, sorry") is None


def test_math_cache_key_is_unchanged_and_code_has_its_own():
    # The math quickstart's figures come from this key (the float32 recipe): nothing but a change
    # of the world itself may move it.
    assert cache_key("tiny-s", 1200, 0, CorpusConfig()) == "5f26d65acb7f"
    code = cache_key("tiny-s", 1200, 0, CodeCorpusConfig(), "code")
    assert code != "5f26d65acb7f"
    assert code != cache_key("tiny-s", 1200, 0, CodeCorpusConfig(bug=0.5), "code")
    with pytest.raises(ValueError, match="valid: math, code"):
        pretrain_tiny("tiny-s", steps=0, task="chess")
    with pytest.raises(ValueError, match="CodeCorpusConfig"):
        pretrain_tiny("tiny-s", steps=0, task="code", corpus=CorpusConfig())


def test_code_pretraining_writes_its_own_folder(tmp_path, monkeypatch):
    path = pretrain_tiny("tiny-s", steps=2, cache_dir=tmp_path, task="code")
    assert path.name.startswith("tiny-s-code-")
    assert pretrain_tiny("tiny-s", steps=2, cache_dir=tmp_path, task="code") == path  # cached
    import json

    from marlow.worlds import tinyeval

    meta = json.loads((path / "meta.json").read_text())
    assert meta["task"] == "code" and meta["corpus_version"] == 1
    monkeypatch.setattr(tinyeval, "REPORT_PROBLEMS", 6)
    report = tinyeval.greedy_report(path, "code")  # the untrained world writes no passing program
    assert report["problems"] == 6 and report["reward"] == 0.0 and "accuracy/io1" in report
