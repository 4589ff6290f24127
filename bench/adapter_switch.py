"""Cost of switching the active LoRA adapter (``marlow.policy.adapters.activate``).

    .venv/bin/python bench/adapter_switch.py [--layers 28] [--switches 2000]

A Qwen3 of ``--layers`` decoder layers (small widths: the cost is per LoRA layer, not per weight)
with two adapters on all 7 linears of every layer; times ``activate`` alternating between an
adapter and the base, and prints microseconds per switch (best of 5). The unit tests check that a
switch touches no parameter (tests/unit/test_rollout_hf.py); the time is measured here.
"""

from __future__ import annotations

import argparse
import time

from transformers import Qwen3Config, Qwen3ForCausalLM

from marlow.policy.adapters import LoraSpec, activate, attach_adapters
from marlow.types import BASE

WIDTHS = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}


def build(layers: int) -> Qwen3ForCausalLM:
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2}
    return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, **heads, **WIDTHS)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--switches", type=int, default=2000)
    args = parser.parse_args()
    model = attach_adapters(
        build(args.layers), ["worker", "workers"], LoraSpec(rank=8, alpha=16), seed=0
    )
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(args.switches // 2):
            activate(model, "worker")
            activate(model, BASE)
        best = min(best, (time.perf_counter() - t0) / args.switches)
    lora_layers = 7 * args.layers
    print(f"{args.layers} layers ({lora_layers} LoRA layers): {best * 1e6:.1f} us per switch")


if __name__ == "__main__":
    main()
