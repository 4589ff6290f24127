"""``marlow pretrain-tiny --verify``: is a shipped world what this code makes on this machine?

It rebuilds the shipped world of a recipe (:mod:`marlow.tiny.shipped`) from scratch in a fresh
temporary cache (never the user's, so that no stale cached world can pass the check), measures
the greedy generator of both worlds here on the same :data:`VERIFY_PROBLEMS` validation problems
(:func:`marlow.worlds.tinyeval.greedy_report`), and passes when the two accuracies differ by
at most :data:`TOLERANCE`.

Why accuracy and not bytes: pre-training is deterministic for one kernel set and thread count
(two builds give the same bytes), but torch's AVX-512 and AVX2 kernels sum float32 in different
orders, so a world rebuilt on another CPU is another set of weights (the weights after 20 steps
agree to 1e-4; after thousands of steps the models differ). Whether the bytes are equal is
reported too: on the kernel set the world was shipped from they should be.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from marlow.fileio import sha256_file
from marlow.tiny import shipped
from marlow.tiny.pretrain import pretrain_tiny
from marlow.worlds.tinyeval import greedy_report

VERIFY_PROBLEMS = 500
"""Validation problems both worlds are measured on (the quickstart validates on 500)."""
TOLERANCE = 0.05
"""Largest accuracy gap that passes. Measured (2026-11-25, AMD EPYC, 500 problems): the quick
world built on the CPU's own AVX-512 kernels (shipped) 0.522, built with torch and oneDNN held to
AVX2 0.536, each the same on both kernel sets; a gap of 0.014. The two disagree on 10.6 % of the
problems, so two equally good worlds differ by sqrt(0.106 / 500) = 0.015 (one standard error);
0.05 is 3.4 of those, where a wrong recipe moved the accuracy by 7 points or more
(docs/benchmarks/worlds.md).
Measured again on 2026-11-26 on an Intel Xeon: rebuilt on its own AVX-512 kernels 0.524 (other
bytes than the AMD-built world: MKL takes another path), and with MKL held to AVX2 as well
(:data:`marlow.tiny.pretrain.AVX2_ONLY`) 0.478, a gap of 0.044: inside the tolerance, with less
room than the first measurement showed."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check: accuracies are fractions of :attr:`n_problems`."""

    world: str  # the shipped world's recipe, in words
    shipped_accuracy: float  # its greedy accuracy measured here
    rebuilt_accuracy: float  # the rebuilt world's, measured here
    n_problems: int
    same_weights: bool  # the rebuilt weights have the shipped bytes
    cpu_capability: str  # torch's kernel set here (the shipped one's is in built_on)
    built_on: str  # where the shipped world was built
    rebuild_s: float  # seconds of the rebuild
    tolerance: float = TOLERANCE

    @property
    def gap(self) -> float:
        return abs(self.rebuilt_accuracy - self.shipped_accuracy)

    @property
    def passed(self) -> bool:
        return self.gap <= self.tolerance + 1e-12

    def to_dict(self) -> dict:
        return {**asdict(self), "gap": self.gap, "passed": self.passed}


def verify_world(
    scale: str = "tiny-s",
    *,
    steps: int | None = None,
    batch: int | None = None,
    task: str = "math",
    n_problems: int = VERIFY_PROBLEMS,
    log: Callable[[str], None] | None = None,
) -> Verdict:
    """Rebuild the shipped ``scale``/``task`` world of this recipe (defaults as
    :func:`~marlow.tiny.pretrain.tiny_path`'s) and compare it with the shipped one. A recipe marlow
    does not ship is a ValueError naming the shipped ones; a damaged shipped file a
    DamagedFileError."""
    log = log or (lambda _msg: None)
    found = shipped.find_shipped(scale, steps=steps, batch=batch, task=task)
    if found is None:
        raise ValueError(
            f"marlow ships no {scale} {task} world of this recipe (steps {steps}, batch {batch}); "
            f"shipped: {shipped.listing()}"
        )
    folder = shipped.checked(found)
    with tempfile.TemporaryDirectory(prefix="marlow-verify-") as tmp:
        t0 = time.perf_counter()
        rebuilt = pretrain_tiny(
            scale, steps=found.steps, batch=found.batch, task=task, cache_dir=tmp, log=log
        )
        seconds = time.perf_counter() - t0
        log(f"measuring both worlds' greedy generator on {n_problems} validation problems")
        ours = greedy_report(rebuilt, task, n_problems)["accuracy"]
        theirs = greedy_report(folder, task, n_problems)["accuracy"]
        same = all(sha256_file(Path(rebuilt) / n) == h for n, h in found.weights.items())
    return Verdict(
        world=found.describe(),
        shipped_accuracy=theirs,
        rebuilt_accuracy=ours,
        n_problems=n_problems,
        same_weights=same,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        built_on=found.built_on,
        rebuild_s=seconds,
    )
