"""Checkpoints: adapters (standard PEFT folders), optimizers, schedule clock, RNG states, cursor.

Layout: ``RUN/checkpoints/step_NNNNNN/{adapters/<name>/, trainer_state.pt, DONE}``. The data
cursor is the step: batches are a pure function of (seed, step), see ``marlow.training.trainer``.
Each adapter folder names its base as the run recorded it (``RUN/base.json``,
:mod:`marlow.training.runbase`): a hub id, a local folder's absolute path, or a tiny world's
``base`` (``RUN/base/``, relative to the run folder); ``marlow export`` (:mod:`marlow.training.export`) makes a standalone copy.

Writing one (:func:`save`) is a commit in four durable steps, so that a kill or a power loss at
any instant leaves either the whole new checkpoint or none of it, and every older one whole:

1. every adapter weight and optimizer moment is checked finite; a non-finite one is refused
   (:class:`CheckpointError`) and nothing is written;
2. the files go into ``step_NNNNNN.tmp/``; ``DONE`` last, holding a manifest (bytes and sha256
   of every other file);
3. every file, then every folder of the temporary tree, is fsynced (:func:`_fsync_tree`);
4. the folder is renamed to ``step_NNNNNN`` and ``checkpoints/`` is fsynced, which makes the
   rename itself durable (:func:`_fsync_dir`).

A checkpoint is a ``step_NNNNNN`` folder holding ``DONE``; a leftover ``.tmp`` (or a checkpoint
whose removal was cut short) never counts and is cleared by :func:`tidy`. :func:`verify` re-reads a checkpoint against its manifest; :func:`load`
names the damaged file when reading fails or a value is not finite. Checkpoints written before
manifests existed (``DONE`` holds just the step) are checked by loading them only.

Devices: the trainer state is read onto the host and each optimizer moment then goes to its
parameter's device, so a checkpoint resumes on another device. The RNG states saved are Python's,
NumPy's and torch's CPU generator; an accelerator's global generator is not (the rollout and the
mini-batch order use their own seeded generators, so on an accelerator only LoRA dropout > 0
draws from it: such a run is reseeded, not continued, on resume; the paper's dropout is 0).

Retention (:func:`prune`): a run keeps its last ``train.keep_checkpoints`` (default 2) plus the
steps the trainer protects (its best validation, which ``detect.on_alarm=rollback`` restores), so
a damaged latest checkpoint always has a good one before it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from marlow.fileio import no_space, sha256_file
from marlow.policy.adapters import (
    WEIGHTS_NAME,
    adapter_parameters,
    load_adapter_weights,
    save_adapters,
)
from marlow.training import runbase
from marlow.training.optim import AdapterOptimizers

PREFIX = "step_"
STATE = "trainer_state.pt"
DONE = "DONE"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written (non-finite values) or read (damaged), in one line
    naming the file."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{PREFIX}{step:06d}"


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


# -- writing ------------------------------------------------------------------------------------


def save(run_dir: Path, step: int, model, adapters: list[str], optim: AdapterOptimizers) -> Path:
    """Write the checkpoint of ``step`` durably (module docstring); returns its folder. A Ctrl-C
    or SIGTERM that arrives meanwhile waits until the checkpoint is committed (renamed into
    place), so an interrupted run keeps every save it began: never half a checkpoint, never a
    finished one left behind as ``.tmp``."""
    bad = nonfinite(model, adapters, optim)
    if bad:
        raise CheckpointError(
            f"refusing to write the checkpoint of step {step}: {bad[0]} is not finite"
            f"{f' (and {len(bad) - 1} more tensors)' if len(bad) > 1 else ''}"
        )
    with _signals_held():
        return _write(run_dir, step, model, adapters, optim)


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back until the block ends, then delivered to the handlers they
    had. Held by Python handlers, not the thread's signal mask: any thread (torch's, gloo's) may
    receive a signal, but Python runs its handler in the main thread alone. Off the main thread
    no Python handler runs, so there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in dict.fromkeys(caught):  # each once, in the order they came
            signal.raise_signal(s)


def _write(run_dir: Path, step: int, model, adapters: list[str], optim: AdapterOptimizers) -> Path:
    """The checkpoint written to a ``.tmp`` sibling, then renamed into place. A device that
    fills up meanwhile is :class:`marlow.fileio.NoSpace`, the ``.tmp`` removed again (its
    space freed; the checkpoints before it stand)."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    try:
        return _write_into(tmp, final, run_dir, step, model, adapters, optim)
    except Exception as err:
        full = no_space(err, run_dir)
        if full is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise full from None


def _write_into(
    tmp: Path, final: Path, run_dir: Path, step: int, model, adapters: list[str], optim
) -> Path:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if adapters:
        save_adapters(model, tmp / "adapters", adapters, base_name=runbase.adapter_base(run_dir))
    state = {
        "step": step,
        "data_cursor": step,
        "optim": optim.state_dict(),
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        },
    }
    torch.save(state, tmp / STATE)
    files = {rel: _describe(tmp / rel) for rel in _files(tmp)}
    (tmp / DONE).write_text(json.dumps({"step": step, "files": files}, indent=1) + "\n")
    _fsync_tree(tmp)
    tmp.rename(final)
    _fsync_dir(final.parent)
    return final


def _files(root: Path) -> list[str]:
    """Every file under ``root`` as a sorted relative path, ``DONE`` excluded."""
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != DONE
    )


