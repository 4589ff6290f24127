"""Tool stages: a workflow stage that calls a function, read by later stages like a role's output;
a tool that raises, hangs or returns nonsense costs one counted call, never the run."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from marlow.config import ConfigError, resolve
from marlow.diagnostics.metrics import Meter, tool_metrics
from marlow.policy.routing import make_routing
from marlow.types import Problem, SamplingParams
from marlow.workflows.engine import run_episodes
from marlow.workflows.load import build_workflow
from marlow.workflows.schema import WorkflowFileError
from marlow.workflows.show import _Placeholders, _Plain, describe
from marlow.workflows.spec import EpisodeRules
from marlow.workflows.validate import check_run_config

HERE = "tests.unit.test_tool_stages"
PROBLEM = Problem("p1", "What is 2 + 2?", "4", {"columns": {"level": "easy"}})
SEEN: list[dict] = []


def echo(reads, problem, episode):
    SEEN.append({"reads": reads, "problem": problem, "episode": episode})
    return f"checked {reads['draft']} for {problem.id}"


def failing_report(reads, problem, episode):
    return {"text": "2 of 2 tests failed", "ok": False, "passed": 0}


def passing_report(reads, problem, episode):
    return {"text": "all passed", "ok": True}


def boom(reads, problem, episode):
    raise ValueError("boom\nsecond line")


def sleepy(reads, problem, episode):
    time.sleep(5)
    return "late"


def number(reads, problem, episode):
    return 42


def surrogate(reads, problem, episode):
    return "ok \ud800"  # a lone surrogate: no tokenizer reads it in the next stage's prompt


def surrogate_mapping(reads, problem, episode):
    return {"text": "ok \udc80", "passed": True}


class Opaque:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def odd_report(reads, problem, episode):
    import numpy as np

    return {
        "text": "x" * 300_000,
        "ok": np.bool_(False),
        "score": np.float32(0.5),
        "counts": np.int64(3),
        "nested": {"deep": [np.bool_(True), Opaque(), "y" * 50_000]},
    }


class Trap(dict):  # a mapping whose reading raises: the user's object, read under the guard
    def get(self, key, default=None):
        raise RuntimeError("trap")


def trapped(reads, problem, episode):
    return Trap(text="t")


async def later(reads, problem, episode):
    await asyncio.sleep(0)
    return "awaited"


def workflow_file(tmp_path: Path, call: str, when: str = "always") -> str:
    """A workflow: writer, the tool ``call`` reading its draft, a fixer reading both (when
    ``when``), a judge; the answer is the latest answer role's."""
    path = tmp_path / "wf.yaml"
    path.write_text(
        f"""roles:
  writer: {{kind: answer}}
  fixer: {{kind: answer, prompts: {{fix: 'Fix {{answer}} given {{feedback}}'}}}}
  judge: {{kind: judge}}
stages:
  - {{role: writer, prompt: generator/answer}}
  - {{tool: check, call: "{HERE}:{call}", reads: {{draft: last.writer}}}}
  - role: fixer
    prompt: fix
    when: {when}
    reads: {{answer: last.writer, feedback: last.check}}
  - {{role: judge, prompt: evaluator/review, reads: {{answer: last.fixer}}, parser: verdict}}
answer: latest
"""
    )
    return str(path)


def episodes(path: str, n: int = 2, timeout: float = 30.0):
    wf = build_workflow(path)
    rules = EpisodeRules(tool_timeout_s=timeout)
    return wf, run_episodes(
        wf,
        [PROBLEM],
        n,
        engine=_Placeholders(),
        tokenizer=_Plain(),
        routing=make_routing("ip", wf.roles, None),
        grade=lambda text, problem: 0.0,
        task="math",
        style="tiny",
        sampling=SamplingParams(0.7, 8, 0),
        rules=rules,
    )


def test_the_tool_gets_its_reads_the_problem_and_the_episode_and_the_next_role_reads_it(
    tmp_path,
):
    SEEN.clear()
    wf, eps = episodes(workflow_file(tmp_path, "echo"))
    assert wf.roles == ["writer", "fixer", "judge"] and wf.tools == {"check": f"{HERE}:echo"}
    ep = eps[0]
    call = ep.tools[0]
    assert call.status == "ok" and call.inputs == {"draft": "<writer output 1>"}
    assert call.completion_text == "checked <writer output 1> for p1"
    fixer = next(t for t in ep.turns if t.role == "fixer")
    assert fixer.prompt_text == "Fix <writer output 1> given checked <writer output 1> for p1"
    assert SEEN[0]["problem"].meta["columns"] == {"level": "easy"}
    assert [t["role"] for t in SEEN[0]["episode"]] == ["writer"]  # the episode so far
    # the tool is no role: no adapter, no turn, nothing to train; the transcript keeps its place
    assert all(t.role != "check" for t in ep.turns)
    assert [r.get("role", r.get("tool")) for r in ep.transcript()] == [
        "writer",
        "check",
        "fixer",
        "judge",
    ]
    assert ep.final_answer == fixer.completion_text  # answer: latest (an answer role's)


