"""Reading a grid results folder (``marlow grid --out DIR``) into memory, one :class:`CellRun`
per finished cell, with the existing diagnostics computed once per cell.

The folder (the contract with ``marlow.grids.results_folder``)::

    DIR/index.json                {"grid": {...}, "cells": {NAME: {identity, state, error, path}}}
    DIR/cells/NAME/config.yaml    the resolved run config
    DIR/cells/NAME/metrics.jsonl  one record per training step and per validation
    DIR/cells/NAME/signatures/    step_NNNNNN.json, role -> signature -> value
    DIR/cells/NAME/events.jsonl   detector alarms the trainer logged (may be absent)

Choices of marlow:

* ``index.json`` is the one source of a cell's identity and state; ``cell.json`` (the same
  fields) is not read. A cell counts only when its state is ``done``.
* A cell that is not ``done``, or is ``done`` but cannot be read (no ``metrics.jsonl``, an
  unreadable config, a record without ``step``, no ``val/all/accuracy`` at all), is *missing*:
  it is listed with the reason and left out of every table, never a crash.
* Detectors are recomputed (``run_detectors`` with the cell's own ``detect`` thresholds and the
  workflow's slots per role), as ``marlow inspect`` does, so a quiet verdict shows its evidence
  too; the alarms the trainer logged in ``events.jsonl`` are kept beside them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from marlow.config import ConfigError, load_config
from marlow.config.titles import scale_title
from marlow.diagnostics.detectors import Verdict, run_detectors
from marlow.diagnostics.runstats import run_statistics
from marlow.diagnostics.signatures import read_signatures
from marlow.diagnostics.sinks import read_metrics, read_stepped
from marlow.workflows.spec import is_workflow_file
from marlow.workflows.validate import run_workflow

IDENTITY = ("kind", "workflow", "policy", "scale", "task", "seed")
TRAINED_KINDS = ("trained", "sa-rl")  # kinds that train (the others only validate)


@dataclass(frozen=True)
class CellId:
    """Who a cell is: its name and the grid axes it sits on (``scale`` is the display title)."""

    name: str
    kind: str  # trained | base | sa-rl | transfer
    workflow: str
    policy: str  # ip | sp | base | sa-rl | transfer
    scale: str
    task: str
    seed: int
    variant: str = ""  # the grid variant ("" without variants); ``scale`` then ends with it

    @property
    def grid_scale(self) -> str:
        """The scale's title without the variant (``tiny-s`` of ``tiny-s lr3e-3``)."""
        return self.scale.removesuffix(f" {self.variant}") if self.variant else self.scale

    @property
    def point(self) -> tuple[str, str, int]:
        """(task, scale, seed): cells are matched across kinds on it."""
        return (self.task, self.scale, self.seed)


@dataclass
class CellRun:
    """One finished cell: its records and what the diagnostics make of them."""

    id: CellId
    path: Path
    records: list[dict]
    stats: dict  # runstats.run_statistics
    signatures: dict[int, dict[str, dict[str, float]]]  # step -> role -> name -> value
    slots: dict[str, int]  # role -> slots in the workflow
    verdicts: list[Verdict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return self.stats["val"]["peak_accuracy"]

    @property
    def final(self) -> float:
        return self.stats["val"]["final_accuracy"]


@dataclass
class GridRuns:
    """A results folder read back: every cell of its index, the finished ones loaded as
    :class:`CellRun` s, the rest listed as missing (the runner's side of the folder is
    :class:`marlow.grids.results_folder.GridIndex`)."""

    root: Path
    grid: dict
    ids: list[CellId]  # every cell of the index, in index order
    runs: dict[str, CellRun]  # name -> finished cell
    missing: list[dict]  # {name, kind, state, reason}

    def find(self, policy: str, workflow: str, point: tuple[str, str, int]) -> CellRun | None:
        """The finished cell of ``policy`` in ``workflow`` at (task, scale, seed), if any."""
        for run in self.runs.values():
            i = run.id
            if i.policy == policy and i.workflow == workflow and i.point == point:
                return run
        return None


def load_results(results_dir: str | Path) -> GridRuns:
    """Read ``results_dir``; raise FileNotFoundError / ConfigError when it is no results folder."""
    root = Path(results_dir)
    index_path = root / "index.json"
    if not index_path.is_file():
        one_run = (root / "metrics.jsonl").is_file()
        raise FileNotFoundError(
            f"{root} holds no grid results: no index.json (give the folder `marlow grid --out` "
            "wrote)" + (f"; it is one run: marlow inspect {root}" if one_run else "")
        )
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{index_path} is not readable JSON: {err}") from None
    if not isinstance(index, dict) or not isinstance(index.get("cells"), dict):
        raise ConfigError(f"{index_path} has no 'cells' mapping; is it a marlow grid index?")
    ids: list[CellId] = []
    runs: dict[str, CellRun] = {}
    missing: list[dict] = []
    for name, entry in index["cells"].items():
        entry = entry if isinstance(entry, dict) else {}
        lacking = [k for k in IDENTITY if k not in entry]
        if lacking:
            missing.append(_missing(name, entry, f"index entry lacks {', '.join(lacking)}"))
            continue
        cid = CellId(
            name,
            entry["kind"],
            _workflow_key(entry),
            entry["policy"],
            # a variant's cells are shown (and matched) as a scale of their own: "tiny-s lr3e-3"
            " ".join(
                [
                    scale_title(str(entry["scale"])),
                    *([entry["variant"]] if entry.get("variant") else []),
                ]
            ),
            entry["task"],
            int(entry["seed"]),
            str(entry.get("variant") or ""),
        )
        ids.append(cid)
        state = entry.get("state")
        if state != "done":
            # the last line of a stored traceback is the exception and its message
            lines = str(entry.get("error") or "").strip().splitlines()
            missing.append(_missing(name, entry, lines[-1] if lines else f"state {state}"))
            continue
        try:
            runs[name] = load_cell(cid, root / entry.get("path", f"cells/{name}"))
        except (OSError, ValueError, KeyError, TypeError) as err:
            missing.append(_missing(name, entry, f"done but unreadable: {err}"))
    return GridRuns(root, index.get("grid") or {}, ids, runs, missing)


def _workflow_key(entry: dict) -> str:
    """How the report names a cell's workflow: a built-in by its name (``voting``), a workflow
    file by the title its cells are named with (``SolverCritic``, not the path as typed, which
    may not even resolve from the folder the report is built in)."""
    workflow = str(entry["workflow"])
    if not is_workflow_file(workflow):
        return workflow
    return str(entry.get("title") or Path(workflow).stem)


def _missing(name: str, entry: dict, reason: str) -> dict:
    return {"name": name, "kind": entry.get("kind"), "state": entry.get("state"), "reason": reason}


def load_cell(cid: CellId, path: Path) -> CellRun:
    """Load one finished cell folder and compute its statistics and detector verdicts."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {path}")
    records = read_metrics(path)
    stats = run_statistics(records)
    if "val" not in stats:
        raise ValueError("metrics.jsonl holds no val/all/accuracy")
    cfg = load_config(path / "config.yaml")
    workflow = run_workflow(path, cfg)  # a file workflow: the cell's own copy
    slots = {role: workflow.slots_of(role) for role in workflow.roles}
    signatures = read_signatures(path)
    events_path = path / "events.jsonl"
    events = read_stepped(events_path) if events_path.is_file() else []
    verdicts = run_detectors(records, signatures, slots, cfg.detect)
    return CellRun(cid, path, records, stats, signatures, slots, verdicts, events)
