"""Tool stages: a workflow stage that calls a function instead of a model, the built-in stage kind
(:data:`TOOL_STAGE`; :mod:`marlow.workflows.stage_kinds`): its fields, check, preparation and run.

A workflow file declares one as ``- {tool: NAME, call: package.module:function, reads: {...}}``
(``path/to/file.py:function`` works too). For each episode where the stage runs, and each of its
slots, the function is called with keywords:

* ``reads``: the stage's reads as text, by field name (``{"program": "..."}``), exactly as a
  role's prompt would get them;
* ``problem``: the :class:`marlow.types.Problem` (``id``, ``prompt``, ``answer``, and ``meta``:
  a custom task's dataset columns under ``meta["columns"]``, a code task's visible tests under
  ``meta["visible_tests"]``);
* ``episode``: the episode so far, as the records of its turns and earlier tool calls (role,
  prompt, completion; tool, inputs, output).

It may be ``async def`` (awaited on one event loop for the whole run: :mod:`marlow.usercode`). It
returns text, or a mapping whose ``"text"`` is the text and whose other keys are fields kept with
the call (``ok``: a bool saying whether what it checked passed; the revision rate reads it).
Fields are kept as plain JSON values (a numpy bool as a bool, an object as its repr); a text over
:data:`MAX_TEXT` characters is cut, with a note saying how much. Later stages read the text as they read a role's output
(``last.NAME``, ``outputs.NAME``, ...).

What can go wrong costs one call, never the run: an exception gives the text
``tool NAME failed: Type: first line``, a call past ``workflow.tool_timeout_s`` the text ``tool
NAME timed out after S s``, and a return that is neither text nor such a mapping ``tool NAME
returned a TYPE, not text`` (a returned object is read under the call's guard: one whose
methods raise or hang is a failed or timed-out call too); each is counted (the call's status, and the episode counters
``tool_error`` / ``tool_timeout``). Calls run in threads, each with its own time limit,
:data:`TOOL_WORKERS` at a time (a timed-out call's thread is abandoned:
:mod:`marlow.usercode`).

Security: the function is the user's trusted code, but what it receives is model output. It
must not run or ``eval`` that text itself; marlow's built-in code tool
(:func:`marlow.workflows.codetools.run_visible_tests`) runs programs only in the code reward's sandbox.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from marlow.types import NOT_UNICODE, Episode, Problem, ToolCall, unicode_text
from marlow.usercode import (
    CallFailed,
    CallTimedOut,
    call_guarded,
    first_line,
    load_callable,
)
from marlow.workflows.spec import EpisodeState, Stage
from marlow.workflows.stage_kinds import Condition, StageContext, StageKind

TOOL_SOURCES = ("last", "own", "outputs", "others")
"""The read sources that may name a tool (a tool has no plan)."""
TOOL_WORKERS = 8
"""Calls of one stage that run at once (each in a thread, each with its own time limit)."""
MAX_TEXT = 100_000
"""The most characters of a call's text that later stages read; the rest is cut, with a note."""
MAX_FIELD = 10_000
"""The most characters of a string field a call returns (or of a field's repr)."""


@cache
def tool_function(call: str, setting: str = "call") -> Callable[..., Any]:
    """The function ``call`` names, imported once per process (a one-line
    :class:`marlow.usercode.UserCodeError` naming ``setting`` when it cannot be)."""
    return load_callable(call, setting)


