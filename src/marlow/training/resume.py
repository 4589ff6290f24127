"""Resume = continue the same run: its own config, a verified checkpoint, intact records.

``marlow train --out RUN --resume`` reads ``RUN/config.yaml`` (:func:`resume_config`); a config
file or ``key=value`` given with it is layered over that config, never over the preset. Before
any model is loaded, and again in the trainer (:meth:`marlow.training.trainer.Trainer.run`, which
the grid and the Python API reach directly), :func:`preflight` checks:

* the config against the stored one (:func:`resume_changes`): any difference outside
  :data:`RESUME_SAFE` is refused in one line listing what would change (``optim.lr: 0.001 ->
  0.002``); the accepted ones are recorded in ``events.jsonl`` (``action: resume``);
* the records (:func:`check_records`): a half-written *last* JSONL line is the mark of a killed
  run and is dropped with a log line; an unreadable line before it, a metrics record without
  its step or a step's damaged signatures file is an error naming the file;
* the base model (:func:`marlow.training.runbase.changed`): weights whose sha256 differs from the
  one ``RUN/base.json`` recorded when the run started are refused. Before the model loads, a base
  not on disk yet (a tiny world whose cache was deleted, a hub id not downloaded) cannot be
  hashed; the trainer's own preflight, after loading, checks it;
* the checkpoint (:func:`pick_checkpoint`, then ``checkpoint.check``): a damaged or non-finite
  one is named, with the last good one before it offered as ``--resume-from STEP``.

Only then is ``config.yaml`` rewritten (with the accepted changes) and are the records after the
checkpoint's step dropped. Choices made here, not fixed by the study:

* ``steps`` may only grow. The cosine schedule is a function of ``steps``, so extending a run
  stretches the schedule from the resume step on: the rate at the resume step jumps to the
  longer schedule's value. A run extended from 24 to 48 steps is therefore *not* the same as
  one started with 48; the ``resume`` event says so by listing the change.
* ``threads`` and ``device`` are resume-safe (machine settings), though another thread count or
  device may change results at round-off level. ``dtype`` is not: bfloat16 against float32
  changes the base's numerics far beyond round-off.
* ``--resume-from STEP`` older than the latest checkpoint deletes the later checkpoints (their
  future is being redone), once every check has passed.
"""

from __future__ import annotations

from pathlib import Path

from marlow.config import ConfigError, RunConfig, differences, load_config
from marlow.diagnostics.signatures import read_signatures
from marlow.diagnostics.sinks import read_jsonl, read_metrics
from marlow.fileio import DamagedFileError, write_text
from marlow.models import task_family
from marlow.training import checkpoint, runbase
from marlow.workflows.spec import is_workflow_file
from marlow.workflows.validate import WORKFLOW_COPY, workflow_copy

RESUME_SAFE = {
    "steps": "may only grow (the run goes on to the new last step)",
    "sample_episodes": "episodes written as text per step",
    "threads": "torch threads, a machine setting",
    "device": "the machine's accelerator (a run may move to another; results change at round-off)",
    "diagnostics.every": "which steps log the sampled diagnostics (chi2_update, kl_to_base)",
    "sinks": "the TensorBoard and W&B mirrors of metrics.jsonl",
    "train": "checkpoints kept and the non-finite streak that stops a run",
}
RECORDS = ("metrics.jsonl", "samples.jsonl", "events.jsonl")


class ResumeError(ValueError):
    """A run folder that cannot be resumed as it is, in one line naming the file and the fix."""


def previous_config(run_dir: Path) -> RunConfig | None:
    """The config a run folder was trained with; None for a folder no run has started in (absent,
    or holding neither ``config.yaml`` nor run records, like a fresh grid cell)."""
    path = run_dir / "config.yaml"
    if path.is_file():
        try:
            return load_config(path)
        except ConfigError as err:
            raise ConfigError(str(err) if str(path) in str(err) else f"{path}: {err}") from None
    found = [n for n in (*RECORDS, "checkpoints") if (run_dir / n).exists()]
    if found:
        raise ResumeError(
            f"{run_dir} holds {', '.join(found)} but no config.yaml, so it is not a marlow run "
            "that can be resumed; choose another --out"
        )
    return None


def resume_config(
    run_dir: Path,
    path: Path | None = None,
    overrides: list[str] | None = None,
    resume_from: int | None = None,
) -> RunConfig:
    """The run's own config with ``path`` and ``overrides`` layered over it, after the
    :func:`preflight` checks: a refused resume fails here, before any model is loaded (the
    trainer checks again, for the grid and the Python API)."""
    if not run_dir.is_dir():
        raise ResumeError(
            f"no run folder {run_dir} to resume; --resume continues a run that "
            f"`marlow train --out {run_dir}` started"
        )
    stored = previous_config(run_dir)
    if stored is None:
        raise ResumeError(
            f"{run_dir} is not a marlow run folder (no config.yaml); --resume needs the --out "
            "of an earlier `marlow train`"
        )
    new = load_config(path, overrides, base=stored)
    preflight(run_dir, stored, new, resume_from)
    return new


