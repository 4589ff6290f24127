"""The built-in workflows give the same episodes as the pinned record (workflow_rollouts.json).

Two records per built-in workflow:

* ``tiny``: two steps' rollouts of the tiny world (the conftest's briefly pre-trained tiny-s, the
  trainer's own problems and seeds, per-role credit so every turn carries a reward): each turn's
  role, slot, round, adapter, prompt text, a hash of its prompt token ids and its completion token
  ids; each episode's reward, counters and extras.
* ``chat``: the chat-style prompts of math and code, rendered by the engine over canned
  completions (no model), so the templates a real chat model sees are pinned token for token too.

The record was written before workflows became files and must not change with them.
Regenerate it only for a deliberate change of prompts or sampling:
``MARLOW_REGEN_ROLLOUTS=1 .venv/bin/pytest tests/integration/test_workflow_regression.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from marlow.policy.routing import make_routing
from marlow.rewards.math import last_boxed
from marlow.training.trainer import Trainer, step_seed
from marlow.types import Completion, Episode, Problem, SamplingParams
from marlow.workflows import build_workflow
from marlow.workflows.engine import run_episodes
from marlow.workflows.spec import EpisodeRules

RECORD = Path(__file__).with_name("workflow_rollouts.json")
WORKFLOWS = ("single", "eval_opt", "voting", "orch_workers")
REGEN = os.environ.get("MARLOW_REGEN_ROLLOUTS") == "1"


def _episode(ep: Episode) -> dict:
    return {
        "problem_id": ep.problem_id,
        "reward": ep.reward,
        "counters": ep.counters,
        "info": ep.info,
        "turns": [
            {
                "role": t.role,
                "slot": t.slot,
                "round": t.round,
                "adapter": t.adapter,
                "prompt_text": t.prompt_text,
                "prompt_ids_sha1": hashlib.sha1(str(t.prompt_ids).encode()).hexdigest(),
                "completion_ids": t.completion_ids,
                "reward": t.reward,
            }
            for t in ep.turns
        ],
    }


def _tiny_record(small_config, tmp_path, workflow: str) -> list[dict]:
    cfg = small_config(
        workflow={"name": workflow}, policy={"routing": "ip"}, grpo={"credit": "role"}
    )
    trainer = Trainer(cfg, tmp_path / "run")
    out = []
    for step in (1, 2):
        problems = trainer.task.train_batch(cfg.seed, step, cfg.grpo.batch_problems)
        episodes = trainer.rollout(
            problems, cfg.grpo.group_size, cfg.rollout.temperature, step_seed(cfg.seed, step)
        )
        out.append([_episode(ep) for ep in episodes])
    return out


CANNED = [
    "Try 2+2. \\boxed{4}",
    "Looks wrong. \\boxed{Incorrect}",
    "STRATEGY 1: add\nSTRATEGY 3: guess",
    "\\boxed{2}",
    "```python\nprint(4)\n```",
    "\\boxed{Correct}",
    "no answer",
]


class _Canned:
    """A rollout engine that answers request i of each call with ``CANNED[(call + i) % 7]``."""

    def __init__(self) -> None:
        self.calls = 0

    def generate(self, requests, params: SamplingParams) -> list[Completion]:
        self.calls += 1
        texts = [CANNED[(self.calls + i) % len(CANNED)] for i in range(len(requests))]
        return [Completion([ord(c) for c in x], [0.0] * len(x), "stop", x) for x in texts]


class _Chars:
    """A tokenizer whose chat template is the text itself and whose ids are code points."""

    def apply_chat_template(self, messages, **_kw) -> str:
        return messages[0]["content"]

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}


def _grade(text: str, problem: Problem) -> float:
    return 1.0 if last_boxed(text) == problem.answer else 0.0


def _chat_record(workflow: str) -> dict[str, list[dict]]:
    spec = build_workflow(workflow)
    out = {}
    for task in ("math", "code"):
        problems = [Problem(f"p{i}", f"What is {i}+{i}?", str(2 * i)) for i in (1, 2)]
        episodes = run_episodes(
            spec,
            problems,
            3,
            engine=_Canned(),
            tokenizer=_Chars(),
            routing=make_routing("ip", spec.roles, None),
            grade=_grade,
            task=task,
            style="chat",
            sampling=SamplingParams(0.7, 16, 0),
            rules=EpisodeRules(credit="role"),
        )
        out[task] = [_episode(ep) for ep in episodes]
    return out


def _compare(key: str, got) -> None:
    stored = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if REGEN:
        stored[key] = got
        RECORD.write_text(json.dumps(stored, sort_keys=True, separators=(",", ":")) + "\n")
        return
    assert key in stored, f"no record for {key}; regenerate (see the module docstring)"
    assert json.loads(json.dumps(got)) == stored[key]


@pytest.mark.parametrize("workflow", WORKFLOWS)
def test_tiny_rollouts_match_the_record(small_config, tmp_path, workflow):
    _compare(f"tiny/{workflow}", _tiny_record(small_config, tmp_path, workflow))


@pytest.mark.parametrize("workflow", WORKFLOWS)
def test_chat_prompts_match_the_record(workflow):
    _compare(f"chat/{workflow}", _chat_record(workflow))
