"""A grid's results folder on disk, as the runner keeps it.

The results folder::

    DIR/grid.yaml              the grid as given
    DIR/index.json             every cell: identity, state (pending|running|done|failed), error,
                               and, once done, seconds (wall time of the cell's last process)
    DIR/cells/NAME/            an ordinary run folder (config.yaml, metrics.jsonl, checkpoints/,
                               signatures/, events.jsonl) plus cell.json (the cell's identity),
                               log.txt (the trainer's log), error.txt (a failure's traceback)
                               and, once it has finished, DONE (JSON: its wall seconds)

``DONE`` is the only proof that a cell finished (written by the cell itself, last); the index
is a view the parent process rewrites atomically after every change (:class:`GridIndex`). A
folder whose cells ran under other settings than the grid now gives them (their
``config.yaml`` differs) is refused, naming the cells and fields, so one table never mixes two
grids; a lock on the folder keeps two grid processes off it. ``marlow.report.results`` reads the
folder back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from marlow.fileio import held, write_json
from marlow.grids.grid import Cell, GridSpec


class GridIndex:
    """A running grid's bookkeeping: each cell's state, error and wall seconds, its folder, and
    ``index.json``, rewritten atomically after every change (what ``report`` later reads as
    :class:`marlow.report.results.GridRuns`)."""

    def __init__(self, root: str | Path, cells: list[Cell], grid: GridSpec) -> None:
        self.root = Path(root)
        self.cells = {c.name: c for c in cells}
        self.grid = grid
        self.state: dict[str, str] = {}
        self.error: dict[str, str | None] = {}
        self.seconds: dict[str, float | None] = {}  # a done cell's, read from its DONE once
        for c in cells:
            self.set(c.name, "done" if self.done(c.name) else "pending", write=False)

    def dir(self, name: str) -> Path:
        return self.root / "cells" / name

    def done(self, name: str) -> bool:
        return (self.dir(name) / "DONE").exists()

    def set(self, name: str, state: str, error: str | None = None, *, write=True) -> None:
        self.state[name], self.error[name] = state, error
        self.seconds[name] = self._read_seconds(name) if state == "done" else None
        if write:
            self.write_index()

    def _read_seconds(self, name: str) -> float | None:
        """A finished cell's wall seconds (its last process only: a resumed cell's earlier
        processes are not counted), or None."""
        try:
            return float(json.loads((self.dir(name) / "DONE").read_text())["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # a DONE from before marlow timed cells

    def write_index(self) -> None:
        cells = {
            name: {
                **c.describe(),
                "state": self.state[name],
                "error": self.error[name],
                "seconds": self.seconds[name],
                "path": f"cells/{name}",
            }
            for name, c in self.cells.items()
        }
        write_json(self.root / "index.json", {"grid": self.grid.model_dump(), "cells": cells})


@contextmanager
def locked(root: Path) -> Iterator[None]:
    """Make the results folder and hold it (:func:`marlow.fileio.held`), or raise: one grid per
    folder."""
    root.mkdir(parents=True, exist_ok=True)
    with held(root, "marlow grid"):
        yield


def refuse_changed_cells(root: Path, cells: list[Cell]) -> None:
    """A cell folder that ran (or began) under another config than the grid now gives it would
    be skipped or resumed under the wrong settings, mixing two grids in one table: refuse,
    naming the cells and the fields (``config.yaml`` is what each cell ran with)."""
    from marlow.config import ConfigError, differences, load_config

    changed = []
    for cell in cells:
        stored = root / "cells" / cell.name / "config.yaml"
        if stored.exists():
            diffs = differences(load_config(stored), cell.config)
            if diffs:
                changed.append(f"{cell.name} ({', '.join(diffs[:3])})")
    if changed:
        raise ConfigError(
            f"{len(changed)} cell(s) in {root} ran under other settings than this grid gives "
            f"them: {'; '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}. Use another "
            "--out, or delete those cell folders to run them again"
        )


def last_step(run_dir: Path) -> int:
    """The last step a cell has logged (0 before it starts)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    tail = path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        return int(json.loads(tail)["step"])
    except (ValueError, KeyError, TypeError):
        return 0  # a line being written (or damaged: the cell's resume names it)
