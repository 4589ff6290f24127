"""One GRPO update of one step, exactly the study's objective, written to read like the
algorithm box.

    for each episode i of problem g:      A_i = (R_i - mean_g R) / (std_g R + eps)   (algo.advantages)
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
  updated policy is checked on one turn per adapter (its shortest), not on all of them, at
  temperature 1: the log-probs the adapter-sync check compares with the rollout engine's
  (:mod:`marlow.training.sync`), so one short forward serves both.
* **One base pass, on the turns that need it.** The base's log-probs are scored at most once a
  step: before the update when ``mitigate.kl_coef`` anchors a role to them, on the turns of
  the roles with a KL weight (every turn of the adapter on a step whose ``kl_to_base`` reads
  them too); else, on a diagnostics step, after the update for ``kl_to_base`` alone. An update
  changes only the adapters, so both give the same log-probs, and scoring fewer turns changes
  only how they are cut into micro-batches (tests hold the metric, and the update's loss and
  gradients, within 1e-6).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from marlow.algo.estimators import chi2_token, kl_k3
from marlow.algo.losses import token_weights
from marlow.algo.policy_loss import LossInputs, LossSettings, policy_loss
from marlow.config import GRPOConfig, MitigateConfig
from marlow.diagnostics.metrics import Meter
from marlow.policy.adapters import folded, held_factors, merged, use_adapter
from marlow.training.batch import AdapterBatch
from marlow.training.distributed import SOLO, Ranks
from marlow.training.logprobs import Scored, score_rows
from marlow.training.optim import AdapterOptimizers
from marlow.types import BASE

NO_MITIGATION = MitigateConfig()


class NonFiniteLoss(RuntimeError):
    """A loss or gradient went NaN/inf: the adapter's update of the step is undone
    (``marlow.training.nonfinite``)."""


def fused_old_logp(turns: int, cfg: GRPOConfig, dropout: float) -> bool:
    """Whether an adapter's logp_old comes from its update forward (see the module docstring);
    ``turns``: its trained turns in the step, over every data-parallel rank."""
    return cfg.epochs == 1 and turns <= cfg.update_turns and dropout == 0.0


def _score_all(
    model,
    batch: AdapterBatch,
    adapter: str,
    temperature: float,
    micro_tokens: int,
    fold: bool = False,
    rows: Sequence[int] | None = None,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, L) log-probs and entropies of the rows of ``batch`` under ``adapter``, no gradient;
    ``rows``: the rows scored (default every row), the others left 0; ``fold``: with the adapter
    merged into the base weights (the weights :func:`update_adapter` folds, bit for bit);
    ``entropy`` False: the entropies are not computed (None)."""
    rows = range(len(batch)) if rows is None else list(rows)
    logp = ent = None
    adapted = merged(model, adapter) if fold else use_adapter(model, adapter)
    with torch.no_grad(), adapted, held_factors():
        for local, s in score_rows(
            model,
            batch,
            rows,
            temperature=temperature,
            micro_tokens=micro_tokens,
            entropy=entropy,
        ):
            if logp is None:
                logp = s.logp.new_zeros(batch.mask.shape)
                ent = s.logp.new_zeros(batch.mask.shape) if entropy else None
            width = s.mask.shape[1]
            picked = [rows[j] for j in local]
            logp[picked, :width] = s.logp
            if ent is not None:
                ent[picked, :width] = s.entropy
    return logp, ent


def score_old(
    model, batch: AdapterBatch, temperature: float, micro_tokens: int, fold: bool = False
) -> None:
    """Fill ``batch.old_logp`` and ``batch.entropy``: the policy before any update of the step
    (``fold``: as :func:`update_adapter` computes it, ``grpo.fold_lora``)."""
    batch.old_logp, batch.entropy = _score_all(
        model, batch, batch.adapter, temperature, micro_tokens, fold
    )


