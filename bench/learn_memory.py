"""Benchmark: the learn phase's memory on the CPU, with and without checkpointed decoder layers.

    .venv/bin/python bench/learn_memory.py [--runs off:4 on:4 on:12] [--row-tokens 512]
        [--dtype float32] [--tensors] [--out bench/results/learn_memory.json]

A Qwen3-0.6B stand-in (its published shape, random weights: ``marlow.archs.stand_in``, saved
once under ``MARLOW_CACHE``), loaded in ``--dtype`` (float32 as a CPU run loads it by default;
bfloat16 as the paper preset's runs, whose LoRA then computes in bfloat16), with one LoRA
adapter of rank 64 on every linear layer. Each run (``SETTING:ROWS``: ``grpo.activation_checkpointing`` off
or on, and the rows of the micro-batch) in a process of its own: the base and the adapter loaded
(its resident memory then is the baseline), then one update pass over a micro-batch of ``rows``
x ``row_tokens`` tokens (the last 3/4 of each row its completion) as the trainer makes it
(``score_chunk``, the loss's backward, the model in training mode). Every weight is read once
before the baseline is taken (a bfloat16 load left the weights out of the resident memory until
the pass read them). Reported: the peak resident memory (``ru_maxrss``) less the baseline, the pass's seconds, and ``marlow plan``'s activations
for the same micro-batch (:func:`marlow.plan.activation_bytes`). With ``--tensors``, the pass
runs once more under :class:`marlow.training.memory.LiveBytes`: the most bytes its tensors held
at once (``peak_tensors_gib``), the quantity plan models, without the allocator's blocks.

The children run with ``MALLOC_MMAP_THRESHOLD_=65536`` (unless set): glibc then maps every
block over 64 KiB on its own and returns it when freed, so the resident memory follows the live
tensors. Under glibc's default (a threshold that rises to the largest block freed) the freed
activations of one layer stay resident beside the next's, and a checkpointed forward showed the
same resident growth per layer as a plain one. On a CPU PyTorch's attention also keeps each
layer's score matrix for its backward, which plan leaves out (it counts a memory-efficient GPU
kernel), and the peak includes the backward's own temporaries.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ARCH = "qwen3-0.6b"
RANK = 64


def rss_gib() -> float:
    """This process's resident memory now, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(
    folder: str, checkpointing: str, rows: int, row_tokens: int, dtype: str, tensors: bool
) -> dict:
    """One setting's measurement, in this (fresh) process."""
    import torch

    from marlow.archs import Shape
    from marlow.config import ModelConfig
    from marlow.models import checkpoint_layers, decoder_and_head, load_base
    from marlow.plan import activation_bytes, lora_shapes
    from marlow.policy.adapters import LoraSpec, attach_adapters, use_adapter
    from marlow.training.batch import Chunk
    from marlow.training.logprobs import score_chunk
    from marlow.training.memory import LiveBytes

    base, _ = load_base(ModelConfig(name=folder), dtype=dtype, device=torch.device("cpu"))
    model = attach_adapters(base, ["policy"], LoraSpec(rank=RANK), seed=0).train()
    on = checkpointing == "on"
    if on:
        checkpoint_layers(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (rows, row_tokens), generator=gen)
    prompt = row_tokens // 4
    chunk = Chunk.full_rows(ids, prompt)
    with torch.no_grad():  # every weight read once: a bfloat16 load leaves them unmapped
        for p in model.parameters():
            p.sum()

    def update_pass() -> None:
        with use_adapter(model, "policy"):
            scored = score_chunk(model, chunk, temperature=1.0)
            (-(scored.logp * scored.mask).sum() / scored.mask.sum()).backward()

    baseline = rss_gib()
    start = time.perf_counter()
    update_pass()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    counted = None
    if tensors:  # once more, its tensors counted
        model.zero_grad(set_to_none=True)
        with LiveBytes(model.state_dict().values()) as counter:
            update_pass()
        counted = counter.peak / 2**30
    shape, lora = Shape.of(base.config), lora_shapes(model, "policy")
    chunked = decoder_and_head(model) is not None
    b = base.dtype.itemsize
    planned = activation_bytes(shape, b, lora, rows * row_tokens, chunked, checkpointed=on)
    return {
        "activation_checkpointing": checkpointing,
        "tokens": rows * row_tokens,
        "baseline_rss_gib": baseline,
        "peak_rss_gib": peak,
        "peak_above_baseline_gib": peak - baseline,
        "seconds": seconds,
        "plan_activations_gib": planned / 2**30,
        "peak_tensors_gib": counted,
    }


def stand_in() -> Path:
    """The stand-in's folder, written once (float32 weights, as the CPU run loads them)."""
    from marlow.archs.stand_in import save_stand_in

    cache = Path(os.environ.get("MARLOW_CACHE", Path.home() / ".cache" / "marlow"))
    folder = cache / "bench" / f"{ARCH}-stand-in"
    if not (folder / "config.json").is_file():
        save_stand_in(ARCH, folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=["off:4", "on:4", "on:12"])
    ap.add_argument("--row-tokens", type=int, default=512)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--tensors", action="store_true", help="count the pass's live tensors too")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # FOLDER SETTING ROWS
    args = ap.parse_args()
    if args.child:
        folder, setting, rows = args.child
        measured = child(folder, setting, int(rows), args.row_tokens, args.dtype, args.tensors)
        print(json.dumps(measured))
        return
    folder = stand_in()
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", **os.environ}
    runs = []
    for run in args.runs:
        setting, rows = run.split(":")
        cmd = [sys.executable, __file__, "--child", str(folder), setting, rows]
        cmd += ["--row-tokens", str(args.row_tokens), "--dtype", args.dtype]
        cmd += ["--tensors"] if args.tensors else []
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        print(
            f"activation_checkpointing={setting}: {r['tokens']:,} tokens, peak RSS "
            f"{r['peak_above_baseline_gib']:.2f} GiB above the loaded model "
            f"({r['baseline_rss_gib']:.2f}), {r['seconds']:.1f} s; plan's activations "
            f"{r['plan_activations_gib']:.2f} GiB"
            + ("" if r["peak_tensors_gib"] is None else f"; tensors {r['peak_tensors_gib']:.2f}"),
            flush=True,
        )
    if args.out is not None:
        record = {
            "bench": "bench/learn_memory.py",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} CPUs",
            "torch_threads": __import__("torch").get_num_threads(),
            "arch": ARCH,
            "rank": RANK,
            "dtype": args.dtype,
            "malloc_mmap_threshold": env["MALLOC_MMAP_THRESHOLD_"],
            "runs": runs,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
