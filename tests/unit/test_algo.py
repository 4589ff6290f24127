"""Unit tests for marlow.algo: hand-worked values (the arithmetic is in the comments) plus
properties (zero-variance groups, padding invariance, micro-batch split invariance)."""

from __future__ import annotations

import math

import pytest
import torch

from marlow import algo

F64 = torch.float64
TOL = 1e-12  # float64 cases
TOL32 = 1e-6  # float32 cases
EPS = 1e-6


def t64(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def ids(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def close(actual: torch.Tensor, expected: object, tol: float = TOL) -> None:
    """assert_close with an absolute tolerance only; `expected` may be a number or nested list."""
    if not isinstance(expected, torch.Tensor):
        expected = torch.tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


# --- advantages --------------------------------------------------------------------------------

# Hand cases: (rewards, group ids, expected A). eps = 1e-6 is added to the std.
#   one group  R = [1, 0, 0, 1]: mean 0.5, deviations +-0.5, sum sq = 4 * 0.25 = 1,
#     Bessel var = 1/3, std = 0.5773502691896258, A = +-0.5 / (std + eps) = +-0.8660239...
#   two groups, sparse interleaved ids 7 and 3:
#     group 7, R = [1, 0, 0]: mean 1/3, deviations [2/3, -1/3, -1/3], sum sq = 2/3,
#       var = (2/3) / 2 = 1/3, std = 1/sqrt(3)
#     group 3, R = [2, 4]: mean 3, deviations [-1, 1], sum sq = 2, var = 2 / 1, std = sqrt(2)
#   flat group [0.1, 0.1, 0.1]: float64 mean 0.10000000000000002, so the naive formula gives
#     -1.4e-11, not 0; a 2-item group [1, 0] beside it: std = sqrt(0.5), A = +-0.5 / (std + eps)
#   singleton [3]: no Bessel std; verl's mean 0, std 1: A = 3 / (1 + eps); beside it [1, 0]
S3, S2, SH = 1 / math.sqrt(3) + EPS, math.sqrt(2) + EPS, math.sqrt(0.5) + EPS
G7 = (1 / 3) / S3  # a deviation of 1/3 in group 7 of the two-group case
ADV_CASES = {
    "one_group": ([1, 0, 0, 1], [0, 0, 0, 0], [0.5 / S3, -0.5 / S3, -0.5 / S3, 0.5 / S3]),
    "two_groups": ([1, 2, 0, 4, 0], [7, 3, 7, 3, 7], [2 * G7, -1 / S2, -G7, 1 / S2, -G7]),
    "flat_group": ([0.1, 0.1, 0.1, 1, 0], [0, 0, 0, 1, 1], [0, 0, 0, 0.5 / SH, -0.5 / SH]),
    "singleton": ([3, 1, 0], [0, 1, 1], [3 / (1 + EPS), 0.5 / SH, -0.5 / SH]),
}


@pytest.mark.parametrize("case", ADV_CASES)
def test_group_advantages_hand_cases(case: str) -> None:
    rewards, groups, expected = ADV_CASES[case]
    a = algo.group_advantages(t64(rewards), ids(groups))
    close(a, expected)
    assert (a[torch.tensor(expected) == 0] == 0).all()  # flat groups: exactly 0, never NaN


def test_group_advantages_contract() -> None:
    # seven float32 rewards of 1000.1: a naive float32 mean leaves a residue of -6.1e-5 >> eps,
    # which would give A = -0.912 for every item.
    a = algo.group_advantages(torch.full((7,), 1000.1), ids([0] * 7))
    assert a.dtype == torch.float32 and (a == 0).all()
    # integer rewards [1, 0]: float output, A = +-0.5 / (sqrt(0.5) + eps); no gradient
    a = algo.group_advantages(ids([1, 0]), ids([0, 0]))
    assert a.dtype == torch.get_default_dtype()
    close(a, [0.5 / SH, -0.5 / SH], tol=TOL32)
    assert not algo.group_advantages(t64([1, 0]).requires_grad_(), ids([0, 0])).requires_grad
    assert algo.group_advantages(t64([]), ids([])).shape == (0,)
    assert algo.zero_std_fraction(t64([]), ids([])) == 0.0
    with pytest.raises(ValueError, match="one group id per reward"):
        algo.group_advantages(t64([1.0, 0.0]), ids([0]))
    with pytest.raises(ValueError, match="torch.long"):
        algo.group_advantages(t64([1.0, 0.0]), torch.tensor([0, 0], dtype=torch.int32))


def test_zero_std_fraction_group_keys_and_scopes() -> None:
    # groups: {1, 1} flat, {0, 1} not, {5} a singleton (A = R, not flat) -> 1 / 3
    frac = algo.zero_std_fraction(t64([1, 0, 1, 1, 5]), ids([0, 1, 0, 1, 2]))
    assert frac == pytest.approx(1 / 3, abs=1e-15)
    keys = [("p1", "gen", 0), ("p0", "gen", 0), ("p1", "gen", 0), ("p1", "agg", 0)]
    assert algo.group_keys(keys).dtype == torch.long
    assert algo.group_keys(keys).tolist() == [0, 1, 0, 2]  # first-seen order
    assert algo.group_keys([]).tolist() == []
    # One problem, two roles, R = [1, 1, 0, 0]. Per problem: one group, A = +-0.866...
    # Per role: gen gets [1, 1] and agg gets [0, 0], both flat -> 0.
    rewards = t64([1, 1, 0, 0])
    per_problem = algo.group_advantages(rewards, algo.group_keys(["p"] * 4))
    per_role = algo.group_advantages(rewards, algo.group_keys(["gen", "gen", "agg", "agg"]))
    assert (per_problem.abs() > 0.8).all() and (per_role == 0).all()


# --- clipped surrogate -------------------------------------------------------------------------

# Ratios r per column: 1.1 (inside [0.8, 1.28]), 1.5 (above), 0.5 (below). Row 0 has A = +1,
# row 1 has A = -2. logp_old = 0 and logp_new = log r.
#   A = +1: r=1.1 -> -min(1.1, 1.1) = -1.1;  r=1.5 -> -min(1.5, 1.28) = -1.28 (clipped high);
#           r=0.5 -> -min(0.5, 0.8) = -0.5 (unclipped branch is the min, not clipped)
#   A = -2: r=1.1 -> -min(-2.2, -2.2) = 2.2; r=1.5 -> -min(-3.0, -2.56) = 3.0 (not clipped);
#           r=0.5 -> -min(-1.0, -1.6) = 1.6 (clipped low)
RATIOS = [[1.1, 1.5, 0.5], [1.1, 1.5, 0.5]]


def _surrogate_case(per_token_adv: bool = False) -> tuple[torch.Tensor, algo.SurrogateOut]:
    logp_new = t64(RATIOS).log().requires_grad_()
    adv = t64([[1.0] * 3, [-2.0] * 3]) if per_token_adv else t64([1.0, -2.0])
    return logp_new, algo.clipped_surrogate(logp_new, torch.zeros(2, 3, dtype=F64), adv)


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_clipped_surrogate_hand_cases(per_token_adv: bool) -> None:
    _, out = _surrogate_case(per_token_adv)
    close(out.loss, [[-1.1, -1.28, -0.5], [2.2, 3.0, 1.6]])
    close(out.ratio, RATIOS)
    assert out.clipped_high.tolist() == [[False, True, False], [False, False, False]]
    assert out.clipped_low.tolist() == [[False, False, False], [False, False, True]]


def test_clipped_tokens_have_zero_gradient_and_bad_shapes_raise() -> None:
    # d loss / d logp_new = -A * r on the unclipped branch, 0 where the clipped branch is active:
    # row 0 (A=1): [-1.1, 0, -0.5]; row 1 (A=-2): [2.2, 3.0, 0]
    logp_new, out = _surrogate_case()
    out.loss.sum().backward()
    close(logp_new.grad, [[-1.1, 0.0, -0.5], [2.2, 3.0, 0.0]])
    with pytest.raises(ValueError, match="advantages"):
        algo.clipped_surrogate(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="logp_old"):
        algo.clipped_surrogate(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2))


# Dual-clip, c = 3, the default clip [0.8, 1.28]; logp_old = 0, logp_new = log r.
# Row 0, A = -1, r = [0.5, 2.0, 4.0, 5.0]: the clipped loss is -min(rA, clip(r)A) =
#   [0.8 (clipped low), 2.0, 4.0, 5.0]; the cap c|A| = 3 binds at r = 4 and 5 -> [0.8, 2, 3, 3].
# Row 1, A = +2, r as above: -min(2r, 2 clip(r)) = [-1.0, -2.56, -2.56, -2.56]; no cap for A > 0.
# Gradients d loss / d logp_new: row 0 [0 (clipped low), -A r = 2.0, 0 (capped), 0 (capped)];
#   row 1 [-A r = -1.0, 0, 0, 0] (clipped high from r = 2 on).
DUAL_RATIOS = [[0.5, 2.0, 4.0, 5.0], [0.5, 2.0, 4.0, 5.0]]


def test_dual_clip_caps_the_loss_of_negative_advantages_at_c_times_abs_a() -> None:
    logp_new = t64(DUAL_RATIOS).log().requires_grad_()
    adv = t64([-1.0, 2.0])
    out = algo.clipped_surrogate(logp_new, torch.zeros(2, 4, dtype=F64), adv, clip_ratio_c=3.0)
    close(out.loss, [[0.8, 2.0, 3.0, 3.0], [-1.0, -2.56, -2.56, -2.56]])
    assert out.clipped_dual.tolist() == [[False, False, True, True], [False] * 4]
    out.loss.sum().backward()
    close(logp_new.grad, [[0.0, 2.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    off = algo.clipped_surrogate(t64(DUAL_RATIOS).log(), torch.zeros(2, 4, dtype=F64), adv)
    close(off.loss[0], [0.8, 2.0, 4.0, 5.0])  # without c the loss grows with r
    assert not off.clipped_dual.any()
    with pytest.raises(ValueError, match="clip_ratio_c > 1"):
        algo.clipped_surrogate(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), 0.2, 0.28, 1.0)


# --- truncated importance sampling (grpo.rollout_correction=truncate) --------------------------

# logp_old - logp_sampler = [ln 0.5, 0, ln 1.5, ln 4] -> ratios 0.5, 1, 1.5, 4; cap 2 -> w =
# [0.5, 1, 1.5, 2]. The surrogate at r = 1 (logp_new = logp_old) with A = 1 is -1 per token, so the
# corrected loss is -w = [-0.5, -1, -1.5, -2]; its gradient w.r.t. logp_new is -w * r = -w (the
# weight is a constant), and the sampler's and old log-probs get no gradient.


def test_truncated_importance_weights_hand_case() -> None:
    old = t64([[math.log(0.5), 0.0, math.log(1.5), math.log(4.0)]]).requires_grad_()
    sampler = torch.zeros(1, 4, dtype=F64, requires_grad=True)
    w = algo.rollout_is_weights(old, sampler, cap=2.0)
    close(w, [[0.5, 1.0, 1.5, 2.0]])
    assert not w.requires_grad
    new = old.detach().clone().requires_grad_()
    out = algo.clipped_surrogate(new, old.detach(), t64([1.0]))
    loss = out.loss * w
    close(loss, [[-0.5, -1.0, -1.5, -2.0]])
    loss.sum().backward()
    close(new.grad, [[-0.5, -1.0, -1.5, -2.0]])
    close(algo.rollout_is_weights(old, sampler, cap=1.0), [[0.5, 1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="cap must be >= 1"):
        algo.rollout_is_weights(old, sampler, cap=0.5)
    with pytest.raises(ValueError, match="differ"):
        algo.rollout_is_weights(old, torch.zeros(1, 3, dtype=F64), cap=2.0)


# --- aggregation -------------------------------------------------------------------------------

# loss = [[1, 2, 3], [4, 5, 6]], mask = [[1, 1, 0], [1, 0, 0]]
#   token-mean:          (1 + 2 + 4) / 3 = 7/3;        w = [[1/3, 1/3, 0], [1/3, 0, 0]]
#   seq-mean-token-mean: ((1 + 2) / 2 + 4 / 1) / 2 = 2.75;  w = [[1/4, 1/4, 0], [1/2, 0, 0]]
#   seq-mean-token-sum:  ((1 + 2) + 4) / 2 = 3.5;      w = [[1/2, 1/2, 0], [1/2, 0, 0]]
LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
MASK = [[True, True, False], [True, False, False]]
HAND = {
    "token-mean": (7 / 3, [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]]),
    "seq-mean-token-mean": (2.75, [[0.25, 0.25, 0], [0.5, 0, 0]]),
    "seq-mean-token-sum": (3.5, [[0.5, 0.5, 0], [0.5, 0, 0]]),
}


@pytest.mark.parametrize("mode", algo.AGGREGATIONS)
def test_aggregation_hand_values(mode: str) -> None:
    value, weights = HAND[mode]
    mask = torch.tensor(MASK)
    close(algo.token_weights(mask, mode), weights, tol=TOL32)  # float32 by default
    close(algo.token_weights(mask, mode, dtype=F64), weights)
    close(algo.aggregate(t64(LOSS), mask, mode), value)
    close(algo.aggregate(t64(LOSS), mask.double(), mode), value)  # 0/1 float mask = bool mask


@pytest.mark.parametrize("mode", algo.AGGREGATIONS)
def test_padding_invariance_and_empty_mask(mode: str) -> None:
    # two padded columns and one all-padding row, holding NaN and huge values, change nothing
    loss = torch.full((3, 5), float("nan"), dtype=F64)
    loss[:2, :3] = t64(LOSS)
    loss[2, 0] = 1e30
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[:2, :3] = torch.tensor(MASK)
    close(algo.aggregate(loss, mask, mode), HAND[mode][0])
    assert (algo.token_weights(mask, mode)[~mask] == 0).all()
    # an all-empty mask gives 0 and zero gradient, not NaN
    loss = torch.ones(2, 3, requires_grad=True)
    out = algo.aggregate(loss, torch.zeros(2, 3, dtype=torch.bool), mode)
    assert out.item() == 0.0
    out.backward()
    assert (loss.grad == 0).all()


@pytest.mark.parametrize("mode", algo.AGGREGATIONS)
def test_micro_batch_split_invariance(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 2, 0, 5, 1, 3]  # turn lengths, one empty turn
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]  # (6, 7)
    logits = torch.randn(6, 7, generator=gen, dtype=F64, requires_grad=True)
    per_token = logits.square()  # (6, 7) any differentiable per-token loss

    full = algo.aggregate(per_token, mask, mode)
    (full_grad,) = torch.autograd.grad(full, logits, retain_graph=True)

    w = algo.token_weights(mask, mode, dtype=F64)  # on the full mini-batch, then split by rows
    splits = [(0, 1), (1, 3), (3, 6)]  # 7, 2 and 9 tokens; 1, 1 and 3 non-empty turns
    split_total = torch.stack([(w[a:b] * per_token[a:b]).sum() for a, b in splits]).sum()
    (split_grad,) = torch.autograd.grad(split_total, logits)
    close(split_total, full)
    close(split_grad, full_grad)

    # Why weights are needed: averaging the micro-batches' own aggregates is a different number.
    naive = torch.stack([algo.aggregate(per_token[a:b], mask[a:b], mode) for a, b in splits])
    assert abs(naive.mean().item() - full.item()) > 1e-3


def test_unknown_aggregation_lists_valid_names() -> None:
    assert set(algo.AGGREGATIONS) == set(HAND)
    with pytest.raises(ValueError, match="unknown aggregation mode 'seq-mean'") as err:
        algo.token_weights(torch.ones(1, 1, dtype=torch.bool), "seq-mean")
    for name in algo.AGGREGATIONS:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="unknown aggregation mode .*; valid: "):
        algo.aggregate(torch.ones(1, 1), torch.ones(1, 1), "nope")


# --- stats -------------------------------------------------------------------------------------


def test_masked_mean_and_chi2() -> None:
    # (1 + 3 + 5) / 3 = 3; the masked-out NaN must not leak; an empty mask gives 0
    x = t64([[1, float("nan"), 3], [4, 5, 6]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.bool)
    close(algo.masked_mean(x, mask), 3.0)
    empty = algo.masked_mean(x, torch.zeros_like(mask))
    assert empty.shape == () and empty.item() == 0.0
    # rho = [2, 0.5] -> mean(rho^2) - 1 = (4 + 0.25) / 2 - 1 = 1.125; the masked log(100) is ignored
    log_ratio = t64([[math.log(2), math.log(0.5), math.log(100)]])
    mask = torch.tensor([[True, True, False]])
    close(algo.chi2_token(log_ratio, mask), 1.125)
    assert algo.chi2_token(torch.zeros(2, 3), torch.ones(2, 3)).item() == 0.0  # rho = 1
    assert algo.chi2_token(log_ratio, torch.zeros_like(mask)).item() == 0.0  # empty mask


def test_kl_k3_and_perplexity() -> None:
    logp = t64([[math.log(0.5), math.log(0.25)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert algo.kl_k3(logp, logp.clone(), mask).item() == 0.0
    # d = ref - logp = [-log 2, +log 2]: exp(d) - d - 1 = [0.5 + log2 - 1, 2 - log2 - 1];
    # their mean is (0.5 + 2 - 2) / 2 = 0.25 (the log 2 terms cancel)
    ref = t64([[math.log(0.25), math.log(0.5)]])
    close(algo.kl_k3(logp, ref, mask), 0.25)
    # logp = [log 1/2, log 1/8] -> mean NLL = (log 2 + 3 log 2) / 2 = 2 log 2 -> ppl = 4
    logp = t64([[math.log(0.5), math.log(0.125), -50.0]])
    close(algo.perplexity(logp, torch.tensor([[True, True, False]])), 4.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_entropy_of_uniform_is_log_v(temperature: float) -> None:
    logits = torch.zeros(2, 3, 5, dtype=F64)  # uniform over V = 5 at any temperature
    logp, ent = algo.token_logprobs_and_entropy(logits, torch.randint(0, 5, (2, 3)), temperature)
    close(ent, torch.full((2, 3), math.log(5), dtype=F64))
    close(logp, torch.full((2, 3), -math.log(5), dtype=F64))


def test_temperature_scaling_hand_value() -> None:
    # logits [0, log 3]: at tau = 1, p = [1/4, 3/4], H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623...
    # at tau = 0.5 the logits double to [0, ln 9]: p = [0.1, 0.9], H = 0.3250829...
    logits = t64([[[0.0, math.log(3)]]])  # (1, 1, 2)
    logp1, h1 = algo.token_logprobs_and_entropy(logits, ids([[1]]), 1.0)
    logp2, h2 = algo.token_logprobs_and_entropy(logits, ids([[1]]), 0.5)
    close(h1, [[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    close(logp1, [[math.log(0.75)]])
    close(h2, [[-(0.1 * math.log(0.1) + 0.9 * math.log(0.9))]])
    close(logp2, [[math.log(0.9)]])


def test_logprobs_match_categorical_and_edge_cases() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 11, generator=gen, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 4), generator=gen)
    logp, ent = algo.token_logprobs_and_entropy(logits, targets, 0.7)
    ref = torch.distributions.Categorical(logits=logits / 0.7)
    close(logp, ref.log_prob(targets))
    close(ent, ref.entropy().detach())
    assert logp.requires_grad and not ent.requires_grad  # entropy is a detached diagnostic
    logp.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    # a vocabulary entry masked with -inf: p = [1/2, 1/2, 0], H = ln 2, not NaN
    masked = torch.tensor([[[0.0, 0.0, float("-inf")]]])
    close(algo.token_logprobs_and_entropy(masked, ids([[0]]), 1.0)[1], [[math.log(2)]], tol=TOL32)
    bf16 = torch.zeros(1, 2, 4, dtype=torch.bfloat16)
    logp, ent = algo.token_logprobs_and_entropy(bf16, ids([[0, 1]]), 1.0)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32  # upcast
    with pytest.raises(ValueError, match="temperature"):
        algo.token_logprobs_and_entropy(masked, ids([[0]]), -1.0)


def test_clip_fractions_and_max_ratio() -> None:
    # from the surrogate hand case: one clipped-high and one clipped-low token out of 6
    _, out = _surrogate_case()
    full = torch.ones(2, 3, dtype=torch.bool)
    low, high = algo.clip_fractions(out, full)
    close(torch.stack([low, high]), [1 / 6, 1 / 6])
    close(algo.max_ratio(out.ratio, full), 1.5)
    # mask out the r = 1.5 column: low = 1/4, high = 0, max ratio = 1.1
    mask = torch.tensor([[True, False, True], [True, False, True]])
    low, high = algo.clip_fractions(out, mask)
    close(torch.stack([low, high]), [0.25, 0.0])
    close(algo.max_ratio(out.ratio, mask), 1.1)
    assert algo.max_ratio(out.ratio, torch.zeros_like(mask)).item() == 1.0
