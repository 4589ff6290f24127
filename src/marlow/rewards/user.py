"""A user's reward function, found by import path and called in batches behind one guard.

``task.reward`` names the function: ``package.module:function`` (an importable module) or
``path/to/file.py:function`` (a file, relative to the working directory). Two contracts, chosen
by ``task.reward_form`` (never guessed from the signature):

* ``trl`` (default), TRL's ``reward_funcs`` contract, so a function written for TRL works as it
  is: ``fn(prompts=[...], completions=[...], **columns, **kwargs) -> list[float | None]``. Every
  list is aligned: ``prompts[i]`` is the problem's prompt column (the text that fills
  ``{problem}``), ``completions[i]`` the text being graded, and each dataset column (the answer
  column among them) is a keyword whose list holds each item's value. marlow also passes
  ``problem_ids``. The function may be ``async def``.
* ``verl``, verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``, called
  once per item: ``data_source`` is ``task.source``, ``ground_truth`` the answer column's value
  ("" without one), ``extra_info`` a dict of the other columns. It returns a number, or a dict
  whose ``score`` is one.

Failure rules (every one counted, none a crash or a hang):

* a ``None`` for an item: that item has no reward (``reward_none``); NaN or inf:
  ``reward_nonfinite``;
* the function raises: every item of the call has no reward (``reward_error``), and the call is
  recorded as an event with the function's name and the first line of the error; so is a return
  of the wrong length or type (the message names the expected and returned length or type);
  under ``verl`` an exception costs its own item only;
* a call that takes longer than ``task.reward_timeout_s``: every item of the call has no reward
  (``reward_timeout``). The call runs in a daemon thread; a timed-out call is abandoned, not
  stopped (Python cannot stop a thread), so a function that never returns keeps a thread busy
  until the process ends, and the next call gets a thread of its own.

An item without a reward is a :class:`marlow.types.NoReward`: a float NaN that carries its
reason, so the workflow engine, the trainer and the metrics can leave it out and count it by
reason.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, get_args

from marlow.config import TaskConfig
from marlow.types import NoReward, Problem
from marlow.usercode import (
    CallFailed,
    CallTimedOut,
    UserCodeError,
    call_guarded,
    first_line,
    load_callable,
)

REWARD_FORMS: tuple[str, ...] = get_args(TaskConfig.model_fields["reward_form"].annotation)
RESERVED = ("prompts", "completions", "problem_ids")
"""Keywords marlow passes to a TRL-form reward: no dataset column may have these names."""


RewardLoadError = UserCodeError
"""``task.reward`` cannot be imported or is not a function; the message is one line."""


class RewardsMissing(RuntimeError):
    """A step had too many items without a reward (``task.reward_max_missing``); one line."""


def load_reward(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names (``module:function`` or ``file.py:function``)."""
    return load_callable(spec, "task.reward")


def _columns(problem: Problem) -> dict[str, Any]:
    """The dataset columns a reward gets for ``problem``: a custom task's own; a built-in task's
    problem (no columns of its own) passes its gold as ``answer``."""
    if "columns" in problem.meta:
        return dict(problem.meta["columns"])
    return {"answer": problem.answer}


class _Failed(Exception):  # noqa: N818 - a whole call failed: its reason and one line
    def __init__(self, reason: str, message: str, raised: bool = False):
        super().__init__(message)
        self.reason = reason
        self.raised = raised  # the function raised (not: timed out, returned the wrong shape)


