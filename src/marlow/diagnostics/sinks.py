"""Metric sinks: where a run's records go. The one home of every sink marlow writes.

* :class:`JsonlSink` (always on). One JSON object per line, fsynced. The trainer owns three:
  ``metrics.jsonl`` (one record per step), ``samples.jsonl`` and ``events.jsonl``.
* :class:`TensorBoardSink` (``sinks.tensorboard``, extra ``tb``): scalars into
  ``run_dir/tensorboard/``.
* :class:`WandbSink` (``sinks.wandb``, extra ``wandb``): a W&B run, offline by default.

:func:`open_sinks` builds the optional sinks chosen in :class:`~marlow.config.SinksConfig` and
puts them behind one :class:`MetricSinks` (``write`` / ``truncate_after`` / ``close``). With both
flags off it holds nothing and every call is a no-op, so the trainer never tests which sinks are
on. Choices made here:

* ``metrics.jsonl`` is *not* routed through :class:`MetricSinks`. It is the run's source of truth
  (read back by the detectors, the report and ``--resume``), keeps every value (NaN and
  non-numeric ones included) and is truncated before the trainer re-reads it. The optional sinks
  are mirrors of it for people's dashboards; keeping the two apart means a dashboard failure can
  never cost the run its record, and the trainer's JSONL code stays as it is.
* TensorBoard and W&B receive the numeric values of a record only (``int``, ``float``, numpy
  scalars; ``bool`` as 0/1). Strings, lists, dicts and non-finite numbers (NaN, +-inf) are
  skipped: TensorBoard draws NaN as a gap at best, and W&B charts break on it. The key ``step``
  is the x axis, never a metric.
* Heavy packages are imported only when their sink is chosen. A chosen sink whose package is
  missing raises :class:`~marlow.config.ConfigError` naming the config field and the install
  command, before any sink is opened.

Resume. ``truncate_after(step)`` means "the records after ``step`` will be written again":

* TensorBoard: the next writer is opened with ``SummaryWriter(purge_step=step + 1)``, which
  writes a session-start event that makes TensorBoard hide every event of step >= ``step + 1``
  from earlier event files. (Without it TensorBoard still purges a tag when it sees its step go
  backwards, but a tag logged only at validation steps would keep stale points.)
* W&B history is append-only, so this is a no-op. Online, a resumed run (same id, kept in
  ``run_dir/wandb/run_id``) ignores steps below its current step, keeping the first values;
  a resumed marlow run recomputes the same values anyway. Offline, each resume writes a new
  ``wandb/offline-run-*-<id>-N`` folder with the same id; ``wandb sync`` uploads them in order.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import secrets
import string
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from marlow.config import ConfigError, SinksConfig
from marlow.fileio import DamagedFileError, no_space, write_text

# -- JSONL (always on) --------------------------------------------------------------------------


class JsonlSink:
    """Append one JSON object per line; flushed and fsynced so a crash loses at most a line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        """Append ``record``; a device that fills up meanwhile is :class:`NoSpace` (a line
        half-written then is left out when the file is read back)."""
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record, allow_nan=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise no_space(err, self.path) or err from None

    def truncate_after(self, step: int) -> int:
        """Drop records of steps after ``step`` (a resumed run redoes them), and a last line a
        killed run left half-written; returns how many such unreadable lines were dropped (the
        trainer checks first with :func:`read_jsonl` that none stands before the last)."""
        if not self.path.exists():
            return 0
        kept, torn = [], 0
        for line in self.path.read_text().splitlines():
            record = _parse(line)
            torn += record is None and bool(line.strip())
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line)
        write_text(self.path, "".join(line + "\n" for line in kept))
        return torn


def _parse(line: str) -> Any:
    """A line's JSON value, or None for a blank or half-written line."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def read_jsonl(path: Path) -> Iterable[dict]:
    """The records of a JSONL file. A half-written last line (a run being written or killed
    mid-write) is left out; a malformed line anywhere else, a line whose JSON is not an object
    (marlow writes no other: it is not half of one either) or bytes that are not UTF-8 text
    (marlow writes ASCII) are an error."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise DamagedFileError(
            f"{path}: byte {err.start} is not UTF-8 text; the file is damaged"
        ) from None
    lines = [line for line in text.splitlines() if line.strip()]
    for n, line in enumerate(lines, 1):
        record = _parse(line)
        if record is None and n < len(lines):
            raise DamagedFileError(
                f"{path}: line {n} of {len(lines)} is not JSON (only a half-written last line is "
                "tolerated); the file is damaged"
            )
        if record is not None and not isinstance(record, dict):
            raise DamagedFileError(
                f"{path}: line {n} of {len(lines)} is JSON but not an object; the file is damaged"
            )
        if record is not None:
            yield record


