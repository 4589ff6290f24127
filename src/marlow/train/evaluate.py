"""``marlow eval``: the base model or a checkpoint, through a workflow, on the validation split."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from marlow.config import ConfigError, load_config
from marlow.fileio import write_json
from marlow.train import checkpoint as ckpt
from marlow.train.trainer import Trainer


def evaluate(
    config: Path | None,
    overrides: list[str],
    *,
    checkpoint: Path | None = None,
    out: Path = Path("runs/eval"),
    log: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Validation metrics. ``config`` may be a YAML file or a run folder (its config.yaml).

    Without a checkpoint every role runs on the frozen base (routing ``base``).
    """
    if config is not None and config.is_dir():
        if checkpoint is None and ckpt.latest(config) is not None:
            checkpoint = ckpt.latest(config)
        config = config / "config.yaml"
    if config is not None and not config.exists():
        raise ConfigError(f"config {config} does not exist")
    if checkpoint is None:
        overrides = [*overrides, "policy.routing=base"]
    cfg = load_config(config, overrides)
    if checkpoint is not None and not (checkpoint / "DONE").exists():  # before loading a model
        raise FileNotFoundError(f"{checkpoint} is not a complete marlow checkpoint")
    trainer = Trainer(cfg, out, log=log)
    if checkpoint is not None:
        trainer.step = ckpt.load(checkpoint, trainer.model, trainer.adapters, trainer.optim)
    result = trainer.validate(trainer.step)
    write_json(out / "eval.json", {"checkpoint": str(checkpoint) if checkpoint else None, **result})
    return result
