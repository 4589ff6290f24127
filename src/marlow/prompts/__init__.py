"""Prompt sets: the templates each role's call is written from, per (task, role, variant); the
built-in sets are in ``sets/``, and a prompt's token ids through a chat template are
:mod:`marlow.prompts.chat`'s.

A prompt set is a data file (``marlow/prompts/sets/NAME.yaml``; its header says the format), so
that the prompts, which are part of an experiment's protocol, are data a preset names
(``workflow.prompts``) rather than code. Two styles share one code path:

* ``chat``: instructions in plain English for real chat models (Qwen3 and the like), through the
  tokenizer's chat template with thinking disabled. Built-in chat sets: ``marlow`` (the default,
  the ``paper`` preset's) and ``official`` (the study's official code's protocol in marlow's own
  words; the ``official`` preset's). ``workflow.prompts`` may also name a file of one's own; a
  file with ``base: NAME`` takes the templates it does not give from that built-in set.
* ``tiny``: the terse ``tiny`` set for the tiny world. The tiny model is pre-trained on exactly
  these prompts (``marlow.tiny.corpus`` renders its examples through :func:`render`), so a tiny
  model always reads this set whatever ``workflow.prompts`` names, and the tiny world's cache
  key hashes the templates of its task.

This is also the prompt *library*: a workflow file's stage names one of its templates as
``ROLE/VARIANT`` (``generator/revise``), or uses a template of its own
(:mod:`marlow.workflows.schema`). Loaded sets are read-only, so that no workflow, registered or
declared, can change what the tiny world's cache key hashes.

Templates are ``str.format`` strings. Their fields are what the workflow file's stage reads
(``reads: {answer: last.generator}``), the problem and the workflow's parameters: the built-in
files give ``problem``, ``answer`` (the latest generator output), ``critique`` (the latest
evaluator output), ``candidates`` (the generator outputs, numbered ``1) ...``), ``strategy``
(the strategy of this worker slot), ``solutions`` (the worker outputs, numbered), ``n`` (how
many candidates / strategies). A set whose ``context`` is ``conversation`` has templates that
rely on the episode's shared chat (the official evaluator reviews "the solution above"): it runs
only under ``workflow.context=conversation`` (checked by ``marlow.workflows.validate``).
"""

from __future__ import annotations

import functools
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import yaml

from marlow.types import NOT_UNICODE, not_unicode

STYLES = ("chat", "tiny")
SET_DIR = Path(__file__).parent / "sets"
CHAT_SETS = ("marlow", "official")  # the built-in chat sets; ``tiny`` is the tiny style's
DEFAULT_SET = "marlow"
CONTEXTS = ("any", "conversation")
TASKS = ("math", "code", "general")
"""Template families: the built-in tasks' own, and ``general`` (chat sets only) for a task of
one's own whose prompt column says what to do."""


@dataclass(frozen=True)
class PromptSet:
    """One prompt set: its name, style, the context its templates assume, and the templates
    by (task, role, variant)."""

    name: str
    style: str
    context: str
    templates: Mapping[tuple[str, str, str], str]


def prompt_set(name: str | Path = DEFAULT_SET) -> PromptSet:
    """A built-in set by name (``marlow``, ``official``, ``tiny``) or a set file by path; a
    ValueError names what is wrong (one line)."""
    return _load(str(name))


