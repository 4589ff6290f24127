"""A user's function, found by an import path and called behind one guard: the home of what a
user's reward (``task.reward``) and a workflow's tool stage (``call:``) share.

* :func:`load_callable` imports ``package.module:function`` or ``path/to/file.py:function`` (a
  file, relative to the working directory, whose own folder goes on ``sys.path`` so that it can
  import the modules beside it, as pytest does for a test file) and refuses, in one line naming
  the setting, a path that does not import or a name that is not a function.
* :func:`call_guarded` calls it in a daemon thread for at most a number of seconds; an exception
  (anything it raises, a thread that cannot start) becomes :class:`CallFailed` with the error's
  first line, and an overrun :class:`CallTimedOut`.

A coroutine it returns is awaited on one event loop that lives as long as the process (its own
thread), as TRL keeps one: an ``asyncio.Semaphore``, a client or a lock made at import or on the
first call works on every later call. A coroutine past its time is cancelled. A loop held up by
blocking code inside a coroutine (cancelling cannot stop it) is left behind and later calls get
a new loop.

A sync call past its time cannot be stopped the way a process can; it is stopped the way Python
allows: :class:`Abandoned` is raised inside its thread (``PyThreadState_SetAsyncExc``), which ends
a call busy in Python code (a spinning loop) at its next bytecode, so that it does not go on
taking the interpreter from the run. A call blocked inside C (a sleep, a socket read) costs no
CPU and ends when that returns; at most :data:`MAX_ABANDONED` calls of one function may be left
running so, and past that the function is not called again until one ends (each call refused is
a :class:`CallTimedOut`), so hung calls never pile up. A function whose last
:data:`MAX_ABANDONED` calls all ran past their time is not called for :data:`COOLDOWN_S`
seconds, then tried again: a tool that hangs on every call costs a run a few timeouts, not one
per call. Chosen over running user code in a worker
process that could be killed: no process to start, no pickling of every call's arguments, and
the user's module state (clients, caches) shared with the run as TRL shares it; what it cannot
end is code that catches :class:`Abandoned` or spins inside C, which a process would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import importlib
import importlib.util
import inspect
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from marlow.config import ConfigError


class UserCodeError(ConfigError):
    """A user's function cannot be imported or is not a function; the message is one line."""


class CallFailed(Exception):  # noqa: N818 - the outcome of one call, with its one line
    """The user's function raised; ``str()`` is ``Type: first line``."""


class CallTimedOut(Exception):  # noqa: N818
    """The user's function ran past its time limit."""


class Abandoned(BaseException):  # noqa: N818 - raised in a user's thread to end it
    """Raised inside a user's call that ran past its time (module docstring); a BaseException so
    that ``except Exception`` in the user's code lets it through."""


MAX_ABANDONED = 4
"""Calls of one function (by name) that may still run past their time; past that it is not
called until one ends."""
STOP_GRACE_S = 0.5
"""How long a cancelled coroutine may take to end before its loop is left behind."""
COOLDOWN_S = 60.0
"""How long a function whose last :data:`MAX_ABANDONED` calls all ran past their time is not
called (each call refused at once, as a timeout) before it is tried again."""


