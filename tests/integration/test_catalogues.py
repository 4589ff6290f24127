"""The metrics and run-folder catalogues (the reference pages' sources) hold what a real run
writes: a metric or a file the trainer starts writing without a line there fails here, and so
does a metric the catalogue claims for a split (``train``, ``val``) it is not written in."""

from __future__ import annotations

import json
from collections import defaultdict

from marlow.diagnostics.metrics import METRICS, TIMINGS, Meter, describe_metric, episode_metrics
from marlow.training.runfolder import RUN_FOLDER, describe_path
from marlow.types import Episode, NoReward, ToolCall, Turn

SOMETIMES = "steps where it is not zero"  # a metric written only when it has something to count


def run_keys(run) -> set[str]:
    keys = set()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        keys |= set(json.loads(line))
    return keys


def splits_of(names: dict[str, set[str]], metric) -> set[str]:
    """The splits in which ``names`` (split -> metric names) hold the catalogue entry."""
    return {split for split, written in names.items() if any(map(metric.matches, written))}


def claimed(metric) -> set[str]:
    return set(metric.splits.split(", "))


def test_every_metric_key_of_a_real_run_is_in_the_catalogue_under_its_splits(trained_voting):
    keys = run_keys(trained_voting)
    unknown = sorted(k for k in keys if not k.startswith(TIMINGS) and describe_metric(k) is None)
    assert unknown == []
    assert {"train/generator/entropy", "val/all/accuracy", "train/shared/grad_norm"} <= keys
    names: dict[str, set[str]] = defaultdict(set)
    for key in keys - {"step"}:
        if not key.startswith(TIMINGS):
            split, _, name = key.split("/")
            names[split].add(name)
    assert set(names) == {"train", "val"}
    for metric in METRICS:
        written = splits_of(names, metric)
        assert written <= claimed(metric), f"{metric.name}: written in {written}"
        if written and metric.when != SOMETIMES:  # written at all: in every split it claims
            assert written == claimed(metric), f"{metric.name}: claims {metric.splits}"


def covering_episodes() -> list[Episode]:
    """Episodes with something of everything :func:`episode_metrics` counts: two roles, a turn
    with its own reward (per-role credit), a counter, a workflow extra, a tool stage whose calls
    fail and pass, and an episode without a reward."""

    def turn(role: str, text: str, reward: float | None = None) -> Turn:
        return Turn(role, 0, 0, role, "", [1], [1, 2], [0.0, 0.0], "stop", text, reward=reward)

    def call(ok: bool) -> ToolCall:
        return ToolCall("tests", 0, 0, {"program": "a"}, "report", "ok", 0.1, {"ok": ok}, 1)

    return [
        Episode(
            "a",
            0,
            0,
            [turn("solver", "a", 1.0), turn("fixer", "b", 0.0)],
            reward=1.0,
            correct=True,
            counters={"prompt_cap": 1},
            info={"rounds_used": 1.0},
            tools=[call(False)],
        ),
        Episode("b", 1, 0, [turn("solver", "a"), turn("fixer", "a")], tools=[call(True)]),
        Episode("c", 2, 0, [turn("solver", "a")], reward=NoReward("reward_error")),
    ]


def test_validation_writes_every_metric_claimed_for_it_and_no_other(trained_voting):
    """A validation step (``Trainer.validate``) writes what :func:`episode_metrics` writes and
    ``n_problems``; a real run's validation records and episode_metrics on episodes of every kind
    give every name it can write. A catalogue entry claims ``val`` exactly when one of them is
    its: a training-only metric listed as logged at validation, or a validation metric left out
    of ``val``, fails here."""
    meter = Meter()
    episode_metrics(meter, covering_episodes())
    written = {key.split("/")[2] for key in meter.result("val")}
    written |= {key.split("/")[2] for key in run_keys(trained_voting) if key.startswith("val/")}
    for metric in METRICS:
        at_validation = any(map(metric.matches, written))
        assert ("val" in claimed(metric)) == at_validation, (metric.name, metric.splits)
        if "val" not in claimed(metric):  # its "when" speaks of training steps only
            assert "val" not in metric.when, (metric.name, metric.when)


def test_every_file_of_a_real_run_is_in_the_run_folder_catalogue(trained_voting):
    files = [p.relative_to(trained_voting).as_posix() for p in trained_voting.rglob("*")]
    unknown = [f for f in files if (trained_voting / f).is_file() and describe_path(f) is None]
    assert unknown == []
    assert describe_path("checkpoints/step_000002/adapters/shared/adapter_model.safetensors")


def test_patterns_match_what_they_say_and_nothing_else():
    names = {m.name for m in METRICS}
    assert "count_<counter>" in names and describe_metric("val/all/count_prompt_cap")
    assert describe_metric("train/all/count_") is None  # a pattern needs its <x>
    assert describe_metric("train/generator/no_such_metric") is None
    assert describe_metric("time/rollout_s") is None  # not a split/who/name key
    assert describe_path("signatures/step_000001.json").pattern == "signatures/step_*.json"
    assert describe_path("signatures/extra/step_1.json") is None
    assert describe_path("notes.txt") is None
    assert len({f.pattern for f in RUN_FOLDER}) == len(RUN_FOLDER)