def _call_in_thread(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` under :func:`marlow.usercode.call_guarded`, its failures as the reward's reasons."""
    try:
        return call_guarded(fn, timeout_s, "marlow-reward")
    except CallTimedOut as err:
        raise _Failed(
            "reward_timeout", f"took longer than task.reward_timeout_s={timeout_s:g} ({err})"
        ) from None
    except CallFailed as err:
        raise _Failed("reward_error", str(err), raised=True) from None


def _as_reward(value: Any) -> float:
    """One item's returned value as a reward; a non-number raises TypeError."""
    if value is None:
        return NoReward("reward_none")
    if isinstance(value, dict) and "score" in value:  # verl may return {"score": ...}
        value = value["score"]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy / torch scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(type(value).__name__)
    value = float(value)
    return value if math.isfinite(value) else NoReward("reward_nonfinite")


def _trl_kwargs(items: list[tuple[str, Problem]]) -> dict[str, Any]:
    """The keywords of one TRL-form call over ``items``: prompts, completions, problem_ids and
    every dataset column, aligned."""
    rows = [_columns(p) for _, p in items]
    names = sorted({k for row in rows for k in row})
    return {
        "prompts": [p.prompt for _, p in items],
        "completions": [text for text, _ in items],
        "problem_ids": [p.id for _, p in items],
        **{name: [row.get(name) for row in rows] for name in names},
    }


def _trl_rewards(returned: Any, count: int) -> list[float]:
    """A TRL-form call's return as ``count`` rewards, or :class:`_Failed` naming what is wrong."""
    if hasattr(returned, "tolist") and not isinstance(returned, list | tuple):
        returned = returned.tolist()  # a numpy array or a tensor of rewards
    if not isinstance(returned, list | tuple):
        raise _Failed(
            "reward_error",
            f"returned a {type(returned).__name__}; expected a list of {count} float or None",
        )
    if len(returned) != count:
        raise _Failed(
            "reward_error",
            f"returned {len(returned)} values for {count} completions; expected one float or "
            "None per completion",
        )
    out = []
    for i, value in enumerate(returned):
        try:
            out.append(_as_reward(value))
        except TypeError as err:
            raise _Failed(
                "reward_error",
                f"returned a {err} at index {i}; expected float or None per completion",
            ) from None
    return out


def _read_rewards(returned: Any, count: int, timeout_s: float) -> list[float]:
    """:func:`_trl_rewards` of what a call returned, read under the call's guard: the returned
    object is the user's too, and one whose ``tolist``, ``len``, ``float`` or ``item`` raises
    or hangs fails the call (``reward_error``), never the run."""

    def read() -> list[float] | _Failed:
        try:
            return _trl_rewards(returned, count)
        except _Failed as failed:
            return failed

    try:
        rewards = call_guarded(read, timeout_s, "marlow-reward")
    except (CallFailed, CallTimedOut) as err:
        raise _Failed("reward_error", f"returned a value that could not be read: {err}") from None
    if isinstance(rewards, _Failed):
        raise rewards
    return rewards


class UserReward:
    """A grader (``(text, problem) -> reward``) over a user's function, called in batches.

    ``prefetch(pairs)`` grades every (text, problem) not graded yet in one call of the function
    (the workflow engine hands it a step's final answers and answer turns first); a text asked
    for later without a prefetch is graded in a call of its own. Results are kept per
    (problem id, text), the newest ``cache_size``. ``events`` collects one record per failed
    call (the trainer writes them to ``events.jsonl`` and empties the list); ``last_error`` is
    the newest one's line.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        spec: str,
        form: str = "trl",
        timeout_s: float = 60.0,
        source: str = "",
        cache_size: int = 50_000,
    ):
        if form not in REWARD_FORMS:
            raise ValueError(f"task.reward_form is {form!r}; valid: {', '.join(REWARD_FORMS)}")
        self.fn = fn
        self.spec = spec
        self.form = form
        self.timeout_s = timeout_s
        self.source = source
        self.cache_size = cache_size
        self.events: list[dict[str, Any]] = []
        self.last_error: str | None = None
        self._cache: dict[tuple[str, str], float] = {}

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", None) or self.spec

    def prefetch(self, pairs: Sequence[tuple[str, Problem]]) -> None:
        todo: dict[tuple[str, str], tuple[str, Problem]] = {}
        for text, problem in pairs:
            key = (problem.id, text)
            if key not in self._cache:
                todo.setdefault(key, (text, problem))
        if not todo:
            return
        rewards = self._grade(list(todo.values()))
        for key, reward in zip(todo, rewards, strict=True):
            self._cache[key] = reward
        while len(self._cache) > self.cache_size:
            self._cache.pop(next(iter(self._cache)))

    def __call__(self, text: str, problem: Problem) -> float:
        key = (problem.id, text)
        if key not in self._cache:
            self.prefetch([(text, problem)])
        return self._cache[key]

    def _grade(self, items: list[tuple[str, Problem]]) -> list[float]:
        """One call of the function over ``items``; a failed call gives each item a NoReward."""
        try:
            if self.form == "verl":
                return self._grade_verl(items)
            return self._grade_trl(items)
        except _Failed as failed:
            self.last_error = f"{self.name}: {failed}"
            self.events.append(
                {
                    "event": failed.reason,
                    "function": self.name,
                    "error": str(failed),
                    "items": len(items),
                }
            )
            return [NoReward(failed.reason)] * len(items)

    def _grade_trl(self, items: list[tuple[str, Problem]]) -> list[float]:
        try:
            returned = _call_in_thread(lambda: self.fn(**_trl_kwargs(items)), self.timeout_s)
        except _Failed as failed:
            if not failed.raised or len(items) == 1:
                raise
            return self._grade_trl_each(items, str(failed))
        return _read_rewards(returned, len(items), self.timeout_s)

    def _grade_trl_each(self, items: list[tuple[str, Problem]], error: str) -> list[float]:
        """The items of a batch whose call raised, graded one call each (in one guarded thread,
        within the one time limit), so that only the items the function fails on lose their
        reward; one event names the batch's error and how many items failed alone."""

        def each() -> list[tuple[float, str | None]]:
            out: list[tuple[float, str | None]] = []
            for item in items:
                try:
                    out.append((_trl_rewards(self.fn(**_trl_kwargs([item])), 1)[0], None))
                except _Failed as failed:
                    out.append((NoReward("reward_error"), str(failed)))
                except Exception as err:  # noqa: BLE001 - the user's code: this item's failure
                    out.append((NoReward("reward_error"), first_line(err)))
            return out

        graded = _call_in_thread(each, self.timeout_s)
        failed = [e for _, e in graded if e is not None]
        self.last_error = f"{self.name}: {error}"
        self.events.append(
            {
                "event": "reward_error",
                "function": self.name,
                "error": error,
                "items": len(failed),
                "batch": len(items),
                "then": f"graded one by one: {len(failed)} of {len(items)} failed"
                + (f" (first: {failed[0]})" if failed else ""),
            }
        )
        return [reward for reward, _ in graded]

    def _grade_verl(self, items: list[tuple[str, Problem]]) -> list[float]:
        def each() -> list[tuple[float, str | None]]:
            out: list[tuple[float, str | None]] = []
            for text, problem in items:
                try:
                    value = self.fn(
                        data_source=self.source,
                        solution_str=text,
                        ground_truth=problem.answer,
                        extra_info=_columns(problem),
                    )
                except Exception as err:  # one item's failure is its own
                    out.append((NoReward("reward_error"), first_line(err)))
                    continue
                try:
                    out.append((_as_reward(value), None))
                except TypeError as err:
                    out.append((NoReward("reward_error"), f"returned a {err}; expected a number"))
            return out

        rewards = []
        for reward, error in _call_in_thread(each, self.timeout_s):
            if error is not None:
                self.last_error = f"{self.name}: {error}"
                self.events.append(
                    {"event": "reward_error", "function": self.name, "error": error, "items": 1}
                )
            rewards.append(reward)
        return rewards
