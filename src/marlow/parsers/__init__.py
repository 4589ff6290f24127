r"""Pure text parsers of what a role wrote: an evaluator's verdict, an orchestrator's strategies,
an aggregator's selection (here); the last box of a text (``marlow.parsers.box``); the program of
a completion (``marlow.parsers.code``).

The workflows act on these readings (Eval-Opt stops revising on a ``Correct`` verdict,
Orch-Workers hands strategy ``i`` to worker ``i``, Voting answers with the selected candidate),
diagnostics measure them (the evaluator's ``verdict_parse_rate``, the orchestrator's strategy
diversity) and so does the tiny worlds' evaluation (``marlow.worlds.tinyeval``: the share of
a role's outputs that parse). All must read a text the same way, so the rules live here, below
them all: this package imports only the standard library and ``marlow.choices``, never a reward
or a workflow; the math reward reads its box with the same rule (``marlow.parsers.box``), and
diagnostics import these parsers instead of the workflows'.
"""

from __future__ import annotations

import re
from typing import get_args

from marlow.choices import ParseRule
from marlow.parsers.box import last_boxed

PARSE_RULES: tuple[str, ...] = get_args(ParseRule)
"""How a verdict or a selection is read (``workflow.parse``):

* ``last-box`` (marlow): the text's last ``\\boxed{...}``, stripped, any case; anything else in
  it is unparseable. A role that re-solves the problem and boxes its answer last is unparseable.
* ``first-match`` (the study's official code): a verdict is the first ``\\boxed{Correct}`` or
  ``\\boxed{Incorrect}`` anywhere (any case, nothing else inside the braces); a selection is the
  first ``\\boxed{<digits>}`` if it names a candidate, else the first standalone digit 1-9 in the
  text if it names one, else unparseable (Voting then takes the first candidate, as the official
  code does).
"""

_VERDICT = re.compile(r"\\boxed\{(Correct|Incorrect)\}", re.IGNORECASE)
_BOXED_NUMBER = re.compile(r"\\boxed\{(\d+)\}")
_LONE_DIGIT = re.compile(r"\b([1-9])\b")


def _check_rule(rule: str) -> None:
    if rule not in PARSE_RULES:
        raise ValueError(f"unknown parse rule {rule!r}; valid: {', '.join(PARSE_RULES)}")


def verdict_of(text: str, rule: str = "last-box") -> bool | None:
    """The evaluator's verdict in ``text`` under ``rule`` (:data:`PARSE_RULES`): True for
    ``\\boxed{Correct}``, False for ``\\boxed{Incorrect}``, None when unparseable."""
    _check_rule(rule)
    if rule == "first-match":
        m = _VERDICT.search(text)
        return None if m is None else m.group(1).lower() == "correct"
    verdict = (last_boxed(text) or "").strip().lower()
    return {"correct": True, "incorrect": False}.get(verdict)


_STRATEGY = re.compile(r"STRATEGY\s*(\d+)\s*:\s*(.+)", re.IGNORECASE)


def strategies_of(text: str, n: int) -> list[str | None]:
    """Strategies 1..n of an orchestrator's ``text``, by index: the first ``STRATEGY i: ...`` line
    of each index 1 <= i <= n; None where index i is missing."""
    found: dict[int, str] = {}
    for line in text.splitlines():
        m = _STRATEGY.search(line)
        if m and 1 <= int(m.group(1)) <= n and int(m.group(1)) not in found:
            found[int(m.group(1))] = m.group(2).strip()
    return [found.get(i) for i in range(1, n + 1)]


_PLAN_STRATEGY = re.compile(r"STRATEGY\s*(\d+)\s*:\s*(.+?)(?=STRATEGY\s*\d+\s*:|$)", re.I | re.S)
_PLAN_NUMBERED = re.compile(r"^\s*(\d+)[.)]\s*(.+?)(?=^\s*\d+[.)]|\Z)", re.M | re.S)


def plan_of(text: str, n: int) -> list[str]:
    """The strategies of an orchestrator's ``text`` as the study's official code reads them
    (``workflow.workers=parsed``): ``STRATEGY i: ...`` items (each up to the next one, sorted by
    i); else a numbered list (``1.`` or ``1)``); else the lines longer than 10 characters; else
    the whole text. At least one strategy, at most ``n``; one worker runs per strategy."""
    for pattern in (_PLAN_STRATEGY, _PLAN_NUMBERED):
        found = pattern.findall(text)
        if found:
            plan = [body.strip() for _, body in sorted(found, key=lambda m: int(m[0]))]
            break
    else:
        plan = [line.strip() for line in text.split("\n") if len(line.strip()) > 10]
    return (plan or [text.strip()])[:n]


def selection_of(text: str, n: int, rule: str = "last-box") -> int | None:
    """The aggregator's choice among ``n`` candidates as a 0-based index under ``rule``
    (:data:`PARSE_RULES`); None when unparseable (Voting then falls back to the first candidate).
    ``last-box``: the last box, stripped, holds an integer 1..n."""
    _check_rule(rule)
    if rule == "first-match":
        for pattern in (_BOXED_NUMBER, _LONE_DIGIT):
            m = pattern.search(text)
            if m is not None and 1 <= int(m.group(1)) <= n:
                return int(m.group(1)) - 1
        return None
    choice = (last_boxed(text) or "").strip()
    return int(choice) - 1 if choice.isdigit() and 1 <= int(choice) <= n else None
