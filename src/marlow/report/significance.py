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

**Dose-response slopes** (an effect measured at several slot counts n of one role, on
the same seeds). :func:`within_slope` is the ordinary least-squares slope of y on x with one
intercept per seed (seed fixed effects)::

    slope = sum_s sum_i (x_i - xbar_s)(y_i - ybar_s) / sum_s sum_i (x_i - xbar_s)^2

Why seed fixed effects: cells of one seed share their data order and sampling seeds, so a seed
that runs high at one n may run high at every n; comparing each point with its own seed's mean
takes that out, as the pairs of :func:`paired_test` do for two conditions (with two doses per
seed the slope *is* the mean paired difference over the dose gap). Its standard error is from
the residuals e_i = (y_i - ybar_s) - slope (x_i - xbar_s): SE^2 = sum e_i^2 / df / Sxx with
df = N - S - 1 (N points, S seeds: one mean per seed and the slope are fitted). A seed with a
single point has nothing to compare within it: its point is dropped (it would fit its own
intercept exactly and add nothing). The interval is slope -/+ t(0.975, df) SE (:data:`T975`).

**Why a stratified permutation test** of slope = 0 (:func:`slope_permutation_p`), for the same
reasons as the sign flip: no normality assumed of 3-8 seeds' accuracies or log ratios. Under
the null hypothesis that the dose does nothing, the doses of one seed's cells are exchangeable
*within that seed* (not across seeds, whose levels differ), so every within-seed permutation of
the x labels is as likely as the observed one. Two-sided on |slope|; Sxx is the same under every
within-seed permutation, so the statistic is the cross-product sum. All within-seed permutations
are enumerated while their number (the product of n_s! over seeds) is at most
:data:`EXACT_MAX_PERMUTATIONS` (2^16, as for the sign flip: 4 seeds x 3 doses = 1,296, 6 x 3 =
46,656); above it :data:`MC_DRAWS` random ones, p = (hits + 1) / (draws + 1). A permutation
"reaches" the observed statistic when ``|T| >= |T_obs| - tol``, ``tol = 1e-9 * max(1,
sum |x_i - xbar_s| |y_i - ybar_s|)``. Its smallest attainable p (``min_p``) depends on the
values (ties): in the exact case it is the p of the most extreme arrangement of these y values
(the share of permutations whose |T| reaches the largest |T| of all); 4 seeds at doses 1, 2, 4
give 2 / 1,296 without ties, since the reversed doses give -T.

**Detectable effect** (:func:`detectable_effect`): the true effect a two-sided test at alpha
0.05 detects with 80 % power, ``(t(0.975, df) + t(0.80, df)) * SE`` (:data:`T975`,
:data:`T80`). This is the usual normal-theory approximation (it uses the central t for both
quantiles, not the non-central t; at df >= 5 it is within a few percent); it describes the
t-test, and the permutation test, on these sizes, has about the same power. It is the one rule
the report (beside each "not shown") and ``docs/results/dose_power.py`` (before a run) use.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

import numpy as np

EXACT_MAX_N = 16
MC_DRAWS = 200_000
EXACT_MAX_PERMUTATIONS = 2**16


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

T80 = (
    1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879,
    0.876, 0.873, 0.870, 0.868, 0.866, 0.865, 0.863, 0.862, 0.861, 0.860,
    0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854,
)  # fmt: skip
"""Student's t quantile at 0.80 for 1..30 degrees of freedom (three decimals); above 30 the
normal's 0.842 is within 1.5 %."""


def t975(df: int) -> float:
    """Student's t at 0.975 with ``df`` >= 1 degrees of freedom (:data:`T975`, 1.960 above 30)."""
    return T975[df - 1] if df <= len(T975) else 1.960


