"""Workflows as data.

A workflow is an ordered list of :class:`Stage` s. A stage is one role called for some number of
slots; it may run only for episodes that satisfy ``when`` (Eval-Opt's revision rounds), and its
outputs may be read into the episode's state by ``parse`` (verdicts, strategies). ``answer``
reads the final answer text from a finished episode; ``extras`` adds workflow-specific numbers
(Voting's pass@N). One engine (:mod:`marlow.workflows.engine`) runs every workflow, batching
each stage's calls across all episodes of a step.

A new workflow is a new spec, a few lines of Python::

    register_workflow("critic-once", lambda: WorkflowSpec(
        name="critic-once",
        stages=(Stage("generator", "answer"), Stage("evaluator", "review", parse=parse_verdict)),
        answer=last_text("generator"),
    ))

plus prompt templates for any new (role, variant) in :mod:`marlow.prompts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from marlow.types import Episode, Problem, Turn


@dataclass
class EpisodeState:
    """An episode while it runs: its record, its problem, and what stages parsed so far."""

    episode: Episode
    problem: Problem
    vars: dict[str, Any] = field(default_factory=dict)

    def turns_of(self, role: str) -> list[Turn]:
        return [t for t in self.episode.turns if t.role == role]

    def count(self, counter: str, k: int = 1) -> None:
        self.episode.counters[counter] = self.episode.counters.get(counter, 0) + k


@dataclass(frozen=True)
class Stage:
    """One role called for ``slots`` slots in every episode where ``when`` holds."""

    role: str
    variant: str  # prompt template variant, see prompts.py
    slots: int = 1
    round: int = 0
    when: Callable[[EpisodeState], bool] | None = None
    parse: Callable[[EpisodeState, list[Turn]], None] | None = None


Grader = Callable[[str, Problem], float]


@dataclass(frozen=True)
class WorkflowSpec:
    name: str
    stages: tuple[Stage, ...]
    answer: Callable[[EpisodeState], str]
    extras: Callable[[EpisodeState, Grader], dict[str, float]] | None = None
    n: int = 1  # how many candidates / strategies / workers: the `n` prompt field

    @property
    def roles(self) -> list[str]:
        """Role types in order of first appearance."""
        out: list[str] = []
        for stage in self.stages:
            if stage.role not in out:
                out.append(stage.role)
        return out

    def slots_of(self, role: str) -> int:
        """Most slots the role occupies in one stage (Voting generator: 3)."""
        return max(s.slots for s in self.stages if s.role == role)


WorkflowFactory = Callable[..., WorkflowSpec]
_REGISTRY: dict[str, WorkflowFactory] = {}


def register_workflow(name: str, factory: WorkflowFactory) -> None:
    """Add a workflow by name. ``factory(**params)`` builds its spec."""
    if name in _REGISTRY:
        raise ValueError(f"workflow {name!r} is already registered")
    _REGISTRY[name] = factory


def workflow_names() -> list[str]:
    return sorted(_REGISTRY)


def workflow_factory(name: str) -> WorkflowFactory:
    if name not in _REGISTRY:
        raise ValueError(f"workflow {name!r} is unknown; valid: {', '.join(workflow_names())}")
    return _REGISTRY[name]


def build_workflow(name: str, **params: Any) -> WorkflowSpec:
    """The spec of workflow ``name``, with its count parameters (e.g. ``rounds=2``)."""
    factory = workflow_factory(name)
    try:
        return factory(**params)
    except TypeError as err:
        raise ValueError(f"workflow {name!r} got bad parameters {params}: {err}") from None


def last_text(role: str) -> Callable[[EpisodeState], str]:
    """Answer rule: the last turn of ``role``."""

    def answer(state: EpisodeState) -> str:
        turns = state.turns_of(role)
        return turns[-1].completion_text if turns else ""

    return answer
