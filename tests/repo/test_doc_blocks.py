"""The code blocks of README.md and docs/**/*.md that a user would run, run.

Every fenced block is collected with its page and line:

* **Python** blocks run as written, in this process, from a scratch folder; a block that is an
  excerpt of a file (:data:`EXCERPTS`) is checked against that file instead, and a block that
  cannot run here is listed in :data:`PYTHON_NOT_RUN` with the reason.
* **Shell** blocks are split into commands. The cheap ``marlow`` commands (help, listings,
  checks, plans, dry runs, and inspecting, evaluating, exporting and answering with a small
  trained run) run through the CLI in this process; every other command must match a rule of
  :data:`NOT_RUN`, which says why it is not run here (training, installs, servers, benchmarks).
  A block none of whose commands runs is skipped with those reasons (``pytest -rs`` lists them).
* **YAML** blocks that are whole run configs (a ``preset`` key) are loaded, and whole grid files
  (a ``workflows`` key) are listed with ``marlow grid --dry-run``.

Where a block names a run folder (the quickstart's Voting-SP cell, ``runs/a``, ``RUN``, ...), a
copy of the ``trained_voting`` fixture stands in for it: a Voting-SP run of 2 steps on the
quickstart's tiny world.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from marlow.cli import app
from marlow.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
SHELL = ("bash", "sh", "shell", "console")

# Run folders the docs name; each is a copy of the trained_voting fixture in the scratch folder.
RUNS = (
    "marlow-quickstart/cells/Voting-SP-tiny-s-Math",
    "runs/a",
    "runs/first",
    "runs/first-sp",
    "runs/sums-ip",
    "runs/v-ip",
    "RUN",
)

# Commands not run here, by their first words, and why. The first rule that matches wins.
NOT_RUN: dict[str, str] = {
    **{
        command: "a command of the real-model page: tests/e2e/test_real_model_page.py runs the "
        "page in order, on a random Qwen3 in a local folder"
        for command in (
            "marlow plan my-qwen.yaml",
            "marlow task check my-qwen.yaml",
            "marlow train my-qwen.yaml",
            "marlow inspect runs/qwen-ip",
            "marlow answer runs/qwen-ip",
            "marlow serve runs/qwen-ip",
        )
    },
    "marlow eval runs/a/checkpoints/step_000016": "names step 16; the stand-in run has 2 steps",
    "marlow eval workflow.name=voting": "evaluates the base model on 500 problems",
    "marlow train": "trains a model: a minute or more (the e2e and integration tests train "
    "shrunk runs)",
    "marlow quickstart": "trains three cells and evaluates two (its time: "
    "docs/benchmarks/quickstart.md)",
    "marlow grid": "trains every cell of a grid (a grid's --dry-run is run)",
    "marlow pretrain-tiny": "pre-trains a tiny world: minutes",
    "marlow serve": "a server that runs until stopped (tests/e2e/test_serve.py starts one)",
    "marlow report": "needs a finished grid (tests/e2e/test_grid_cli.py reports one)",
    "marlow rescore": "grades with a reward file of your own (my_rewards.py)",
    ".venv-vllm/bin/marlow": "trains on vLLM in .venv-vllm (make test-vllm tests the backend)",
    "torchrun": "trains on several processes (tests/integration/test_data_parallel.py runs it)",
    "make": "a Makefile target: installs an environment, then runs the quickstart, tests or the "
    "docs build (minutes)",
    "pip": "installs packages",
    ".venv/bin/pip": "installs packages",
    "git clone": "clones the repository (network)",
    "cd": "changes the calling shell's folder",
    "bench/gpu_wheels.sh": "downloads wheels from PyPI (network)",
    "bench/gpu_check.sh": "the GPU check: needs a CUDA GPU",
    "python3.11": "makes a virtual environment and installs TRL into it",
    "source": "changes the calling shell's environment",
    ".venv/bin/python": "a benchmark script: minutes",
    ".venv/bin/pytest": "runs the test suite",
    ".venv/bin/ruff": "formats the source in place",
    "/tmp/trlvenv/bin/python": "the TRL comparison: minutes, in TRL's own environment",
}

# Python blocks not run here, by (page, first line), and why.
PYTHON_NOT_RUN: dict[tuple[str, str], str] = {
    **{
        ("docs/concepts/extending.md", first): "registers into this process's registries, which "
        "other tests list: tests/integration/test_registries.py registers a loss and a backend "
        "and trains with them"
        for first in (
            "from marlow.algo.policy_loss import policy_loss, register_policy_loss",
            "from marlow.rollout import register_backend",
        )
    },
    ("docs/concepts/extending.md", "from types import SimpleNamespace"): "registers a stage "
    "kind, which the workflow reference lists: tests/unit/test_stage_kinds.py runs it as written "
    "in a registry of its own and runs a workflow with it",
    ("docs/how-to/python.md", "import marlow"): "trains 2 steps: tests/e2e/test_api.py runs it "
    "as written",
    ("docs/using.md", "from openai import OpenAI"): "talks to a running `marlow serve`: "
    "tests/e2e/test_serve.py drives one with this client",
}

# Python blocks that show part of a file: every line of the block (comments and spacing aside)
# is a line of the file, in the same order.
EXCERPTS: dict[tuple[str, str], str] = {
    ("docs/tasks.md", "def exact_answer(prompts, completions, answer, **kwargs):"): (
        "examples/sums/sums_task/reward.py"
    ),
    ("docs/tasks.md", "TASK = {"): "examples/sums/sums_task/__init__.py",
}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository's root
    line: int  # of the opening fence
    lang: str
    text: str

    @property
    def first(self) -> str:
        return self.text.strip().splitlines()[0].strip()

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def collect(*langs: str) -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) in langs and match.group(2).strip():
                line = text[: match.start()].count("\n") + 1
                rel = str(page.relative_to(ROOT))
                found.append(Block(rel, line, match.group(1), match.group(2)))
    return found


def commands(text: str) -> list[list[str]]:
    """A shell block's commands as words: continuation lines joined, comments dropped."""
    return [w for line in text.replace("\\\n", " ").splitlines() if (w := shlex.split(line, True))]


