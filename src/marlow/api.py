"""marlow from Python: train a cell, load a run, evaluate a checkpoint.

These are what ``import marlow`` exports (``marlow.train``, ``marlow.load_run``,
``marlow.evaluate``); the CLI's ``train`` and ``eval`` run the same code.

Settings: ``config`` is a YAML path, a nested dict, a :class:`marlow.config.RunConfig`, or None
(the tiny preset's defaults); keyword settings go over it, by top-level field, a section as a
dict merged into that section (``steps=50, optim={"lr": 5e-4}``), or a dotted key as on the
command line (``**{"optim.lr": 5e-4}``). Library code prints nothing itself:
``verbose=True`` sends marlow's log lines to stderr and lets third-party progress bars (Hugging
Face's "Loading weights") show; by default marlow is quiet, not mute: one line on stderr per
long phase (pre-training a tiny world, with an estimate of its time; training; evaluating) and
no third-party bars. Choices of marlow, not fixed by the spec.

docs/how-to/python.md holds a runnable example (``tests/e2e/test_api.py`` runs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marlow.config import ConfigError, RunConfig, load_config, merge, resolve
from marlow.diagnostics.runstats import series
from marlow.diagnostics.sinks import read_metrics
from marlow.fileio import read_json_object
from marlow.logs import quiet

if TYPE_CHECKING:
    from marlow.serving.trained import TrainedWorkflow

ConfigLike = str | Path | dict | RunConfig | None


def _nested(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings by field, a dotted key standing for its section's field (``"optim.lr": 5e-4``
    is ``optim={"lr": 5e-4}``), as on the command line."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        *sections, name = key.split(".")
        node = out
        for part in sections:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"setting {key!r}: {part} is also given a value of its own")
        node[name] = (
            merge(node[name], value)
            if isinstance(node.get(name), dict) and isinstance(value, dict)
            else value
        )
    return out


def make_config(config: ConfigLike = None, **settings: Any) -> RunConfig:
    """A run config from ``config`` (module docstring) with ``settings`` over it."""
    settings = _nested(settings)
    if isinstance(config, RunConfig):
        return resolve(merge(config.model_dump(mode="json"), settings))
    if isinstance(config, dict):
        return resolve(merge(config, settings))
    if config is not None and not isinstance(config, str | Path):
        raise ConfigError(
            f"config is a {type(config).__name__}; give a YAML path, a dict, a RunConfig or None"
        )
    return load_config(config, _dotted(settings))  # the file read once, settings as overrides


def _dotted(settings: dict, prefix: str = "") -> list[str]:
    """``{"optim": {"lr": 5e-4}}`` -> ``["optim.lr=0.0005"]`` (values as JSON, which YAML reads)."""
    out: list[str] = []
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key != "params":
            out += _dotted(value, f"{name}.")
        else:
            out.append(f"{name}={json.dumps(value)}")
    return out


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[Any]:
    """The log function to hand down: every line when ``verbose``, else only the lines that open
    a long phase (:class:`marlow.logs.Phase`); third-party progress bars off unless ``verbose``."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    env = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    if not verbose:
        hf_logging.disable_progress_bar()
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:

        def say(message: str) -> None:
            print(message, file=sys.stderr, flush=True)

        yield say if verbose else quiet(say)  # quiet, not mute: one line per long phase
    finally:
        if was:
            hf_logging.enable_progress_bar()
        if env is None:
            os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
        else:
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = env


def train(
    config: ConfigLike = None,
    *,
    out: str | Path = "runs/run",
    resume: bool = False,
    verbose: bool = False,
    **settings: Any,
) -> Run:
    """Train one cell and return it as a :class:`Run`. ``resume=True`` continues the run in
    ``out`` under its own config (``settings`` may then only extend steps or change logging, as
    with ``marlow train --resume``)."""
    from marlow.training.resume import resume_config
    from marlow.training.trainer import Trainer

    out = Path(out)
    if resume:
        if config is not None and not isinstance(config, str | Path):
            raise ConfigError("resume=True reads the run's own config; give settings, not config")
        overrides = _dotted(_nested(settings))
        cfg = resume_config(out, None if config is None else Path(config), overrides, None)
    else:
        cfg = make_config(config, **settings)
    with _quiet(verbose) as log, Trainer(cfg, out, log=log) as trainer:
        trainer.run(resume=resume)
    return load_run(out)


