"""Checkpoints: adapters (standard PEFT folders), optimizers, schedule clock, RNG states, cursor.

Layout: ``RUN/checkpoints/step_NNNNNN/{adapters/<name>/, trainer_state.pt, DONE}``. A checkpoint
is written into a temporary folder and renamed into place, so a checkpoint folder either holds a
complete checkpoint or does not exist. The data cursor is the step: batches are a pure function
of (seed, step), see ``marlow.train.trainer``.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

from marlow.policy.adapters import load_adapter_weights, save_adapters
from marlow.train.optim import AdapterOptimizers

PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{PREFIX}{step:06d}"


def save(run_dir: Path, step: int, model, adapters: list[str], optim: AdapterOptimizers) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if adapters:
        save_adapters(model, tmp / "adapters", adapters)
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
    torch.save(state, tmp / "trainer_state.pt")
    (tmp / "DONE").write_text(str(step))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def all_done(run_dir: Path) -> list[Path]:
    """Every complete checkpoint of a run, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    done = [
        p
        for p in root.iterdir()
        if p.name.startswith(PREFIX) and not p.name.endswith(".tmp") and (p / "DONE").exists()
    ]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def latest(run_dir: Path) -> Path | None:
    done = all_done(run_dir)
    return done[-1] if done else None


def load(path: Path, model, adapters: list[str], optim: AdapterOptimizers) -> int:
    """Restore a checkpoint into a freshly built trainer; returns its step."""
    if adapters:
        load_adapter_weights(model, path / "adapters", adapters)
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    optim.load_state_dict(state["optim"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return int(state["step"])
