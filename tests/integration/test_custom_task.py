"""A custom task (one's own jsonl and reward) trained for real on the tiny world: each reward
contract, and each failure rule on a real run (counted per role, recorded, or stopping the run
with its last checkpoint intact)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from marlow.config import ConfigError, dump_config, resolve
from marlow.diagnostics.sinks import read_metrics
from marlow.report.rescore import rescore
from marlow.rewards.user import RewardsMissing
from marlow.tasks.catalog import catalog
from marlow.tiny import mathgen
from marlow.training import checkpoint
from marlow.training.taskcheck import check_task
from marlow.training.trainer import Trainer

REWARDS = textwrap.dedent(
    """
    import asyncio, math, os, time

    def spread(prompts, completions, answer, **kwargs):
        # a spread in every group: the parity of the sum of its characters
        return [float(sum(map(ord, c)) % 2) for c in completions]

    async def spread_async(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [float(sum(map(ord, c)) % 2) for c in completions]

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if extra_info["level"] == 1:
            raise ValueError("level 1 is not graded")
        return {"score": float(sum(map(ord, solution_str)) % 2)}

    def half_none(prompts, completions, **kwargs):
        return [None if i % 2 else float(sum(map(ord, c)) % 2) for i, c in enumerate(completions)]

    def half_nan(prompts, completions, **kwargs):
        return [math.nan if i % 2 else float(sum(map(ord, c)) % 2) for i, c in enumerate(completions)]

    def short(prompts, completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    def sleepy(prompts, completions, **kwargs):
        time.sleep(3)
        return [1.0] * len(completions)

    def stingy(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    def fair(prompts, completions, answer, **kwargs):
        # the gold in a box: 1; anything else: 0 or 0.5 by its characters' parity
        return [
            1.0 if c == "\\\\boxed{" + a + "}" else 0.5 * (sum(map(ord, c)) % 2)
            for c, a in zip(completions, answer, strict=True)
        ]

    def wanders(prompts, completions, **kwargs):
        os.chdir(os.environ["MARLOW_TEST_ELSEWHERE"])  # a reward that changes the cwd
        return [float(sum(map(ord, c)) % 2) for c in completions]

    def fails_after_flag(prompts, completions, **kwargs):
        if os.path.exists(os.environ["MARLOW_TEST_FLAG"]):
            raise RuntimeError("the grading service is down")
        return [float(sum(map(ord, c)) % 2) for c in completions]
    """
)


@pytest.fixture
def task_files(tmp_path):
    rows = [
        {"id": f"r{i}", "question": p.prompt, "answer": p.answer, "level": p.meta["level"]}
        for i, p in enumerate(itertools.islice(mathgen.train_problems(seed=7), 40))
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


def task_config(small_config, files, function, **task):
    return small_config(
        workflow={"name": "voting"},
        policy={"routing": "ip"},
        task={
            "source": str(files / "rows.jsonl"),
            "prompt_field": "question",
            "answer_field": "answer",
            "reward": f"{files / 'rewards.py'}:{function}",
            "val_size": 6,
            **task,
        },
    )


def run(small_config, files, function, out, **task):
    cfg = task_config(small_config, files, function, **task)
    with Trainer(cfg, out) as trainer:
        trainer.run()
    return read_metrics(out), [
        json.loads(x) for x in (out / "events.jsonl").read_text().split("\n") if x
    ]


@pytest.mark.parametrize(
    ("function", "form"),
    [("spread", "trl"), ("spread_async", "trl"), ("compute_score", "verl")],
)
def test_a_custom_task_trains_voting_with_each_reward_form(
    small_config, task_files, tmp_path, function, form
):
    records, events = run(
        small_config,
        task_files,
        function,
        tmp_path / "run",
        reward_form=form,
        reward_max_missing=1.0,
    )
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["train/generator/grad_norm"] > 0  # the rewards varied: the adapters learned
        assert 0.0 <= r["train/all/reward"] <= 1.0
    data = next(e for e in events if e.get("action") == "data")
    assert data["dataset"] == "custom" and data["kept"] == 40
    if form == "verl":  # level-1 rows raise: each costs its own item, recorded by name
        failed = [e for e in events if e.get("event") == "reward_error"]
        assert failed and {e["function"] for e in failed} == {"compute_score"}
        assert failed[0]["error"] == "ValueError: level 1 is not graded"
        assert any(r.get("train/all/reward_error", 0) > 0 for r in records[1:])


@pytest.mark.parametrize(
    ("function", "reason"),
    [("half_none", "reward_none"), ("half_nan", "reward_nonfinite")],
)
def test_none_and_nan_rewards_are_left_out_and_counted_per_role(
    small_config, task_files, tmp_path, function, reason
):
    records, _ = run(small_config, task_files, function, tmp_path / "run")
    for r in records[1:]:
        # 3 problems x 4 episodes: the engine grades the final answers and the answer turns in
        # one call, so which items are odd varies; some, never all, are missing
        assert 0 < r[f"train/all/{reason}"] < 12
        assert r[f"train/aggregator/{reason}"] == r[f"train/all/{reason}"]
        assert r[f"train/generator/{reason}"] == 3 * r[f"train/all/{reason}"]


def test_a_wrong_length_is_an_error_event_naming_the_function_and_the_lengths(
    small_config, task_files, tmp_path
):
    records, events = run(
        small_config, task_files, "short", tmp_path / "run", reward_max_missing=1.0
    )
    failed = [e for e in events if e.get("event") == "reward_error"]
    assert failed and all(e["function"] == "short" for e in failed)
    assert "values for" in failed[0]["error"] and "completions" in failed[0]["error"]
    assert records[1]["train/all/reward_error"] == 12
    assert "train/all/reward" not in records[1]  # no episode had a reward


def test_a_reward_past_its_timeout_costs_its_items_not_the_run(small_config, task_files, tmp_path):
    records, events = run(
        small_config,
        task_files,
        "sleepy",
        tmp_path / "run",
        reward_timeout_s=0.3,
        reward_max_missing=1.0,
    )
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[1]["train/all/reward_timeout"] == 12
    assert {e["event"] for e in events if "event" in e} == {"reward_timeout"}


def test_a_reward_that_keeps_failing_stops_the_run_in_one_line_keeping_its_checkpoint(
    small_config, task_files, tmp_path, monkeypatch
):
    flag = tmp_path / "down"
    monkeypatch.setenv("MARLOW_TEST_FLAG", str(flag))
    cfg = small_config(
        steps=4,
        val_every=4,
        ckpt_every=2,
        task={
            "source": str(task_files / "rows.jsonl"),
            "prompt_field": "question",
            "reward": f"{task_files / 'rewards.py'}:fails_after_flag",
            "val_size": 6,
        },
    )
    out = tmp_path / "run"

    def on_step(step, _record):
        if step == 2:
            flag.write_text("down")

    with Trainer(cfg, out) as trainer, pytest.raises(RewardsMissing) as err:
        trainer.run(on_step=on_step)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("step 3: 12 of 12 episodes have no reward")
    assert "fails_after_flag" in message and "the grading service is down" in message
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]
    kept = checkpoint.latest(out)
    assert kept is not None and checkpoint.step_of(kept) == 2
    checkpoint.check(kept)  # intact: it loads


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sums"


def test_the_example_task_installed_as_a_package_is_listed_and_trains_by_name(
    small_config, tmp_path, monkeypatch
):
    source = shutil.copytree(EXAMPLE, tmp_path / "sums", ignore=shutil.ignore_patterns("build"))
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(site), str(source)], check=True, capture_output=True)
    monkeypatch.syspath_prepend(str(site))

    listed = {info.name: info for info in catalog()}
    assert list(listed)[:3] == ["math", "code", "custom"]
    assert listed["sums"].origin == "marlow-sums-task 0.1.0 (sums_task:TASK)"
    assert "arithmetic" in listed["sums"].description
    shown = subprocess.run(
        [sys.executable, "-m", "marlow", "tasks"],
        env={**os.environ, "PYTHONPATH": str(site), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "sums" in shown and "marlow-sums-task 0.1.0" in shown

    cfg = small_config(workflow={"name": "voting"}, task={"name": "sums", "val_size": 6})
    assert cfg.task.source == str(site / "sums_task" / "sums.jsonl")
    assert cfg.task.reward == "sums_task.reward:exact_answer" and cfg.task.val_size == 6
    with Trainer(cfg, tmp_path / "run") as trainer:
        trainer.run()
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "train/all/reward" in records[1] and "train/all/reward_error" not in records[1]


def test_an_unknown_task_name_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"'task.name' is 'chess'; valid: math, code, custom"):
        resolve({"task": {"name": "chess"}})


def test_task_check_passes_a_task_whose_gold_scores_and_whose_groups_vary(small_config, task_files):
    report = check_task(task_config(small_config, task_files, "fair"), problems=2)
    assert report.problems == []
    assert report.lines[0] == (
        f"data: {task_files / 'rows.jsonl'}: read 40, kept 40, skipped none; 34 train, 6 validation"
    )
    assert report.lines[1] == "gold answers: 40 of 40 score at least task.correct_threshold=1"
    assert [line.split(": rewards ")[0][:12] for line in report.lines[2:4]] == ["episodes of "] * 2
    assert report.lines[4] == "groups whose rewards vary: 2 of 2"
    assert len(report.lines) == 5  # no episode as text without show


def test_task_check_shows_the_base_models_episodes_as_text(small_config, task_files):
    report = check_task(task_config(small_config, task_files, "fair"), problems=2, show=2)
    text = "\n".join(report.lines)
    assert text.count("--- episode ") == 2 and "--- episode 1 of " in text
    assert " prompt:\n" in text and " completion:\n" in text and "final answer:\n" in text


def test_task_check_reports_a_reward_that_cannot_teach(small_config, task_files):
    report = check_task(task_config(small_config, task_files, "stingy"), problems=2)
    assert len(report.problems) == 2
    assert report.problems[0].startswith(
        "the reward gives 40 of 40 gold answers less than task.correct_threshold=1 (problem r"
    )
    assert report.problems[0].endswith(" got 0); it cannot tell right from wrong")
    assert report.problems[1].startswith("no group of 2 sampled has rewards that vary")
    assert report.lines[-1] == "groups whose rewards vary: 0 of 2"


def test_marlow_task_check_exits_non_zero_with_one_line(small_config, task_files, tmp_path):
    cfg = task_config(small_config, task_files, "stingy")
    (tmp_path / "c.yaml").write_text(dump_config(cfg))
    done = subprocess.run(
        [sys.executable, "-m", "marlow", "task", "check", str(tmp_path / "c.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith("error: the reward gives 40 of 40 gold answers less than")
    assert "gold '\\boxed{" in errors[0]
    assert "problem: no group of 4 sampled" in done.stdout


def test_rescore_grades_a_finished_runs_answers_again_without_generating(
    small_config, task_files, tmp_path
):
    out = tmp_path / "run"
    records, _ = run(small_config, task_files, "fair", out)
    again = rescore(out, f"{task_files / 'rewards.py'}:fair")
    validated = [r for r in records if "val/all/accuracy" in r]
    assert [s["step"] for s in again["steps"]] == [r["step"] for r in validated] == [0, 2]
    for s, r in zip(again["steps"], validated, strict=True):
        # the same reward over the same stored answers: the run's own figures, exactly
        assert s["new"]["accuracy"] == s["old"]["accuracy"] == r["val/all/accuracy"]
        assert s["new"]["reward"] == pytest.approx(r["val/all/reward"], abs=1e-12)
        assert s["new"]["pass_at_n"] == s["old"]["pass_at_n"] == r["val/all/pass_at_n"]
    stingy = rescore(out, f"{task_files / 'rewards.py'}:stingy", threshold=0.5)
    assert all(s["new"]["accuracy"] == 0.0 and s["new"]["reward"] == 0.0 for s in stingy["steps"])
    assert stingy["threshold"] == 0.5
    saved = json.loads((out / "rescore" / "stingy.json").read_text())
    assert saved["steps"] == stingy["steps"]
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        rescore(out, f"{task_files / 'rewards.py'}:stingy")
    broken = rescore(out, f"{task_files / 'rewards.py'}:short", name="short")
    assert all(s["new"]["no_reward"] == 6 and s["new"]["accuracy"] is None for s in broken["steps"])
    assert broken["failures"][0]["function"] == "short"


def test_a_reward_that_changes_the_working_directory_moves_no_file_of_the_run(
    small_config, task_files, tmp_path, monkeypatch
):
    from marlow.training.evaluate import evaluate

    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir(), elsewhere.mkdir()
    monkeypatch.setenv("MARLOW_TEST_ELSEWHERE", str(elsewhere))
    monkeypatch.chdir(home)
    out = Path("runs/x")  # relative, as a user types --out
    with Trainer(task_config(small_config, task_files, "wanders"), out) as trainer:
        trainer.run()
    assert Path.cwd() == elsewhere  # the reward did move the process
    monkeypatch.chdir(home)
    evaluate(out, name="again")
    monkeypatch.chdir(home)
    rescore(out, f"{task_files / 'rewards.py'}:wanders")
    assert not any(elsewhere.iterdir()), sorted(p.name for p in elsewhere.rglob("*"))
    run_dir = home / out
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    assert checkpoint.latest(run_dir).name == "step_000002"
    assert (run_dir / "evals" / "again" / "eval.json").is_file()
    assert (run_dir / "rescore" / "wanders.json").is_file()


def test_rescore_refuses_a_folder_without_stored_answers(tmp_path):
    (tmp_path / "config.yaml").write_text("steps: 1\n")
    with pytest.raises(ConfigError, match="no stored validation answers"):
        rescore(tmp_path, "m:f")
