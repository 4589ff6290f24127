"""Refilled rows against batches one after the other: a sampling call of more rows than
``max_batch`` whose completions stop at scattered lengths, side by side in one run.

    .venv/bin/python bench/refill.py [--rows 256] [--max-batch 64] [--new 128] [--repeats 2]

Two models, eager decode steps (the CPU's default), 4 LoRA adapters of rank 16 mixed (row i
answered by adapter i mod 4), temperature 1, a seed per request (so both ways sample the same
tokens, and the same number of them):

- **tiny-s**, the quickstart's shape (0.4M parameters, random weights): a step's cost grows with
  its rows, as on a CPU;
- **proxy**: the 0.6B's 28 layers at width 64 (``bench/lean_lora.py``'s), one thread, where a
  step is bound by its per-layer overhead and costs about the same whatever its rows, as a
  decode step on a GPU.

The stop ids are the ``--stops`` most likely first tokens of a warm-up call, so completions stop
early or late at random (their mean and longest are printed). Each way, the best of
``--repeats`` timed calls: seconds, sampled tokens per second and decode steps (forwards of the
working batch).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

from lean_lora import proxy  # bench/ is the script's folder: on sys.path
from marlow.policy.adapters import LoraSpec, attach_adapters
from marlow.rollout.hf import HFEngine
from marlow.rollout.lean import LeanQwen3
from marlow.tiny.model import build_model
from marlow.tiny.tokenizer import build_tokenizer
from marlow.types import GenRequest, SamplingParams

ADAPTERS = ("a0", "a1", "a2", "a3")


def adapted(base: torch.nn.Module) -> torch.nn.Module:
    model = attach_adapters(base, list(ADAPTERS), LoraSpec(rank=16, alpha=32), seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def measure(model, tok, args) -> None:
    reqs = [
        GenRequest(
            tok.encode(f"{i % 97}+{(7 * i) % 89}=", add_special_tokens=False),
            ADAPTERS[i % len(ADAPTERS)],
            seed=i,
        )
        for i in range(args.rows)
    ]
    params = SamplingParams(1.0, args.new, seed=0)
    never = [model.config.vocab_size]
    warm = HFEngine(model, tok, stop_ids=never, max_batch=args.rows).generate(reqs, params)
    firsts = Counter(t for c in warm for t in c.token_ids[1:])
    stops = [t for t, _ in firsts.most_common(args.stops)]
    steps = {"n": 0}
    call = LeanQwen3.__call__

    def counted(self, *a, **kw):
        steps["n"] += 1
        return call(self, *a, **kw)

    LeanQwen3.__call__ = counted
    rows = {}
    try:
        for refill in (False, True):
            engine = HFEngine(model, tok, stop_ids=stops, max_batch=args.max_batch, refill=refill)
            best, out = float("inf"), None
            for _ in range(args.repeats):
                steps["n"] = 0
                t0 = time.perf_counter()
                out = engine.generate(reqs, params)
                best = min(best, time.perf_counter() - t0)
            rows[refill] = (best, out, steps["n"])
    finally:
        LeanQwen3.__call__ = call
    (chunk_s, chunked, chunk_steps), (refill_s, refilled, refill_steps) = rows[False], rows[True]
    assert [c.token_ids for c in chunked] == [c.token_ids for c in refilled]
    lengths = [len(c.token_ids) for c in refilled]
    tokens = sum(lengths)
    print(
        f"  {args.rows} rows, max_batch {args.max_batch}: {tokens} tokens, mean length "
        f"{tokens / len(lengths):.1f}, longest {max(lengths)} (stop ids {stops})"
    )
    for label, s, n in (("batches", chunk_s, chunk_steps), ("refilled", refill_s, refill_steps)):
        print(f"  {label:>9}: {s:7.3f} s  {tokens / s:9.0f} tokens/s  {n:5d} decode steps")
    print(f"  refilled / batches: {refill_s / chunk_s:.3f} of the time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256, help="rows of the call")
    ap.add_argument("--max-batch", type=int, default=64, help="the engine's max_batch")
    ap.add_argument("--new", type=int, default=128, help="the most new tokens a row")
    ap.add_argument("--stops", type=int, default=2, help="how many stop ids")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls a way; the best is kept")
    args = ap.parse_args()
    tok = build_tokenizer()
    print(f"torch threads: {torch.get_num_threads()}")
    print("tiny-s (random weights):")
    measure(adapted(build_model("tiny-s", len(tok)).eval()), tok, args)
    torch.set_num_threads(1)
    print("proxy (28 layers, width 64, one thread):")
    measure(adapted(proxy(len(tok))), tok, args)


if __name__ == "__main__":
    main()
