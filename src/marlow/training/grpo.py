"""One GRPO update of one step, exactly SPEC §4, written to read like the algorithm box.

    for each episode i of problem g:      A_i = (R_i - mean_g R) / (std_g R + eps)   (algo.credit)
    every token of every turn of i gets A_i (broadcast credit; scope and 1/N weighting optional)
    logp_old <- score every turn under the current adapters, before any update
    for each adapter a (routing order):
        its turns, shuffled (seeded), cut into mini-batches of M turns
        for each mini-batch:                                   # one AdamW update each
            r = exp(logp_new - logp_old); loss = aggregate(-min(rA, clip(r) A), mode)
            backward; clip grad to c; AdamW step at the adapter's scheduled rate
    logp_new <- rescore every turn after all updates           # chi2_update, sampled steps only

A policy's loss sees only the tokens of turns routed to it: the per-adapter batches
(:mod:`marlow.training.batch`) *are* the token masks. Turns on the frozen base (``__base__``) are
never trained.

Fewer passes, same numbers (choices of marlow):

* **Fused logp_old.** When an adapter's step is one update (one epoch, all its turns in one
  mini-batch) and the model has no active dropout, logp_old is the update forward's own
  log-probs, detached: the policy before the update *is* the policy of that forward, so the
  separate no-grad pass is skipped. The ratio is then exactly 1 and the loss and gradient equal
  those of the separate pass up to float round-off (a test holds them within 1e-6).
* **Sampled diagnostics.** ``chi2_update`` (the post-update rescoring) and ``kl_to_base`` (a
  forward with the adapters disabled) are exact but run only on diagnostics steps: steps 1,
  1 + k, 1 + 2k, ... with k = ``diagnostics.every``. On the other steps the finiteness of the
  updated policy is checked on one turn per adapter (its shortest), not on all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from marlow.algo.losses import clipped_surrogate, token_weights
from marlow.algo.stats import chi2_token, kl_k3
from marlow.config import GRPOConfig
from marlow.diagnostics.metrics import Meter
from marlow.policy.adapters import use_adapter
from marlow.training.batch import AdapterBatch
from marlow.training.distributed import SOLO, World
from marlow.training.optim import AdapterOptimizers
from marlow.training.scoring import score_rows
from marlow.types import BASE


class NonFiniteLoss(RuntimeError):
    """A loss or gradient went NaN/inf: the adapter's update of the step is undone
    (``marlow.training.nonfinite``)."""


def fused_old_logp(turns: int, cfg: GRPOConfig, dropout: float) -> bool:
    """Whether an adapter's logp_old comes from its update forward (see the module docstring);
    ``turns``: its trained turns in the step, over every data-parallel rank."""
    return cfg.epochs == 1 and turns <= cfg.update_turns and dropout == 0.0


def _score_all(
    model, batch: AdapterBatch, adapter: str, temperature: float, micro_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, L) log-probs and entropies of every row of ``batch`` under ``adapter``, no gradient."""
    logp = ent = None
    with torch.no_grad(), use_adapter(model, adapter):
        for local, s in score_rows(
            model, batch, range(len(batch)), temperature=temperature, micro_tokens=micro_tokens
        ):
            if logp is None:
                logp, ent = (
                    s.logp.new_zeros(batch.mask.shape),
                    s.entropy.new_zeros(batch.mask.shape),
                )
            width = s.mask.shape[1]
            logp[local, :width] = s.logp
            ent[local, :width] = s.entropy
    return logp, ent


def score_old(model, batch: AdapterBatch, temperature: float, micro_tokens: int) -> None:
    """Fill ``batch.old_logp`` and ``batch.entropy``: the policy before any update of the step."""
    batch.old_logp, batch.entropy = _score_all(
        model, batch, batch.adapter, temperature, micro_tokens
    )


