"""A task = problems (train stream, validation split) + an outcome reward.

Training batches are a pure function of (seed, step): a resumed run draws exactly the batches
the uninterrupted run would have drawn, and the data cursor is just the step count.

Tasks: ``math`` (reward: ``marlow.rewards.grade_math`` against ``Problem.answer``), ``code``
(reward: ``marlow.rewards.code`` on the hidden tests in ``Problem.meta["tests"]``, through
:class:`CodeGrader`) and ``custom``: a file of one's own columns
(``marlow.tasks.loaders.load_columns``; ``Problem.meta["columns"]`` keeps every column but the
prompt's) graded by a user's function (``marlow.rewards.user``). Sources: ``tiny`` (synthetic arithmetic, ``marlow.tiny.mathgen``, or
synthetic code, ``marlow.tiny.codegen``; endless and seeded), or a dataset file / hub id read by
``marlow.tasks.loaders`` (``task.dataset`` names its format; code: ``humaneval`` or
``deepcoder`` with ``task.subset``). A dataset is split once, by ``task.split_rule`` and
``task.split_seed``, into held-out problems (``task.holdout``, default ``task.val_size``) and
train; validation is the held-out part's first ``task.val_size`` problems, or those of
``task.val_source`` (then nothing is held out unless ``task.holdout`` says so; the official DAPO
recipe holds out 10 % and validates on AIME-2025). ``split_rule=permutation`` reproduces the
``datasets`` library's seeded split of the rows, on the rows the loader read (less those
``task.runtime_filter`` drops), so a row marlow skips is missing from its side only. Train batches walk
the train problems in epochs, each epoch in its own seeded order; a batch may straddle two
epochs. Choices of marlow, not fixed by the spec.

Bad rows: the loader skips and counts them by reason (``marlow.tasks.loaders``); ``build_task``
logs the counts and keeps them in ``Task.data_report`` (the trainer records them in the run's
``events.jsonl``). The data settings live in ``task.*``, so the strict switch is ``task.strict``:
with it, the first row that would be skipped is an error naming the row and the reason.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, get_args

from marlow.config import ConfigError, TaskConfig
from marlow.rewards.code import DEFAULT_TIMEOUT_S
from marlow.rewards.math import grade_math
from marlow.types import Problem

if TYPE_CHECKING:
    from marlow.tasks.loaders import LoadReport

CODE_REWARDS: tuple[str, ...] = get_args(TaskConfig.model_fields["code_reward"].annotation)
TINY_CODE_TIMEOUT_S = 2.0  # per hidden test: the tiny programs run in microseconds


def _grade_math(text: str, problem: Problem, format_penalty: float) -> float:
    return grade_math(text, problem.answer, format_penalty)


class CodeGrader:
    """The code reward as a picklable (text, problem) -> fraction of hidden tests passed.

    Its cache maps (problem id, extracted program, exactly) to the reward, so a program written by
    several slots or episodes, or graded again for per-role credit and Voting's extras, runs
    once. ``prefetch`` grades many texts in one ``score_code_batch`` call (suite mode: one
    sandbox run per program; the runs spread over the cores); the workflow engine calls it with
    every text of a step before asking text by text. The cache keeps the newest ``cache_size``
    entries; a text without code scores 0 without running anything.

    ``reward``: ``pass_rate`` (the fraction of tests passed, the paper's text) or ``all_pass`` (1
    only when every test passes, else 0: the official code); ``block_rule``: which code is run
    (``marlow.parsers.code.BLOCK_RULES``).

    A program whose run hit a sandbox failure (the sandbox could not set up: no verdict on the
    program) scores 0 for that call but is never cached, so a passing failure cannot stick to
    a program; ``sandbox_errors`` counts such programs (the trainer logs it per step, and warns
    with ``last_sandbox_error``, the newest failure's reason).
    """

    def __init__(
        self,
        timeout_s: float,
        cache_size: int = 20_000,
        max_workers: int | None = None,
        reward: str = "pass_rate",
        block_rule: str = "fallback",
    ):
        if reward not in CODE_REWARDS:
            raise ValueError(f"unknown code reward {reward!r}; valid: {', '.join(CODE_REWARDS)}")
        self.timeout_s = timeout_s
        self.reward = reward
        self.block_rule = block_rule
        self.cache_size = cache_size
        self.max_workers = max_workers
        self.sandbox_errors = 0
        self.last_sandbox_error: str | None = None
        self._cache: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._uncached: dict[tuple[str, str], float] = {}

    def _key(self, text: str, problem: Problem) -> tuple[str, str] | None:
        from marlow.rewards.code import extract_code

        program = extract_code(text, self.block_rule)
        return None if program is None else (problem.id, program)

    def prefetch(self, pairs: Sequence[tuple[str, Problem]]) -> None:
        """Grade every (text, problem) not in the cache yet, in one batch."""
        from marlow.rewards.code import score_code_batch

        todo: dict[tuple[str, str], tuple[str, object]] = {}
        for text, problem in pairs:
            key = self._key(text, problem)
            if key is not None and key not in self._cache and key not in todo:
                todo[key] = (text, problem.meta["tests"])
        if not todo:
            return
        scores = score_code_batch(
            list(todo.values()),
            suite=True,
            block_rule=self.block_rule,
            timeout_s=self.timeout_s,
            max_workers=self.max_workers,
        )
        for key, score in zip(todo, scores, strict=True):
            if score.sandbox_error is not None:
                self.sandbox_errors += 1
                self.last_sandbox_error = score.sandbox_error
                self._uncached[key] = score.reward
            else:
                self._remember(key, score.reward)

    def _remember(self, key: tuple[str, str], reward: float) -> None:
        self._cache[key] = reward
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def __call__(self, text: str, problem: Problem) -> float:
        rate = self._pass_rate(text, problem)
        if self.reward == "all_pass":
            return 1.0 if rate >= 1.0 else 0.0
        return rate

    def _pass_rate(self, text: str, problem: Problem) -> float:
        key = self._key(text, problem)
        if key is None:
            return 0.0
        if key not in self._cache:
            if key in self._uncached:  # graded by this step's prefetch, not cached
                return self._uncached.pop(key)
            self.prefetch([(text, problem)])
            if key in self._uncached:
                return self._uncached.pop(key)
        return self._cache[key]


@dataclass
class Task:
    name: str
    config: TaskConfig
    _train: list[Problem] = field(default_factory=list, repr=False)
    _val: list[Problem] = field(default_factory=list, repr=False)
    data_report: dict | None = None  # a dataset's rows read, kept and skipped by reason

    @property
    def sandboxed(self) -> bool:
        """Whether grading runs model code in marlow's sandbox (the code task's hidden tests)."""
        return self.name == "code"

    def grader(self):
        """A (text, problem) -> reward function (picklable for math and code; a custom task's
        is :class:`marlow.rewards.user.UserReward`, which imports the user's function)."""
        if self.config.custom:
            from marlow.rewards.user import UserReward, load_reward

            c = self.config
            return UserReward(
                load_reward(c.reward),
                spec=c.reward,
                form=c.reward_form,
                timeout_s=c.reward_timeout_s,
                source=c.source,
            )
        if self.name == "code":
            timeout = self.config.code_timeout_s or (
                TINY_CODE_TIMEOUT_S if self.config.source == "tiny" else DEFAULT_TIMEOUT_S
            )
            return CodeGrader(
                timeout, reward=self.config.code_reward, block_rule=self.config.code_block
            )
        return partial(_grade_math, format_penalty=self.config.format_penalty)

    def _generator(self) -> ModuleType:
        """The tiny world's problem module of this task."""
        if self.name == "code":
            from marlow.tiny import codegen

            return codegen
        from marlow.tiny import mathgen

        return mathgen

    def train_batch(self, seed: int, step: int, size: int) -> list[Problem]:
        if self.config.source == "tiny":
            stream = self._generator().train_problems(seed=seed * 100_003 + step)
            return list(itertools.islice(stream, size))
        n = len(self._train)
        out = []
        for position in range((step - 1) * size, step * size):
            epoch, k = divmod(position, n)
            out.append(self._train[_epoch_order(seed, epoch, n)[k]])
        return out

    def train_problems(self) -> list[Problem]:
        """A dataset's training problems (a tiny task's are endless: none listed)."""
        return list(self._train)

    def val_problems(self) -> list[Problem]:
        if self.config.source == "tiny":
            return self._generator().val_problems(self.config.val_size)
        return list(self._val)


def _epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    order = list(range(n))
    random.Random(f"marlow-epoch-{seed}-{epoch}").shuffle(order)
    return order


def build_task(
    config: TaskConfig,
    log: Callable[[str], None] | None = None,
    vocabulary: str | None = None,
    recorded: dict | None = None,
) -> Task:
    """The task of ``config``; a dataset is loaded and split here, and ``log`` gets one line of
    its row counts (``WARNING`` first when rows were skipped). ``vocabulary``: the characters
    the model reads (the tiny world's); a custom task's prompt with any other character is
    skipped and counted, and the characters logged.

    ``recorded``: the ``data`` event of the run this command works on (a resume, an eval, a
    rescore), if it has one: data that read the same are then said in one quiet line, so a
    run's data warning is given once, when it starts; data that changed since are said in full,
    with the change named."""
    if config.source == "tiny":
        return Task(config.name, config)
    from marlow.tasks.loaders import (
        DatasetError,
        held_out_count,
        load,
        load_columns,
        permutation_split,
        split,
    )

    outside: Counter = Counter()

    def read(source: str) -> tuple[list[Problem], LoadReport]:
        if config.custom:
            from marlow.rewards.user import RESERVED

            return load_columns(
                source,
                prompt_field=config.prompt_field or "prompt",
                answer_field=config.answer_field,
                id_field=config.id_field,
                vocabulary=vocabulary,
                outside=outside,
                reserved=RESERVED if config.reward_form == "trl" else (),
                strict=config.strict,
            )
        kwargs: dict = {"subset": config.subset} if config.dataset == "deepcoder" else {}
        if config.runtime_filter is not None:
            kwargs["runtime_filter"] = config.runtime_filter
        if config.hub_config is not None:
            kwargs["config"] = config.hub_config
        return load(config.dataset, source, strict=config.strict, **kwargs)

    try:
        problems, report = read(config.source)
        holdout = config.holdout
        if holdout is None and config.val_source is None:
            holdout = config.val_size
            if len(problems) <= holdout:
                raise DatasetError(
                    f"task.val_size is {config.val_size} but {config.source} has only "
                    f"{len(problems)} usable problems; leave some for training"
                )
        if holdout is None:  # validation from its own source, nothing held out: train on all
            train, held = problems, []
        elif config.split_rule == "permutation":
            args = (report.positions, report.n_positions, holdout, config.split_seed)
            train, held = permutation_split(problems, *args)
        else:
            n_held = held_out_count(holdout, len(problems))
            if n_held >= len(problems):
                raise DatasetError(
                    f"task.holdout holds out {n_held} of {len(problems)} usable problems; "
                    "leave some for training"
                )
            train, held = split(problems, n_held, config.split_seed)
        val = held[: config.val_size]
        if config.val_source is not None:  # validation from its own source
            if config.custom:
                other, _ = read(config.val_source)
            else:
                other, _ = load(config.val_dataset, config.val_source, strict=config.strict)
            if not other:
                raise DatasetError(f"task.val_source {config.val_source} has no usable problem")
            val = other[: config.val_size]
    except DatasetError as err:
        strict = "task.strict is true and " if config.strict and "rejected" in str(err) else ""
        raise ConfigError(f"{strict}{err}") from None
    data = {
        "dataset": report.dataset,
        "source": report.source,
        "rows_read": report.rows_read,
        "kept": report.kept,
        "skipped": dict(sorted(report.skipped.items())),
    }
    if log is not None and recorded is not None and _same_data(recorded, data):
        log(f"data as at the run's start: kept {report.kept}, skipped {report.n_skipped}")
    elif log is not None:
        hint = "; task.strict=true makes a skipped row an error" if report.n_skipped else ""
        log(f"{'WARNING ' if report.n_skipped else ''}data {report.summary()}{hint}")
        if outside:
            chars = ", ".join(repr(c) for c, _ in outside.most_common(12))
            log(
                f"WARNING the tiny world reads printable ASCII only: prompts holding {chars} "
                "were skipped (outside_vocabulary), not rewritten"
            )
        if recorded is not None:
            log("WARNING the data differ from what the run started with (events.jsonl: data)")
    return Task(config.name, config, train, val, data)


def _same_data(recorded: dict, data: dict) -> bool:
    return {k: v for k, v in recorded.items() if k not in ("step", "action")} == data
