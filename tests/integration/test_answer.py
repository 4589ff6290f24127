"""Using a trained workflow: from Python (marlow.load_workflow), the CLI (marlow answer) and an
exported bundle; at temperature 0 the answers are exactly marlow eval's."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest

import marlow
from marlow.serving.trained import load_workflow
from marlow.tasks import build_task
from marlow.training.evaluate import evaluate
from marlow.training.export import export_run
from tests.conftest import in_process


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "marlow", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_at_temperature_0_the_answers_are_exactly_marlow_evals(trained_voting, tmp_path):
    record = evaluate(trained_voting, ["rollout.val_temperature=0"], out=tmp_path / "eval")
    stored = gzip.decompress(
        (tmp_path / "eval" / "val_answers" / f"step_{record['step']:06d}.jsonl.gz").read_bytes()
    )
    eval_finals = [json.loads(line)["final"] for line in stored.decode().splitlines()]
    cfg = marlow.make_config(str(trained_voting / "config.yaml"))
    problems = build_task(cfg.task).val_problems()
    with marlow.load_workflow(trained_voting, rollout={"val_temperature": 0}) as wf:
        answers = wf.answer([p.prompt for p in problems])
        one = wf.answer(problems[0].prompt, trace=True)
    assert [a.text for a in answers] == eval_finals and len(eval_finals) == 8
    assert one.text == eval_finals[0]
    assert [t["role"] for t in one.turns] == ["generator"] * 3 + ["aggregator"]
    assert {t["adapter"] for t in one.turns} == {"shared"}  # SP: one adapter for every role
    # the tiny tokenizer reads a character a token; the chat template adds a few to each turn
    assert one.prompt_tokens > sum(len(t["prompt"]) for t in one.turns)
    assert one.completion_tokens == sum(len(t["completion"]) for t in one.turns) + sum(
        t["finish"] == "stop" for t in one.turns
    )  # each stopped turn ends with its stop token
    assert one.finish in ("stop", "length")


def test_the_trained_adapters_are_the_ones_that_answer(trained_voting):
    from safetensors.torch import load_file

    from marlow.policy.adapters import adapter_parameters
    from marlow.training import checkpoint

    saved = load_file(
        checkpoint.latest(trained_voting) / "adapters" / "shared" / "adapter_model.safetensors"
    )
    with load_workflow(trained_voting) as wf:
        loaded = adapter_parameters(wf.agents.model, "shared")
    assert len(loaded) == len(saved) > 0
    b = [v for k, v in loaded.items() if "lora_B" in k]
    assert b and any(float(v.abs().max()) > 0 for v in b)  # trained: LoRA B is no longer zero
    for key, value in saved.items():
        name = next(
            k
            for k in loaded
            if k.endswith(key.split(".", 2)[-1].replace(".weight", ".shared.weight"))
        )
        assert (loaded[name].detach() == value).all(), name
    with load_workflow(trained_voting, ["policy.routing=base"]) as wf:
        assert wf.agents.adapters == [] and wf.agents.model is wf.agents.base


def test_marlow_answer_prints_the_final_answer_and_the_turns_with_trace(trained_voting):
    with load_workflow(trained_voting, ["rollout.val_temperature=0"]) as wf:
        want = wf.answer("59+19").text
    done = cli("answer", str(trained_voting), "59+19", "rollout.val_temperature=0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == want.strip()
    traced = cli("answer", str(trained_voting), "59+19", "--trace", "--temperature", "0")
    assert traced.returncode == 0, traced.stderr
    assert traced.stdout.count("--- generator (slot") == 3
    assert "--- aggregator (slot 0, adapter shared)" in traced.stdout
    assert traced.stdout.rstrip().endswith(want.strip())


def test_marlow_answer_answers_a_file_in_batches_and_never_overwrites(trained_voting, tmp_path):
    source = tmp_path / "in.jsonl"
    rows = [{"prompt": q, "id": i} for i, q in enumerate(["1+2", "30-4", "7*8", "12+12", "9*9"])]
    odd = [json.dumps({"prompt": ["1+2"]}), '{"prompt": "1+\\ud800"}', json.dumps({"prompt": 12})]
    lines = [json.dumps(r) for r in rows] + ["not json", json.dumps({"other": 1}), *odd]
    source.write_bytes(b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode())  # a BOM first
    out = tmp_path / "out.jsonl"
    done = cli(
        "answer", str(trained_voting), "--input", str(source), "--out", str(out), "--batch", "2",
        "--temperature", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = "read 10, answered 6, skipped bad_json=1, missing_field:prompt=1, not_text:prompt=2"
    assert said in done.stdout  # a list, a lone surrogate; the number 12 is read as "12"
    assert "answered 2/6" in done.stderr and "answered 6/6" in done.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: r.get(k) for k in ("prompt", "id")} for r in written] == [
        *rows,
        {"prompt": 12, "id": None},
    ]
    with load_workflow(trained_voting) as wf:
        questions = [*(r["prompt"] for r in rows), "12"]
        want = [a.text for a in wf.answer(questions, temperature=0)]
    assert [r["answer"] for r in written] == want  # batches of 2 answer as one batch of 6
    again = cli("answer", str(trained_voting), "--input", str(source), "--out", str(out))
    assert again.returncode != 0 and "exists; pass --overwrite" in again.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == written


def test_an_input_file_that_is_not_utf8_is_one_line_and_a_line_separator_is_not_a_row_break(
    trained_voting, tmp_path
):
    binary = tmp_path / "in.bin"
    binary.write_bytes(b'{"prompt": "1+2"}\n\xa6\xff\n')
    result = in_process(
        ["answer", trained_voting, "--input", binary, "--out", tmp_path / "o.jsonl"], tmp_path
    )
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [
        f"error: --input {binary}: not UTF-8 text (byte 0xa6 at offset 18); give a JSON-lines file"
    ]
    assert not (tmp_path / "o.jsonl").exists()
    # U+2028 inside a JSON string, written raw: one row, not two halves of bad JSON
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "1+2", "note": "a\u2028b"}, ensure_ascii=False))
    done = cli("answer", str(trained_voting), "--input", str(source), "--out", str(tmp_path / "o"))
    assert "read 1, answered 1, skipped none" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], 'give one "QUESTION"'),
        (["a", "b"], 'give one "QUESTION"'),
        (["--out", "x.jsonl"], "give --input FILE"),
        (["rollout.temperature=-1", "1+1"], "rollout.temperature"),
    ],
)
def test_marlow_answer_refuses_bad_arguments_in_one_line(trained_voting, args, message):
    result = in_process(["answer", trained_voting, *args], trained_voting.parent)
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output


def test_an_exported_bundle_answers_from_anywhere_like_its_run(trained_voting, tmp_path):
    bundle = export_run(trained_voting, tmp_path / "bundle")
    record = json.loads((bundle / "export.json").read_text())
    assert record["workflow"] == "voting" and record["style"] == "tiny"
    assert record["routing"] == {"generator": "shared", "aggregator": "shared"}
    assert (bundle / "workflow.yaml").is_file() and (bundle / "base" / "config.json").is_file()
    moved = shutil.move(str(bundle), str(tmp_path / "elsewhere" / "b"))
    questions = ["1+1", "23*4", "90-45"]
    with load_workflow(trained_voting) as wf:
        want = [a.text for a in wf.answer(questions, temperature=0)]
    with load_workflow(moved) as wf:
        assert wf.name == "voting"
        assert [a.text for a in wf.answer(questions, temperature=0)] == want
    (tmp_path / "cwd").mkdir()
    done = cli("answer", str(moved), "23*4", "--temperature", "0", cwd=tmp_path / "cwd")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == want[1].strip()


def test_a_grid_cell_folder_is_a_run_folder_for_answer_and_eval(trained_voting, tmp_path):
    """A grid's cell writes a DONE of its own beside config.yaml (the quickstart's cells too):
    still a run folder, not a checkpoint."""
    cell = shutil.copytree(trained_voting, tmp_path / "cells" / "Voting-SP-tiny-s-Math")
    (cell / "DONE").write_text('{"seconds": 1.0}')
    with load_workflow(cell) as wf:
        assert wf.source.label.startswith("checkpoint ") and wf.source.step == 2
        assert wf.answer("1+1", temperature=0).text
    record = evaluate(cell, ["rollout.val_temperature=0"], out=tmp_path / "eval")
    assert record["step"] == 2


TOOL_WORKFLOW = """roles:
  solver: {kind: answer}
  fixer: {kind: answer}
