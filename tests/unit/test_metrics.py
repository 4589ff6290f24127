"""Episode metrics on hand-made episodes: counters average over every episode, lengths per role."""

from __future__ import annotations

import pytest

from marlow.diagnostics.metrics import Meter, episode_metrics
from marlow.types import Episode, Turn


def turn(role: str, n_tokens: int, finish: str = "stop") -> Turn:
    return Turn(role, 0, 0, role, "", [1], list(range(n_tokens)), [0.0] * n_tokens, finish, "")


def test_counters_are_per_episode_means_with_missing_counted_as_zero():
    eps = [
        Episode(
            "a",
            0,
            0,
            [turn("generator", 4)],
            reward=1.0,
            correct=True,
            counters={"verdict_correct": 1},
        ),
        Episode("b", 1, 0, [turn("generator", 6)], counters={"verdict_incorrect": 2}),
        Episode("c", 2, 0, [turn("generator", 8, "length")], counters={"verdict_incorrect": 1}),
        Episode("d", 3, 0, [turn("generator", 2)]),
    ]
    meter = Meter()
    episode_metrics(meter, eps)
    out = meter.result("val")
    # verdicts per episode: correct (1 + 0 + 0 + 0) / 4, incorrect (0 + 2 + 1 + 0) / 4
    assert out["val/all/count_verdict_correct"] == 0.25
    assert out["val/all/count_verdict_incorrect"] == 0.75
    assert out["val/all/accuracy"] == 0.25 and out["val/all/reward"] == 0.25
    assert out["val/generator/length_mean"] == 5.0
    assert out["val/generator/length_max"] == 8.0
    assert out["val/generator/truncation_rate"] == pytest.approx(0.25)
