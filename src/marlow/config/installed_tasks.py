"""Tasks that installed packages publish under the entry-point group ``marlow.tasks``.

A package publishes a task as settings: its entry point names a mapping (or a function
returning one) with the run settings the task brings, whose ``task`` section names the data and
the reward, and an optional ``description``::

    # pyproject.toml of the package
    [project.entry-points."marlow.tasks"]
    sums = "sums_task:TASK"

    # sums_task/__init__.py
    from importlib.resources import files

    TASK = {
        "description": "integer arithmetic, graded by the exact answer",
        "task": {
            "source": str(files(__name__) / "sums.jsonl"),  # a data file in the package
            "prompt_field": "question",
            "answer_field": "answer",
            "reward": "sums_task.reward:exact_answer",
        },
        "rollout": {"max_new_tokens": 64},  # any other setting the task wants by default
    }

``task.name=sums`` then trains it: its settings come between the preset and the run's own file
and overrides (which win), like a preset's settings for a built-in task. The task is a custom
task under its own name (cell names, tables). This module imports nothing of marlow, so that the
config can read entry points without loading anything above it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

GROUP = "marlow.tasks"


class TaskEntryError(ValueError):
    """An installed task that cannot be loaded, or is not settings; the message is one line."""


def _entries() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def installed_tasks() -> dict[str, str]:
    """Each installed task's name -> where it comes from (``dist version: module:attr``)."""
    out = {}
    for name, ep in sorted(_entries().items()):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "unknown package"
        out[name] = f"{dist} ({ep.value})"
    return out


def installed_task(name: str) -> dict[str, Any] | None:
    """The settings the installed task ``name`` brings (``description`` removed), or None when
    no package publishes it."""
    ep = _entries().get(name)
    if ep is None:
        return None
    try:
        found: Any = ep.load()
        if isinstance(found, Callable) and not isinstance(found, Mapping):
            found = found()
    except Exception as err:  # the publishing package failed: one line
        line = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
        raise TaskEntryError(
            f"task {name!r} ({ep.value}) failed to load: {type(err).__name__}: {line}"
        ) from None
    if not isinstance(found, Mapping) or not isinstance(found.get("task"), Mapping):
        raise TaskEntryError(
            f"task {name!r} ({ep.value}) is a {type(found).__name__}; an installed task is a "
            "mapping of settings with a 'task' section (marlow.config.installed_tasks)"
        )
    settings = {k: v for k, v in found.items() if k != "description"}
    task = dict(settings["task"])
    if task.get("name", name) != name:
        raise TaskEntryError(
            f"task {name!r} ({ep.value}) names itself {task['name']!r}; leave task.name out"
        )
    settings["task"] = {**task, "name": name}
    return settings


def description(name: str) -> str:
    """The installed task's ``description`` ("" when it has none or does not load)."""
    ep = _entries().get(name)
    try:
        found = ep.load() if ep is not None else None
        if isinstance(found, Callable) and not isinstance(found, Mapping):
            found = found()
    except Exception:  # listed anyway; training it reports the error
        return ""
    return str(found.get("description", "")) if isinstance(found, Mapping) else ""
