"""The train/validation split of the synthetic generators (math and code), one rule for both.

A problem belongs to validation when a stable hash of its text (plus the generator's ``salt``)
falls in one of ``buckets`` buckets: a pure function of the text, the same on every machine, run
and seed, so no training stream ever draws a validation problem. Training problems are an endless
stream of draws (repeats allowed); validation problems are a list of distinct draws, the same for
the same (n, seed), where a larger ``n`` extends a smaller one.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from marlow.types import Problem


def text_hash(text: str) -> int:
    """A stable 64-bit hash of ``text`` (blake2b: Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Split:
    """How one generator's draws are split: ``draw(rng)`` is one draw, ``text(draw)`` the text
    the split reads (the statement) and ``make(draw)`` its ``Problem``."""

    name: str  # in errors: "math", "code"
    stream: str  # rng seeds: f"{stream}-train-{seed}" and f"{stream}-val-{seed}"
    draw: Callable[[random.Random], Any]
    text: Callable[[Any], str]
    make: Callable[[Any], Problem]
    buckets: int  # one text in ``buckets`` is a validation problem
    max_val: int  # ``val`` refuses more (the generator's validation pool runs dry past it)
    salt: str = ""  # prefixed to the text before hashing (a second generator, other buckets)

    def is_val(self, text: str) -> bool:
        """Whether a problem text belongs to the validation split (stable across runs and seeds)."""
        return text_hash(self.salt + text) % self.buckets == 0

    def train(self, seed: int = 0) -> Iterator[Problem]:
        """An infinite, seeded stream of training problems (never a validation problem)."""
        rng = random.Random(f"{self.stream}-train-{seed}")
        while True:
            drawn = self.draw(rng)
            if not self.is_val(self.text(drawn)):
                yield self.make(drawn)

    def val(self, n: int, seed: int = 0) -> list[Problem]:
        """``n`` distinct validation problems, the same list for the same (n, seed); a larger
        ``n`` extends a smaller one."""
        if not 0 <= n <= self.max_val:
            raise ValueError(f"{self.name} val_problems n must be in 0..{self.max_val}, got {n}")
        rng = random.Random(f"{self.stream}-val-{seed}")
        out: list[Problem] = []
        seen: set[str] = set()
        while len(out) < n:
            drawn = self.draw(rng)
            text = self.text(drawn)
            if self.is_val(text) and text not in seen:
                seen.add(text)
                out.append(self.make(drawn))
        return out
