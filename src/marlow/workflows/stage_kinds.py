"""Stage kinds: a kind of workflow stage that is not a role speaking, added in one place.

A stage of a workflow file is a role's (``role:`` and ``prompt:``: the model samples it), a
repeat block, or a stage of a registered kind, which its kind's key marks (``tool: NAME``). A
:class:`StageKind` holds everything the rest of marlow needs to know of one:

* **schema**: ``fields``, the pydantic model of what a file writes for it: its key (the stage's
  name, which later stages read: ``last.NAME``) and its own fields. Besides them a kind's stage
  takes the fields every stage has (:data:`SHARED_FIELDS`: ``slots``, ``when``, ``reads``,
  ``skip_last``) and none of a role's (:data:`ROLE_FIELDS`);
* **check**: what its fields mean beyond their types, called in file order with the options of
  the earlier stage of the same name (:data:`Check`); ``sources``, the reads a later stage may
  name it with (of ``marlow.workflows.schema.SOURCES``); ``conditions``, the ``when`` conditions
  it offers a later stage, each valid only after a stage of the kind;
* **prepare**: what a run does before it starts, such as importing a function, raising a
  one-line ``ValueError`` when it cannot (a :class:`marlow.config.ConfigError` naming the stage
  before the run starts);
* **run**: the stage in every episode where it runs, with a :class:`StageContext` (each
  episode's slots and reads). It records its outputs in the episode and hands them to the
  episode's state (:meth:`marlow.workflows.spec.EpisodeState.keep`), where later stages read
  them. An output has a ``slot`` and a ``completion_text``. A kind's stage has no adapter and
  gets no gradient.

The tool stage (:mod:`marlow.workflows.tools`) is the built-in kind. ``register_stage_kind``
adds one; ``docs/concepts/extending.md`` shows a ten-line example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from marlow.config import ConfigError
from marlow.registry import Registry

if TYPE_CHECKING:
    from marlow.workflows.spec import EpisodeRules, EpisodeState, Stage, WorkflowSpec

SHARED_FIELDS = ("reads", "slots", "when", "skip_last")
"""The fields of a workflow stage that a registered kind's stage takes too."""
ROLE_FIELDS = ("role", "prompt", "parser", "trajectory")
"""The fields only a role's stage takes."""

Check = Callable[[Any, Any], "tuple[str, str] | None"]
"""``check(options, earlier)``: a stage's validated fields and those of the earlier stage of the
same name (None: the first) -> None, or (field, message) for a one-line error at that field."""


@dataclass(frozen=True)
class Condition:
    """A ``when`` condition a stage kind offers: what it means, and whether it holds."""

    meaning: str
    holds: Callable[[EpisodeState], bool]


@dataclass(frozen=True)
class StageContext:
    """What the engine hands a kind's run: the stage's index in the workflow, the prompt style,
    the run's rules, and each episode's slots and reads, as a role's stage would see them."""

    index: int
    style: str
    rules: EpisodeRules
    slots: Callable[[Stage, EpisodeState], int]
    reads: Callable[[Stage, EpisodeState, int], dict[str, str]]


def _no_check(options: Any, earlier: Any) -> tuple[str, str] | None:
    return None


def _nothing(options: Any) -> None:
    return None


@dataclass(frozen=True)
class StageKind:
    """A kind of stage: its key and fields in a file, their check, what a run prepares and how
    the engine runs it (the module's docstring says each)."""

    name: str
    fields: type[BaseModel]
    run: Callable[[Stage, Sequence[EpisodeState], StageContext], None]
    check: Check = _no_check
    prepare: Callable[[Any], None] = _nothing
    sources: tuple[str, ...] = ("last", "own", "outputs", "others")
    conditions: Mapping[str, Condition] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in self.fields.model_fields:
            raise ValueError(
                f"stage kind {self.name}: its fields ({self.fields.__name__}) need a field "
                f"{self.name!r}, the stage's name"
            )


RESERVED = frozenset(
    {*SHARED_FIELDS, *ROLE_FIELDS, "repeat", "stages", "answer", "judge", "select", "plan"}
)
"""Names a stage kind cannot take: a stage's own fields, and the role kinds."""

_KINDS: Registry[StageKind | str] = Registry(
    "stage kind", {"tool": "marlow.workflows.tools:TOOL_STAGE"}
)


def register_stage_kind(kind: StageKind) -> StageKind:
    """Add ``kind``: a workflow file's stages may then be ``{NAME: ..., ...}``."""
    if kind.name in RESERVED or not kind.name.isidentifier():
        raise ValueError(
            f"stage kind name {kind.name!r} must be a word and not one of {', '.join(sorted(RESERVED))}"
        )
    clash = sorted((set(SHARED_FIELDS) | set(ROLE_FIELDS)) & set(kind.fields.model_fields))
    if clash:
        raise ValueError(f"stage kind {kind.name}: field {clash[0]} is every stage's own")
    _KINDS.add(kind.name, kind)
    return kind


def stage_kind_names() -> list[str]:
    """The registered kinds' names, which are their keys in a file (nothing is imported)."""
    return list(_KINDS)


def stage_kind(name: str) -> StageKind:
    """The kind registered as ``name``, its module imported now if it was not yet."""
    return _KINDS.load(name)  # type: ignore[return-value]  # a path is imported


def kind_conditions() -> dict[str, tuple[str, Condition]]:
    """Every condition a registered kind offers: name -> (the kind, the condition)."""
    return {
        name: (kind, condition)
        for kind in stage_kind_names()
        for name, condition in stage_kind(kind).conditions.items()
    }


def prepare_stages(workflow: WorkflowSpec) -> None:
    """Each stage of a registered kind prepared for a run (a tool's function imported); a
    one-line ConfigError naming the workflow, the kind and the stage when one cannot be."""
    for name, (kind, options) in workflow.named_stages.items():
        try:
            stage_kind(kind).prepare(options)
        except ValueError as err:
            raise ConfigError(f"workflow {workflow.name}: {kind} {name}'s {err}") from None
