"""Dataset loaders: the real files in tests/data, hub-format fixtures (jsonl, parquet), the split."""

from __future__ import annotations

import gzip
import json
import sys
import types
from pathlib import Path

import pytest

from marlow.rewards import score_code
from marlow.tasks.loaders import (
    DATASETS,
    DEEPCODER_SUBSETS,
    DatasetError,
    load,
    load_dapo,
    load_deepcoder,
    load_gsm8k,
    load_humaneval,
    load_math500,
    split,
)
from marlow.types import Problem
from tests.conftest import DATA


def write_jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write(tmp_path: Path, fmt: str, rows: list[dict], name: str = "rows") -> Path:
    if fmt == "jsonl":
        return write_jsonl(tmp_path / f"{name}.jsonl", rows)
    return write_parquet(tmp_path / f"{name}.parquet", rows)


# ----------------------------------------------------------------------------- real files


def test_gsm8k_real_file():
    problems, report = load_gsm8k(DATA / "gsm8k_test.jsonl")
    assert len(problems) == report.kept == report.rows_read == 1319
    assert not report.skipped
    assert problems[0].id == "gsm8k/0"
    assert problems[0].prompt.startswith("Janet")
    assert problems[0].answer == "18"
    # golds with thousands separators lose their commas (rows 146, 201: "2,125", "114,200")
    assert problems[146].answer == "2125"
    assert problems[201].answer == "114200"
    assert all("," not in p.answer and "####" not in p.answer for p in problems)
    assert "<<" in problems[0].meta["solution"]


def test_math500_real_file():
    problems, report = load_math500(DATA / "math500_test.jsonl")
    assert len(problems) == report.kept == 500
    first, last = problems[0], problems[-1]
    assert first.id == "math500/test/precalculus/807.json"
    assert first.answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert first.meta["level"] == 2 and first.meta["subject"] == "Precalculus"
    assert first.meta["unique_id"] == "test/precalculus/807.json"
    assert last.answer == r"106^\circ" and last.meta["subject"] == "Geometry"
    assert len({p.id for p in problems}) == 500


def test_humaneval_real_file():
    problems, report = load_humaneval(DATA / "HumanEval.jsonl.gz")
    assert len(problems) == report.kept == 164
    p = problems[0]
    assert p.id == "humaneval/HumanEval/0"
    assert p.meta["entry_point"] == "has_close_elements"
    assert p.prompt.startswith("from typing import List")
    assert p.meta["tests"] == {
        "check": p.meta["test"],
        "entry_point": "has_close_elements",
        "prompt": p.prompt,
    }
    assert all(p.meta["canonical_solution"] and "def check" in p.meta["test"] for p in problems)


def test_humaneval_canonical_solutions_score_one():
    problems, _ = load_humaneval(DATA / "HumanEval.jsonl.gz", limit=5)
    assert len(problems) == 5
    for p in problems:
        completion = f"```python\n{p.prompt}{p.meta['canonical_solution']}\n```"
        assert score_code(completion, p.meta["tests"]) == 1.0, p.id
    # and the tests can fail: the bare prompt (no body) does not pass
    bare = f"```python\n{problems[0].prompt}    pass\n```"
    assert score_code(bare, problems[0].meta["tests"]) < 1.0


def test_wrong_file_names_the_fields():
    with pytest.raises(DatasetError) as e:
        load_math500(DATA / "HumanEval.jsonl.gz")
    msg = str(e.value)
    assert "\n" not in msg
    assert "problem" in msg and "answer" in msg and "entry_point" in msg


def test_gsm8k_bad_rows_skipped_and_strict(tmp_path):
    rows = [
        {"question": "q0", "answer": "work\n#### 1,234"},
        {"question": "q1", "answer": "no marker"},
        {"answer": "#### 3"},
        "{not json",
        {"question": "q4", "answer": "a #### 1 #### -5"},
    ]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    problems, report = load_gsm8k(path)
    assert [(p.id, p.answer) for p in problems] == [("gsm8k/0", "1234"), ("gsm8k/4", "-5")]
    assert report.rows_read == 5 and report.kept == 2
    assert report.skipped == {"no_gold_marker": 1, "missing_field:question": 1, "bad_json": 1}
    assert "bad_json=1 (line 4)" in report.summary()
    assert "no_gold_marker=1 (line 2)" in report.summary()
    with pytest.raises(DatasetError, match="line 2 of gsm8k rejected .no_gold_marker."):
        load_gsm8k(path, strict=True)


