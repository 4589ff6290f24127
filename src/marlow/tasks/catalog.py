"""Every task ``task.name`` can name, with where it comes from: the built-in ``math`` and
``code`` (marlow's own formats and graders), ``custom`` (a file and a reward of one's own, named
in the settings), and the tasks installed packages publish (``marlow.config.installed_tasks``).
``marlow tasks`` prints this."""

from __future__ import annotations

from dataclasses import dataclass

from marlow.config.installed_tasks import description, installed_tasks


@dataclass(frozen=True)
class TaskInfo:
    name: str
    origin: str  # "built-in", or the publishing package and its entry point
    description: str


BUILTIN = (
    TaskInfo(
        "math",
        "built-in",
        "the last \\boxed{} answer against the gold, by mathematical equivalence; tiny "
        "arithmetic, or task.dataset gsm8k, math500, dapo",
    ),
    TaskInfo(
        "code",
        "built-in",
        "the last python block against hidden tests in the sandbox; tiny programs, or "
        "task.dataset humaneval, deepcoder",
    ),
    TaskInfo(
        "custom",
        "built-in",
        "your data and your reward: task.source, task.prompt_field, task.reward (docs/tasks.md)",
    ),
)


def catalog() -> list[TaskInfo]:
    """The built-in tasks, then the installed ones by name."""
    installed = [TaskInfo(n, o, description(n)) for n, o in installed_tasks().items()]
    return [*BUILTIN, *installed]
