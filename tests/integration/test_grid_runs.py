"""A real grid on local processes: every cell finishes; after an interruption, running the grid
again redoes only what was missing, and the resumed cell ends exactly as the uninterrupted one."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from marlow.config import ConfigError
from marlow.grids import pretraining
from marlow.grids.grid import expand, parse_grid
from marlow.grids.runner import run_grid
from tests.conftest import PRETRAIN_STEPS

GRID = {
    "workflows": ["voting"],
    "policies": ["ip"],
    "controls": ["base"],
    "settings": {
        "steps": 2,
        "val_every": 1,
        "ckpt_every": 1,
        "model": {"pretrain_steps": PRETRAIN_STEPS},
        "task": {"val_size": 6},
        "rollout": {"max_new_tokens": 16},
        "grpo": {"batch_problems": 2, "group_size": 2, "credit": "broadcast"},
    },
}


def records(path):
    """Metric records without timings (the only thing allowed to differ between two runs)."""
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
        for line in path.read_text().splitlines()
    ]


def test_a_grid_runs_then_resumes_only_what_was_missing(tiny_cache, tmp_path):
    out = tmp_path / "grid"
    states = run_grid(parse_grid(GRID), out, workers=2)
    assert states == {"Voting-IP-tiny-s-Math": "done", "Voting-Base-tiny-s-Math": "done"}
    trained = out / "cells" / "Voting-IP-tiny-s-Math"
    base = out / "cells" / "Voting-Base-tiny-s-Math"
    assert json.loads((trained / "cell.json").read_text())["kind"] == "trained"
    index = json.loads((out / "index.json").read_text())
    assert index["cells"]["Voting-Base-tiny-s-Math"]["state"] == "done"
    seconds = json.loads((trained / "DONE").read_text())["seconds"]
    assert 0 < seconds == index["cells"]["Voting-IP-tiny-s-Math"]["seconds"]
    uninterrupted = records(trained / "metrics.jsonl")
    assert [r["step"] for r in uninterrupted] == [0, 1, 2]

    # as if killed during step 2: no DONE, no step-2 checkpoint, a half-written record
    (trained / "DONE").unlink()
    shutil.rmtree(trained / "checkpoints" / "step_000002")
    with (trained / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "train/all/rew')
    base_done = (base / "DONE").stat().st_mtime_ns

    states = run_grid(parse_grid(GRID), out, workers=2)
    assert set(states.values()) == {"done"}
    assert (base / "DONE").stat().st_mtime_ns == base_done  # the finished cell was skipped
    assert "resumed from step_000001" in (trained / "log.txt").read_text()
    assert records(trained / "metrics.jsonl") == uninterrupted


@pytest.mark.slow
def test_the_same_grid_runs_on_a_local_ray_instance(tiny_cache, tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    # each cell asks Ray for one CPU (resources), which its task then holds
    grid = {**GRID, "settings": {**GRID["settings"], "steps": 1}, "resources": {"cpus": 1}}
    out = tmp_path / "grid"
    states = run_grid(parse_grid(grid), out, runner="ray", workers=2)
    assert states == {"Voting-IP-tiny-s-Math": "done", "Voting-Base-tiny-s-Math": "done"}
    log = (out / "cells" / "Voting-IP-tiny-s-Math" / "log.txt").read_text()
    assert 'ray resources: {"CPU": 1.0}' in log
    steps = [r["step"] for r in records(out / "cells" / "Voting-IP-tiny-s-Math" / "metrics.jsonl")]
    assert steps == [0, 1]
    assert (
        json.loads((out / "index.json").read_text())["cells"]["Voting-IP-tiny-s-Math"]["state"]
        == "done"
    )


def fake_pretrain(scale, task, steps, batch):
    """Stands in for a pre-training child: records its pid; the code world fails."""
    import os

    if task == "code":
        raise SystemExit(3)
    marker = Path(os.environ["MARLOW_CACHE"]) / f"{scale}-{task}.pid"
    marker.write_text(str(os.getpid()))


def test_missing_worlds_are_pre_trained_in_child_processes(tmp_path, monkeypatch):
    import os

    from marlow.grids.grid import expand

    monkeypatch.setenv("MARLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(pretraining, "_pretrain_world", fake_pretrain)  # pickled by name: the child
    grid = {**GRID, "tasks": ["math", "code"]}  # imports this module's fake_pretrain
    grid["settings"] = {**GRID["settings"], "model": {"pretrain_steps": 2}}
    lines = []
    pretraining.pretrain_worlds(expand(parse_grid(grid)), lines.append)
    assert int((tmp_path / "tiny-s-math.pid").read_text()) != os.getpid()
    assert [x for x in lines if "failed" in x] == ["pre-training tiny-s (code) failed (exit 3)"]
    for task in ("math", "code"):  # each world is announced first, with an estimate
        assert any(x.startswith(f"the tiny world tiny-s ({task}) is not cached") for x in lines)


def test_a_cell_runs_under_the_environment_its_grid_has_when_it_starts(
    tiny_cache, tmp_path, monkeypatch
):
    """The local pool's fork server outlives a grid and keeps the environment it was started
    with; a cell takes its grid's: here a world cache that is a file, where the cell cannot
    pre-train its missing world (the server's cache holds it)."""
    from marlow.grids import runner
    from marlow.grids.pools import LocalPool

    LocalPool(1).close()  # the fork server runs from here on, the session's cache in its environ
    not_a_folder = tmp_path / "not-a-folder"
    not_a_folder.write_text("")
    monkeypatch.setenv("MARLOW_CACHE", str(not_a_folder))
    monkeypatch.setattr(runner, "pretrain_worlds", lambda todo, log: None)  # the cell's job now
    grid = {**GRID, "policies": []}  # the base cell alone
    states = run_grid(parse_grid(grid), tmp_path / "grid", workers=1)
    assert states == {"Voting-Base-tiny-s-Math": "failed"}, "the cell took the server's environ"
    error = tmp_path / "grid" / "cells" / "Voting-Base-tiny-s-Math" / "error.txt"
    assert str(not_a_folder) in error.read_text().splitlines()[-1]


def test_a_cell_runs_in_the_working_directory_its_grid_has_not_where_a_reward_moved_it(
    tiny_cache, tmp_path, monkeypatch
):
    """One worker runs cell after cell: the first cell's reward moves it (os.chdir), and the
    second, whose data file, reward and results folder are relative, still finds them."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    rows = [{"id": f"r{i}", "question": f"{i}+{i}", "answer": str(2 * i)} for i in range(20)]
    (here / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (here / "wander.py").write_text(
        "import os\n"
        "def reward(prompts, completions, **kwargs):\n"
        f"    os.chdir({str(elsewhere)!r})\n"
        "    return [float(len(c) % 2) for c in completions]\n"
    )
    monkeypatch.chdir(here)
    task = {"source": "rows.jsonl", "prompt_field": "question", "answer_field": "answer",
            "reward": "wander.py:reward", "val_size": 4}  # fmt: skip
    grid = {**GRID, "workflows": ["single", "voting"], "policies": [], "tasks": ["custom"]}  # 3
    grid["settings"] = {**GRID["settings"], "task": task}
    states = run_grid(parse_grid(grid), "grid", workers=1)
    assert len(states) == 3 and set(states.values()) == {"done"}, states  # Single-SA too
    assert not any(elsewhere.iterdir())
    for name in states:
        assert (here / "grid" / "cells" / name / "DONE").is_file()


def test_an_orch_workers_transfer_cell_equals_its_base_cell(tiny_cache, tmp_path):
    grid = {**GRID, "workflows": ["orch_workers"], "policies": [], "controls": ["base", "transfer"]}
    grid["settings"] = {**GRID["settings"], "steps": 1}
    states = run_grid(parse_grid(grid), tmp_path, workers=2)
    assert states["Orch-Workers-Transfer-tiny-s-Math"] == "done"
    cells = tmp_path / "cells"
    transfer = records(cells / "Orch-Workers-Transfer-tiny-s-Math" / "metrics.jsonl")
    assert transfer == records(cells / "Orch-Workers-Base-tiny-s-Math" / "metrics.jsonl")
    assert (
        "no generator role" in (cells / "Orch-Workers-Transfer-tiny-s-Math" / "log.txt").read_text()
    )


def test_a_ray_request_larger_than_the_cluster_is_refused_in_one_line(tiny_cache, tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    grid = {**GRID, "resources": {"gpus": 1}}  # a local Ray instance on this CPU-only machine
    with pytest.raises(ConfigError, match=r"'resources\.gpus' asks 1 per cell .* has 0"):
        run_grid(parse_grid(grid), tmp_path / "grid", runner="ray", workers=1)
    assert not (tmp_path / "grid").exists()  # a failed start leaves no results folder


def test_a_ray_address_where_nothing_answers_is_one_line_at_once(tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    import socket

    with socket.socket() as closed:  # a port that was free a moment ago: nothing listens
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"--address 127.0.0.1:{port}: no Ray cluster answers"):
        run_grid(parse_grid(GRID), tmp_path / "grid", runner="ray", address=f"127.0.0.1:{port}")
    assert not (tmp_path / "grid").exists()


def test_a_grid_and_its_report_take_a_custom_task(tiny_cache, tmp_path):
    from marlow.report.build import build_report
    from marlow.tiny import mathgen

    rows = tmp_path / "rows.jsonl"
    problems = list(itertools.islice(mathgen.train_problems(seed=3), 30))
    rows.write_text("".join(json.dumps({"q": p.prompt, "a": p.answer}) + "\n" for p in problems))
    (tmp_path / "reward.py").write_text(
        "def parity(prompts, completions, a, **kwargs):\n"
        "    return [float(sum(map(ord, c)) % 2) for c in completions]\n"
    )
    task = {"source": str(rows), "prompt_field": "q", "answer_field": "a"}
    task["reward"] = f"{tmp_path / 'reward.py'}:parity"
    settings = {**GRID["settings"], "task": {**GRID["settings"]["task"], **task}}
    grid = parse_grid({**GRID, "tasks": ["custom"], "settings": settings})
    out = tmp_path / "grid"
    states = run_grid(grid, out, workers=2)
    assert states == {"Voting-IP-tiny-s-Custom": "done", "Voting-Base-tiny-s-Custom": "done"}
    build_report(out, out / "report.html")
    table1 = (out / "report" / "table1.csv").read_text().splitlines()
    assert table1[1].startswith("custom,tiny-s,voting,")


def test_a_grid_task_must_be_one_marlow_knows():
    with pytest.raises(ConfigError, match="'task.name' is 'chess'; valid: math, code, custom"):
        expand(parse_grid({**GRID, "tasks": ["chess"]}))