def read_stepped(path: Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl`` or ``events.jsonl`` (:func:`read_jsonl`); a
    record without its step (a whole number, as the trainer writes every one) is an error."""
    records = list(read_jsonl(path))
    for n, record in enumerate(records, 1):
        step = record.get("step")
        if type(step) is not int or step < 0:
            raise DamagedFileError(
                f"{path}: record {n} of {len(records)} has no step (a whole number); the file "
                "is damaged"
            )
    return records


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every record of a run's ``metrics.jsonl``, in file order (:func:`read_stepped`); a value
    that is not a number, true, false or null (the trainer writes no other) is an error."""
    path = Path(run_dir) / "metrics.jsonl"
    records = read_stepped(path)
    for n, record in enumerate(records, 1):
        wrong = [k for k, v in record.items() if v is not None and not isinstance(v, (int, float))]
        if wrong:
            raise DamagedFileError(
                f"{path}: record {n} of {len(records)} holds {wrong[0]!r:.80}, which is not a "
                "number; the file is damaged"
            )
    return records


def first_event(run: Path, action: str) -> dict | None:
    """The first record of ``action`` in the run's ``events.jsonl`` (None without one)."""
    events = run / "events.jsonl"
    if not events.exists():
        return None
    return next((e for e in read_jsonl(events) if e.get("action") == action), None)


# -- shared helpers -----------------------------------------------------------------------------


def numeric_scalars(record: dict) -> tuple[int, dict[str, float]]:
    """Split a record into its step and its finite numeric values (everything else dropped)."""
    if "step" not in record:
        raise ValueError(f"a metrics record needs a 'step' key; got keys {sorted(record)[:5]}")
    values = {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, numbers.Real) and math.isfinite(value)
    }
    return int(record["step"]), values


_EXTRAS = {  # config field -> (module to import, pip extra)
    "sinks.tensorboard": ("torch.utils.tensorboard", "tb"),
    "sinks.wandb": ("wandb", "wandb"),
}


def _require(field: str) -> ModuleType:
    """Import the package behind ``field`` or say, in one line, how to install it."""
    module, extra = _EXTRAS[field]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        # torch.utils.tensorboard raises ImportError when the tensorboard package is missing.
        raise ConfigError(
            f"{field} is true but {module} cannot be imported ({err}); "
            f"install it with: pip install 'marlow[{extra}]'"
        ) from err


class Sink(Protocol):
    def write(self, record: dict) -> None: ...
    def truncate_after(self, step: int) -> None: ...
    def close(self) -> None: ...
    def describe(self) -> str: ...


# -- TensorBoard --------------------------------------------------------------------------------


class TensorBoardSink:
    """Scalars into ``log_dir`` with ``torch.utils.tensorboard.SummaryWriter``: tag = metric
    name, global step = the record's ``step``.

    The writer is opened lazily (first ``write`` or ``truncate_after``) so that a resume can pass
    ``purge_step``, which SummaryWriter only takes at construction. Each write is flushed: one
    record per training step is cheap, and the dashboard is then never two minutes behind.
    """

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._summary_writer = _require("sinks.tensorboard").SummaryWriter
        self._writer: Any = None

    def _open(self, purge_step: int | None) -> None:
        self.close()
        self._writer = self._summary_writer(str(self.log_dir), purge_step=purge_step)

    def write(self, record: dict) -> None:
        step, values = numeric_scalars(record)
        if self._writer is None:
            self._open(purge_step=None)
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def truncate_after(self, step: int) -> None:
        """Hide events of steps after ``step`` from earlier event files (see module docstring)."""
        self._open(purge_step=max(step + 1, 0))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def describe(self) -> str:
        return f"tensorboard: tensorboard --logdir {self.log_dir}"


