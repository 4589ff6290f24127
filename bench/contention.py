"""Seconds per training step when a run shares the CPU: alone, two runs side by side, and one
run beside a process that keeps one core busy, under each thread setting named.

A run is ``marlow train examples/sums/config.yaml`` (the task page's command) for a few steps
with a small validation; a step's seconds are its ``time/rollout_s + time/learn_s`` from
``metrics.jsonl``, the first step left out (it warms caches). Run it on a quiet machine:

    python bench/contention.py --out bench/results/contention.json

A fair share on 2 cores is 2x the alone time for two runs side by side, and about 2x (one core
of two) beside a busy core; the ``slowdown`` of each scenario is its time over the alone time of
the same setting, and ``vs_default_alone`` compares every setting with marlow's default alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPIN = "while True: pass"

# name -> (extra environment, extra config settings)
SETTINGS: dict[str, tuple[dict[str, str], list[str]]] = {
    "default": ({}, []),  # marlow's: GOMP_SPINCOUNT=1000 (marlow/__init__.py)
    "libgomp_default": ({"GOMP_SPINCOUNT": "300000"}, []),  # libgomp's own, marlow's before
    "omp_passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "omp_active": ({"OMP_WAIT_POLICY": "ACTIVE"}, []),
    "threads_1": ({}, ["threads=1"]),
    "spin_10k": ({"GOMP_SPINCOUNT": "10000"}, []),
}


def _train(out: Path, env: dict[str, str], settings: list[str], steps: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "marlow", "train", "examples/sums/config.yaml",
        f"steps={steps}", "val_every=1000", "task.val_size=8", *settings, "--out", str(out),
    ]  # fmt: skip
    inherited = {
        k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
    }
    return subprocess.Popen(
        command, cwd=ROOT, env={**inherited, **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _step_seconds(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [
        row["time/rollout_s"] + row["time/learn_s"]
        for row in rows
        if row["step"] > 1 and "time/learn_s" in row
    ]


def _scenario(kind: str, env: dict, settings: list[str], steps: int, scratch: Path) -> dict:
    runs = 2 if kind == "pair" else 1
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if kind == "busy_core" else None
    started = time.monotonic()
    try:
        outs = [scratch / f"{kind}-{i}" for i in range(runs)]
        procs = [_train(out, env, settings, steps) for out in outs]
        for proc in procs:
            _, err = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"a run failed: {err.strip().splitlines()[-1:]}")
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    per_run = [_step_seconds(out) for out in outs]
    every = [s for run in per_run for s in run]
    return {
        "step_s": round(sum(every) / len(every), 3),
        "step_s_per_run": [round(sum(r) / len(r), 3) for r in per_run],
        "wall_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--scenarios", nargs="+", default=["alone", "pair", "busy_core"],
                    choices=["alone", "pair", "busy_core"])  # fmt: skip
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results: dict = {
        "cores": len(os.sched_getaffinity(0)),
        "load_before": os.getloadavg(),
        "steps": args.steps,
        "settings": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.settings:
            env, extra = SETTINGS[name]
            row = {"env": env, "config": extra}
            for kind in args.scenarios:
                row[kind] = _scenario(kind, env, extra, args.steps, Path(tmp) / name)
                print(name, kind, row[kind], flush=True)
            results["settings"][name] = row
    base = results["settings"].get("default", {}).get("alone", {}).get("step_s")
    for row in results["settings"].values():
        alone = row.get("alone", {}).get("step_s")
        for kind in ("pair", "busy_core"):
            if alone and kind in row:
                row[kind]["slowdown"] = round(row[kind]["step_s"] / alone, 2)
        if base and alone:
            row["vs_default_alone"] = round(alone / base, 2)
    results["load_after"] = os.getloadavg()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