def evaluate(
    target: str | Path | None = None,
    *,
    base: bool = False,
    name: str | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    verbose: bool = False,
    **settings: Any,
) -> dict:
    """Evaluate a run's latest checkpoint, one checkpoint, or a base model (``target``: a run
    folder, a checkpoint folder, a config file or None) on the validation split, as ``marlow
    eval`` does (:mod:`marlow.training.evaluate`: a run's evals go to ``RUN/evals/NAME/``, an
    earlier one is kept unless ``overwrite``). Returns the record written to ``eval.json``."""
    from marlow.training.evaluate import evaluate as run_eval

    with _quiet(verbose) as log:
        return run_eval(
            None if target is None else Path(target),
            _dotted(_nested(settings)),
            base=base,
            name=name,
            out=None if out is None else Path(out),
            overwrite=overwrite,
            log=log,
        )


class Metrics(Sequence[dict]):
    """A run's ``metrics.jsonl`` as a table: one record (dict) per logged step, in file order.

    ``metrics[i]`` is record i; ``metrics["val/all/accuracy"]`` is that column, None where a
    record lacks it; :meth:`series` gives the (step, value) pairs where it is present (both a
    KeyError for a metric no record holds);
    :meth:`to_pandas` makes a DataFrame (pandas is not a marlow dependency)."""

    def __init__(self, records: list[dict]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, str):
            self._check(key)
            return [r.get(key) for r in self.records]
        return self.records[key]

    def _check(self, key: str) -> None:
        """A KeyError naming a few metrics where no record holds ``key`` (a misspelt name)."""
        if key not in self.columns:
            raise KeyError(f"no metric {key!r}; e.g. {', '.join(self.columns[:5])}")

    @property
    def columns(self) -> list[str]:
        seen: dict[str, None] = {}
        for record in self.records:
            seen.update(dict.fromkeys(record))
        return list(seen)

    def series(self, key: str) -> list[tuple[int, float]]:
        self._check(key)
        return series(self.records, key)

    def to_pandas(self):
        try:
            import pandas
        except ImportError:
            raise ImportError("Metrics.to_pandas needs pandas: pip install pandas") from None
        return pandas.DataFrame.from_records(self.records, columns=self.columns)


@dataclass
class Run:
    """A run folder, read: its config, metrics, checkpoints, the latest checkpoint's adapters
    (name -> PEFT folder) and its evals (name -> the ``eval.json`` record)."""

    path: Path
    config: RunConfig
    metrics: Metrics
    checkpoints: list[Path] = field(default_factory=list)
    adapters: dict[str, Path] = field(default_factory=dict)
    evals: dict[str, dict] = field(default_factory=dict)


def load_workflow(path: str | Path, *, verbose: bool = False, **settings: Any) -> TrainedWorkflow:
    """A trained workflow to answer with (a run folder, a checkpoint, or a bundle from ``marlow
    export``), loaded once: ``wf.answer("question")`` returns an :class:`marlow.serving.Answer`
    (``.text`` the final answer), ``wf.answer([...], trace=True)`` one per question with every
    role's turns (:mod:`marlow.serving.trained`). ``settings`` as everywhere
    (``rollout={"max_new_tokens": 64}``). Close it (or use ``with``) to stop a vLLM engine."""
    from marlow.serving.trained import load_workflow as load

    with _quiet(verbose) as log:
        return load(Path(path), _dotted(_nested(settings)), log=log)


def load_run(path: str | Path) -> Run:
    """Read the run folder ``path`` (``marlow train --out``); ConfigError when it is not one."""
    from marlow.training import checkpoint as ckpt

    path = Path(path)
    if not (path / "config.yaml").is_file():
        raise ConfigError(f"{path} is not a run folder (no config.yaml)")
    config = load_config(path / "config.yaml")
    metrics = path / "metrics.jsonl"
    records = read_metrics(path) if metrics.exists() else []
    checkpoints = ckpt.all_done(path)
    adapters: dict[str, Path] = {}
    if checkpoints:
        root = checkpoints[-1] / "adapters"
        adapters = {p.name: p for p in sorted(root.iterdir()) if p.is_dir()}
    evals = {f.parent.name: read_json_object(f) for f in sorted(path.glob("evals/*/eval.json"))}
    return Run(path, config, Metrics(records), checkpoints, adapters, evals)
