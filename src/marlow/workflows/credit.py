"""Per-role credit (``grpo.credit: role``), the alternative SPEC §3 offers to broadcast credit.

Under broadcast credit (the paper's, the default) every turn carries the episode's reward. Under
role credit each turn is rewarded for its own work:

* a turn that answers the problem (``generator``, ``worker``: answers, revisions, proposals) gets
  the grade of its own completion;
* an ``evaluator`` gets 1 when its verdict is right about the answer it reviewed (the latest
  generator turn before it) and 0 otherwise; an unparseable verdict counts as wrong;
* every other role (``aggregator``, ``synthesizer``, ``orchestrator``) decides or shapes the final
  answer and gets the episode's reward.

Advantages are then normalised among the turns of the same (problem, role, slot, round) across
the group's n episodes (the ``slot`` scope): turns of different roles earn different rewards, so
mixing them in one group would compare unlike things. Choices of marlow, not fixed by the spec.
"""

from __future__ import annotations

from collections.abc import Callable

from marlow.types import Turn
from marlow.workflows.builtin import verdict_of

ANSWERING = frozenset({"generator", "worker"})


def assign_role_rewards(
    turns: list[Turn], episode_reward: float, grade: Callable[[str], float]
) -> None:
    """Set ``turn.reward`` on every turn of one episode; ``grade`` scores an answer text."""
    reviewed: float | None = None  # grade of the latest generator answer
    for turn in turns:
        if turn.role in ANSWERING:
            turn.reward = grade(turn.completion_text)
            if turn.role == "generator":
                reviewed = turn.reward
        elif turn.role == "evaluator":
            verdict = verdict_of(turn.completion_text)  # None: unparseable, counted wrong
            right = verdict is not None and reviewed is not None and verdict == (reviewed >= 1.0)
            turn.reward = 1.0 if right else 0.0
        else:
            turn.reward = episode_reward
