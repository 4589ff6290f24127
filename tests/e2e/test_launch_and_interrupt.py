"""Launching and stopping runs as a user (or a scheduler) does.

* ``torchrun --nproc_per_node 2 -m marlow train ...`` with no seeding setting: the default
  ``rollout.seeding=auto`` picks ``request``, the run records it and says so once;
* SIGINT or SIGTERM to ``marlow train`` mid-run: exit 130 and one line naming the step, the last
  checkpoint and the resume command; no child process left; the same for SIGTERM to
  ``marlow train --nproc 2``, passed on to its ranks;
* SIGINT or SIGTERM to the ``marlow grid`` process alone (``kill -INT``, ``kill``): its cells'
  processes stop too, and ``index.json`` marks the stopped cell pending, not running;
* SIGKILL to the ``marlow grid`` process: no process it started outlives it (its cells run in
  processes forked from its fork server, and die with it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from marlow.training import checkpoint
from tests.conftest import PRETRAIN_STEPS

TINY = [
    "threads=1",
    "model.name=tiny-s",
    f"model.pretrain_steps={PRETRAIN_STEPS}",
    "workflow.name=single",
    "task.val_size=2",
    "rollout.max_new_tokens=8",
    "grpo.batch_problems=2",
    "grpo.group_size=2",
]


def env(cache: str) -> dict[str, str]:
    return {**os.environ, "MARLOW_CACHE": cache, "OMP_NUM_THREADS": "1"}


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


def wait_for(predicate, what: str, limit_s: float = 300.0) -> None:
    """Poll ``predicate`` until it holds (a bound against hanging, not a timing assert)."""
    end = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.2)


def logged_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return -1
    steps = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            steps.append(json.loads(line)["step"])
    return max(steps, default=-1)


def test_torchrun_with_two_processes_needs_no_seeding_setting(tiny_cache, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launcher += ["--master_addr", "127.0.0.1", "--master_port", str(port)]
    launcher += ["--log_dir", str(tmp_path / "torchrun")]  # not the machine's /tmp
    command = [*launcher, "-m", "marlow", "train", *TINY, "steps=1", "--out", "run"]
    done = subprocess.run(
        command, capture_output=True, text=True, env=env(tiny_cache), cwd=tmp_path, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["rollout"]["seeding"] == "request"  # what ran, recorded
    said = [line for line in done.stderr.splitlines() if "rollout.seeding=auto" in line]
    assert len(said) == 1 and "request" in said[0], done.stderr[-3000:]


def interrupted_train(cache: str, tmp_path: Path, sig: int, *extra: str):
    """``marlow train ... EXTRA --out runs/x`` sent ``sig`` once it has logged step 3; its exit
    code, stderr, run folder and the processes below it then."""
    command = [sys.executable, "-m", "marlow", "train", *TINY, "steps=50", "ckpt_every=2"]
    proc = subprocess.Popen(
        [*command, "val_every=50", *extra, "--out", "runs/x"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env(cache),
        cwd=tmp_path,
    )
    run = tmp_path / "runs" / "x"
    try:
        wait_for(lambda: logged_step(run) >= 3 or proc.poll() is not None, "step 3")
        children = descendants(proc.pid)
        proc.send_signal(sig)  # the command's process alone, as `kill PID` sends it
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stderr, run, children


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_of_train_says_what_was_kept_and_how_to_resume(sig, tiny_cache, tmp_path):
    code, stderr, run, children = interrupted_train(tiny_cache, tmp_path, sig)
    assert code == 130, stderr[-3000:]
    done = logged_step(run)
    kept = checkpoint.latest(run)  # complete checkpoints, as the code reads them
    assert not list(run.glob("checkpoints/*.tmp"))  # a save in progress was finished first
    expected = (
        f"interrupted at step {done + 1}; the last checkpoint is step {checkpoint.step_of(kept)}; "
        "resume with `marlow train --out runs/x --resume`"
    )
    assert expected in " ".join(stderr.split()), stderr[-3000:]
    assert "Traceback" not in stderr
    wait_for(lambda: not any(alive(p) for p in children), "the run's children to end", 60)


def test_sigterm_to_a_data_parallel_train_stops_every_rank_and_says_what_was_kept(
    tiny_cache, tmp_path
):
    """``marlow train --nproc 2`` passes a SIGTERM on to torchrun, whose ranks stop as on
    Ctrl-C: rank 0 says what was kept; the launcher exits 130 once every process has ended."""
    code, stderr, run, children = interrupted_train(
        tiny_cache, tmp_path, signal.SIGTERM, "--nproc", "2"
    )
    assert code == 130, stderr[-3000:]
    said = " ".join(stderr.split())
    assert f"interrupted at step {logged_step(run) + 1}; the last checkpoint is step" in said, said
    assert "resume with `marlow train --out runs/x --resume`" in said
    wait_for(lambda: not any(alive(p) for p in children), "the ranks to end", 60)


GRID = """\
workflows: [single]
policies: [ip]
controls: []
settings:
  steps: 200
  val_every: 200
  ckpt_every: 1
  threads: 1
  model: {pretrain_steps: %d}
  task: {val_size: 2}
  rollout: {max_new_tokens: 8}
  grpo: {batch_problems: 2, group_size: 2}
"""


@contextlib.contextmanager
def grid_at_step_1(cache: str, tmp_path: Path):
    """``marlow grid`` of one cell (`single` alone: the SA-RL control, trained), yielded with its
    cell's folder and every process below it once the cell has logged step 1; killed at the end
    if it still runs."""
    (tmp_path / "grid.yaml").write_text(GRID % PRETRAIN_STEPS)
    # a temp folder of its own, removed here: a grid process killed outright leaves
    # multiprocessing's pymp-* folder (short: under a deep one it would go to /tmp)
    tmpdir = tempfile.mkdtemp(prefix="grid")
    proc = subprocess.Popen(
        [sys.executable, "-m", "marlow", "grid", "grid.yaml", "--out", "res", "--workers", "1"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**env(cache), "TMPDIR": tmpdir},
        cwd=tmp_path,
    )
    cell = tmp_path / "res" / "cells" / "Single-SA-tiny-s-Math"
    try:
        wait_for(lambda: logged_step(cell) >= 1 or proc.poll() is not None, "the cell's step 1")
        children = descendants(proc.pid)
        assert proc.poll() is None and children, "the cell runs in a process of its own"
        yield proc, cell, children
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmpdir)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_of_the_grid_process_stops_its_cells_and_leaves_the_index_true(
    sig, tiny_cache, tmp_path
):
    with grid_at_step_1(tiny_cache, tmp_path) as (proc, cell, children):
        os.kill(proc.pid, sig)  # the grid process alone, as `kill -INT PID` or `kill PID` sends it
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "run the same `marlow grid` again" in " ".join(stderr.split())
    wait_for(lambda: not any(alive(p) for p in children), "the cell's processes to end", 60)
    entry = json.loads((tmp_path / "res" / "index.json").read_text())["cells"][cell.name]
    assert entry["state"] == "pending", entry
    assert re.fullmatch(r"interrupted at step \d+; the grid resumes it", entry["error"])
    assert not (cell / "DONE").exists()


def test_a_grid_process_killed_outright_leaves_no_process_behind(tiny_cache, tmp_path):
    with grid_at_step_1(tiny_cache, tmp_path) as (proc, _, children):
        os.kill(proc.pid, signal.SIGKILL)  # no handler runs: only the kernel and the pipes
        proc.communicate(timeout=60)
    wait_for(lambda: not any(alive(p) for p in children), "the grid's processes to end", 60)
