"""``--help`` at every level: every argument shows, the key=value overrides included,
each command that takes settings gives three examples, and every example is valid."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from marlow.cli import app, reflowed
from marlow.config import load_config

ROOT = Path(__file__).resolve().parents[2]
COMMAND = typer.main.get_command(app)
SETTINGS = ("train", "eval", "plan", "quickstart")  # commands that take key=value settings


def help_of(*path: str) -> str:
    done = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    return done.output


def commands() -> list[str]:
    return sorted(COMMAND.commands)


def test_the_top_level_help_is_a_users_map_of_the_commands():
    text = help_of()
    for name in commands():
        assert name in text, name
    assert "``" not in text and "rich markup" not in text  # not the developer docstring
    for start in ("marlow quickstart", "marlow train", "marlow grid", "marlow report"):
        assert start in text


@pytest.mark.parametrize("name", commands())
def test_every_argument_and_option_of_a_command_shows_in_its_help(name):
    text = help_of(name)
    command = COMMAND.commands[name]
    for param in command.params:
        if param.param_type_name == "option":
            assert param.opts[0] in text, (name, param.opts)
        else:
            assert (param.name or "") in text, (name, param.name)
    if name in SETTINGS:
        assert "key=value ...]" in text, name  # the brackets survive the console markup


def examples(name: str) -> list[list[str]]:
    epilog = COMMAND.commands[name].epilog or ""
    return [
        shlex.split(line.split("(")[0])
        for line in epilog.splitlines()
        if line.strip().startswith("marlow ")
    ]


@pytest.mark.parametrize("name", [*SETTINGS, "grid", "inspect"])
def test_three_examples_each_valid(name):
    shown = help_of(name)
    found = examples(name)
    assert len(found) == 3, found
    for words in found:
        assert words[:2] == ["marlow", name]
        assert " ".join(words[2:4]) in shown  # the examples are printed
        args = [w for w in words[2:] if not w.startswith("--")]
        flags = {w for w in words[2:] if w.startswith("--")}
        options = {o for p in COMMAND.commands[name].params for o in getattr(p, "opts", [])}
        assert flags <= options, (name, flags - options)
        overrides = [a for a in args if "=" in a]
        files = [a for a in args if "=" not in a and a.endswith((".yaml", ".yml"))]
        for file in files:
            assert (ROOT / file).exists(), file
        if name in ("train", "plan", "quickstart") or (name == "eval" and files):
            load_config(ROOT / files[0] if files else None, overrides)  # a valid config


def _paths() -> list[tuple[str, ...]]:
    """Every command path: the top level, each command, each group's commands."""
    out: list[tuple[str, ...]] = [()]
    for name, command in COMMAND.commands.items():
        out.append((name,))
        for sub in getattr(command, "commands", {}):
            out.append((name, sub))
    return out


def _plain(markup: str) -> str:
    return re.sub(r"\[/?b\]", "", markup).replace("\\[", "[")


@pytest.mark.parametrize("path", _paths(), ids=lambda p: " ".join(p) or "marlow")
def test_help_paragraphs_are_not_broken_mid_sentence_and_fit_80_columns(path):
    """Rich keeps a help text's line breaks; marlow joins each paragraph's lines, so that a wide
    terminal shows a paragraph on one line and a narrow one wraps it at its own width."""
    command = COMMAND
    for part in path:
        command = command.commands[part]
    lines = [line.strip() for line in help_of(*path).splitlines()]  # at 200 columns
    for paragraph in reflowed(command.help or "").split("\n\n"):
        if "\n" in paragraph or len(paragraph) > 190:  # an indented example keeps its breaks
            continue
        assert any(_plain(paragraph) in line for line in lines), paragraph
    done = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert done.exit_code == 0
    assert max(len(line) for line in done.output.splitlines()) <= 80


def test_reflowed_joins_a_paragraphs_lines_and_keeps_indented_ones():
    text = "One line\nand its rest.\n\nExamples:\n    marlow a\n    marlow b"
    assert reflowed(text) == "One line and its rest.\n\nExamples:\n    marlow a\n    marlow b"