def pre_update_stats(meter: Meter, batch: AdapterBatch) -> None:
    """Entropy, perplexity and the sampler/trainer mismatch per role, token-weighted: chi2_rollout
    and rollout_abs_dlogp, the mean |logp_old - logp_sampler| per token (0 to round-off when
    the sampler is the trainer's own model, the ``hf`` backend). One read of the device per
    role."""
    for role, idx in batch.by_role().items():
        n = sum(batch.completion_len[i] for i in idx)
        if n == 0:
            continue
        mask = batch.mask[idx]
        lp = batch.old_logp[idx]
        diff = lp - batch.sampler_logp[idx].to(lp.dtype)
        ent, nll, chi2, gap = torch.stack(
            [
                batch.entropy[idx].sum(),
                -lp.sum(),
                chi2_token(diff, mask),
                diff.abs().masked_fill(~mask, 0.0).sum(),
            ]
        ).tolist()
        meter.mean(role, "entropy", ent, n)
        meter.mean(role, "nll", nll, n)
        meter.mean(role, "chi2_rollout", chi2 * n, n)
        meter.mean(role, "rollout_abs_dlogp", gap, n)


def kl_to_base_stats(meter: Meter, batch: AdapterBatch) -> None:
    """kl_to_base per role: the k3 estimate of KL(pi_old || base) on the step's sampled tokens,
    from ``batch.old_logp`` and ``batch.base_logp`` (:func:`score_base`, scored once a step: see
    the module docstring). Both sides are temperature-scaled, as the sampler's distribution is."""
    for role, idx in batch.by_role().items():
        n = sum(batch.completion_len[i] for i in idx)
        if n:
            base = batch.base_logp[idx].to(batch.old_logp.dtype)
            kl = kl_k3(batch.old_logp[idx], base, batch.mask[idx])
            meter.mean(role, "kl_to_base", float(kl) * n, n)


def score_base(
    model,
    batch: AdapterBatch,
    temperature: float,
    micro_tokens: int,
    rows: Sequence[int] | None = None,
) -> None:
    """Fill ``batch.base_logp``: the base model's log-probs of the step's tokens (every adapter
    disabled, no gradient), for the per-role KL penalty (``mitigate.kl_coef``) and
    ``kl_to_base``; ``rows``: the rows scored (default every row), the others left 0. The same
    before and after an update, which changes only the adapters."""
    batch.base_logp, _ = _score_all(
        model, batch, BASE, temperature, micro_tokens, rows=rows, entropy=False
    )


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
    fold: bool = False,
    ranks: Ranks = SOLO,
    mitigate: MitigateConfig = NO_MITIGATION,
) -> None:
    """All mini-batch updates of one adapter in one step: for each mini-batch, each micro-batch
    is scored (forward), its per-token loss is the registered policy loss ``cfg.policy_loss``
    (:mod:`marlow.algo.policy_loss`), weighed by the aggregation and backpropagated; then the
    gradient is mitigated, summed over ranks, clipped and stepped (``optim.update``).

    ``ranks``: the data-parallel processes (:mod:`marlow.training.distributed`). ``batch`` holds this
    rank's rows (possibly none); the mini-batches are cut from every rank's rows in rank order
    with the same permutation, each row is weighed with its whole mini-batch's normaliser, and
    the gradients are summed across ranks before the clip and the step: one process with the
    same global batch takes the same updates.

    ``fold``: each LoRA layer computes with its adapter folded into one weight
    (:func:`marlow.policy.adapters.folded`, ``grpo.fold_lora``): the same loss and gradients up to
    float round-off, faster on the CPU.

    ``fused``: logp_old is taken from the (single) update's forward and written to
    ``batch.old_logp`` / ``batch.entropy`` once every row is scored; otherwise ``batch.old_logp``
    must be filled already (:func:`score_old`).

    When the adapter serves several roles (SP, or a shared entry of a role map), micro-batches
    are kept role-pure and consecutive per role, so each role's own gradient in an update is the
    change of the accumulated gradient across its micro-batches (no extra backward pass):
    ``grad_mass_share`` of a role = |g_role| / sum over roles of |g_role'| (L2 norms, before clipping
    and before any mitigation), averaged over the step's updates; ``grad_norm_own`` = |g_role|.

    ``cfg.rollout_correction`` ``truncate`` and ``mitigate.kl_coef`` enter the policy loss (the
    importance weight and the KL anchor of ``ppo-clip``: ``batch.sampler_logp``, and
    ``batch.base_logp`` from :func:`score_base`).

    ``mitigate`` (:class:`marlow.config.MitigateConfig`, docs/mitigations.md), applied to each
    update's gradient before the clip:

    * ``kl_coef``: a role's tokens add ``beta_role * k3`` to their loss (above);
    * ``coherence_threshold`` tau: micro-batches are also slot-pure; for a role with N >= 2 slots
      in the update, c = the mean pairwise cosine of the slots' gradients (``slot_coherence``);
      when c > tau each slot's gradient is multiplied by 1 / (1 + (N - 1) c) (``slot_damping``):
      N perfectly aligned slots then move the adapter as far as one;
    * ``role_balance`` (a shared adapter): each role's gradient (after damping) is rescaled to
      the mean of the roles' gradient norms, so every role contributes an equal mass.
    """
    u = _AdapterUpdate(model, batch, optim, cfg, temperature, meter, fused, fold, ranks, mitigate)
    for _ in range(cfg.epochs):
        order = torch.randperm(len(u.rows.lengths), generator=generator).tolist()
        for start in range(0, len(order), cfg.update_turns):
            idx, weights = u.mini_batch(order[start : start + cfg.update_turns])
            own, total_loss = u.backward(idx, weights, whole=cfg.update_turns >= len(order))
            u.step(own, total_loss)
    u.finish()


