"""Benchmark: the GRPO update's time against ``grpo.micro_tokens`` (memory and speed, not math).

    .venv/bin/python bench/micro_tokens.py [--sizes 65536 16384 8192 4096] [--repeats 3]

One process, the tiny-s math world (pre-trained or cached: ``MARLOW_CACHE``), the single-agent
step of ``bench/vs_trl.py`` (32 problems x 8, up to 96 new tokens, LoRA r16 on all linear
layers, fp32, 2 threads): one rollout, then ``Trainer.learn`` on the same episodes ``--repeats``
times per size, sizes interleaved round by round. Prints the median seconds of each size. Large
micro-batches make large intermediate buffers (B x T x 384 floats in the MLP's LoRA path: tens of
MB each), and on a CPU their allocation and first touch cost more than the arithmetic.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from marlow.config import load_config
from marlow.training.trainer import Trainer


def config(micro_tokens: int, threads: int):
    return load_config(
        None,
        [
            "workflow.name=single",
            "policy.routing=sp",
            "policy.lora_rank=16",
            "policy.lora_alpha=32",
            "grpo.batch_problems=32",
            "grpo.group_size=8",
            "grpo.minibatch_turns=256",
            "grpo.credit=broadcast",
            f"grpo.micro_tokens={micro_tokens}",
            "rollout.max_new_tokens=96",
            "diagnostics.kl_to_base=false",
            "diagnostics.every=1000",
            "optim.lr=1e-3",
            "optim.warmup_steps=0",
            "steps=100000",
            f"threads={threads}",
            "sample_episodes=0",
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[65536, 16384, 8192, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="marlow-micro-")
    trainers = {n: Trainer(config(n, args.threads), f"{out}/m{n}") for n in args.sizes}
    first = trainers[args.sizes[0]]
    first.train_step(1)  # warm-up (and the tiny world, if not cached)
    episodes = first.rollout(first.task.train_batch(0, 2, 32), 8, 0.7, seed=2)
    times: dict[int, list[float]] = {n: [] for n in args.sizes}
    for r in range(args.repeats):
        for n, trainer in trainers.items():
            t0 = time.perf_counter()
            trainer.learn(2 + r, episodes)
            times[n].append(time.perf_counter() - t0)
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
        f"{args.threads} threads; learn() seconds on the same 256 episodes, median of "
        f"{args.repeats}"
    )
    for n in args.sizes:
        print(
            f"  micro_tokens {n:>6}: {statistics.median(times[n]):.3f} s  "
            f"({' '.join(f'{t:.3f}' for t in times[n])})"
        )


if __name__ == "__main__":
    main()
