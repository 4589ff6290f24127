"""Summaries over seeds and the paired IP-vs-SP test. Pure functions over floats; no scipy.

**Spread** is the sample standard deviation (Bessel's correction, ``statistics.stdev``), None
for fewer than two values; ``n`` is always given beside it, since with the 2-5 seeds a grid can
afford the spread itself is a rough number.

**Why a sign-flip permutation test** for IP vs SP. The pairs are (IP, SP) peak accuracies of the
same (task, scale, workflow, seed): same data order, same base, so the difference d_i of a pair
removes what the seed shares. Under the null hypothesis that IP and SP are exchangeable within a
pair, each d_i is as likely to be +|d_i| as -|d_i|, so the 2^n sign patterns are equally likely
and the share of them whose |sum| reaches the observed |sum| is an *exact* two-sided p-value
(Fisher's randomisation test; sum and mean are the same statistic for fixed n). It needs no
normality, which n = 2-5 differences of bounded accuracies can neither show nor justify (the
paired t-test would), and unlike the Wilcoxon signed-rank test it uses the sizes of the
differences, not only their ranks, and has no tie corrections to choose. Its price: with n
pairs the smallest attainable p is 2 / 2^n (n = 2: 0.5; n < 6 never reaches 0.05), which the
report states next to the result.

Choices of marlow: patterns are enumerated for n <= :data:`EXACT_MAX_N` (2^16 = 65,536
patterns); above it, :data:`MC_DRAWS` random patterns from ``numpy.random.default_rng(seed)``
(seed 0 unless given) with p = (hits + 1) / (draws + 1) (Phipson & Smyth, 2010: never 0, and
valid as a p-value). A pattern "reaches" the observed statistic when ``|S| >= |S_obs| - tol``
with ``tol = 1e-9 * max(1, sum |d_i|)``, so float noise in sums of accuracies cannot drop the
observed pattern itself. Zero differences stay in n (they move no sum).

**Why not** ``scipy.stats.permutation_test``, which does this test (``permutation_type=
"samples"`` on the IP and SP arrays with the mean difference as statistic, exact when
``n_resamples >= 2**n``; its two-sided p is twice the smaller one-sided p, which equals the
``|S|`` rule here because the sign-flip null distribution of the sum is symmetric about 0):
scipy is not a dependency of marlow (``pyproject.toml``) and nothing else in marlow needs it, so
it would be a new compiled package on every install for the ~20 lines of numpy of
:func:`sign_flip_p`, whose exact p-values are checked against hand-counted sign patterns in
``tests/unit/test_report.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

EXACT_MAX_N = 16
MC_DRAWS = 200_000


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """{"mean", "sd", "n"} of the values (mean None when empty, sd None under two values)."""
    vals = [float(v) for v in values]
    return {
        "mean": statistics.fmean(vals) if vals else None,
        "sd": statistics.stdev(vals) if len(vals) >= 2 else None,
        "n": len(vals),
    }


def sign_flip_p(diffs: Sequence[float], *, seed: int = 0, draws: int = MC_DRAWS) -> float | None:
    """Two-sided p-value of the paired sign-flip permutation test on ``diffs`` (None if empty)."""
    d = np.asarray(diffs, dtype=np.float64)  # (n,)
    n = d.size
    if n == 0:
        return None
    observed = abs(d.sum())
    tol = 1e-9 * max(1.0, float(np.abs(d).sum()))
    if n <= EXACT_MAX_N:
        patterns = (np.arange(2**n)[:, None] >> np.arange(n)[None, :]) & 1  # (2^n, n) of 0/1
        sums = (1 - 2 * patterns) @ d  # (2^n,)
        return float(np.count_nonzero(np.abs(sums) >= observed - tol)) / 2**n
    rng = np.random.default_rng(seed)
    hits, left = 0, draws
    while left > 0:  # chunks keep memory at ~8 MB whatever n is
        k = min(left, max(1, 1_000_000 // n))
        signs = rng.integers(0, 2, size=(k, n)) * 2 - 1  # (k, n)
        hits += int(np.count_nonzero(np.abs(signs @ d) >= observed - tol))
        left -= k
    return (hits + 1) / (draws + 1)


def min_p(n: int) -> float | None:
    """The smallest p-value :func:`sign_flip_p` can give with ``n`` values (None for none)."""
    if not n:
        return None
    return 2 / 2**n if n <= EXACT_MAX_N else 1 / (MC_DRAWS + 1)


def paired_test(ip: Sequence[float], sp: Sequence[float], *, seed: int = 0) -> dict:
    """IP - SP over matched pairs: mean difference, its sd, n, the sign-flip p-value and how it
    was computed; ``min_p`` is the smallest p the test can give with this n."""
    if len(ip) != len(sp):
        raise ValueError(f"paired test needs as many IP as SP values; got {len(ip)} and {len(sp)}")
    diffs = [a - b for a, b in zip(ip, sp, strict=True)]
    n = len(diffs)
    summary = summarize(diffs)
    return {
        "mean_diff": summary["mean"],
        "sd_diff": summary["sd"],
        "n": n,
        "p_value": sign_flip_p(diffs, seed=seed),
        "method": "exact" if n <= EXACT_MAX_N else f"monte-carlo ({MC_DRAWS} draws, seed {seed})",
        "min_p": min_p(n),
    }


T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
"""Student's t quantile at 0.975 for 1..30 degrees of freedom (the standard table, to three
decimals); above 30 the normal's 1.960 is within 2 %."""


def ci95(values: Sequence[float]) -> tuple[float, float] | None:
    """The mean's 95 % confidence interval over seeds, ``mean -/+ t(0.975, n-1) * sd / sqrt(n)``
    (None under two values). With 2-3 seeds it is wide, as it should be."""
    if len(values) < 2:
        return None
    mean, sd, n = statistics.fmean(values), statistics.stdev(values), len(values)
    t = T975[n - 2] if n - 1 <= len(T975) else 1.960
    half = t * sd / n**0.5
    return mean - half, mean + half
