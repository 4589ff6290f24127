"""Code episodes through the engine with real tiny models: random weights, then a training run."""

from __future__ import annotations

import json

import pytest

from marlow.diagnostics.sinks import read_metrics
from marlow.policy.routing import make_routing
from marlow.prompts.chat import chat_prompt_ids
from marlow.rollout.hf import HFEngine
from marlow.tasks.base import CodeGrader
from marlow.tiny import codegen
from marlow.tiny.model import build_model
from marlow.tiny.tokenizer import build_tokenizer
from marlow.training.trainer import Trainer
from marlow.types import SamplingParams
from marlow.workflows import build_workflow
from marlow.workflows.engine import run_episodes
from marlow.workflows.spec import EpisodeRules


@pytest.mark.parametrize("workflow", ["single", "eval_opt", "voting", "orch_workers"])
def test_code_episodes_with_a_random_tiny_model(workflow):
    tokenizer = build_tokenizer()
    model = build_model("tiny-s", len(tokenizer), seed=0).eval()
    wf = build_workflow(workflow, **({"rounds": 1} if workflow == "eval_opt" else {}))
    problems = codegen.val_problems(2)
    episodes = run_episodes(
        wf,
        problems,
        2,
        engine=HFEngine(model, tokenizer),
        tokenizer=tokenizer,
        routing=make_routing("base", wf.roles),
        grade=CodeGrader(2.0),
        task="code",
        style="tiny",
        sampling=SamplingParams(1.0, 24, 0),
        rules=EpisodeRules(credit="role"),
    )
    assert len(episodes) == 4
    fresh = CodeGrader(2.0)  # no cache shared with the run's grader
    for ep in episodes:
        problem = next(p for p in problems if p.id == ep.problem_id)
        assert ep.turns
        assert ep.reward == fresh(ep.final_answer, problem)  # the final answer's grade
        assert ep.correct == (ep.reward >= 1.0)
        assert all(t.reward is not None for t in ep.turns)
        for t in ep.turns:
            assert t.prompt_ids == chat_prompt_ids(tokenizer, t.prompt_text)
            assert t.prompt_text.startswith("P: ")


@pytest.mark.slow  # ~25 s on 2 busy cores: it pre-trains the code model briefly first
def test_a_code_voting_run_trains_and_validates(small_config, tmp_path):
    cfg = small_config(
        task={"name": "code", "val_size": 6},
        workflow={"name": "voting"},
        policy={"routing": "sp"},
        grpo={"credit": "role"},
        sample_episodes=12,  # every training episode of a step: 3 problems x 4
    )
    out = Trainer(cfg, tmp_path / "run").run()
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "val/all/accuracy" in records[0] and "val/all/accuracy" in records[2]
    assert records[1]["train/shared/updates"] >= 1
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in samples if r["split"] == "train" and r["step"] == 1]
    assert len(rewards) == 12
    # the mean episode reward (role credit gives turns other rewards; they must not leak in)
    assert records[1]["train/all/reward"] == pytest.approx(sum(rewards) / 12, abs=1e-12)
    assert any(k.endswith("pass_at_n") for k in records[1])
    assert records[1]["train/all/sandbox_errors"] == 0.0  # every program got a verdict
    assert "task:\n  name: code" in (out / "config.yaml").read_text()
