"""Group-relative advantages (GRPO), as small pure functions over tensors.

For K scored items (episodes, or the turns of one role, or one slot...) each carrying a group id g:

    mean_g = (1 / n_g) * sum_{i in g} R_i
    std_g  = sqrt( (1 / (n_g - 1)) * sum_{i in g} (R_i - mean_g)^2 )      (Bessel's correction)
    A_i    = (R_i - mean_g) / (std_g + eps)                               eps = 1e-6, as in verl

Departures from the textbook formula, both deliberate:

* A group whose rewards are all equal gives A = 0 *exactly*. Computed naively, (R - mean) is a
  rounding residue c (three float64 rewards of 0.1 have mean 0.10000000000000002), the same for
  every item, so std = sqrt(n / (n - 1)) * |c| and A = c / (std + eps): tiny while |c| << eps, but
  close to +-1 once |c| >> eps (seven float32 rewards of 1000.1 leave c = -6.1e-5). Flat groups are
  therefore detected by min == max and zeroed; `zero_std_fraction` counts them.
* A group of one item has no Bessel std (n - 1 = 0). It follows verl
  (``compute_grpo_outcome_advantage``): mean 0 and std 1, so A = R / (1 + eps). Such groups
  arise from the data, not the config (``grpo.group_size`` >= 2): an Eval-Opt revision round
  reached by one episode of a problem, grouped per slot and round. A singleton is therefore not
  "zero std" for `zero_std_fraction` (its advantage is R, not 0).

What a "group" is (per problem, per role, per slot) is the trainer's *advantage scope*: it builds
one hashable key per item, e.g. (problem, role, slot), and `group_keys` turns the keys into ids.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

__all__ = ["group_advantages", "group_keys", "zero_std_fraction"]


def group_keys(keys: Sequence[Hashable]) -> Tensor:
    """Map arbitrary hashable keys to dense group ids 0..G-1, numbered in first-seen order.

    >>> group_keys([("p1", "gen"), ("p0", "gen"), ("p1", "gen")]).tolist()
    [0, 1, 0]
    """
    ids: dict[Hashable, int] = {}
    dense = [ids.setdefault(key, len(ids)) for key in keys]
    return torch.tensor(dense, dtype=torch.long)  # (K,)


def _check_inputs(rewards: Tensor, group_index: Tensor) -> None:
    if rewards.dim() != 1 or group_index.dim() != 1:
        raise ValueError(
            "rewards and group_index must be 1-D tensors of shape (K,); got shapes "
            f"{tuple(rewards.shape)} and {tuple(group_index.shape)}"
        )
    if rewards.shape != group_index.shape:
        raise ValueError(
            f"rewards has {rewards.numel()} items but group_index has {group_index.numel()}; "
            "give one group id per reward"
        )
    if group_index.dtype != torch.long:
        raise ValueError(
            f"group_index must be a torch.long tensor, got {group_index.dtype}; "
            "build it with group_keys(...) or .long()"
        )


def _group_extrema(rewards: Tensor, inverse: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """Per-group (min, max) of `rewards`, both (G,)."""
    lo = rewards.new_full((n_groups,), float("inf")).scatter_reduce(
        0, inverse, rewards, reduce="amin"
    )
    hi = rewards.new_full((n_groups,), float("-inf")).scatter_reduce(
        0, inverse, rewards, reduce="amax"
    )
    return lo, hi


def group_advantages(rewards: Tensor, group_index: Tensor, eps: float = 1e-6) -> Tensor:
    """A_i = (R_i - mean_g) / (std_g + eps) per group, std with Bessel's correction.

    Args:
        rewards: (K,) one scalar reward per item; any real dtype.
        group_index: (K,) torch.long group id per item. Ids need not be dense or sorted.
        eps: added to the std, not the variance (verl's convention).

    Returns:
        (K,) advantages in the rewards' floating dtype (float32 for integer rewards). Items of a
        group of two or more whose rewards are all equal get exactly 0; the item of a group of
        one gets R / (1 + eps) (verl). The result carries no gradient (advantages are constants
        in the policy loss).
    """
    _check_inputs(rewards, group_index)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    if rewards.numel() == 0:
        return rewards.detach().to(out_dtype)

    r = rewards.detach().to(torch.float64)  # (K,) float64 keeps group sums exact
    _, inverse = torch.unique(group_index, return_inverse=True)  # (K,) dense ids 0..G-1
    n_groups = int(inverse.max()) + 1

    count = torch.bincount(inverse, minlength=n_groups).to(r.dtype)  # (G,)
    total = r.new_zeros(n_groups).index_add_(0, inverse, r)  # (G,)
    mean = total / count  # (G,)
    centred = r - mean[inverse]  # (K,)
    sq_dev = r.new_zeros(n_groups).index_add_(0, inverse, centred * centred)  # (G,)
    # Bessel: divide by n - 1. Singletons would divide by zero; verl's mean 0, std 1 instead.
    var = sq_dev / (count - 1).clamp_min(1)  # (G,)
    single = count == 1  # (G,)
    std = torch.where(single, torch.ones_like(var), var.sqrt())  # (G,)
    centred = torch.where(single[inverse], r, centred)  # (K,) R - 0 for a singleton

    flat = _flat_groups(r, inverse, n_groups, count)  # (G,)
    adv = centred / (std[inverse] + eps)  # (K,)
    adv = torch.where(flat[inverse], torch.zeros_like(adv), adv)  # (K,) exact zeros, never NaN
    return adv.to(out_dtype)


def _flat_groups(r: Tensor, inverse: Tensor, n_groups: int, count: Tensor) -> Tensor:
    """(G,) bool: groups of two or more items whose rewards are all equal."""
    lo, hi = _group_extrema(r, inverse, n_groups)  # (G,), (G,)
    return (lo == hi) & (count > 1)


def zero_std_fraction(rewards: Tensor, group_index: Tensor) -> float:
    """Fraction of groups of two or more items whose rewards are all equal (TRL's
    `frac_reward_zero_std`), over all groups.

    These groups get A = 0 and so contribute no gradient. A group of one is not counted (it gets
    A = R, see the module docstring). Returns 0.0 when there are no items.
    """
    _check_inputs(rewards, group_index)
    if rewards.numel() == 0:
        return 0.0
    _, inverse = torch.unique(group_index, return_inverse=True)  # (K,)
    n_groups = int(inverse.max()) + 1
    count = torch.bincount(inverse, minlength=n_groups)  # (G,)
    flat = _flat_groups(rewards.detach().to(torch.float64), inverse, n_groups, count)  # (G,)
    return float(flat.double().mean())
