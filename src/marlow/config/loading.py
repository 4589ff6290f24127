"""A run config assembled and read: preset (with its overlay for the run's task,
:data:`marlow.config.presets.PRESETS`) -> YAML file -> ``key=value`` overrides (dotted keys,
YAML-parsed values), validated into a :class:`~marlow.config.schema.RunConfig` with one-line
errors that name the field. The resolved config is written beside a run's outputs; that file
alone reproduces the run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from marlow.config.presets import PER_TASK, PRESETS
from marlow.config.schema import (
    BOUNDS,
    BUILTIN_TASKS,
    CODE_DATASETS,
    MATH_DATASETS,
    ConfigError,
    RunConfig,
    TaskConfig,
)


def preset_settings(preset: str, task: str) -> dict[str, Any]:
    """The settings ``preset`` gives a run of ``task``: its own with its overlay for ``task``."""
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError(f"config field 'preset' is {preset!r}; valid: {', '.join(PRESETS)}")
    own = {k: v for k, v in PRESETS[preset].items() if k != PER_TASK}
    return merge(own, PRESETS[preset].get(PER_TASK, {}).get(task, {}))


def flat_fields(config: RunConfig) -> dict[str, Any]:
    """Dotted field name -> value (JSON form) of every field of ``config``."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and not prefix.endswith(("params", "role_map", "role_weights")):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = tuple(value) if isinstance(value, list) else value

    walk("", config.model_dump(mode="json"))
    return out


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, recursively for nested sections (a workflow's params replace)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "params":
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["grpo.clip_high=0.3", "workflow.name=voting"]`` -> nested dict."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. optim.lr=1e-3)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(
                f"override {item!r} has an empty key part; keys are dotted field names "
                "(e.g. optim.lr=1e-3)"
            )
        node = out
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(parts[: depth + 1])} was already set to a "
                    "value, so it has no fields to set; give one of the two"
                )
        node[parts[-1]] = _scalar(raw, key)
    return out


def _scalar(raw: str, key: str = "value") -> Any:
    """YAML value, except that ``1e-3`` is a float (YAML 1.1 would keep it a string)."""
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(
            f"override {key}={raw!r} is not a YAML value ({problem}); quote text, write lists "
            "as [a, b] and mappings as {k: v}"
        ) from None
    if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value):
        return float(value)
    return value


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        section: type[BaseModel] = RunConfig
        for part in first["loc"][:-1]:
            section = section.model_fields[str(part)].annotation  # type: ignore[assignment]
        valid = ", ".join(section.model_fields)
        return f"config field {where!r} is unknown; valid here: {valid}"
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    msg = first["msg"].removeprefix("Value error, ")
    got = (
        "" if first["type"].startswith("value_error") else f", got {repr(first.get('input'))[:80]}"
    )
    valid = _valid_range(first["loc"])
    valid = f"; valid: {valid}" if valid and first["type"] == "finite_number" else ""
    field = f"config field {where!r}: " if first["loc"] else "config: "
    return f"{field}{msg}{got}{valid}{more}".replace("\n", " ")


def _valid_range(loc: tuple) -> str:
    """The bounds declared on the field at ``loc`` (``> 0``, ``>= 0 and < 1``), or ""."""
    model: Any = RunConfig
    info = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not fields or str(part) not in fields:
            break
        info = fields[str(part)]
        model = info.annotation
    bounds = [
        f"{sym} {getattr(m, name)}"
        for m in (info.metadata if info else [])
        for name, sym in BOUNDS.items()
        if getattr(m, name, None) is not None
    ]
    return " and ".join(bounds) or "a finite number"


def _shorthand(data: dict[str, Any]) -> dict[str, Any]:
    """``workflow: NAME`` (``workflow=FILE`` on the command line) is short for ``workflow.name``:
    a built-in name or a workflow file's path, the one field a user sets most."""
    if isinstance(data.get("workflow"), str):
        return {**data, "workflow": {"name": data["workflow"]}}
    return data


def resolve(data: dict[str, Any]) -> RunConfig:
    """Validate a merged dict over its preset (:func:`preset_settings`); raise ConfigError with
    one line naming the field."""
    data = _shorthand(data)
    task = data.get("task")
    if isinstance(task, dict) and task.get("reward") is not None and "name" not in task:
        task = data["task"] = {**task, "name": "custom"}  # a reward of one's own: a custom task
    name = task.get("name") if isinstance(task, dict) else None
    name = name if isinstance(name, str) else TaskConfig.model_fields["name"].default
    installed = _installed_settings(name)
    family = merge(installed.get("task", {}), task if isinstance(task, dict) else {}).get("family")
    # the preset's overlay for the task's family when one is named, else for its name (a
    # custom task gets none: the preset's own settings); then what an installed task brings
    preset = preset_settings(
        data.get("preset", RunConfig.model_fields["preset"].default),
        family if isinstance(family, str) else name,
    )
    try:
        return RunConfig.model_validate(merge(merge(preset, installed), data))
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def _installed_settings(name: str) -> dict[str, Any]:
    """What task ``name`` brings when an installed package publishes it ({} for the built-in
    names); an unknown name is one line listing the valid ones."""
    if name in (*BUILTIN_TASKS, "custom"):
        return {}
    from marlow.config.installed_tasks import TaskEntryError, installed_task, installed_tasks

    try:
        found = installed_task(name)
    except TaskEntryError as err:
        raise ConfigError(f"config field 'task.name': {err}") from None
    if found is None:
        valid = ", ".join((*BUILTIN_TASKS, "custom", *installed_tasks()))
        family = "math" if name in MATH_DATASETS else "code" if name in CODE_DATASETS else None
        dataset = (
            f"; {name} is a dataset: task.dataset={name} task.source=FILE (its .jsonl or "
            f".parquet) or a hub id, under task.name={family}"
            if family
            else ""
        )
        raise ConfigError(
            f"config field 'task.name' is {name!r}; valid: {valid} (marlow tasks){dataset}"
        )
    return found


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    base: RunConfig | None = None,
) -> RunConfig:
    """Preset (named in the file or an override; default tiny) <- file <- overrides. With
    ``base`` (a resumed run's own config) the file and overrides are layered over it instead."""
    data: dict[str, Any] = base.model_dump(mode="json") if base is not None else {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError) as err:
            reason = getattr(err, "strerror", None) or type(err).__name__
            if not str(path).endswith((".yaml", ".yml")):  # e.g. an override without its '='
                reason += "; give a .yaml file, and overrides as key=value"
            raise ConfigError(f"cannot read config {path}: {reason}") from None
        except yaml.YAMLError as err:
            line, problem = yaml_problem(err)
            where = f" at line {line}" if line is not None else ""
            raise ConfigError(f"config {path} is not valid YAML{where}: {problem}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a YAML mapping, got {type(loaded).__name__}")
        data = merge(data, _shorthand(loaded))
    return resolve(merge(data, _shorthand(parse_overrides(overrides or []))))


def yaml_problem(err: yaml.YAMLError) -> tuple[int | None, str]:
    """Where a YAML file's error is (its line, from 1; None where PyYAML gives none) and what it
    is, in one line, for an error message that names the file."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or (str(err).splitlines() or [type(err).__name__])[0]
    return (mark.line + 1 if mark is not None else None), problem


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def differences(old: RunConfig, new: RunConfig) -> list[str]:
    """The dotted fields where two configs differ, as ``"steps: 12 -> 8"``, in field order
    (:func:`flat_fields`' fields: a mapping such as ``workflow.params`` compares whole)."""
    a, b = flat_fields(old), flat_fields(new)
    return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k]]
