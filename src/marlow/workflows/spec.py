"""Workflows as data: the compiled form one engine runs, and the registry of built-in names.

A workflow is written as a YAML file (:mod:`marlow.workflows.schema` documents the format) and
compiled to a :class:`WorkflowSpec`: an ordered tuple of :class:`Stage` s (repeat blocks
unrolled, parameters filled in), each a role of some kind called for some number of slots in the
episodes where its condition holds, with the fields its prompt reads. Nothing here, in the engine
or in credit knows a role by name: they read kinds, reads, parsers and conditions.

Built-in workflows are files shipped in the package (``marlow/workflows/files/*.yaml``), known
by their file's stem; anywhere a workflow name is accepted, a path to a workflow file is too
(:func:`build_workflow`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from marlow.config import ConfigError, RunConfig
from marlow.registry import Registry
from marlow.types import Episode, Problem, Turn

BUILTIN_DIR = Path(__file__).with_name("files")
FILE_SUFFIXES = (".yaml", ".yml")


@dataclass
class EpisodeState:
    """An episode while it runs: its record, its problem, and what its parsers read so far."""

    episode: Episode
    problem: Problem
    verdict: bool | None = None  # the latest judge verdict (None: none yet, or unparseable)
    plans: dict[str, list[str | None]] = field(default_factory=dict)  # plan role -> strategies
    candidates: list[str] = field(default_factory=list)  # what the latest selection chose among
    selected: str = ""  # the candidate it chose
    selected_turn: Turn | None = None  # the turn that wrote it
    # role or stage name -> every output (a Turn, a ToolCall) so far, and its latest stage's
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    latest: dict[str, list[Any]] = field(default_factory=dict)
    ended: bool = False  # a call's prompt passed rollout.max_prompt_tokens: no later stage runs
    marks: dict[str, Any] = field(default_factory=dict)  # what a stage kind's conditions read

    def keep(self, name: str, outputs: list[Any]) -> None:
        """A stage's outputs in this episode (turns of a role, or a stage kind's records: each
        with a ``slot`` and a ``completion_text``), which later stages read by ``name``."""
        self.outputs.setdefault(name, []).extend(outputs)
        self.latest[name] = outputs

    def turns_of(self, name: str) -> list[Any]:
        """Every output of a role, or of a stage kind's stage, so far."""
        return self.outputs.get(name, [])

    def count(self, counter: str, k: int = 1) -> None:
        self.episode.counters[counter] = self.episode.counters.get(counter, 0) + k


@dataclass(frozen=True)
class Read:
    """A prompt field a stage reads: ``source`` (schema.SOURCES) of ``role``."""

    field: str
    source: str
    role: str


@dataclass(frozen=True)
class Stage:
    """One role called for ``slots`` slots in every episode where ``when`` holds; or a stage of
    a registered kind (:mod:`marlow.workflows.stage_kinds`, the tool stage's ``tool``), run the
    same way: then ``role`` is the stage's name, ``kind`` the stage kind's and ``options`` its
    fields."""

    role: str
    kind: str
    prompt: str  # "ROLE/VARIANT" of the prompt library, or a variant of the role's own prompts
    slots: int = 1
    round: int = 0
    when: str = "always"
    parser: str | None = None
    reads: tuple[Read, ...] = ()
    count: int = 0  # strategies parser: how many strategies (the slots of the stage reading them)
    trajectory: str = "role"  # schema.TRAJECTORIES: how its turns are named (Turn.trajectory)
    options: Any = None  # a stage kind's stage: its fields (StageKind.fields, validated)

    def trajectory_of(self, slot: int) -> str:
        """The trajectory name of the stage's turn in ``slot``: ``generator`` or ``generator0``."""
        return f"{self.role}{slot}" if self.trajectory == "slot" else self.role


Grader = Callable[[str, Problem], float]


