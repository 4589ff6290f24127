"""Benchmark: pre-train a tiny scale and measure every role it learned (not a test).

    .venv/bin/python bench/tiny_pretrain.py --scale tiny-s --cache-dir /tmp/marlow-bench
    .venv/bin/python bench/tiny_pretrain.py --throughput        # tokens/s of every scale
    .venv/bin/python bench/tiny_pretrain.py --precision         # float32 vs bf16 autocast
    .venv/bin/python bench/tiny_pretrain.py --set gen_error=0.3 --set borrow_bug=0.7

Reports (JSON on stdout, progress on stderr): pre-training wall time (``meta.json``), the
generator's greedy (T=0) and sampled (T=0.7, and T=1.0: the tiny preset's rollout temperature)
accuracy on the validation problems, per level, pass@8 at T=1.0 (the room RL can reach), Voting
with the model in both roles (aggregator vs majority), and every role's parse rate, and the
peak resident memory of the pre-training process (``pretrain_peak_rss_mb``: pass a cold
``--cache-dir``, or it measures a cache hit). Wall times are only meaningful on an otherwise idle
machine: the load average is printed beside them, and the CPU capability torch dispatched to.

``--precision`` times the pre-training loop side by side in one run under the shipped float32
recipe and under bf16 autocast, on this CPU's own kernels and, when this CPU is above AVX2, again
with torch and oneDNN held to AVX2 (:data:`marlow.tiny.pretrain.AVX2_ONLY`: how an
AVX2-only CPU without native bf16 runs). Each measurement is a fresh child process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import fields

import torch

from marlow.rewards.math import grade_math
from marlow.tiny.corpus import CorpusConfig
from marlow.tiny.mathgen import val_problems
from marlow.tiny.model import SCALES, build_model, n_parameters
from marlow.tiny.pretrain import AVX2_ONLY, load_tiny, pretrain_tiny, train
from marlow.tiny.tokenizer import build_tokenizer
from marlow.worlds.tinyeval import generator_texts, greedy_report, role_rates, voting_eval


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def throughput(threads: int, steps: int = 40) -> dict[str, dict[str, float]]:
    """Training tokens/s of each scale: the real pre-training loop for a few steps."""
    torch.set_num_threads(threads)
    tok = build_tokenizer()
    out = {}
    for name in SCALES:
        model = build_model(name, len(tok))
        stats = train(model, tok, CorpusConfig(), steps=steps, lr=1e-3, seed=0, log=lambda _m: None)
        s_per_step = stats["train_seconds"] / steps
        out[name] = {
            "params": n_parameters(model),
            "tokens_per_s": round(stats["tokens_per_second"]),
            "s_per_step": round(s_per_step, 3),
            "pretrain_steps": SCALES[name].pretrain_steps,
            "est_pretrain_s": round(s_per_step * SCALES[name].pretrain_steps),
        }
        log(f"{name}: {out[name]}")
    return out


PATHS = {"float32": False, "bf16-autocast": True}


def one_path(path: str, threads: int, steps: int) -> dict[str, float | str]:
    """Child body: the pre-training loop on tiny-s for ``steps`` steps under ``path``."""
    torch.set_num_threads(threads)
    tok = build_tokenizer()
    model = build_model("tiny-s", len(tok))
    if PATHS[path]:  # marlow's earlier recipe: eager attention, the forward under bf16 autocast
        model.set_attn_implementation("eager")
        forward = model.forward

        def autocast_forward(*args, **kwargs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return forward(*args, **kwargs)

        model.forward = autocast_forward
    stats = train(model, tok, CorpusConfig(), steps=steps, lr=3e-3, seed=0, log=lambda _m: None)
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "s_per_step": round(stats["train_seconds"] / steps, 4),
        "tokens_per_s": round(stats["tokens_per_second"]),
        "final_loss": round(stats["final_loss"], 4),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }


def precision(threads: int, steps: int) -> dict:
    """Every path on this CPU's kernels and, if it has more than AVX2, held to AVX2."""
    native = torch.backends.cpu.get_cpu_capability()
    envs = {native: {}}
    if native != "AVX2" and native != "DEFAULT":
        envs["AVX2"] = AVX2_ONLY
    out: dict = {"native_capability": native, "threads": threads, "steps": steps, "runs": {}}
    for cap, extra in envs.items():
        for path in PATHS:
            cmd = [sys.executable, __file__, "--one-path", path, "--threads", str(threads)]
            cmd += ["--steps", str(steps)]
            done = subprocess.run(
                cmd, env={**os.environ, **extra}, capture_output=True, text=True, check=True
            )
            out["runs"][f"{cap}/{path}"] = json.loads(done.stdout)
            log(f"{cap}/{path}: {out['runs'][f'{cap}/{path}']}")
        runs = out["runs"]
        out[f"{cap}/bf16_over_float32_time"] = round(
            runs[f"{cap}/bf16-autocast"]["s_per_step"] / runs[f"{cap}/float32"]["s_per_step"], 2
        )
    out["load_after"] = os.getloadavg()
    return out


