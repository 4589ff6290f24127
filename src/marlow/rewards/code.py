"""Code outcome reward: the last fenced python block, run against hidden tests.

``score_code(completion, tests, **limits)`` is the fraction of tests passed; ``code_details``
returns the same with one ``TestOutcome`` per test; ``score_code_batch`` scores many
(completion, tests) pairs with all their tests on one pool. By default every test is one run of
the sandbox (``marlow.rewards.sandbox``), so a test's crash, timeout or output flood costs only
that test.

**Who decides**: the verdict never comes from anything the program controls. A stdin
test alone runs the program itself and compares its captured stdout here (its exit status can
only fail it); every other test runs through the harness (``marlow.rewards.harness``): the
sandboxed process holds the program and answers requests (call this function with these
arguments, run the program on this stdin) with plain-data literals; this process parses them
(``ast.literal_eval``, exact types only) and does every comparison. Test code and expected values
never enter the sandbox, so an always-equal object, a ``str`` subclass, an exit hook, a forged
answer line or reading the tests from memory or disk wins nothing
(``tests/unit/test_reward_hacks.py`` holds the catalogue).

Extraction (:func:`marlow.parsers.code.extract_code`, one rule for every reader of code): the last
fenced block tagged ``python``/``py``/``python3``; else the last fenced block of any language; else
the whole completion if it parses as Python; else nothing (reward 0).

Test styles (``tests`` may also be the JSON string of any of these):

* **stdin/stdout** (APPS/TACO/CodeContests in DeepCoder): ``{"inputs": [...], "outputs": [...]}``.
  The program reads the input on stdin; its stdout passes when it exits 0 and the output equals
  the expected one after stripping, per line, with runs of whitespace collapsed and trailing blank
  lines dropped.
* **function call**: the same with ``"fn_name"``. Each input is a list of positional arguments or
  a JSON string of one (or one JSON value per line, as LiveCodeBench writes them); each output is
  the expected return value (or its JSON). The harness loads the code as a module named
  ``solution`` (its ``__main__`` block does not run), with ``from typing import *`` and a few
  common modules preloaded; when there is no top-level function of that name,
  ``Solution().<fn_name>`` is used. Return values are compared by value as JSON would see them
  (tuples are lists, dict keys strings), floats with a relative tolerance of 1e-6; an expected
  ``[x]`` also accepts ``x`` (APPS wraps call outputs in a list). A return value that is not plain
  data (None, bool, int, float, str, bytes and list/tuple/dict/set of them; subclasses count as
  their base type) fails the test.
* **LiveCodeBench/DeepCoder rows**: a list of ``{"input", "output", "testtype": "stdin" |
  "functional", "metadata": {"func_name"}}``.
* **check harness** (HumanEval): ``{"check": test_source, "entry_point": name, "prompt": src}``:
  one test that passes when ``check(candidate)`` returns, run here with the problem's ``prompt``
  (trusted: the helpers some tests call) and ``candidate`` a proxy whose calls run in the sandbox
  (``harness.run_check`` lists where this departs from running one script). Without ``prompt``,
  a test that calls a prompt helper fails.

**Suite mode** (``suite=True``; the tiny code task's grader uses it): the stdin and call tests of
one program are asked of ONE sandboxed harness process instead of one process each, which is ~N
times cheaper for N tests (a sandbox start costs ~50 ms on 2 cores; tiny programs run in
microseconds). Each test runs in a fresh namespace with its own stdin and captured stdout (capped
at ``SUITE_OUTPUT_CAP`` characters) under a ``SIGALRM`` timer of ``timeout_s``, and is over when
the non-daemon threads it started have finished (as a process's exit waits for them); the sandbox
bounds the whole process by ``N * timeout_s`` of CPU and wall. What differs from the default mode:
tests share one interpreter, so a program that kills its process, swallows the timer's exception
in an endless loop or corrupts interpreter state loses the tests that had not answered yet (they
score 0, as the spec allows for a program that never runs), state a test leaves in imported
modules is visible to the next test, and stdin is a text buffer (``sys.stdin.buffer`` and
``open(0)`` are not the input). Check-harness tests always run one per process.

All public functions and records are module level, so they pickle.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from marlow.parsers.code import code_key as code_key  # re-exported: the workflows vote with it
from marlow.parsers.code import extract_code, parses_as_python
from marlow.rewards.harness import CandidateFailed, Session, run_check, serve_source
from marlow.rewards.sandbox import SANDBOX_ERROR, Channel, Job, Limits, RunResult, run_many

DEFAULT_TIMEOUT_S = 6.0

# ----------------------------------------------------------------------------- tests


@dataclass(frozen=True)
class TestCase:
    kind: str  # "stdin" | "call" | "check"
    input: Any  # stdin text | list of args | the check source
    expected: Any  # stdout text | return value | entry point name
    fn_name: str = ""
    prompt: str = ""  # check: trusted source run before the test (HumanEval's prompt, helpers)

    __test__ = False  # not a pytest class


@dataclass
class TestOutcome:
    passed: bool
    status: str  # the sandbox status, or "wrong_answer" / "no_code" / "syntax_error"
    detail: str = ""
    run: RunResult | None = None

    __test__ = False


@dataclass
class CodeScore:
    reward: float
    tests: list[TestOutcome] = field(default_factory=list)
    code: str | None = None

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def sandbox_error(self) -> str | None:
        """Why the sandbox could not set up for this program (no verdict on it), or None."""
        return next((t.detail for t in self.tests if t.status == SANDBOX_ERROR), None)


def parse_tests(tests: Any) -> list[TestCase]:
    """Normalise any supported test format (module docstring) into ``TestCase`` records."""
    if isinstance(tests, str | bytes):
        tests = json.loads(tests)
    if isinstance(tests, dict) and "check" in tests:
        prompt = str(tests.get("prompt") or "")
        return [TestCase("check", str(tests["check"]), str(tests["entry_point"]), "", prompt)]
    if isinstance(tests, dict):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("code tests need list fields 'inputs' and 'outputs'")
        if len(inputs) != len(outputs):
            raise ValueError(f"code tests: {len(inputs)} inputs but {len(outputs)} outputs")
        fn = tests.get("fn_name") or ""
        if fn:
            return [
                TestCase("call", _args(i), _value(o), str(fn))
                for i, o in zip(inputs, outputs, strict=True)
            ]
        return [TestCase("stdin", _text(i), _text(o)) for i, o in zip(inputs, outputs, strict=True)]
    if isinstance(tests, list):
        cases = []
        for row in tests:
            if not isinstance(row, dict) or "input" not in row or "output" not in row:
                raise ValueError("code test rows need 'input' and 'output'")
            meta = row.get("metadata") or {}
            if isinstance(meta, str):
                meta = json.loads(meta) if meta.strip() else {}
            fn = row.get("fn_name") or meta.get("func_name") or ""
            if row.get("testtype") == "functional" or (fn and row.get("testtype") != "stdin"):
                cases.append(TestCase("call", _args(row["input"]), _value(row["output"]), fn))
            else:
                cases.append(TestCase("stdin", _text(row["input"]), _text(row["output"])))
        return cases
    raise ValueError(f"unsupported code test format: {type(tests).__name__}")


def _text(x: Any) -> str:
    if isinstance(x, list):
        return "\n".join(str(v) for v in x)
    return str(x)


def _args(x: Any) -> list:
    if isinstance(x, str):
        try:
            v = json.loads(x)
        except ValueError:
            return [json.loads(line) for line in x.splitlines() if line.strip()]
        return v if isinstance(v, list) else [v]
    return list(x) if isinstance(x, list | tuple) else [x]


def _value(x: Any) -> Any:
    if isinstance(x, str):
        try:
            return json.loads(x)
        except ValueError:
            return x
    return x


# ----------------------------------------------------------------------------- comparison


def _norm_stdout(text: str) -> list[str]:
    lines = [" ".join(line.split()) for line in text.strip().splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def same_stdout(actual: str, expected: str) -> bool:
    return _norm_stdout(actual) == _norm_stdout(expected)


def same_value(actual: Any, expected: Any) -> bool:
    """Equality by value: JSON shapes, float tolerance; ``[x]`` expected also accepts ``x``."""
    actual = _as_json(actual)
    if _eq(actual, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _eq(actual, expected[0])


def _as_json(x: Any) -> Any:
    """A returned value as the JSON it would be: tuples are lists, dict keys strings."""
    if isinstance(x, list | tuple):
        return [_as_json(v) for v in x]
    if isinstance(x, dict):
        return {_json_key(k): _as_json(v) for k, v in x.items()}
    return x


def _json_key(k: Any) -> str:
    if isinstance(k, str):
        return k
    if k is None or isinstance(k, int | float):
        return json.dumps(k)
    return repr(k)  # not a JSON key (a tuple...): it cannot match an expected one


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (type(a) is type(b) and a == b)
    if isinstance(a, int | float) and isinstance(b, int | float):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    return a == b


# ----------------------------------------------------------------------------- programs

_PRELUDE = (
    "from typing import *\n"
    "import bisect, collections, functools, heapq, itertools, math, re, string\n"
    "from collections import Counter, defaultdict, deque\n"
    "from functools import lru_cache\n"
)

SUITE_OUTPUT_CAP = 1 << 16  # characters of captured stdout per stdin test run by the harness


class _Conversation:
    """The tests of one sandboxed harness process; ``outcomes[i]`` stays None for a test the
    conversation never reached (the run's status explains it). The stdin and call tests are all
    sent at once (the process answers them in order), then their answers read one by one."""

    def __init__(self, cases: list[TestCase], timeout_s: float) -> None:
        self.cases, self.timeout_s = cases, timeout_s
        self.outcomes: list[TestOutcome | None] = [None] * len(cases)

    def __call__(self, channel: Channel) -> None:
        session = Session(channel)
        asked: list[int | CandidateFailed | None] = []
        for case in self.cases:
            try:
                asked.append(_submit(session, case, self.timeout_s))
            except CandidateFailed as exc:
                asked.append(exc)
        for i, (case, seq) in enumerate(zip(self.cases, asked, strict=True)):
            try:
                if isinstance(seq, CandidateFailed):
                    raise seq
                self.outcomes[i] = _judge(session, case, seq)
            except CandidateFailed as exc:
                self.outcomes[i] = TestOutcome(False, exc.status, exc.detail)


def _submit(session: Session, case: TestCase, timeout_s: float) -> int | None:
    """Send a stdin or call test's request (a check test asks as it runs: None)."""
    if case.kind == "stdin":
        return session.submit("stdin", case.input, timeout_s)
    if case.kind == "call":
        return session.submit("call", (case.fn_name, case.input, True), timeout_s)
    return None


def _judge(session: Session, case: TestCase, seq: int | None) -> TestOutcome:
    """One test: the sandbox computed, this process compares (``CandidateFailed``: no value)."""
    if seq is None:
        try:
            run_check(session, case.input, case.expected, case.prompt)
        except Exception as exc:  # an assertion (or any error) of the trusted test code
            return TestOutcome(False, "wrong_answer", f"{type(exc).__name__}: {exc}"[:300])
        return TestOutcome(True, "ok")
    value = session.answer(seq)
    try:
        if case.kind == "stdin":
            good = type(value) is str and same_stdout(value, case.expected)
        else:
            good = same_value(value, case.expected)
    except Exception as exc:  # the value breaks the comparison (an int too big for a float...)
        return TestOutcome(False, "wrong_answer", f"{type(exc).__name__}: {exc}"[:300])
    if good:
        return TestOutcome(True, "ok")
    return TestOutcome(False, "wrong_answer", f"returned {value!r}"[:300])


def _suitable(cases: list[TestCase]) -> bool:
    """Whether ``cases`` can run as one suite: all stdin, or all calls of one function."""
    if not cases or cases[0].kind == "check":
        return False
    return all(c.kind == cases[0].kind and c.fn_name == cases[0].fn_name for c in cases)


def _harness_job(code: str, cases: list[TestCase], limits: Limits) -> tuple[Job, _Conversation]:
    conv = _Conversation(cases, limits.cpu_s)
    if len(cases) > 1:  # a suite: the process may use every test's time
        total = limits.cpu_s * len(cases)
        limits = replace(limits, cpu_s=total, wall_s=total + 1.0)
    source = serve_source(code, _PRELUDE, SUITE_OUTPUT_CAP)
    return Job(source, "", limits, converse=conv), conv


def _plan(
    completion: str, tests: Any, limits: Limits, suite: bool = False, block_rule: str = "fallback"
) -> tuple[str | None, list[TestCase], list[tuple[Job, _Conversation | None]]]:
    """The runs of one program: a stdin test alone is the program itself on that stdin; every
    other run is the harness (one per test, or one for all with ``suite``)."""
    cases = parse_tests(tests)
    code = extract_code(completion, block_rule)
    if code is None or not parses_as_python(code):
        return code, cases, []
    if suite and _suitable(cases):
        return code, cases, [_harness_job(code, cases, limits)]
    runs = [
        (Job(code, c.input, limits), None) if c.kind == "stdin" else _harness_job(code, [c], limits)
        for c in cases
    ]
    return code, cases, runs


def _outcomes(case_runs: list, run: RunResult) -> list[TestOutcome]:
    """The outcomes of one run's tests (``case_runs``: its cases and conversation)."""
    cases, conv = case_runs
    if conv is None:  # the program itself on a stdin test: its exit and its output
        (case,) = cases
        if not run.ok:
            return [TestOutcome(False, run.status, run.detail or run.stderr[-300:], run)]
        good = same_stdout(run.stdout, case.expected)
        detail = "" if good else f"printed {run.stdout[:200]!r}"
        return [TestOutcome(good, "ok" if good else "wrong_answer", detail, run)]
    out = []
    for got in conv.outcomes:
        if got is None or got.status == "no_result":  # the process died before answering
            status = run.status if not run.ok else "no_result"
            got = TestOutcome(False, status, run.detail or run.stderr[-300:])
        got.run = run
        out.append(got)
    return out


def _finish(code: str | None, cases: list[TestCase], planned: list, runs: list) -> CodeScore:
    if not planned:  # no code, or it does not parse: every test fails without running
        status = "no_code" if code is None else "syntax_error"
        outcomes = [TestOutcome(False, status) for _ in cases]
    elif len(planned) == 1 and len(cases) > 1:  # one suite run for all tests
        outcomes = _outcomes([cases, planned[0][1]], runs[0])
    else:
        outcomes = [
            o
            for case, (_, conv), run in zip(cases, planned, runs, strict=True)
            for o in _outcomes([[case], conv], run)
        ]
    reward = sum(o.passed for o in outcomes) / len(outcomes) if outcomes else 0.0
    return CodeScore(reward, outcomes, code)


def code_details(
    completion: str,
    tests: Any,
    *,
    max_workers: int | None = None,
    block_rule: str = "fallback",
    **limits: Any,
) -> CodeScore:
    """Reward and per-test outcomes. ``limits``: ``timeout_s`` or any ``Limits`` field;
    ``block_rule``: which code is run (``marlow.parsers.code.BLOCK_RULES``)."""
    return score_code_batch(
        [(completion, tests)], max_workers=max_workers, block_rule=block_rule, **limits
    )[0]


def score_code(
    completion: str, tests: Any, *, max_workers: int | None = None, **limits: Any
) -> float:
    """Fraction of ``tests`` that the last python block of ``completion`` passes."""
    return code_details(completion, tests, max_workers=max_workers, **limits).reward


def score_code_batch(
    items: Sequence[tuple[str, Any]],
    *,
    max_workers: int | None = None,
    suite: bool = False,
    block_rule: str = "fallback",
    **limits: Any,
) -> list[CodeScore]:
    """``code_details`` of many (completion, tests) pairs; all tests share one worker pool.
    ``suite``: the tests of one program run in one sandbox process (module docstring)."""
    limits.setdefault("timeout_s", DEFAULT_TIMEOUT_S)
    lim = Limits.from_kwargs(**limits)
    plans = [_plan(c, t, lim, suite, block_rule) for c, t in items]
    jobs = [job for _, _, planned in plans for job, _ in planned]
    runs = run_many(jobs, max_workers=max_workers)
    out, at = [], 0
    for code, cases, planned in plans:
        out.append(_finish(code, cases, planned, runs[at : at + len(planned)]))
        at += len(planned)
    return out