def why_not_run(words: list[str]) -> str | None:
    """The reason a command is not run here, or None when it is."""
    if words[:2] == ["marlow", "grid"] and "--dry-run" in words:
        return None
    for rule, reason in NOT_RUN.items():
        if words[: len(rule.split())] == rule.split():
            return reason
    if words[0] == "marlow":
        return None
    raise AssertionError(f"{shlex.join(words)}: neither run here nor listed in NOT_RUN")


@pytest.fixture
def scratch(tmp_path, monkeypatch, trained_voting) -> Path:
    """A folder that looks like the repository's root to the docs' commands: configs/ and
    examples/, a questions file, and stand-ins for the run folders the docs name (made on
    demand by :func:`stand_in`)."""
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "questions.jsonl").write_text('{"question": "12*7"}\n{"question": "59+19"}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    return tmp_path


def stand_in(text: str, trained: Path) -> None:
    """A copy of the trained run for every run folder the text names."""
    for run in RUNS:
        if re.search(rf"(?<![\w/.-]){re.escape(run)}(?![\w-])", text) and not Path(run).exists():
            shutil.copytree(trained, run, symlinks=True)


def marlow(words: list[str]) -> str:
    done = CliRunner().invoke(app, words[1:], env={"COLUMNS": "200"})
    assert done.exit_code == 0, f"{shlex.join(words)}: exit {done.exit_code}\n{done.output[-3000:]}"
    return done.output


# -- shell blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize("block", collect(*SHELL), ids=str)
def test_a_shell_blocks_cheap_commands_run(block, scratch, trained_voting):
    run, not_run = [], []
    for words in commands(block.text):
        reason = why_not_run(words)
        (not_run.append(f"{shlex.join(words)}: {reason}") if reason else run.append(words))
    if not run:
        pytest.skip("not run: " + "; ".join(not_run))
    stand_in(block.text, trained_voting)
    for words in run:
        marlow(words)


def test_the_answers_come_from_the_stand_in_run(scratch, trained_voting):
    """A command the docs show gives what they say it gives, on the stand-in run."""
    stand_in("RUN", trained_voting)
    args = ["--input", "questions.jsonl", "--out", "a.jsonl", "--field", "question"]
    out = marlow(["marlow", "answer", "RUN", *args])
    assert Path("a.jsonl").read_text().count('"answer"') == 2, out


# -- Python blocks ---------------------------------------------------------------------------


def normalised_lines(text: str) -> list[str]:
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines())
    return [" ".join(line.split()) for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize("block", collect("python"), ids=str)
def test_a_python_block_runs_or_is_its_files_text(block, scratch, trained_voting):
    key = (block.page, block.first)
    if key in PYTHON_NOT_RUN:
        pytest.skip(f"not run: {PYTHON_NOT_RUN[key]}")
    if key in EXCERPTS:
        shown = normalised_lines(block.text)
        source = normalised_lines((ROOT / EXCERPTS[key]).read_text())
        at = 0
        for line in shown:
            assert line in source[at:], f"{block}: not in {EXCERPTS[key]}: {line}"
            at = source.index(line, at) + 1
        return
    stand_in(block.text, trained_voting)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block.text, str(block), "exec"), {"__name__": "__main__"})  # noqa: S102


def test_every_listed_block_is_still_in_the_docs():
    firsts = {(b.page, b.first) for b in collect("python")}
    for key in (*PYTHON_NOT_RUN, *EXCERPTS):
        assert key in firsts, f"{key}: no such block any more; remove it from the list"


# -- YAML: whole configs and grid files ------------------------------------------------------


def whole_files() -> list[Block]:
    return [
        b
        for b in collect("yaml")
        if isinstance(data := yaml.safe_load(b.text), dict)
        and ({"preset", "workflows"} & data.keys())
    ]


@pytest.mark.parametrize("block", whole_files(), ids=str)
def test_a_config_or_grid_file_in_the_docs_is_valid(block, scratch):
    file = scratch / "shown.yaml"
    file.write_text(block.text)
    if "workflows" in yaml.safe_load(block.text):
        out = marlow(["marlow", "grid", str(file), "--dry-run"])
        assert re.search(r"\d+ cells: ", out), out
    else:
        load_config(file, [])


# -- the README's links (the docs' own are checked by mkdocs build --strict) ------------------


def test_every_relative_link_of_the_readme_names_a_file_of_the_repository():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links to no file"
    for link in local:
        assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"
