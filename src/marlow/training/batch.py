"""The step's batch record: every trained turn as padded tensors, made once per adapter.

Built right after the rewards (:func:`build_batches`), it holds for each trained turn its token
ids, completion mask, role, group, reward, advantage and sampler log-probs; scoring adds the
log-probs and entropies of the policy before the update (``old_logp``, ``entropy``). The update,
the diagnostics and the finiteness checks all read this record; none keeps a copy of the turns'
data. Its tensors are built once and moved once to the model's device (``build_batches(device=)``);
micro-batches (:meth:`AdapterBatch.chunk`) are slices on that device, and log-probs stay there.
The lengths are also kept on the host (``seq_len``, ``completion_len``), known from the turns'
token lists: every shape (micro-batch cuts, padded widths) is decided without reading the device.

Layout per adapter, N turns, S = longest prompt + completion, L = longest completion::

    ids          (N, S) long   prompt then completion, right-padded with the pad id
    prompt_len   (N,)   long
    targets      (N, L) long   completion ids, 0 on padding
    mask         (N, L) bool   True on real completion tokens
    sampler_logp (N, L) float32  the sampler's log-probs, 0 on padding
    rewards, advantages (N,) float32
    old_logp, entropy (N, L) float32, 0 on padding (set by scoring)
    seq_len, completion_len    N ints on the host: prompt + completion, completion lengths

Turns on the frozen base (``__base__``) are not trained and have no batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from marlow.algo.turn_advantages import CreditRows
from marlow.types import BASE, Episode, Turn, missing_reason


@dataclass
class Chunk:
    """Some rows of an :class:`AdapterBatch`, cut to their own longest sequence and completion."""

    rows: list[int]  # indices into the adapter's batch
    ids: Tensor  # (T, S')
    attention: Tensor  # (T, S') long
    prompt_len: Tensor  # (T,)
    targets: Tensor  # (T, L')
    mask: Tensor  # (T, L') bool

    @classmethod
    def full_rows(cls, ids: Tensor, prompt: int) -> Chunk:
        """Every row of ``ids`` (T, S), none padded: its first ``prompt`` tokens its prompt,
        the rest its completion, every completion token scored (the micro-batch the benchmarks
        time and count)."""
        rows = ids.shape[0]
        prompt_len = torch.full((rows,), prompt, dtype=torch.long, device=ids.device)
        mask = torch.ones_like(ids[:, prompt:], dtype=torch.bool)
        return cls(list(range(rows)), ids, torch.ones_like(ids), prompt_len, ids[:, prompt:], mask)


@dataclass
class AdapterBatch:
    """The step's trained turns of one adapter (see the module docstring for the layout)."""

    adapter: str
    turns: list[Turn]  # for text-level diagnostics (samples, signatures) only
    roles: list[str]
    groups: Tensor
    rewards: Tensor
    advantages: Tensor
    ids: Tensor
    prompt_len: Tensor
    targets: Tensor
    mask: Tensor
    sampler_logp: Tensor
    seq_len: list[int]
    completion_len: list[int]
    old_logp: Tensor | None = None
    entropy: Tensor | None = None
    base_logp: Tensor | None = None  # (N, L) under the base (grpo.score_base); 0 on unscored rows

    def __len__(self) -> int:
        return len(self.roles)

    def by_role(self) -> dict[str, list[int]]:
        """Row indices of each role, roles in order of first appearance."""
        out: dict[str, list[int]] = {}
        for i, role in enumerate(self.roles):
            out.setdefault(role, []).append(i)
        return out

    def chunk(self, rows: Sequence[int]) -> Chunk:
        rows = list(rows)
        device = self.ids.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        seq = max(self.seq_len[r] for r in rows)
        width = max(self.completion_len[r] for r in rows)
        seq_len = self.prompt_len[index] + self.mask[index].sum(1)  # (T,)
        attention = (torch.arange(seq, device=device)[None, :] < seq_len[:, None]).long()
        return Chunk(
            rows,
            self.ids[index, :seq],
            attention,
            self.prompt_len[index],
            self.targets[index, :width],
            self.mask[index, :width],
        )