Part = str | tuple[str, int]  # a gradient part: a role, or (role, slot) for coherence damping


def _part(batch: AdapterBatch, i: int, slotted: bool) -> Part:
    """The gradient part row ``i`` belongs to: its role, or (role, slot) for coherence damping."""
    return (batch.roles[i], batch.turns[i].slot) if slotted else batch.roles[i]


def _role(part: Part) -> str:
    return part[0] if isinstance(part, tuple) else part


@dataclass(frozen=True)
class _Rows:
    """The adapter's trained rows over every data-parallel rank, in rank order: the mini-batches
    are cut from them, and each rank scores its own."""

    keys: list[Part]  # the gradient part of each of this rank's rows
    lengths: list[int]  # the completion length of every rank's rows
    mine: range  # this rank's rows among them
    parts: list[Part]  # every rank's gradient parts, sorted
    roles: list[str]  # their roles, sorted

    @property
    def shared(self) -> bool:
        """Whether the adapter serves several roles in the step."""
        return len(self.roles) > 1

    @property
    def measured(self) -> bool:
        """Whether each part's own gradient is measured: several roles, or (coherence damping) a
        role's several slots."""
        return len(self.parts) > 1


def _gather_rows(batch: AdapterBatch, ranks: Ranks, slotted: bool) -> _Rows:
    """Every rank's row lengths and gradient parts, in one message; ``slotted``: a part is a
    (role, slot), else a role."""
    keys = [_part(batch, i, slotted) for i in range(len(batch))]
    per_rank = ranks.gather((sorted(set(keys)), batch.completion_len))  # one message
    parts = sorted({key for rank_keys, _ in per_rank for key in rank_keys})
    offset = sum(len(rank_lengths) for _, rank_lengths in per_rank[: ranks.rank])
    return _Rows(
        keys=keys,
        lengths=[n for _, rank_lengths in per_rank for n in rank_lengths],
        mine=range(offset, offset + len(batch)),
        parts=parts,
        roles=sorted({_role(key) for key in parts}),
    )


