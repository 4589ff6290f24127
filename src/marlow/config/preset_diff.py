"""Two presets compared field by field, from the configs they resolve to (docs/presets.md's
table is this module's output; a test checks that the committed page is)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from marlow.config.loading import flat_fields, resolve
from marlow.config.presets import SWITCHES, Switch
from marlow.config.schema import BUILTIN_TASKS


@dataclass(frozen=True)
class PresetDiff:
    """One field on which two presets resolve differently, for one task."""

    key: str
    task: str
    left: Any
    right: Any
    switch: Switch | None  # its sources, where the field is a documented switch

    def cells(self) -> tuple[str, str, str, str, str, str, str]:
        """The table row: field, task, both values, what, and both sources ("" for a field
        that is no documented switch)."""
        sw = self.switch
        about = (sw.what, sw.paper, sw.official) if sw else ("", "", "")
        return (self.key, self.task, _shown(self.left), _shown(self.right), *about)


def preset_diff(left: str, right: str) -> list[PresetDiff]:
    """Every config field on which presets ``left`` and ``right`` resolve to different values,
    per task (math, then code; a field that differs for both tasks is listed once with task
    ``all``), in field order. Computed from the resolved configs themselves, so the table cannot
    drift from what a run gets."""
    switches = {s.key: s for s in SWITCHES}
    per_task: dict[str, dict[str, tuple[Any, Any]]] = {}
    for task in BUILTIN_TASKS:
        a, b = (flat_fields(resolve({"preset": p, "task": {"name": task}})) for p in (left, right))
        per_task[task] = {k: (a[k], b[k]) for k in a if a[k] != b[k] and k != "preset"}
    out: list[PresetDiff] = []
    keys = dict.fromkeys(k for diffs in per_task.values() for k in diffs)
    for key in keys:
        tasks = [t for t, diffs in per_task.items() if key in diffs]
        values = {per_task[t][key] for t in tasks}
        if len(tasks) == len(per_task) and len(values) == 1:
            tasks = ["all"]
        for task in tasks:
            pair = per_task[task if task != "all" else next(iter(per_task))][key]
            out.append(PresetDiff(key, task, pair[0], pair[1], switches.get(key)))
    return out


def preset_diff_markdown(left: str, right: str) -> str:
    """:func:`preset_diff` as a Markdown table (docs/presets.md holds this text for paper vs
    official; a test checks that it is the code's)."""
    rows = [
        f"| field | task | {left} | {right} | what | source ({left}) | source ({right}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in preset_diff(left, right):
        key, task, a, b, *about = d.cells()
        cells = [f"`{key}`", task, f"`{a}`", f"`{b}`", *about]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _shown(value: Any) -> str:
    return "null" if value is None else str(value)