def empty_batch(adapter: str, device: torch.device | str = "cpu") -> AdapterBatch:
    """An adapter's batch with no rows: a data-parallel rank whose problems gave the adapter no
    turn still takes part in its update (its share of the gradient is zero)."""
    long, flat = torch.zeros((0, 0), dtype=torch.long, device=device), torch.zeros(0, device=device)
    return AdapterBatch(
        adapter=adapter,
        turns=[],
        roles=[],
        groups=torch.zeros(0, dtype=torch.long, device=device),
        rewards=flat,
        advantages=flat,
        ids=long,
        prompt_len=torch.zeros(0, dtype=torch.long, device=device),
        targets=long,
        mask=torch.zeros((0, 0), dtype=torch.bool, device=device),
        sampler_logp=torch.zeros((0, 0), device=device),
        seq_len=[],
        completion_len=[],
    )


def credit_rows(episodes: Sequence[Episode]) -> tuple[list[Turn], CreditRows]:
    """Every turn of the step that has a reward, in episode order, and the columns credit
    assignment reads. A turn without a reward (None, NaN, inf: a user's reward that failed)
    is left out: it is in no group's advantage and gets no gradient."""
    turns: list[Turn] = []
    cols: dict[str, list] = {k: [] for k in CreditRows.__dataclass_fields__}
    for e, ep in enumerate(episodes):
        for t in ep.turns:
            if missing_reason(ep.reward_of(t)) is not None:
                continue
            turns.append(t)
            cols["episode"].append(e)
            cols["group"].append(ep.group)
            cols["role"].append(t.role)
            cols["slot"].append(t.slot)
            cols["round"].append(t.round)
            cols["episode_reward"].append(ep.reward)
            cols["own_reward"].append(t.reward)
            cols["trajectory"].append(t.trajectory)
    return turns, CreditRows(**cols)


def build_batches(
    turns: Sequence[Turn],
    rows: CreditRows,
    advantages: Tensor,
    pad_id: int,
    device: torch.device | str = "cpu",
) -> dict[str, AdapterBatch]:
    """One :class:`AdapterBatch` per adapter that has trained turns, in order of first appearance,
    its tensors on ``device``."""
    members: dict[str, list[int]] = {}
    for i, t in enumerate(turns):
        if t.adapter != BASE:
            members.setdefault(t.adapter, []).append(i)
    return {
        adapter: _pack(adapter, [turns[i] for i in idx], rows, idx, advantages, pad_id, device)
        for adapter, idx in members.items()
    }


def _pack(
    adapter: str,
    turns: list[Turn],
    rows: CreditRows,
    idx: list[int],
    advantages: Tensor,
    pad_id: int,
    device: torch.device | str,
) -> AdapterBatch:
    n = len(turns)
    seq_len = [len(t.prompt_ids) + len(t.completion_ids) for t in turns]
    completion_len = [len(t.completion_ids) for t in turns]
    width = max(completion_len)
    ids = torch.full((n, max(seq_len)), pad_id, dtype=torch.long)
    targets = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    sampler = torch.zeros(n, width, dtype=torch.float32)
    for i, t in enumerate(turns):
        k = len(t.completion_ids)
        ids[i, : seq_len[i]] = torch.tensor(t.prompt_ids + t.completion_ids, dtype=torch.long)
        targets[i, :k] = torch.tensor(t.completion_ids, dtype=torch.long)
        mask[i, :k] = True
        sampler[i, :k] = torch.tensor(t.sampler_logprobs, dtype=torch.float32)
    index = torch.tensor(idx, dtype=torch.long)
    reward = [
        rows.episode_reward[i] if rows.own_reward[i] is None else rows.own_reward[i] for i in idx
    ]
    return AdapterBatch(
        adapter=adapter,
        turns=turns,
        roles=[t.role for t in turns],
        groups=torch.tensor([rows.group[i] for i in idx], dtype=torch.long).to(device),
        rewards=torch.tensor(reward, dtype=torch.float32).to(device),
        advantages=advantages[index].to(device=device, dtype=torch.float32),
        ids=ids.to(device),
        prompt_len=torch.tensor([len(t.prompt_ids) for t in turns], dtype=torch.long).to(device),
        targets=targets.to(device),
        mask=mask.to(device),
        sampler_logp=sampler.to(device),
        seq_len=seq_len,
        completion_len=completion_len,
    )
