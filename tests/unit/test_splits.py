"""Dataset splits: marlow's id-hash split and the official code's, which is the
``datasets`` library's seeded permutation of the rows; the held-out part; the official runtime
filter of DeepCoder tests."""

from __future__ import annotations

import json

import pytest

from marlow.config import ConfigError, resolve
from marlow.tasks import base
from marlow.tasks.loaders import DatasetError, load, permutation_split
from marlow.types import Problem

# What datasets 5.2.0 (numpy 2.4.6) gave for Dataset.from_dict({"i": range(23)}):
# .train_test_split(test_size=0.1, seed=42) and .shuffle(seed=42)["i"].
DATASETS_TEST = [18, 10, 17]
DATASETS_TRAIN = [22, 16, 15, 7, 6, 9, 3, 0, 19, 12, 5, 11, 14, 21, 2, 4, 20, 1, 13, 8]


def rows(n):
    return [Problem(f"r{i}", f"q{i}", str(i)) for i in range(n)]


def test_the_permutation_split_is_the_datasets_librarys():
    train, held = permutation_split(rows(23), list(range(23)), 23, 0.1, 42)
    assert [p.id for p in held] == [f"r{i}" for i in DATASETS_TEST]
    assert [p.id for p in train] == [f"r{i}" for i in DATASETS_TRAIN]
    # shuffle(seed) then the first k rows: the same order, with a count
    train, held = permutation_split(rows(23), list(range(23)), 23, 5, 42)
    assert [p.id for p in held + train] == [f"r{i}" for i in DATASETS_TEST + DATASETS_TRAIN]
    assert len(held) == 5


def test_the_permutation_split_matches_datasets_where_it_is_installed():
    datasets = pytest.importorskip("datasets")
    for n, holdout, seed in ((23, 0.1, 42), (101, 0.1, 42), (57, 0.25, 7), (40, 9, 42)):
        table = datasets.Dataset.from_dict({"i": list(range(n))})
        if isinstance(holdout, float):
            theirs = table.train_test_split(test_size=holdout, seed=seed)
            want_held, want_train = list(theirs["test"]["i"]), list(theirs["train"]["i"])
        else:
            order = list(table.shuffle(seed=seed)["i"])
            want_held, want_train = order[:holdout], order[holdout:]
        train, held = permutation_split(rows(n), list(range(n)), n, holdout, seed)
        assert [p.id for p in held] == [f"r{i}" for i in want_held]
        assert [p.id for p in train] == [f"r{i}" for i in want_train]


def test_a_row_marlow_skipped_leaves_only_its_own_side():
    kept = [p for p in rows(23) if p.id not in ("r10", "r22")]  # a held-out row and a train row
    positions = [int(p.id[1:]) for p in kept]
    train, held = permutation_split(kept, positions, 23, 0.1, 42)
    assert [p.id for p in held] == ["r18", "r17"]
    assert [p.id for p in train] == [f"r{i}" for i in DATASETS_TRAIN if i != 22]


def write_dapo(path, n, bad=()):
    lines = []
    for i in range(n):
        row = {"prompt": f"What is {i}+1?", "solution": str(i + 1)}
        if i in bad:
            row = {"prompt": f"What is {i}+1?"}  # no solution: marlow skips the row
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_official_split_holds_out_a_tenth_and_validates_on_its_first_val_size(tmp_path):
    source = write_dapo(tmp_path / "dapo.jsonl", 23, bad={22})
    task = {"source": source, "dataset": "dapo", "holdout": 0.1, "val_size": 2}
    built = base.build_task(resolve({"preset": "official", "task": task}).task)
    assert built.config.split_rule == "permutation" and built.config.split_seed == 42
    assert [p.id for p in built.val_problems()] == ["dapo/18", "dapo/10"]
    assert [p.id for p in built._train] == [f"dapo/{i}" for i in DATASETS_TRAIN if i != 22]
    # marlow's own rule holds out the same number, chosen by id hash
    mine = base.build_task(resolve({"task": task}).task)
    assert len(mine._train) == 19 and len(mine.val_problems()) == 2
    assert {p.id for p in mine._train} != {p.id for p in built._train}


