"""Resume continues the same run: its own config, refused changes with a diff, a named
damaged checkpoint with an earlier one offered, the last two checkpoints kept, and a run killed
with SIGKILL anywhere (mid-run, or inside a checkpoint's commit) resuming bit-equal."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from marlow.cli import app
from marlow.training.trainer import Trainer
from tests.conftest import shrunk_config
from tests.integration.reference import VOTING_IP, vary_rewards

SETTINGS = VOTING_IP


@pytest.fixture(scope="module")
def reference(tiny_cache, tmp_path_factory) -> Path:
    """The uninterrupted run: 3 steps, a checkpoint after each (the last two kept)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    vary_rewards(Trainer(shrunk_config(**SETTINGS), out)).run()
    return out


def copy_run(reference: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    return run


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    lines = [line for line in result.output.splitlines() if line.strip()]
    return result, lines


def refused(run: Path, *args: str) -> str:
    """Run a resume that must fail: exit 2, one line, no traceback, no file changed."""
    before = snapshot(run) if run.exists() else None
    result, lines = cli("train", "--out", str(run), *args)
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert (snapshot(run) if run.exists() else None) == before
    return lines[0]


def resumed(run: Path) -> None:
    """Resume ``run`` to its end in-process with the reference's rewards."""
    trainer = vary_rewards(Trainer(shrunk_config(**SETTINGS), run))
    trainer.run(resume=True)


def records(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock timings."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")} for x in lines]


def same_checkpoint(a: Path, b: Path) -> None:
    """The adapters of two checkpoints are bit-equal."""
    names = sorted(p.name for p in (a / "adapters").iterdir())
    assert (
        names == sorted(p.name for p in (b / "adapters").iterdir()) == ["aggregator", "generator"]
    )
    for name in names:
        wa = load_file(a / "adapters" / name / "adapter_model.safetensors")
        wb = load_file(b / "adapters" / name / "adapter_model.safetensors")
        assert wa.keys() == wb.keys()
        for key in wa:
            assert torch.equal(wa[key], wb[key]), (name, key)


def test_the_run_keeps_its_last_two_checkpoints(reference):
    kept = sorted(p.name for p in (reference / "checkpoints").iterdir())
    assert kept == ["step_000002", "step_000003"]  # step 1: not the best validated, pruned


def test_resume_refuses_changes_and_folders_that_are_not_runs(reference, tmp_path):
    run = copy_run(reference, tmp_path)
    line = refused(run, "--resume", "optim.lr=0.5", "policy.routing=sp")
    assert "optim.lr: 0.001 -> 0.5" in line and "policy.routing: 'ip' -> 'sp'" in line
    assert "steps" in line and "sinks.*" in line  # names what may change
    assert "steps may only grow" in refused(run, "--resume", "steps=2")
    config = tmp_path / "other.yaml"
    config.write_text("grpo: {clip_high: 0.3}\n")
    assert "grpo.clip_high: 0.28 -> 0.3" in refused(run, str(config), "--resume")
    assert "no such checkpoint; valid: 2, 3" in refused(run, "--resume-from", "1")

    assert "no run folder" in refused(tmp_path / "missing", "--resume")
    assert not (tmp_path / "missing").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert "not a marlow run folder (no config.yaml)" in refused(foreign, "--resume")
    (foreign / "metrics.jsonl").write_text('{"step": 0}\n')
    assert "holds metrics.jsonl but no config.yaml" in refused(foreign, "--resume")


