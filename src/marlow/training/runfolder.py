"""What a run folder holds: every file and folder a run, an eval or a rescore writes there, with
when it appears and what it is for. The run-folder reference page is written from
:data:`RUN_FOLDER`, and a test checks that a real run writes nothing outside it."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass


@dataclass(frozen=True)
class RunFile:
    """One entry of a run folder. ``pattern`` is a path relative to the folder, with ``*`` for
    any part of one name (``signatures/step_*.json``); a folder's pattern ends with ``/`` and
    covers everything under it."""

    pattern: str
    when: str
    meaning: str

    def matches(self, path: str) -> bool:
        parts = path.split("/")
        want = self.pattern.rstrip("/").split("/")
        if self.pattern.endswith("/"):  # the folder, or anything under it
            parts = parts[: len(want)]
        return len(parts) == len(want) and all(
            fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want, strict=True)
        )


RUN_FOLDER: tuple[RunFile, ...] = (
    RunFile("config.yaml", "always", "the resolved config: this file alone reproduces the run"),
    RunFile(
        "metrics.jsonl",
        "always",
        "one record per step: every metric (the metrics "
        "reference), step, time/* and, on CUDA, memory/*",
    ),
    RunFile(
        "samples.jsonl",
        "always",
        "sampled episodes (every turn's prompt and completion and every tool call's inputs "
        "and output, in order; rewards), sample_episodes a step",
    ),
    RunFile(
        "events.jsonl",
        "when something happens",
        "detector alarms with their evidence, resumes, skipped updates, rollbacks, missing rewards",
    ),
    RunFile(
        "signatures/step_*.json",
        "each validation",
        "per-role trajectory signatures of the validation episodes",
    ),
    RunFile(
        "val_answers/step_*.jsonl.gz",
        "each validation",
        "every validation answer with its grade, which marlow rescore grades again",
    ),
    RunFile(
        "base.json",
        "always",
        "the base model as given, the folder it loaded from and the "
        "sha256 of its weights (a resume refuses changed weights)",
    ),
    RunFile("base/", "tiny scales", "the pre-trained tiny base as a plain Hugging Face folder"),
    RunFile(
        "workflow.yaml",
        "a workflow given as a file",
        "its text as the run started, read by every later command instead of the path",
    ),
    RunFile("sandbox.json", "code tasks", "the code sandbox's isolation on this machine"),
    RunFile("best.json", "after a rollback", "the checkpoint the run rolled back to and why"),
    RunFile(
        "checkpoints/step_*/",
        "every ckpt_every steps and the last",
        "adapters/<adapter>/ "
        "(PEFT files), trainer_state.pt (optimizers, schedules, RNG), DONE once complete",
    ),
    RunFile(
        "evals/",
        "marlow eval RUN",
        "evals/<name>/eval.json and its metrics, one folder per eval (never replaced)",
    ),
    RunFile(
        "rescore/*.json", "marlow rescore RUN", "the validation answers graded by another reward"
    ),
    RunFile("tensorboard/", "sinks.tensorboard", "TensorBoard event files"),
    RunFile("wandb/", "sinks.wandb", "the Weights & Biases run (offline until wandb sync)"),
)
"""Every entry of a run folder, in the order a reader meets them."""


def describe_path(path: str) -> RunFile | None:
    """The :data:`RUN_FOLDER` entry of ``path`` (relative to the run folder, ``/``-separated),
    or None for a path no entry covers."""
    return next((f for f in RUN_FOLDER if f.matches(path)), None)
