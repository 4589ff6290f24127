"""Workflow files: the built-ins are files, any file works like a name, and none touches the tiny
world's cache key."""

from __future__ import annotations

import copy

import pytest

from marlow.tiny.corpus import CorpusConfig
from marlow.tiny.pretrain import cache_key
from marlow.workflows import (
    KINDS,
    build_workflow,
    load_workflow,
    register_workflow,
    spec,
    workflow_names,
)
from marlow.workflows.spec import BUILTIN_DIR

ECHO = """\
title: Echo
roles:
  speaker: {kind: answer, prompts: {say: {tiny: "Q: {problem}", chat: "Answer: {problem}"}}}
  echo:
    kind: final
    prompts:
      repeat: "Q: {problem}\\nA: {heard}\\nFinal:"
stages:
  - {role: speaker, prompt: say}
  - {role: echo, prompt: repeat, reads: {heard: last.speaker}}
answer: last.echo
"""


def test_the_built_ins_are_the_shipped_files():
    assert workflow_names() == ["eval_opt", "orch_workers", "single", "test_fix", "voting"]
    assert sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml")) == workflow_names()
    kinds = {n: dict(build_workflow(n).kinds) for n in workflow_names()}
    assert kinds == {
        "single": {"generator": "answer"},
        "eval_opt": {"generator": "answer", "evaluator": "judge"},
        "voting": {"generator": "answer", "aggregator": "select"},
        "orch_workers": {"orchestrator": "plan", "worker": "answer", "synthesizer": "final"},
        "test_fix": {"solver": "answer", "fixer": "answer"},  # and its tool stage, no role
    }
    assert build_workflow("test_fix").tools == {
        "tests": "marlow.workflows.codetools:run_visible_tests"
    }
    assert set().union(*(k.values() for k in kinds.values())) == set(KINDS)


def test_parameters_unroll_rounds_and_slots():
    three = build_workflow("eval_opt")
    assert [(s.role, s.round) for s in three.stages] == [
        ("generator", 0),
        ("evaluator", 0),
        ("generator", 1),
        ("evaluator", 1),
        ("generator", 2),
        ("evaluator", 2),
        ("generator", 3),
    ]
    assert len(build_workflow("eval_opt", rounds=0).stages) == 2
    assert build_workflow("voting", n=5).slots_of("generator") == 5
    orch = build_workflow("orch_workers", n=2)
    assert orch.stages[0].count == 2 and orch.slots_of("worker") == 2


def test_a_file_path_works_like_a_name(tmp_path):
    path = tmp_path / "echo.yaml"
    path.write_text(ECHO)
    wf = build_workflow(str(path))
    assert (wf.name, wf.title, wf.roles) == ("echo", "Echo", ["speaker", "echo"])
    assert load_workflow(path).kinds == wf.kinds


def test_declaring_or_registering_a_workflow_leaves_the_tiny_cache_key(tmp_path, monkeypatch):
    """The key hashes what shapes the model only: the read-only prompt library's templates, never
    a workflow's own (the pinned value is the default tiny-s math world's)."""
    before = cache_key("tiny-s", 1200, 0, CorpusConfig())
    assert before == "5f26d65acb7f"
    monkeypatch.setattr(spec, "_REGISTRY", copy.deepcopy(spec._REGISTRY))
    path = tmp_path / "echo.yaml"
    path.write_text(ECHO)
    register_workflow("echo", path)
    assert build_workflow("echo").prompts  # its own templates, read
    assert cache_key("tiny-s", 1200, 0, CorpusConfig()) == before


def test_the_prompt_library_is_read_only():
    from marlow.prompts import TEMPLATES

    with pytest.raises(TypeError):
        TEMPLATES["tiny"][("math", "x", "y")] = "{problem}"  # type: ignore[index]