def _describe(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder, deepest first, ``root`` last."""
    paths = sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True)
    for path in paths:
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in [*(p for p in paths if p.is_dir()), root]:
        _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    """fsync a folder: makes the creation, removal and renaming of its entries durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def nonfinite(model, adapters: Iterable[str], optim: AdapterOptimizers) -> list[str]:
    """The names of every adapter weight and optimizer-state tensor holding a NaN or inf."""
    bad = []
    for name in adapters:
        for path, p in adapter_parameters(model, name).items():
            if not bool(torch.isfinite(p).all()):
                bad.append(f"adapter {name!r} weight {path}")
        for i, state in enumerate(optim.optimizers[name].state.values()):
            for key, value in state.items():
                if torch.is_tensor(value) and not bool(torch.isfinite(value).all()):
                    bad.append(f"adapter {name!r} optimizer {key} of parameter {i}")
    return bad


def tidy(run_dir: Path) -> None:
    """Remove what a kill left in ``checkpoints/``: ``.tmp`` folders and checkpoints whose removal
    was cut short (no ``DONE``). Only called when no save is under way."""
    root = run_dir / "checkpoints"
    if root.is_dir():
        for path in root.iterdir():
            if path.is_dir() and not (path / DONE).exists():
                shutil.rmtree(path)


def prune(run_dir: Path, keep: int, protect: Iterable[int] = ()) -> list[Path]:
    """Remove all but the last ``keep`` checkpoints and the ``protect``ed steps, and what
    :func:`tidy` removes; returns the removed checkpoints. Called after a save, so the newest
    checkpoint is one of those kept."""
    tidy(run_dir)
    done = all_done(run_dir)
    kept = {step_of(p) for p in done[-keep:]} | set(protect)
    gone = [p for p in done if step_of(p) not in kept]
    for path in gone:
        remove(path)
    return gone


def remove(path: Path) -> None:
    """Delete a checkpoint: ``DONE`` first (durably), so a kill mid-way leaves no half checkpoint
    that still counts."""
    (path / DONE).unlink(missing_ok=True)
    _fsync_dir(path)
    shutil.rmtree(path)


# -- finding and reading ------------------------------------------------------------------------


def all_done(run_dir: Path) -> list[Path]:
    """Every complete checkpoint of a run, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    done = [
        p
        for p in root.iterdir()
        if p.name.startswith(PREFIX) and not p.name.endswith(".tmp") and (p / DONE).exists()
    ]
    return sorted(done, key=step_of)


def latest(run_dir: Path) -> Path | None:
    done = all_done(run_dir)
    return done[-1] if done else None


def verify(path: Path) -> str | None:
    """None when every file of the checkpoint matches its manifest, else what is wrong, naming
    the file. A checkpoint without a manifest (written by an older marlow) passes here."""
    try:
        manifest = json.loads((path / DONE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return f"{DONE} is unreadable"
    if not isinstance(manifest, dict):
        return None
    for rel, want in manifest.get("files", {}).items():
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        size = file.stat().st_size
        if size != want["bytes"]:
            return f"{rel} is {size} bytes, {want['bytes']} were written"
        if _describe(file)["sha256"] != want["sha256"]:
            return f"{rel} differs from what was written (sha256)"
    return None


def check(path: Path) -> None:
    """Read every file of a checkpoint without a model: the manifest, each adapter's tensors
    (finite), the trainer state (readable, optimizer moments finite). Raises
    :class:`CheckpointError` naming the damaged file, so a resume can refuse before it loads a
    model."""
    damage = verify(path)
    for file in sorted((path / "adapters").glob(f"*/{WEIGHTS_NAME}")) if damage is None else []:
        rel = file.relative_to(path)
        try:
            tensors = load_file(file)
        except Exception as err:  # a truncated or garbled safetensors file
            damage = f"{rel}: {_first_line(err)}"
            break
        bad = [k for k, t in tensors.items() if not bool(torch.isfinite(t).all())]
        if bad:
            damage = f"{rel}: {bad[0]} is not finite"
            break
    if damage is None:
        try:
            state = torch.load(path / STATE, map_location="cpu", weights_only=False)
            moments = [
                v
                for opt in state["optim"]["optimizers"].values()
                for per_param in opt["state"].values()
                for v in per_param.values()
                if torch.is_tensor(v)
            ]
        except Exception as err:  # truncated pickle, zip or tensor data; missing keys
            damage = f"{STATE}: {_first_line(err)}"
        else:
            if not all(bool(torch.isfinite(v).all()) for v in moments):
                damage = f"{STATE}: an optimizer moment is not finite"
    if damage is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {damage}")


def load(path: Path, model, adapters: list[str], optim: AdapterOptimizers) -> int:
    """:func:`check` the checkpoint, then restore it into a freshly built trainer; returns its
    step. Raises :class:`CheckpointError` naming the file."""
    check(path)
    for name in adapters:
        try:
            load_adapter_weights(model, path / "adapters", [name])
        except (OSError, ValueError) as err:  # missing folder, other shapes or tensor names
            raise CheckpointError(
                f"checkpoint {path} does not fit this run: adapters/{name}: {_first_line(err)}"
            ) from None
    # Read onto the host: AdamW's load_state_dict moves each moment to its parameter's device, so
    # a checkpoint written on one device resumes on another.
    state = torch.load(path / STATE, map_location="cpu", weights_only=False)
    optim.load_state_dict(state["optim"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return int(state["step"])


def _first_line(err: Exception) -> str:
    """The error's first sentence (torch's zip errors go on for a paragraph)."""
    text = (str(err).strip().splitlines() or [""])[0].split(". ")[0]
    return f"{type(err).__name__}: {text}"
