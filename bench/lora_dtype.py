"""Benchmark: an update pass over a bfloat16 base with LoRA computed in bfloat16 (marlow's
default, :func:`marlow.policy.adapters.lora_in_base_dtype`) and in PEFT's float32, side by side.

    .venv/bin/python bench/lora_dtype.py [--layers 4] [--rows 2] [--row-tokens 512]
        [--repeats 5] [--device cpu] [--out bench/results/lora_dtype.json]

A Qwen3 of Qwen3-0.6B's widths (hidden 1,024, MLP 3,072, 16 query and 8 key-value heads of 128)
with ``--layers`` layers and a 4,096-id vocabulary (the head is not what is measured), random
weights in bfloat16, one LoRA adapter of rank 64 (alpha 32) on every linear layer, in training
mode. One pass is what the trainer's update makes of a micro-batch
(:func:`marlow.models.completion_logprobs` over ``rows`` x ``row-tokens`` random ids, the last
3/4 of each row its completion, and the backward of the summed log-probs); it is timed
``repeats`` times after an untimed one, alternating the two arithmetics round by round (so that a
machine's drift falls on both), and the median of each is reported with their ratio. The float32
arithmetic is ``completion_logprobs`` with ``lora_in_base_dtype`` replaced by a context that does
nothing (PEFT's own: each LoRA layer's input cast up to its float32 factors).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import marlow.models
from marlow.archs import arch_config
from marlow.fileio import write_json
from marlow.models import completion_logprobs
from marlow.policy.adapters import LoraSpec, attach_adapters, use_adapter

ARITHMETICS = ("bfloat16", "float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--row-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("bench/results/lora_dtype.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    model = adapted_stand_in({"num_hidden_layers": args.layers}, device)
    one_pass = update_pass(model, args.rows, args.row_tokens)
    ours = marlow.models.lora_in_base_dtype

    def one(arithmetic: str) -> float:
        marlow.models.lora_in_base_dtype = (
            ours if arithmetic == "bfloat16" else lambda model: contextlib.nullcontext()
        )
        return one_pass()

    seconds: dict[str, list[float]] = {a: [] for a in ARITHMETICS}
    try:
        with use_adapter(model, "policy"):
            for a in ARITHMETICS:  # untimed
                one(a)
            for _ in range(args.repeats):
                for a in ARITHMETICS:
                    seconds[a].append(one(a))
    finally:
        marlow.models.lora_in_base_dtype = ours
    median = {a: statistics.median(s) for a, s in seconds.items()}
    result = {
        "settings": {**vars(args), "out": str(args.out), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "seconds": seconds,
        "median_s": median,
        "tokens_per_s": {a: args.rows * args.row_tokens / m for a, m in median.items()},
        "float32_over_bfloat16": median["float32"] / median["bfloat16"],
    }
    write_json(args.out, result)
    for a in ARITHMETICS:
        print(f"LoRA in {a}: {median[a]:.3f} s a pass (median of {args.repeats})")
    print(f"float32 / bfloat16: {result['float32_over_bfloat16']:.2f}x -> {args.out}")


def adapted_stand_in(shape: dict, device: torch.device) -> torch.nn.Module:
    """A Qwen3 of Qwen3-0.6B's config with ``shape``'s fields over it and a 4,096-id vocabulary
    (unless ``shape`` names another), random bfloat16 weights (seed 0) on ``device``, one LoRA
    adapter ``policy`` of rank 64 (alpha 32) on every linear layer, in training mode."""
    torch.manual_seed(0)
    fields = {**arch_config("qwen3-0.6b"), "vocab_size": 4096, **shape}
    fields.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base = Qwen3ForCausalLM(Qwen3Config(**fields)).to(device, torch.bfloat16)
    return attach_adapters(base, ["policy"], LoraSpec(rank=64), seed=0).train()


def update_pass(model: torch.nn.Module, rows: int, row_tokens: int) -> Callable[[], float]:
    """One update pass of ``model`` (its active adapter) as the trainer makes it, over ``rows``
    x ``row_tokens`` random ids, the last 3/4 of each row its completion: a callable that runs
    it (:func:`marlow.models.completion_logprobs`, the backward of the summed log-probs, the
    gradients dropped) and returns its seconds, the device synchronized around it."""
    device = next(model.parameters()).device
    ids = torch.randint(0, 4096, (rows, row_tokens), device=device)
    prompt = row_tokens // 4
    prompt_len = torch.full((rows,), prompt, device=device)
    targets = ids[:, prompt:]
    mask = torch.ones_like(targets, dtype=torch.bool)

    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        logp, _ = completion_logprobs(
            model, ids, torch.ones_like(ids), prompt_len, targets, mask, 1.0
        )
        (-logp.sum()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return run


if __name__ == "__main__":
    main()