@functools.cache
def _load(name: str) -> PromptSet:
    builtin = SET_DIR / f"{name}.yaml"
    if "/" not in name and "." not in name:
        if not builtin.is_file():
            valid = ", ".join((*CHAT_SETS, "tiny"))
            raise ValueError(f"prompt set {name!r} is unknown; valid: {valid}, or a .yaml file")
        path = builtin
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ValueError(f"prompt set file {name} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"prompt set {path}: not readable YAML ({first})") from None
    if (at := not_unicode(data)) is not None:
        raise ValueError(f"prompt set {path}: {'.'.join(map(str, at))} {NOT_UNICODE}")
    return _parse(data, path)


def _parse(data: object, path: Path) -> PromptSet:
    where = f"prompt set {path}"
    if not isinstance(data, dict):
        raise ValueError(f"{where}: the file must be a mapping with a 'templates' key")
    unknown = sorted(set(data) - {"name", "style", "context", "base", "templates"})
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r}; valid: name, style, context, base, templates"
        )
    style = data.get("style", "chat")
    if style not in STYLES:
        raise ValueError(f"{where}: style {style!r} is unknown; valid: {', '.join(STYLES)}")
    context = data.get("context", "any")
    if context not in CONTEXTS:
        raise ValueError(f"{where}: context {context!r} is unknown; valid: {', '.join(CONTEXTS)}")
    table: dict[tuple[str, str, str], str] = {}
    base = data.get("base")
    if base is not None:
        if base not in CHAT_SETS:
            raise ValueError(f"{where}: base {base!r} is unknown; valid: {', '.join(CHAT_SETS)}")
        table.update(prompt_set(base).templates)
    by_task = data.get("templates")
    if not isinstance(by_task, dict) or not by_task:
        raise ValueError(f"{where}: 'templates' must map a task ({', '.join(TASKS)}) to templates")
    for task, entries in by_task.items():
        if task not in TASKS:
            raise ValueError(f"{where}: task {task!r} is unknown; valid: {', '.join(TASKS)}")
        if not isinstance(entries, dict):
            raise ValueError(f"{where}: templates.{task} must map ROLE/VARIANT to a template")
        for key, text in entries.items():
            role, slash, variant = str(key).partition("/")
            if not (slash and role and variant) or "/" in variant:
                raise ValueError(f"{where}: template key {key!r} is not ROLE/VARIANT")
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{where}: template {task}/{key} must be non-empty text")
            try:
                list(string.Formatter().parse(text))
            except ValueError as err:
                raise ValueError(
                    f"{where}: template {task}/{key} is not a format string ({err})"
                    "; write a literal brace twice"
                ) from None
            table[(task, role, variant)] = text
    name = str(data.get("name", path.stem))
    return PromptSet(name, style, context, MappingProxyType(table))


TEMPLATES: Mapping[str, Mapping[tuple[str, str, str], str]] = MappingProxyType(
    {"chat": prompt_set(DEFAULT_SET).templates, "tiny": prompt_set("tiny").templates}
)
"""The library: the default chat set's templates and the tiny set's, by style."""

GENERIC_STRATEGY = {"chat": "Solve it directly, step by step.", "tiny": "direct"}
"""Filled in for each strategy the orchestrator did not provide (counted as a fallback)."""


def template(style: str, task: str, role: str, variant: str, prompts: str = DEFAULT_SET) -> str:
    """The template for (task, role, variant): from the ``tiny`` set in the tiny style, else from
    the chat set ``prompts``; an error lists what the set has."""
    if style not in STYLES:
        raise ValueError(f"prompt style {style!r} is unknown; valid: {', '.join(STYLES)}")
    chosen = prompt_set("tiny" if style == "tiny" else prompts)
    key = (task, role, variant)
    if key not in chosen.templates:
        known = ", ".join(f"{t}/{r}/{v}" for t, r, v in sorted(chosen.templates))
        raise ValueError(f"prompt set {chosen.name} has no {task}/{role}/{variant}; known: {known}")
    return chosen.templates[key]


def fill(text: str, fields: Mapping[str, object], label: str) -> str:
    """Fill a template; a missing field names the template (``label``) and the field."""
    try:
        return text.format_map(fields)
    except KeyError as err:
        raise ValueError(
            f"prompt {label} needs field {err.args[0]!r}; given: {', '.join(sorted(fields))}"
        ) from None


def render(style: str, task: str, role: str, variant: str, fields: Mapping[str, object]) -> str:
    """Fill the library template (style, task, role, variant)."""
    return fill(template(style, task, role, variant), fields, f"{style}/{task}/{role}/{variant}")


def numbered(texts: list[str], style: str) -> str:
    """Candidates or solutions as a numbered list. The tiny style folds each onto one line."""
    if style == "tiny":
        return "\n".join(f"{i}) {t.strip().replace(chr(10), '; ')}" for i, t in enumerate(texts, 1))
    return "\n\n".join(f"Candidate {i}:\n{t.strip()}" for i, t in enumerate(texts, 1))
