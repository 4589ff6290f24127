"""Links from the hand-written pages to the reference: every setting, command and metric a page
names in code (`` `task.family` ``, `` `grpo.group_size=8` ``, `` `marlow plan CONFIG` ``,
`` `train/ROLE/grad_norm` ``) is linked to its own anchor on the generated reference page, at
its first mention on the page; later mentions stay plain text.

    python docs/reference_links.py            link the first unlinked mention of each on every page
    python docs/reference_links.py --check    exit 1 naming each page and what it leaves unlinked

What counts as a mention (inline code outside fenced blocks and headings):

* a **setting**: a dotted key of the config (``section.field``, :func:`marlow.config.describe.
  settings`), alone or as ``key=value``; a top-level field (``steps``, ``seed``, ...) only as
  ``key=value``, since alone those are common words. Anchor: the key itself
  (``reference/settings.md#task.family``).
* a **command**: ``marlow COMMAND ...`` for a command of the CLI (the longest that matches:
  ``marlow task check`` before ``marlow task``). Anchor: its heading on the command-line page
  (``reference/cli.md#marlow-task-check``).
* a **metric**: a key ``train/WHO/NAME`` or ``val/WHO/NAME``, or a bare name with an underscore
  (``grad_norm``, ``chi2_update``), of a metric of :data:`marlow.diagnostics.metrics.METRICS`.
  Anchor: the name (``reference/metrics.md#grad_norm``).

The pages are the tutorials, how-to guides, concepts and the pages at the top of ``docs/``; the
reference pages are the targets, and the benchmark and results pages report measurements.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from marlow.reference import anchor_id

DOCS = Path(__file__).resolve().parent
SKIPPED = ("reference", "benchmarks", "results")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#+ .*$", re.M)
LINKED_CODE = re.compile(r"\[`([^`]+)`\]\(([^)]+)\)")
CODE = re.compile(r"(?<![`\[])`([^`\n]+)`(?![`\]])")


@dataclass(frozen=True)
class Target:
    page: str  # relative to docs/
    anchor: str

    def href(self, from_page: Path) -> str:
        path = os.path.relpath(DOCS / self.page, (DOCS / from_page).parent)
        return f"{Path(path).as_posix()}#{self.anchor}"


def catalogue() -> tuple[set[str], dict[str, str], set[str]]:
    """(setting keys, command -> anchor, metric names), from the code."""
    import typer

    from marlow.cli import app
    from marlow.config.describe import settings
    from marlow.diagnostics.metrics import METRICS

    commands: dict[str, str] = {}

    def walk(command, path: list[str]) -> None:
        commands[" ".join(path)] = "-".join(path)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), ["marlow"])
    del commands["marlow"]
    return {s.key for s in settings()}, commands, {m.name for m in METRICS}


def target_of(code: str, keys: set[str], commands: dict[str, str], metrics: set[str]):
    """The reference target of an inline code's text, or None."""
    words = code.split()
    if words and words[0] == "marlow":
        for n in range(min(len(words), 3), 1, -1):
            if (name := " ".join(words[:n])) in commands:
                return Target("reference/cli.md", commands[name])
        return None
    key, eq, _ = code.partition("=")
    if (eq or "." in key) and key in keys and " " not in key:
        return Target("reference/settings.md", anchor_id(key))
    parts = code.split("/")
    if len(parts) == 3 and parts[0] in ("train", "val") and parts[2] in metrics:
        return Target("reference/metrics.md", anchor_id(parts[2]))
    if "_" in code and code in metrics:
        return Target("reference/metrics.md", anchor_id(code))
    return None


def pages() -> list[Path]:
    return sorted(
        p.relative_to(DOCS)
        for p in DOCS.rglob("*.md")
        if p.relative_to(DOCS).parts[0] not in SKIPPED
    )


def _prose_spans(text: str) -> list[tuple[int, int]]:
    """Where the text is prose: outside fenced blocks and headings."""
    hidden = sorted(
        [m.span() for m in FENCE.finditer(text)] + [m.span() for m in HEADING.finditer(text)]
    )
    spans, at = [], 0
    for start, end in hidden:
        if start > at:
            spans.append((at, start))
        at = max(at, end)
    return [*spans, (at, len(text))]


def unlinked(page: Path, text: str, catalogue_: tuple) -> dict[Target, int]:
    """Each target the page names without ever linking it -> the offset of its first mention."""
    linked: set[Target] = set()
    first: dict[Target, int] = {}
    for start, end in _prose_spans(text):
        prose = text[start:end]
        for m in LINKED_CODE.finditer(prose):  # a link counts where it reaches the anchor
            if (t := target_of(m.group(1), *catalogue_)) is None:
                continue
            if m.group(2) == t.href(page):
                linked.add(t)
            else:  # a mention, linked wrong
                first.setdefault(t, start + m.start())
        for m in CODE.finditer(prose):
            t = target_of(m.group(1), *catalogue_)
            if t is not None and t not in first:
                first[t] = start + m.start()
    return {t: at for t, at in first.items() if t not in linked}


def link(page: Path, text: str, catalogue_: tuple) -> str:
    """The page with the first mention of each unlinked target made a link."""
    for target, at in sorted(unlinked(page, text, catalogue_).items(), key=lambda kv: -kv[1]):
        m = CODE.match(text, at)
        if m is None:  # a link to the wrong anchor: --check names it, to be mended by hand
            continue
        text = f"{text[:at]}[{m.group(0)}]({target.href(page)}){text[m.end() :]}"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    cat = catalogue()
    missing = 0
    for page in pages():
        text = (DOCS / page).read_text()
        if args.check:
            for target, at in unlinked(page, text, cat).items():
                line = text[:at].count("\n") + 1
                print(f"docs/{page}:{line}: names {target.page}#{target.anchor} without a link")
                missing += 1
        elif (new := link(page, text, cat)) != text:
            (DOCS / page).write_text(new)
            print(f"linked docs/{page}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