def test_skipped_rows_are_located_by_line_and_id_and_blank_lines_counted(tmp_path):
    from marlow.tasks.loaders import load_columns

    path = tmp_path / "mine.jsonl"
    lines = ['{"id": "s-1", "q": "1+1"}', "", '{"id": "s-2"}', "   ", '{"id": "s-3", "q": "2+2"}',
             '{"id": "s-4", "q": ""}', '{"id": "s-5"}', '{"id": "s-6"}', '{"id": "s-7"}']  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    problems, report = load_columns(path, prompt_field="q")
    assert [p.id for p in problems] == ["s-1", "s-3"]
    assert report.rows_read == 7 and report.skipped["blank_line"] == 2
    summary = report.summary()
    assert "blank_line=2 (line 2, line 4)" in summary
    assert "missing_field:q=5 (line 3 (id s-2), line 6 (id s-4), line 7 (id s-5), ...)" in summary
    with pytest.raises(DatasetError, match=r"line 3 \(id s-2\) of custom rejected"):
        load_columns(path, prompt_field="q", strict=True)


def test_a_byte_order_mark_is_no_part_of_the_first_row(tmp_path):
    from marlow.tasks.loaders import load_columns

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"q": "1+1"}\n{"q": "2+2"}\n')
    problems, report = load_columns(path, prompt_field="q")
    assert [p.prompt for p in problems] == ["1+1", "2+2"] and report.n_skipped == 0
    gz = tmp_path / "bom.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert [p.prompt for p in load_columns(gz, prompt_field="q")[0]] == ["1+1", "2+2"]


