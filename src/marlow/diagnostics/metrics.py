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
from dataclasses import dataclass

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
    tool_metrics(meter, episodes)
    for role, values in lengths.items():
        arr = np.asarray(values)
        meter.set(role, "length_mean", float(arr.mean()))
        meter.set(role, "length_p50", float(np.percentile(arr, 50)))
        meter.set(role, "length_p95", float(np.percentile(arr, 95)))
        meter.set(role, "length_max", float(arr.max()))


def _same(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


TOOL_METRICS = ("calls", "errors", "seconds", "wall_s", "ok_rate", "revision_rate")
"""The metrics :func:`tool_metrics` logs per tool, in the order tables show them."""


def tool_metrics(meter: Meter, episodes: Sequence[Episode]) -> None:
    """Per tool (its name in the role's place): ``calls`` per episode, ``errors`` (the fraction
    of calls that raised, timed out or returned no text), ``seconds`` per call (calls run
    several at once, so this is each one's latency), ``wall_s`` (the wall seconds of the tool's
    stages over all the episodes: their share of ``time/rollout_s``), ``ok_rate``
    (of the calls that report ``ok``, the fraction that passed) and ``revision_rate``: of the
    calls that reported a failure (``ok`` False, or a failed call) and are followed by a model
    turn, the fraction where that turn's text differs from every text the tool was given
    (whitespace aside): the next role changed the answer the tool examined."""
    names = sorted({c.tool for ep in episodes for c in ep.tools})
    for name in names:  # each stage ran once for every episode: its wall time, summed
        walls = {c.stage: c.stage_s for ep in episodes for c in ep.tools if c.tool == name}
        meter.set(name, "wall_s", sum(walls.values()))
    for ep in episodes:
        for name in names:
            mine = [c for c in ep.tools if c.tool == name]
            meter.mean(name, "calls", len(mine), 1, also_all=False)
            for c in mine:
                meter.mean(name, "errors", float(c.status != "ok"), 1, also_all=False)
                meter.mean(name, "seconds", c.seconds, 1, also_all=False)
                if c.ok is not None and c.status == "ok":
                    meter.mean(name, "ok_rate", float(c.ok), 1, also_all=False)
                if c.ok is False and c.after < len(ep.turns) and c.inputs:
                    nxt = ep.turns[c.after].completion_text
                    changed = not any(_same(nxt, seen) for seen in c.inputs.values())
                    meter.mean(name, "revision_rate", float(changed), 1, also_all=False)


@dataclass(frozen=True)
class MetricDoc:
    """What one metric of ``metrics.jsonl`` means. ``name`` is the last part of a key
    (``split/who/name``; ``<x>`` stands for any text); ``who`` says what the middle part names:
    ``role`` (each role, and ``all`` over every role), ``all`` (only ``all``), ``adapter`` (each
    adapter: ``shared`` under SP, the role's name under IP), ``tool`` (each tool stage's name);
    ``splits`` are the splits that log it; ``when`` says on which steps."""

    name: str
    who: str
    splits: str
    when: str
    meaning: str

    def matches(self, name: str) -> bool:
        head, mark, tail = self.name.partition("<")
        if not mark:
            return name == self.name
        rest = tail.partition(">")[2]
        return name.startswith(head) and name.endswith(rest) and len(name) > len(head + rest)


EVERY = "every step (val: each validation)"
TRAINING = "every step"  # a metric of the update: training steps only
DIAGNOSED = "diagnostics.every's steps"
METRICS: tuple[MetricDoc, ...] = (
    MetricDoc(
        "reward",
        "role",
        "train, val",
        EVERY,
        "mean reward of the episodes (a role: of the episodes it spoke in)",
    ),
    MetricDoc(
        "accuracy",
        "role",
        "train, val",
        EVERY,
        "fraction of those episodes graded correct (reward >= task.correct_threshold)",
    ),
    MetricDoc(
        "own_reward",
        "role",
        "train, val",
        EVERY,
        "under grpo.credit=role (the tiny and quickstart presets' setting; the paper's is "
        "broadcast): mean reward of the role's own turns, what it is trained on; absent under "
        "broadcast credit",
    ),
    MetricDoc(
        "truncation_rate",
        "role",
        "train, val",
        EVERY,
        "fraction of the role's turns cut at rollout.max_new_tokens",
    ),
    MetricDoc(
        "length_mean",
        "role",
        "train, val",
        EVERY,
        "mean completion length of the role's turns, in tokens",
    ),
    MetricDoc("length_p50", "role", "train, val", EVERY, "median completion length"),
    MetricDoc("length_p95", "role", "train, val", EVERY, "95th percentile completion length"),
    MetricDoc("length_max", "role", "train, val", EVERY, "longest completion"),
    MetricDoc(
        "reward_<reason>",
        "role",
        "train, val",
        "steps where it is not zero",
        "a user's "
        "reward that gave none (reason: none, nonfinite, error, timeout): episodes (all) "
        "or turns (a role) left out",
    ),
    MetricDoc(
        "count_<counter>",
        "all",
        "train, val",
        EVERY,
        "a workflow counter's mean per "
        "episode (verdict_correct, verdict_incorrect, verdict_unparsed, selection_fallback, "
        "strategies_parsed, strategy_missing, prompt_cap, tool_error, tool_timeout)",
    ),
    MetricDoc(
        "rounds_used",
        "all",
        "train, val",
        EVERY,
        "a workflow with rounds: the highest round an episode reached, averaged",
    ),
    MetricDoc(
        "pass_at_n",
        "all",
        "train, val",
        EVERY,
        "a workflow that selects: fraction of episodes with a correct candidate",
    ),
    MetricDoc(
        "majority_correct",
        "all",
        "train, val",
        EVERY,
        "a workflow that selects: fraction whose majority-vote candidate is correct",
    ),
    MetricDoc("n_problems", "all", "val", "validation steps", "problems validated"),
    MetricDoc(
        "entropy",
        "role",
        "train",
        TRAINING,
        "mean per-token entropy of the policy at the sampling temperature, on its sampled tokens",
    ),
    MetricDoc(
        "nll",
        "role",
        "train",
        TRAINING,
        "mean negative log-probability of the sampled tokens under the policy",
    ),
    MetricDoc("perplexity", "role", "train", TRAINING, "exp(nll)"),
    MetricDoc(
        "chi2_rollout",
        "role",
        "train",
        TRAINING,
        "chi-square divergence between the "
        "sampler's and the trainer's token distributions, on the sampled tokens (mean(ratio^2) "
        "- 1: a small negative value is a difference too small to measure)",
    ),
    MetricDoc(
        "rollout_abs_dlogp",
        "role",
        "train",
        TRAINING,
        "mean |trainer - sampler| log-probability per sampled token",
    ),
    MetricDoc(
        "chi2_update",
        "role",
        "train",
        DIAGNOSED,
        "chi-square divergence of the updated "
        "policy from the one that sampled (the step's update size), estimated on the step's "
        "sampled tokens as mean(ratio^2) - 1: >= 0 in expectation, so a small negative value "
        "(e.g. -1e-4) is an update too small to measure",
    ),
    MetricDoc(
        "kl_to_base",
        "role",
        "train",
        DIAGNOSED,
        "k3 estimate of KL(policy || base model) on the step's sampled tokens",
    ),
    MetricDoc(
        "clipfrac_low",
        "role",
        "train",
        TRAINING,
        "fraction of tokens whose importance ratio was clipped below (1 - grpo.clip_low)",
    ),
    MetricDoc(
        "clipfrac_high", "role", "train", TRAINING, "fraction clipped above (1 + grpo.clip_high)"
    ),
    MetricDoc(
        "ratio_max", "role", "train", TRAINING, "largest importance ratio of the role's tokens"
    ),
    MetricDoc(
        "grad_norm_own",
        "role",
        "train",
        TRAINING,
        "SP: L2 norm of the role's own share of the shared adapter's gradient",
    ),
    MetricDoc(
        "grad_mass_share",
        "role",
        "train",
        TRAINING,
        "SP: the role's gradient norm over the sum of every role's",
    ),
    MetricDoc(
        "slot_coherence",
        "role",
        "train",
        TRAINING,
        "mitigate.slot_damping: mean pairwise cosine of a role's slots' gradients",
    ),
    MetricDoc(
        "slot_damping",
        "role",
        "train",
        TRAINING,
        "mitigate.slot_damping: the factor each slot's gradient was multiplied by",
    ),
    MetricDoc(
        "frac_reward_zero_std",
        "all",
        "train",
        TRAINING,
        "fraction of advantage groups whose rewards are all equal (they teach nothing)",
    ),
    MetricDoc(
        "sandbox_errors",
        "all",
        "train",
        "steps where it is not zero",
        "programs whose sandbox failed to start (graded wrong)",
    ),
    MetricDoc("calls", "tool", "train, val", EVERY, "a tool stage's calls per episode"),
    MetricDoc(
        "errors",
        "tool",
        "train, val",
        EVERY,
        "fraction of its calls that raised, timed out or returned no text (the next role read "
        "what went wrong)",
    ),
    MetricDoc(
        "seconds",
        "tool",
        "train, val",
        EVERY,
        "seconds per call (its latency: calls run several at once)",
    ),
    MetricDoc(
        "wall_s",
        "tool",
        "train, val",
        EVERY,
        "wall seconds of the tool's stages over "
        "every episode (within time/rollout_s or time/val_s)",
    ),
    MetricDoc(
        "ok_rate",
        "tool",
        "train, val",
        EVERY,
        "of the calls that report ok, the fraction that passed",
    ),
    MetricDoc(
        "revision_rate",
        "tool",
        "train, val",
        EVERY,
        "of the calls that reported a failure, the fraction after which the next role changed "
        "its answer",
    ),
    MetricDoc(
        "grad_norm",
        "adapter",
        "train",
        TRAINING,
        "the adapter's gradient L2 norm before clipping, averaged over its updates",
    ),
    MetricDoc("grad_norm_max", "adapter", "train", TRAINING, "its largest over the step's updates"),
    MetricDoc("loss", "adapter", "train", TRAINING, "the policy loss, averaged over the updates"),
    MetricDoc("lr", "adapter", "train", TRAINING, "the adapter's learning rate after the step"),
    MetricDoc(
        "updates",
        "adapter",
        "train",
        TRAINING,
        "optimizer updates the adapter took in this step (its mini-batches x grpo.epochs), not "
        "since the run began",
    ),
    MetricDoc(
        "nonfinite_skips",
        "adapter",
        "train",
        TRAINING,
        "1 when the step's update was non-finite and undone",
    ),
    MetricDoc(
        "engine_drift",
        "adapter",
        "train",
        "after each adapter sync",
        "largest "
        "|engine - trainer| log-probability on a probe, after the rollout engine got the "
        "new weights",
    ),
)
"""Every per-split metric of ``metrics.jsonl``. Besides them a record holds ``step`` and, per
step, ``time/*`` (seconds of each phase: rollout, scoring, update, learn, stats, val,
kl_to_base; ``rollout_tokens_per_s``) and, on CUDA, ``memory/*`` (peak allocated and reserved
GiB of the rollout and the learn phase, and what was allocated when each began)."""
TIMINGS = ("time/", "memory/", "step")


def describe_metric(key: str) -> MetricDoc | None:
    """The :data:`METRICS` entry of a ``metrics.jsonl`` key (``train/generator/entropy``), or
    None for a key outside the catalogue (and for ``step``, ``time/*``, ``memory/*``)."""
    parts = key.split("/")
    if len(parts) != 3:
        return None
    return next((m for m in METRICS if m.matches(parts[2])), None)
