"""One GRPO update of one step, exactly SPEC §4, written to read like the algorithm box.

    for each episode i of problem g:      A_i = (R_i - mean_g R) / (std_g R + eps)   (algo)
    every token of every turn of i gets A_i (broadcast credit; scope and 1/N weighting optional)
    logp_old <- score every turn under the current adapters, before any update
    for each adapter a (routing order):
        its turns, shuffled (seeded), cut into mini-batches of M turns
        for each mini-batch:                                   # one AdamW update each
            r = exp(logp_new - logp_old); loss = aggregate(-min(rA, clip(r) A), mode)
            backward; clip grad to c; AdamW step at the adapter's scheduled rate
    logp_new <- rescore every turn after all updates           # for chi2_update

A policy's loss sees only the tokens of turns routed to it: the per-adapter turn lists *are* the
token masks. Turns on the frozen base (``__base__``) are never trained.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from marlow.algo.advantages import group_advantages, group_keys, zero_std_fraction
from marlow.algo.losses import clipped_surrogate, token_weights
from marlow.algo.stats import chi2_token, kl_k3
from marlow.config import GRPOConfig
from marlow.diagnostics.metrics import Meter
from marlow.policy.adapters import use_adapter
from marlow.train.optim import AdapterOptimizers
from marlow.train.scoring import completion_mask, pad_rows, score_turns
from marlow.types import BASE, Episode, Turn


class NonFiniteLoss(RuntimeError):
    """A loss or gradient went NaN/inf: the adapter's update of the step is undone
    (``marlow.train.nonfinite``)."""


@dataclass
class TurnBatch:
    """The step's trainable turns of one adapter, with their advantages."""

    turns: list[Turn]
    advantages: list[float]


def turn_advantages(
    episodes: Sequence[Episode],
    scope: str,
    eps: float,
    same_role_weighting: bool = False,
    role_weights: dict[str, float] | None = None,
) -> tuple[dict[int, float], float]:
    """Advantage of every turn (keyed by ``id(turn)``) and ``frac_reward_zero_std``.

    Scopes: ``problem`` groups the n episodes of a problem; ``role`` groups (problem, role)
    items; ``slot`` groups (problem, role, slot, round) items, as the paper's code keeps
    ``generator0``, ``generator1``, ... apart. The reward is broadcast: every item of an episode
    carries the episode's reward. Turns that carry their own reward (per-role credit) are one item
    each, grouped per (problem, role) under scope ``role`` and per (problem, role, slot, round)
    under ``slot`` and ``problem`` (a turn's own reward is only comparable with its own slot's, so
    per problem means per slot there, as it does for a broadcast reward). Then, optionally, each
    turn's advantage is multiplied by its role's weight and divided by the number of same-role
    slots in its round.

    ``frac_reward_zero_std`` is counted on these very items and groups (the rewards that define
    the advantages), so under per-role credit or a finer scope it is the fraction of groups that
    give no gradient, not the fraction of problems whose episode rewards are equal.
    """
    items: list[tuple[object, float, list[Turn]]] = []
    for ep in episodes:
        if any(t.reward is not None for t in ep.turns):  # per-role credit: one item per turn
            items.extend((_own_key(ep, t, scope), _own(t, ep), [t]) for t in ep.turns)
            continue
        if scope == "problem":
            items.append(((ep.group,), ep.reward, ep.turns))
            continue
        by_key: dict[tuple, list[Turn]] = defaultdict(list)
        for t in ep.turns:
            key = (ep.group, t.role) if scope == "role" else (ep.group, t.role, t.slot, t.round)
            by_key[key].append(t)
        items.extend((k, ep.reward, ts) for k, ts in by_key.items())
    rewards = torch.tensor([r for _, r, _ in items], dtype=torch.float64)
    index = group_keys([k for k, _, _ in items])
    adv = group_advantages(rewards, index, eps=eps)
    frac_zero = zero_std_fraction(rewards, index)
    out: dict[int, float] = {}
    for (_, _, turns), a in zip(items, adv.tolist(), strict=True):
        for t in turns:
            out[id(t)] = a
    if role_weights:
        for ep in episodes:
            for t in ep.turns:
                out[id(t)] *= role_weights.get(t.role, 1.0)
    if same_role_weighting:
        for ep in episodes:
            slots: dict[tuple[str, int], int] = defaultdict(int)
            for t in ep.turns:
                slots[(t.role, t.round)] += 1
            for t in ep.turns:
                out[id(t)] /= slots[(t.role, t.round)]
    return out, frac_zero


def _own_key(episode: Episode, turn: Turn, scope: str) -> tuple:
    """The group of a turn that carries its own reward (per-role credit)."""
    if scope == "role":
        return (episode.group, turn.role)
    return (episode.group, turn.role, turn.slot, turn.round)


