"""The workflow file: YAML, read by a pydantic model, checked, and compiled to a WorkflowSpec.

A workflow file declares (docs/workflows.md walks through one)::

    title: Voting                      # cell names and the report (default: the name)
    params:                            # count parameters; `workflow.params` overrides the default
      n: {default: 3, min: 1}
    roles:
      generator: {kind: answer}
      aggregator: {kind: select}
    stages:
      - {role: generator, prompt: generator/answer, slots: n}
      - role: aggregator
        prompt: aggregator/select
        reads: {candidates: outputs.generator}
        parser: selection
    answer: selected

* **kinds** (:data:`KINDS`) say what a role does; the engine, credit, signatures and detectors
  read kinds and declared reads, never role names. A ``judge`` must parse a verdict, a ``select``
  a selection, a ``plan`` its strategies; a ``final`` role writes the episode's answer.
* **prompts**: ``prompt: ROLE/VARIANT`` (with a slash) names a template of the built-in prompt
  library (:mod:`marlow.prompts`, the one the tiny world is pre-trained on); ``prompt: VARIANT``
  names one of the role's own ``prompts:``, a ``str.format`` string (``{field}``; ``{{`` for a
  literal brace) for every style, or a mapping ``{chat: ..., tiny: ...}`` whose values may be
  mappings by task (``{math: ..., code: ...}``). ``str.format`` and not Jinja: the library's
  templates already are, and a field is a name, never an expression.
* **fields** a template may use: ``problem``, every parameter (``{n}``), and the stage's
  ``reads`` (``FIELD: SOURCE.ROLE``, :data:`SOURCES`). A read names a role with a stage before
  this one in the file: a later role is a forward read (a cycle), refused.
* **rounds**: ``- repeat: rounds`` with its own ``stages:`` runs them for rounds 1..R (R a number
  or a parameter); ``skip_last: true`` leaves a stage out of the last round (Eval-Opt's evaluator
  after the last revision: its verdict could change nothing). Stages outside a repeat are round 0.
  A workflow with a repeat reports ``rounds_used``, the highest round an episode reached.
* **when** (:data:`CONDITIONS`): a stage runs only in the episodes where its condition holds.
* **conversation** (default ``false``): ``true`` lets ``workflow.context: conversation`` send each
  call after the episode's chat so far (the official Eval-Opt's shared history); workflows
  without it ignore that switch (the official Voting and Orch-Workers build each prompt alone).
* **trajectory** (:data:`TRAJECTORIES`, default ``role``): how the stage's turns are named for
  ``grpo.advantage_scope: trajectory`` (the official code's groups): ``slot`` keeps the slots
  apart (Voting's voters), ``role`` pools them with the role's other stages.
* **answer**: ``last.ROLE`` (that role's latest output), ``latest`` (the latest output of any
  role of kind ``answer``: a solver's, or a fixer's when one ran after it) or ``selected`` (the
  candidate the ``selection`` parser chose; its fallback is the first candidate, counted).
* **stage kinds** (:mod:`marlow.workflows.stage_kinds`): a stage marked by a registered kind's
  key is that kind's. The built-in one is the tool stage, ``- {tool: NAME, call:
  package.module:function, reads: {...}}``, which calls a function instead of a model
  (:mod:`marlow.workflows.tools`): it gets the stage's reads, the problem and the episode so far,
  and returns text (and optionally fields) that later stages read like a role's output
  (``last.NAME``). A kind's stage takes ``slots``, ``when``, ``reads`` and ``skip_last`` like a
  role's stage, and no ``role``, ``prompt``, ``parser`` or ``trajectory``; its name is not a
  role's. It has no adapter and gets no gradient.
* **credit** (under ``grpo.credit: role``; broadcast credit gives every turn the episode reward):
  one rule per kind, :data:`DEFAULT_CREDIT` unless the file's ``credit:`` changes it.

Every problem is a :class:`WorkflowFileError`, one line: the file, the line where the YAML shows
it, the field, what is wrong and the valid choices.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from marlow.config import yaml_problem
from marlow.prompts import TEMPLATES
from marlow.types import NOT_UNICODE, not_unicode

KINDS = {
    "answer": "proposes or revises an answer to the problem",
    "judge": "gives a verdict (Correct/Incorrect) on the latest answer before it",
    "select": "picks one of the candidates it reads",
    "plan": "writes strategies (sub-tasks) for the slots of a later stage",
    "final": "writes the episode's answer from the others' work",
}
"""Role kinds: what a role does, which is all the engine and diagnostics know of it."""

PARSERS = {"verdict": "judge", "selection": "select", "strategies": "plan"}
"""Parser (marlow.parsers) -> the kind that must use it (and may use no other)."""

CONDITIONS = {
    "always": "every episode",
    "verdict_incorrect": "the latest verdict is not Correct (unparseable counts as Incorrect)",
    "verdict_correct": "the latest verdict is Correct",
}
"""A stage's ``when``, besides those a stage kind offers (``tool_failed``, ``tool_passed``)."""

