"""Every setting of a run config, described from the schema itself: its dotted key, type, default,
valid values and description, and each section's purpose (its model's docstring).
``marlow settings [SECTION]`` prints them, and the settings reference page
(:mod:`marlow.docpages`) is written from the same rows, so neither can drift from what a run
accepts."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from marlow.config.schema import BOUNDS, RunConfig

TOP = "top"
"""The name of the section of the top-level fields (``steps``, ``seed``, ...)."""


@dataclass(frozen=True)
class Setting:
    """One field of the config, as a user types it (``section.field=value``)."""

    key: str
    type: str
    default: str
    valid: str  # the choices, or the bounds ("" where any value of the type is taken)
    description: str

    @property
    def section(self) -> str:
        """The section the key sits in (:data:`TOP` for a top-level field)."""
        return self.key.rpartition(".")[0] or TOP


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, str):  # a forward reference (a model that holds itself)
        return annotation
    if get_origin(annotation) is Literal:
        return "choice"
    if get_origin(annotation) in (Union, types.UnionType):
        parts = [_type_name(a) for a in get_args(annotation) if a is not type(None)]
        optional = type(None) in get_args(annotation)
        return " or ".join(parts) + (" or null" if optional else "")
    origin = get_origin(annotation)
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(annotation))
        return f"{origin.__name__}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _choices(annotation: Any) -> tuple[str, ...]:
    """The values a Literal (possibly optional) admits."""
    if get_origin(annotation) is Literal:
        return tuple(str(a) for a in get_args(annotation))
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(c for a in get_args(annotation) for c in _choices(a))
    if get_origin(annotation) is list:  # a list of choices: each item one of them
        return _choices(get_args(annotation)[0])
    return ()


def _valid(info: FieldInfo) -> str:
    choices = _choices(info.annotation)
    if choices:
        return ", ".join(choices)
    bounds = [
        f"{symbol} {getattr(m, name)}"
        for m in info.metadata
        for name, symbol in BOUNDS.items()
        if getattr(m, name, None) is not None
    ]
    return " and ".join(bounds)


def _default(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "null"
    if value == "":
        return '""'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, BaseModel):  # a section of its own: its fields' defaults
        return ", ".join(f"{k}={_default(f)}" for k, f in type(value).model_fields.items())
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def fields_of(model: type[BaseModel], prefix: str = "", recurse: bool = True) -> list[Setting]:
    """The fields of any pydantic ``model`` as rows, in declaration order; with ``recurse`` a
    field that is itself a model gives its own fields (``prefix`` + ``name.`` + field) instead
    of a row. A required field's default is ``""``."""
    rows: list[Setting] = []
    for name, info in model.model_fields.items():
        if recurse and _is_section(info.annotation):
            rows += fields_of(info.annotation, f"{prefix}{name}.")
            continue
        rows.append(
            Setting(
                key=f"{prefix}{name}",
                type=_type_name(info.annotation),
                default="" if info.is_required() else _default(info),
                valid=_valid(info),
                description=info.description or "",
            )
        )
    return rows


def settings(section: str | None = None) -> list[Setting]:
    """Every setting of a run config, in the schema's order; with ``section`` (``grpo``,
    ``rollout.vllm``, or :data:`TOP` for the top-level fields) only that section's own. An
    unknown section is a ValueError naming the valid ones."""
    rows = fields_of(RunConfig)
    if section is None:
        return rows
    names = sections()
    if section not in names:
        raise ValueError(f"no settings section {section!r}; valid: {', '.join(names)}")
    return [r for r in rows if r.section == section]


def sections() -> list[str]:
    """The sections in the schema's order, the top level (:data:`TOP`) first."""
    seen = dict.fromkeys([TOP])
    for row in settings():
        seen.setdefault(row.section)
    return list(seen)


def summary(section: str) -> str:
    """What ``section`` is for: the first paragraph of its model's docstring, on one line (the
    top level's is :class:`RunConfig`'s). An unknown section is a ValueError as in
    :func:`settings`."""
    settings(section)  # refuses an unknown section
    model: type[BaseModel] = RunConfig
    for name in [] if section == TOP else section.split("."):
        model = model.model_fields[name].annotation
    return " ".join((model.__doc__ or "").split("\n\n")[0].split())
