"""The box rule: the content of a text's last ``\\boxed{...}``, which the math reward grades and
the role parsers read verdicts and selections from. Standard library only."""

from __future__ import annotations

import re

_BOX_HEAD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_TOKEN = re.compile(r"\\[A-Za-z]+|[^\s${}\\]+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces) or of the last
    unbraced ``\\boxed 5`` (one token); None when there is none."""
    if not isinstance(text, str):
        return None
    heads = [m.end() for m in _BOX_HEAD.finditer(text)]
    # A box whose brace never closes keeps every earlier box that reaches it open as well, so
    # scans stop there: linear time even for "\\boxed{" repeated 100,000 times.
    unclosed_at = len(text)
    for end in reversed(heads):
        i = end
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            content = balanced(text, i, stop=unclosed_at)
            if content is not None:
                return content
            unclosed_at = i
            continue
        if i > end:  # `\boxed 5`: at least one space, then one token
            m = _BARE_TOKEN.match(text, i)
            if m:
                token = m.group().rstrip(".,;:")
                if token:
                    return token
    return None


def balanced(text: str, open_at: int, stop: int | None = None) -> str | None:
    """The text inside the brace group that opens at ``open_at``; None if it does not close
    before ``stop`` (default: the end of the text)."""
    depth = 0
    for i in range(open_at, len(text) if stop is None else stop):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None