def t80(df: int) -> float:
    """Student's t at 0.80 with ``df`` >= 1 degrees of freedom (:data:`T80`, 0.842 above 30)."""
    return T80[df - 1] if df <= len(T80) else 0.842


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's T with integer ``df`` >= 1, by the finite series of
    Abramowitz & Stegun 26.7.3-4 (theta = atan(|t| / sqrt(df)); exact up to float round-off)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    term = total = 1.0
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        for k in range(1, (df - 1) // 2):
            term *= 2 * k / (2 * k + 1) * cos2
            total += term
        bracket = sin * math.cos(theta) * total if df > 1 else 0.0  # df = 1: 2 theta / pi
        inside = 2 / math.pi * (theta + bracket)
    else:  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        for k in range(1, df // 2):
            term *= (2 * k - 1) / (2 * k) * cos2
            total += term
        inside = sin * total
    return min(1.0, max(0.0, 1.0 - inside))


def detectable_effect(se: float | None, df: int | None) -> float | None:
    """The true effect a two-sided test at alpha 0.05 finds with 80 % power, given its standard
    error and degrees of freedom: ``(t(0.975, df) + t(0.80, df)) * se`` (None without both)."""
    if se is None or df is None or df < 1:
        return None
    return (t975(df) + t80(df)) * se


def ci95(values: Sequence[float]) -> tuple[float, float] | None:
    """The mean's 95 % confidence interval over seeds, ``mean -/+ t(0.975, n-1) * sd / sqrt(n)``
    (None under two values). With 2-3 seeds it is wide, as it should be."""
    if len(values) < 2:
        return None
    mean, sd, n = statistics.fmean(values), statistics.stdev(values), len(values)
    half = t975(n - 1) * sd / n**0.5
    return mean - half, mean + half


def _strata(points: Sequence[tuple[object, float, float]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(x - xbar_s, y - ybar_s) of every seed with two or more points, in first-seen order."""
    by_seed: dict[object, list[tuple[float, float]]] = {}
    for seed, x, y in points:
        by_seed.setdefault(seed, []).append((float(x), float(y)))
    out = []
    for pts in by_seed.values():
        if len(pts) < 2:
            continue  # a lone point fits its own seed's intercept exactly: no information
        xy = np.asarray(pts, dtype=np.float64)  # (n_s, 2)
        out.append((xy[:, 0] - xy[:, 0].mean(), xy[:, 1] - xy[:, 1].mean()))
    return out


def within_slope(points: Sequence[tuple[object, float, float]]) -> dict:
    """The pooled within-seed OLS slope of y on x over ``points`` (seed, x, y): slope, its
    standard error, df = N - S - 1, the 95 % t-interval, and N and S after seeds with a single
    point are dropped. slope is None when x never varies within a seed; se and the interval are
    None when df < 1."""
    strata = _strata(points)
    n = sum(len(x) for x, _ in strata)
    df = n - len(strata) - 1
    out = {"slope": None, "se": None, "df": df, "ci_low": None, "ci_high": None}
    out.update(n=n, seeds=len(strata))
    sxx = sum(float(x @ x) for x, _ in strata)
    if sxx <= 0:
        return out
    slope = sum(float(x @ y) for x, y in strata) / sxx
    out["slope"] = slope
    if df >= 1:
        sse = sum(float(((y - slope * x) ** 2).sum()) for x, y in strata)
        se = math.sqrt(sse / df / sxx)
        half = t975(df) * se
        out.update(se=se, ci_low=slope - half, ci_high=slope + half)
    return out


def slope_permutation_p(
    points: Sequence[tuple[object, float, float]], *, seed: int = 0, draws: int = MC_DRAWS
) -> dict:
    """The stratified permutation test of :func:`within_slope` = 0 (x permuted within each
    seed): the two-sided p-value, how it was computed, and the smallest p attainable with these
    values (``p_value`` and ``min_p`` None when x never varies within a seed)."""
    strata = _strata(points)
    count = math.prod(math.factorial(len(x)) for x, _ in strata)
    exact = count <= EXACT_MAX_PERMUTATIONS
    method = "exact" if exact else f"monte-carlo ({draws} draws, seed {seed})"
    out = {"p_value": None, "min_p": None, "method": method, "permutations": count}
    if not strata or sum(float(x @ x) for x, _ in strata) <= 0:
        return out
    observed = abs(sum(float(x @ y) for x, y in strata))
    tol = 1e-9 * max(1.0, sum(float(np.abs(x) @ np.abs(y)) for x, y in strata))
    if exact:
        totals = np.zeros(1)  # (k,): the statistic of every permutation of the strata so far
        for x, y in strata:
            perms = np.asarray(list(itertools.permutations(x)))  # (n_s!, n_s)
            totals = (totals[:, None] + (perms @ y)[None, :]).ravel()
        stat = np.abs(totals)  # (count,)
        out["p_value"] = float(np.count_nonzero(stat >= observed - tol)) / count
        out["min_p"] = float(np.count_nonzero(stat >= stat.max() - tol)) / count
        return out
    rng = np.random.default_rng(seed)
    hits, left = 0, draws
    while left > 0:  # chunks keep memory bounded whatever the design
        k = min(left, 50_000)
        totals = np.zeros(k)
        for x, y in strata:
            totals += rng.permuted(np.broadcast_to(x, (k, len(x))), axis=1) @ y  # (k,)
        hits += int(np.count_nonzero(np.abs(totals) >= observed - tol))
        left -= k
    out["p_value"] = (hits + 1) / (draws + 1)
    out["min_p"] = 1 / (draws + 1)
    return out
