"""Per-adapter AdamW and the cosine-with-warmup schedule, with its two stepping modes.

Each adapter owns an AdamW optimizer, its own gradient clip and its own schedule position.

Schedule (HF's ``get_cosine_schedule_with_warmup`` shape, min lr 0)::

    lr(t) = lr0 * t / W                                         for t < W
    lr(t) = lr0 * 0.5 * (1 + cos(pi * min(1, (t - W) / (S - W))))   for t >= W

with W warmup steps and S total steps. Departure from HF: past S the rate stays at 0 instead of
rising again along the cosine, except under ``shared-uncapped``.

Stepping modes:

* ``per-step`` (default): every adapter's position t is the number of training steps done.
* ``per-role-update``: one shared schedule stepped once per role update, so with P adapters each
  updating once per step, t advances by P per step; within step k the j-th adapter to update
  sees t = k * P + j; capped at 0 past S.
* ``shared-uncapped`` (the official code, verl's cosine): as ``per-role-update``, but past S the
  cosine goes on, 0.5 * (1 + cos(pi * progress)) with progress > 1, so the rate climbs back: an
  IP run with two adapters reaches 0 near step S / 2 and lr0 again near step S.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

SHARED = ("per-role-update", "shared-uncapped")  # the stepping modes with one shared clock


def cosine_lr(lr0: float, t: int, warmup: int, total: int, capped: bool = True) -> float:
    """The rate at schedule position ``t`` (module docstring). Up to ``total`` it equals
    transformers' ``get_cosine_schedule_with_warmup`` (tests/unit/test_schedule.py compares
    them); it is not used because that is a ``LambdaLR`` bound to one optimizer and advanced one
    step per ``.step()``, while each adapter here needs the rate at a position it sets itself
    (``per-role-update`` advances P per step, a resume jumps to the checkpoint's), and because
    past ``total`` its cosine rises again where this stays at 0 (``capped``; uncapped, it rises
    again like verl's)."""
    if t < warmup:
        return lr0 * t / warmup
    span = max(1, total - warmup)
    progress = (t - warmup) / span
    if capped:
        progress = min(1.0, progress)
    return lr0 * 0.5 * (1.0 + math.cos(math.pi * progress))


class AdapterOptimizers:
    """One AdamW per adapter plus the schedule clock."""

    def __init__(
        self,
        params: Mapping[str, Sequence[nn.Parameter]],
        *,
        lr: float,
        warmup: int,
        total: int,
        weight_decay: float,
        betas: tuple[float, float],
        grad_clip: float,
        stepping: str,
    ) -> None:
        self.lr0, self.warmup, self.total = lr, warmup, total
        self.grad_clip = grad_clip
        self.stepping = stepping
        self.params = {name: list(ps) for name, ps in params.items()}
        self.optimizers = {
            name: torch.optim.AdamW(ps, lr=self.lr_at(0), betas=betas, weight_decay=weight_decay)
            for name, ps in self.params.items()
        }
        self.position = dict.fromkeys(self.params, 0)  # per-step mode
        self.shared_position = 0  # the shared modes

    def lr_at(self, t: int) -> float:
        capped = self.stepping != "shared-uncapped"
        return cosine_lr(self.lr0, t, self.warmup, self.total, capped)

    def current_lr(self, name: str) -> float:
        t = self.shared_position if self.stepping in SHARED else self.position[name]
        return self.lr_at(t)

    def update(self, name: str) -> float:
        """Clip the adapter's gradient, take one AdamW step at the current rate, zero grads.

        Returns the gradient norm before clipping (inf/nan when the gradient is not finite, in
        which case no step is taken).
        """
        ps = self.params[name]
        norm = float(torch.nn.utils.clip_grad_norm_(ps, self.grad_clip))
        opt = self.optimizers[name]
        if math.isfinite(norm):
            for group in opt.param_groups:
                group["lr"] = self.current_lr(name)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return norm

    def snapshot(self, name: str) -> dict:
        """A copy of the adapter's weights and AdamW state, for :meth:`restore`. The copies stay
        on the tensors' own device: no round trip to the host inside the step."""
        saved = {"weights": [p.detach().clone() for p in self.params[name]]}
        saved["optim"] = _cloned(self.optimizers[name].state_dict())
        return saved

    def restore(self, name: str, snapshot: dict) -> None:
        """Put back the weights and AdamW state of :meth:`snapshot`; drop any gradient. The
        schedule clock is not part of it: a skipped update still uses up its schedule turn."""
        with torch.no_grad():
            for p, saved in zip(self.params[name], snapshot["weights"], strict=True):
                p.copy_(saved)
        opt = self.optimizers[name]
        opt.load_state_dict(snapshot["optim"])
        opt.zero_grad(set_to_none=True)

    def end_role_update(self, name: str) -> None:
        """Called once per adapter after its last update of a step."""
        if self.stepping in SHARED:
            self.shared_position += 1

    def end_step(self) -> None:
        """Called once per training step, after every adapter's updates."""
        if self.stepping == "per-step":
            for name in self.position:
                self.position[name] += 1

    def state_dict(self) -> dict:
        return {
            "optimizers": {n: o.state_dict() for n, o in self.optimizers.items()},
            "position": dict(self.position),
            "shared_position": self.shared_position,
        }

    def load_state_dict(self, state: dict) -> None:
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state["optimizers"][name])
        self.position = dict(state["position"])
        self.shared_position = int(state["shared_position"])


def _cloned(obj):
    """A copy of a (nested) optimizer state dict with every tensor cloned on its device."""
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cloned(v) for v in obj]
    return obj
