"""GRPO's math as a small pure core: functions over tensors, no config, no I/O, no roles.

* `advantages`: group-relative advantages and the group ids that define an advantage scope.
* `turn_advantages`: a step's per-turn advantages under an advantage scope and credit rule.
* `losses`: the PPO clipped surrogate (clip-higher) and the loss aggregation modes, by name.
* `policy_loss`: the per-token policy loss, registered by name (``grpo.policy_loss``).
* `estimators`: masked means and the per-token estimators behind the metrics (entropy, chi2, k3
  KL, perplexity, clip fractions).
* `matmul`: the matrix products of the update's own backward passes, their operands laid out
  the way the machine's GEMM computes fast (a CPU without native bfloat16).

Each module's docstring writes out its formulas.
"""

from marlow.algo.advantages import group_advantages, group_keys, zero_std_fraction
from marlow.algo.estimators import (
    chi2_token,
    clip_fractions,
    kl_k3,
    masked_mean,
    max_ratio,
    perplexity,
    token_logprobs_and_entropy,
)
from marlow.algo.losses import (
    AGGREGATIONS,
    SurrogateOut,
    aggregate,
    clipped_surrogate,
    rollout_is_weights,
    token_weights,
)

__all__ = [
    "AGGREGATIONS",
    "SurrogateOut",
    "aggregate",
    "chi2_token",
    "clip_fractions",
    "clipped_surrogate",
    "group_advantages",
    "group_keys",
    "kl_k3",
    "masked_mean",
    "max_ratio",
    "perplexity",
    "rollout_is_weights",
    "token_logprobs_and_entropy",
    "token_weights",
    "zero_std_fraction",
]
