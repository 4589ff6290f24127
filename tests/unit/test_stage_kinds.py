"""A stage kind is added in one place: the documented example kind, registered as the extension
page writes it, is read, checked, shown and run by the workflow code without a line of it
changing, and a kind's bad stages are one-line errors naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from marlow.registry import Registry
from marlow.workflows import stage_kinds
from marlow.workflows.load import build_workflow
from marlow.workflows.schema import WorkflowFileError
from marlow.workflows.show import describe
from marlow.workflows.stage_kinds import StageKind, register_stage_kind
from marlow.workflows.tools import ToolStage
from tests.unit.test_tool_stages import episodes

PAGE = Path(__file__).parents[2] / "docs" / "concepts" / "extending.md"


@pytest.fixture
def own_registry(monkeypatch):
    """The process's stage kinds, in a registry of this test's own (the tool kind in it)."""
    mine = Registry("stage kind", {"tool": "marlow.workflows.tools:TOOL_STAGE"})
    monkeypatch.setattr(stage_kinds, "_KINDS", mine)
    return mine


@pytest.fixture
def count_kind(own_registry):
    """The extension page's stage kind, registered by running its block as written."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    (block,) = [b for b in blocks if "register_stage_kind" in b]
    exec(compile(block, str(PAGE), "exec"), {"__name__": "__main__"})  # noqa: S102
    return stage_kinds.stage_kind("count")


def workflow(tmp_path: Path, stage: str, when: str = "too_long") -> str:
    path = tmp_path / "wf.yaml"
    path.write_text(
        f"""roles:
  writer: {{kind: answer}}
  fixer: {{kind: answer, prompts: {{cut: 'Shorten {{draft}} ({{note}})'}}}}
stages:
  - {{role: writer, prompt: generator/answer}}
  - {stage}
  - {{role: fixer, prompt: cut, when: {when}, reads: {{draft: last.writer, note: last.length}}}}
answer: latest
"""
    )
    return str(path)


@pytest.mark.parametrize(("most", "fixed"), [(2, True), (3, False)])
def test_the_documented_kind_runs_and_its_condition_routes_the_episode(
    count_kind, tmp_path, most, fixed
):
    path = workflow(tmp_path, f"{{count: length, most: {most}, reads: {{draft: last.writer}}}}")
    for ep in episodes(path)[1]:
        roles = [t.role for t in ep.turns]
        assert roles == (["writer", "fixer"] if fixed else ["writer"])  # 3 words vs most
        if fixed:
            draft = ep.turns[0].completion_text  # <writer output k>
            assert ep.turns[1].prompt_text == f"Shorten {draft} (3 words)"
    shown = describe(build_workflow(path))
    assert f"  2. count length x1; most {most}; round 0; reads draft=last.writer" in shown


def test_a_kinds_bad_stage_is_one_line_naming_the_field(count_kind, tmp_path):
    bad = {
        "{count: length, most: 2, role: writer}": ("role", "a count stage takes no role"),
        "{most: 2}": ("count", "a count stage needs count"),
        "{count: length, least: 2}": ("least", "unknown field; valid: count, most, reads"),
        "{count: length, most: many}": ("most", "input should be a valid integer"),
        "{count: writer}": ("count", "count name 'writer' must be a word and not a role's"),
        "{count: length, tool: t, call: 'a:b'}": ("tool", "a stage has one kind"),
    }
    for stage, (field, message) in bad.items():
        with pytest.raises(WorkflowFileError) as info:
            build_workflow(workflow(tmp_path, stage))
        said = str(info.value)
        assert f"field 'stages[1].{field}'" in said and message in said and "\n" not in said
    with pytest.raises(WorkflowFileError, match="too_long needs a count stage before this one"):
        build_workflow(workflow(tmp_path, "{role: writer, prompt: generator/answer}"))
    clash = "{tool: length, call: 'a:b'}\n  - {count: length}"
    with pytest.raises(WorkflowFileError, match="length names a tool stage before this one"):
        build_workflow(workflow(tmp_path, clash))


def test_without_the_kind_its_key_and_condition_are_unknown(own_registry, tmp_path):
    with pytest.raises(
        WorkflowFileError, match=r"stages\[1\].count': unknown field; valid: .*tool"
    ):
        build_workflow(workflow(tmp_path, "{count: length}", when="always"))
    with pytest.raises(WorkflowFileError, match="unknown condition 'too_long'; valid: always"):
        build_workflow(workflow(tmp_path, "{role: writer, prompt: generator/answer}"))


def test_the_reference_page_lists_each_registered_kind(count_kind):
    from marlow.docpages import workflow_file_page

    page = workflow_file_page()
    assert "## A tool stage (`tool:` entries of `stages:`) {#tool-stage}" in page
    assert "## A count stage (`count:` entries of `stages:`) {#count-stage}" in page
    assert "`too_long`: over most words" in page


def test_a_kind_is_refused_a_reserved_name_a_shared_field_or_no_name_field(own_registry):
    def run(stage, active, ctx):
        return None

    from pydantic import create_model

    judge = create_model("Judge", judge=(str, ...))
    with pytest.raises(ValueError, match="'judge' must be a word and not one of"):
        register_stage_kind(StageKind("judge", judge, run))
    probe = create_model("Probe", probe=(str, ...), when=(str, "x"))
    with pytest.raises(ValueError, match="field when is every stage's own"):
        register_stage_kind(StageKind("probe", probe, run))
    with pytest.raises(ValueError, match="need a field 'probe', the stage's name"):
        StageKind("probe", ToolStage, run)
    assert stage_kinds.stage_kind_names() == ["tool"]  # nothing refused was registered
    with pytest.raises(ValueError, match="stage kind 'tool' is already registered"):
        register_stage_kind(StageKind("tool", ToolStage, run))