stages:
  - {role: solver, prompt: generator/answer}
  - {tool: check, call: "checks/judge.py:check", reads: {program: last.solver}}
  - {role: fixer, prompt: generator/revise, reads: {answer: last.solver, critique: last.check}}
answer: latest
"""


def test_a_bundle_carries_the_tool_files_its_workflow_calls_by_path(
    tiny_cache, tmp_path, monkeypatch
):
    """A workflow whose tool is a file by path (relative to the run's working folder): the bundle
    holds the file as a module of its own and answers, calling it, from another folder after the
    original file is gone."""
    from marlow.training.trainer import Trainer
    from tests.conftest import shrunk_config

    work = tmp_path / "work"
    (work / "checks").mkdir(parents=True)
    (work / "checks" / "judge.py").write_text(
        "def check(reads, problem, episode):\n"
        "    return {'text': 'judged ' + str(len(reads['program'])), 'ok': False}\n"
    )
    (work / "wf.yaml").write_text(TOOL_WORKFLOW)
    monkeypatch.chdir(work)
    cfg = shrunk_config(workflow={"name": "wf.yaml"}, policy={"routing": "ip"}, steps=1)
    Trainer(cfg, work / "run").run()
    bundle = export_run(work / "run", tmp_path / "bundle")
    (module,) = (bundle / "tools").iterdir()
    assert module.name.startswith("marlow_tool_") and module.suffix == ".py"
    assert "checks/judge.py" not in (bundle / "workflow.yaml").read_text()
    moved = shutil.move(str(bundle), str(tmp_path / "elsewhere" / "b"))
    shutil.rmtree(work / "checks")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    with load_workflow(moved) as wf:
        answer = wf.answer("1+1", trace=True, temperature=0)
    (call,) = [t for t in answer.turns if t.get("tool") == "check"]
    assert call["status"] == "ok" and call["output"].startswith("judged ")


def test_a_question_the_tiny_model_cannot_read_is_refused_or_skipped(trained_voting, tmp_path):
    with load_workflow(trained_voting) as wf:
        with pytest.raises(ValueError, match="cannot read: 'é'"):
            wf.answer("12+13+é")
        # a lone surrogate (JSON's escape, or argv bytes that are not UTF-8), which a real
        # model's tokenizer raises on from deep inside, is refused before any model sees it
        with pytest.raises(ValueError, match=r"valid unicode .no lone surrogate.*1\+.udcff"):
            wf.answer(["1+1", "1+\udcff"])
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"question": "1+1"}\n{"question": "2+é"}\n')
    done = cli(
        "answer", str(trained_voting), "--input", str(rows), "--out", str(tmp_path / "out.jsonl"),
        "--field", "question",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "answered 1, skipped outside_vocabulary=1" in done.stdout