class _FusedOld:
    """logp_old and the entropy taken from the update's own forward (``fused``), micro-batch by
    micro-batch; :meth:`_AdapterUpdate.finish` hands them to the batch after the last update."""

    def __init__(self, shape: torch.Size) -> None:
        self.shape = shape
        self.logp: torch.Tensor | None = None
        self.entropy: torch.Tensor | None = None

    def take(self, s: Scored, rows: list[int]) -> torch.Tensor:
        """The micro-batch's logp_old: its own log-probs, detached; kept with its entropies."""
        old_lp = s.logp.detach()
        if self.logp is None:
            self.logp = old_lp.new_zeros(self.shape)
            self.entropy = s.entropy.new_zeros(self.shape)
        width = s.mask.shape[1]
        self.logp[rows, :width] = old_lp
        self.entropy[rows, :width] = s.entropy
        return old_lp


class _AdapterUpdate:
    """One adapter's updates in one step (:func:`update_adapter`): what every mini-batch reads,
    and the steps of one update."""

    def __init__(
        self,
        model,
        batch: AdapterBatch,
        optim: AdapterOptimizers,
        cfg: GRPOConfig,
        temperature: float,
        meter: Meter,
        fused: bool,
        fold: bool,
        ranks: Ranks,
        mitigate: MitigateConfig,
    ) -> None:
        self.model, self.batch, self.optim, self.cfg = model, batch, optim, cfg
        self.temperature, self.meter, self.fold = temperature, meter, fold
        self.ranks, self.mitigate = ranks, mitigate
        self.rows = _gather_rows(batch, ranks, mitigate.coherence_threshold is not None)
        self.beta = [mitigate.kl_weight(role) for role in batch.roles]  # mitigate.kl_coef
        if any(self.beta) and batch.base_logp is None:
            raise RuntimeError(
                "mitigate.kl_coef needs batch.base_logp (score_base) before the update"
            )
        self.params = optim.params[batch.adapter]
        self.device = batch.ids.device
        self.loss_fn = policy_loss(cfg.policy_loss)  # grpo.policy_loss (marlow.algo.policy_loss)
        self.settings = LossSettings(
            cfg.clip_low,
            cfg.clip_high,
            cfg.clip_ratio_c,
            cfg.rollout_correction,
            cfg.rollout_correction_cap,
        )
        self.old = _FusedOld(batch.mask.shape) if fused else None
        self.updates = 0

    def mini_batch(self, rows: list[int]) -> tuple[list[int], torch.Tensor]:
        """This rank's rows of the mini-batch ``rows`` (every rank's, as global row numbers) and
        their (M_rank, L) token weights, normalised over the whole mini-batch."""
        lengths, mine, device = self.rows.lengths, self.rows.mine, self.device
        lens = torch.tensor([lengths[r] for r in rows], device=device)
        mask = torch.arange(int(max(lengths[r] for r in rows)), device=device) < lens[:, None]
        local_pos = [j for j, r in enumerate(rows) if r in mine]
        idx = [rows[j] - mine.start for j in local_pos]
        return idx, token_weights(mask, self.cfg.aggregation)[local_pos]

    def backward(
        self, idx: list[int], weights: torch.Tensor, whole: bool
    ) -> tuple[GradientParts | None, torch.Tensor]:
        """Forward and backward of this rank's rows ``idx`` of the mini-batch, micro-batch by
        micro-batch (part-pure, each part's consecutive). Returns the parts' gradients (when
        :attr:`_Rows.measured`, else None) and the summed loss, on the device.

        ``whole``: the mini-batch is every row of the adapter. Only then do rows that share a
        prompt forward it once (:mod:`marlow.shared_prompts`). A mini-batch drawn at random
        from the batch is scored one row a sequence: the rows of one prompt it holds depend on
        the routing (an IP adapter's mini-batch holds one role's turns, an SP mini-batch mixes
        roles, so fewer of its rows share a prompt), and sharing there made Voting's IP step 5%
        cheaper than SP's for no reason of the algorithm (``bench/step_cost.py``: IP/SP 0.949,
        1.005 without)."""
        total_loss = torch.zeros((), device=self.device)  # read once per update, after backwards
        own = GradientParts(self.params, self.ranks) if self.rows.measured else None
        keys, adapter = self.rows.keys, self.batch.adapter
        adapted = folded(self.model, adapter) if self.fold else use_adapter(self.model, adapter)
        with adapted, held_factors():  # the factors cast once for the mini-batch
            for local, s in score_rows(
                self.model,
                self.batch,
                idx,
                temperature=self.temperature,
                micro_tokens=self.cfg.micro_tokens,
                keys=[keys[i] for i in idx],
                share_prompts=whole,
                entropy=self.old is not None,  # read only where logp_old is this forward's
            ):
                rows = [idx[j] for j in local]
                if own is not None:
                    own.enter(keys[rows[0]])
                w = weights[local, : s.mask.shape[1]]  # the micro-batch's token weights
                total_loss = total_loss + self.micro_batch(s, rows, w)
        return own, total_loss

    def micro_batch(self, s: Scored, rows: list[int], weights: torch.Tensor) -> torch.Tensor:
        """The micro-batch's policy loss weighed by ``weights`` (its rows' token weights),
        backpropagated; its clip fractions and ratios metered. Returns the loss, detached."""
        width = s.mask.shape[1]
        old_lp = self.batch.old_logp[rows, :width] if self.old is None else self.old.take(s, rows)
        token_loss, out = self.loss_fn(self.loss_inputs(s, rows, old_lp), self.settings)  # (T, L)
        loss = (weights.to(s.logp.dtype) * token_loss).sum()
        loss.backward()
        _ratio_stats(self.meter, [self.batch.roles[i] for i in rows], out, s.mask)
        return loss.detach()

    def loss_inputs(self, s: Scored, rows: list[int], old_logp: torch.Tensor) -> LossInputs:
        """The policy loss's inputs for the micro-batch: the sampler's log-probs under
        ``rollout_correction=truncate``, the base's and the KL weights where a row has one."""
        width, dtype, batch = s.mask.shape[1], s.logp.dtype, self.batch
        truncate = self.settings.rollout_correction == "truncate"
        beta = [self.beta[i] for i in rows]
        kl = any(beta)  # mitigate.kl_coef
        return LossInputs(
            logp=s.logp,
            old_logp=old_logp,
            advantages=batch.advantages[rows].to(dtype),
            sampler_logp=batch.sampler_logp[rows, :width] if truncate else None,
            base_logp=batch.base_logp[rows, :width].to(dtype) if kl else None,
            kl_coef=torch.tensor(beta, dtype=dtype, device=self.device) if kl else None,
        )

    def step(self, own: GradientParts | None, total_loss: torch.Tensor) -> None:
        """The update's gradient mitigated (:func:`_mitigate`), summed with the loss over the
        ranks, refused when not finite, clipped and stepped; its norm and loss metered."""
        rows, adapter, meter = self.rows, self.batch.adapter, self.meter
        mitigated = own is not None and _mitigate(
            own, rows.parts, rows.roles, rows.shared, self.mitigate, meter
        )
        if self.ranks.size > 1:
            _sum_over_ranks(self.ranks, self.params, total_loss, mitigated)
        loss_value = float(total_loss)
        if not math.isfinite(loss_value):  # its gradients are dropped when the step is undone
            raise NonFiniteLoss(f"loss is {loss_value}")
        norm = self.optim.update(adapter)
        if not math.isfinite(norm):
            raise NonFiniteLoss(f"gradient norm is {norm}")
        meter.mean(adapter, "grad_norm", norm, 1, also_all=False)
        meter.max(adapter, "grad_norm_max", norm, also_all=False)
        meter.mean(adapter, "loss", loss_value, 1, also_all=False)
        self.updates += 1

    def finish(self) -> None:
        """Hand the fused logp_old to the batch; meter the step's updates and learning rate."""
        adapter = self.batch.adapter
        if self.old is not None:
            self.batch.old_logp, self.batch.entropy = self.old.logp, self.old.entropy
        self.meter.set(adapter, "updates", self.updates)
        self.meter.set(adapter, "lr", self.optim.current_lr(adapter))
        self.optim.end_role_update(adapter)