def preflight(
    run_dir: Path, stored: RunConfig, new: RunConfig, resume_from: int | None
) -> tuple[Path | None, list[str]]:
    """Every check of a resume that needs no model, in order: the config changes, the records,
    the base's weights, the checkpoint. Returns the checkpoint to load (None: none yet) and the
    accepted changes."""
    changes = resume_changes(run_dir, stored, new)
    check_records(run_dir)
    try:
        base_changed = runbase.changed(run_dir, new.model, task_family(new.model, new.task))
    except DamagedFileError as err:  # removed, it is written again from the base loaded
        raise ResumeError(f"{err}; repair or remove it, then resume") from None
    if base_changed:
        raise ResumeError(base_changed)
    found = pick_checkpoint(run_dir, resume_from)
    if found is not None:
        try:
            checkpoint.check(found)
        except checkpoint.CheckpointError as err:
            raise checkpoint.CheckpointError(f"{err}; {last_good_before(run_dir, found)}") from None
    return found, changes


def record_workflow_file(run_dir: Path, cfg: RunConfig) -> None:
    """Keep the run's workflow file beside its config when the run starts (a resumed run keeps
    the copy it has), so that the run folder alone reproduces it; a built-in workflow ships with
    marlow and is not copied."""
    copy = run_dir / WORKFLOW_COPY
    if is_workflow_file(cfg.workflow.name) and workflow_copy(run_dir) is None:
        write_text(copy, Path(cfg.workflow.name).read_text())


def finished(run_dir: Path, cfg: RunConfig, resume_from: int | None = None) -> str | None:
    """The line to say when the run in ``run_dir`` has nothing left to do under ``cfg``: its
    checkpoint to resume from is at (or past) ``cfg.steps``. None when there is training left.
    The trainer still makes the checks and repairs of any resume (a torn last record, a
    checkpoint commit cut short) but writes no ``resume`` event."""
    found = pick_checkpoint(run_dir, resume_from) if run_dir.is_dir() else None
    if found is None or checkpoint.step_of(found) < cfg.steps:
        return None
    step = checkpoint.step_of(found)
    return f"{run_dir} already finished at step {step}; pass steps=N to extend it (N > {step})"


def _safe(field: str) -> bool:
    return any(field == key or field.startswith(key + ".") for key in RESUME_SAFE)


def resume_changes(run_dir: Path, stored: RunConfig, new: RunConfig) -> list[str]:
    """The differences of ``new`` from the run's ``stored`` config, all resume-safe (``"steps: 24
    -> 48"``); raises ConfigError listing the others."""
    diffs = differences(stored, new)
    refused = [d for d in diffs if not _safe(d.split(": ", 1)[0])]
    if new.steps < stored.steps:
        refused.append(f"steps: {stored.steps} -> {new.steps} (steps may only grow)")
    if refused:
        more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
        raise ConfigError(
            f"{run_dir / 'config.yaml'} was trained with other settings; resuming would change "
            f"{'; '.join(refused[:3])}{more}. A resume may change only "
            f"{', '.join(k + ('.*' if k in ('sinks', 'train') else '') for k in RESUME_SAFE)} "
            "(steps to extend); for other settings start a new run with another --out"
        )
    return diffs


def pick_checkpoint(run_dir: Path, resume_from: int | None) -> Path | None:
    """The checkpoint to resume from: step ``resume_from``, else the latest (None: none yet)."""
    if resume_from is None:
        return checkpoint.latest(run_dir)
    found = {checkpoint.step_of(p): p for p in checkpoint.all_done(run_dir)}
    if resume_from not in found:
        valid = ", ".join(map(str, found)) or "none"
        raise ResumeError(
            f"--resume-from {resume_from}: {run_dir} has no such checkpoint; valid: {valid}"
        )
    return found[resume_from]


def last_good_before(run_dir: Path, damaged: Path) -> str:
    """The hint after a damaged checkpoint: the newest earlier one whose files match their
    manifest, as a ``--resume-from`` to pass."""
    step = checkpoint.step_of(damaged)
    earlier = [p for p in checkpoint.all_done(run_dir) if checkpoint.step_of(p) < step]
    for path in reversed(earlier):
        if checkpoint.verify(path) is None:
            return f"resume from the last good one with --resume-from {checkpoint.step_of(path)}"
    return "no earlier good checkpoint: start the run again with another --out"


def check_records(run_dir: Path) -> None:
    """Refuse a run whose records are damaged: a JSONL line before the last (which a kill may
    leave half-written: that one is dropped and counted by the trainer), a metrics record
    without its step, a step's signatures file; before any step is trained again, since the
    run's end reads them all."""
    try:
        for name in RECORDS:
            path = run_dir / name
            if path.exists():
                read_metrics(run_dir) if name == "metrics.jsonl" else list(read_jsonl(path))
        read_signatures(run_dir)
    except DamagedFileError as err:
        raise ResumeError(f"{err}; repair or remove it, then resume") from None
