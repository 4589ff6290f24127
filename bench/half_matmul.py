"""Benchmark: this CPU's matrix products in float32, bfloat16 and float16, in the layouts an update
makes, plain and through :func:`marlow.algo.matmul.mm`.

    .venv/bin/python bench/half_matmul.py [--threads 2] [--repeats 2] [--vocab 16384]
        [--out FILE.json]

Three products, each timed ``repeats`` times after an untimed one (the median, as GFLOP/s):

* ``forward``: a linear's forward, ``x @ W.T`` (512 x 1,024 by a 3,072 x 1,024 weight, Qwen3-0.6B's
  MLP widths), one operand row-major and the other column-major;
* ``input gradient``: a linear's input gradient in the backward, ``g @ W`` (512 x 3,072 by the
  3,072 x 1,024 weight), both operands row-major;
* ``head input gradient``: the LM head's, ``dz @ W`` for a chunk of 64 tokens (64 x ``vocab`` by
  ``vocab`` x 1,024; Qwen3's vocabulary is 151,936, whose plain bfloat16 product took 174 s
  on an AVX2 CPU, hence the smaller default).

The two gradients are timed plain (``torch.mm``) and through ``marlow.algo.matmul.mm``, which
re-lays out one operand where the CPU has no native instructions for the dtype
(``native_half``, printed); in float32 the two are the same call. Measured on a 2-core AMD EPYC
(Zen 3, AVX2, no native bfloat16 or float16), torch 2.13.0, 2 threads, on 2026-11-29
(``bench/results/half_matmul.json``), GFLOP/s:

    dtype     forward  input gradient: plain, mm  head input gradient: plain, mm
    float32   92.2     126.4, 119.4 (one call)    59.6, 54.1 (one call)
    bfloat16  16.7     0.6, 21.7                  0.5, 13.7
    float16   21.3     0.5, 3.6                   0.5, 5.1

Without native instructions torch's own GEMM is fast where the first operand is row-major and
the second column-major (a linear's forward), in bfloat16 also the other way round, and 25 to 170
times slower where both share a layout; ``mm`` copies the smaller operand, which in float16 can
leave the slower of the two mixed layouts (4 GFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from marlow.algo.matmul import mm, native_half

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gflops(product: Callable[[], torch.Tensor], flops: float, repeats: int) -> float:
    """GFLOP/s of ``product``: the median of ``repeats`` timed calls after an untimed one."""
    product()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        seconds.append(time.perf_counter() - start)
    return flops / statistics.median(seconds) / 1e9


def measure(dtype: torch.dtype, vocab: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    x, w, g = draw(512, 1024), draw(3072, 1024), draw(512, 3072)
    dz, head = draw(64, vocab), draw(vocab, 1024)
    out: dict = {"native": native_half(dtype) if dtype != torch.float32 else None}
    out["forward"] = gflops(
        lambda: torch.nn.functional.linear(x, w), 2 * 512 * 1024 * 3072, repeats
    )
    for name, (a, b) in {"input_gradient": (g, w), "head_input_gradient": (dz, head)}.items():
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        out[name] = {
            "plain": gflops(lambda a=a, b=b: torch.mm(a, b), flops, repeats),
            "mm": gflops(lambda a=a, b=b: mm(a, b), flops, repeats),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        r = results[name] = measure(dtype, args.vocab, args.repeats)
        grads = ", ".join(
            f"{k.replace('_', ' ')} {r[k]['plain']:.1f} plain, {r[k]['mm']:.1f} mm"
            for k in ("input_gradient", "head_input_gradient")
        )
        print(f"{name} (native: {r['native']}): forward {r['forward']:.1f}; {grads} GFLOP/s")
    if args.out:
        record = {
            "bench": "bench/half_matmul.py",
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "settings": vars(args) | {"out": str(args.out)},
            "gflops": results,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
