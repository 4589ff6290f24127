"""Credit assignment: the advantage of every trained turn of a step, as one pure function.

Input is one row per turn (:class:`CreditRows`, plain columns: no ``Turn`` objects, no ``id()``
keys); output is one advantage per row, in row order, and ``frac_reward_zero_std``.

An *item* is what carries one reward into the group statistics of
:func:`~marlow.algo.advantages.group_advantages`:

* broadcast credit (no turn of the episode has its own reward): the episode's reward is carried by
  one item per episode under scope ``problem`` (grouped per problem), one per (episode, role) under
  ``role`` (grouped per (problem, role)), one per (episode, role, slot, round) under ``slot``
  (grouped per (problem, role, slot, round)), as the paper's code keeps ``generator0``,
  ``generator1``, ... apart. Every turn of an item gets the item's advantage.
* per-role credit (``grpo.credit: role``; a turn carries its own reward, see
  ``marlow.workflows.role_rewards``): each turn is its own item, grouped per (problem, role) under scope
  ``role`` and per (problem, role, slot, round) under ``slot`` and ``problem`` (a turn's own reward
  is only comparable with its own slot's, so per problem means per slot there, as it does for a
  broadcast reward). A turn without its own reward in such an episode carries the episode's.

* scope ``trajectory`` (the official code's groups, rllm's ``(task id, trajectory name)``): each
  turn is its own item, carrying its own reward under per-role credit and the episode's
  otherwise, grouped per (problem, trajectory name): a Voting voter's slot (``generator0``), or
  a role whose slots and rounds are one trajectory (every generator turn of Eval-Opt's episodes
  of a problem in one group, its evaluator turns in another). A workflow file's stage names its
  turns (``trajectory: role|slot``). An episode with more turns of a role weighs more in its
  group: 4 right one-turn episodes and 4 wrong three-turn ones give +1.68 / -0.56 (unbiased std).

Then, optionally, a turn's advantage is multiplied by its role's weight (``role_weights``) and
divided by the number of same-role turns in its episode and round (``same_role_weighting``).

``frac_reward_zero_std`` is counted on these very items and groups (the rewards that define the
advantages), so under per-role credit or a finer scope it is the fraction of groups that give no
gradient, not the fraction of problems whose episode rewards are equal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from marlow.algo.advantages import group_advantages, group_keys, zero_std_fraction
from marlow.choices import AdvantageScope

SCOPES: tuple[str, ...] = get_args(AdvantageScope)

__all__ = ["SCOPES", "CreditRows", "turn_advantages"]


@dataclass(frozen=True)
class CreditRows:
    """One row per turn, every column of the same length T."""

    episode: Sequence[int]  # the turn's episode, any id unique within the step
    group: Sequence[int]  # the episode's problem within the step
    role: Sequence[str]
    slot: Sequence[int]
    round: Sequence[int]
    episode_reward: Sequence[float]
    own_reward: Sequence[float | None]  # the turn's own reward (per-role credit), else None
    trajectory: Sequence[str] = ()  # the turn's trajectory name (Turn.trajectory); () or "": role


def turn_advantages(
    rows: CreditRows,
    scope: str,
    eps: float,
    same_role_weighting: bool = False,
    role_weights: Mapping[str, float] | None = None,
) -> tuple[Tensor, float, int]:
    """((T,) float64 advantages in row order, frac_reward_zero_std, the number of groups it is a
    fraction of); see the module docstring. Data-parallel ranks merge the fraction weighted by
    their groups (a problem's groups vary with the scope: Eval-Opt's revision rounds)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown advantage scope {scope!r}; valid: {', '.join(SCOPES)}")
    n = len(rows.role)
    own_credit = {
        e for e, own in zip(rows.episode, rows.own_reward, strict=True) if own is not None
    }
    item_of: dict[tuple, int] = {}  # item key -> item index
    group_of_item: list[tuple] = []
    reward_of_item: list[float] = []
    turn_item: list[int] = []
    for i in range(n):
        e, g, role = rows.episode[i], rows.group[i], rows.role[i]
        place = (role, rows.slot[i], rows.round[i])
        if scope == "trajectory":
            own = rows.own_reward[i] if e in own_credit else None
            name = (rows.trajectory[i] if rows.trajectory else "") or role
            item, group = ("turn", i), (g, name)
            reward = rows.episode_reward[i] if own is None else own
        elif e in own_credit:
            item = ("turn", i)
            group = (g, role) if scope == "role" else (g, *place)
            own = rows.own_reward[i]
            reward = rows.episode_reward[i] if own is None else own
        else:
            where = {"problem": (), "role": (role,), "slot": place}[scope]
            item, group, reward = ("episode", e, *where), (g, *where), rows.episode_reward[i]
        if item not in item_of:
            item_of[item] = len(group_of_item)
            group_of_item.append(group)
            reward_of_item.append(float(reward))
        turn_item.append(item_of[item])
    rewards = torch.tensor(reward_of_item, dtype=torch.float64)  # (K,)
    index = group_keys(group_of_item)  # (K,)
    adv = group_advantages(rewards, index, eps=eps)[torch.tensor(turn_item, dtype=torch.long)]
    if role_weights:
        adv = adv * torch.tensor([role_weights.get(r, 1.0) for r in rows.role], dtype=adv.dtype)
    if same_role_weighting:
        key = list(zip(rows.episode, rows.role, rows.round, strict=True))
        count = Counter(key)
        adv = adv / torch.tensor([count[k] for k in key], dtype=adv.dtype)
    return adv, zero_std_fraction(rewards, index), int(index.unique().numel())
