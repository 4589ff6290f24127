"""Every bad workflow file is one line of error, exit code 2, no traceback.

Each row is a small change to a good file (Voting with its own tiny prompt), checked through
``marlow workflows check FILE`` (typer's CliRunner, in-process) and through ``marlow train
workflow.name=FILE`` (which refuses it in ``check_run_config``, before any model loads). The
needles are what the line must name: the field, the line where it can, the valid choices.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from marlow.cli import app

GOOD = """\
title: Good
params:
  n: {default: 2, min: 1}
roles:
  generator:
    kind: answer
    prompts: {say: {tiny: "Q: {problem}", chat: "Solve: {problem}"}}
  aggregator: {kind: select}
stages:
  - {role: generator, prompt: say, slots: n}
  - role: aggregator
    prompt: aggregator/select
    reads: {candidates: outputs.generator}
    parser: selection
answer: selected
"""

JUDGED = """\
roles:
  generator: {kind: answer}
  evaluator: {kind: judge}
stages:
  - {role: generator, prompt: generator/answer}
  - {role: evaluator, prompt: evaluator/review, reads: {answer: last.generator}, parser: verdict}
  - repeat: 2
    stages:
      - {role: generator, prompt: generator/revise, when: verdict_incorrect,
         reads: {answer: last.generator, critique: last.evaluator}}
