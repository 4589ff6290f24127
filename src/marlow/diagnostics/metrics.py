"""Per-role metric accumulation (the sinks that write the metrics live in ``sinks.py``).

Metric names are a grammar: ``split/role/metric`` (``train/aggregator/chi2_update``,
``val/all/accuracy``). Adapter-level numbers (grad norm, learning rate) use the adapter name in
the role position (``train/shared/grad_norm``; under IP the adapter is named after its role).

:class:`Meter` keeps weighted sums so a mean over tokens and a mean over turns are both exact,
whatever order the pieces arrive in.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from marlow.types import Episode, missing_reason

ALL = "all"


class Meter:
    """Weighted means and maxima keyed by (role, metric)."""

    def __init__(self) -> None:
        self._sum: dict[tuple[str, str], float] = defaultdict(float)
        self._weight: dict[tuple[str, str], float] = defaultdict(float)
        self._max: dict[tuple[str, str], float] = {}
        self._value: dict[tuple[str, str], float] = {}
        self._count: dict[tuple[str, str], float] = defaultdict(float)

    def mean(
        self, role: str, metric: str, total: float, weight: float, also_all: bool = True
    ) -> None:
        """Add ``total`` (a sum) carrying ``weight`` (a count) to the running mean."""
        for r in (role, ALL) if also_all and role != ALL else (role,):
            self._sum[(r, metric)] += float(total)
            self._weight[(r, metric)] += float(weight)

    def max(self, role: str, metric: str, value: float, also_all: bool = True) -> None:
        for r in (role, ALL) if also_all and role != ALL else (role,):
            key = (r, metric)
            self._max[key] = max(self._max.get(key, -math.inf), float(value))

    def add(self, role: str, metric: str, value: float) -> None:
        """Add ``value`` to a sum reported as it is (a count)."""
        self._count[(role, metric)] += float(value)

    def set(self, role: str, metric: str, value: float) -> None:
        self._value[(role, metric)] = float(value)

    @classmethod
    def merge(cls, meters: Sequence[Meter]) -> Meter:
        """One meter from several (data-parallel ranks, in rank order): sums and weights add,
        maxima take the largest, set values come from the first meter that has them (they are
        the same on every rank: learning rates, update counts)."""
        out = cls()
        for m in meters:
            for key, total in m._sum.items():
                out._sum[key] += total
                out._weight[key] += m._weight[key]
            for key, value in m._max.items():
                out._max[key] = max(out._max.get(key, -math.inf), value)
            for key, value in m._value.items():
                out._value.setdefault(key, value)
            for key, value in m._count.items():
                out._count[key] += value
        return out

    def result(self, split: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, total in self._sum.items():
            if self._weight[key] > 0:
                out[f"{split}/{key[0]}/{key[1]}"] = total / self._weight[key]
        for key, value in {**self._max, **self._value, **self._count}.items():
            out[f"{split}/{key[0]}/{key[1]}"] = value
        return dict(sorted(out.items()))


def episode_metrics(meter: Meter, episodes: Sequence[Episode]) -> None:
    """Reward, accuracy, completion lengths and truncation, per role and overall. ``reward`` and
    ``accuracy`` of a role are its episodes'; under per-role credit ``own_reward`` is the mean
    reward of the role's own turns. ``count_<name>`` is a counter's mean per episode, an episode
    without it counting 0 (Eval-Opt: ``count_verdict_correct`` + ``_incorrect`` + ``_unparsed``
    = verdicts per episode, their ratio the verdict distribution).

    An episode without a reward (a user's reward that failed: ``marlow.types.NoReward``) is left
    out of ``reward`` and ``accuracy``, and counted: ``all/reward_<reason>`` is the number of
    such episodes, ``ROLE/reward_<reason>`` the number of the role's turns left out of training
    for that reason (under per-role credit, by each turn's own reward); all are written only
    when non-zero."""
    counters = sorted({key for ep in episodes for key in ep.counters})
    for ep in episodes:
        missing = missing_reason(ep.reward)
        if missing is not None:
            meter.add(ALL, missing, 1)
        for key, value in ep.info.items():
            meter.mean(ALL, key, value, 1, also_all=False)
        for key in counters:
            meter.mean(ALL, f"count_{key}", ep.counters.get(key, 0), 1, also_all=False)
        if missing is not None:
            continue
        meter.mean(ALL, "reward", ep.reward, 1, also_all=False)
        meter.mean(ALL, "accuracy", float(ep.correct), 1, also_all=False)
        for role in {t.role for t in ep.turns}:
            meter.mean(role, "reward", ep.reward, 1, also_all=False)
            meter.mean(role, "accuracy", float(ep.correct), 1, also_all=False)
    lengths: dict[str, list[int]] = defaultdict(list)
    for ep in episodes:
        for t in ep.turns:
            lengths[t.role].append(len(t.completion_ids))
            lengths[ALL].append(len(t.completion_ids))
            meter.mean(t.role, "truncation_rate", float(t.truncated), 1)
            missing = missing_reason(ep.reward_of(t))
            if missing is not None:
                meter.add(t.role, missing, 1)
            elif t.reward is not None:  # per-role credit: what the role is trained on
                meter.mean(t.role, "own_reward", t.reward, 1, also_all=False)
    for role, values in lengths.items():
        arr = np.asarray(values)
        meter.set(role, "length_mean", float(arr.mean()))
        meter.set(role, "length_p50", float(np.percentile(arr, 50)))
        meter.set(role, "length_p95", float(np.percentile(arr, 95)))
        meter.set(role, "length_max", float(arr.max()))
