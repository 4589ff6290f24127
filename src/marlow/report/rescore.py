"""``marlow rescore``: a run's stored validation answers graded again with another reward, no
generation needed, so a reward can be iterated on without a GPU.

Each validation of a run keeps every episode's final answer and answer turns
(:mod:`marlow.diagnostics.answers`). Rescoring rebuilds the run's task from its ``config.yaml``
(the same rows, split and validation problems, so every stored answer meets its own problem and
dataset columns), grades every stored text with the new reward in one call per validation
(:class:`marlow.rewards.user.UserReward`, with its failure rules), and writes, per validation
step, the run's own figures beside the new ones to ``RUN/rescore/NAME.json`` (NAME: the
function's name, or ``name``): ``reward`` (mean over episodes with a reward), ``accuracy`` (a
reward of at least the threshold), ``pass_at_n`` (any answer turn correct; workflows with several
answer turns), and the count of episodes without a reward. An earlier file of that name is
replaced only with ``overwrite``.

Choices of marlow, not fixed by the spec: the threshold defaults to the run's
``task.correct_threshold``; a built-in task's problems (which have no columns of their own) pass
their gold as the reward's ``answer`` keyword.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from marlow.config import ConfigError, load_config
from marlow.diagnostics.answers import read_answers
from marlow.diagnostics.sinks import first_event, read_metrics
from marlow.fileio import write_json
from marlow.models import vocabulary
from marlow.rewards.user import UserReward, load_reward
from marlow.tasks import build_task
from marlow.types import missing_reason

FIGURES = ("reward", "accuracy", "pass_at_n")


def rescore(
    run_dir: str | Path,
    reward: str,
    *,
    form: str = "trl",
    threshold: float | None = None,
    timeout_s: float | None = None,
    name: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Grade ``run_dir``'s stored validation answers with ``reward`` (module docstring); returns
    what it wrote."""
    run = Path(run_dir).absolute()  # the reward may change the working directory
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"{run} is not a run folder (no config.yaml)")
    stored = read_answers(run)
    if not stored:
        raise ConfigError(
            f"{run} has no stored validation answers (val_answers/); a run stores them at each "
            "validation"
        )
    config = load_config(run / "config.yaml")
    fn = load_reward(reward)
    out = run / "rescore" / f"{name or fn.__name__}.json"
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it, or --name")
    task = build_task(
        config.task,
        log=log,
        vocabulary=vocabulary(config.model.name),
        recorded=first_event(run, "data"),
    )
    problems = {p.id: p for p in task.val_problems()}
    grade = UserReward(
        fn,
        spec=reward,
        form=form,
        timeout_s=timeout_s or config.task.reward_timeout_s,
        source=config.task.source,
    )
    at = config.task.correct_threshold if threshold is None else threshold
    old = {r["step"]: r for r in read_metrics(run)}
    steps = []
    for step, rows in stored.items():
        missing = [r["problem"] for r in rows if r["problem"] not in problems]
        if missing:
            raise ConfigError(
                f"{run}: validation problem {missing[0]!r} of step {step} is not in the task "
                "its config.yaml builds now (has the data file changed?)"
            )
        new = _grade(grade, rows, problems, at)
        before = {k: old.get(step, {}).get(f"val/all/{k}") for k in FIGURES}
        steps.append({"step": step, "old": before, "new": new})
    result = {
        "run": str(run),
        "reward": reward,
        "form": form,
        "threshold": at,
        "failures": grade.events,
        "steps": steps,
    }
    write_json(out, result)
    return {**result, "file": str(out)}


def _grade(grade: UserReward, rows: list[dict], problems: dict, at: float) -> dict[str, Any]:
    pairs = [(text, problems[r["problem"]]) for r in rows for text in (r["final"], *r["answers"])]
    grade.prefetch(pairs)
    finals = [grade(r["final"], problems[r["problem"]]) for r in rows]
    scored = [x for x in finals if not math.isnan(x)]
    new: dict[str, Any] = {
        "reward": sum(scored) / len(scored) if scored else None,
        "accuracy": sum(x >= at for x in scored) / len(scored) if scored else None,
        "pass_at_n": None,
        "no_reward": sum(missing_reason(x) is not None for x in finals),
    }
    if any(len(r["answers"]) > 1 for r in rows):
        hits = [any(grade(t, problems[r["problem"]]) >= at for t in r["answers"]) for r in rows]
        new["pass_at_n"] = sum(hits) / len(hits)
    return new
