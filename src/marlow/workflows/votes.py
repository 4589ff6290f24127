"""Reading candidates' answers for a vote: Voting's majority-vote accuracy and pass@N beside the
selection (and the tiny worlds' evaluation of the same).

Choices the spec leaves open, made here: majority-vote accuracy breaks ties by first appearance;
candidates with no boxed answer do not vote. On code problems (a problem whose ``meta`` holds
``tests``) the "answer" a candidate votes with is its program, normalised by
``marlow.rewards.code.code_key`` (identical programs agree; no hidden test is run to vote);
candidates with no code do not vote.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from marlow.rewards.code import code_key
from marlow.rewards.math import last_boxed, normalize_answer
from marlow.types import Problem
from marlow.workflows.spec import Grader


def boxed_key(text: str) -> str | None:
    """A math answer for voting: the last boxed answer, normalised (None: no box)."""
    boxed = last_boxed(text)
    return normalize_answer(boxed) if boxed is not None else None


def answer_key(problem: Problem) -> Callable[[str], str | None]:
    """How a candidate's answer is read for voting on ``problem``: its program on a code
    problem (``meta["tests"]``), else its boxed answer."""
    return code_key if "tests" in problem.meta else boxed_key


def majority_index(texts: list[str], key: Callable[[str], str | None] = boxed_key) -> int | None:
    """Majority vote over the candidates' answers read by ``key`` (default: boxed, normalised):
    the index of the first candidate holding the most common answer; ties go to the answer seen
    first; None when no candidate has an answer."""
    votes: Counter[str] = Counter()
    first_of: dict[str, int] = {}
    for i, text in enumerate(texts):
        key_i = key(text)
        if key_i is not None:
            key_i = str(key_i)
            votes[key_i] += 1
            first_of.setdefault(key_i, i)
    if not votes:
        return None
    top = max(votes.values())
    winner = min((k for k, v in votes.items() if v == top), key=first_of.__getitem__)
    return first_of[winner]


def selection_extras(
    candidates: list[str], problem: Problem, grade: Grader, correct_at: float = 1.0
) -> dict[str, float]:
    """pass@N (any candidate correct: a reward of at least ``correct_at``; a candidate without
    a reward is not) and majority-vote accuracy beside the selection's."""
    correct = [grade(t, problem) >= correct_at for t in candidates]
    m = majority_index(candidates, answer_key(problem))
    return {
        "pass_at_n": float(any(correct)),
        "majority_correct": float(m is not None and correct[m]),
    }
