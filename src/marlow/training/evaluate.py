"""``marlow eval``: a run's checkpoint, or a base model, through a workflow on the validation split.

What is evaluated (:func:`eval_target`), from the one path given:

* a checkpoint folder (``RUN/checkpoints/step_NNNNNN``, holding ``DONE``): that checkpoint, with
  its run's ``config.yaml``;
* a run folder (holding ``config.yaml``): its latest checkpoint, or the base model when it has
  none (or with ``base=True``);
* a config file, or nothing (the defaults): the base model (every role on routing ``base``).

Where it goes: an eval of a run writes into that run's own folder, ``RUN/evals/NAME/`` (NAME:
``step-N``, ``base``, or the ``name`` given), holding ``eval.json`` with the validation samples
and signatures beside it; the run's own files are never touched. ``out`` puts it elsewhere (a base
eval without a run: default ``runs/eval``). An existing eval folder is never overwritten silently: the
call refuses, naming the folder, unless ``overwrite=True`` (then the old folder is removed first).
Choices of marlow, not fixed by the spec.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from marlow.config import ConfigError, load_config
from marlow.fileio import write_json
from marlow.logs import Phase
from marlow.training import checkpoint as ckpt

DEFAULT_OUT = Path("runs/eval")


@dataclass(frozen=True)
class EvalTarget:
    """What an eval evaluates and where it writes."""

    config: Path | None  # the YAML its settings come from (None: the defaults)
    checkpoint: Path | None  # None: the base model
    run: Path | None  # the run folder the checkpoint (or base eval) belongs to
    folder: Path  # where eval.json goes

    @property
    def label(self) -> str:
        if self.checkpoint is not None:
            return f"checkpoint {self.checkpoint}"
        return f"the base model of run {self.run}" if self.run else "the base model"


def eval_target(
    path: Path | None,
    *,
    base: bool = False,
    name: str | None = None,
    out: Path | None = None,
) -> EvalTarget:
    """Resolve ``path`` (module docstring) into an :class:`EvalTarget`; ConfigError otherwise."""
    if name is not None and (not name or "/" in name or name.startswith(".")):
        raise ConfigError(f"--name {name!r} must be a plain folder name")
    checkpoint: Path | None = None
    run: Path | None = None
    if path is None or path.is_file():
        if path is not None and path.suffix not in (".yaml", ".yml"):
            raise ConfigError(f"{path} is a file but not a config (.yaml)")
        folder = out or DEFAULT_OUT
        return EvalTarget(path, None, None, folder / name if name else folder)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a run folder, a checkpoint or a config")
    if (path / "config.yaml").exists():  # a run folder (a grid's cell holds a DONE of its own)
        run = path
        checkpoint = None if base else ckpt.latest(path)
    elif (path / "DONE").exists():
        checkpoint, run = path, path.parent.parent
        if base:
            raise ConfigError(f"{path} is a checkpoint; --base evaluates a run's base model")
    else:
        raise ConfigError(
            f"{path} is neither a run folder (config.yaml), a complete checkpoint (DONE) nor a "
            "config file"
        )
    if not (run / "config.yaml").exists():
        raise ConfigError(f"{checkpoint} is not inside a run folder (no {run / 'config.yaml'})")
    tag = name or ("base" if checkpoint is None else f"step-{ckpt.step_of(checkpoint)}")
    folder = run / "evals" / tag if out is None else (out / name if name else out)
    return EvalTarget(run / "config.yaml", checkpoint, run, folder)


def evaluate(
    path: Path | None,
    overrides: list[str] | None = None,
    *,
    base: bool = False,
    name: str | None = None,
    out: Path | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Evaluate what ``path`` names (module docstring) and return the record written to
    ``eval.json``: ``checkpoint``, ``step``, ``folder`` and the validation metrics."""
    from marlow.training.trainer import Trainer

    target = eval_target(path, base=base, name=name, out=out)
    overrides = list(overrides or [])
    if target.checkpoint is None:
        overrides.append("policy.routing=base")
    cfg = load_config(target.config, overrides)  # bad settings fail before anything is written
    if (target.folder / "eval.json").exists() or (
        target.run is not None and target.folder.exists() and out is None
    ):
        if not overwrite:
            raise FileExistsError(
                f"{target.folder} holds an earlier eval; pass --name NAME to keep both, or "
                "--overwrite to replace it"
            )
        shutil.rmtree(target.folder)
    if target.checkpoint is not None:
        ckpt.check(target.checkpoint)  # a damaged checkpoint is refused before a model loads
    if log is not None:
        log(Phase(f"evaluating {target.label} -> {target.folder}"))
    made = not target.folder.exists()
    folder = target.folder.absolute()  # where the eval writes, whatever a reward does to the cwd
    try:
        with Trainer(cfg, target.folder, log=log, run_dir=target.run) as trainer:
            step = 0
            if target.checkpoint is not None:
                step = ckpt.load(target.checkpoint, trainer.model, trainer.adapters, trainer.optim)
            metrics = trainer.validate(step)
        record = {
            "checkpoint": str(target.checkpoint) if target.checkpoint else None,
            "step": step,
            "folder": str(target.folder),
            "workflow": cfg.workflow.name,
            "routing": cfg.policy.routing,
            **metrics,
        }
        write_json(folder / "eval.json", record)
    except BaseException:  # an eval that did not finish leaves no folder of its own behind
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return record
