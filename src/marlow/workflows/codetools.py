"""Built-in tools for workflows on code tasks (a workflow file's ``call:``; the mechanism is
:mod:`marlow.workflows.tools`).

:func:`run_visible_tests` runs a role's program on the problem's *visible* tests, the examples
a solver may see (``Problem.meta["visible_tests"]``: the tiny code world draws two of its own
beside the hidden ones; a HumanEval row's are the ``>>>`` examples of its docstring), never the
hidden tests that score it, and reports the failures as text for the next role. The program runs
only in the code reward's sandbox (:mod:`marlow.rewards.sandbox`), with the code task's limits.
"""

from __future__ import annotations

from typing import Any

from marlow.parsers.code import extract_code
from marlow.rewards.code import parse_tests, score_code_batch
from marlow.types import Problem

TIMEOUT_S = 2.0
"""Seconds of CPU each visible test may use."""
SHOWN = 3
"""Failed tests the report spells out (the rest are counted)."""


def _call(case: Any) -> str:
    if case.kind == "stdin":
        return f"stdin {case.input!r}"
    args = ", ".join(repr(a) for a in case.input)
    return f"{case.fn_name}({args})"


def run_visible_tests(
    reads: dict[str, str], problem: Problem, episode: list[dict[str, Any]]
) -> dict[str, Any]:
    """The program in ``reads["program"]`` (its last fenced python block, as the reward reads
    it) on the problem's visible tests: ``text`` (what passed, each failure with its input,
    expected and actual value), ``ok`` (every visible test passed), ``passed`` and ``total``."""
    del episode  # this tool needs only the program and the problem
    program = reads.get("program", "")
    tests = problem.meta.get("visible_tests")
    if not tests:
        return {"text": "No visible tests for this problem.", "ok": None, "passed": 0, "total": 0}
    if extract_code(program) is None:
        return {
            "text": "No program found: write it in a ```python block.",
            "ok": False,
            "passed": 0,
            "total": len(parse_tests(tests)),
        }
    # every visible test of the program in one sandboxed process (the tiny code grader's suite
    # mode: one process start instead of one per test)
    (score,) = score_code_batch([(program, tests)], suite=True, timeout_s=TIMEOUT_S)
    cases = parse_tests(tests)
    total, passed = len(cases), score.passed
    if passed == total:
        return {
            "text": f"All {total} visible tests passed.",
            "ok": True,
            "passed": passed,
            "total": total,
        }
    lines = [f"{total - passed} of {total} visible tests failed:"]
    failed = [(c, o) for c, o in zip(cases, score.tests, strict=True) if not o.passed]
    for case, outcome in failed[:SHOWN]:
        why = outcome.detail or outcome.status
        lines.append(f"- {_call(case)}: expected {case.expected!r}, {why}")
    if len(failed) > SHOWN:
        lines.append(f"- and {len(failed) - SHOWN} more")
    return {"text": "\n".join(lines), "ok": False, "passed": passed, "total": total}