def _sum_over_ranks(
    ranks: Ranks, params: Sequence[torch.Tensor], total_loss: torch.Tensor, mitigated: bool
) -> None:
    """Every rank's share of the mini-batch's loss and gradient, summed in place; a mitigated
    gradient holds every rank's sum already (:meth:`GradientParts.finish`): then only the loss."""
    grads = []
    if not mitigated:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
    ranks.sum_([total_loss, *grads])


def _mitigate(
    own: GradientParts,
    parts: list[Part],
    roles: list[str],
    shared: bool,
    mitigate: MitigateConfig,
    meter: Meter,
) -> bool:
    """Measure the update's per-role gradients (``grad_norm_own``, ``grad_mass_share`` under a
    shared adapter) and apply coherence damping and role balance (:func:`update_adapter`).
    Returns whether ``.grad`` was rewritten (then it already holds every rank's sum)."""
    vectors = own.finish(parts)
    weight = dict.fromkeys(parts, 1.0)
    if shared:
        _share_stats(meter, roles, _role_vectors(vectors, weight))
    if mitigate.coherence_threshold is not None:
        _damp_slots(vectors, weight, parts, roles, mitigate.coherence_threshold, meter)
    if mitigate.role_balance and shared:
        _balance_roles(vectors, weight, parts)
    if all(w == 1.0 for w in weight.values()):
        return False
    own.write(weight)
    return True


