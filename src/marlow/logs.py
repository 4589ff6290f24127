"""Log lines. Library code never prints: it hands each line to a ``log`` callable, which the CLI
prints (dimmed, on stderr) and the Python API prints only in part (:class:`Phase` lines) unless
``verbose=True``.

Quiet is not mute: a run from Python that pre-trains a world, trains and evaluates still says
so, one line per long phase, so a minute of silence is never all a user sees.
"""

from __future__ import annotations

from collections.abc import Callable


class Phase(str):
    """A log line that opens (or closes) a long phase: pre-training a tiny world, training,
    evaluating. Shown even when quiet; everything else is detail."""

    __slots__ = ()


def quiet(print_line: Callable[[str], None]) -> Callable[[str], None]:
    """A log callable that passes only :class:`Phase` lines to ``print_line``."""

    def log(message: str) -> None:
        if isinstance(message, Phase):
            print_line(message)

    return log
