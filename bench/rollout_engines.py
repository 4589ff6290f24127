"""Sampling throughput of the two rollout backends side by side: ``hf`` (marlow's own loop) and
``vllm``.

For each scale (random weights of its architecture: what sampling costs does not depend on the
weights' values), each adapter mix and each completion length, the same requests go to both
engines in this one process: P prompts of 64 tokens x C completions each (a GRPO batch), every row
sampled to exactly N new tokens (no stop token), temperature 1, LoRA rank 16 on every linear. The
mixes: ``base`` (every row on the base), ``1-adapter`` (every row on one adapter), ``4-adapters``
(rows cycling over four). A throughput is new tokens / wall seconds of one ``generate`` call,
after one small warm-up call per engine; each is measured ``--repeats`` times, the two engines
taking turns, and the median is reported with the range (one call on a 2-core machine moves
with anything else that wakes up); the vLLM engine's start-up is reported apart.

    .venv-vllm/bin/python bench/rollout_engines.py                       # the tiny scales
    .venv-vllm/bin/python bench/rollout_engines.py --scales qwen3-0.6b --prompts 4 \\
        --completions 2 --new-tokens 16 64

Scales: ``tiny-s``, ``tiny-m``, ``tiny-l`` (float32, the tiny worlds' architectures and their
99-symbol vocabulary; positions raised from the worlds' 512 to 2,048 so that 1,024 new tokens
fit: a cost measurement, not a length the worlds were trained for) and ``qwen3-0.6b`` (bfloat16, the Qwen3-0.6B architecture of
``marlow.archs``, 151,936-token vocabulary). ``--threads`` is both engines' CPU threads (the
``hf`` loop's torch threads; vLLM's ``rollout.vllm.cpu_threads``, unless ``--vllm-threads``
gives vLLM its own: its engine core and the caller's process then keep the other cores). Results: a table on stdout
and ``--json`` (default bench/results/rollout_engines.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from marlow.config import VLLMConfig
from marlow.policy.adapters import LoraSpec, adapter_parameters, attach_adapters
from marlow.rollout.hf import HFEngine
from marlow.rollout.vllm import VLLMEngine
from marlow.types import BASE, GenRequest, SamplingParams

ADAPTERS = ["a0", "a1", "a2", "a3"]
MIXES = {"base": [BASE], "1-adapter": ADAPTERS[:1], "4-adapters": ADAPTERS}


def build(scale: str, folder: Path):
    """(model with 4 random adapters, tokenizer, dtype name) for ``scale``, saved in ``folder``
    first so that vLLM loads the same base from disk."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if scale.startswith("tiny"):
        from marlow.tiny.model import build_model
        from marlow.tiny.tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
        model = build_model(scale, tokenizer.vocab_size, seed=0)
        model.config.max_position_embeddings = 2048  # room for 1,024 new tokens (module doc)
        dtype = "float32"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    else:
        from marlow.archs.stand_in import save_stand_in

        save_stand_in(scale, folder)
        dtype = "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    for p in base.parameters():
        p.requires_grad_(False)
    model = attach_adapters(base, ADAPTERS, LoraSpec(16, 32, 0.0, "all-linear"), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in ADAPTERS:
            for p in adapter_parameters(model, name).values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model, tokenizer, dtype


def requests(tokenizer, prompts: int, completions: int, mix: list[str]) -> list[GenRequest]:
    g = torch.Generator().manual_seed(0)
    vocab = min(tokenizer.vocab_size, 90)  # ordinary symbols, no special token
    out = []
    for i in range(prompts):
        ids = (torch.randint(4, vocab, (64,), generator=g)).tolist()
        out += [GenRequest(ids, mix[(i * completions + j) % len(mix)]) for j in range(completions)]
    return out


def timed(engine, reqs, n_new: int, seed: int) -> float:
    t0 = time.perf_counter()
    out = engine.generate(reqs, SamplingParams(1.0, n_new, seed))
    seconds = time.perf_counter() - t0
    assert all(len(c.token_ids) == n_new for c in out), "a row stopped early"
    return len(reqs) * n_new / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", nargs="+", default=["tiny-s", "tiny-l"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--completions", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-threads", type=int, help="vLLM's CPU threads (default: --threads)")
    ap.add_argument("--repeats", type=int, default=1, help="calls per engine and setting")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results/rollout_engines.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(
        f"torch {torch.__version__}, {args.threads} threads, cpu {torch.backends.cpu.get_cpu_capability()}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    for scale in args.scales:
        with tempfile.TemporaryDirectory() as tmp:
            model, tokenizer, dtype = build(scale, Path(tmp) / scale)
            # no stop token: every row runs to N tokens (the hf loop takes an id no row can
            # sample, vLLM refuses out-of-vocabulary ids and takes none)
            longest = 64 + max(args.new_tokens) + 8
            hf = HFEngine(model, tokenizer, stop_ids=[10**9], merge=dtype == "float32")
            t0 = time.perf_counter()
            threads = args.vllm_threads or args.threads
            settings = VLLMConfig(kv_cache_gib=2.0, max_model_len=longest, cpu_threads=threads)
            vllm = VLLMEngine(model, tokenizer, settings=settings, dtype=dtype, stop_ids=[])
            start = time.perf_counter() - t0
            print(f"{scale} ({dtype}): vLLM engine ({threads} threads) started in {start:.1f} s")
            try:
                for engine in (hf, vllm):  # warm-up: first-call costs out of the figures
                    engine.generate(requests(tokenizer, 2, 2, ADAPTERS), SamplingParams(1.0, 4, 0))
                for mix in args.mixes:
                    for n_new in args.new_tokens:
                        reqs = requests(tokenizer, args.prompts, args.completions, MIXES[mix])
                        runs = {"hf": [], "vllm": []}
                        for k in range(args.repeats):  # the engines take turns
                            for name, engine in (("hf", hf), ("vllm", vllm)):
                                runs[name].append(timed(engine, reqs, n_new, k))
                        speed = {name: statistics.median(v) for name, v in runs.items()}
                        row = dict(
                            scale=scale,
                            dtype=dtype,
                            mix=mix,
                            rows=len(reqs),
                            new_tokens=n_new,
                            hf_tokens_per_s=speed["hf"],
                            vllm_tokens_per_s=speed["vllm"],
                            hf_range=[min(runs["hf"]), max(runs["hf"])],
                            vllm_range=[min(runs["vllm"]), max(runs["vllm"])],
                            repeats=args.repeats,
                            hf_threads=args.threads,
                            vllm_threads=threads,
                            vllm_over_hf=speed["vllm"] / speed["hf"],
                            vllm_start_s=start,
                        )
                        rows.append(row)
                        print(
                            f"  {mix:<10} {len(reqs)} rows x {n_new:>4} new: hf {speed['hf']:>9,.0f} "
                            f"tok/s ({min(runs['hf']):,.0f}-{max(runs['hf']):,.0f}), vllm "
                            f"{speed['vllm']:>9,.0f} tok/s ({min(runs['vllm']):,.0f}-"
                            f"{max(runs['vllm']):,.0f}), vllm/hf {row['vllm_over_hf']:.2f}",
                            flush=True,
                        )
            finally:
                vllm.close()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
