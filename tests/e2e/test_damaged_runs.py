"""A run folder damaged after its run (a disk, a sync tool, a hand edit): the commands that read
it say so in one line naming the file (exit 2), never with a traceback, and write nothing; a
resume refuses before it trains a step, not at the run's end."""

from __future__ import annotations

import gzip
import shutil
import sys

import pytest

from tests.conftest import in_process

NOT_UTF8 = b"\xff\xfe\x00\x81 run\n"
A_LIST = b"[1, 2]\n"


SIGNATURES = "signatures/step_*.json"
ANSWERS = "val_answers/step_*.jsonl.gz"
REWARD = "def reward(completions, **kw):\n    return [0.0 for _ in completions]\n"


CASES = [
    # (id, file in the run (a pattern: its first match), damaged contents (None: half of it),
    # command, what the line says)
    ("metrics-not-utf8", "metrics.jsonl", NOT_UTF8, "inspect", "byte 0 is not UTF-8 text"),
    ("metrics-list", "metrics.jsonl", A_LIST, "inspect", "line 1 of 1 is JSON but not an object"),
    ("metrics-no-step", "metrics.jsonl", b'{"x": 1}\n', "inspect", "record 1 of 1 has no step"),
    (
        "events-no-step",
        "events.jsonl",
        b'{"action": "data"}\n',
        "inspect",
        "record 1 of 1 has no step",
    ),
    ("signatures-empty", SIGNATURES, b"", "inspect", "is not JSON"),
    ("signatures-half", SIGNATURES, None, "inspect", "is not JSON"),
    ("signatures-not-utf8", SIGNATURES, NOT_UTF8, "inspect", "is not UTF-8 text"),
    ("signatures-list", SIGNATURES, A_LIST, "inspect", "holds a JSON list, not an object"),
    (
        "signatures-role",
        SIGNATURES,
        b'{"generator": 3}',
        "inspect",
        "role 'generator' has no mapping",
    ),
    ("base-empty", "base.json", b"", "export", "is not JSON"),
    ("base-not-utf8", "base.json", NOT_UTF8, "export", "is not UTF-8 text"),
    ("base-list", "base.json", A_LIST, "export", "holds a JSON list, not an object"),
    ("base-fields", "base.json", b'{"name": "tiny-s"}', "export", "is not the record of a run's"),
    ("resume-base", "base.json", b'{"name": 1}', "resume", "is not the record of a run's"),
    ("resume-metrics", "metrics.jsonl", b'{"x": 1}\n', "resume", "record 1 of 1 has no step"),
    ("resume-signatures", SIGNATURES, b"", "resume", "is not JSON"),
    ("answers-not-gzip", ANSWERS, NOT_UTF8, "rescore", "not a readable answers file"),
    ("answers-half", ANSWERS, None, "rescore", "not a readable answers file"),
    ("answers-list", ANSWERS, gzip.compress(A_LIST), "rescore", "row 1 is not an answer's"),
    ("answers-row", ANSWERS, gzip.compress(b'{"x": 1}\n'), "rescore", "row 1 is not an answer's"),
]


@pytest.mark.parametrize(
    ("file", "data", "command", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_damaged_run_file_is_one_line_naming_it(
    trained_voting, tmp_path, monkeypatch, file, data, command, says
):
    run = tmp_path / "run"
    shutil.copytree(trained_voting, run)
    (tmp_path / "reward.py").write_text(REWARD)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    found = sorted(run.glob(file)) or [run / file]  # events.jsonl: a run without alarms has none
    damaged = found[0]
    damaged.write_bytes(
        damaged.read_bytes()[: damaged.stat().st_size // 2] if data is None else data
    )
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    args = {
        "inspect": ["inspect", run],
        "export": ["export", run, tmp_path / "exported"],
        "resume": ["train", "--resume", "--out", run, "steps=3"],
        "rescore": ["rescore", run, "--reward", "reward.py:reward"],
    }[command]
    result = in_process(args, tmp_path)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert lines[-1].startswith(f"error: {damaged}") and says in lines[-1]
    if command == "resume":  # refused before a step was trained
        assert not any(line.startswith("step ") for line in lines)
        assert "repair or remove it, then resume" in lines[-1]
    else:
        assert len(lines) == 1
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
