"""Which per-role metrics a real tiny run logs, per role, for every workflow x {SP, IP}.

Trains each cell briefly (tiny preset, shortened), then prints one table per cell: every metric
the last training step and the last validation logged for every role, with its value, and the
metrics a role is missing. Run folders are kept (``--out``) for ``marlow inspect``.

    .venv/bin/python bench/metric_coverage.py [--steps 4] [--val-size 50] [--out /tmp/coverage]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from marlow.config import resolve
from marlow.diagnostics.sinks import read_metrics
from marlow.report.inspect import ROLE_METRICS, inspect_run
from marlow.training.trainer import Trainer

CELLS = [
    ("single", "ip"),
    ("eval_opt", "ip"),
    ("eval_opt", "sp"),
    ("voting", "ip"),
    ("voting", "sp"),
    ("orch_workers", "ip"),
    ("orch_workers", "sp"),
]
PER_ROLE = tuple(
    m for m in ROLE_METRICS if m not in ("own_reward", "grad_mass_share", "grad_norm_own")
)
SP_ONLY = ("grad_mass_share", "grad_norm_own")


def run_cell(
    workflow: str, routing: str, steps: int, val_size: int, out: Path, threads: int | None
) -> Path:
    cfg = resolve(
        {
            "preset": "tiny",
            "threads": threads,
            "steps": steps,
            "val_every": steps,
            "ckpt_every": steps,
            "workflow": {"name": workflow},
            "policy": {"routing": routing},
            "task": {"val_size": val_size},
        }
    )
    run_dir = out / f"{workflow}-{routing}"
    if not (run_dir / "metrics.jsonl").exists():
        Trainer(cfg, run_dir).run()
    return run_dir


def report(run_dir: Path) -> list[str]:
    records = read_metrics(run_dir)
    train = next(r for r in reversed(records) if "train/all/reward" in r)
    val = next(r for r in reversed(records) if "val/all/accuracy" in r)
    rep = inspect_run(run_dir)
    roles = [r for r in rep["roles"] if r != "all"]
    lines = [f"## {run_dir.name} (train step {train['step']}, validation step {val['step']})"]
    missing: list[str] = []
    for role in roles:
        wanted = PER_ROLE + (SP_ONLY if rep["routing"] == "sp" and len(roles) > 1 else ())
        have = {m: train.get(f"train/{role}/{m}") for m in wanted}
        missing += [f"{role}/{m}" for m, v in have.items() if v is None]
        lines.append(
            f"- {role}: " + ", ".join(f"{m} {v:.4g}" for m, v in have.items() if v is not None)
        )
    for adapter, vals in rep["adapters"].items():
        lines.append(f"- adapter {adapter}: " + ", ".join(f"{m} {v:.4g}" for m, v in vals.items()))
    extras = {
        k: v
        for k, v in {**train, **val}.items()
        if k.startswith(("train/all/", "val/all/", "time/")) and k.split("/")[-1] not in PER_ROLE
    }
    lines.append("- run: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(extras.items())))
    sigs = rep["signatures"]
    if sigs:
        for role, s in sigs["roles"].items():
            lines.append(
                f"- signatures {role} (step {sigs['step']}): "
                + ", ".join(f"{k} {v:.4g}" for k, v in s.items())
            )
    verdicts = ", ".join(
        f"{d['name']} {'FIRED' if d['fired'] else 'quiet'}" for d in rep["detectors"]
    )
    lines.append(f"- detectors: {verdicts}")
    lines.append(f"- missing: {', '.join(missing) if missing else 'none'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--val-size", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("/tmp/marlow-coverage"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run")
    parser.add_argument("--cells", nargs="*", help="workflow-routing names, e.g. voting-sp")
    args = parser.parse_args()
    for workflow, routing in CELLS:
        if args.cells and f"{workflow}-{routing}" not in args.cells:
            continue
        run_dir = run_cell(workflow, routing, args.steps, args.val_size, args.out, args.threads)
        print("\n".join(report(run_dir)) + "\n", flush=True)


if __name__ == "__main__":
    main()
