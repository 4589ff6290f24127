"""A user's function, found by an import path and called behind one guard: the home of what a
user's reward (``task.reward``) and a workflow's tool stage (``call:``) share.

* :func:`load_callable` imports ``package.module:function`` or ``path/to/file.py:function`` (a
  file, relative to the working directory) and refuses, in one line naming the setting, a path
  that does not import or a name that is not a function.
* :func:`call_guarded` calls it (awaiting a coroutine it returns) in a daemon thread for at most
  a number of seconds; an exception becomes :class:`CallFailed` with the error's first line, and
  an overrun :class:`CallTimedOut`. A timed-out call is abandoned, not stopped (Python cannot
  stop a thread): a function that never returns keeps its thread until the process ends, and
  the next call gets a thread of its own.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
import threading
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
        try:
            found = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(found)
            sys.modules[module_name] = module  # dataclasses and pickling look modules up here
            found.loader.exec_module(module)
        except Exception as err:  # the user's module failed to run: one line
            sys.modules.pop(module_name, None)
            raise UserCodeError(
                f"{setting} {spec!r}: {where} failed to import: {first_line(err)}"
            ) from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as err:
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
    """``fn()`` (awaited when it returns a coroutine) in a daemon thread, at most ``timeout_s``
    seconds: its value, or :class:`CallFailed` / :class:`CallTimedOut`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            value = fn()
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            box["value"] = value
        except BaseException as err:  # noqa: BLE001 - the user's code: reported, never raised here
            box["error"] = err

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CallTimedOut(f"took longer than {timeout_s:g} s")
    if "error" in box:
        raise CallFailed(first_line(box["error"]))
    return box["value"]


async def _awaited(value: Any) -> Any:
    return await value