# -- Weights & Biases ---------------------------------------------------------------------------


class WandbSink:
    """One W&B run per run folder: ``wandb.init(project, dir=run_dir, mode, name=<folder name>,
    config=<resolved config>, id=<kept in run_dir/wandb/run_id>, resume="allow")``.

    ``mode`` (``sinks.wandb_mode``) wins over the ``WANDB_MODE`` environment variable, so the
    run config alone decides whether anything is uploaded.

    ``silent=True``: marlow's library code never prints; :meth:`describe` says where the run is
    (its URL online, its folder and the ``wandb sync`` command offline) for the caller to log.
    W&B's other defaults stay (git commit, console capture, system metrics), since they are what
    a W&B user expects to find. ``close`` finishes the run and, when no other W&B run is active
    in the process, calls ``wandb.teardown()`` so that the ``wandb-core`` service process exits
    now rather than at interpreter exit.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        project: str,
        mode: str = "offline",
        config: dict | None = None,
    ) -> None:
        self._wandb = _require("sinks.wandb")
        self.run_dir = Path(run_dir)
        id_file = self.run_dir / "wandb" / "run_id"
        resumed = id_file.exists()  # a resumed run continues its W&B run
        if resumed:
            run_id = id_file.read_text().strip()
        else:
            alphabet = string.ascii_lowercase + string.digits
            run_id = "".join(secrets.choice(alphabet) for _ in range(8))
        try:
            self.run = self._wandb.init(
                project=project,
                dir=str(self.run_dir),
                mode=mode,
                id=run_id,
                name=self.run_dir.resolve().name,
                config=config or {},
                resume="allow",
                settings=self._wandb.Settings(silent=True),
            )
        except Exception as err:  # no API key, no network, a W&B server error: one line
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ConfigError(
                f"sinks.wandb_mode={mode}: W&B could not start a run ({first}); log in with "
                "`wandb login` and check the network, or use sinks.wandb_mode=offline and "
                "`wandb sync` later"
            ) from None
        if not resumed:  # only once W&B holds the run, so a failed start leaves no id behind
            write_text(id_file, run_id + "\n")
        self._closed = False

    def write(self, record: dict) -> None:
        step, values = numeric_scalars(record)
        if values:
            self.run.log(values, step=step)

    def truncate_after(self, step: int) -> None:
        """No-op: W&B history cannot be rewritten (see the module docstring)."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.run.finish()
        if self._wandb.run is None:
            self._wandb.teardown()

    def describe(self) -> str:
        if self.run.offline:
            folder = Path(self.run.dir).parent  # run.dir is the run folder's files/
            return f"wandb: offline run in {folder}; upload with: wandb sync {folder}"
        return f"wandb: {self.run.url}"


# -- the bundle the trainer holds -----------------------------------------------------------------


class MetricSinks:
    """The optional sinks of a run behind one interface; empty when none is chosen."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def write(self, record: dict) -> None:
        """``record`` = ``{"step": int, "<split>/<role>/<metric>": value, ...}``."""
        for sink in self.sinks:
            sink.write(record)

    def truncate_after(self, step: int) -> None:
        for sink in self.sinks:
            sink.truncate_after(step)

    def close(self) -> None:
        """Close every sink, even if one fails; re-raise the first failure."""
        errors: list[BaseException] = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # closing the others matters more
                errors.append(err)
        if errors:
            raise errors[0]

    def describe(self) -> list[str]:
        """One line per sink saying where its output is, for the caller to log."""
        return [sink.describe() for sink in self.sinks]

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_sinks(run_dir: str | Path, cfg: SinksConfig, config: dict | None = None) -> MetricSinks:
    """The sinks ``cfg`` asks for, writing under ``run_dir``; ``config`` is the resolved run
    config recorded by W&B. Raises ConfigError, before opening anything, if a chosen sink's
    package is missing."""
    run_dir = Path(run_dir)
    for field, chosen in (("sinks.tensorboard", cfg.tensorboard), ("sinks.wandb", cfg.wandb)):
        if chosen:
            _require(field)
    sinks: list[Sink] = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if cfg.wandb:
        sinks.append(
            WandbSink(run_dir, project=cfg.wandb_project, mode=cfg.wandb_mode, config=config)
        )
    return MetricSinks(sinks)
