"""The code blocks of README.md and docs/**/*.md read without scrolling sideways, and a shell
block holds commands that paste as they are.

**The width, measured.** In headless Chromium (Debian's ``chromium`` 1280 x 900 window, as
``docs/report_screenshot.py`` drives it) on the built site (``mkdocs build``), a page with the
left navigation and the right table of contents (``how-to/train/``) lays its content column out
at 736 px, a code block's text at 656 px (its padding aside), and the monospace font draws 8.18
px a character (13.6 px text: 0.6 em, Roboto Mono, or DejaVu Sans Mono offline, the same
advance): 656 / 8.18 = 80.2 characters. Filling a block with 79, 80, 81 and 82 characters gave
``scrollWidth`` 688, 688, 695, 703 against a ``clientWidth`` of 688: **80 characters fit, the
81st scrolls**. Every block of the site had the same 656 px (before this test, 38 of its 74
blocks scrolled). So :data:`WIDTH` is 80; GitHub's README column is wider at that window.

Every fenced block counts, whatever its language (commands, YAML, Python, output), the generated
reference pages included: their blocks are the help text of ``src/marlow/cli.py``, so a long
example is fixed there and the pages regenerated (``python -m marlow.docpages docs/reference``).

**Prose in a command** (:func:`prose_in`): a CLI reference example used to read
``marlow eval runs/a      (its latest checkpoint -> ...)``, which fails when pasted. In a shell
block (``bash``, ``sh``, ``shell``, ``console``, and an untagged block whose every command starts
with ``marlow``, as the reference pages write usage and examples) each command, its ``\\``
continuations joined and a ``# comment`` set apart, must

* split as shell words (:func:`shlex.split`: no unbalanced quote, as in "it's");
* hold no unquoted ``(`` or ``)``: in a plain command they are bash syntax errors, and in the
  docs they open prose;
* hold no unquoted arrow (``->``, ``→``): prose, or a redirection that would write a file named
  by the words after it;
* hold no unquoted run of two or more spaces inside it: the gap that sets prose beside a
  command (a comment after the gap starts with ``#`` and is set apart first).

Prose belongs in a ``#`` comment line or in the text around the block.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
WIDTH = 80
"""Characters a code block shows at a 1280 px window without scrolling (module docstring)."""
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
SHELL = ("bash", "sh", "shell", "console")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository's root
    line: int  # of the block's first line (after the opening fence)
    lang: str
    lines: tuple[str, ...]

    def where(self, i: int) -> str:
        return f"{self.page}:{self.line + i}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, with the line its text starts on."""
    out: list[Block] = []
    lines = page.read_text().splitlines()
    rel = page.relative_to(ROOT).as_posix()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, lang = opening.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        out.append(Block(rel, i + 2, lang, tuple(lines[i + 1 : end])))
        i = end + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def test_the_pages_have_code_blocks_to_check():
    assert len(ALL) > 50, len(ALL)
    assert any(b.page == "docs/reference/cli.md" for b in ALL)


def test_no_code_line_is_wider_than_a_code_block_at_1280_px():
    wide = [
        f"{b.where(i)}: {len(line)} > {WIDTH}: {line.strip()[:60]}"
        for b in ALL
        for i, line in enumerate(b.lines)
        if len(line) > WIDTH
    ]
    assert wide == [], "\n".join(wide)


# -- prose in shell commands -------------------------------------------------------------------


def split_comment(line: str) -> tuple[str, str]:
    """``line`` as (code, comment): the comment starts at the first ``#`` outside quotes that
    begins a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i:]
    return line, ""


def unquoted(code: str) -> str:
    """``code`` with every quoted span's text replaced by ``_`` (its quotes kept)."""
    return re.sub(r"'[^']*'|\"(?:\\.|[^\"\\])*\"", lambda m: "_" * len(m.group()), code)


def prose_in(command: str) -> str | None:
    """Why ``command`` (one logical shell line, continuations joined) carries prose, or None."""
    code, _ = split_comment(command)
    code = code.strip()
    if not code:
        return None
    try:
        shlex.split(code)
    except ValueError as err:
        return f"not shell words ({err})"
    bare = unquoted(code)
    if "(" in bare or ")" in bare:
        return "an unquoted parenthesis"
    if "->" in bare or "→" in bare:
        return "an unquoted arrow"
    if "  " in bare:
        return "text set apart by spaces, not a # comment"
    return None


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """A block's commands: lines joined over a trailing ``\\``, each with its first line."""
    out: list[tuple[int, str]] = []
    first, parts = 0, []
    for i, line in enumerate(block.lines):
        if not parts:
            first = i
        code, _ = split_comment(line)
        if code.rstrip().endswith("\\") and not _:
            parts.append(code.rstrip()[:-1].strip())
            continue
        parts.append(line.strip())
        out.append((first, " ".join(parts)))
        parts = []
    if parts:
        out.append((first, " ".join(parts)))
    return out


def first_word(command: str) -> str:
    code = split_comment(command)[0]
    words = [w for w in code.split() if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w)]
    return words[0] if words else ""


def shell_blocks() -> list[Block]:
    """Tagged shell blocks, and untagged ones that are ``marlow`` commands (the reference's)."""
    out = []
    for b in ALL:
        commands = [c for _, c in logical_lines(b) if split_comment(c)[0].strip()]
        if b.lang in SHELL or (
            not b.lang and commands and all(first_word(c) == "marlow" for c in commands)
        ):
            out.append(b)
    return out


def test_a_shell_command_carries_no_prose():
    found = [
        f"{b.where(i)}: {why}: {command}"
        for b in shell_blocks()
        for i, command in logical_lines(b)
        if (why := prose_in(command))
    ]
    assert found == [], "\n".join(found)


def test_the_cli_reference_examples_are_checked_as_shell_commands():
    checked = {(b.page, b.lines) for b in shell_blocks()}
    examples = [b for b in ALL if b.page == "docs/reference/cli.md" and not b.lang]
    assert examples and all((b.page, b.lines) in checked for b in examples)


@pytest.mark.parametrize(
    "command",
    [
        "marlow eval runs/a                      (its latest checkpoint -> runs/a/evals/step-N)",
        "marlow grid configs/grids/tiny-matrix.yaml --dry-run   (the cells and their count)",
        "marlow eval runs/a -> runs/a/evals/step-N",
        "marlow answer RUN it's 12",
        "marlow train steps=4   the short run",
    ],
)
def test_prose_beside_a_command_is_found(command):
    assert prose_in(command)


@pytest.mark.parametrize(
    "command",
    [
        "marlow eval runs/a   # its latest checkpoint -> runs/a/evals/step-N (a comment)",
        'marlow answer RUN "12*7" --temperature 0',
        "marlow train workflow.params='{rounds: 2}' --out runs/d",
        "MARLOW_API_KEY=secret marlow serve runs/a-bundle --host 0.0.0.0",
        "marlow answer RUN 'what is (3 + 4) * 2?  twice'",
        "# a comment line (with prose) -> anything",
    ],
)
def test_a_plain_command_or_comment_passes(command):
    assert prose_in(command) is None
