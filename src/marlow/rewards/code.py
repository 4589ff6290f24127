"""Code outcome reward (SPEC §3): the last fenced python block, run against hidden tests.

``score_code(completion, tests, **limits)`` is the fraction of tests passed; ``code_details``
returns the same with one ``TestOutcome`` per test; ``score_code_batch`` scores many
(completion, tests) pairs with all their tests on one pool. Every test is one run of the sandbox
(``marlow.rewards.sandbox``), so a test's crash, timeout or output flood costs only that test.

Extraction: the last fenced block tagged ``python``/``py``/``python3``; else the last fenced block
of any language; else the whole completion if it parses as Python; else nothing (reward 0).

Test styles (``tests`` may also be the JSON string of any of these):

* **stdin/stdout** (APPS/TACO/CodeContests in DeepCoder): ``{"inputs": [...], "outputs": [...]}``.
  The program reads the input on stdin; its stdout passes when it equals the expected output after
  stripping, per line, with runs of whitespace collapsed and trailing blank lines dropped.
* **function call**: the same with ``"fn_name"``. Each input is a list of positional arguments or
  a JSON string of one (or one JSON value per line, as LiveCodeBench writes them); each output is
  the expected return value (or its JSON). The function is called by a harness that loads the code
  as a module named ``solution`` (its ``__main__`` block does not run), with ``from typing import
  *`` and a few common modules preloaded; when there is no top-level function of that name,
  ``Solution().<fn_name>`` is used. Return values are compared by value after a JSON round trip
  (tuples are lists), floats with a relative tolerance of 1e-6; an expected ``[x]`` also accepts
  ``x`` (APPS wraps call outputs in a list).
* **LiveCodeBench/DeepCoder rows**: a list of ``{"input", "output", "testtype": "stdin" |
  "functional", "metadata": {"func_name"}}``.
* **check harness** (HumanEval): ``{"check": test_source, "entry_point": name}``: one test that
  passes when ``code + test_source + check(name)`` exits 0.

**Suite mode** (``suite=True``; the tiny code task's grader uses it): the stdin and call tests of
one program run in ONE sandboxed process instead of one each, which is ~N times cheaper for N
tests (a sandbox start costs ~50 ms on 2 cores; tiny programs run in microseconds). The harness
runs each test in a fresh namespace with its own stdin and captured stdout (capped at
``SUITE_OUTPUT_CAP`` characters), and bounds each test by a wall-clock ``SIGALRM`` timer of
``timeout_s``; the sandbox bounds the whole process by ``N * timeout_s`` of CPU and wall. What
differs from the default mode: tests share one interpreter, so a program that kills its process,
swallows the timer's exception in an endless loop or corrupts interpreter state loses the tests
that had not reported yet (they score 0, as the spec allows for a program that never runs), and
state a test leaves in imported modules is visible to the next test. Check-harness tests always
run one per process.

The expected outputs never enter the sandbox; a program can only hand back what it computed.
All public functions and records are module level, so they pickle.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from marlow.rewards.sandbox import SANDBOX_ERROR, Job, Limits, RunResult, run_many

DEFAULT_TIMEOUT_S = 6.0

_FENCE = re.compile(r"^[ \t]*```[ \t]*([^\n`]*)\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_PY_TAGS = {"python", "py", "python3", "py3"}


def extract_code(completion: str) -> str | None:
    """The code to run from a completion (see the module docstring), or None."""
    blocks = [(m.group(1).strip().lower(), m.group(2)) for m in _FENCE.finditer(completion)]
    py = [body for tag, body in blocks if tag.split()[:1] and tag.split()[0] in _PY_TAGS]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    if completion.strip() and _parses(completion):
        return completion
    return None


def code_key(completion: str) -> str | None:
    """The program of a completion, normalised for comparing answers (Voting's majority vote):
    blank lines dropped, runs of spaces inside a line collapsed, indentation kept; None when
    there is no code."""
    code = extract_code(completion)
    if code is None:
        return None
    lines = []
    for line in code.splitlines():
        if line.strip():
            indent = len(line) - len(line.lstrip())
            lines.append(" " * indent + " ".join(line.split()))
    return "\n".join(lines) or None


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


# ----------------------------------------------------------------------------- tests


@dataclass(frozen=True)
class TestCase:
    kind: str  # "stdin" | "call" | "check"
    input: Any  # stdin text | list of args | the check source
    expected: Any  # stdout text | return value | entry point name
    fn_name: str = ""

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
        return [TestCase("check", str(tests["check"]), str(tests["entry_point"]))]
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
    if _eq(actual, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _eq(actual, expected[0])


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

_PLAIN = """\
def _plain(x):
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    return x
"""
"""A return value as plain JSON data (tuples become lists, keys strings), in both harnesses."""

_CALL_HARNESS = """\
import io, json, sys
_marker = {marker!r}
_args = json.loads(sys.stdin.read())
sys.stdin = io.StringIO("")
_ns = {{"__name__": "solution", "__builtins__": __builtins__}}
exec(compile({prelude!r}, "<prelude>", "exec"), _ns)
exec(compile({code!r}, "solution.py", "exec"), _ns)
_fn = _ns.get({fn!r})
if not callable(_fn) and isinstance(_ns.get("Solution"), type):
    _fn = getattr(_ns["Solution"](), {fn!r})
_result = _fn(*_args)
{plain}sys.stdout.flush()
sys.stdout.write("\\n" + _marker + json.dumps(_plain(_result), default=repr) + "\\n")
sys.stdout.flush()
"""


SUITE_OUTPUT_CAP = 1 << 16  # characters of captured stdout per test in suite mode

_SUITE_HARNESS = """\
import io, json, os, signal, sys
_marker = {marker!r}
_spec = json.loads(sys.stdin.read())
_report_fd = os.dup(1)
class _Timeout(BaseException):
    pass
class _Overflow(BaseException):
    pass
def _alarm(signum, frame):
    raise _Timeout()
signal.signal(signal.SIGALRM, _alarm)
class _Capped(io.StringIO):
    def write(self, s):
        if self.tell() + len(s) > {cap}:
            raise _Overflow()
        return super().write(s)
{plain}def _report(i, status, value):
    line = json.dumps({{"i": i, "status": status, "value": value}}, default=repr)
    os.write(_report_fd, ("\\n" + _marker + line + "\\n").encode())
_code = compile({code!r}, "solution.py", "exec")
_prelude = compile({prelude!r}, "<prelude>", "exec")
_stdin, _stdout = sys.stdin, sys.stdout
for _i, _case in enumerate(_spec["cases"]):
    _buf = _Capped()
    _status, _value = "ok", None
    try:
        sys.stdin = io.StringIO(_case if _spec["fn"] is None else "")
        sys.stdout = _buf
        signal.setitimer(signal.ITIMER_REAL, _spec["timeout"])
        try:
            if _spec["fn"] is None:
                exec(_code, {{"__name__": "__main__", "__builtins__": __builtins__}})
                _value = _buf.getvalue()
            else:
                _ns = {{"__name__": "solution", "__builtins__": __builtins__}}
                exec(_prelude, _ns)
                exec(_code, _ns)
                _fn = _ns.get(_spec["fn"])
                if not callable(_fn) and isinstance(_ns.get("Solution"), type):
                    _fn = getattr(_ns["Solution"](), _spec["fn"])
                _value = _plain(_fn(*_case))
        except SystemExit as _e:
            _ok = _e.code is None or _e.code == 0
            _status, _value = ("ok", _buf.getvalue()) if _ok and _spec["fn"] is None else (
                "runtime_error", "SystemExit")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        _status, _value = "timeout", None
    except _Overflow:
        _status, _value = "output_limit", None
    except BaseException as _e:
        _status, _value = "runtime_error", type(_e).__name__
    sys.stdin, sys.stdout = _stdin, _stdout
    try:
        _report(_i, _status, _value)
    except BaseException:
        _report(_i, "runtime_error", "unreportable value")
"""


def _suite_job(code: str, cases: list[TestCase], limits: Limits, marker: str) -> Job:
    """All (stdin or call) tests of one program in one sandbox run; see the module docstring."""
    fn = cases[0].fn_name if cases[0].kind == "call" else None
    spec = {"fn": fn, "timeout": limits.cpu_s, "cases": [c.input for c in cases]}
    src = _SUITE_HARNESS.format(
        marker=marker, cap=SUITE_OUTPUT_CAP, code=code, prelude=_PRELUDE, plain=_PLAIN
    )
    total = limits.cpu_s * len(cases)
    return Job(src, json.dumps(spec), replace(limits, cpu_s=total, wall_s=total + 1.0))


def _judge_suite(cases: list[TestCase], run: RunResult, marker: str) -> list[TestOutcome]:
    reports: dict[int, dict] = {}
    for chunk in run.stdout.split(marker)[1:]:
        try:
            row = json.loads(chunk.split("\n", 1)[0])
            reports.setdefault(int(row["i"]), row)
        except (ValueError, KeyError, TypeError):
            continue
    out = []
    for i, case in enumerate(cases):
        row = reports.get(i)
        if row is None:  # the process died or was killed before this test reported
            status = run.status if not run.ok else "no_result"
            out.append(TestOutcome(False, status, run.detail or run.stderr[-300:], run))
        elif row["status"] != "ok":
            out.append(TestOutcome(False, str(row["status"]), str(row.get("value")), run))
        elif case.kind == "stdin":
            good = isinstance(row["value"], str) and same_stdout(row["value"], case.expected)
            out.append(TestOutcome(good, "ok" if good else "wrong_answer", "", run))
        else:
            good = same_value(row["value"], case.expected)
            out.append(TestOutcome(good, "ok" if good else "wrong_answer", "", run))
    return out


def _suitable(cases: list[TestCase]) -> bool:
    """Whether ``cases`` can run as one suite: all stdin, or all calls of one function."""
    if not cases or cases[0].kind == "check":
        return False
    return all(c.kind == cases[0].kind and c.fn_name == cases[0].fn_name for c in cases)


def _job(code: str, case: TestCase, limits: Limits, marker: str) -> Job:
    if case.kind == "stdin":
        return Job(code, case.input, limits)
    if case.kind == "call":
        src = _CALL_HARNESS.format(
            marker=marker, prelude=_PRELUDE, code=code, fn=case.fn_name, plain=_PLAIN
        )
        return Job(src, json.dumps(case.input), limits)
    return Job(f"{code}\n\n{case.input}\n\ncheck({case.expected})\n", "", limits)


def _judge(case: TestCase, run: RunResult, marker: str) -> TestOutcome:
    if case.kind == "check":
        return TestOutcome(run.ok, run.status, run.stderr[-300:] if not run.ok else "", run)
    if not run.ok:
        return TestOutcome(False, run.status, run.detail or run.stderr[-300:], run)
    if case.kind == "stdin":
        good = same_stdout(run.stdout, case.expected)
        return TestOutcome(good, "ok" if good else "wrong_answer", "", run)
    at = run.stdout.rfind(marker)
    if at < 0:
        return TestOutcome(False, "wrong_answer", "no return value reported", run)
    try:
        value = json.loads(run.stdout[at + len(marker) :].strip())
    except ValueError:
        return TestOutcome(False, "wrong_answer", "return value is not JSON", run)
    good = same_value(value, case.expected)
    return TestOutcome(good, "ok" if good else "wrong_answer", "", run)


def _plan(
    completion: str, tests: Any, limits: Limits, suite: bool = False
) -> tuple[str | None, list, list[Job]]:
    cases = parse_tests(tests)
    code = extract_code(completion)
    if code is None or not _parses(code):
        return code, cases, []
    marker = f"\x00marlow-return-{secrets.token_hex(8)}\x00"
    if suite and _suitable(cases):
        return code, [(c, marker) for c in cases], [_suite_job(code, cases, limits, marker)]
    return code, [(c, marker) for c in cases], [_job(code, c, limits, marker) for c in cases]


def _finish(code: str | None, planned: list, runs: Sequence[RunResult]) -> CodeScore:
    if not runs:  # no code, or it does not parse: every test fails without running
        status = "no_code" if code is None else "syntax_error"
        outcomes = [TestOutcome(False, status) for _ in planned]
    elif len(runs) == 1 and len(planned) > 1:  # one suite run for all tests
        outcomes = _judge_suite([c for c, _ in planned], runs[0], planned[0][1])
    else:
        outcomes = [_judge(c, r, m) for (c, m), r in zip(planned, runs, strict=True)]
    reward = sum(o.passed for o in outcomes) / len(outcomes) if outcomes else 0.0
    return CodeScore(reward, outcomes, code)


def code_details(
    completion: str, tests: Any, *, max_workers: int | None = None, **limits: Any
) -> CodeScore:
    """Reward and per-test outcomes. ``limits``: ``timeout_s`` or any ``Limits`` field."""
    return score_code_batch([(completion, tests)], max_workers=max_workers, **limits)[0]


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
    **limits: Any,
) -> list[CodeScore]:
    """``code_details`` of many (completion, tests) pairs; all tests share one worker pool.
    ``suite``: the tests of one program run in one sandbox process (module docstring)."""
    limits.setdefault("timeout_s", DEFAULT_TIMEOUT_S)
    lim = Limits.from_kwargs(**limits)
    plans = [_plan(c, t, lim, suite) for c, t in items]
    jobs = [j for _, _, js in plans for j in js]
    runs = run_many(jobs, max_workers=max_workers)
    out, at = [], 0
    for code, planned, js in plans:
        out.append(_finish(code, planned, runs[at : at + len(js)]))
        at += len(js)
    return out
