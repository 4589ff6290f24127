"""Turns cut at ``rollout.max_new_tokens``, said aloud: a run whose completions are all cut
scores the format penalty on every answer and otherwise looks like a model that simply fails
(``val acc 0.000 reward -0.100``). The trainer logs these lines once per role and split.
"""

from __future__ import annotations

TRUNCATION_WARN = 0.5
"""A role whose turns were cut at ``rollout.max_new_tokens`` at this rate or more in a step (or a
validation) gets a warning: a cut answer has no box, so it scores the format penalty, and the
run learns nothing from it while looking like it simply fails."""


def truncation_warnings(step: int, record: dict, max_new_tokens: int) -> list[tuple[str, str]]:
    """((split, role), line) for every role of ``record`` whose ``truncation_rate`` is at least
    :data:`TRUNCATION_WARN`, naming the role and the setting to raise."""
    out = []
    for key, rate in record.items():
        split, role, metric = (key.split("/") + ["", ""])[:3]
        if metric != "truncation_rate" or role == "all" or rate < TRUNCATION_WARN:
            continue
        where = "training" if split == "train" else "validation"
        out.append(
            (
                (split, role),
                f"WARNING step {step}: {rate:.0%} of the {role} turns ({where}) were cut at "
                f"rollout.max_new_tokens={max_new_tokens}, so their answers are lost; raise "
                "rollout.max_new_tokens",
            )
        )
    return out
