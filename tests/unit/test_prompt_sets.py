"""Prompt sets as data: the built-in sets, a set of one's own, the official protocol's
set, and the errors a bad set file gets."""

from __future__ import annotations

import pytest

from marlow.config import ConfigError, resolve
from marlow.prompts import CHAT_SETS, TEMPLATES, prompt_set, template
from marlow.types import Problem
from marlow.workflows import build_workflow
from marlow.workflows.spec import workflow_names
from marlow.workflows.validate import check_run_config
from tests.unit.test_official_switches import episodes

LIBRARY_KEYS = sorted({(t, r, v) for t, r, v in TEMPLATES["chat"]})


def test_every_builtin_chat_set_has_every_template_the_builtin_workflows_name():
    used = {
        tuple(stage.prompt.split("/"))
        for name in workflow_names()
        for stage in build_workflow(name).stages
        if "/" in stage.prompt
    }
    assert used  # the built-in workflows do name library templates
    for name in CHAT_SETS:
        keys = set(prompt_set(name).templates)
        for task in ("math", "code", "general") if name == "marlow" else ("math", "code"):
            missing = {(task, r, v) for r, v in used} - keys
            assert not missing, (name, missing)
    # the official protocol covers the study's two tasks; a task of one's own reads marlow's
    marlow = {k for k in prompt_set("marlow").templates if k[0] != "general"}
    assert set(prompt_set("official").templates) == marlow


def test_the_library_is_the_marlow_set_and_the_tiny_set():
    assert TEMPLATES["chat"] is prompt_set("marlow").templates
    assert TEMPLATES["tiny"] is prompt_set("tiny").templates
    assert template("chat", "math", "generator", "answer", "official") != template(
        "chat", "math", "generator", "answer"
    )
    # a tiny model reads the tiny set whatever set is named
    assert template("tiny", "math", "generator", "answer", "official") == "Q: {problem}"


def test_the_official_set_keeps_the_official_protocol():
    off = prompt_set("official")
    assert off.context == "conversation"
    for task in ("math", "code"):
        revise = off.templates[(task, "generator", "revise")]
        assert "different" in revise and "feedback above" in revise
        review = off.templates[(task, "evaluator", "review")]
        assert "above" in review and "\\boxed{{Correct}}" in review
        assert "{problem}" not in review and "{answer}" not in review  # the conversation has them
        assert "at most {n}" in off.templates[(task, "orchestrator", "plan")]
        assert "STRATEGY 1:" in off.templates[(task, "orchestrator", "plan")]
        assert "\\boxed{{N}}" in off.templates[(task, "aggregator", "select")]
    # marlow's reviser carries the answer and the critique itself
    mine = prompt_set("marlow").templates[("math", "generator", "revise")]
    assert "{answer}" in mine and "{critique}" in mine and "different" not in mine


def test_the_named_set_writes_the_chat_prompts_of_an_episode():
    wf = build_workflow("eval_opt", rounds=1)

    def script(prompt, i, call):
        return ["\\boxed{6}", "\\boxed{Incorrect}", "\\boxed{5}"][call]

    problem = Problem("p0", "What is 2+3?", "5")
    texts = {}
    for name in ("marlow", "official"):
        (ep,) = episodes(
            wf, script, problems=(problem,), style="chat", prompts=name, context="conversation"
        )
        texts[name] = [t.prompt_text for t in ep.turns]
    assert texts["marlow"][0] == template("chat", "math", "generator", "answer").format(
        problem="What is 2+3?"
    )
    assert texts["official"][0].endswith("Problem: What is 2+3?")
    assert "What is 2+3?" in texts["marlow"][1] and "\\boxed{6}" in texts["marlow"][1]
    # the official reviewer reads the solution from the shared conversation, not its prompt
    assert (
        texts["official"][1]
        == prompt_set("official").templates[("math", "evaluator", "review")].format()
    )
    assert "different" in texts["official"][2]


def test_a_set_of_ones_own_may_take_the_rest_from_a_builtin_base(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "base: marlow\ntemplates:\n  math:\n    aggregator/select: |-\n"
        "      Pick one of these for {problem}:\n      {candidates}\n"
    )
    mine = prompt_set(str(path))
    assert mine.name == "mine" and mine.style == "chat"
    assert mine.templates[("math", "aggregator", "select")].startswith("Pick one of these")
    assert (
        mine.templates[("math", "generator", "answer")]
        == TEMPLATES["chat"][("math", "generator", "answer")]
    )
    cfg = resolve({"workflow": {"prompts": str(path)}})
    check_run_config(cfg)  # accepted


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("templates: [1, 2]", "'templates' must map a task"),
        ("templates:\n  chess:\n    a/b: x", "task 'chess' is unknown; valid: math, code"),
        ("templates:\n  math:\n    generator: x", "'generator' is not ROLE/VARIANT"),
        ("templates:\n  math:\n    a/b: 'x {'", "is not a format string"),
        ("templates:\n  math:\n    a/b: ''", "must be non-empty text"),
        ("style: fancy\ntemplates:\n  math:\n    a/b: x", "style 'fancy' is unknown"),
        ("context: always\ntemplates:\n  math:\n    a/b: x", "context 'always' is unknown"),
        ("base: gpt\ntemplates:\n  math:\n    a/b: x", "base 'gpt' is unknown; valid: marlow"),
        ("temlates:\n  math: {}", "unknown key 'temlates'"),
        ("templates: {math: [", "not readable YAML"),
        ('templates:\n  math:\n    a/b: "x \\ud800 {problem}"', "math.a/b holds a lone surrogate"),
    ],
)
def test_a_bad_set_file_is_one_line_naming_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="workflow.prompts") as err:
        check_run_config(resolve({"workflow": {"prompts": str(path)}}))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_set_name_or_context_that_cannot_work_is_refused():
    with pytest.raises(ConfigError, match="'offical' is unknown; valid: marlow, official, tiny"):
        check_run_config(resolve({"workflow": {"prompts": "offical"}}))
    with pytest.raises(ConfigError, match="tiny set"):
        check_run_config(resolve({"workflow": {"prompts": "tiny"}}))
    chat_model = {"name": "Qwen/Qwen3-0.6B"}
    with pytest.raises(ConfigError, match="workflow.context=conversation"):
        check_run_config(resolve({"model": chat_model, "workflow": {"prompts": "official"}}))
    # a tiny model never reads a chat set: an ablation of the context on it is allowed
    check_run_config(
        resolve(
            {"preset": "official", "model": {"name": "tiny-s"}, "workflow": {"context": "latest"}}
        )
    )
    check_run_config(resolve({"preset": "official"}))  # the preset pairs them