def _own(turn: Turn, episode: Episode) -> float:
    return episode.reward if turn.reward is None else turn.reward


def split_by_adapter(episodes: Sequence[Episode], adv: dict[int, float]) -> dict[str, TurnBatch]:
    batches: dict[str, TurnBatch] = {}
    for ep in episodes:
        for t in ep.turns:
            if t.policy == BASE:
                continue
            b = batches.setdefault(t.policy, TurnBatch([], []))
            b.turns.append(t)
            b.advantages.append(adv[id(t)])
    return batches


def score_logps(
    model, adapter: str, turns: Sequence[Turn], temperature: float, pad_id: int, micro_tokens: int
):
    """Per-turn log-prob and entropy vectors under ``adapter``, no gradient."""
    logps: list[torch.Tensor] = [torch.empty(0)] * len(turns)
    ents: list[torch.Tensor] = [torch.empty(0)] * len(turns)
    with torch.no_grad(), use_adapter(model, adapter):
        for rows, s in score_turns(
            model, turns, temperature=temperature, pad_id=pad_id, micro_tokens=micro_tokens
        ):
            for j, i in enumerate(rows):
                n = len(turns[i].completion_ids)
                logps[i] = s.logp[j, :n].clone()
                ents[i] = s.entropy[j, :n].clone()
    return logps, ents


def pre_update_stats(
    meter: Meter, turns: Sequence[Turn], old: list[torch.Tensor], ent: list[torch.Tensor]
) -> None:
    """Entropy, perplexity and chi2_rollout (trainer vs sampler) per role, token-weighted."""
    for role, idx in _by_role(turns).items():
        lp = torch.cat([old[i] for i in idx])
        if lp.numel() == 0:
            continue
        sampler = torch.cat([torch.tensor(turns[i].sampler_logprobs, dtype=lp.dtype) for i in idx])
        mask = torch.ones_like(lp, dtype=torch.bool)
        n = lp.numel()
        meter.mean(role, "entropy", float(torch.cat([ent[i] for i in idx]).sum()), n)
        meter.mean(role, "nll", float(-lp.sum()), n)
        meter.mean(role, "chi2_rollout", float(chi2_token(lp - sampler, mask)) * n, n)


def kl_to_base_stats(
    meter: Meter,
    model,
    turns: Sequence[Turn],
    old: list[torch.Tensor],
    temperature: float,
    pad_id: int,
    micro_tokens: int,
) -> None:
    """kl_to_base per role: the k3 estimate of KL(pi_old || base) on the step's sampled tokens,
    the base being the same model with every adapter disabled (one extra forward, no gradient).
    Both sides are temperature-scaled, as the sampler's distribution is."""
    base, _ = score_logps(model, BASE, turns, temperature, pad_id, micro_tokens)
    for role, idx in _by_role(turns).items():
        lp = torch.cat([old[i] for i in idx])
        if lp.numel():
            ref = torch.cat([base[i] for i in idx])
            n = lp.numel()
            kl = kl_k3(lp, ref, torch.ones_like(lp, dtype=torch.bool))
            meter.mean(role, "kl_to_base", float(kl) * n, n)