def test_a_resume_safe_change_extends_the_run_and_is_recorded(reference, tmp_path):
    run = copy_run(reference, tmp_path)
    trainer = vary_rewards(
        Trainer(shrunk_config(**{**SETTINGS, "steps": 4, "sample_episodes": 1}), run)
    )
    trainer.run(resume=True)
    assert [r["step"] for r in records(run)] == [0, 1, 2, 3, 4]
    events = map(json.loads, (run / "events.jsonl").read_text().splitlines())
    (event,) = [e for e in events if e.get("action") == "resume"]
    assert event == {
        "step": 3,
        "action": "resume",
        "checkpoint": "step_000003",
        "changed": ["steps: 3 -> 4", "sample_episodes: 4 -> 1"],
    }
    assert "steps: 4\n" in (run / "config.yaml").read_text()
    # the README's form, nothing left to do: config.yaml stays byte-identical
    before = (run / "config.yaml").read_bytes()
    result, _ = cli("train", "--out", str(run), "--resume")
    assert result.exit_code == 0, result.output
    assert (run / "config.yaml").read_bytes() == before


def remanifest(checkpoint: Path, rel: str) -> None:
    """Record a rewritten file in the checkpoint's manifest, as if it had been written so."""
    done = json.loads((checkpoint / "DONE").read_text())
    data = (checkpoint / rel).read_bytes()
    done["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "DONE").write_text(json.dumps(done))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def poison(path: Path) -> None:
    weights = load_file(path)
    first = sorted(weights)[0]
    weights[first] = torch.full_like(weights[first], math.nan)
    save_file(weights, path)


ADAPTER = "adapters/generator/adapter_model.safetensors"
DAMAGE = {  # how -> (what is done to step 3, what the error names)
    "truncated adapter": (lambda c: truncate(c / ADAPTER), f"{ADAPTER} is"),
    "truncated state": (lambda c: truncate(c / "trainer_state.pt"), "trainer_state.pt is"),
    "truncated state, no manifest": (  # a checkpoint of an older marlow: found when read
        lambda c: (truncate(c / "trainer_state.pt"), (c / "DONE").write_text("3")),
        "trainer_state.pt: ",
    ),
    "non-finite adapter": (lambda c: (poison(c / ADAPTER), remanifest(c, ADAPTER)), "not finite"),
}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_checkpoint_is_named_and_the_last_good_one_offered(reference, tmp_path, how):
    run = copy_run(reference, tmp_path)
    damage, named = DAMAGE[how]
    damage(run / "checkpoints" / "step_000003")
    line = refused(run, "--resume")
    assert "step_000003 is damaged" in line and named in line, line
    assert "resume from the last good one with --resume-from 2" in line
    scripted_resume = vary_rewards(Trainer(shrunk_config(**SETTINGS), run))
    scripted_resume.run(resume_from=2)  # redoes step 3 exactly
    same_checkpoint(run / "checkpoints" / "step_000003", reference / "checkpoints" / "step_000003")
    assert records(run) == records(reference)


def test_damaged_records_are_an_error_and_a_torn_last_line_is_repaired(reference, tmp_path):
    run = copy_run(reference, tmp_path)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], '{"step": 1, "tra', *lines[1:]]) + "\n")
    line = refused(run, "--resume")
    assert "metrics.jsonl: line 2 of 5 is not JSON" in line and "repair or remove" in line

    metrics.write_text("\n".join([*lines, '{"step": 4, "tra']) + "\n")  # a killed run's last line
    result, out = cli("train", "--out", str(run), "--resume")
    assert result.exit_code == 0, result.output
    assert any("metrics.jsonl: dropped a half-written last line" in x for x in out), out
    assert metrics.read_text().splitlines() == lines


# -- SIGKILL anywhere: in the loop, or between the steps of a checkpoint's commit ----------------

