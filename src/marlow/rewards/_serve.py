"""The sandboxed side of the code harness: the candidate's code, answering requests over a pipe.

This module's source is the program the sandbox runs (``harness.serve_source``; built-in modules
only, so that it starts fast). Nothing here is trusted: the candidate's code runs in
this process and may rewrite any of it. What keeps the verdict honest lives on the caller's side
(``marlow.rewards.harness``): it only ever sends arguments and inputs here, never expected values
or test code, and it reads back only plain-data literals that it parses with ``ast.literal_eval``
and compares itself. Forging a response is therefore the same as returning a value.

Protocol, one line each way per request. The caller writes ``repr((seq, op, arg, timeout_s))``:

* ``("load", prelude)``: a fresh module namespace (``__name__ == "solution"``, so a ``__main__``
  block does not run), the prelude imports if ``prelude``, then the program.
* ``("call", (fn_name, args, load))``: ``fn_name(*args)`` in the loaded namespace (or
  ``Solution().fn_name`` when no top-level function has the name), after a fresh ``load`` with
  prelude ``load`` when it is not None; the response is its return value.
* ``("stdin", text)``: the program as ``__main__`` in a fresh namespace with ``text`` as stdin;
  the response is what it printed (at most ``cap`` characters).

and this process answers ``f"{seq} {status} {payload}"``: status ``ok`` with the value as a plain
literal (:func:`to_literal`), or a failure status (``runtime_error``, ``timeout``, ``memory``,
``output_limit``) with a one-line detail. Each request runs under a ``SIGALRM`` timer of
``timeout_s`` (None: no timer; the sandbox's limits bound it), and a request is over only when the
non-daemon threads it left behind have finished within that time, as a process's exit waits for
them. The program's own stdin is empty and its fd 1 is its stderr; the request and response
channels are duplicates of the original fds 0 and 1 taken before it runs.
"""

from __future__ import annotations

import _signal  # not ``signal``: it imports enum, ~7 ms of every run's start
import io
import os
import sys

MAX_DEPTH = 100


def to_literal(x: object, depth: int = 0) -> str:
    """``x`` as the text of a Python literal of plain types only: None, bool, int, float, str,
    bytes, and list/tuple/dict/set of them (a frozenset is sent as a set, a subclass of a plain
    type as its base type). ``inf`` is written ``1e999``; NaN and anything else raise."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if x is None or x is True or x is False:
        return repr(x)
    if isinstance(x, int):
        return int.__repr__(x)
    if isinstance(x, float):
        if x != x:
            raise ValueError("NaN is not sent")
        if x in (float("inf"), float("-inf")):
            return "1e999" if x > 0 else "-1e999"
        return float.__repr__(x)
    if isinstance(x, str):
        return str.__repr__(x)
    if isinstance(x, bytes):
        return bytes.__repr__(x)
    if isinstance(x, list | tuple | set | frozenset):
        items = ", ".join(to_literal(v, depth + 1) for v in x)
        if isinstance(x, list):
            return f"[{items}]"
        if isinstance(x, tuple):
            return f"({items},)" if len(x) == 1 else f"({items})"
        return f"{{{items}}}" if items else "set()"
    if isinstance(x, dict):
        pairs = (f"{to_literal(k, depth + 1)}: {to_literal(v, depth + 1)}" for k, v in x.items())
        return "{" + ", ".join(pairs) + "}"
    raise TypeError(f"{type(x).__name__} is not plain data")


class _Timeout(BaseException):
    pass


class _Overflow(BaseException):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Timeout()


def _capped(cap: int) -> io.StringIO:
    class Capped(io.StringIO):
        def write(self, s: str) -> int:
            if self.tell() + len(s) > cap:
                raise _Overflow()
            return super().write(s)

    return Capped()


def _load(state: dict, prelude: bool) -> None:
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    if prelude:
        exec(state["prelude"], ns)
    exec(state["program"], ns)
    state["ns"] = ns


def _answer(op: str, arg: object, state: dict, cap: int) -> object:
    """Run one request; its value, or an exception."""
    if op == "load":
        _load(state, bool(arg))
        return None
    if op == "call":
        name, args, load = arg  # type: ignore[misc]
        if load is not None:
            _load(state, load)
        ns = state["ns"]
        fn = ns.get(name)
        if not callable(fn) and isinstance(ns.get("Solution"), type):
            fn = getattr(ns["Solution"](), name)
        return fn(*args)
    buf = _capped(cap)
    sys.stdin, sys.stdout = io.StringIO(arg), buf  # type: ignore[arg-type]
    try:
        exec(state["program"], {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    return buf.getvalue()


def _wait_threads() -> None:
    """Join the non-daemon threads still running (a process's exit would wait for them)."""
    threading = sys.modules.get("threading")
    if threading is None:  # never imported: no thread that could keep a process alive
        return
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()


def serve(program: str, prelude: str, cap: int) -> None:
    """Answer requests on the original stdin until it closes, then exit at once."""
    requests = os.fdopen(os.dup(0), "rb")
    out = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    _signal.signal(_signal.SIGALRM, _alarm)
    state = {"program": compile(program, "solution.py", "exec"), "ns": {}}
    state["prelude"] = compile(prelude, "<prelude>", "exec")
    stdin, stdout = io.StringIO(""), sys.stdout
    names = {"__builtins__": {}, "inf": float("inf"), "nan": float("nan")}
    for line in requests:
        seq, op, arg, timeout = eval(line, names)
        status, payload = "ok", ""
        try:
            if timeout is not None:
                _signal.setitimer(_signal.ITIMER_REAL, timeout)
            try:
                payload = to_literal(_answer(op, arg, state, cap))
                _wait_threads()
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
        except _Timeout:
            status = "timeout"
        except _Overflow:
            status = "output_limit"
        except MemoryError:
            status = "memory"
        except BaseException as e:
            status, payload = "runtime_error", type(e).__name__
        sys.stdin, sys.stdout = stdin, stdout
        os.write(out, f"{seq} {status} {payload}\n".encode("utf-8", "replace"))
    os._exit(0)
