"""``marlow task check``: a task looked at before any training.

In order, each a line of the report:

1. **data**: the rows read, kept and skipped by reason (a tiny task: its endless generator), and
   the train and validation problems;
2. **gold answers**: where problems have one, each is graded as if a model had answered it (for
   the ``math`` family inside ``\\boxed{}``, as the math prompts ask; else as it is). A reward
   that gives a gold answer less than ``task.correct_threshold``, or no reward at all, is a
   problem: such a reward cannot tell a right answer from a wrong one;
3. **episodes**: a few training problems through the workflow on the run's model, as step 1
   would sample them (``grpo.group_size`` episodes each, at ``rollout.temperature``), with each
   group's rewards. A reward missing for any episode is a problem, and so is a batch in which no
   group's rewards vary: GRPO's advantage is zero in a group of equal rewards, so such a task
   teaches the model nothing until some group varies.

The adapters are new (LoRA's B is zero), so the episodes are the base model's; ``show`` prints
some of them as text, to read what the base model writes before writing a reward. Nothing is written
outside a temporary folder. Choices of marlow, not fixed by the spec: the number of problems
(``problems``, 4) and of gold answers graded (``GOLD_LIMIT``).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from marlow.config import RunConfig
from marlow.models import task_family
from marlow.training.trainer import Trainer
from marlow.types import Problem, missing_reason

GOLD_LIMIT = 200
"""At most this many gold answers are graded (the validation problems first)."""


@dataclass
class TaskReport:
    lines: list[str] = field(default_factory=list)  # what was checked, in order
    problems: list[str] = field(default_factory=list)  # one line each; empty: the task is fine


def gold_completion(problem: Problem, family: str) -> str:
    """A gold answer written as a model would answer it."""
    return f"\\boxed{{{problem.answer}}}" if family == "math" else problem.answer


def check_task(
    config: RunConfig,
    *,
    problems: int = 4,
    show: int = 0,
    log: Callable[[str], None] | None = None,
) -> TaskReport:
    """The report of the module docstring for ``config``'s task, model and workflow; ``show``:
    that many of the sampled episodes also as text (every turn's prompt and completion, and each
    tool call), so that the base model's answers can be read before the reward is written."""
    report = TaskReport()
    with (
        tempfile.TemporaryDirectory(prefix="marlow-task-check-") as tmp,
        Trainer(config, tmp, log=log) as trainer,
    ):
        task, family = trainer.task, task_family(config.model, config.task)
        data = task.data_report
        if data is None:
            report.lines.append(f"data: the tiny world's {config.task.name} problems (endless)")
        else:
            skipped = ", ".join(f"{k}={v}" for k, v in data["skipped"].items()) or "none"
            report.lines.append(
                f"data: {data['source']}: read {data['rows_read']}, kept {data['kept']}, "
                f"skipped {skipped}; {len(task.train_problems())} train, {len(trainer.val_set)} validation"
            )
        _gold(report, trainer, family, config.task.correct_threshold)
        _episodes(report, trainer, problems, show)
    return report


def _gold(report: TaskReport, trainer: Trainer, family: str, threshold: float) -> None:
    pool = [p for p in (*trainer.val_set, *trainer.task.train_problems()) if p.answer][:GOLD_LIMIT]
    if not pool:
        report.lines.append("gold answers: none to grade (the task's problems carry no answer)")
        return
    pairs = [(gold_completion(p, family), p) for p in pool]
    prefetch = getattr(trainer.grade, "prefetch", None)
    if prefetch is not None:
        prefetch(pairs)
    scores = [trainer.grade(text, p) for text, p in pairs]
    low = [(p, s) for (_, p), s in zip(pairs, scores, strict=True) if not s >= threshold]
    report.lines.append(
        f"gold answers: {len(pool) - len(low)} of {len(pool)} score at least "
        f"task.correct_threshold={threshold:g}"
    )
    if low:
        p, s = low[0]
        why = missing_reason(s)
        got = f"no reward ({why})" if why is not None else f"{s:g}"
        report.problems.append(
            f"the reward gives {len(low)} of {len(pool)} gold answers less than "
            f"task.correct_threshold={threshold:g} (problem {p.id}: gold "
            f"'{gold_completion(p, family)}' got {got}); it cannot tell right from wrong"
        )


def _episodes(report: TaskReport, trainer: Trainer, problems: int, show: int = 0) -> None:
    cfg = trainer.cfg
    batch = trainer.task.train_batch(cfg.seed, 1, problems)
    episodes = trainer.rollout(batch, cfg.grpo.group_size, cfg.rollout.temperature, seed=cfg.seed)
    for i, ep in enumerate(episodes[:show]):
        reward = "none" if math.isnan(ep.reward) else f"{ep.reward:g}"
        report.lines.append(f"--- episode {i + 1} of {batch[ep.group].id} (reward {reward})")
        for t in ep.transcript():
            if "tool" in t:
                report.lines.append(f"tool {t['tool']} ({t['status']}):\n{t['output']}")
            else:
                report.lines.append(f"{t['role']} prompt:\n{t['prompt']}")
                report.lines.append(f"{t['role']} completion:\n{t['completion']}")
        report.lines.append(f"final answer:\n{ep.final_answer}")
    if show:
        report.lines.append("---")
    groups: dict[int, list[float]] = {}
    for ep in episodes:
        groups.setdefault(ep.group, []).append(ep.reward)
    varied = 0
    for g, rewards in groups.items():
        shown = ", ".join("none" if math.isnan(r) else f"{r:g}" for r in rewards)
        present = [r for r in rewards if not math.isnan(r)]
        spread = len(present) > 1 and min(present) != max(present)
        varied += spread
        report.lines.append(
            f"episodes of {batch[g].id}: rewards {shown} ({'vary' if spread else 'all equal'})"
        )
    missing = sum(missing_reason(ep.reward) is not None for ep in episodes)
    if missing:
        last = getattr(trainer.grade, "last_error", None)
        report.problems.append(
            f"{missing} of {len(episodes)} sampled episodes got no reward"
            + (f"; last error: {last}" if last else " (the reward returned None or NaN)")
        )
    report.lines.append(f"groups whose rewards vary: {varied} of {len(groups)}")
    if not varied:
        report.problems.append(
            f"no group of {len(groups)} sampled has rewards that vary: GRPO learns nothing from "
            "a group of equal rewards (a reward too strict or too lenient for this model?)"
        )