class ToolStage(BaseModel):
    """A tool stage (``{tool: NAME, call: package.module:function, reads: {...}}``): a function
    called instead of a model, whose text later stages read (``last.NAME``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tool: str = Field(description="its name: what later stages read (last.TOOL); not a role's")
    call: str = Field(
        description="the function it calls: package.module:function or path/to/file.py:function"
    )


def _check(stage: ToolStage, earlier: ToolStage | None) -> tuple[str, str] | None:
    """One tool, one function; a call that names a function."""
    if earlier is not None and earlier.call != stage.call:
        return (
            "call",
            f"tool {stage.tool} calls {earlier.call} in an earlier stage; one tool, one "
            "function (give this stage another name)",
        )
    where, colon, name = stage.call.rpartition(":")
    if not colon or not where or not name.isidentifier():
        return (
            "call",
            f"call is {stage.call!r}; valid: package.module:function or path/to/file.py:function",
        )
    return None


def _prepare(stage: ToolStage) -> None:
    """Import the tool's function before the run starts (once: the run's calls reuse it)."""
    tool_function(stage.call)


def _as_output(tool: str, value: Any) -> tuple[str, dict[str, Any], str]:
    """A returned value as (text, fields, status): the text cut to :data:`MAX_TEXT` characters,
    the fields as plain JSON values (:func:`_plain`). Text that is not valid unicode (a lone
    surrogate, which no tokenizer reads in a later stage's prompt) is an error call."""
    text = value if isinstance(value, str) else None
    fields: dict[str, Any] = {}
    if isinstance(value, Mapping) and isinstance(value.get("text"), str):
        text = value["text"]
        fields = {_cut(str(k), 200): _plain(v) for k, v in value.items() if k != "text"}
    if text is None:
        what = type(value).__name__
        return f"tool {tool} returned a {what}, not text (or a mapping with 'text')", {}, "error"
    if not unicode_text(text):
        return f"tool {tool} returned text that {NOT_UNICODE}", {}, "error"
    return _cut(text), fields, "ok"


def _cut(text: str, most: int | None = None) -> str:
    most = MAX_TEXT if most is None else most
    if len(text) <= most:
        return text
    return text[:most] + f" [cut: {len(text) - most} more characters]"


def _plain(value: Any, depth: int = 0) -> Any:
    """A returned field as a plain JSON value: numpy and torch scalars as Python numbers and
    bools, mappings and sequences element by element (8 levels deep), strings cut, anything
    else as its repr (cut)."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return _cut(value, MAX_FIELD)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        with contextlib.suppress(Exception):
            return _plain(item(), depth)
    if depth < 8 and isinstance(value, Mapping):
        return {_cut(str(k), 200): _plain(v, depth + 1) for k, v in list(value.items())[:100]}
    if depth < 8 and isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value[:100]]
    try:
        text = repr(value)
    except Exception as err:  # noqa: BLE001 - a user's __repr__ may raise anything
        text = f"<{type(value).__name__}: repr failed: {first_line(err)}>"
    return _cut(text, MAX_FIELD)


def call_tools(
    tool: str,
    call: str,
    jobs: Sequence[tuple[dict[str, str], Problem, Episode]],
    timeout_s: float,
) -> list[tuple[str, dict[str, Any], str, float]]:
    """Call ``tool``'s function once per job (its reads, problem and episode), all at once,
    each for at most ``timeout_s`` seconds: (text, fields, status, seconds) per job."""
    fn = tool_function(call)
    out: list[Any] = [None] * len(jobs)

    def one(i: int, reads: dict[str, str], problem: Problem, episode: Episode) -> None:
        start = time.perf_counter()
        records = episode.transcript()
        try:
            value = call_guarded(
                lambda: fn(reads=reads, problem=problem, episode=records),
                timeout_s,
                f"marlow-tool-{tool}",
            )
            if type(value) is str:
                text, fields, status = _as_output(tool, value)
            else:  # the returned object is the user's too: read under the same guard
                read = partial(_as_output, tool, value)
                text, fields, status = call_guarded(read, timeout_s, f"marlow-tool-{tool}")
        except CallTimedOut:
            text, fields, status = f"tool {tool} timed out after {timeout_s:g} s", {}, "timeout"
        except CallFailed as err:
            text, fields, status = f"tool {tool} failed: {err}", {}, "error"
        out[i] = (text, fields, status, time.perf_counter() - start)

    if jobs:
        with ThreadPoolExecutor(min(len(jobs), TOOL_WORKERS), f"marlow-tool-{tool}") as pool:
            list(pool.map(lambda ij: one(ij[0], *ij[1]), enumerate(jobs)))
    return out


def tool_call(
    tool: str,
    slot: int,
    rnd: int,
    reads: dict[str, str],
    result: tuple[str, dict[str, Any], str, float],
    after: int,
    stage: int = 0,
    stage_s: float = 0.0,
) -> ToolCall:
    """The record of one call (:func:`call_tools`' result for one job) of the stage at index
    ``stage``, which took ``stage_s`` seconds of wall time in all."""
    text, fields, status, seconds = result
    return ToolCall(
        tool=tool,
        slot=slot,
        round=rnd,
        inputs=dict(reads),
        completion_text=text,
        status=status,  # type: ignore[arg-type]  # one of ToolStatus
        seconds=seconds,
        fields=fields,
        after=after,
        stage=stage,
        stage_s=stage_s,
    )


def run_tool_stage(stage: Stage, active: Sequence[EpisodeState], ctx: StageContext) -> None:
    """A tool stage in every active episode and slot: one call each, recorded in
    ``Episode.tools`` and read by later stages like a role's turns; a failed or timed-out call is
    counted (``tool_error``, ``tool_timeout``)."""
    places, jobs = [], []
    for st in active:
        for slot in range(ctx.slots(stage, st)):
            reads = ctx.reads(stage, st, slot)
            places.append((st, slot, reads))
            jobs.append((reads, st.problem, st.episode))
    start = time.perf_counter()
    results = call_tools(stage.role, stage.options.call, jobs, ctx.rules.tool_timeout_s)
    wall = time.perf_counter() - start
    new: dict[int, list[ToolCall]] = {}
    for (st, slot, reads), result in zip(places, results, strict=True):
        after = len(st.episode.turns)
        done = tool_call(stage.role, slot, stage.round, reads, result, after, ctx.index, wall)
        st.episode.tools.append(done)
        new.setdefault(id(st), []).append(done)
        if done.status != "ok":
            st.count(f"tool_{done.status}")
    for st in active:
        calls = new.get(id(st), [])
        st.keep(stage.role, calls)
        oks = [c.ok for c in calls]
        st.marks["tool_ok"] = False if False in oks else True if oks and all(oks) else None


TOOL_STAGE = StageKind(
    name="tool",
    fields=ToolStage,
    run=run_tool_stage,
    check=_check,
    prepare=_prepare,
    sources=TOOL_SOURCES,
    conditions={
        "tool_failed": Condition(
            "the latest tool stage reported a failure (ok false, or a call failed)",
            lambda st: st.marks.get("tool_ok") is False,
        ),
        "tool_passed": Condition(
            "the latest tool stage reported success (ok true in every call)",
            lambda st: st.marks.get("tool_ok") is True,
        ),
    },
)
"""The tool stage, registered as the stage kind ``tool``."""