@dataclass(frozen=True)
class EpisodeRules:
    """How the engine runs a workflow's episodes, beyond the workflow itself: the run's switches
    (``marlow.config``), most of them the choices of the study's official code
    (:mod:`marlow.config.presets`). :meth:`of` reads them from a run config.

    * ``credit``: ``broadcast`` (every turn the episode's reward) or ``role`` (each turn its own:
      ``marlow.workflows.role_rewards``);
    * ``seeding``: ``call`` (a stage's samples from one generator in request order) or
      ``request`` (each request its own seed: ``engine.request_seed``);
    * ``parse``: how verdicts and selections are read (``marlow.parsers.PARSE_RULES``), in the
      episode and in its credit;
    * ``workers``: ``fixed`` runs every slot of a plan-reading stage, ``parsed`` one per
      strategy the official parser finds (``engine.slots_of``);
    * ``context``: ``latest`` sends each call its prompt alone, ``conversation`` after the
      episode's chat so far, in a workflow whose file allows it (``engine.conversation``);
    * ``max_prompt_tokens``: an episode whose next call's prompt is longer ends before that
      stage (counted ``prompt_cap``); None: no cap. A run also caps it so that a prompt and its
      completion fit in the model's context (:meth:`within_context`);
    * ``prompts``: the chat prompt set library templates come from (``marlow.prompts``; a tiny
      model always reads the ``tiny`` set);
    * ``correct_at``: a reward at least this is correct (accuracy, pass@N, majority vote, a
      verdict's credit); a missing reward (NaN) is never correct;
    * ``tool_timeout_s``: the most seconds one call of a tool stage may take.
    """

    credit: str = "broadcast"
    seeding: str = "call"
    parse: str = "last-box"
    workers: str = "fixed"
    context: str = "latest"
    max_prompt_tokens: int | None = None
    prompts: str = "marlow"
    correct_at: float = 1.0
    tool_timeout_s: float = 30.0

    @classmethod
    def of(cls, config: RunConfig) -> EpisodeRules:
        return cls(
            credit=config.grpo.credit,
            seeding=config.rollout.seeding,
            parse=config.workflow.parse,
            workers=config.workflow.workers,
            context=config.workflow.context,
            max_prompt_tokens=config.rollout.max_prompt_tokens,
            prompts=config.workflow.prompts,
            correct_at=config.task.correct_threshold,
            tool_timeout_s=config.workflow.tool_timeout_s,
        )

    def within_context(self, positions: int | None, new_tokens: int) -> EpisodeRules:
        """These rules with the prompt cap lowered to ``positions - new_tokens``, so that no call
        runs a model past the positions it has (``max_position_embeddings``; a shared
        conversation grows with every turn: the tiny model's 512 were passed by Eval-Opt's third
        round). ``positions`` None: unchanged."""
        if positions is None:
            return self
        room = positions - new_tokens
        if room < 1:
            raise ConfigError(
                f"config field 'rollout.max_new_tokens' is {new_tokens} but the model has "
                f"{positions} positions; leave room for a prompt"
            )
        cap = room if self.max_prompt_tokens is None else min(room, self.max_prompt_tokens)
        return replace(self, max_prompt_tokens=cap)


@dataclass(frozen=True)
class WorkflowSpec:
    name: str
    title: str
    stages: tuple[Stage, ...]
    kinds: Mapping[str, str]  # role -> kind, in order of first appearance (a tool is no role)
    answer: str  # "selected" or "last.ROLE"
    credit: Mapping[str, str]  # kind -> credit rule (schema.CREDIT_RULES)
    params: Mapping[str, int] = field(default_factory=dict)  # also prompt fields ({n})
    prompts: Mapping[tuple[str, str], Mapping[tuple[str, str], str]] = field(default_factory=dict)
    """(role, variant) -> {(style or *, task or *): template}: the roles' own prompts."""
    rounds: bool = False  # declared a repeat block: episodes report rounds_used
    conversation: bool = False  # its calls may see the episode's chat so far (workflow.context)
    source: str = ""  # the file it was read from
    named_stages: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    """The name of each stage of a registered kind -> (its kind, its fields)."""

    @property
    def tools(self) -> dict[str, str]:
        """The tool stages' functions by tool name (their ``call``)."""
        return {n: o.call for n, (kind, o) in self.named_stages.items() if kind == "tool"}

    @property
    def roles(self) -> list[str]:
        """Role types in order of first appearance."""
        return list(self.kinds)

    def slots_of(self, role: str) -> int:
        """Most slots the role occupies in one stage (Voting generator: 3)."""
        return max(s.slots for s in self.stages if s.role == role)


_REGISTRY: Registry[Path] = Registry(
    "workflow", {p.stem: p for p in sorted(BUILTIN_DIR.glob("*.yaml"))}
)


def register_workflow(name: str, path: str | Path) -> None:
    """Make the workflow file at ``path`` known by ``name`` too."""
    _REGISTRY.add(name, Path(path))


def workflow_names() -> list[str]:
    return _REGISTRY.names()


def is_workflow_file(name: str) -> bool:
    """Whether ``name`` is meant as a path to a workflow file (it ends in .yaml or .yml)."""
    return name.endswith(FILE_SUFFIXES)


def workflow_path(name: str) -> Path:
    """The file of workflow ``name``: a registered name's, or ``name`` itself as a path."""
    if name in _REGISTRY:
        return _REGISTRY.get(name)
    if is_workflow_file(name):
        return Path(name)
    raise ValueError(f"{_REGISTRY.unknown(name)}, or the path of a workflow file (.yaml)")
