"""Reading the program out of a completion: the extraction rule and the key Voting compares.

Pure text functions (standard library only), so that every layer that reads code from a
completion uses one rule: the code reward (:mod:`marlow.rewards.code`) runs what
:func:`extract_code` returns, the workflows vote with :func:`code_key`, and the tiny code world
(:mod:`marlow.tiny.codecorpus`) writes its aggregator and synthesizer examples with the same key,
without importing the rewards.

Extraction (:data:`BLOCK_RULES`, ``task.code_block``): ``fallback`` (marlow's default) takes the
last fenced block tagged ``python``/``py``/``python3``; else the last fenced block of any language;
else the whole completion if it parses as Python; else nothing. ``last-block`` (the study's
official code) takes the last fenced block of any language, and nothing when there is none (a
completion without a block scores 0).
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import get_args

from marlow.choices import CodeBlockRule

_FENCE = re.compile(r"^[ \t]*```[ \t]*([^\n`]*)\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_PY_TAGS = {"python", "py", "python3", "py3"}


BLOCK_RULES: tuple[str, ...] = get_args(CodeBlockRule)


def extract_code(completion: str, rule: str = "fallback") -> str | None:
    """The code to run from a completion under ``rule`` (see the module docstring), or None."""
    if rule not in BLOCK_RULES:
        raise ValueError(f"unknown code block rule {rule!r}; valid: {', '.join(BLOCK_RULES)}")
    blocks = [(m.group(1).strip().lower(), m.group(2)) for m in _FENCE.finditer(completion)]
    if rule == "last-block":
        return blocks[-1][1] if blocks else None
    py = [body for tag, body in blocks if tag.split()[:1] and tag.split()[0] in _PY_TAGS]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    if completion.strip() and parses_as_python(completion):
        return completion
    return None


def code_key(completion: str) -> str | None:
    """The program of a completion, normalised for comparing answers (Voting's majority vote):
    blank lines dropped, runs of spaces inside a line collapsed, indentation kept; None when
    there is no code."""
    code = extract_code(completion)
    if code is None:
        return None
    lines = []
    for line in code.splitlines():
        if line.strip():
            indent = len(line) - len(line.lstrip())
            lines.append(" " * indent + " ".join(line.split()))
    return "\n".join(lines) or None


def parses_as_python(code: str) -> bool:
    """Whether ``code`` is syntactically valid Python (it is not run). A model's code may draw
    a SyntaxWarning (``1if x``); it is not the user's to see, so it is silenced here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True
