"""The tiny worlds' evaluation (marlow.worlds.tinyeval): parsing and Voting's statistics."""

from __future__ import annotations

import pytest

from marlow.parsers import selection_of
from marlow.tiny import mathgen
from marlow.worlds import tinyeval
from marlow.worlds.tinyeval import parses


@pytest.mark.parametrize(
    ("text", "n", "index"),
    [
        ("\\boxed{2}", 3, 1),
        ("I pick \\boxed{ 3 }", 3, 2),
        ("\\boxed{4}", 3, None),
        ("\\boxed{4}", 5, 3),
        ("\\boxed{0}", 3, None),
        ("\\boxed{two}", 3, None),
        ("no box", 3, None),
    ],
)
def test_selection_is_an_index_in_1_to_n(text, n, index):
    assert selection_of(text, n) == index


@pytest.mark.parametrize(
    ("role", "text", "n", "task", "ok"),
    [
        ("aggregator", "\\boxed{5}", 5, "math", True),
        ("aggregator", "\\boxed{5}", 3, "math", False),
        ("orchestrator", "STRATEGY 4: direct", 4, "math", True),
        ("orchestrator", "STRATEGY 4: direct", 3, "math", False),
        ("orchestrator", "plan: direct", 3, "code", False),
        ("evaluator", "ok; \\boxed{Correct}", 3, "math", True),
        ("evaluator", "\\boxed{maybe}", 3, "code", False),
        ("generator", "1+2 = \\boxed{-12}", 3, "math", True),
        ("generator", "\\boxed{x}", 3, "math", False),
        ("worker", "```python\ndef f(x):\n    return x\n```", 3, "code", True),
        ("worker", "x = 1", 3, "code", False),  # parses as Python, but not the fenced format
    ],
)
def test_parses_reads_what_the_workflow_parsers_read(role, text, n, task, ok):
    assert parses(role, text, n, task) is ok


def test_voting_statistics_by_hand(monkeypatch):
    """n = 2 voters on two problems. A: voter 1 right, voter 2 wrong, the aggregator picks 2.
    B: both wrong, the aggregator's pick (7) is out of range, so it falls back to candidate 1."""
    a, b = mathgen.val_problems(2)
    wrong_a, wrong_b = int(a.answer) + 1, int(b.answer) + 1
    voters = {
        0: [f"\\boxed{{{a.answer}}}", f"\\boxed{{{wrong_b}}}"],
        1: [f"\\boxed{{{wrong_a}}}", f"\\boxed{{{wrong_b}}}"],
    }

    def scripted(model, tokenizer, prompts, *, temperature=0.0, max_new_tokens=160, seed=0, **kw):
        if max_new_tokens == 16:  # the aggregator's selection
            assert "1) " in prompts[0] and "2) " in prompts[0] and "3) " not in prompts[0]
            return ["\\boxed{2}", "\\boxed{7}"]
        return voters[seed]

    monkeypatch.setattr(tinyeval, "generate", scripted)
    stats = tinyeval.voting_eval(None, None, [a, b], n=2, seed=0)
    assert stats == {
        "candidate_accuracy": 0.25,  # (1/2 + 0/2) / 2
        "pass_at_n": 0.5,  # only A has a right candidate
        "majority_accuracy": 0.5,  # A: a 1-1 tie goes to the first answer, the right one
        "aggregator_accuracy": 0.0,  # A: picked the wrong one; B: nothing right to pick
        "majority_on_solvable": 1.0,
        "aggregator_on_solvable": 0.0,
        "solvable_sets": 1.0,
        "selection_fallback_rate": 0.5,  # B's out-of-range pick
    }


def test_an_unknown_task_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid: math, code"):
        tinyeval.grade(["x"], mathgen.val_problems(1), "chess")
