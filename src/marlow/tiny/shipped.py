"""The tiny worlds marlow ships as package data, so that a run of their recipe pre-trains nothing.

A shipped world is a folder ``marlow/tiny/worlds/<tag>-<key>/`` exactly as
:func:`marlow.tiny.pretrain.pretrain_tiny` wrote it (weights, tokenizer, ``meta.json``) on the
machine that built it, and one entry of ``marlow/tiny/worlds/worlds.json``: its recipe (scale,
task, steps, examples per step, seed, threads), its folder name, the sha256 of its weights, and
its greedy validation accuracy when it was built. The folder's name is the cache folder's name
of the same recipe (:func:`marlow.tiny.pretrain.tiny_path`), so the recipe key picks the shipped
world: a recipe whose key moved (a corpus, template or tokenizer change) finds no shipped world
until the worlds are rebuilt and shipped again (a unit test says so first).

A shipped world and a world rebuilt from the same recipe never shadow each other: the shipped
one lives in the package and is only read, the rebuilt one in the cache
(:func:`~marlow.tiny.pretrain.default_cache_dir`), and a run picks one by ``model.world``
(:data:`WORLDS`; the picking is :func:`marlow.models.tiny_world`). They may differ in the last
bits: float32 sums differ between kernel sets (AVX-512 against AVX2), so a world rebuilt on
another CPU is another set of weights of about the same accuracy (``marlow pretrain-tiny
--verify`` measures both: :mod:`marlow.worlds.verify`).

This module reads files only; it never trains and never measures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import get_args

from marlow.choices import World
from marlow.fileio import DamagedFileError, sha256_file
from marlow.tiny.pretrain import tiny_path

ROOT = Path(__file__).resolve().parent / "worlds"
MANIFEST = "worlds.json"
WORLDS: tuple[str, ...] = get_args(World)
"""The values of ``model.world``: ``auto`` the shipped world of the recipe when marlow ships one,
else pre-trained into the cache; ``shipped`` a shipped world or an error; ``rebuild`` pre-trained
on this machine into the cache (or found there), never the shipped one."""


@dataclass(frozen=True)
class ShippedWorld:
    """One entry of ``worlds.json``: a recipe and the folder that holds its weights."""

    folder: str  # "<tag>-<key>", the cache folder name of the recipe (tag: scale, or scale-task)
    scale: str
    task: str
    steps: int  # optimizer steps of pre-training
    batch: int  # examples per step
    seed: int
    threads: int  # torch threads it was built with (the recipe's, pretrain.THREADS)
    weights: dict[str, str]  # weights file name -> sha256
    greedy_accuracy: float  # greedy generator, marlow.worlds.tinyeval.greedy_report, at build
    n_val: int  # validation problems of that accuracy
    built_on: str  # the torch CPU capability (kernel set) and packages it was built with

    def describe(self) -> str:
        return f"{self.scale} {self.task} ({self.steps} steps x {self.batch})"


def shipped_worlds(root: Path | None = None) -> tuple[ShippedWorld, ...]:
    """Every world of ``root/worlds.json`` (default :data:`ROOT`; none when the file is absent)."""
    return _read(Path(ROOT if root is None else root) / MANIFEST)


@cache
def _read(path: Path) -> tuple[ShippedWorld, ...]:
    if not path.is_file():
        return ()
    try:
        rows = json.loads(path.read_text())["worlds"]
        return tuple(ShippedWorld(**row) for row in rows)
    except (ValueError, KeyError, TypeError) as err:
        raise DamagedFileError(f"{path}: not a shipped-worlds manifest ({err})") from None


def find_shipped(
    scale: str,
    *,
    steps: int | None = None,
    batch: int | None = None,
    task: str = "math",
    root: Path | None = None,
) -> ShippedWorld | None:
    """The shipped world of this recipe (defaults as :func:`~marlow.tiny.pretrain.tiny_path`'s),
    or None. Matched by the recipe's cache folder name, which holds its key."""
    name = tiny_path(scale, steps=steps, batch=batch, task=task, cache_dir=ROOT).name
    return next((w for w in shipped_worlds(root) if w.folder == name), None)


def checked(world: ShippedWorld, root: Path | None = None) -> Path:
    """The folder of ``world`` once every weights file's sha256 is the manifest's; a missing or
    damaged file is a one-line :class:`DamagedFileError` (never a silent load)."""
    folder = Path(ROOT if root is None else root) / world.folder
    for name, want in world.weights.items():
        file = folder / name
        if not file.is_file():
            raise DamagedFileError(
                f"shipped world {world.describe()}: {file} is missing; reinstall marlow, or set "
                "model.world=rebuild to pre-train it on this machine"
            )
        got = sha256_file(file)
        if got != want:
            raise DamagedFileError(
                f"shipped world {world.describe()}: {file} is damaged (sha256 {got[:12]}..., "
                f"shipped {want[:12]}...); reinstall marlow, or set model.world=rebuild to "
                "pre-train it on this machine"
            )
    return folder


def listing(root: Path | None = None) -> str:
    """The shipped recipes, for error messages."""
    return ", ".join(w.describe() for w in shipped_worlds(root)) or "none"