def _role_vectors(
    vectors: dict[Part, torch.Tensor], weight: dict[Part, float]
) -> dict[str, torch.Tensor]:
    """Each role's gradient: the weighted sum of its parts'."""
    out: dict[str, torch.Tensor] = {}
    for part, vec in vectors.items():
        out[_role(part)] = out.get(_role(part), 0) + weight[part] * vec
    return out


def _share_stats(meter: Meter, roles: list[str], by_role: dict[str, torch.Tensor]) -> None:
    """``grad_norm_own`` and ``grad_mass_share`` of each role (a role absent from this
    mini-batch has share 0 in it); one read of the device."""
    norms = dict(zip(roles, torch.stack([by_role[r].norm() for r in roles]).tolist(), strict=True))
    total = sum(norms.values())
    for role in roles:
        share = norms[role] / total if total > 0 else 0.0
        meter.mean(role, "grad_norm_own", norms[role], 1, also_all=False)
        meter.mean(role, "grad_mass_share", share, 1, also_all=False)


def _damp_slots(
    vectors: dict[Part, torch.Tensor],
    weight: dict[Part, float],
    parts: list[Part],
    roles: list[str],
    threshold: float,
    meter: Meter,
) -> None:
    """Coherence damping: the N >= 2 slots of a role scale their weights by 1 / (1 + (N - 1) c)
    when their gradients' mean pairwise cosine c exceeds ``threshold``; c and the factor are
    metered per role."""
    for role in roles:
        slots = [p for p in parts if _role(p) == role]
        if len(slots) < 2:
            continue
        c = _mean_cosine([vectors[p] for p in slots])
        factor = 1.0 / (1.0 + (len(slots) - 1) * c) if c > threshold else 1.0
        for p in slots:
            weight[p] *= factor
        meter.mean(role, "slot_coherence", c, 1, also_all=False)
        meter.mean(role, "slot_damping", factor, 1, also_all=False)