def _by_role(turns: Sequence[Turn]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(turns):
        out[t.role].append(i)
    return out


def update_adapter(
    model,
    adapter: str,
    batch: TurnBatch,
    old: list[torch.Tensor],
    optim: AdapterOptimizers,
    cfg: GRPOConfig,
    *,
    temperature: float,
    pad_id: int,
    generator: torch.Generator,
    meter: Meter,
) -> None:
    """All mini-batch updates of one adapter in one step.

    When the adapter serves several roles (SP, or a shared entry of a role map), micro-batches
    are kept role-pure and consecutive per role, so each role's own gradient in an update is the
    change of the accumulated gradient across its micro-batches (no extra backward pass):
    ``grad_mass_share`` of a role = |g_role| / sum over roles of |g_role'| (L2 norms, before clipping),
    averaged over the step's updates; ``grad_norm_own`` = |g_role|.
    """
    turns = batch.turns
    roles = sorted({t.role for t in turns})
    shared = len(roles) > 1
    params = optim.params[adapter]
    updates = 0
    for _ in range(cfg.epochs):
        order = torch.randperm(len(turns), generator=generator).tolist()
        for start in range(0, len(order), cfg.minibatch_turns):
            idx = order[start : start + cfg.minibatch_turns]
            mb = [turns[i] for i in idx]
            weights = token_weights(completion_mask(mb), cfg.aggregation)  # (M, L)
            total_loss = 0.0
            own = RoleGradients(params) if shared else None
            with use_adapter(model, adapter):
                for local, s in score_turns(
                    model,
                    mb,
                    temperature=temperature,
                    pad_id=pad_id,
                    micro_tokens=cfg.micro_tokens,
                    by=_role,
                ):
                    rows = [idx[j] for j in local]
                    if own is not None:
                        own.enter(turns[rows[0]].role)
                    width = s.mask.shape[1]
                    old_lp = pad_rows([old[i].tolist() for i in rows], width, s.logp.dtype)
                    adv = torch.tensor([batch.advantages[i] for i in rows], dtype=s.logp.dtype)
                    out = clipped_surrogate(
                        s.logp, old_lp, adv, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c
                    )
                    w = weights[local, :width].to(s.logp.dtype)
                    loss = (w * out.loss).sum()
                    if not torch.isfinite(loss):
                        raise NonFiniteLoss(f"loss is {float(loss.detach())}")
                    loss.backward()
                    total_loss += float(loss.detach())
                    _ratio_stats(meter, [turns[i] for i in rows], out, s.mask)
            if own is not None:
                norms = own.finish()  # a role absent from this mini-batch has share 0 in it
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
            meter.mean(adapter, "loss", total_loss, 1, also_all=False)
            updates += 1
    meter.set(adapter, "updates", updates)
    meter.set(adapter, "lr", optim.current_lr(adapter))
    optim.end_role_update(adapter)


def _role(turn: Turn) -> str:
    return turn.role


class RoleGradients:
    """Each role's own gradient in one update, from snapshots of the accumulated gradient taken
    where the (role-consecutive) micro-batches switch role."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.role: str | None = None
        self.before: list[torch.Tensor] = []
        self.norms: dict[str, float] = {}

    def _grads(self) -> list[torch.Tensor]:
        return [
            torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params
        ]

    def enter(self, role: str) -> None:
        if role == self.role:
            return
        if role in self.norms:
            raise RuntimeError(f"micro-batches of role {role!r} are not consecutive")
        now = self._grads()
        self._close(now)
        self.role, self.before = role, now

    def _close(self, now: list[torch.Tensor]) -> None:
        if self.role is not None:
            sq = sum(float((a - b).pow(2).sum()) for a, b in zip(now, self.before, strict=True))
            self.norms[self.role] = math.sqrt(sq)

    def finish(self) -> dict[str, float]:
        self._close(self._grads())
        self.role = None
        return self.norms


def _ratio_stats(meter: Meter, turns: Sequence[Turn], out, mask: torch.Tensor) -> None:
    """Clip fractions and max ratio per role, from one micro-batch (whole-tensor ops, one sync)."""
    with torch.no_grad():
        m = mask.to(out.ratio.dtype)
        n = mask.sum(1).tolist()
        low = (out.clipped_low.to(m.dtype) * m).sum(1).tolist()
        high = (out.clipped_high.to(m.dtype) * m).sum(1).tolist()
        top = out.ratio.detach().masked_fill(~mask, float("-inf")).amax(1).tolist()
    for t, k, lo, hi, r in zip(turns, n, low, high, top, strict=True):
        if k == 0:
            continue
        meter.mean(t.role, "clipfrac_low", lo, k)
        meter.mean(t.role, "clipfrac_high", hi, k)
        meter.max(t.role, "ratio_max", r)


def post_update_stats(
    meter: Meter,
    model,
    adapter: str,
    turns: Sequence[Turn],
    old: list[torch.Tensor],
    temperature: float,
    pad_id: int,
    micro_tokens: int,
) -> list[torch.Tensor]:
    """chi2_update: token chi2 of pi_new / pi_old on the step's tokens, after all updates.
    Returns the new log-probs (the trainer refuses an update that made them non-finite)."""
    new, _ = score_logps(model, adapter, turns, temperature, pad_id, micro_tokens)
    for role, idx in _by_role(turns).items():
        log_ratio = torch.cat([new[i] - old[i] for i in idx])
        if log_ratio.numel():
            mask = torch.ones_like(log_ratio, dtype=torch.bool)
            n = log_ratio.numel()
            meter.mean(role, "chi2_update", float(chi2_token(log_ratio, mask)) * n, n)
    return new


def finish_role_stats(meter_values: dict[str, float]) -> dict[str, float]:
    """Perplexity = exp(mean NLL), derived from the accumulated NLL."""
    out = dict(meter_values)
    for key in list(out):
        if key.endswith("/nll"):
            out[key[: -len("nll")] + "perplexity"] = math.exp(out[key])
    return out


__all__ = [
    "NonFiniteLoss",
    "TurnBatch",
    "finish_role_stats",
    "kl_to_base_stats",
    "post_update_stats",
    "pre_update_stats",
    "score_logps",
    "split_by_adapter",
    "turn_advantages",
    "update_adapter",
]