@pytest.mark.parametrize(
    ("call", "status", "text"),
    [
        ("boom", "error", "tool check failed: ValueError: boom"),
        ("number", "error", "tool check returned a int, not text"),
        ("trapped", "error", "tool check failed: RuntimeError: trap"),
        ("later", "ok", "awaited"),
        ("surrogate", "error", "tool check returned text that holds a lone surrogate"),
        ("surrogate_mapping", "error", "tool check returned text that holds a lone surrogate"),
    ],
)
def test_a_raising_or_wrong_tool_is_one_counted_call_and_async_works(tmp_path, call, status, text):
    _, eps = episodes(workflow_file(tmp_path, call))
    for ep in eps:
        (done,) = ep.tools
        assert done.status == status and done.completion_text.startswith(text)
        assert ep.counters.get(f"tool_{status}", 0) == (status != "ok")
        assert len(ep.turns) == 3  # the episode went on: fixer and judge spoke


def test_a_hanging_tool_times_out_without_holding_the_run(tmp_path):
    start = time.perf_counter()
    _, eps = episodes(workflow_file(tmp_path, "sleepy"), n=3, timeout=0.3)
    assert time.perf_counter() - start < 3.0  # three calls at once, each cut at 0.3 s
    for ep in eps:
        assert ep.tools[0].status == "timeout"
        assert ep.tools[0].completion_text == "tool check timed out after 0.3 s"
        assert ep.counters["tool_timeout"] == 1


def test_tool_conditions_and_structured_fields(tmp_path):
    _, failed = episodes(workflow_file(tmp_path, "failing_report", when="tool_failed"))
    assert failed[0].tools[0].fields == {"ok": False, "passed": 0}
    assert [t.role for t in failed[0].turns] == ["writer", "fixer", "judge"]
    _, passed = episodes(workflow_file(tmp_path, "passing_report", when="tool_failed"))
    assert [t.role for t in passed[0].turns] == ["writer", "judge"]  # no fix needed
    assert passed[0].final_answer == "<writer output 1>"


def test_odd_returned_fields_are_plain_json_and_a_huge_text_is_cut(tmp_path):
    import json

    from marlow.workflows.tools import MAX_FIELD, MAX_TEXT

    _, eps = episodes(workflow_file(tmp_path, "odd_report", when="tool_failed"))
    call = eps[0].tools[0]
    assert call.status == "ok" and call.ok is False  # numpy's False read as False
    assert [t.role for t in eps[0].turns] == ["writer", "fixer", "judge"]
    assert call.completion_text.endswith("[cut: 200000 more characters]")
    assert len(call.completion_text) < MAX_TEXT + 100
    fields = json.loads(json.dumps(call.record()))["fields"]  # what samples.jsonl writes
    assert fields["ok"] is False and fields["score"] == 0.5 and fields["counts"] == 3
    deep = fields["nested"]["deep"]
    assert deep[0] is True and "repr failed: RuntimeError: no repr" in deep[1]
    assert len(deep[2]) < MAX_FIELD + 100


def test_tool_metrics_count_calls_failures_time_and_revisions(tmp_path):
    _, eps = episodes(workflow_file(tmp_path, "failing_report"), n=4)
    meter = Meter()
    tool_metrics(meter, eps)
    got = meter.result("train")
    assert got["train/check/calls"] == 1.0 and got["train/check/errors"] == 0.0
    assert got["train/check/ok_rate"] == 0.0 and got["train/check/seconds"] >= 0.0
    walls = {c.stage_s for ep in eps for c in ep.tools}
    assert len(walls) == 1 and got["train/check/wall_s"] == walls.pop()  # one stage, once
    assert got["train/check/revision_rate"] == 1.0  # the fixer's text is not the draft
    for ep in eps:  # a fixer that copies the draft did not revise
        fixer = next(t for t in ep.turns if t.role == "fixer")
        fixer.completion_text = ep.tools[0].inputs["draft"]
    meter = Meter()
    tool_metrics(meter, eps)
    assert meter.result("train")["train/check/revision_rate"] == 0.0


