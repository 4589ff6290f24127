"""Metric sinks: JSONL write and resume, TensorBoard events read back, an offline W&B run read
back, and the ConfigError of a chosen sink whose package is missing.

The TensorBoard and W&B tests use the real packages (both are in the ``test`` extra) and skip
with the reason when one is absent. W&B runs offline with every directory in tmp_path, so it
never reaches the network, prompts, or writes to the home directory.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from marlow.config import ConfigError, SinksConfig
from marlow.diagnostics.sinks import JsonlSink, MetricSinks, numeric_scalars, open_sinks, read_jsonl

# Two steps of records as the trainer writes them, with values exact in float32 (TensorBoard
# stores float32) and the kinds of value the optional sinks must skip.
RECORDS = [
    {
        "step": 0,
        "val/all/accuracy": 0.5,
        "train/generator/grad_norm": np.float32(0.25),
        "train/all/note": "a string",  # non-numeric: skipped
        "train/all/hist": [1, 2],  # non-numeric: skipped
    },
    {
        "step": 1,
        "val/all/accuracy": 0.75,
        "train/generator/grad_norm": math.nan,  # non-finite: skipped at this step only
        "train/all/kl": math.inf,  # non-finite at its only step: never appears
        "train/all/length_max": 12,
    },
    {"step": 2, "val/all/accuracy": -1.5, "train/generator/grad_norm": 2.0},
]
LOGGED = {  # tag -> [(step, value)] that TensorBoard and W&B must hold
    "val/all/accuracy": [(0, 0.5), (1, 0.75), (2, -1.5)],
    "train/generator/grad_norm": [(0, 0.25), (2, 2.0)],
    "train/all/length_max": [(1, 12.0)],
}


# -- JSONL --------------------------------------------------------------------------------------


def test_jsonl_writes_one_line_per_record_and_keeps_nan(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "sub" / "metrics.jsonl")
    sink.write({"step": 0, "a": 1.0})
    sink.write({"step": 1, "a": math.nan, "tag": "x"})
    assert sink.path.read_text().count("\n") == 2
    back = list(read_jsonl(sink.path))
    assert back[0] == {"step": 0, "a": 1.0}
    assert back[1]["tag"] == "x" and math.isnan(back[1]["a"])


def test_jsonl_truncate_after_drops_later_steps_then_appends(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in range(5):
        sink.write({"step": step, "a": float(step)})
    sink.truncate_after(2)  # resumed from the checkpoint of step 2: steps 3, 4 are redone
    assert [r["step"] for r in read_jsonl(sink.path)] == [0, 1, 2]
    sink.write({"step": 3, "a": 30.0})
    assert [(r["step"], r["a"]) for r in read_jsonl(sink.path)][-2:] == [(2, 2.0), (3, 30.0)]
    sink.truncate_after(-1)  # no checkpoint found: everything is redone
    assert list(read_jsonl(sink.path)) == []
    assert not (tmp_path / "metrics.tmp").exists()


def test_jsonl_truncate_without_file_is_a_no_op(tmp_path: Path) -> None:
    JsonlSink(tmp_path / "metrics.jsonl").truncate_after(3)
    assert not (tmp_path / "metrics.jsonl").exists()


# -- the shared record filter and the empty bundle ---------------------------------------------


def test_numeric_scalars_keeps_finite_numbers_only() -> None:
    step, values = numeric_scalars({**RECORDS[1], "flag": True, "n": np.int64(3)})
    assert step == 1
    assert values == {"val/all/accuracy": 0.75, "train/all/length_max": 12.0, "flag": 1.0, "n": 3.0}
    assert numeric_scalars(RECORDS[0])[1] == {
        "val/all/accuracy": 0.5,
        "train/generator/grad_norm": 0.25,
    }


def test_numeric_scalars_needs_a_step() -> None:
    with pytest.raises(ValueError, match="'step'"):
        numeric_scalars({"val/all/accuracy": 0.5})


def test_no_sink_chosen_gives_an_empty_no_op_bundle(tmp_path: Path) -> None:
    sinks = open_sinks(tmp_path, SinksConfig())
    assert isinstance(sinks, MetricSinks) and sinks.sinks == [] and sinks.describe() == []
    sinks.truncate_after(3)
    sinks.write(RECORDS[0])
    sinks.close()
    assert list(tmp_path.iterdir()) == []


# -- missing packages ---------------------------------------------------------------------------


def test_missing_tensorboard_names_field_and_install_command(monkeypatch, tmp_path: Path) -> None:
    # A None entry in sys.modules makes `import` raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError) as err:
        open_sinks(tmp_path, SinksConfig(tensorboard=True))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("sinks.tensorboard ") and "pip install 'marlow[tb]'" in msg


def test_missing_wandb_fails_before_any_sink_opens(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError) as err:
        open_sinks(tmp_path, SinksConfig(tensorboard=True, wandb=True))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("sinks.wandb ") and "pip install 'marlow[wandb]'" in msg
    assert list(tmp_path.iterdir()) == []  # the TensorBoard sink was not opened either


# -- TensorBoard --------------------------------------------------------------------------------


def _tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    pytest.importorskip("tensorboard", reason="tensorboard not installed: pip install 'marlow[tb]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_written_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard not installed: pip install 'marlow[tb]'")
    with open_sinks(tmp_path, SinksConfig(tensorboard=True)) as sinks:
        for record in RECORDS:
            sinks.write(record)
        assert sinks.describe() == [f"tensorboard: tensorboard --logdir {tmp_path / 'tensorboard'}"]
    assert _tb_scalars(tmp_path / "tensorboard") == LOGGED


def test_tensorboard_resume_replaces_the_redone_steps(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard not installed: pip install 'marlow[tb]'")
    cfg = SinksConfig(tensorboard=True)
    with open_sinks(tmp_path, cfg) as sinks:  # first run: dies after logging step 5
        sinks.truncate_after(-1)  # what the trainer calls on a fresh run
        for step in range(1, 6):
            sinks.write({"step": step, "train/all/loss": float(step)})
            if step % 2 == 0:  # a validation-only tag: not re-logged at every redone step
                sinks.write({"step": step, "val/all/accuracy": float(step)})
    with open_sinks(tmp_path, cfg) as sinks:  # resumed from the checkpoint of step 3
        sinks.truncate_after(3)
        for step in range(4, 7):
            sinks.write({"step": step, "train/all/loss": 10.0 * step})
    got = _tb_scalars(tmp_path / "tensorboard")
    assert got["train/all/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert got["val/all/accuracy"] == [(2, 2.0)]  # step 4's stale point is purged too


# -- Weights & Biases (offline) -----------------------------------------------------------------


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path: Path):
    """W&B confined to tmp_path: offline, silent, no git probing, no home-directory files."""
    wandb = pytest.importorskip("wandb", reason="wandb not installed: pip install 'marlow[wandb]'")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_DIR": str(tmp_path / "wandb_dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "wandb_dir").mkdir()
    return wandb


def _wandb_records(path: Path):
    """The records of a ``.wandb`` file, parsed with W&B's own protobuf schema.

    The file is a LevelDB-style log (what W&B's former ``DataStore`` reader read; wandb >= 0.19
    ships no Python reader): a 7-byte header ``:W&B``, then 32 KiB blocks of chunks, each with a
    7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _history(run_folder: Path) -> list[dict]:
    (path,) = run_folder.glob("run-*.wandb")
    rows = []
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def _descendants() -> list[str]:
    """Command lines of this process's live descendants (Linux /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # zombies are gone, just not yet reaped
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        found += [pid for pid in frontier]
    cmds = []
    for pid in found:
        try:
            cmds.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return cmds


def _wandb_processes() -> list[str]:
    return [cmd for cmd in _descendants() if "wandb" in cmd]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_wandb_offline_run_holds_history_config_and_leaves_no_process(
    offline_wandb, tmp_path: Path
) -> None:
    run_dir = tmp_path / "voting-ip-seed0"
    config = {"seed": 3, "grpo": {"group_size": 4}}
    sinks = open_sinks(run_dir, SinksConfig(wandb=True, wandb_project="marlow-test"), config)
    assert _wandb_processes()  # the wandb-core service runs while the run is open
    for record in RECORDS:
        sinks.write(record)
    (line,) = sinks.describe()
    sinks.close()
    for _ in range(100):  # teardown has asked wandb-core to exit; give it up to 10 s to go
        if not _wandb_processes():
            break
        time.sleep(0.1)
    assert _wandb_processes() == []

    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    (folder,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    assert line == f"wandb: offline run in {folder}; upload with: wandb sync {folder}"
    rows = _history(folder)
    assert [row["_step"] for row in rows] == [0, 1, 2]
    for tag, points in LOGGED.items():
        assert [(row["_step"], row[tag]) for row in rows if tag in row] == points
    # strings, lists and the never-finite train/all/kl were not logged (W&B's own keys start "_")
    assert {key for row in rows for key in row if not key.startswith("_")} == set(LOGGED)

    (run,) = [r.run for r in _wandb_records(next(folder.glob("run-*.wandb"))) if r.HasField("run")]
    assert run.run_id == run_id and run.project == "marlow-test"
    assert run.display_name == "voting-ip-seed0"
    got_config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert got_config["seed"] == 3 and got_config["grpo"] == {"group_size": 4}


def test_wandb_reopened_run_dir_continues_the_same_run(offline_wandb, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = SinksConfig(wandb=True, wandb_project="marlow-test")
    with open_sinks(run_dir, cfg) as sinks:
        sinks.write({"step": 1, "train/all/loss": 1.0})
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    with open_sinks(run_dir, cfg) as sinks:  # --resume
        sinks.truncate_after(0)  # a no-op for W&B: its history is append-only
        sinks.write({"step": 2, "train/all/loss": 2.0})
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(run_id in f.name for f in folders)
    assert [row["train/all/loss"] for f in folders for row in _history(f)] == [1.0, 2.0]
