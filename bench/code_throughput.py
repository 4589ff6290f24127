"""Code-reward throughput: sandboxed programs per second, HumanEval and suite mode.

    .venv/bin/python bench/code_throughput.py [--workers N] [--repeats R]

Each HumanEval problem is one sandboxed test (``prompt + canonical_solution`` through its
``check`` harness: the test runs here, each call in the sandbox). The suite lines grade 60 small
programs of 10 tests each, function calls and stdin/stdout, in suite mode (one sandbox process per
program, as the tiny code task does). Also times the sandbox alone on an empty program, which is
the fixed cost per run. Reads ``tests/data/HumanEval.jsonl.gz``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path

from marlow.rewards.code import score_code_batch
from marlow.rewards.sandbox import Job, isolation_in_force, run_many

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "HumanEval.jsonl.gz"


def _suites() -> dict[str, list[tuple[str, dict]]]:
    """60 programs x 10 tests of each suite form (all pass)."""
    call = {"fn_name": "f", "inputs": [[i, i + 1] for i in range(10)]}
    call["outputs"] = [2 * i + 1 for i in range(10)]
    stdin = {"inputs": [f"{i} {i + 1}\n" for i in range(10)]}
    stdin["outputs"] = [f"{2 * i + 1}\n" for i in range(10)]
    return {
        "call suite": [
            (f"```python\ndef f(a, b):\n    return a + b + {k} * 0\n```", call) for k in range(60)
        ],
        "stdin suite": [
            (f"```python\na, b = map(int, input().split())\nprint(a + b + {k} * 0)\n```", stdin)
            for k in range(60)
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with gzip.open(DATA, "rt") as f:
        rows = [json.loads(line) for line in f]
    items = [
        (
            f"```python\n{r['prompt']}{r['canonical_solution']}\n```",
            {"check": r["test"], "entry_point": r["entry_point"], "prompt": r["prompt"]},
        )
        for r in rows
    ]
    print(f"cores {os.cpu_count()}, workers {args.workers}; {isolation_in_force().line()}")
    for workers in sorted({1, args.workers}):
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            scores = score_code_batch(items, max_workers=workers)
            best = min(best, time.perf_counter() - t0)
        passed = sum(s.reward for s in scores)
        print(
            f"humaneval  workers {workers}: {len(items)} tests in {best:.2f} s = "
            f"{len(items) / best:.1f} tests/s (passed {passed:.0f}/{len(items)})"
        )
        for name, programs in _suites().items():
            t0 = time.perf_counter()
            scores = score_code_batch(programs, max_workers=workers, suite=True)
            dt = time.perf_counter() - t0
            passed = sum(s.reward for s in scores)
            print(
                f"{name} workers {workers}: {len(programs)} programs in {dt:.2f} s = "
                f"{len(programs) / dt:.1f} programs/s (passed {passed:.0f}/{len(programs)})"
            )
        n = 100
        t0 = time.perf_counter()
        run_many([Job("pass")] * n, max_workers=workers)
        dt = time.perf_counter() - t0
        print(f"empty prog workers {workers}: {n / dt:.1f} runs/s ({1000 * dt / n:.1f} ms each)")


if __name__ == "__main__":
    main()
