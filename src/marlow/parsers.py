r"""Pure text parsers of what a role wrote: an evaluator's verdict, an orchestrator's strategies,
an aggregator's selection.

The workflows act on these readings (Eval-Opt stops revising on a ``Correct`` verdict,
Orch-Workers hands strategy ``i`` to worker ``i``, Voting answers with the selected candidate),
diagnostics measure them (the evaluator's ``verdict_parse_rate``, the orchestrator's strategy
diversity) and so does the tiny worlds' evaluation (``marlow.experiments.tinyeval``: the share of
a role's outputs that parse). All must read a text the same way, so the rules live here, below
them all: this module imports only the math reward's box rule (``marlow.rewards.math.last_boxed``),
never a workflow, and diagnostics import it instead of the workflows' parsers.
"""

from __future__ import annotations

import re

from marlow.rewards.math import last_boxed


def verdict_of(text: str) -> bool | None:
    """The evaluator's verdict in ``text``: True for ``\\boxed{Correct}``, False for
    ``\\boxed{Incorrect}`` (last box, stripped, any case), None when unparseable."""
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


def selection_of(text: str, n: int) -> int | None:
    """The aggregator's choice among ``n`` candidates as a 0-based index: its last box, stripped,
    holds an integer 1..n; None otherwise (Voting then falls back to the first candidate)."""
    choice = (last_boxed(text) or "").strip()
    return int(choice) - 1 if choice.isdigit() and 1 <= int(choice) <= n else None
