"""The metrics and run-folder catalogues (the reference pages' sources) hold what a real run
writes: a metric or a file the trainer starts writing without a line there fails here."""

from __future__ import annotations

import json

from marlow.diagnostics.metrics import METRICS, TIMINGS, describe_metric
from marlow.runfolder import RUN_FOLDER, describe_path


def test_every_metric_key_of_a_real_run_is_in_the_catalogue(trained_voting):
    keys = set()
    for line in (trained_voting / "metrics.jsonl").read_text().splitlines():
        keys |= set(json.loads(line))
    unknown = sorted(k for k in keys if not k.startswith(TIMINGS) and describe_metric(k) is None)
    assert unknown == []
    assert {"train/generator/entropy", "val/all/accuracy", "train/shared/grad_norm"} <= keys


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