def by_level(texts: list[str], problems: list) -> dict[str, float]:
    hits, counts = defaultdict(int), defaultdict(int)
    for t, p in zip(texts, problems, strict=True):
        key = (
            f"L{p.meta['level']}"
            + ("*" if "*" in p.prompt else "")
            + ("-" if "-" in p.prompt else "")
        )
        counts[key] += 1
        hits[key] += grade_math(t, p.answer) >= 1.0
    return {k: round(hits[k] / counts[k], 3) for k in sorted(counts)}


def measure(path: str, n_val: int) -> dict:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model, tok = load_tiny(path)
    problems = val_problems(n_val)
    out: dict = {}
    t0 = time.perf_counter()
    for temp in (0.0, 0.7, 1.0):
        texts = generator_texts(model, tok, problems, temperature=temp, seed=1)
        ok = [grade_math(t, p.answer) >= 1.0 for t, p in zip(texts, problems, strict=True)]
        out[f"generator_T{temp}"] = sum(ok) / len(ok)
        out[f"generator_T{temp}_by_level"] = by_level(texts, problems)
        out[f"generator_T{temp}_boxed_rate"] = sum("\\boxed{" in t for t in texts) / len(texts)
        if temp == 0.0:
            out["greedy_examples"] = texts[:8]
    samples = [
        generator_texts(model, tok, problems, temperature=1.0, seed=10 + k) for k in range(8)
    ]
    out["pass_at_8_T1.0"] = sum(
        any(grade_math(s[i], p.answer) >= 1.0 for s in samples) for i, p in enumerate(problems)
    ) / len(problems)
    out["voting_T0.7"] = voting_eval(model, tok, problems, temperature=0.7, seed=2)
    out["voting_T1.0"] = voting_eval(model, tok, problems, temperature=1.0, seed=3)
    out["roles_greedy"] = role_rates(model, tok, problems[:200])
    out["measure_seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scale", default="tiny-s", choices=list(SCALES))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="examples per step (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--n-val", type=int, default=500)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="override a CorpusConfig rate (repeatable)",
    )
    ap.add_argument("--throughput", action="store_true", help="only measure tokens/s per scale")
    ap.add_argument(
        "--precision", action="store_true", help="float32 vs bf16 autocast, native and AVX2"
    )
    ap.add_argument("--one-path", choices=list(PATHS), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    if args.one_path:
        print(json.dumps(one_path(args.one_path, args.threads, args.steps or 60)))
        return
    if args.precision:
        print(json.dumps(precision(args.threads, args.steps or 60), indent=2))
        return
    if args.throughput:
        print(
            json.dumps(
                {
                    "threads": args.threads,
                    "load": os.getloadavg(),
                    "scales": throughput(args.threads),
                },
                indent=2,
            )
        )
        return
    knobs = {f.name for f in fields(CorpusConfig)} - {"weights"}
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in knobs:
            ap.error(f"--set {key}: unknown; valid: {', '.join(sorted(knobs))}")
        overrides[key] = float(value)
    corpus = CorpusConfig(**overrides)
    load_before = os.getloadavg()
    path = pretrain_tiny(
        args.scale,
        cache_dir=args.cache_dir,
        steps=args.steps,
        batch=args.batch,
        seed=args.seed,
        log=log,
        corpus=corpus,
        threads=args.threads,
    )
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    meta = json.loads((path / "meta.json").read_text())
    result = {
        "path": str(path),
        "scale": args.scale,
        "steps": meta["steps"],
        "batch_examples": meta["batch_examples"],
        "corpus_overrides": overrides,
        "pretrain_seconds": round(meta["seconds"], 1),
        "pretrain_peak_rss_mb": peak_rss_mb,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": args.threads,
        "tokens_per_second": round(meta["tokens_per_second"]),
        "final_loss": meta["final_loss"],
        "greedy_accuracy_200": greedy_report(path)["accuracy"],
        "load_avg_before_after": [load_before, os.getloadavg()],
        "n_val": args.n_val,
        **measure(str(path), args.n_val),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