DRIVER = """
import json, os, signal, sys
from pathlib import Path
from marlow.config import RunConfig
from marlow.training import checkpoint
from marlow.training.trainer import Trainer
from tests.integration.reference import VOTING_IP, vary_rewards

config, out, point = RunConfig.model_validate_json(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
STEP2 = "step_000002"

def kill():
    os.kill(os.getpid(), signal.SIGKILL)

def after(fn, when):
    def wrapped(*args):
        fn(*args)
        if when(*args):
            kill()
    return wrapped

if point == "before-rename":  # the temporary folder is complete and fsynced, not yet renamed
    checkpoint._fsync_tree = after(checkpoint._fsync_tree, lambda p: p.name == STEP2 + ".tmp")
elif point == "before-parent-fsync":  # renamed, the rename not yet fsynced
    real = checkpoint._fsync_dir
    def fsync_dir(path):
        if path.name == "checkpoints" and (path / STEP2).exists():
            kill()
        real(path)
    checkpoint._fsync_dir = fsync_dir
elif point == "inside-prune":  # step 3 written, step 1's DONE removed, its files not yet
    checkpoint._fsync_dir = after(
        checkpoint._fsync_dir, lambda p: p.name == "step_000001" and not (p / "DONE").exists()
    )

def on_step(step, record):
    if point == "after-record" and step == 2:  # step 2 logged, its checkpoint not written
        kill()

vary_rewards(Trainer(config, out)).run(on_step=on_step)
"""


@pytest.mark.parametrize(
    "point", ["after-record", "before-rename", "before-parent-fsync", "inside-prune"]
)
def test_a_run_killed_anywhere_resumes_bit_equal(reference, tmp_path, point):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    config = shrunk_config(**SETTINGS).model_dump_json()
    killed = subprocess.run(
        [sys.executable, "-c", DRIVER, config, str(run), point], env=env, capture_output=True
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    if point != "inside-prune":
        assert not (run / "checkpoints" / "step_000003").exists()
    resumed(run)
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["step_000002", "step_000003"]  # no .tmp or half-removed folder left
    same_checkpoint(run / "checkpoints" / "step_000003", reference / "checkpoints" / "step_000003")
    assert records(run) == records(reference)


def test_a_file_workflow_is_kept_in_the_run_and_a_resume_reads_the_copy(small_config, tmp_path):
    """config.yaml names a workflow file by its path; the run keeps the file's text beside it
    (RUN/workflow.yaml), and a resume reads that copy, never the path: after the file changed,
    and after it is gone, the run goes on with the workflow it started with."""
    source = Path(__file__).parents[2] / "configs" / "workflows" / "debate.yaml"
    mine = tmp_path / "debate.yaml"
    shutil.copy(source, mine)
    run = tmp_path / "run"
    cfg = small_config(steps=1, val_every=1, workflow={"name": str(mine)}, task={"val_size": 4})
    Trainer(cfg, run).run()
    assert (run / "workflow.yaml").read_text() == source.read_text()
    mine.write_text(source.read_text().replace("debater", "speaker"))  # another workflow now
    trainer = Trainer(cfg.model_copy(update={"steps": 2}), run)
    assert trainer.workflow.roles == ["debater", "judge"]  # the copy's roles, not the file's
    trainer.run(resume=True)
    mine.unlink()
    Trainer(cfg.model_copy(update={"steps": 3}), run).run(resume=True)
    assert [r["step"] for r in records(run)] == [0, 1, 2, 3]
    assert (run / "workflow.yaml").read_text() == source.read_text()


def test_a_signal_during_a_checkpoint_save_waits_for_its_commit(
    small_config, tmp_path, monkeypatch
):
    """Ctrl-C while a checkpoint is written: the save finishes (renamed into place, whole), then
    the KeyboardInterrupt comes; no ``.tmp`` is left to be thrown away."""
    import signal

    from marlow.policy.adapters import save_adapters
    from marlow.training import checkpoint

    trainer = Trainer(small_config(), tmp_path / "run")
    trainer.out.mkdir(parents=True, exist_ok=True)
    (trainer.out / "base.json").write_text("{}")

    def interrupted_save(*args, **kwargs):
        save_adapters(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, halfway through the checkpoint

    monkeypatch.setattr(checkpoint, "save_adapters", interrupted_save)
    monkeypatch.setattr(checkpoint.runbase, "adapter_base", lambda _run: "base")
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(trainer.out, 3, trainer.model, trainer.adapters, trainer.optim)
    assert [p.name for p in (trainer.out / "checkpoints").iterdir()] == ["step_000003"]
    assert checkpoint.verify(trainer.out / "checkpoints" / "step_000003") is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
