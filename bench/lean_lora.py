"""The HF rollout loop's per-position cost where a forward is bound by Python, as on a GPU: a
Qwen3 with the 0.6B's 28 layers but width 64 (so the arithmetic is negligible), bfloat16, three
rank-64 LoRA adapters on every linear, one unmerged adapter sampling 16 rows of 64 new tokens,
through PEFT's modules (``lean=False``) and through marlow's lean forward, side by side.

    .venv/bin/python bench/lean_lora.py [--repeats R]

Prints milliseconds per sampled position (the best of R timed calls) for each, and their ratio.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from marlow.policy.adapters import LoraSpec, attach_adapters
from marlow.rollout.hf import HFEngine
from marlow.tiny.tokenizer import build_tokenizer
from marlow.types import GenRequest, SamplingParams

ROWS, NEW = 16, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per forward; the best")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=28,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    model = attach_adapters(base, ["gen", "agg", "crit"], LoraSpec(rank=64, alpha=32), seed=0)
    never = [config.vocab_size]  # no row stops: every call samples ROWS x NEW positions
    reqs = [
        GenRequest(tok.encode(f"{i}+{i}=", add_special_tokens=False), "gen") for i in range(ROWS)
    ]
    ms = {}
    for label, use_lean in (("PEFT's modules", False), ("lean forward", True)):
        engine = HFEngine(model, tok, stop_ids=never, lean=use_lean)
        engine.generate(reqs[:2], SamplingParams(1.0, 8, seed=0))  # warm-up
        best = float("inf")
        for r in range(args.repeats):
            t0 = time.perf_counter()
            engine.generate(reqs, SamplingParams(1.0, NEW, seed=r))
            best = min(best, time.perf_counter() - t0)
        ms[label] = best / NEW * 1000
        print(f"{label:>15}: {ms[label]:.1f} ms per sampled position ({ROWS} rows)")
    peft, lean = ms["PEFT's modules"], ms["lean forward"]
    print(f"ratio: {peft / lean:.2f}x")


if __name__ == "__main__":
    main()