def pre_update_stats(meter: Meter, batch: AdapterBatch) -> None:
    """Entropy, perplexity and chi2_rollout (trainer vs sampler) per role, token-weighted: one
    read of the device per role."""
    for role, idx in batch.by_role().items():
        n = sum(batch.completion_len[i] for i in idx)
        if n == 0:
            continue
        mask = batch.mask[idx]
        lp = batch.old_logp[idx]
        sampler = batch.sampler_logp[idx].to(lp.dtype)
        ent, nll, chi2 = torch.stack(
            [batch.entropy[idx].sum(), -lp.sum(), chi2_token(lp - sampler, mask)]
        ).tolist()
        meter.mean(role, "entropy", ent, n)
        meter.mean(role, "nll", nll, n)
        meter.mean(role, "chi2_rollout", chi2 * n, n)


def kl_to_base_stats(
    meter: Meter, model, batch: AdapterBatch, temperature: float, micro_tokens: int
) -> None:
    """kl_to_base per role: the k3 estimate of KL(pi_old || base) on the step's sampled tokens,
    the base being the same model with every adapter disabled (one extra forward, no gradient).
    Both sides are temperature-scaled, as the sampler's distribution is."""
    base, _ = _score_all(model, batch, BASE, temperature, micro_tokens)
    for role, idx in batch.by_role().items():
        n = sum(batch.completion_len[i] for i in idx)
        if n:
            kl = kl_k3(batch.old_logp[idx], base[idx].to(batch.old_logp.dtype), batch.mask[idx])
            meter.mean(role, "kl_to_base", float(kl) * n, n)


