"""Benchmark: the quickstart from a cold cache, as a new user runs it (not a test).

    .venv/bin/python bench/quickstart_cold.py            # this CPU's own kernels
    .venv/bin/python bench/quickstart_cold.py --avx2     # torch and oneDNN held to AVX2
    .venv/bin/python bench/quickstart_cold.py --seed 1   # marlow quickstart --seed 1

Runs ``marlow quickstart`` in a child process with ``MARLOW_CACHE`` pointing at a fresh empty
folder (as on a fresh machine: the shipped world is loaded from the package, anything else is
made anew) and its output in a temporary folder, and reports (JSON on stdout): the wall time of the whole command, the quickstart's own
split (pre-training, cells), each cell's peak and final validation accuracy, the best trained
Voting cell's gain over the base through Voting (points, at its peak), the CPU capability the
child's torch dispatched to, the versions of the packages that set the numbers, and the load
average before and after. ``--avx2`` sets
:data:`marlow.tiny.pretrain.AVX2_ONLY` in the child (and its cells: ATen, oneDNN and MKL held
to AVX2): how a CPU without AVX-512 or native bf16 runs. The installation (``make install``) is not timed.

Wall times mean something only on an otherwise idle machine: read the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from marlow.tiny.pretrain import AVX2_ONLY

CAPABILITY = "import torch; print(torch.backends.cpu.get_cpu_capability())"
# The packages whose versions can change the quickstart's numbers (make install pins them all:
# constraints.txt).
PACKAGES = ("torch", "transformers", "tokenizers", "peft", "numpy", "math-verify")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--avx2", action="store_true", help="hold torch and oneDNN to AVX2")
    ap.add_argument("--seed", type=int, default=0, help="the quickstart's --seed")
    ap.add_argument("overrides", nargs="*", help="key=value settings passed to the quickstart")
    args = ap.parse_args()
    marlow = Path(sys.executable).with_name("marlow")
    with tempfile.TemporaryDirectory(prefix="marlow-qs-cold-") as tmp:
        env = {**os.environ, "MARLOW_CACHE": str(Path(tmp) / "cache")}
        if args.avx2:
            env.update(AVX2_ONLY)
        capability = subprocess.run(
            [sys.executable, "-c", CAPABILITY], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        out = Path(tmp) / "qs"
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        done = subprocess.run(
            [
                str(marlow),
                "quickstart",
                *args.overrides,
                "--seed",
                str(args.seed),
                "--out",
                str(out),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            sys.exit(f"quickstart failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        summary = json.loads((out / "summary.json").read_text())
        index = json.loads((out / "index.json").read_text())["cells"]
    gains = summary["voting_gain_over_base"]
    best = max(gains, key=lambda name: gains[name]["peak_minus_base"])
    result = {
        "seed": args.seed,
        "wall_s": round(wall, 1),
        "timings_s": {k: round(v, 1) for k, v in summary["timings_s"].items()},
        "cpu_capability": capability,
        "threads_available": len(os.sched_getaffinity(0)),
        "packages": {name: version(name) for name in PACKAGES},
        "load_avg_before_after": [load_before, os.getloadavg()],
        "cells": {
            name: {
                **{k: row[k] for k in ("peak_accuracy", "peak_step", "final_accuracy", "n_val")},
                "seconds": index.get(name, {}).get("seconds"),
            }
            for name, row in summary["cells"].items()
        },
        "voting_gain_over_base": gains,
        "best_trained_voting_cell": best,
        "best_gain_points": gains[best]["peak_minus_base"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