SOURCES = {
    "last": "ROLE's latest output",
    "own": "ROLE's latest output in this stage's slot",
    "outputs": "the outputs of ROLE's latest stage, numbered",
    "others": "the outputs of ROLE's latest stage but this slot's, numbered",
    "plan": "this slot's strategy from ROLE's plan (a generic one where it gave none)",
}
"""Read sources, written ``SOURCE.ROLE``."""

CREDIT_RULES = {
    "broadcast": "the episode's reward",
    "own": "the grade of the turn's own output as an answer",
    "verdict": "1 when its verdict is right about the latest answer before it, else 0",
}
DEFAULT_CREDIT = {
    "answer": "own",
    "judge": "verdict",
    "select": "broadcast",
    "plan": "broadcast",
    "final": "broadcast",
}
CREDIT_FOR = {"own": ("answer", "final"), "verdict": ("judge",), "broadcast": tuple(KINDS)}
"""Which kinds a credit rule may apply to."""

TRAJECTORIES = ("role", "slot")
"""A stage's ``trajectory``: the name its turns carry into the official code's advantage groups
(``grpo.advantage_scope=trajectory``): the role's name (every slot and round of the role one
trajectory: Eval-Opt's generator, Orch-Workers' workers), or the role's name and the slot
(``generator0``, ``generator1``, ...: Voting's voters, each its own)."""

Loc = tuple[str | int, ...]


class WorkflowFileError(ValueError):
    """A workflow file problem, in one line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ParamFile(_Strict):
    """A count parameter (``params: {n: {default: 3, min: 1}}``); ``workflow.params`` sets it."""

    default: int = Field(description="its value unless workflow.params gives another")
    min: int = Field(0, description="the smallest value workflow.params may give")


class RoleFile(_Strict):
    """A role: what it does (its kind), and prompts of its own."""

    kind: str = Field(description=f"what the role does: {', '.join(KINDS)}")
    prompts: dict[str, str | dict[str, str | dict[str, str]]] = Field(
        {},
        description="the role's own templates by variant: a str.format string for every style, "
        "or {chat: ..., tiny: ...} whose values may be {math: ..., code: ...}",
    )


class StageFile(BaseModel):
    """A stage, or (``repeat`` and ``stages`` only) a block of stages run for several rounds. A
    stage of a registered kind is marked by its key (``tool:``) and takes that kind's fields
    besides ``slots``, ``when``, ``reads`` and ``skip_last`` (the sections below); the check of
    the file (``marlow.workflows.load``) refuses any other field."""

    model_config = ConfigDict(extra="allow")

    role: str | None = Field(None, description="the role that speaks in this stage")
    prompt: str | None = Field(
        None,
        description="ROLE/VARIANT: a template of the built-in library; VARIANT: one of the "
        "role's own prompts",
    )
    slots: int | str = Field(
        1, description="how many times the role speaks in parallel: a number or a parameter's name"
    )
    when: str = Field(
        "always",
        description=f"the episodes the stage runs in: {', '.join(CONDITIONS)}, or a condition a "
        "stage kind offers (tool_failed, tool_passed)",
    )
    parser: str | None = Field(
        None,
        description=f"how the output is read: {', '.join(PARSERS)} (each for its kind), or none",
    )
    reads: dict[str, str] = Field(
        {},
        description="template field -> SOURCE.ROLE of an earlier stage's role; sources: "
        + ", ".join(SOURCES),
    )
    trajectory: str = Field(
        "role",
        description="the name its turns carry for grpo.advantage_scope=trajectory: role, or slot "
        "(each slot its own)",
    )
    skip_last: bool = Field(
        False, description="inside a repeat: leave the stage out of the last round"
    )
    repeat: int | str | None = Field(
        None, description="run this block's stages for rounds 1..R (a number or a parameter)"
    )
    stages: list[StageFile] | None = Field(None, description="the stages of a repeat block")


class WorkflowFile(_Strict):
    """A workflow file's top level: its name and description, its parameters, roles and stages,
    and where the episode's answer comes from."""

    name: str | None = Field(None, description="its name (default: the file's name)")
    title: str | None = Field(None, description="its title in cell names and reports")
    description: str = Field("", description="one line on what it does (marlow workflows)")
    params: dict[str, ParamFile] = Field({}, description="count parameters by name")
    roles: dict[str, RoleFile] = Field(description="the roles by name")
    stages: list[StageFile] = Field(description="the stages, in the order they run")
    answer: str = Field(
        description="the episode's answer: last.ROLE (that role's latest output), latest (the "
        "latest output of any answer role) or selected (the candidate the selection parser "
        "chose)"
    )
    credit: dict[str, str] = Field(
        {},
        description="under grpo.credit=role: kind -> credit rule ("
        + ", ".join(CREDIT_RULES)
        + "), over the defaults",
    )
    conversation: bool = Field(
        False,
        description="whether workflow.context=conversation sends each call after the episode's "
        "chat so far",
    )


