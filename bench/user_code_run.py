"""A run beside users' functions that hang, against the same run with well-behaved ones, one
after the other in one process tree: a solver-tool-fixer
workflow on the example sums task (``examples/sums``), 10 steps, validation at steps 0 and 10 on
24 problems, ``task.reward_timeout_s`` and ``workflow.tool_timeout_s`` of 1 s:

- **well-behaved**: the example's reward; a tool that answers at once;
- **hanging, blocked**: the reward hangs on one call in five and the tool on every call, each in
  a sleep (blocked in C: what a network call that never answers does);
- **hanging, spinning**: the same calls hang in a busy Python loop.

    .venv/bin/python bench/user_code_run.py [--steps 10]

Prints each run's wall seconds (the ``marlow train`` process, the tiny world already cached) and
their ratio to the well-behaved run's, and the reward and tool counters of the last step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FUNCTIONS = """
import itertools, time

from sums_task.reward import exact_answer

calls = itertools.count()


def hang(kind):
    if kind == "blocked":
        time.sleep(3600)
    while True:
        pass


def reward_ok(prompts, completions, answer, **kw):
    return exact_answer(prompts, completions, answer)


def reward_blocked(prompts, completions, answer, **kw):
    if next(calls) % 5 == 4:
        hang("blocked")
    return exact_answer(prompts, completions, answer)


def reward_spinning(prompts, completions, answer, **kw):
    if next(calls) % 5 == 4:
        hang("spinning")
    return exact_answer(prompts, completions, answer)


def tool_ok(reads, problem, episode):
    return {"text": "looks fine", "ok": True}


def tool_blocked(reads, problem, episode):
    hang("blocked")


def tool_spinning(reads, problem, episode):
    hang("spinning")
"""

WORKFLOW = """roles:
  solver: {kind: answer}
  fixer: {kind: answer}
stages:
  - {role: solver, prompt: generator/answer}
  - {tool: check, call: "user_fns.py:tool_KIND", reads: {program: last.solver}}
  - {role: fixer, prompt: generator/revise, reads: {answer: last.solver, critique: last.check}}
answer: latest
"""


def run(folder: Path, kind: str, steps: int) -> tuple[float, dict]:
    (folder / f"wf_{kind}.yaml").write_text(WORKFLOW.replace("KIND", kind))
    out = folder / f"run_{kind}"
    command = [
        sys.executable, "-m", "marlow", "train", "--out", str(out),
        "preset=quickstart", f"steps={steps}", f"val_every={steps}", f"ckpt_every={steps}",
        f"task.source={ROOT / 'examples/sums/sums_task/sums.jsonl'}",
        "task.prompt_field=question", "task.answer_field=answer",
        f"task.reward=user_fns.py:reward_{kind}", "task.val_size=24",
        "task.reward_timeout_s=1", "workflow.tool_timeout_s=1", "task.reward_max_missing=1",
        f"workflow.name=wf_{kind}.yaml", "policy.routing=ip",
    ]  # fmt: skip
    env_path = f"{ROOT / 'examples/sums'}"
    t0 = time.perf_counter()
    done = subprocess.run(
        command, cwd=folder, capture_output=True, text=True,
        env={**__import__("os").environ, "PYTHONPATH": env_path},
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{kind}: marlow train failed:\n{done.stderr[-3000:]}")
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    counts = {k: v for k, v in last.items() if "timeout" in k or "tool" in k and "count" in k}
    return seconds, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="marlow-hangs-") as tmp:
        folder = Path(tmp)
        (folder / "user_fns.py").write_text(FUNCTIONS)
        results = {kind: run(folder, kind, args.steps) for kind in ("ok", "blocked", "spinning")}
    base = results["ok"][0]
    for kind, (seconds, counts) in results.items():
        print(f"{kind:>9}: {seconds:6.1f} s ({seconds / base:.2f}x)  {counts}")


if __name__ == "__main__":
    main()
