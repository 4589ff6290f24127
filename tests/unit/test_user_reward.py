"""A user's reward by import path (marlow.rewards.user), a file of one's own columns
(marlow.tasks.loaders.load_columns), and the custom task's settings: every failure rule alone."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from marlow.config import ConfigError, resolve
from marlow.diagnostics.metrics import Meter, episode_metrics
from marlow.rewards.user import RESERVED, RewardLoadError, UserReward, load_reward
from marlow.tasks.loaders import DatasetError, load_columns
from marlow.training.batch import credit_rows
from marlow.types import Episode, NoReward, Problem, Turn, missing_reason

PROBLEMS = [
    Problem("a", "1+1", "2", {"columns": {"answer": "2", "level": 1}}),
    Problem("b", "2+3", "5", {"columns": {"answer": "5", "level": 2}}),
    Problem("c", "4*2", "8", {"columns": {"answer": "8", "level": 3}}),
]


def reward_of(fn, form: str = "trl", timeout_s: float = 5.0) -> UserReward:
    return UserReward(fn, spec=f"tests:{fn.__name__}", form=form, timeout_s=timeout_s, source="s")


def grade(reward: UserReward, texts: list[str]) -> list[float]:
    pairs = list(zip(texts, PROBLEMS, strict=True))
    reward.prefetch(pairs)
    return [reward(t, p) for t, p in pairs]


def reasons(values: list[float]) -> list[str | None]:
    return [missing_reason(v) for v in values]


# --------------------------------------------------------------------------- the TRL contract


def test_a_trl_reward_gets_prompts_completions_and_every_column_aligned_in_one_call():
    calls = []

    def exact(prompts, completions, answer, level, problem_ids, **kwargs):
        calls.append((prompts, completions, answer, level, problem_ids, kwargs))
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    reward = reward_of(exact)
    assert grade(reward, ["2", "4", "8"]) == [1.0, 0.0, 1.0]
    assert calls == [
        (["1+1", "2+3", "4*2"], ["2", "4", "8"], ["2", "5", "8"], [1, 2, 3], ["a", "b", "c"], {})
    ]
    assert reward("2", PROBLEMS[0]) == 1.0 and len(calls) == 1  # cached, not called again
    assert reward("9", PROBLEMS[0]) == 0.0 and len(calls) == 2  # a new text: a call of its own


def test_an_async_reward_is_awaited():
    async def judge(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    assert grade(reward_of(judge), ["x", "yy", "zzz"]) == [1.0, 2.0, 3.0]


def test_none_nan_and_inf_are_no_reward_each_with_its_reason():
    def holes(prompts, completions, **kwargs):
        return [None, math.nan, math.inf]

    got = grade(reward_of(holes), ["1", "2", "3"])
    assert all(math.isnan(v) for v in got)
    assert reasons(got) == ["reward_none", "reward_nonfinite", "reward_nonfinite"]


def test_numpy_and_tensor_returns_are_numbers():
    import numpy as np

    def as_array(prompts, completions, **kwargs):
        return np.array([0.5, 1.0, 0.0])

    def as_tensor(prompts, completions, **kwargs):
        return torch.tensor([0.25, 0.5, 0.75])

    assert grade(reward_of(as_array), ["1", "2", "3"]) == [0.5, 1.0, 0.0]
    assert grade(reward_of(as_tensor), ["1", "2", "3"]) == [0.25, 0.5, 0.75]


def test_a_raising_reward_is_graded_one_by_one_and_recorded_with_its_name_and_first_line():
    def broken(prompts, completions, **kwargs):
        raise ValueError("no column 'gold'\nsecond line")

    reward = reward_of(broken)
    assert reasons(grade(reward, ["1", "2", "3"])) == ["reward_error"] * 3
    assert reward.events == [
        {
            "event": "reward_error",
            "function": "test_a_raising_reward_is_graded_one_by_one_and_recorded_with_its_name_"
            "and_first_line.<locals>.broken",
            "error": "ValueError: no column 'gold'",
            "items": 3,
            "batch": 3,
            "then": "graded one by one: 3 of 3 failed (first: ValueError: no column 'gold')",
        }
    ]
    assert reward.last_error.endswith("ValueError: no column 'gold'")


def test_a_reward_raising_on_some_rows_costs_those_rows_alone():
    def picky(prompts, completions, **kwargs):
        return [1.0 / int(c) for c in completions]  # "0" raises ZeroDivisionError

    reward = reward_of(picky)
    got = grade(reward, ["1", "0", "4"])
    assert got[0] == 1.0 and got[2] == 0.25
    assert reasons(got) == [None, "reward_error", None]
    (event,) = reward.events
    assert event["items"] == 1 and event["batch"] == 3
    assert event["then"].startswith("graded one by one: 1 of 3 failed (first: ZeroDivisionError")


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0, 0.0], "returned 2 values for 3 completions"),
        (1.0, "returned a float; expected a list of 3 float or None"),
        ([1.0, "yes", 0.0], "returned a str at index 1"),
        ([1.0, True, 0.0], "returned a bool at index 1"),
    ],
)
def test_a_wrong_length_or_type_is_an_error_naming_what_was_expected_and_returned(
    returned, message
):
    def odd(prompts, completions, **kwargs):
        return returned

    reward = reward_of(odd)
    assert reasons(grade(reward, ["1", "2", "3"])) == ["reward_error"] * 3
    (event,) = reward.events
    assert message in event["error"] and event["function"].endswith("odd")


class Trap(float):  # a number whose reading raises or hangs: the user's object, read under guard
    def __float__(self):
        raise RuntimeError("trap")


class Spinning(list):
    def __len__(self):
        while True:
            pass


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0, Trap(1.0), 0.0], "returned a value that could not be read: RuntimeError: trap"),
        (Spinning([1.0, 1.0, 1.0]), "returned a value that could not be read: took longer"),
    ],
)
def test_a_returned_object_that_raises_or_hangs_when_read_fails_the_call_not_the_run(
    returned, message
):
    def hostile(prompts, completions, **kwargs):
        return returned

    reward = reward_of(hostile, timeout_s=0.5)
    assert reasons(grade(reward, ["1", "2", "3"])) == ["reward_error"] * 3
    (event,) = reward.events
    assert message in event["error"]


def test_a_reward_past_its_timeout_is_no_reward_and_does_not_hang():
    def slow(prompts, completions, **kwargs):
        time.sleep(30)
        return [1.0] * len(completions)

    reward = reward_of(slow, timeout_s=0.2)
    t0 = time.monotonic()
    got = grade(reward, ["1", "2", "3"])
    assert time.monotonic() - t0 < 10  # far below the sleep: the call was abandoned
    assert reasons(got) == ["reward_timeout"] * 3
    assert reward.events[0]["event"] == "reward_timeout"
    assert "task.reward_timeout_s=0.2" in reward.events[0]["error"]


# --------------------------------------------------------------------------- the verl contract


def test_a_verl_reward_is_called_per_item_with_verls_arguments():
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        if solution_str == "boom":
            raise ValueError("cannot parse")
        return {"score": 1.0} if solution_str == ground_truth else 0.0

    reward = reward_of(compute_score, form="verl")
    got = grade(reward, ["2", "boom", "7"])
    assert got[0] == 1.0 and got[2] == 0.0 and reasons(got)[1] == "reward_error"
    assert seen[0] == ("s", "2", "2", {"answer": "2", "level": 1})
    assert [e["error"] for e in reward.events] == ["ValueError: cannot parse"]


# --------------------------------------------------------------------------- import paths


def test_a_reward_loads_from_a_file_and_from_a_module(tmp_path, monkeypatch):
    (tmp_path / "myreward.py").write_text(
        "def score(prompts, completions, **kw):\n    return [1]\n"
    )
    assert load_reward(f"{tmp_path}/myreward.py:score").__name__ == "score"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("myreward:score").__name__ == "score"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "valid: package.module:function or path/to/file.py:function"),
        ("a.b:1x", "valid: package.module:function"),
        ("missing_dir/r.py:f", "file missing_dir/r.py does not exist"),
        ("no_such_module_xyz:f", "cannot import no_such_module_xyz: ModuleNotFoundError"),
        ("{dir}/r.py:nothere", "has no 'nothere'; its functions: score"),
        ("{dir}/r.py:VALUE", "VALUE is a int, not callable"),
        ("{dir}/bad.py:f", "failed to import: ZeroDivisionError"),
        ("{dir}/leaves.py:f", "failed to import: SystemExit: 3"),  # not marlow's exit
    ],
)
def test_a_bad_reward_path_is_one_line_naming_what_is_wrong(tmp_path, spec, message):
    (tmp_path / "r.py").write_text(
        "VALUE = 3\ndef score(prompts, completions, **kw):\n    return []\n"
    )
    (tmp_path / "bad.py").write_text("x = 1 / 0\n")
    (tmp_path / "leaves.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(RewardLoadError) as err:
        load_reward(spec.format(dir=tmp_path))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, ConfigError)


# --------------------------------------------------------------------------- a file of columns


def write_rows(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_columns_become_the_prompt_the_answer_the_id_and_the_rewards_keywords(tmp_path):
    src = write_rows(
        tmp_path / "t.jsonl",
        [
            {"q": "1+1", "gold": 2, "id": "first", "topic": "add"},
            {"q": "2*3", "gold": 6, "topic": "mul"},  # no id: the row's hash
            {"q": "  ", "gold": 1},  # a blank prompt
            {"gold": 5},  # no prompt
            {"q": "3-1"},  # no answer
            "not json",
            {"q": "1+1", "gold": 2, "id": "first", "topic": "add"},  # a repeated id
        ],
    )
    problems, report = load_columns(src, prompt_field="q", answer_field="gold")
    assert [p.prompt for p in problems] == ["1+1", "2*3"]
    assert [p.answer for p in problems] == ["2", "6"]
    assert problems[0].id == "first" and len(problems[1].id) == 16
    assert problems[0].meta["columns"] == {"gold": 2, "id": "first", "topic": "add"}
    assert dict(report.skipped) == {
        "missing_field:q": 2,
        "missing_field:gold": 1,
        "bad_json": 1,
        "duplicate_id": 1,
    }
    again, _ = load_columns(src, prompt_field="q", answer_field="gold")
    assert again[1].id == problems[1].id  # the hash is of the row: the same every time


def test_strict_makes_the_first_bad_row_an_error_naming_it(tmp_path):
    src = write_rows(tmp_path / "t.jsonl", [{"prompt": "1+1"}, {"text": "x"}])
    with pytest.raises(DatasetError, match=r"line 2 of custom rejected \(missing_field:prompt\)"):
        load_columns(src, strict=True)


def test_a_column_named_like_a_reward_keyword_is_refused(tmp_path):
    src = write_rows(tmp_path / "t.jsonl", [{"prompt": "1+1", "completions": "x"}])
    with pytest.raises(DatasetError, match="column 'completions' has the name of a keyword"):
        load_columns(src, reserved=RESERVED)


def test_on_the_tiny_world_prompts_outside_its_characters_are_skipped_and_counted(tmp_path):
    from collections import Counter

    from marlow.tiny.tokenizer import CHARACTERS

    src = write_rows(tmp_path / "t.jsonl", [{"prompt": "1+1"}, {"prompt": "2×3 €"}])
    outside: Counter = Counter()
    problems, report = load_columns(src, vocabulary="".join(CHARACTERS), outside=outside)
    assert [p.prompt for p in problems] == ["1+1"]  # never rewritten to '?'
    assert dict(report.skipped) == {"outside_vocabulary": 1}
    assert set(outside) == {"×", "€"}


# --------------------------------------------------------------------------- settings


def test_a_reward_alone_makes_a_custom_task():
    cfg = resolve({"task": {"source": "d.jsonl", "reward": "m:f"}})
    assert cfg.task.name == "custom"
    assert cfg.task.family_for(tiny=True) == "math" and cfg.task.family_for(tiny=False) == "general"


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"name": "custom", "source": "d.jsonl"}, "task.name is custom but task.reward is not set"),
        ({"reward": "m:f"}, "task.source is tiny; give your data"),
        ({"reward": "m:f", "source": "d.jsonl", "dataset": "gsm8k"}, "task.dataset is for the"),
        ({"name": "math", "reward": "m:f"}, "task.reward is for task.name custom"),
        ({"name": "math", "answer_field": "a"}, "task.answer_field is for task.name custom"),
        ({"name": "code", "family": "math"}, "task.family is math but task.name is code"),
        ({"reward": "m:f", "source": "d.jsonl", "reward_form": "x"}, "'trl' or 'verl'"),
        ({"reward": "m:f", "source": "d.jsonl", "reward_timeout_s": 0}, "reward_timeout_s"),
        ({"reward": "m:f", "source": "d.jsonl", "reward_max_missing": 1.5}, "reward_max_missing"),
    ],
)
def test_custom_task_settings_are_checked_in_one_line(task, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve({"task": task})


# --------------------------------------------------------------------------- training and metrics


def episode(group: int, sample: int, reward: float, roles=("generator", "aggregator")) -> Episode:
    turns = [Turn(r, 0, 0, r, "prompt", [1], [2], [0.0], "stop", "text") for r in roles]
    return Episode(f"p{group}", group, sample, turns=turns, reward=reward, correct=reward >= 1)


def test_a_sample_without_a_reward_is_out_of_its_groups_advantage_and_gets_no_gradient():
    from marlow.algo.turn_advantages import turn_advantages

    episodes = [episode(0, 0, 1.0), episode(0, 1, NoReward("reward_error")), episode(0, 2, 0.0)]
    turns, rows = credit_rows(episodes)
    assert len(turns) == 4 and all(t in episodes[0].turns + episodes[2].turns for t in turns)
    adv, _, _ = turn_advantages(rows, "problem", 1e-6, False, None)
    # the group is {1.0, 0.0}: mean 0.5, Bessel std sqrt(0.5) = 0.7071; A = +-0.5 / 0.7071
    want = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.tolist() == pytest.approx([want, want, -want, -want], abs=1e-6)


def test_metrics_leave_a_missing_reward_out_and_count_it_per_role():
    episodes = [
        episode(0, 0, 1.0),
        episode(0, 1, NoReward("reward_timeout")),
        episode(0, 2, math.nan, roles=("generator",)),
        episode(1, 0, 0.0),
    ]
    meter = Meter()
    episode_metrics(meter, episodes)
    out = meter.result("train")
    assert out["train/all/reward"] == 0.5 and out["train/all/accuracy"] == 0.5
    assert out["train/all/reward_timeout"] == 1 and out["train/all/reward_nonfinite"] == 1
    assert out["train/generator/reward_timeout"] == 1
    assert out["train/aggregator/reward_timeout"] == 1
    assert out["train/generator/reward_nonfinite"] == 1
    assert "train/aggregator/reward_nonfinite" not in out
    merged = Meter.merge([meter, meter]).result("train")  # data-parallel ranks add counts
    assert merged["train/all/reward_timeout"] == 2


def test_the_progress_line_says_how_many_episodes_have_no_reward(capsys):
    from marlow.cli import _StepProgress

    progress = _StepProgress(total=4)
    progress.tty = False  # the plain line, as in a log file
    record = {
        "train/all/reward": 0.5,
        "train/all/reward_error": 3.0,
        "train/all/reward_none": 2.0,
        "val/all/accuracy": 0.75,
        "val/all/reward_timeout": 4.0,
    }
    progress.update(1, record)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "5 episodes without a reward" in line
    assert "val acc 0.750 (of the graded; 4 without a reward)" in line
    progress.update(2, {"train/all/reward": 0.5, "val/all/accuracy": 0.5})
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "without a reward" not in line


def test_inspect_shows_the_turns_and_episodes_left_without_a_reward(tmp_path):
    import json

    import marlow
    from marlow.config.loading import dump_config
    from marlow.report.inspect import inspect_run

    cfg = marlow.make_config(preset="tiny", workflow={"name": "voting"})
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    records = [
        {"step": 1, "train/all/reward": 0.5, "train/all/reward_error": 6.0,
         "train/generator/reward_error": 18.0, "train/aggregator/reward": 0.5,
         "val/all/accuracy": 0.5, "val/all/reward_timeout": 2.0},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = inspect_run(tmp_path)
    assert report["roles"]["all"]["latest"]["reward_error"] == 6.0
    assert report["roles"]["generator"]["latest"]["reward_error"] == 18.0
    assert report["roles"]["all"]["val"]["reward_timeout"] == 2.0
