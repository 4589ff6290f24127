"""The HF rollout loop's per-position cost where a forward is bound by Python, as on a GPU: a
Qwen3 with the 0.6B's 28 layers but width 64 (so the arithmetic is negligible), bfloat16, three
rank-64 LoRA adapters on every linear, 64 new tokens a row, side by side in one run:

- one adapter, 16 rows: through PEFT's modules (``lean=False``), the lean forward eager, and the
  lean forward compiled (``compile=True``; its first call's seconds, the compilation, apart);
- three adapters, 16 rows each (an IP stage): one pass per adapter (three calls, as the loop
  sampled them before adapters were batched together) and one mixed pass of the 48 rows, eager
  and compiled (where a layer's linears that read one input compute together, their base
  weights packed with their LoRA A factors after them); and the mixed pass through the CUDA path's step run on the CPU (its buffers
  replayed by running them, each layer's attention the compiled flex attention that reads each
  row's own blocks of columns, where the CPU's compiled step attends by SDPA).

    .venv/bin/python bench/lean_lora.py [--repeats R]

Prints milliseconds per sampled position (the best of R timed calls: one forward of the whole
batch per position) for each, and the ratios; last, the mixed pass's operations per position,
eager and with the compiled step's layers (run eager to be counted) (:func:`operations`: the
ATen operations one call runs that are not views, divided by its positions, and how many of
them are matrix products), a count that stands for a GPU step's kernels, whose number bounds a
graphed step there more than its bytes.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from marlow.policy.adapters import LoraSpec, attach_adapters
from marlow.rollout import lean
from marlow.rollout.hf import HFEngine
from marlow.tiny.tokenizer import build_tokenizer
from marlow.types import GenRequest, SamplingParams

ROWS, NEW = 16, 64
ADAPTERS = ("gen", "agg", "crit")


def proxy(vocab: int) -> Qwen3ForCausalLM:
    """The Python-bound stand-in: the 0.6B's 28 layers at width 64, random float32 weights
    (seed 0), in eval mode (``bench/refill.py`` samples it too)."""
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=28,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


VIEWS = frozenset(
    [
        "view",
        "_unsafe_view",
        "t",
        "transpose",
        "expand",
        "reshape",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "permute",
        "as_strided",
        "alias",
        "detach",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
    ]
)
"""Operations that make a view: no kernel on a GPU."""
GEMMS = frozenset(["mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul", "linear"])


def operations(call, every: int = 0) -> tuple[Counter, Counter]:
    """The ATen operations ``call()`` runs below autograd, views left out, counted by name; and
    with ``every``, by (name, dtype) those whose output holds at least ``every`` elements
    (``bench/update_ops.py``'s passes over every token)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()
    large: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in VIEWS:
                return out
            seen[name] += 1
            first = out[0] if isinstance(out, tuple | list) else out
            if every and isinstance(first, torch.Tensor) and first.numel() >= every:
                large[(name, str(first.dtype).removeprefix("torch."))] += 1
            return out

    with Count():
        call()
    return seen, large


def best_ms(call, repeats: int) -> float:
    """The best of ``repeats`` timed calls, in milliseconds per sampled position."""
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        call(r)
        best = min(best, time.perf_counter() - t0)
    return best / NEW * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per forward; the best")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = build_tokenizer()
    base = proxy(len(tok)).to(torch.bfloat16)
    model = attach_adapters(base, list(ADAPTERS), LoraSpec(rank=64, alpha=32), seed=0)
    never = [base.config.vocab_size]  # no row stops: every call samples every row's NEW positions
    reqs = {
        a: [GenRequest(tok.encode(f"{i}+{i}=", add_special_tokens=False), a) for i in range(ROWS)]
        for a in ADAPTERS
    }

    def sample(engine: HFEngine, requests: list[GenRequest], seed: int) -> None:
        engine.generate(requests, SamplingParams(1.0, NEW, seed=seed))

    ms = {}
    one = reqs["gen"]
    for label, kw in (
        ("PEFT's modules", {"lean": False}),
        ("lean, eager", {}),
        ("lean, compiled", {"compile": True}),
    ):
        engine = HFEngine(model, tok, stop_ids=never, **kw)
        t0 = time.perf_counter()
        sample(engine, one, 0)  # warm-up (compiled: the compilation)
        warm = time.perf_counter() - t0
        ms[label] = best_ms(lambda r, e=engine: sample(e, one, r), args.repeats)
        print(
            f"1 adapter, {ROWS} rows, {label:>15}: {ms[label]:6.1f} ms per position"
            f" (first call {warm:.1f} s)"
        )
    peft, eager, compiled = ms.values()
    print(f"  PEFT / lean eager {peft / eager:.2f}x; lean eager / compiled {eager / compiled:.2f}x")
    engine = HFEngine(model, tok, stop_ids=never)
    mixed = [r for a in ADAPTERS for r in reqs[a]]
    passes = best_ms(lambda r: [sample(engine, reqs[a], r) for a in ADAPTERS], args.repeats)
    together = best_ms(lambda r: sample(engine, mixed, r), args.repeats)
    print(
        f"{len(ADAPTERS)} adapters, {ROWS} rows each, one pass per adapter: {passes:6.1f} ms"
        " per position"
    )
    print(
        f"{len(ADAPTERS)} adapters, {ROWS} rows each, one mixed pass:      {together:6.1f} ms"
        " per position"
    )
    print(f"  per adapter / mixed {passes / together:.2f}x")
    engine = HFEngine(model, tok, stop_ids=never, compile=True)
    sample(engine, mixed, 0)  # warm-up: the compilation
    compiled = best_ms(lambda r: sample(engine, mixed, r), args.repeats)
    print(
        f"{len(ADAPTERS)} adapters, {ROWS} rows each, one mixed pass compiled: {compiled:6.1f} ms"
        " per position"
    )
    graphs_on = lean._graphs_on
    lean._graphs_on = lambda device: True  # the CUDA path's step: flex attention
    try:
        engine = HFEngine(model, tok, stop_ids=never, compile=True)
        sample(engine, mixed, 0)  # warm-up: the compilation
        flex = best_ms(lambda r: sample(engine, mixed, r), args.repeats)
    finally:
        lean._graphs_on = graphs_on
    print(
        f"{len(ADAPTERS)} adapters, {ROWS} rows each, one mixed pass, the CUDA path's step (flex"
        f" attention): {flex:6.1f} ms per position"
    )
    for label, kw in (("eager", {}), ("compiled", {"compile": True})):
        # the compiled step's layers run eager (torch.compile disabled) so that each is counted;
        # the step then finds nothing compiled and says so once, keeping its layers
        with torch._dynamo.config.patch(disable=True), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ops, _ = operations(
                lambda kw=kw: sample(HFEngine(model, tok, stop_ids=never, **kw), mixed, 0)
            )
        gemms = sum(n for name, n in ops.items() if name in GEMMS)
        print(
            f"one mixed pass, {label} step: {sum(ops.values()) / NEW:.0f} operations a position"
            f" (views left out), {gemms / NEW:.0f} of them matrix products"
        )


if __name__ == "__main__":
    main()