def test_a_line_that_is_not_utf8_is_skipped_and_the_rest_load(tmp_path):
    from marlow.tasks.loaders import load_columns

    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"q": "1+1"}\n{"q": "caf\xe9"}\n{"q": "2+2"}\n')
    problems, report = load_columns(path, prompt_field="q")
    assert [p.prompt for p in problems] == ["1+1", "2+2"]
    assert report.skipped == {"not_utf8": 1} and "not_utf8=1 (line 2)" in report.summary()
    path.write_bytes(b'{"q": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match="most rows: not_utf8: .*save it as UTF-8"):
        load_columns(path, prompt_field="q")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_file_in_a_wide_encoding_is_named_in_one_line(tmp_path, encoding):
    from marlow.tasks.loaders import load_columns

    path = tmp_path / "wide.jsonl"
    path.write_bytes('{"q": "1+1"}\n'.encode(encoding))  # with its byte-order mark
    with pytest.raises(DatasetError) as e:
        load_columns(path, prompt_field="q")
    assert f"is {encoding.upper()} text" in str(e.value) and "\n" not in str(e.value)


def test_a_prompt_that_is_not_text_is_skipped_and_a_number_is_read_as_text(tmp_path):
    from marlow.tasks.loaders import load_columns

    lines = [
        '{"id": "a", "q": "1+1", "gold": 2}',
        '{"id": "b", "q": [{"role": "user", "content": "1+1"}]}',  # chat messages
        '{"id": "c", "q": {"text": "1+1"}}',
        '{"id": "d", "q": "1+\\ud800"}',  # JSON's escape of a lone surrogate
        '{"id": "e", "q": 12345, "gold": "x"}',
        '{"id": "f", "q": "3+3", "gold": ["6", "six"]}',
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems, report = load_columns(path, prompt_field="q")
    assert [(p.id, p.prompt) for p in problems] == [("a", "1+1"), ("e", "12345"), ("f", "3+3")]
    assert report.skipped == {"not_text:q": 3}
    assert "not_text:q=3 (line 2 (id b), line 3 (id c), line 4 (id d))" in report.summary()
    problems, report = load_columns(path, prompt_field="q", answer_field="gold")
    assert [(p.id, p.answer) for p in problems] == [("a", "2"), ("e", "x")]
    assert report.skipped == {"not_text:q": 3, "not_text:gold": 1}


def test_a_file_of_chat_messages_says_what_the_prompt_column_must_hold(tmp_path):
    from marlow.tasks.loaders import load_columns

    row = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [row, row])
    with pytest.raises(DatasetError) as e:
        load_columns(path)
    message = str(e.value)
    assert "most rows: not_text:prompt" in message and "chat messages" in message
    assert "must hold the problem's text" in message and "\n" not in message


# ----------------------------------------------------------------------------- DAPO


def dapo_row(prompt: str, answer: str, idx: str) -> dict:
    return {
        "prompt": prompt,
        "solution": answer,
        "data_source": "math_dapo",
        "source_prompt": [{"content": prompt, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": idx},
    }


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_dapo_processed_dedup_and_bad_rows(tmp_path, fmt):
    rows = [
        dapo_row("What is 1+1?", "2", "a"),
        dapo_row("What is 2+2?", "4", "b"),
        dapo_row("What is 1+1?", "2", "c"),  # duplicate prompt
        dapo_row("What is 1+1?  ", "3", "d"),  # duplicate after stripping
        dapo_row("", "5", "e"),  # empty prompt
        dapo_row("What is 3+3?", "", "f"),  # empty answer
    ]
    problems, report = load_dapo(write(tmp_path, fmt, rows))
    assert [(p.id, p.prompt, p.answer) for p in problems] == [
        ("dapo/a", "What is 1+1?", "2"),
        ("dapo/b", "What is 2+2?", "4"),
    ]
    assert problems[0].meta["data_source"] == "math_dapo"
    assert report.rows_read == 6 and report.kept == 2
    assert report.skipped == {
        "duplicate_prompt": 2,
        "missing_field:prompt": 1,
        "missing_field:solution": 1,
    }


def test_dapo_raw_chat_form(tmp_path):
    row = dapo_row("ignored", "7", "z")
    row["prompt"] = row.pop("source_prompt")
    row["prompt"][0]["content"] = "Compute 3+4."
    del row["solution"]
    problems, _ = load_dapo(write_jsonl(tmp_path / "raw.jsonl", [row]))
    assert (problems[0].prompt, problems[0].answer) == ("Compute 3+4.", "7")


# ----------------------------------------------------------------------------- DeepCoder

ADD = "a, b = map(int, input().split())\nprint(a + b)"
FN = "def add(a, b):\n    return a + b"


def dc_row(tests, metadata=None, problem="Add two numbers.", **extra) -> dict:
    row = {
        "problem": problem,
        "tests": tests if isinstance(tests, str) else json.dumps(tests),
        "metadata": json.dumps(metadata or {}),
    }
    row.update(extra)
    return row


# per subset: (good stdin row, good function row or None, expected code for each)
GOOD = {
    "primeintellect": [
        (
            dc_row([{"type": "stdin_stdout", "input": "1 2\n", "output": "3\n"}]),
            ADD,
        ),
        (
            dc_row(
                [
                    {"type": "function_call", "fn_name": "add", "input": [1, 2], "output": [3]},
                    {"type": "function_call", "fn_name": "add", "input": [5, 5], "output": [10]},
                ]
            ),
            FN,
        ),
    ],
    "taco": [
        (dc_row({"inputs": ["1 2\n", "4 5\n"], "outputs": ["3\n", "9\n"]}), ADD),
        (dc_row({"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]}), FN),
    ],
    "lcbv5": [
        (dc_row([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]), ADD),
        (
            dc_row(
                [{"input": "1\n2", "output": "3", "testtype": "functional"}],
                metadata={"func_name": "add"},
                starter_code="class Solution:\n    def add(self, a, b):\n        ",
            ),
            "class Solution:\n    def add(self, a, b):\n        return a + b",
        ),
    ],
    "codeforces": [
        (dc_row([{"input": "1 2\n", "output": "3\n"}, {"input": "0 0", "output": "0"}]), ADD),
        (dc_row([{"type": "stdin_stdout", "input": "7 8\n", "output": "15\n"}]), ADD),
    ],
}

BAD = [
    (dc_row([]), "empty_tests"),
    (dc_row(""), "empty_tests"),
    (dc_row({"inputs": [], "outputs": []}), "empty_tests"),
    (dc_row("{not json"), "unparseable_tests"),
    (dc_row({"inputs": ["1"], "outputs": ["1", "2"]}), "unparseable_tests"),
    (dc_row([{"input": "1"}]), "unparseable_tests"),
    (dc_row([{"type": "function_call", "input": [1], "output": 1}]), "unparseable_tests"),
    (dc_row(42), "unparseable_tests"),
    (dc_row([{"input": "1", "output": "1"}], problem=""), "missing_field:problem"),
    ({"problem": "no tests column"}, "missing_field:tests"),
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("subset", DEEPCODER_SUBSETS)
def test_deepcoder_subsets(tmp_path, subset, fmt):
    good = GOOD[subset]
    rows = [good[0][0], *(r for r, _ in BAD), good[1][0]]
    if fmt == "parquet":  # parquet needs one schema: keep every column on every row
        rows = [{"starter_code": "", **dc_row([]), **r} for r in rows]
        rows[-2].pop("tests", None)
        rows[-2]["tests"] = None
    problems, report = load_deepcoder(write(tmp_path, fmt, rows), subset=subset)
    assert report.rows_read == len(rows)
    assert report.kept == 2
    expected = {}
    for _, reason in BAD:
        expected[reason] = expected.get(reason, 0) + 1
    assert report.skipped == expected
    assert [p.id for p in problems] == [
        f"deepcoder/{subset}/0",
        f"deepcoder/{subset}/{len(rows) - 1}",
    ]
    for p, (_, code) in zip(problems, good, strict=True):
        assert p.prompt == "Add two numbers."
        assert p.meta["subset"] == subset
        assert score_code(f"```python\n{code}\n```", p.meta["tests"]) == 1.0
        assert score_code("```python\nprint(0)\n```", p.meta["tests"]) < 1.0
    if subset == "lcbv5":
        assert problems[1].meta["starter_code"].startswith("class Solution")


def test_deepcoder_strict_raises(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD["taco"][0][0], dc_row([])])
    with pytest.raises(DatasetError, match="line 2 of deepcoder rejected .empty_tests."):
        load_deepcoder(path, subset="taco", strict=True)


# ----------------------------------------------------------------------------- errors


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(DatasetError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def test_unknown_names_list_the_choices(tmp_path):
    msg = one_line_error(load, "gsm9k", tmp_path / "x.jsonl")
    assert all(n in msg for n in DATASETS)
    msg = one_line_error(load_deepcoder, tmp_path / "x.jsonl", subset="apps")
    assert all(s in msg for s in DEEPCODER_SUBSETS)
    msg = one_line_error(load, "deepcoder", tmp_path / "x.jsonl")
    assert all(s in msg for s in DEEPCODER_SUBSETS)


def test_bad_sources(tmp_path):
    assert "file not found" in one_line_error(load_gsm8k, tmp_path / "missing.jsonl")
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    assert ".parquet" in one_line_error(load_gsm8k, csv)
    assert "hub id" in one_line_error(load_gsm8k, "not a source")
    fake_gz = tmp_path / "x.jsonl.gz"
    fake_gz.write_text("plain text, not gzip")
    assert "jsonl" in one_line_error(load_gsm8k, fake_gz)
    fake_pq = tmp_path / "x.parquet"
    fake_pq.write_text("not parquet")
    pytest.importorskip("pyarrow")
    assert "parquet" in one_line_error(load_gsm8k, fake_pq)
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    assert "no rows" in one_line_error(load_gsm8k, empty)


def test_missing_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    msg = one_line_error(load_gsm8k, path)
    assert "pyarrow" in msg and "marlow[data]" in msg


def test_hub_id_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    msg = one_line_error(load_gsm8k, "openai/gsm8k")
    assert "datasets" in msg and "marlow[data]" in msg and "openai/gsm8k" in msg


def test_hub_id_offline(monkeypatch):
    fake = types.ModuleType("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub\n(LocalEntryNotFound)")

    fake.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", fake)
    msg = one_line_error(load_gsm8k, "openai/gsm8k")
    assert "openai/gsm8k" in msg and "ConnectionError" in msg and "split=test" in msg


def test_hub_rows_go_through_the_loader(monkeypatch):
    fake = types.ModuleType("datasets")
    seen = {}

    def load_dataset(hub_id, name=None, split=None):
        seen.update(hub_id=hub_id, name=name, split=split)
        return [{"question": "q", "answer": "#### 12"}]

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    problems, _ = load_gsm8k("openai/gsm8k")
    assert problems[0].answer == "12"
    assert seen == {"hub_id": "openai/gsm8k", "name": "main", "split": "test"}


def test_jsonl_gz_reads(tmp_path):
    path = tmp_path / "m.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"problem": "p", "answer": " 3 ", "level": 1}) + "\n")
    problems, _ = load_math500(path)
    assert (problems[0].id, problems[0].answer, problems[0].meta) == (
        "math500/0",
        "3",
        {"level": 1},
    )


# ----------------------------------------------------------------------------- split


def probs(n: int) -> list[Problem]:
    return [Problem(f"p/{i}", f"prompt {i}", str(i)) for i in range(n)]


def test_split_disjoint_seeded_order_independent():
    ps = probs(100)
    train, val = split(ps, 20, seed=0)
    assert len(val) == 20 and len(train) == 80
    assert {p.id for p in train}.isdisjoint({p.id for p in val})
    assert {p.id for p in train} | {p.id for p in val} == {p.id for p in ps}
    again = split(list(reversed(ps)), 20, seed=0)
    assert again == (train, val)  # same lists, same order, whatever the input order
    other = split(ps, 20, seed=1)
    assert {p.id for p in other[1]} != {p.id for p in val}
    assert [p.id for p in val] != [p.id for p in ps[:20]]  # not just the first rows


def test_split_stable_under_growth():
    # keys depend only on (seed, id): problems common to two inputs keep their relative order
    small_train, small_val = split(probs(50), 10, seed=3)
    big_train, big_val = split(probs(100), 10, seed=3)
    common = {p.id for p in probs(50)}
    big_order = [p.id for p in big_val + big_train if p.id in common]
    assert big_order == [p.id for p in small_val + small_train]


def test_split_bad_arguments():
    assert "val_size" in one_line_error(split, probs(3), 4, 0)
    assert "val_size" in one_line_error(split, probs(3), 0.5, 0)
    dup = probs(2) + probs(1)
    assert "p/0" in one_line_error(split, dup, 1, 0)
    assert split(probs(3), 0, 0)[1] == []