def test_a_holdout_with_its_own_validation_source_never_trains_on_the_held_out(tmp_path):
    source = write_dapo(tmp_path / "dapo.jsonl", 23)
    other = write_dapo(tmp_path / "aime.jsonl", 4)
    task = {
        "source": source,
        "dataset": "dapo",
        "holdout": 0.1,
        "val_source": other,
        "val_dataset": "dapo",
    }
    built = base.build_task(resolve({"preset": "official", "task": task}).task)
    assert [p.prompt for p in built.val_problems()] == [f"What is {i}+1?" for i in range(4)]
    assert sorted(p.id for p in built._train) == sorted(f"dapo/{i}" for i in DATASETS_TRAIN)


def write_deepcoder(path, tests_per_row):
    lines = []
    for i, n in enumerate(tests_per_row):
        tests = [{"input": f"{k}\n", "output": f"{k}\n", "testtype": "stdin"} for k in range(n)]
        lines.append(json.dumps({"problem": f"Echo {i}.", "tests": json.dumps(tests)}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_runtime_filter_keeps_the_passing_tests_and_drops_problems_with_none(tmp_path):
    source = write_deepcoder(tmp_path / "dc.jsonl", [3, 2, 2, 1])
    results = {  # row 3 is not named: kept whole
        "0": {"0": {"status": "passed"}, "1": {"status": "timeout"}, "2": {"status": "passed"}},
        "1": {"0": {"status": "failed"}, "1": {"status": "timeout"}},
        "2": {"0": {"status": "passed"}},
    }
    filt = tmp_path / "runtime_results.json"
    filt.write_text(json.dumps(results))
    problems, report = load("deepcoder", source, subset="primeintellect", runtime_filter=filt)
    assert [p.id for p in problems] == [
        "deepcoder/primeintellect/0",
        "deepcoder/primeintellect/2",
        "deepcoder/primeintellect/3",
    ]
    assert [t["input"] for t in problems[0].meta["tests"]] == ["0\n", "2\n"]
    assert [t["input"] for t in problems[1].meta["tests"]] == ["0\n"]
    assert len(problems[2].meta["tests"]) == 1
    assert report.skipped["no_passing_tests"] == 1
    # the split permutes the rows the filter left, as the official code shuffles its table
    assert (report.positions, report.n_positions) == ([0, 1, 2], 3)


def test_a_bad_runtime_filter_or_holdout_is_one_line(tmp_path):
    source = write_deepcoder(tmp_path / "dc.jsonl", [1, 1])
    bad = tmp_path / "bad.json"
    bad.write_text('{"0": [1, 2]}')
    task = {
        "name": "code",
        "source": source,
        "dataset": "deepcoder",
        "subset": "primeintellect",
        "val_size": 1,
    }
    with pytest.raises(ConfigError, match="task.runtime_filter .* row 0 is not"):
        base.build_task(resolve({"task": {**task, "runtime_filter": str(bad)}}).task)
    with pytest.raises(ConfigError, match="only for task.dataset deepcoder"):
        resolve({"task": {"source": "x.jsonl", "dataset": "dapo", "runtime_filter": "r.json"}})
    with pytest.raises(ConfigError, match="a fraction must be in"):
        resolve({"task": {"source": "x.jsonl", "dataset": "dapo", "holdout": 1.5}})
    with pytest.raises(ConfigError, match="only for a dataset source"):
        resolve({"task": {"holdout": 10}})
    with pytest.raises(ConfigError, match="holds out 2 of 2"):
        base.build_task(resolve({"task": {**task, "holdout": 2}}).task)
    with pytest.raises(DatasetError, match="leave some for training"):
        permutation_split(rows(3), [0, 1, 2], 3, 3, 42)
