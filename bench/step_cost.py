"""Step cost of Voting under IP and SP on the tiny model, identical settings, side by side.

The two trainers run in one process and take turns step by step (IP step 1, SP step 1, IP
step 2, ...), so a change of machine load falls on both. Prints the mean step time of each, their
ratio, and the phase split: rollout, scoring (the separate logp_old pass; none for an adapter
whose step is one update), update, kl_to_base and stats (metrics, the post-update chi2 pass on
diagnostics steps and the one-turn finiteness probe on the others). Diagnostics steps are steps
1, 1 + k, ... with k = diagnostics.every; the means are over every timed step, so they hold the
sampled passes in their true proportion.

    .venv/bin/python bench/step_cost.py [--steps 12] [--warmup 2] [--threads 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from marlow.config import load_config
from marlow.training.trainer import Trainer

PARTS = ("rollout_s", "scoring_s", "update_s", "kl_to_base_s", "stats_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="key=value settings applied to both")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    total = args.steps + args.warmup
    common = ["workflow.name=voting", f"seed={args.seed}", f"steps={total}", *args.overrides]
    cfgs = {r: load_config(None, [*common, f"policy.routing={r}"]) for r in ("ip", "sp")}
    cfg = cfgs["ip"]
    print(
        f"Voting, tiny preset: B={cfg.grpo.batch_problems} n={cfg.grpo.group_size} "
        f"M={cfg.grpo.minibatch_turns} max_new={cfg.rollout.max_new_tokens} "
        f"diagnostics.every={cfg.diagnostics.every} kl_to_base={cfg.diagnostics.kl_to_base} "
        f"threads={args.threads}, {args.steps} steps after {args.warmup} warm-up, interleaved"
    )
    times: dict[str, list[float]] = {r: [] for r in cfgs}
    parts: dict[str, dict[str, list[float]]] = {r: {p: [] for p in PARTS} for r in cfgs}
    with tempfile.TemporaryDirectory() as out:
        trainers = {r: Trainer(c, f"{out}/{r}") for r, c in cfgs.items()}
        torch.set_num_threads(args.threads)  # a trainer sets its config's threads
        for step in range(1, total + 1):
            for routing, trainer in trainers.items():
                t0 = time.perf_counter()
                record = trainer.train_step(step)
                if step > args.warmup:
                    times[routing].append(time.perf_counter() - t0)
                    for p in PARTS:
                        parts[routing][p].append(record[f"time/{p}"])
    mean = {r: statistics.mean(v) for r, v in times.items()}
    for routing in cfgs:
        split = "  ".join(f"{p} {statistics.mean(parts[routing][p]):.3f}" for p in PARTS)
        sd = statistics.stdev(times[routing]) if len(times[routing]) > 1 else 0.0
        print(f"{routing.upper()}: step {mean[routing]:.3f} s (sd {sd:.3f})  {split}")
    print(f"IP/SP step-time ratio: {mean['ip'] / mean['sp']:.3f}")


if __name__ == "__main__":
    main()