def _choices(valid) -> str:
    return ", ".join(valid) or "none"


def _field(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line(node: yaml.Node | None, loc: Loc) -> int | None:
    """1-based line of ``loc`` in the composed YAML (the deepest part of it that exists)."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        nxt = None
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            nxt = node.value[part] if part < len(node.value) else None
        if nxt is None:
            break
        node, line = nxt, nxt.start_mark.line + 1
    return line


class _Errors:
    """Raises one-line errors that name the file, the line and the field."""

    def __init__(self, source: str, root: yaml.Node | None) -> None:
        self.source, self.root = source, root

    def __call__(self, loc: Loc, message: str) -> WorkflowFileError:
        line = _line(self.root, loc)
        where = f"{self.source}, line {line}" if line else self.source
        field = f", field '{_field(loc)}'" if loc else ""
        return WorkflowFileError(f"workflow file {where}{field}: {message}")


def _pydantic_message(err: dict, model: type[BaseModel] | None) -> str:
    if err["type"] == "extra_forbidden":
        valid = list(model.model_fields) if model is not None else []
        return f"unknown field; valid: {_choices(valid)}"
    if err["type"] == "missing":
        return "required field missing"
    return err["msg"][0].lower() + err["msg"][1:]


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The model whose field the last part of ``loc`` is (for 'unknown field' choices)."""
    model: type[BaseModel] | None = WorkflowFile
    parts = list(loc[:-1])
    while parts and model is not None:
        part = parts.pop(0)
        if part in ("roles", "params"):
            model = RoleFile if part == "roles" else ParamFile
            if parts:
                parts.pop(0)  # the role or parameter name
        else:  # a stage's unknown field is the file check's to name (StageFile allows extras)
            model = None
    return model


def read_workflow_file(path: str | Path) -> tuple[WorkflowFile, _Errors]:
    """The file parsed and type-checked (not yet checked for meaning: :func:`compile_file`)."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise WorkflowFileError(
            f"workflow file {source}: cannot read it ({err.strerror})"
        ) from None
    except UnicodeDecodeError as err:
        raise WorkflowFileError(
            f"workflow file {source}: byte {err.start} is not UTF-8 text; save it as UTF-8"
        ) from None
    return parse_workflow_text(text, source)


def parse_workflow_text(text: str, source: str) -> tuple[WorkflowFile, _Errors]:
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        line, problem = yaml_problem(err)
        where = f"{source}, line {line}" if line is not None else source
        raise WorkflowFileError(f"workflow file {where}: not valid YAML: {problem}") from None
    errors = _Errors(source, root)
    if not isinstance(data, dict):
        raise errors((), "must be a mapping of name, title, params, roles, stages, answer, credit")
    if (at := not_unicode(data)) is not None:
        raise errors(at, NOT_UNICODE)
    try:
        return WorkflowFile.model_validate(data), errors
    except ValidationError as err:
        # an unknown field before a missing one: a misspelt field is reported as itself
        first = min(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
        loc = tuple(first["loc"])
        raise errors(loc, _pydantic_message(first, _model_at(loc))) from None


def template_fields(text: str) -> set[str]:
    """The names of the ``{field}`` s of a ``str.format`` template."""
    return {
        name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(text) if name
    }


def inline_templates(value: str | Mapping) -> dict[tuple[str, str], str]:
    """A role's prompt as {(style, task): text}; ``*`` stands for every style or task."""
    if isinstance(value, str):
        return {("*", "*"): value}
    out = {}
    for style, by_task in value.items():
        if isinstance(by_task, str):
            out[(style, "*")] = by_task
        else:
            out.update({(style, task): text for task, text in by_task.items()})
    return out


def library_templates(key: str) -> dict[tuple[str, str], str]:
    """The prompt library's templates of ``ROLE/VARIANT``, as {(style, task): text}."""
    role, _, variant = key.partition("/")
    return {
        (style, task): text
        for style, table in TEMPLATES.items()
        for (task, r, v), text in table.items()
        if (r, v) == (role, variant)
    }


def library_keys() -> list[str]:
    return sorted({f"{r}/{v}" for table in TEMPLATES.values() for _, r, v in table})