def update_adapter(
    model,
    batch: AdapterBatch,
    optim: AdapterOptimizers,
    cfg: GRPOConfig,
    *,
    temperature: float,
    generator: torch.Generator,
    meter: Meter,
    fused: bool = False,
    world: World = SOLO,
) -> None:
    """All mini-batch updates of one adapter in one step.

    ``world``: the data-parallel ranks (:mod:`marlow.training.distributed`). ``batch`` holds this
    rank's rows (possibly none); the mini-batches are cut from every rank's rows in rank order
    with the same permutation, each row is weighed with its whole mini-batch's normaliser, and
    the gradients are summed across ranks before the clip and the step: one process with the
    same global batch takes the same updates.

    ``fused``: logp_old is taken from the (single) update's forward and written to
    ``batch.old_logp`` / ``batch.entropy`` once every row is scored; otherwise ``batch.old_logp``
    must be filled already (:func:`score_old`).

    When the adapter serves several roles (SP, or a shared entry of a role map), micro-batches
    are kept role-pure and consecutive per role, so each role's own gradient in an update is the
    change of the accumulated gradient across its micro-batches (no extra backward pass):
    ``grad_mass_share`` of a role = |g_role| / sum over roles of |g_role'| (L2 norms, before clipping),
    averaged over the step's updates; ``grad_norm_own`` = |g_role|.
    """
    adapter = batch.adapter
    ranks = world.gather((sorted(set(batch.roles)), batch.completion_len))  # one message
    roles = sorted({role for rank_roles, _ in ranks for role in rank_roles})
    shared = len(roles) > 1
    params = optim.params[adapter]
    lengths = [n for _, rank_lengths in ranks for n in rank_lengths]  # every rank's rows, in order
    offset = sum(len(rank_lengths) for _, rank_lengths in ranks[: world.rank])
    mine = range(offset, offset + len(batch))
    device = batch.ids.device
    old_logp = entropy = None  # fused: filled from the update forward
    updates = 0
    for _ in range(cfg.epochs):
        order = torch.randperm(len(lengths), generator=generator).tolist()
        for start in range(0, len(order), cfg.update_turns):
            rows = order[start : start + cfg.update_turns]  # global row numbers
            lens = torch.tensor([lengths[r] for r in rows], device=device)
            mask = torch.arange(int(max(lengths[r] for r in rows)), device=device) < lens[:, None]
            local_pos = [j for j, r in enumerate(rows) if r in mine]
            idx = [rows[j] - offset for j in local_pos]  # this rank's rows of the mini-batch
            weights = token_weights(mask, cfg.aggregation)[local_pos]  # (M_rank, L)
            total_loss = torch.zeros((), device=device)  # read once per update, after backwards
            own = RoleGradients(params) if shared else None
            with use_adapter(model, adapter):
                for local, s in score_rows(
                    model,
                    batch,
                    idx,
                    temperature=temperature,
                    micro_tokens=cfg.micro_tokens,
                    by_role=True,
                ):
                    chunk_rows = [idx[j] for j in local]
                    if own is not None:
                        own.enter(batch.roles[chunk_rows[0]])
                    w_chunk = s.mask.shape[1]
                    if fused:
                        old_lp = s.logp.detach()
                        if old_logp is None:
                            old_logp = old_lp.new_zeros(batch.mask.shape)
                            entropy = s.entropy.new_zeros(batch.mask.shape)
                        old_logp[chunk_rows, :w_chunk] = old_lp
                        entropy[chunk_rows, :w_chunk] = s.entropy
                    else:
                        old_lp = batch.old_logp[chunk_rows, :w_chunk]
                    adv = batch.advantages[chunk_rows].to(s.logp.dtype)
                    out = clipped_surrogate(
                        s.logp, old_lp, adv, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c
                    )
                    w = weights[local, :w_chunk].to(s.logp.dtype)
                    loss = (w * out.loss).sum()
                    loss.backward()
                    total_loss = total_loss + loss.detach()
                    _ratio_stats(meter, [batch.roles[i] for i in chunk_rows], out, s.mask)
            norms = own.finish(roles, world) if own is not None else {}  # before the sum below
            if world.size > 1:  # every rank's share of the mini-batch's loss and gradient
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                world.sum_([total_loss, *(p.grad for p in params)])
            loss_value = float(total_loss)
            if not math.isfinite(loss_value):  # its gradients are dropped when the step is undone
                raise NonFiniteLoss(f"loss is {loss_value}")
            if own is not None:  # a role absent from this mini-batch has share 0 in it
                total = sum(norms.values())
                for role in roles:
                    norm = norms.get(role, 0.0)
                    meter.mean(role, "grad_norm_own", norm, 1, also_all=False)
                    meter.mean(
                        role,
                        "grad_mass_share",
                        norm / total if total > 0 else 0.0,
                        1,
                        also_all=False,
                    )
            norm = optim.update(adapter)
            if not math.isfinite(norm):
                raise NonFiniteLoss(f"gradient norm is {norm}")
            meter.mean(adapter, "grad_norm", norm, 1, also_all=False)
            meter.max(adapter, "grad_norm_max", norm, also_all=False)
            meter.mean(adapter, "loss", loss_value, 1, also_all=False)
            updates += 1
    if fused:
        batch.old_logp, batch.entropy = old_logp, entropy
    meter.set(adapter, "updates", updates)
    meter.set(adapter, "lr", optim.current_lr(adapter))
    optim.end_role_update(adapter)