def _balance_roles(
    vectors: dict[Part, torch.Tensor], weight: dict[Part, float], parts: list[Part]
) -> None:
    """Role balance: each role's parts scale their weights so that the role's gradient norm
    becomes the mean of the roles' nonzero norms (a role with a zero gradient is left as it is)."""
    norms = {r: float(v.norm()) for r, v in _role_vectors(vectors, weight).items()}
    live = [n for n in norms.values() if n > 0]
    if not live:
        return
    target = sum(live) / len(live)
    for part in parts:
        n = norms[_role(part)]
        weight[part] *= target / n if n > 0 else 1.0


def _mean_cosine(vectors: list[torch.Tensor]) -> float:
    """Mean pairwise cosine similarity of the vectors (a zero vector counts as cosine 0)."""
    unit = torch.stack([v / v.norm() if float(v.norm()) > 0 else v for v in vectors])
    sims = unit @ unit.T  # (N, N)
    n = len(vectors)
    return float((sims.sum() - sims.diagonal().sum()) / (n * (n - 1)))


class GradientParts:
    """Each part's own gradient (a role, or a role's slot) in one update, from snapshots of the
    accumulated gradient taken where the (part-consecutive) micro-batches switch part. Snapshots
    and differences stay on the gradients' device (float32, the LoRA weights' dtype);
    :meth:`finish` sums each part's gradient over the data-parallel ranks; :meth:`write` puts a
    weighted sum of the parts back as the gradient."""

    def __init__(self, params: Sequence[torch.Tensor], ranks: Ranks = SOLO) -> None:
        self.params = list(params)
        self.ranks = ranks
        self.part: object = None
        self.before: list[torch.Tensor] = []
        self.own: dict[object, torch.Tensor] = {}  # part -> its gradient, flattened

    def _grads(self) -> list[torch.Tensor]:
        return [
            torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params
        ]

    def enter(self, part: object) -> None:
        if part == self.part:
            return
        if part in self.own:
            raise RuntimeError(f"micro-batches of {part!r} are not consecutive")
        now = self._grads()
        self._close(now)
        self.part, self.before = part, now

    def _close(self, now: list[torch.Tensor]) -> None:
        if self.part is not None:
            diff = [(a - b).reshape(-1) for a, b in zip(now, self.before, strict=True)]
            self.own[self.part] = torch.cat(diff)

    def finish(self, parts: Sequence[object]) -> dict[object, torch.Tensor]:
        """The gradient of each of ``parts`` in this update (a part without rows here has a
        zero gradient on this rank), summed over the ranks."""
        self._close(self._grads())
        self.part = None
        size = sum(p.numel() for p in self.params)
        device = self.params[0].device
        own = [self.own[k] if k in self.own else torch.zeros(size, device=device) for k in parts]
        self.ranks.sum_(own)
        self.own = dict(zip(parts, own, strict=True))
        return self.own

    def write(self, weights: dict[object, float]) -> None:
        """``.grad`` = sum over parts of weight * gradient (every rank's, after :meth:`finish`)."""
        total = sum(w * self.own[k] for k, w in weights.items())
        start = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[start : start + n].view_as(p).clone()
            start += n


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
    new, _ = _score_all(model, batch, batch.adapter, temperature, micro_tokens, entropy=False)
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


def probe_logp(model, batch: AdapterBatch) -> torch.Tensor:
    """Log-probs of the batch's probe turn (:func:`probe_row`) under its adapter, at temperature 1:
    the trainer's side of the adapter-sync check (:mod:`marlow.training.sync`) and, on steps
    without the post-update rescoring, the cheap finiteness check of the updated policy. That
    check is made at temperature 1 rather than the sampling temperature so that one forward serves
    both: NaN or infinite logits, what a broken update gives, fail it at any temperature; the two
    could differ only on logits near float32's largest value."""
    row = probe_row(batch)
    with torch.no_grad(), use_adapter(model, batch.adapter):
        _, scored = next(
            score_rows(model, batch, [row], temperature=1.0, micro_tokens=1, entropy=False)
        )
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
    "score_base",
    "score_old",
    "update_adapter",
]
