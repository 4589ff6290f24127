"""The trusted side of the code harness: tests run here, each call of the candidate in the sandbox.

The verdict never comes from anything the program controls. The sandboxed process
(``marlow.rewards._serve``) holds the candidate's code and answers requests: load the code, call
a function with these arguments, run the program on this stdin. It receives arguments and inputs
only; test code and expected values stay in this process. Its answers are parsed by
:func:`from_literal` (``ast.literal_eval`` of a size-capped line, then an exact-type walk), so
what comes back is plain data built here: no object of the program's (an always-true ``__eq__``,
a ``str`` subclass) ever reaches a comparison, and a forged answer is no more than a returned
value, which must equal an expected value the program never saw. A program that exits, hangs,
crashes or kills its process fails every test it has not answered yet.

HumanEval's ``check(candidate)`` runs here, in a thread of the caller: the problem's trusted
``prompt`` (its helpers, such as ``encode_cyclic`` or ``poly``, which a test may call) and test
code are executed with the entry point bound to a :class:`Candidate` proxy. Where this departs
from running ``code + test + check(entry_point)`` as one script: arguments are copied into the
sandbox (a test never sees the candidate mutate them), a value that is not plain data fails the
call, NaN is not sent back, the calls whose arguments are literals in the test source are made
first, back to back in source order (one round trip instead of one each: a stateful candidate
sees them in that order, and one in a branch the test never takes is made anyway), and the
test's ``import random`` gets a private generator seeded with 0 (HumanEval/53 draws from the
global one; the caller's random state is left alone and a check is deterministic). The test code
itself is trusted (the dataset's): it runs unbounded but for the candidate's calls, which share
the run's wall clock. The proxy raises :class:`CandidateFailed`, a ``BaseException``, so a test's
``except Exception`` cannot turn a crash or timeout of the candidate into a pass.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import random
import threading
import time
import types
from collections.abc import Sequence
from typing import Any

from marlow.rewards import _serve
from marlow.rewards.sandbox import TIMEOUT, Channel

_PLAIN_TYPES = (type(None), bool, int, float, str, bytes)
_AST = threading.Lock()
"""Held around every ``ast`` parse and ``compile`` here. The check harness grades programs in
threads (``sandbox.run_many``), and CPython 3.11's AST-to-object conversion keeps one recursion
counter per interpreter: two threads converting at once can leave it off, and a later parse fails
with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905), which graded a
canonical HumanEval solution as a wrong answer once in several full test runs. The parses are
small and cached, so serialising them costs nothing measurable."""


@functools.cache
def _serve_module() -> str:
    return inspect.getsource(_serve)


def serve_source(program: str, prelude: str, cap: int) -> str:
    """The sandboxed program: ``_serve`` answering requests about ``program``."""
    return f"{_serve_module()}\n\nserve({program!r}, {prelude!r}, {cap!r})\n"


def from_literal(text: str) -> Any:
    """Plain data from an answer: ``ast.literal_eval``, then only exact plain types (None, bool,
    int, float, str, bytes; list, tuple, dict, set) at most ``_serve.MAX_DEPTH`` deep."""
    with _AST:
        value = ast.literal_eval(text)

    def walk(x: Any, depth: int) -> None:
        if depth > _serve.MAX_DEPTH:
            raise ValueError("nested too deeply")
        if type(x) in _PLAIN_TYPES:
            return
        if type(x) in (list, tuple, set):
            for v in x:
                walk(v, depth + 1)
        elif type(x) is dict:
            for k, v in x.items():
                walk(k, depth + 1)
                walk(v, depth + 1)
        else:
            raise ValueError(f"{type(x).__name__} is not plain data")

    walk(value, 0)
    return value


class CandidateFailed(BaseException):  # noqa: N818 (a verdict, not an error of this code)
    """A call of the candidate gave no value: ``status`` says why (timeout, runtime_error...)."""

    def __init__(self, status: str, detail: str = "") -> None:
        super().__init__(f"{status}: {detail}" if detail else status)
        self.status, self.detail = status, detail


class Session:
    """Requests to one sandboxed ``_serve`` process over its ``Channel``. ``submit`` queues a
    request and ``answer`` waits for its answer, so requests can be pipelined (the process
    answers them in order). A request's ``timeout_s`` is the process's own ``SIGALRM`` timer; here
    an answer is awaited up to the run's wall clock (a program that defeats its timer loses the
    tests after it, as a process killed at its limit does). After a request gets no answer the
    session is dead and every later request fails at once."""

    def __init__(self, channel: Channel) -> None:
        self.ch = channel
        self.seq = 0
        self.dead: str | None = None  # why no request can be answered any more
        self._lines: dict[int, bytes] = {}  # answer lines read ahead, by request number

    def submit(self, op: str, arg: Any, timeout_s: float | None) -> int:
        """Queue one request; its number (``CandidateFailed`` if ``arg`` is not plain data)."""
        if self.dead:
            raise CandidateFailed(self.dead, "an earlier request got no answer")
        try:
            line = f"({self.seq + 1}, {op!r}, {_serve.to_literal(arg)}, {timeout_s!r})\n"
        except (TypeError, ValueError) as exc:
            raise CandidateFailed("bad_argument", str(exc)) from None
        self.seq += 1
        self.ch.send(line.encode())
        return self.seq

    def answer(self, seq: int) -> Any:
        """The value of request ``seq``, or raise ``CandidateFailed``."""
        while seq not in self._lines:
            if self.dead:
                raise CandidateFailed(self.dead, "an earlier request got no answer")
            raw = self.ch.line(self.ch.deadline)
            if raw is None:
                late = time.monotonic() >= self.ch.deadline
                self.dead = self.ch.verdict or (TIMEOUT if late else "no_result")
                raise CandidateFailed(self.dead, "no answer")
            head, _, rest = raw.partition(b" ")
            if len(head) < 12 and head.isdigit() and 0 < int(head) <= self.seq:  # else ignored
                self._lines.setdefault(int(head), rest)  # the first line for a request counts
        status, _, payload = self._lines.pop(seq).decode("utf-8", "replace").partition(" ")
        if status != "ok":
            raise CandidateFailed(status, payload)
        try:
            return from_literal(payload)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
            raise CandidateFailed("bad_value", f"{type(exc).__name__}: {exc}"[:200]) from None

    def request(self, op: str, arg: Any, timeout_s: float | None) -> Any:
        return self.answer(self.submit(op, arg, timeout_s))


class Candidate:
    """The function under test, as HumanEval's ``check(candidate)`` sees it: each call sends its
    arguments to the sandboxed process and returns the plain value that comes back. ``ahead``:
    argument lists sent at once, before the test runs (a call with the same arguments then takes
    the first of their answers not taken yet), so that the process computes them back to back
    instead of one round trip each."""

    def __init__(self, session: Session, name: str, ahead: Sequence[list]) -> None:
        self._session, self.__name__ = session, name
        self._ahead: list[tuple[str, int]] = []  # (arguments as a literal, request number)
        for args in ahead:
            seq = session.submit("call", (name, args, None), None)
            self._ahead.append((_serve.to_literal(args), seq))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise CandidateFailed("bad_argument", "keyword arguments are not sent")
        try:
            key = _serve.to_literal(list(args))
        except (TypeError, ValueError) as exc:
            raise CandidateFailed("bad_argument", str(exc)) from None
        for i, (text, seq) in enumerate(self._ahead):
            if text == key:
                del self._ahead[i]
                return self._session.answer(seq)
        return self._session.request("call", (self.__name__, list(args), None), None)


@functools.lru_cache(maxsize=512)
def _literal_calls(test: str, entry_point: str) -> tuple[list, ...]:
    """The argument lists of the calls of the candidate (``check``'s parameter, or the entry
    point by name) whose arguments are all literals, in source order."""
    with _AST:
        tree = ast.parse(test)
    names = {entry_point}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check" and node.args.args:
            names.add(node.args.args[0].arg)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in names
            and not node.keywords
        ):
            try:
                with _AST:
                    args = [ast.literal_eval(a) for a in node.args]
                _serve.to_literal(args)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                continue
            found.append((node.lineno, node.col_offset, args))
    return tuple(args for _, _, args in sorted(found, key=lambda f: f[:2]))


@functools.lru_cache(maxsize=512)
def _compiled(source: str, name: str) -> types.CodeType:
    with _AST:
        return compile(source, name, "exec")


def _private_random() -> types.ModuleType:
    """A ``random`` module whose functions draw from one private generator seeded with 0."""
    rng = random.Random(0)
    mod = types.ModuleType("random")
    mod.__dict__.update(random.__dict__)
    for name in dir(rng):
        if not name.startswith("_") and callable(getattr(random, name, None)):
            setattr(mod, name, getattr(rng, name))
    return mod


def _check_builtins() -> dict:
    private = _private_random()

    def _import(name: str, *args: Any, **kwargs: Any) -> Any:
        return private if name == "random" else builtins.__import__(name, *args, **kwargs)

    return {**builtins.__dict__, "__import__": _import}


def run_check(session: Session, test: str, entry_point: str, prompt: str) -> None:
    """HumanEval's ``check(candidate)`` here, the candidate in the session; raises
    ``CandidateFailed`` when a call gave no value and any other exception when a test fails."""
    loaded = session.submit("load", False, None)
    candidate = Candidate(session, entry_point, _literal_calls(test, entry_point))
    ns: dict[str, Any] = {"__name__": "__check__", "__builtins__": _check_builtins()}
    if prompt:
        exec(_compiled(prompt, "<prompt>"), ns)
    exec(_compiled(test, "<test>"), ns)
    ns[entry_point] = candidate
    session.answer(loaded)
    ns["check"](candidate)
