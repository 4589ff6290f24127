"""marlow.fileio: a folder held by one holder at a time; a run's JSON files read back."""

from __future__ import annotations

import subprocess
import sys

import pytest

from marlow.diagnostics.sinks import read_jsonl, read_metrics
from marlow.fileio import DamagedFileError, FolderBusy, held, read_json_object, write_json


def test_a_held_folder_refuses_a_second_holder_at_once_and_gets_nothing_written(tmp_path):
    with held(tmp_path, "marlow train"):
        busy = f"^another marlow train is running in {tmp_path}$"
        with pytest.raises(FolderBusy, match=busy), held(tmp_path, "marlow train"):
            pass
        assert list(tmp_path.iterdir()) == []
    with held(tmp_path, "marlow train"):  # let go of at the end of the block
        pass


def test_a_process_killed_while_holding_a_folder_lets_go_of_it(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom marlow.fileio import held\n"
            f"with held({str(tmp_path)!r}, 'x'):\n    print('held', flush=True)\n    time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusy), held(tmp_path, "x"):
            pass
    finally:
        holder.kill()
        holder.wait()
    with held(tmp_path, "x"):
        pass


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "is not JSON"),
        (b'{"a": 1', "is not JSON"),
        (b"\xff\xfe{}", "is not UTF-8 text"),
        (b"[1, 2]", "holds a JSON list, not an object"),
        (b"null", "holds a JSON NoneType, not an object"),
    ],
)
def test_a_damaged_json_object_is_one_line_naming_the_file(tmp_path, data, says):
    path = tmp_path / "eval.json"
    path.write_bytes(data)
    with pytest.raises(DamagedFileError) as err:
        read_json_object(path)
    assert str(err.value).startswith(f"{path} {says}") and "\n" not in str(err.value)
    assert read_json_object(write_json(path, {"a": [1.5]})) == {"a": [1.5]}


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b'{"step": 0}\n\xff\n{"step": 1}\n', "byte 12 is not UTF-8 text"),
        (b'{"step": 0}\n[1, 2]\n', "line 2 of 2 is JSON but not an object"),
        (b'{"step": 0}\n3\n{"step": 1}\n', "line 2 of 3 is JSON but not an object"),
        (b'{"step": 0}\n{"step": 1\n{"step": 2}\n', "line 2 of 3 is not JSON"),
        (b'{"step": 0}\n{"loss": 1.0}\n', "record 2 of 2 has no step"),
        (b'{"step": "1"}\n', "record 1 of 1 has no step"),
        (b'{"step": true}\n', "record 1 of 1 has no step"),
        (b'{"step": -1}\n', "record 1 of 1 has no step"),
        (b'{"step": 1, "loss": "x"}\n', "record 1 of 1 holds 'loss', which is not a number"),
        (b'{"step": 1, "loss": [1]}\n', "record 1 of 1 holds 'loss', which is not a number"),
    ],
)
def test_damaged_metrics_are_one_line_naming_the_file_and_what_is_wrong(tmp_path, data, says):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(data)
    with pytest.raises(DamagedFileError) as err:
        read_metrics(tmp_path)
    assert str(err.value).startswith(f"{path}: {says}")
    assert str(err.value).endswith("; the file is damaged") and "\n" not in str(err.value)


def test_only_a_half_written_last_line_is_left_out(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0}\n{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 0}, {"step": 1, "loss": 0.5}]
    path.write_bytes(b'{"step": 0, "a": NaN, "b": null, "c": true, "d": -Infinity}\n')
    (record,) = read_metrics(tmp_path)  # what the trainer writes besides plain numbers
    assert record["a"] != record["a"] and record["b"] is None and record["c"] is True


def test_events_need_their_step_and_a_hand_edited_event_still_reads(tmp_path):
    from marlow.diagnostics.sinks import read_stepped
    from marlow.report.inspect import event_line

    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"step": 0, "action": "data", "skipped": [1]}\n{"action": "resume"}\n')
    with pytest.raises(DamagedFileError, match="record 2 of 2 has no step"):
        read_stepped(path)
    assert event_line({"step": 0, "action": "data", "skipped": [1]}).endswith("skipped none")
    assert event_line({"step": 3, "action": "resume", "changed": [1, "steps: 4 -> 8"]}) == (
        "resumed from None (changed: 1, steps: 4 -> 8)"
    )
    path.write_bytes(b'{"step": 0}\n[1, 2]\n')  # complete JSON, not half of an object
    with pytest.raises(DamagedFileError):
        list(read_jsonl(path))


def test_a_write_error_is_no_space_by_its_errno_or_by_a_device_left_without_space(
    tmp_path, monkeypatch
):
    import errno
    import shutil

    import marlow.fileio
    from marlow.fileio import NoSpace, no_space

    target = tmp_path / "run" / "checkpoints"  # not made yet: its device is tmp_path's
    quota = no_space(OSError(errno.EDQUOT, "Disk quota exceeded"), target)
    assert isinstance(quota, NoSpace) and quota.errno == errno.ENOSPC
    assert str(quota).startswith(f"no space left on the device holding {target} (")
    assert "\n" not in str(quota) and "[Errno" not in str(quota)
    assert no_space(RuntimeError("unexpected pos 64 vs 0"), target) is None  # space is left
    assert no_space(OSError(errno.EACCES, "Permission denied"), target) is None
    left = shutil.disk_usage(tmp_path)._replace(free=300 * 1024)
    monkeypatch.setattr(marlow.fileio.shutil, "disk_usage", lambda _path: left)
    short = no_space(RuntimeError("unexpected pos 64 vs 0"), target)
    assert isinstance(short, NoSpace) and "(0.3 MiB free)" in str(short)


def test_a_full_device_leaves_an_atomic_file_as_it_was_and_a_sink_says_no_space(
    tmp_path, monkeypatch
):
    import errno
    from pathlib import Path

    from marlow.diagnostics.sinks import JsonlSink
    from marlow.fileio import NoSpace

    path = write_json(tmp_path / "base.json", {"kept": 1})

    def full(self, data):
        Path.open(self, "wb").write(data[:3])  # part of it, then the device is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(NoSpace, match="no space left on the device holding .*base.json"):
        write_json(path, {"kept": 2})
    assert read_json_object(path) == {"kept": 1} and not list(tmp_path.glob("*.tmp"))
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write({"step": 0})

    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("marlow.diagnostics.sinks.os.fsync", no_room)
    with pytest.raises(NoSpace):
        sink.write({"step": 1})
