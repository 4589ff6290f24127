"""Per-role credit (``grpo.credit: role``), the alternative to broadcast credit.

Under broadcast credit (the paper's, the default) every turn carries the episode's reward. Under
role credit each turn is rewarded by the rule of its role's *kind* (the workflow file's
``credit:``, :data:`marlow.workflows.schema.DEFAULT_CREDIT` by default):

* ``own``: the grade of the turn's own completion as an answer (``answer`` kinds: answers,
  revisions, a worker's solution);
* ``verdict``: 1 when the judge's verdict is right about the answer it reviewed (the latest
  ``answer``-kind turn before it), 0 otherwise; an unparseable verdict counts as wrong;
* ``broadcast``: the episode's reward (``select``, ``plan``, ``final``: they decide or shape the
  final answer).

Advantages are then normalised among the turns of the same (problem, role, slot, round) across
the group's n episodes (the ``slot`` scope): turns of different roles earn different rewards, so
mixing them in one group would compare unlike things. Choices of marlow, not fixed by the spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from marlow.parsers import verdict_of
from marlow.types import Turn
from marlow.workflows.schema import DEFAULT_CREDIT


def assign_role_rewards(
    turns: list[Turn],
    episode_reward: float,
    grade: Callable[[str], float],
    rules: Mapping[str, str] = DEFAULT_CREDIT,
    parse_rule: str = "last-box",
    correct_at: float = 1.0,
) -> None:
    """Set ``turn.reward`` on every turn of one episode by its kind's rule in ``rules``;
    ``grade`` scores an answer text (at least ``correct_at``: correct); ``parse_rule`` reads
    verdicts (``marlow.parsers``). A verdict on an answer that has no reward (NaN) has none
    either: the answer's NaN is its reward."""
    reviewed: str | None = None  # the latest answer-kind output
    for turn in turns:
        rule = rules[turn.kind]
        if rule == "own":
            turn.reward = grade(turn.completion_text)
        elif rule == "verdict":
            verdict = verdict_of(
                turn.completion_text, parse_rule
            )  # None: unparseable, counted wrong
            judged = grade(reviewed) if reviewed is not None else None
            if judged is not None and math.isnan(judged):
                turn.reward = judged  # no reward for the answer: none for its verdict
            else:
                right = verdict is not None and judged is not None
                turn.reward = 1.0 if right and verdict == (judged >= correct_at) else 0.0
        else:
            turn.reward = episode_reward
        if turn.kind == "answer":
            reviewed = turn.completion_text
