"""HFEngine throughput on the tiny scales: base vs one LoRA adapter (rank 16, all linear), and the
lean Qwen3 forward (``marlow.rollout.lean``) vs the model's own, side by side in one run.

    .venv/bin/python bench/rollout_speed.py [--threads N] [--repeats R]

Rows: the base through the model's forward and the lean one; the adapter unmerged (what GPUs
run) through the model's (PEFT's) forward and the lean one; and merged into the base
(``rollout.merge_lora``, the CPU default) through the model's forward and the lean one.

Every row generates exactly 64 new tokens (the stop id is one no model can produce), so tokens/s
counts sampled tokens only. Models are the tiny scales (``marlow.tiny.model``) freshly initialised:
speed does not depend on the weights.
"""

from __future__ import annotations

import argparse
import time

import torch

from marlow.policy.adapters import LoraSpec, attach_adapters
from marlow.rollout.hf import HFEngine
from marlow.tiny.model import SCALES, build_model
from marlow.tiny.tokenizer import build_tokenizer
from marlow.types import BASE, GenRequest, SamplingParams


def tokens_per_s(engine: HFEngine, adapter: str, batch: int, repeats: int) -> float:
    tok = engine.tokenizer
    prompts = [
        tok.encode(f"{i % 97}+{(7 * i) % 89}=", add_special_tokens=False) for i in range(batch)
    ]
    reqs = [GenRequest(p, adapter) for p in prompts]
    params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=0)
    engine.generate(reqs[:4], params)  # warm-up
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(reqs, SamplingParams(1.0, 64, seed=r))
        best = min(best, time.perf_counter() - t0)
    assert all(len(c.token_ids) == 64 for c in out)
    return batch * 64 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the best is kept")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    print(
        f"torch threads: {torch.get_num_threads()}; 64 new tokens per row; best of {args.repeats}"
    )
    print(f"{'model':>6} {'params':>8} {'policy':>13} {'batch':>6} {'tok/s':>9}")
    for size in SCALES:
        base = build_model(size, len(tok)).eval()
        n_params = sum(p.numel() for p in base.parameters())
        never = [base.config.vocab_size]  # an unreachable stop id
        model = attach_adapters(base, ["policy"], LoraSpec(rank=16, alpha=32), seed=0)
        cells = [
            ("base", BASE, HFEngine(model, tok, stop_ids=never, lean=False)),
            ("base, lean", BASE, HFEngine(model, tok, stop_ids=never)),
            ("lora", "policy", HFEngine(model, tok, stop_ids=never, lean=False)),
            ("lora, lean", "policy", HFEngine(model, tok, stop_ids=never)),
            ("merged", "policy", HFEngine(model, tok, stop_ids=never, merge=True, lean=False)),
            ("merged, lean", "policy", HFEngine(model, tok, stop_ids=never, merge=True)),
        ]
        for b in (32, 128, 256):
            for label, adapter, engine in cells:
                tps = tokens_per_s(engine, adapter, b, args.repeats)
                print(f"{size:>6} {n_params:>8,} {label:>13} {b:>6} {tps:>9,.0f}")


if __name__ == "__main__":
    main()