def first_line(err: BaseException) -> str:
    """``Type: first line`` of an exception, at most 300 characters."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300].rstrip(": ")


def load_callable(spec: str, setting: str) -> Callable[..., Any]:
    """The function ``spec`` names (``module:function`` or ``file.py:function``); every problem
    is a :class:`UserCodeError` naming ``setting`` (``task.reward``, ``stages[2].call``)."""
    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name.isidentifier():
        raise UserCodeError(
            f"{setting} is {spec!r}; valid: package.module:function or path/to/file.py:function"
        )
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserCodeError(f"{setting} {spec!r}: file {where} does not exist")
        module_name = f"marlow_user_{abs(hash(str(path.resolve())))}"
        folder = str(path.resolve().parent)  # its own folder importable, as pytest makes it
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            found = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(found)
            sys.modules[module_name] = module  # dataclasses and pickling look modules up here
            found.loader.exec_module(module)
        except (Exception, SystemExit) as err:  # the user's module failed to run: one line
            sys.modules.pop(module_name, None)
            raise UserCodeError(
                f"{setting} {spec!r}: {where} failed to import: {first_line(err)}"
            ) from None
    else:
        try:
            module = importlib.import_module(where)
        except (Exception, SystemExit) as err:
            raise UserCodeError(
                f"{setting} {spec!r}: cannot import {where}: {first_line(err)}"
            ) from None
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UserCodeError(
            f"{setting} {spec!r}: {where} has no {name!r}; its functions: "
            f"{', '.join(public) or 'none'}"
        )
    if not callable(fn):
        raise UserCodeError(f"{setting} {spec!r}: {name} is a {type(fn).__name__}, not callable")
    return fn


def call_guarded(fn: Callable[[], Any], timeout_s: float, name: str = "marlow-user") -> Any:
    """``fn()`` in a daemon thread named ``name``, a coroutine it returns awaited on the
    process's user loop, for at most ``timeout_s`` seconds in all: its value, or
    :class:`CallFailed` / :class:`CallTimedOut` (module docstring)."""
    end = time.monotonic() + timeout_s
    refused = _CALLS.refusal(name)
    if refused is not None:
        raise CallTimedOut(refused)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - the user's code: reported, never raised here
            box["error"] = err

    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError as err:  # no thread to be had
        raise CallFailed(first_line(err)) from None
    thread.join(max(end - time.monotonic(), 0.0))
    if thread.is_alive():
        _CALLS.timed_out(name, thread)
        raise CallTimedOut(f"took longer than {timeout_s:g} s")
    if "error" in box:
        _CALLS.answered(name)
        raise CallFailed(first_line(box["error"]))
    value = box["value"]
    if inspect.isawaitable(value):
        value = _await(value, end, timeout_s, name)
    _CALLS.answered(name)
    return value


def _await(value: Any, end: float, timeout_s: float, name: str) -> Any:
    """``value`` awaited on the user loop until ``end`` (time.monotonic); cancelled past it."""
    loop = _LOOP.get()
    future = asyncio.run_coroutine_threadsafe(_awaited(value), loop)
    try:
        return future.result(max(end - time.monotonic(), 0.0))
    except concurrent.futures.TimeoutError:
        future.cancel()
        probe: concurrent.futures.Future = concurrent.futures.Future()
        loop.call_soon_threadsafe(probe.set_result, None)
        try:  # the loop runs the cancellation and the probe unless blocking code holds it
            probe.result(STOP_GRACE_S)
        except concurrent.futures.TimeoutError:  # held: later calls get a new loop
            _LOOP.leave(loop)
        _CALLS.timed_out(name)
        raise CallTimedOut(f"took longer than {timeout_s:g} s") from None
    except concurrent.futures.CancelledError:
        _CALLS.timed_out(name)
        raise CallTimedOut(f"took longer than {timeout_s:g} s") from None
    except Exception as err:  # the coroutine raised
        _CALLS.answered(name)
        raise CallFailed(first_line(err)) from None


async def _awaited(value: Any) -> Any:
    return await value


class _UserLoop:
    """The process's event loop for users' coroutines, in a daemon thread of its own, made on
    first use (and again in a forked child, or after :meth:`leave`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="marlow-user-loop", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def leave(self, loop: asyncio.AbstractEventLoop) -> None:
        """``loop`` is held up: stop it once it can, and make a new one for later calls."""
        with self._lock:
            if loop is self._loop:
                loop.call_soon_threadsafe(loop.stop)
                self._loop = self._thread = None


class _Registry:
    """Calls that ran past their time, by function name: each has :class:`Abandoned` raised in
    its thread; a function with :data:`MAX_ABANDONED` calls still running, or whose last
    :data:`MAX_ABANDONED` calls all ran past their time, is refused (:meth:`refusal`), the
    latter for :data:`COOLDOWN_S` seconds, then tried again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[str, list[threading.Thread]] = {}
        self._late: dict[str, int] = {}  # consecutive calls past their time
        self._until: dict[str, float] = {}  # refused until (time.monotonic)

    def timed_out(self, name: str, thread: threading.Thread | None = None) -> None:
        if thread is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(thread.ident), ctypes.py_object(Abandoned)
            )
        with self._lock:
            if thread is not None:
                self._threads.setdefault(name, []).append(thread)
            self._late[name] = self._late.get(name, 0) + 1
            if self._late[name] >= MAX_ABANDONED:
                self._until[name] = time.monotonic() + COOLDOWN_S

    def answered(self, name: str) -> None:
        with self._lock:
            self._late.pop(name, None)

    def refusal(self, name: str) -> str | None:
        """Why ``name`` is not called now, or None."""
        with self._lock:
            alive = [t for t in self._threads.get(name, []) if t.is_alive()]
            self._threads[name] = alive
            if len(alive) >= MAX_ABANDONED:
                return f"not called: {len(alive)} earlier calls still run past their time limit"
            left = self._until.get(name, 0.0) - time.monotonic()
            if left > 0:
                return (
                    f"not called: its last {self._late[name]} calls ran past their time limit; "
                    f"tried again in {left:.0f} s"
                )
            return None


_LOOP = _UserLoop()
_CALLS = _Registry()