BAD = [
    ("{tool: check, role: writer, call: 'a:b'}", "a tool stage takes no role"),
    ("{tool: check}", "a tool stage needs both tool and call"),
    ("{tool: writer, call: 'a:b'}", "tool name 'writer' must be a word and not a role's name"),
    ("{tool: check, call: 'nocolon'}", "valid: package.module:function"),
    ("{tool: check, call: 'a:b', reads: {x: last.later}}", "reads unknown role 'later'"),
    ("{tool: check, call: 'a:b', reads: {x: plan.writer}}", "plan.writer reads a plan"),
]


@pytest.mark.parametrize(("stage", "message"), BAD)
def test_a_bad_tool_stage_is_one_line_naming_the_field(tmp_path, stage, message):
    path = tmp_path / "bad.yaml"
    path.write_text(
        f"""roles:
  writer: {{kind: answer}}
stages:
  - {{role: writer, prompt: generator/answer}}
  - {stage}
answer: last.writer
"""
    )
    with pytest.raises(WorkflowFileError) as info:
        build_workflow(str(path))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert "stages[1]" in str(info.value)


def test_a_forward_read_of_a_tool_and_a_tool_condition_without_a_tool_are_refused(tmp_path):
    path = tmp_path / "fwd.yaml"
    path.write_text(
        """roles:
  writer: {kind: answer}
stages:
  - {role: writer, prompt: generator/answer, when: tool_failed}
  - {tool: check, call: "a:b", reads: {x: last.writer}}
answer: last.writer
"""
    )
    with pytest.raises(WorkflowFileError, match="tool_failed needs a tool stage before"):
        build_workflow(str(path))
    path.write_text(
        """roles:
  writer: {kind: answer, prompts: {mine: '{x}'}}
stages:
  - {role: writer, prompt: mine, reads: {x: last.check}}
  - {tool: check, call: "a:b", reads: {x: last.writer}}
answer: last.writer
"""
    )
    with pytest.raises(WorkflowFileError, match="reads unknown role 'check'"):
        build_workflow(str(path))


def test_an_import_path_that_does_not_resolve_is_refused_before_a_run(tmp_path):
    path = workflow_file(tmp_path, "no_such_function")
    build_workflow(path)  # the file itself is fine: a report elsewhere can still read the run
    cfg = resolve({"workflow": {"name": path}})
    with pytest.raises(ConfigError) as info:
        check_run_config(cfg)
    said = str(info.value)
    assert said.startswith("config field 'workflow.name': workflow wf: tool check's call")
    assert "has no 'no_such_function'" in said and "\n" not in said
    with pytest.raises(ConfigError, match="has no 'no_such_function'"):
        describe(build_workflow(path))


def test_workflows_check_shows_the_tool_stage_and_its_output(tmp_path):
    lines = describe(build_workflow(workflow_file(tmp_path, "echo")))
    assert any(line.strip().startswith("2. tool check x1; call") for line in lines)
    at = lines.index("--- tool check slot 0 round 0 (ok) output:")
    assert lines[at + 1].startswith("checked <writer output 1>")


def test_the_report_has_a_tools_table_only_for_cells_with_tool_stages():
    from marlow.report.results import CellId, CellRun, GridRuns
    from marlow.report.tables import tools_table

    def run(name, records):
        cid = CellId(name, "trained", "test_fix", "ip", "tiny-s", "code", 0)
        return CellRun(cid, Path(name), records, {}, {}, {"solver": 1, "fixer": 1})

    tool = [
        {
            "step": 1,
            "train/tests/calls": 1.0,
            "train/tests/errors": 0.0,
            "train/tests/ok_rate": 0.5,
        },
        {
            "step": 2,
            "train/tests/calls": 1.0,
            "train/tests/errors": 0.5,
            "train/tests/ok_rate": 1.0,
        },
    ]
    plain = [{"step": 1, "train/solver/entropy": 1.0}]
    res = GridRuns(Path("."), {}, [], {"a": run("a", tool), "b": run("b", plain)}, [])
    table = tools_table(res)
    (row,) = table.rows
    assert row["cell"] == "a" and row["tool"] == "tests"
    assert row["errors"] == 0.25 and row["ok_rate"] == 0.75 and row["revision_rate"] is None
    assert tools_table(GridRuns(Path("."), {}, [], {"b": run("b", plain)}, [])) is None
