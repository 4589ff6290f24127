"""A workflow file checked for meaning and compiled to a :class:`WorkflowSpec`.

:mod:`marlow.workflows.schema` reads the file's structure; this module checks what it means
(roles, kinds, prompts, reads in order, parsers that fit their kind, the answer, the credit) and
unrolls it with the run's parameters. Every check raises one line naming the file, the line, the
field and the valid choices. Checks are made in file order, so a file with several problems
reports the first.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from marlow.prompts import STYLES
from marlow.workflows.schema import (
    CONDITIONS,
    CREDIT_FOR,
    CREDIT_RULES,
    DEFAULT_CREDIT,
    KINDS,
    PARSERS,
    SOURCES,
    TRAJECTORIES,
    Loc,
    StageFile,
    WorkflowFile,
    WorkflowFileError,
    _choices,
    _Errors,
    _pydantic_message,
    inline_templates,
    library_keys,
    library_templates,
    read_workflow_file,
    template_fields,
)
from marlow.workflows.spec import (
    Read,
    Stage,
    WorkflowSpec,
    is_workflow_file,
    workflow_names,
    workflow_path,
)
from marlow.workflows.stage_kinds import (
    ROLE_FIELDS,
    SHARED_FIELDS,
    StageKind,
    kind_conditions,
    stage_kind,
    stage_kind_names,
)

_NEEDS_PARSER = {kind: parser for parser, kind in PARSERS.items()}


class ParamError(ValueError):
    """A workflow parameter the run sets that the workflow does not take or refuses."""


def _is_name(text: str) -> bool:
    return (
        bool(text)
        and (text[0].isalpha() or text[0] == "_")
        and text.replace("_", "a").replace("-", "a").isalnum()
    )


def _check_roles(wf: WorkflowFile, err: _Errors) -> None:
    if not wf.roles:
        raise err(("roles",), "a workflow needs at least one role")
    for role, spec in wf.roles.items():
        if not _is_name(role):
            raise err(("roles", role), f"role name {role!r} must be a word (letters, digits, _ -)")
        if spec.kind not in KINDS:
            raise err(
                ("roles", role, "kind"), f"unknown kind {spec.kind!r}; valid: {_choices(KINDS)}"
            )
        for variant, value in spec.prompts.items():
            loc = ("roles", role, "prompts", variant)
            if not _is_name(variant):
                raise err(loc, f"prompt name {variant!r} must be a word (a '/' names the library)")
            if isinstance(value, dict):
                for style in value:
                    if style not in STYLES:
                        raise err(
                            (*loc, style), f"unknown style {style!r}; valid: {_choices(STYLES)}"
                        )
    for name, param in wf.params.items():
        if not _is_name(name) or name in ("problem", "rounds_count"):
            raise err(
                ("params", name),
                f"parameter name {name!r} must be a word, not 'problem' or 'rounds_count'",
            )
        if param.default < param.min:
            raise err(("params", name, "default"), f"{param.default} is below min {param.min}")


def _check_credit(wf: WorkflowFile, err: _Errors) -> dict[str, str]:
    credit = dict(DEFAULT_CREDIT)
    for kind, rule in wf.credit.items():
        if kind not in KINDS:
            raise err(("credit", kind), f"unknown kind {kind!r}; valid: {_choices(KINDS)}")
        if rule not in CREDIT_RULES:
            raise err(("credit", kind), f"unknown rule {rule!r}; valid: {_choices(CREDIT_RULES)}")
        if kind not in CREDIT_FOR[rule]:
            raise err(
                ("credit", kind),
                f"rule {rule!r} does not apply to kind {kind}; valid for it: "
                f"{_choices(r for r, kinds in CREDIT_FOR.items() if kind in kinds)}",
            )
        credit[kind] = rule
    return credit


def _count_ok(value: int | str, wf: WorkflowFile, least: int) -> str | None:
    """Why a slots or repeat value is bad (None: fine)."""
    if isinstance(value, str):
        return (
            None
            if value in wf.params
            else (f"unknown parameter {value!r}; valid: a number or {_choices(wf.params)}")
        )
    return None if value >= least else f"must be >= {least}, got {value}"


class _Checker:
    """Walks the stages in file order; ``seen`` holds the roles of the stages before."""

    def __init__(self, wf: WorkflowFile, err: _Errors) -> None:
        self.wf, self.err = wf, err
        self.seen: set[str] = set()  # roles and named stages with a stage before
        self.named: dict[str, tuple[str, Any]] = {}  # a stage kind's stage: name -> (kind, fields)
        self.options: dict[int, tuple[str, Any]] = {}  # id(StageFile) -> (kind, fields)
        self.judged = False
        self.stages: list[tuple[Loc, StageFile]] = []

    def block(self, entries: list[StageFile], loc: Loc, in_repeat: bool) -> None:
        if not entries:
            raise self.err(loc, "needs at least one stage")
        for i, entry in enumerate(entries):
            here = (*loc, i)
            kind = self.kind_of(entry, here)
            if entry.repeat is not None or entry.stages is not None:
                self.repeat(entry, here, in_repeat)
            elif kind is not None:
                self.kind_stage(kind, entry, here, in_repeat)
            else:
                self.stage(entry, here, in_repeat)

    def kind_of(self, entry: StageFile, loc: Loc) -> StageKind | None:
        """The registered kind whose key marks ``entry`` (None: a role's stage or a repeat);
        a field that is no stage's, or a kind's field without its key, is refused."""
        extra = list(entry.model_extra or {})
        keys = [k for k in extra if k in stage_kind_names()]
        if len(keys) > 1:
            raise self.err((*loc, keys[1]), f"a stage has one kind; it names {' and '.join(keys)}")
        if keys:
            return stage_kind(keys[0])
        if not extra:
            return None
        for name in stage_kind_names():
            kind = stage_kind(name)
            if extra[0] in kind.fields.model_fields:
                raise self.err((*loc, name), f"a {name} stage needs {_needs(kind)}")
        valid = [*StageFile.model_fields, *stage_kind_names()]
        raise self.err((*loc, extra[0]), f"unknown field; valid: {_choices(valid)}")

    def kind_stage(self, kind: StageKind, st: StageFile, loc: Loc, in_repeat: bool) -> None:
        """A stage of a registered kind: its own fields valid (its model, then its check), a
        name that is no role's, and the slots, condition and reads any stage has."""
        err = self.err
        valid = _choices([*kind.fields.model_fields, *SHARED_FIELDS])
        extra = sorted(set(ROLE_FIELDS) & st.model_fields_set)
        if extra:
            raise err((*loc, extra[0]), f"a {kind.name} stage takes no {extra[0]}; valid: {valid}")
        try:
            options = kind.fields.model_validate(st.model_extra)
        except ValidationError as problem:
            first = min(problem.errors(), key=lambda e: e["type"] != "extra_forbidden")
            where = (*loc, *first["loc"])
            if first["type"] == "missing":
                raise err(where, f"a {kind.name} stage needs {_needs(kind)}") from None
            if first["type"] == "extra_forbidden":
                raise err(where, f"unknown field; valid: {valid}") from None
            raise err(where, _pydantic_message(first, None)) from None
        name = getattr(options, kind.name)
        if not _is_name(name) or name in self.wf.roles:
            raise err(
                (*loc, kind.name),
                f"{kind.name} name {name!r} must be a word and not a role's name "
                f"({_choices(self.wf.roles)})",
            )
        earlier = self.named.get(name)
        if earlier is not None and earlier[0] != kind.name:
            raise err((*loc, kind.name), f"{name} names a {earlier[0]} stage before this one")
        problem = kind.check(options, earlier[1] if earlier else None)
        if problem is not None:
            raise err((*loc, problem[0]), problem[1])
        self.slots_and_condition(st, loc)
        if st.skip_last and not in_repeat:
            raise err((*loc, "skip_last"), "only a stage inside a repeat block has a last round")
        self.reads(st, loc)
        self.seen.add(name)
        self.named[name] = self.options[id(st)] = (kind.name, options)
        self.stages.append((loc, st))

    def repeat(self, entry: StageFile, loc: Loc, in_repeat: bool) -> None:
        if in_repeat:
            raise self.err(loc, "a repeat block cannot hold another repeat block")
        if entry.repeat is None or entry.stages is None:
            missing = "repeat" if entry.repeat is None else "stages"
            raise self.err((*loc, missing), "a repeat block needs both repeat and stages")
        extra = sorted(set(entry.model_fields_set) - {"repeat", "stages"})
        if extra:
            raise self.err((*loc, extra[0]), "a repeat block holds only repeat and stages")
        problem = _count_ok(entry.repeat, self.wf, 0)
        if problem:
            raise self.err((*loc, "repeat"), problem)
        self.block(entry.stages, (*loc, "stages"), True)

    def stage(self, st: StageFile, loc: Loc, in_repeat: bool) -> None:
        wf, err = self.wf, self.err
        for name in ("role", "prompt"):
            if getattr(st, name) is None:
                raise err((*loc, name), "required field missing")
        if st.role not in wf.roles:
            raise err((*loc, "role"), f"unknown role {st.role!r}; valid: {_choices(wf.roles)}")
        kind = wf.roles[st.role].kind
        templates = self.templates(st, loc)
        self.slots_and_condition(st, loc)
        self.parser(st, kind, loc)
        if st.trajectory not in TRAJECTORIES:
            raise err(
                (*loc, "trajectory"),
                f"unknown trajectory {st.trajectory!r}; valid: {_choices(TRAJECTORIES)}",
            )
        if st.skip_last and not in_repeat:
            raise err((*loc, "skip_last"), "only a stage inside a repeat block has a last round")
        fields = {"problem", *wf.params, *self.reads(st, loc)}
        for (style, task), text in sorted(templates.items()):
            missing = sorted(template_fields(text) - fields)
            if missing:
                raise err(
                    (*loc, "prompt"),
                    f"prompt {st.prompt} ({style}/{task}) uses field {{{missing[0]}}}, which "
                    f"this stage does not read; valid: {_choices(sorted(fields))} "
                    "(add it to reads)",
                )
        self.seen.add(st.role)
        self.judged |= kind == "judge"
        self.stages.append((loc, st))

    def slots_and_condition(self, st: StageFile, loc: Loc) -> None:
        """A stage's (a role's or a stage kind's) slots and ``when``: a known condition, a
        verdict condition after a judge's stage, a kind's condition after a stage of the kind."""
        problem = _count_ok(st.slots, self.wf, 1)
        if problem:
            raise self.err((*loc, "slots"), problem)
        offered = kind_conditions()
        if st.when not in CONDITIONS and st.when not in offered:
            valid = _choices([*CONDITIONS, *offered])
            raise self.err((*loc, "when"), f"unknown condition {st.when!r}; valid: {valid}")
        if st.when.startswith("verdict") and not self.judged:
            raise self.err((*loc, "when"), f"{st.when} needs a judge role's stage before this one")
        kind = offered[st.when][0] if st.when in offered else None
        if kind is not None and all(k != kind for k, _ in self.named.values()):
            raise self.err((*loc, "when"), f"{st.when} needs a {kind} stage before this one")

    def templates(self, st: StageFile, loc: Loc) -> dict[tuple[str, str], str]:
        if any(c in st.prompt for c in "{} \n"):  # a template's text where its name belongs
            raise self.err(
                (*loc, "prompt"),
                f"a stage names its prompt, it does not hold the text ({st.prompt[:40]!r}); "
                f'put the text under roles.{st.role}.prompts (e.g. prompts: {{mine: "..."}}) '
                "and write prompt: mine here, or name a library prompt ROLE/VARIANT",
            )
        if "/" in st.prompt:
            found = library_templates(st.prompt)
            if not found:
                raise self.err(
                    (*loc, "prompt"),
                    f"unknown library prompt {st.prompt!r}; valid: {_choices(library_keys())}, "
                    "or a prompt of the role",
                )
            return found
        own = self.wf.roles[st.role].prompts
        if st.prompt not in own:
            raise self.err(
                (*loc, "prompt"),
                f"role {st.role} has no prompt {st.prompt!r}; valid: {_choices(own)}, "
                "or a library prompt ROLE/VARIANT",
            )
        return inline_templates(own[st.prompt])

    def parser(self, st: StageFile, kind: str, loc: Loc) -> None:
        if st.parser is not None and st.parser not in PARSERS:
            raise self.err(
                (*loc, "parser"), f"unknown parser {st.parser!r}; valid: {_choices(PARSERS)}"
            )
        needed = _NEEDS_PARSER.get(kind)
        if st.parser != needed:
            what = f"parser: {needed}" if needed else "no parser"
            raise self.err((*loc, "parser"), f"a stage of a {kind} role takes {what}")
        if st.parser is not None and st.slots != 1:
            raise self.err((*loc, "slots"), f"a stage with parser {st.parser} has 1 slot")

    def reads(self, st: StageFile, loc: Loc) -> list[str]:
        wf = self.wf
        lists = 0
        for name, source in st.reads.items():
            here = (*loc, "reads", name)
            if not _is_name(name) or name == "problem" or name in wf.params:
                raise self.err(
                    here, f"field name {name!r} must be a word, not problem or a parameter"
                )
            kind, _, role = source.partition(".")
            if kind not in SOURCES or not role:
                valid = ", ".join(f"{s}.ROLE" for s in SOURCES)
                raise self.err(here, f"unknown source {source!r}; valid: {valid}")
            named = self.named.get(role)
            if named is not None and kind not in stage_kind(named[0]).sources:
                valid = ", ".join(f"{s}.{role}" for s in stage_kind(named[0]).sources)
                raise self.err(
                    here, f"{source} reads a {named[0]}, which has no {kind}; valid: {valid}"
                )
            if role not in wf.roles and named is None:
                known = _choices([*wf.roles, *self.named])
                raise self.err(here, f"reads unknown role {role!r}; valid: {known}")
            if role not in self.seen:
                raise self.err(
                    here,
                    f"reads role {role}, which has no stage before this one (a forward read or "
                    f"a cycle); valid: {_choices(sorted(self.seen))}",
                )
            if kind == "plan" and wf.roles[role].kind != "plan":
                raise self.err(here, f"plan.{role} reads a plan, but role {role} is not kind plan")
            lists += kind == "outputs"
        if st.parser == "selection" and lists != 1:
            raise self.err(
                (*loc, "reads"), "a selection stage reads exactly one outputs.ROLE: its candidates"
            )
        return list(st.reads)


def _check_answer(wf: WorkflowFile, err: _Errors, stages: list[tuple[Loc, StageFile]]) -> None:
    if wf.answer == "selected":
        if not any(st.parser == "selection" for _, st in stages):
            raise err(("answer",), "'selected' needs a stage with parser: selection")
        answer_role = None
    elif wf.answer == "latest":
        if not any(spec.kind == "answer" for spec in wf.roles.values()):
            raise err(("answer",), "'latest' needs a role of kind answer")
        answer_role = None
    else:
        kind, _, answer_role = wf.answer.partition(".")
        if kind != "last" or answer_role not in wf.roles:
            valid = ", ".join(["selected", "latest", *(f"last.{r}" for r in wf.roles)])
            raise err(("answer",), f"unknown answer {wf.answer!r}; valid: {valid}")
    for role, spec in wf.roles.items():
        if spec.kind == "final" and role != answer_role:
            raise err(
                ("roles", role, "kind"), f"a final role writes the answer: answer: last.{role}"
            )
        if not any(st.role == role for _, st in stages):
            raise err(("roles", role), f"role {role} has no stage")


def _needs(kind: StageKind) -> str:
    """``both tool and call``: the fields a kind's stage must write."""
    required = [n for n, f in kind.fields.model_fields.items() if f.is_required()]
    if len(required) == 1:
        return required[0]
    return ("both " if len(required) == 2 else "") + " and ".join(
        [", ".join(required[:-1]), required[-1]]
    )


def check_file(wf: WorkflowFile, err: _Errors) -> _Checker:
    """The checker that walked the whole file: every stage with its location (``stages``), and
    the fields of each stage of a registered kind (``options``, ``named``)."""
    _check_roles(wf, err)
    checker = _Checker(wf, err)
    checker.block(wf.stages, ("stages",), False)
    _check_answer(wf, err, checker.stages)
    for loc, st in checker.stages:
        if st.parser == "strategies" and not _plan_reader(checker.stages, st.role):
            raise err((*loc, "parser"), f"no later stage reads plan.{st.role}")
    return checker


def _plan_reader(stages: list[tuple[Loc, StageFile]], role: str) -> StageFile | None:
    return next((st for _, st in stages if f"plan.{role}" in st.reads.values()), None)


def _values(wf: WorkflowFile, name: str, given: Mapping[str, Any]) -> dict[str, int]:
    unknown = sorted(set(given) - set(wf.params))
    if unknown:
        raise ParamError(
            f"workflow {name} has no parameter {', '.join(unknown)}; valid: {_choices(wf.params)}"
        )
    values = {}
    for key, param in wf.params.items():
        value = given.get(key, param.default)
        if not isinstance(value, int):
            raise ParamError(f"{name} {key} must be an integer >= {param.min}, got {value!r}")
        if value < param.min:
            raise ParamError(f"{name} {key} must be >= {param.min}, got {value}")
        values[key] = value
    return values


ROUNDS_COUNTS = ("revisions", "judge-calls")
"""What a ``repeat`` count counts (``workflow.rounds_count``): ``revisions`` (marlow) runs the
block R times and leaves its ``skip_last`` stages out of the last round (Eval-Opt with rounds 3:
G E G E G E G); ``judge-calls`` (the study's official code, whose ``max_iterations`` counts
evaluator calls) runs it R - 1 times, its judge stage before the block making the first call,
and keeps every stage in the last round, so the judge reviews the last revision too and is
trained on that turn (rounds 3: G E G E G E)."""


def compile_workflow(
    wf: WorkflowFile,
    err: _Errors,
    name: str,
    params: Mapping[str, Any],
    rounds_count: str = "revisions",
) -> WorkflowSpec:
    """The spec of a parsed file with the run's parameters (defaults where it sets none) and
    ``rounds_count`` (:data:`ROUNDS_COUNTS`)."""
    if rounds_count not in ROUNDS_COUNTS:
        raise ValueError(
            f"unknown rounds count {rounds_count!r}; valid: {', '.join(ROUNDS_COUNTS)}"
        )
    checker = check_file(wf, err)
    located = checker.stages
    credit = _check_credit(wf, err)
    values = _values(wf, name, params)

    def count(value: int | str) -> int:
        return values[value] if isinstance(value, str) else value

    kinds = {role: spec.kind for role, spec in wf.roles.items()}

    def compiled(st: StageFile, rnd: int) -> Stage:
        slots = count(st.slots)
        reads = tuple(Read(f, *src.split(".", 1)) for f, src in st.reads.items())
        if id(st) in checker.options:  # a stage kind's stage
            kind, options = checker.options[id(st)]
            label = getattr(options, kind)
            if slots < 1:
                raise ParamError(f"workflow {name}: parameter {st.slots} gives {label} zero slots")
            return Stage(label, kind, "", slots, rnd, st.when, reads=reads, options=options)
        if slots < 1:
            raise ParamError(
                f"workflow {name}: parameter {st.slots} = {slots} gives {st.role} zero slots"
            )
        reader = _plan_reader(located, st.role) if st.parser == "strategies" else None
        return Stage(
            role=st.role,
            kind=kinds[st.role],
            prompt=st.prompt,
            slots=slots,
            round=rnd,
            when=st.when,
            parser=st.parser,
            trajectory=st.trajectory,
            reads=reads,
            count=count(reader.slots) if reader is not None else 0,
        )

    stages: list[Stage] = []
    for entry in wf.stages:
        if entry.stages is None:
            stages.append(compiled(entry, 0))
            continue
        last = count(entry.repeat)
        skip = rounds_count == "revisions"
        if not skip:
            last = max(0, last - 1)
        for rnd in range(1, last + 1):
            stages += [
                compiled(st, rnd)
                for st in entry.stages
                if not (skip and st.skip_last and rnd == last)
            ]
    order = [st.role for _, st in located if id(st) not in checker.options]
    return WorkflowSpec(
        name=name,
        title=wf.title or name,
        stages=tuple(stages),
        kinds={role: kinds[role] for role in dict.fromkeys(order)},
        answer=wf.answer,
        credit=credit,
        params=values,
        prompts={
            (role, variant): inline_templates(value)
            for role, spec in wf.roles.items()
            for variant, value in spec.prompts.items()
        },
        rounds=any(entry.stages is not None for entry in wf.stages),
        conversation=wf.conversation,
        source=err.source,
        named_stages=checker.named,
    )


def load_workflow(
    path: str | Path,
    params: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    rounds_count: str = "revisions",
) -> WorkflowSpec:
    """The workflow file at ``path`` compiled with ``params``; its name is ``name``, else the
    file's ``name:``, else the file's stem."""
    wf, err = read_workflow_file(path)
    label = name or wf.name or Path(path).stem
    return compile_workflow(wf, err, label, params or {}, rounds_count)


def build_workflow(
    name: str, rounds_count: str = "revisions", *, copy: Path | None = None, **params: Any
) -> WorkflowSpec:
    """The spec of workflow ``name`` (a registered name or a file path), with its count
    parameters (e.g. ``rounds=2``) and what its repeat counts count (:data:`ROUNDS_COUNTS`).
    ``copy``: for a file ``name``, read the file's text from there instead (a run folder's own
    ``workflow.yaml``), named as ``name`` itself would be (its ``name:``, else its stem), so that
    a run reads the same wherever its typed path now points. Raises WorkflowFileError for the
    file, ParamError for a parameter, ValueError for an unknown name."""
    if is_workflow_file(name) and name not in workflow_names():
        wf, err = read_workflow_file(copy if copy is not None else name)
        return compile_workflow(wf, err, wf.name or Path(name).stem, params, rounds_count)
    return load_workflow(workflow_path(name), params, name=name, rounds_count=rounds_count)


def workflow_title(name: str) -> str:
    """The ``title:`` of workflow ``name`` (a registered name or a file path); a name that no
    longer loads (a results folder read where its file is absent) is titled by itself, a file by
    its stem."""
    try:
        return build_workflow(name).title
    except ValueError:
        return Path(name).stem if is_workflow_file(name) else name


__all__ = ["ParamError", "WorkflowFileError", "build_workflow", "load_workflow", "workflow_title"]