answer: last.generator
"""


def swap(old: str, new: str, base: str = GOOD) -> str:
    assert old in base, old
    return base.replace(old, new, 1)


ROWS = {
    "not yaml": ("roles: [unclosed\n", "line 2", "not valid YAML"),
    "not a mapping": ("- a list\n", "must be a mapping"),
    "a prompt with a lone surrogate": (
        swap('chat: "Solve: {problem}"', 'chat: "Solve \\ud800: {problem}"'),
        "line 7",
        "field 'roles.generator.prompts.say.chat'",
        "lone surrogate",
    ),
    "a role named with a lone surrogate": (
        swap("aggregator: {kind: select}", '"a\\udc00": {kind: select}'),
        "not valid unicode",
    ),
    "unknown top field": (GOOD + "extra: 1\n", "line 16", "field 'extra'", "valid: name, title"),
    "no roles field": (swap("roles:", "rolez:"), "field 'rolez'", "unknown field"),
    "no answer": (GOOD.replace("answer: selected\n", ""), "field 'answer'", "required"),
    "stage holds its prompt's text": (
        swap("prompt: say,", 'prompt: "Say: {problem}",'),
        "field 'stages[0].prompt'",
        "roles.generator.prompts",
    ),
    "unknown kind": (
        swap("kind: select", "kind: critic"),
        "line 8",
        "field 'roles.aggregator.kind'",
        "unknown kind 'critic'; valid: answer, judge, select, plan, final",
    ),
    "kind not a string": (swap("kind: select", "kind: [select]"), "roles.aggregator.kind"),
    "unknown role field": (
        swap("{kind: select}", "{kind: select, weight: 2}"),
        "roles.aggregator.weight",
        "valid: kind, prompts",
    ),
    "unknown style": (
        swap('tiny: "Q: {problem}"', 'tinny: "Q: {problem}"'),
        "roles.generator.prompts.say.tinny",
        "valid: chat, tiny",
    ),
    "prompt name with a slash": (
        swap("prompts: {say:", "prompts: {a/b:"),
        "roles.generator.prompts.a/b",
        "must be a word",
    ),
    "unknown role in a stage": (
        swap("- role: aggregator", "- role: judge"),
        "line 11",
        "stages[1].role",
        "unknown role 'judge'; valid: generator, aggregator",
    ),
    "stage without a prompt": (
        swap("{role: generator, prompt: say, slots: n}", "{role: generator, slots: n}"),
        "stages[0].prompt",
        "required",
    ),
    "unknown own prompt": (
        swap("prompt: say", "prompt: shout"),
        "stages[0].prompt",
        "role generator has no prompt 'shout'; valid: say",
    ),
    "unknown library prompt": (
        swap("prompt: aggregator/select", "prompt: aggregator/pick"),
        "stages[1].prompt",
        "unknown library prompt 'aggregator/pick'; valid: aggregator/select",
    ),
    "zero slots": (swap("slots: n", "slots: 0"), "stages[0].slots", "must be >= 1, got 0"),
    "slots of an unknown parameter": (
        swap("slots: n", "slots: k"),
        "stages[0].slots",
        "unknown parameter 'k'; valid: a number or n",
    ),
    "unknown parser": (
        swap("parser: selection", "parser: majority"),
        "line 14",
        "stages[1].parser",
        "unknown parser 'majority'; valid: verdict, selection, strategies",
    ),
    "parser of another kind": (
        swap("parser: selection", "parser: verdict"),
        "stages[1].parser",
        "a stage of a select role takes parser: selection",
    ),
    "select role without its parser": (
        swap("    parser: selection\n", ""),
        "stages[1].parser",
        "takes parser: selection",
    ),
    "unknown condition": (
        swap("slots: n}", "slots: n, when: sometimes}"),
        "stages[0].when",
        "unknown condition 'sometimes'; valid: always, verdict_incorrect, verdict_correct",
    ),
    "unknown trajectory naming": (
        swap("slots: n}", "slots: n, trajectory: vote}"),
        "stages[0].trajectory",
        "unknown trajectory 'vote'; valid: role, slot",
    ),
    "verdict condition with no judge": (
        swap("slots: n}", "slots: n, when: verdict_incorrect}"),
        "stages[0].when",
        "needs a judge role's stage before",
    ),
    "read of a role with no stage yet": (
        swap("reads: {candidates: outputs.generator}", "reads: {candidates: outputs.aggregator}"),
        "line 13",
        "stages[1].reads.candidates",
        "reads role aggregator, which has no stage before this one (a forward read or a cycle)",
    ),
    "cycle: a first stage reading the second": (
        swap(
            "{role: generator, prompt: say, slots: n}",
            "{role: generator, prompt: say, slots: n, reads: {x: last.aggregator}}",
        ),
        "stages[0].reads.x",
        "a forward read or a cycle",
    ),
    "read of an unknown role": (
        swap("outputs.generator", "outputs.critic"),
        "reads unknown role 'critic'; valid: generator, aggregator",
    ),
    "unknown read source": (
        swap("outputs.generator", "best.generator"),
        "stages[1].reads.candidates",
        "unknown source 'best.generator'; valid: last.ROLE, own.ROLE, outputs.ROLE",
    ),
    "selection with nothing to choose from": (
        swap("outputs.generator", "last.generator"),
        "stages[1].reads",
        "reads exactly one outputs.ROLE",
    ),
    "missing template field": (
        swap('"Q: {problem}"', '"Q: {problem} {hint}"'),
        "stages[0].prompt",
        "prompt say (tiny/*) uses field {hint}, which this stage does not read",
    ),
    "library template field not read": (
        swap("reads: {answer: last.generator}, parser: verdict}", "parser: verdict}", JUDGED),
        "line 6",
        "stages[1].prompt",
        "prompt evaluator/review (chat/code) uses field {answer}",
    ),
    "unknown answer": (
        swap("answer: selected", "answer: majority"),
        "field 'answer'",
        "unknown answer 'majority'; valid: selected, latest, last.generator, last.aggregator",
    ),
    "role with no stage": (
        swap(
            "  aggregator: {kind: select}", "  aggregator: {kind: select}\n  spare: {kind: answer}"
        ),
        "roles.spare",
        "role spare has no stage",
    ),
    "final role that does not answer": (
        swap(
            "  aggregator: {kind: select}", "  aggregator: {kind: select}\n  spare: {kind: final}"
        ),
        "roles.spare.kind",
        "a final role writes the answer",
    ),
    "parameter default below its min": (
        swap("{default: 2, min: 1}", "{default: 0, min: 1}"),
        "params.n.default",
        "0 is below min 1",
    ),
    "parameter not an integer": (
        swap("{default: 2, min: 1}", "{default: two, min: 1}"),
        "params.n.default",
        "integer",
    ),
    "unknown credit kind": (GOOD + "credit: {voter: own}\n", "credit.voter", "valid: answer"),
    "credit rule that does not fit the kind": (
        GOOD + "credit: {select: own}\n",
        "credit.select",
        "rule 'own' does not apply to kind select; valid for it: broadcast",
    ),
    "repeat of an unknown parameter": (
        swap("repeat: 2", "repeat: rounds", JUDGED),
        "stages[2].repeat",
        "unknown parameter 'rounds'",
    ),
    "repeat with a role": (
        swap("  - repeat: 2\n", "  - repeat: 2\n    role: generator\n", JUDGED),
        "stages[2].role",
        "a repeat block holds only repeat and stages",
    ),
    "skip_last outside a repeat": (
        swap("parser: verdict}", "parser: verdict, skip_last: true}", JUDGED),
        "stages[1].skip_last",
        "only a stage inside a repeat block",
    ),
    "judge with two slots": (
        swap("parser: verdict}", "parser: verdict, slots: 2}", JUDGED),
        "stages[1].slots",
        "a stage with parser verdict has 1 slot",
    ),
    "empty stages": (
        swap(JUDGED[JUDGED.index("stages:") :], "stages: []\nanswer: last.generator\n", JUDGED),
        "field 'stages'",
        "needs at least one stage",
    ),
}


@pytest.mark.parametrize("via", ["check", "train"])
@pytest.mark.parametrize("name", list(ROWS))
def test_a_bad_workflow_file_is_one_line(name, via, tmp_path, monkeypatch):
    text, *needles = ROWS[name]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.yaml").write_text(text)
    args = ["workflows", "check", "w.yaml"] if via == "check" else ["train", "workflow.name=w.yaml"]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "w.yaml" in lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.yaml"]  # nothing written


def test_the_table_has_at_least_25_rows_and_the_good_files_pass(tmp_path):
    assert len(ROWS) >= 25
    for text in (GOOD, JUDGED):
        (tmp_path / "w.yaml").write_text(text)
        result = CliRunner().invoke(app, ["workflows", "check", str(tmp_path / "w.yaml")])
        assert result.exit_code == 0, result.output
