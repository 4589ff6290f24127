"""The CLI as a user types it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import PRETRAIN_STEPS, in_process

MARLOW = [sys.executable, "-m", "marlow.cli"]


def run(args, cache, cwd):
    env = {**os.environ, "MARLOW_CACHE": cache}
    return subprocess.run(
        [*MARLOW, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


def test_train_on_a_tiny_config_then_eval(tiny_cache, tmp_path: Path):
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "preset: tiny\nsteps: 2\nval_every: 1\nckpt_every: 2\nthreads: 1\n"
        f"model: {{name: tiny-s, pretrain_steps: {PRETRAIN_STEPS}}}\n"
        "task: {val_size: 6}\nworkflow: {name: voting}\npolicy: {routing: sp}\n"
        "rollout: {max_new_tokens: 16}\ngrpo: {batch_problems: 2, group_size: 2}\n"
    )
    done = run(["train", str(config), "optim.lr=5e-4", "--out", "run"], tiny_cache, tmp_path)
    assert done.returncode == 0, done.stderr
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "lr: 0.0005" in (tmp_path / "run" / "config.yaml").read_text()
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "adapters" / "shared").is_dir()

    assert "best val. accuracy" in done.stdout and "run/checkpoints/step_000002" in done.stdout
    assert "step 2/2" in done.stderr  # without a terminal: plain progress lines

    done = run(["eval", "run"], tiny_cache, tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "run" / "evals" / "step-2" / "eval.json").read_text())
    assert result["checkpoint"].endswith("step_000002") and result["step"] == 2
    assert result["val/all/n_problems"] == 6
    assert "step_000002" in done.stdout and "problems" in done.stdout  # a table naming it
    again = in_process(["eval", "run"], tmp_path)  # never clobbers the earlier eval
    assert again.exit_code == 2 and "--overwrite" in again.stderr
    assert json.loads((tmp_path / "run" / "evals" / "step-2" / "eval.json").read_text()) == result
    elsewhere = run(["eval", "run", "--out", "ev", "--json"], tiny_cache, tmp_path)  # by choice
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["step"] == 2
    done = run(["eval", "run", "--base", "--json"], tiny_cache, tmp_path)
    assert done.returncode == 0, done.stderr
    base = json.loads(done.stdout)
    assert base["checkpoint"] is None and base["routing"] == "base"
    assert (tmp_path / "run" / "evals" / "base" / "eval.json").exists()

    done = in_process(["train", str(config), "--out", "run"], tmp_path)
    assert done.exit_code == 2 and "--resume" in done.stderr

    done = in_process(["inspect", "run", "--json"], tmp_path)
    assert done.exit_code == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["workflow"], report["routing"], report["step"]) == ("voting", "sp", 2)
    last_train = [r for r in records if "train/all/reward" in r][-1]
    assert report["train_step"] == last_train["step"] == 2
    for role in ("generator", "aggregator"):  # inspect shows each role its own logged values
        for metric in ("grad_mass_share", "reward", "entropy"):
            logged = last_train[f"train/{role}/{metric}"]
            assert report["roles"][role]["latest"][metric] == logged, (role, metric)
    assert report["signatures"]["step"] == 2
    assert report["signatures"]["roles"]["generator"]["n_turns"] == 18  # 6 problems x 3 slots
    names = [d["name"] for d in report["detectors"]]
    assert names == ["terminal_cliff", "gradient_amplification", "sp_role_capture"]
    done = in_process(["inspect", "run", "detect.cliff_drop=0.2"], tmp_path)
    assert done.exit_code == 0, done.stderr
    for title in ("latest training metrics", "trajectory signatures", "detectors"):
        assert title in done.stdout
    assert in_process(["inspect", "nowhere"], tmp_path).exit_code == 2


def test_a_wrong_field_fails_in_one_line_naming_it(tiny_cache, tmp_path: Path):
    done = run(["train", "grpo.clip_hgh=0.3"], tiny_cache, tmp_path)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "grpo.clip_hgh" in lines[0] and "clip_high" in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing half-written


def test_quickstart_on_a_shrunk_tiny_world(tiny_cache, tmp_path: Path):
    settings = [
        f"model.pretrain_steps={PRETRAIN_STEPS}",
        "task.val_size=6",
        "rollout.max_new_tokens=16",
        "grpo.batch_problems=2",
        "grpo.group_size=2",
        "val_every=1",
    ]
    done = run(["quickstart", *settings, "--steps", "2", "--out", "qs"], tiny_cache, tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "qs" / "summary.json").read_text())
    cells = summary["cells"]
    assert set(cells) == {
        "Voting-Base-tiny-s-Math",
        "Single-Base-tiny-s-Math",
        "Single-SA-tiny-s-Math",
        "Voting-IP-tiny-s-Math",
        "Voting-SP-tiny-s-Math",
    }
    assert all(row["n_val"] == 6 for row in cells.values())
    assert cells["Voting-Base-tiny-s-Math"]["final_step"] == 0
    assert all(cells[name]["final_step"] == 2 for name in cells if "Base" not in name)
    ip_records = [
        json.loads(line)
        for line in (tmp_path / "qs" / "cells" / "Voting-IP-tiny-s-Math" / "metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    ip_norms = [v for r in ip_records for k, v in r.items() if k.endswith("/grad_norm_max")]
    assert len(ip_norms) == 2 * 2  # two adapters (IP: one per role), two steps
    assert cells["Voting-IP-tiny-s-Math"]["max_grad_norm"] == max(ip_norms)
    assert cells["Voting-Base-tiny-s-Math"]["max_grad_norm"] is None  # never trained
    assert set(summary["voting_gain_over_base"]) == {
        "Voting-IP-tiny-s-Math",
        "Voting-SP-tiny-s-Math",
    }
    assert (tmp_path / "qs" / "val_curves.png").stat().st_size > 1000
    assert "Voting-IP-tiny-s-Math" in done.stdout  # the printed table
    index = json.loads((tmp_path / "qs" / "index.json").read_text())  # a grid results folder
    assert {c["state"] for c in index["cells"].values()} == {"done"}

    bad = run(["quickstart", "grpo.group_sise=2", "--out", "qs2"], tiny_cache, tmp_path)
    assert (
        bad.returncode == 2
        and "group_sise" in bad.stderr
        and len(bad.stderr.strip().splitlines()) == 1
    )


def test_a_device_that_fills_up_during_a_checkpoint_is_one_line_saying_how_to_go_on(
    tiny_cache, tmp_path: Path, monkeypatch
):
    import shutil

    import marlow.fileio
    import marlow.training.checkpoint

    def short_write(obj, path):  # torch's C++ writer: part of the file, then a RuntimeError
        Path(path).write_bytes(b"\0" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    full = shutil.disk_usage(tmp_path)._replace(free=4096)
    monkeypatch.setattr(marlow.training.checkpoint.torch, "save", short_write)
    monkeypatch.setattr(marlow.fileio.shutil, "disk_usage", lambda _path: full)
    args = ["train", "steps=2", "val_every=2", "ckpt_every=1", "task.val_size=4",
            f"model.pretrain_steps={PRETRAIN_STEPS}", "rollout.max_new_tokens=16",
            "--out", "runs/full"]  # fmt: skip
    done = in_process(args, tmp_path)
    assert done.exit_code == 2, done.output
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    held = tmp_path / "runs" / "full"
    assert f"no space left on the device holding {held} (0.0 MiB free)" in line, line
    assert "no checkpoint yet" in line and "`marlow train --out runs/full --resume`" in line
    assert "Traceback" not in done.output
    checkpoints = tmp_path / "runs" / "full" / "checkpoints"
    assert not list(checkpoints.glob("*.tmp"))  # the partial checkpoint's space given back
    assert (tmp_path / "runs" / "full" / "metrics.jsonl").is_file()  # the run's records stay


def test_a_full_device_under_any_commands_write_is_one_line(trained_voting, tmp_path, monkeypatch):
    import errno
    import shutil

    def full(src, dst, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(src), None, str(dst))

    monkeypatch.setattr(shutil, "copyfile", full)
    done = in_process(["export", trained_voting, "bundle"], tmp_path)
    assert done.exit_code == 2, done.output
    (line,) = [x for x in done.stderr.splitlines() if x.strip()]
    assert line.startswith("error: no space left on the device holding ") and "bundle" in line
    assert "free some space" in line and "Traceback" not in done.output
    assert not list(tmp_path.iterdir())  # the export's temporary folder is gone
