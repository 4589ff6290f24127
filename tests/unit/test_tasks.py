"""Tasks from a dataset file: config checks, the fixed split, seeded epoch batches, the grader."""

from __future__ import annotations

import pytest

from marlow.config import ConfigError, resolve
from marlow.tasks import build_task
from tests.conftest import DATA

GSM8K = str(DATA / "gsm8k_test.jsonl")


def task_config(**task):
    return resolve({"preset": "tiny", "task": task}).task


def test_a_file_source_needs_a_known_dataset_format():
    with pytest.raises(ConfigError, match="task.dataset.*valid: gsm8k, math500, dapo"):
        task_config(source=GSM8K)
    with pytest.raises(ConfigError, match="valid: gsm8k, math500, dapo"):
        task_config(source=GSM8K, dataset="humaneval")
    with pytest.raises(ConfigError, match="only for a file or hub source"):
        task_config(dataset="gsm8k")


def test_gsm8k_file_split_and_epoch_batches():
    task = build_task(task_config(source=GSM8K, dataset="gsm8k", val_size=100))
    val = task.val_problems()
    assert len(val) == 100
    size, n_train = 64, 1319 - 100
    steps = -(-n_train // size)  # the first epoch spans this many steps
    seen = [p.id for step in range(1, steps + 1) for p in task.train_batch(7, step, size)]
    first_epoch = seen[:n_train]
    assert len(set(first_epoch)) == n_train  # every train problem once per epoch
    assert not set(first_epoch) & {p.id for p in val}  # disjoint from validation
    assert [p.id for p in task.train_batch(7, 3, size)] == seen[2 * size : 3 * size]  # pure
    assert [p.id for p in task.train_batch(8, 1, size)] != seen[:size]  # seeded
    grade = task.grader()
    assert all(grade(f"so \\boxed{{{p.answer}}}", p) == 1.0 for p in val)
    assert (
        build_task(task_config(source=GSM8K, dataset="gsm8k", val_size=100)).val_problems() == val
    )


def test_val_size_must_leave_training_problems():
    with pytest.raises(ConfigError, match="only 1319 usable problems"):
        build_task(task_config(source=GSM8K, dataset="gsm8k", val_size=1319))


def test_a_run_trains_on_a_dataset_file(small_config, tmp_path):
    from marlow.diagnostics.sinks import read_metrics
    from marlow.training.trainer import Trainer

    cfg = small_config(task={"source": GSM8K, "dataset": "gsm8k", "val_size": 4}, steps=1)
    out = Trainer(cfg, tmp_path / "run").run()
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["val/all/n_problems"] == 4
    said: list[str] = []
    with Trainer(cfg, out, log=said.append):  # a later command of the run: a resume, an eval
        pass
    assert "data as at the run's start: kept 1319, skipped 0" in said


def test_a_runs_data_warning_is_given_once_and_again_when_the_data_change(tmp_path):
    rows = (DATA / "gsm8k_test.jsonl").read_text().splitlines()[:40]
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join([*rows[:20], "not json", *rows[20:]]) + "\n")
    cfg = task_config(source=str(path), dataset="gsm8k", val_size=4)
    first: list[str] = []
    task = build_task(cfg, log=first.append)
    assert first[0].startswith("WARNING data") and "line 21" in first[0]
    event = {"step": 0, "action": "data", **task.data_report}  # as the run records it
    again: list[str] = []
    build_task(cfg, log=again.append, recorded=event)
    assert again == ["data as at the run's start: kept 40, skipped 1"]
    path.write_text("\n".join([*rows, "not json", ""]) + "\n")  # a row more, the bad one moved
    changed: list[str] = []
    build_task(cfg, log=changed.append, recorded=event)
    assert changed[0].startswith("WARNING data") and "line 41" in changed[0]
    assert "differ from what the run started with" in changed[-1]