class RoleGradients:
    """Each role's own gradient in one update, from snapshots of the accumulated gradient taken
    where the (role-consecutive) micro-batches switch role. Snapshots and differences stay on
    the gradients' device (float32, the LoRA weights' dtype); :meth:`finish` sums each role's
    gradient over the data-parallel ranks and reads the norms once."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.role: str | None = None
        self.before: list[torch.Tensor] = []
        self.own: dict[str, torch.Tensor] = {}  # role -> its gradient, flattened

    def _grads(self) -> list[torch.Tensor]:
        return [
            torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params
        ]

    def enter(self, role: str) -> None:
        if role == self.role:
            return
        if role in self.own:
            raise RuntimeError(f"micro-batches of role {role!r} are not consecutive")
        now = self._grads()
        self._close(now)
        self.role, self.before = role, now

    def _close(self, now: list[torch.Tensor]) -> None:
        if self.role is not None:
            diff = [(a - b).reshape(-1) for a, b in zip(now, self.before, strict=True)]
            self.own[self.role] = torch.cat(diff)

    def finish(self, roles: Sequence[str], world: World = SOLO) -> dict[str, float]:
        """The gradient norm of each of ``roles`` in this update (a role without rows here has a
        zero gradient on this rank), summed over ``world``'s ranks first."""
        self._close(self._grads())
        self.role = None
        size = sum(p.numel() for p in self.params)
        device = self.params[0].device
        own = [self.own[r] if r in self.own else torch.zeros(size, device=device) for r in roles]
        world.sum_(own)
        return dict(zip(roles, torch.stack([g.norm() for g in own]).tolist(), strict=True))


def _ratio_stats(meter: Meter, roles: Sequence[str], out, mask: torch.Tensor) -> None:
    """Clip fractions and max ratio per role, from one micro-batch (whole-tensor ops, one read
    of the device)."""
    with torch.no_grad():
        m = mask.to(out.ratio.dtype)
        n, low, high, top = torch.stack(
            [
                m.sum(1),
                (out.clipped_low.to(m.dtype) * m).sum(1),
                (out.clipped_high.to(m.dtype) * m).sum(1),
                out.ratio.detach().masked_fill(~mask, float("-inf")).amax(1),
            ]
        ).tolist()  # 4 x (T,)
    for role, k, lo, hi, r in zip(roles, n, low, high, top, strict=True):
        if k == 0:
            continue
        meter.mean(role, "clipfrac_low", lo, k)
        meter.mean(role, "clipfrac_high", hi, k)
        meter.max(role, "ratio_max", r)


def post_update_stats(
    meter: Meter, model, batch: AdapterBatch, temperature: float, micro_tokens: int
) -> torch.Tensor:
    """chi2_update: token chi2 of pi_new / pi_old on the step's tokens, after all updates.
    Returns the new (N, L) log-probs (the trainer refuses an update that made them non-finite)."""
    new, _ = _score_all(model, batch, batch.adapter, temperature, micro_tokens)
    for role, idx in batch.by_role().items():
        n = sum(batch.completion_len[i] for i in idx)
        if n:
            log_ratio = new[idx] - batch.old_logp[idx].to(new.dtype)
            chi2 = float(chi2_token(log_ratio, batch.mask[idx]))
            meter.mean(role, "chi2_update", chi2 * n, n)
    return new[batch.mask]


def probe_row(batch: AdapterBatch) -> int:
    """The batch's probe turn: its shortest (prompt + completion), the first of equals."""
    return min(range(len(batch)), key=batch.seq_len.__getitem__)


def probe_logp(model, batch: AdapterBatch, temperature: float) -> torch.Tensor:
    """Log-probs of the batch's probe turn (:func:`probe_row`) under its adapter: the cheap
    finiteness check of an updated policy on steps without the post-update rescoring."""
    row = probe_row(batch)
    with torch.no_grad(), use_adapter(model, batch.adapter):
        _, scored = next(score_rows(model, batch, [row], temperature=temperature, micro_tokens=1))
    return scored.logp[scored.mask]


def finish_role_stats(meter_values: dict[str, float]) -> dict[str, float]:
    """Perplexity = exp(mean NLL), derived from the accumulated NLL."""
    out = dict(meter_values)
    for key in list(out):
        if key.endswith("/nll"):
            out[key[: -len("nll")] + "perplexity"] = math.exp(out[key])
    return out


__all__ = [
    "NonFiniteLoss",
    "finish_role_stats",
    "fused_old_logp",
    "kl_to_base_stats",
    "post_update_stats",
    "pre_update_stats",
    "probe_logp",
    "probe_row",
    "score_old",
    "update_adapter",
]
