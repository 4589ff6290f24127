"""Pre-training a tiny scale on the role corpus, with a content-addressed cache.

The loop, top to bottom:

1. stream corpus examples (``marlow.tiny.corpus``); a prompt becomes token ids through
   :func:`marlow.prompts.chat.chat_prompt_ids`, exactly as the workflow engine builds them, and the
   completion is followed by ``<|im_end|>``;
2. take ``POOL_BATCHES`` batches' worth of examples, sort them by length and cut them into
   batches (little padding), in a seeded shuffled order;
3. loss = mean cross-entropy over the batch's completion tokens only (prompt and padding labels
   are -100), computed and back-propagated in right-padded micro-batches of at most
   ``MICRO_TOKENS`` tokens (bounded memory; the same loss), in float32 on every machine
   (:data:`PRECISION`);
4. AdamW (betas 0.9/0.95, weight decay on matrices only), linear warmup then cosine decay to
   10 % of the peak, gradient clipping at 1.0, for a FIXED number of optimizer steps per scale
   (never a time budget: the result must be a function of the cache key).

The folder ``<cache_dir>/<scale>-<hash>`` holds the model, the tokenizer and ``meta.json``; the
hash covers everything that changes the weights (scale shape, steps, learning rate, batch,
corpus config, the ``tiny`` prompt templates, the tokenizer, the seed, :data:`CORPUS_VERSION`,
and the torch thread count when it is not :data:`THREADS`).

One model per TASK: ``task="math"`` (the arithmetic corpus, :mod:`marlow.tiny.corpus`) or
``task="code"`` (the code corpus, :mod:`marlow.tiny.codecorpus`, folder
``<scale>-code-<hash>``). Not one mixed corpus: the math model, its cache key and the figures
published from it stay exactly as they were (the math key covers the math templates only and
holds no task field), and each world spends all of a small model's capacity on its own task.
marlow also ships the worlds of the quickstart's and the tiny preset's recipes, built by this code
(:mod:`marlow.tiny.shipped`); a run loads those unless it asks for a rebuild
(:func:`marlow.models.tiny_world`), and this module builds any world, shipped or not, into the cache.
The model is trained in memory, then written to a temporary folder and renamed into place, under
a file lock: concurrent callers train once, a run killed while training leaves nothing on disk,
and a temporary folder left by a kill during the save is removed by the next run of that key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from marlow.choices import BuiltinTask
from marlow.prompts import TEMPLATES
from marlow.prompts.chat import chat_prompt_text
from marlow.tiny import codegen, mathgen
from marlow.tiny.codecorpus import CodeCorpusConfig
from marlow.tiny.codecorpus import examples as code_examples
from marlow.tiny.corpus import CorpusConfig, Example, examples
from marlow.tiny.model import build_model, get_scale
from marlow.tiny.tokenizer import CHARACTERS, CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

CORPUS_VERSION = 1
"""Bump when the corpus or problem generator changes in a way its config does not show."""
CODE_CORPUS_VERSION = 1
"""The same for the code world (its own cache entries)."""
TASKS: tuple[str, ...] = get_args(BuiltinTask)  # each built-in task has a world

BATCH_EXAMPLES = 64  # examples per optimizer step, unless a run sets model.pretrain_batch
POOL_BATCHES = 16  # batches sorted by length together
AVX2_ONLY = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
"""The environment that holds torch's CPU kernels to AVX2 on a CPU with AVX-512, as a CPU
without AVX-512 or native bf16 runs them: ATen's vectorised kernels, oneDNN, and MKL (torch's
BLAS; on an Intel CPU it takes its AVX-512 path unless told, as ``MKL_VERBOSE=1`` shows: before
2026-11-26 marlow held only the first two). Set it before torch is imported (a child process)."""
MICRO_TOKENS = 8192  # padded tokens per forward/backward; a step sums several (bounded memory)
WARMUP_FRACTION = 0.05
WEIGHT_DECAY = 0.01
GRAD_CLIP = 1.0
PRECISION = "float32"
"""One precision recipe on every CPU, never chosen by the machine: float32 weights, activations
and optimizer state, PyTorch's fused (sdpa) attention. Measured with ``bench/tiny_pretrain.py
--precision --threads 2`` (tiny-s): bf16 autocast took 9.0x as long as this with torch held to
AVX2 (a CPU without native bf16) and 0.6x on an AVX-512 CPU with native bf16. float32 is the only
recipe that is fast on both, and a cache key that depended on the CPU would make the measured
numbers (docs/benchmarks) machine-specific."""
THREADS = 2
"""Torch threads of a pre-training unless the caller asks for others, on every machine: part of
the recipe, never the machine's core count. A CPU's float32 sums are split across threads, so
the weights depend on the thread count (tiny-s, 300 steps of 8: 1 and 2 threads gave different
bytes; two runs at 2 threads, and two on different transformers releases, the same bytes). Two
keeps the key of every world cached before this constant (all built on 2 cores); on a one-core
machine it costs 12 % (measured: docs/benchmarks/worlds.md). Another count is honoured and is
another world, with its own key."""

Log = Callable[[str], None]


def default_cache_dir() -> Path:
    """``$MARLOW_CACHE``, or ``~/.cache/marlow``."""
    env = os.environ.get("MARLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "marlow"


def _check_task(task: str, corpus: CorpusConfig | CodeCorpusConfig | None):
    if task not in TASKS:
        raise ValueError(f"tiny task {task!r} is unknown; valid: {', '.join(TASKS)}")
    if corpus is None:
        return CorpusConfig() if task == "math" else CodeCorpusConfig()
    want = CorpusConfig if task == "math" else CodeCorpusConfig
    if not isinstance(corpus, want):
        raise ValueError(f"the {task} world pre-trains on a {want.__name__}")
    return corpus


def cache_key(
    scale: str,
    steps: int,
    seed: int,
    corpus: CorpusConfig | CodeCorpusConfig,
    task: str = "math",
    batch: int = BATCH_EXAMPLES,
    threads: int = THREADS,
) -> str:
    """Hash of everything that determines the pre-trained weights. The math payload is the one
    of the math-only marlow (no task field, math templates only), so math caches keep their key;
    the thread count enters only when it is not :data:`THREADS`, so that no cached key moved."""
    payload = {
        "version": CORPUS_VERSION,
        "scale": get_scale(scale).to_dict(),
        "steps": steps,
        "seed": seed,
        "corpus": corpus.to_dict(),
        "train": [
            batch,
            POOL_BATCHES,
            WARMUP_FRACTION,
            WEIGHT_DECAY,
            GRAD_CLIP,
            MICRO_TOKENS,
            PRECISION,
        ],
        "problems": [mathgen.LEVEL_WEIGHTS, mathgen.VAL_BUCKETS],
        "templates": sorted(["/".join(k), v] for k, v in TEMPLATES["tiny"].items() if k[0] == task),
        "tokenizer": [SPECIAL_TOKENS, CHARACTERS, CHAT_TEMPLATE],
    }
    if task != "math":
        payload["task"] = task
        payload["version"] = CODE_CORPUS_VERSION
        payload["problems"] = [codegen.FAMILY_WEIGHTS, codegen.VAL_BUCKETS, codegen.N_TESTS]
    if threads != THREADS:
        payload["threads"] = threads
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def load_tiny(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """(model in eval mode, on the CPU, its weights cast to ``dtype``, tokenizer) from a folder
    written by :func:`pretrain_tiny`. The folder always holds the float32 weights pre-training
    made (:data:`PRECISION`); a run in bfloat16 casts its own copy here."""
    path = Path(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path, padding_side="left")
    with quiet_hf():
        model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval(), tokenizer


def _recipe(
    scale: str, steps: int | None, batch: int | None, threads: int | None
) -> tuple[int, int, int]:
    """(steps, examples per step, threads) of a pre-training, defaults filled in and checked."""
    spec = get_scale(scale)  # ValueError listing the valid names
    steps = spec.pretrain_steps if steps is None else steps
    batch = BATCH_EXAMPLES if batch is None else batch
    threads = THREADS if threads is None else threads
    if steps < 0:
        raise ValueError(f"pretraining steps must be >= 0, got {steps}")
    if batch < 1:
        raise ValueError(f"pretraining batch must be >= 1 example, got {batch}")
    if threads < 1:
        raise ValueError(f"pretraining threads must be >= 1, got {threads}")
    return steps, batch, threads


def tiny_path(
    scale: str = "tiny-s",
    *,
    cache_dir: str | Path | None = None,
    steps: int | None = None,
    seed: int = 0,
    corpus: CorpusConfig | CodeCorpusConfig | None = None,
    task: str = "math",
    batch: int | None = None,
    threads: int | None = None,
) -> Path:
    """The cache folder of a pre-trained tiny world (it holds ``meta.json`` once trained).
    ``steps``, ``batch`` (examples per step) and ``threads`` default to the scale's,
    :data:`BATCH_EXAMPLES` and :data:`THREADS`."""
    steps, batch, threads = _recipe(scale, steps, batch, threads)
    corpus = _check_task(task, corpus)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    tag = scale if task == "math" else f"{scale}-{task}"
    return root / f"{tag}-{cache_key(scale, steps, seed, corpus, task, batch, threads)}"


def pretrain_tiny(
    scale: str = "tiny-s",
    *,
    cache_dir: str | Path | None = None,
    steps: int | None = None,
    seed: int = 0,
    log: Log | None = None,
    corpus: CorpusConfig | CodeCorpusConfig | None = None,
    task: str = "math",
    threads: int | None = None,
    batch: int | None = None,
) -> Path:
    """Pre-train ``scale`` for ``task`` (or find it in the cache) and return its folder.
    ``threads``: torch threads while training (default :data:`THREADS`, whatever the machine's
    cores); the caller's setting is restored afterwards. The weights depend on it, and so does
    the key. ``steps`` and ``batch``: the recipe's optimizer steps and examples per step
    (:func:`tiny_path`)."""
    steps, batch, threads = _recipe(scale, steps, batch, threads)
    corpus = _check_task(task, corpus)
    recipe = {"steps": steps, "batch": batch, "threads": threads, "seed": seed, "task": task}
    final = tiny_path(scale, cache_dir=cache_dir, corpus=corpus, **recipe)
    if (final / "meta.json").exists():
        return final
    log = log or (lambda _msg: None)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{final.name}.lock"):
        if (final / "meta.json").exists():  # another process finished it while we waited
            return final
        # Holding the lock, any temporary folder of this key is a killed run's: remove it.
        for stale in root.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        log(f"pre-training {scale} ({task}) for {steps} steps of {batch} -> {final}")
        # Train in memory first: the temporary folder exists only for the seconds of the save,
        # so a run killed while training leaves nothing on disk.
        model, tokenizer, meta = _train(scale, steps, batch, seed, corpus, threads, log)
        meta["path"] = str(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            with quiet_hf():
                model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            if final.exists():  # a stale folder without meta.json: an older crash
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still protects the result
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def quiet_hf() -> Iterator[None]:
    """No progress bars from transformers while loading or saving weights (library code never
    prints; they leaked into the CLI's one-line errors and logs)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@dataclass
class _Batch:
    rows: list[tuple[list[int], list[int]]]  # (prompt ids, completion ids + eos), shortest first
    n_tokens: int  # real tokens, for throughput
    n_labels: int  # completion tokens: the loss is their mean over the whole batch


def encode(tokenizer: Any, batch: list[Example]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + eos) per example; the prompt ids equal
    ``chat_prompt_ids(tokenizer, example.prompt)`` (batched here for speed)."""
    prompts = [chat_prompt_text(tokenizer, e.prompt) for e in batch]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer([e.completion for e in batch], add_special_tokens=False)["input_ids"]
    return [(p, c + [tokenizer.eos_token_id]) for p, c in zip(p_ids, c_ids, strict=True)]


def batches(
    tokenizer: Any, corpus: CorpusConfig | CodeCorpusConfig, seed: int, size: int = BATCH_EXAMPLES
) -> Iterator[_Batch]:
    """Length-bucketed batches of ``size`` examples, forever, deterministic in ``seed``."""
    if isinstance(corpus, CodeCorpusConfig):
        stream = code_examples(corpus, seed)
    else:
        stream = examples(corpus, seed)
    rng = random.Random(f"marlow-tiny-batches-{seed}")
    while True:
        pool = [next(stream) for _ in range(size * POOL_BATCHES)]
        rows = sorted(encode(tokenizer, pool), key=lambda pc: len(pc[0]) + len(pc[1]))
        chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            n_tokens = sum(len(p) + len(c) for p, c in chunk)
            yield _Batch(chunk, n_tokens, sum(len(c) for _p, c in chunk))


def micro_batches(
    rows: list[tuple[list[int], list[int]]], pad: int, budget: int = MICRO_TOKENS
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels), each (b, T) right-padded to its own width, cutting ``rows`` (shortest
    first) into consecutive runs of at most ``budget`` padded tokens (a longer row goes alone).

    Why: one 64-row forward at the widest batches held ~1 GB of activations, and a new width
    every step left the heap fragmented (RSS grew to GBs). Bounded micro-batches cap both, and
    the summed loss is the same mean over the batch's completion tokens."""
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and (end + 1 - start) * _length(rows[end]) <= budget:
            end += 1
        run = rows[start:end]
        width = max(_length(r) for r in run)
        ids = [p + c + [pad] * (width - len(p) - len(c)) for p, c in run]
        labels = [[-100] * len(p) + c + [-100] * (width - len(p) - len(c)) for p, c in run]
        yield torch.tensor(ids), torch.tensor(labels)
        start = end


def _length(row: tuple[list[int], list[int]]) -> int:
    return len(row[0]) + len(row[1])


def batch_loss(model: Qwen3ForCausalLM, batch: _Batch, pad: int) -> float:
    """Mean cross-entropy over the batch's completion tokens, back-propagated one micro-batch at a
    time (gradients accumulate in ``.grad``); returns the loss. Right padding needs no attention
    mask under causal attention, and pads carry no label."""
    total = 0.0
    for ids, labels in micro_batches(batch.rows, pad):
        ids, labels = ids.to(model.device), labels.to(model.device)
        logits = model(input_ids=ids).logits[:, :-1]  # (b, T-1, V): position t predicts t+1
        loss = (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            / batch.n_labels
        )
        loss.backward()
        total += float(loss.detach())
    return total


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``peak / 10`` at the last step."""
    warmup = max(1, int(WARMUP_FRACTION * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def train(
    model: Qwen3ForCausalLM,
    tokenizer: Any,
    corpus: CorpusConfig | CodeCorpusConfig,
    *,
    steps: int,
    lr: float,
    seed: int,
    log: Log,
    batch: int = BATCH_EXAMPLES,
) -> dict[str, float | None]:
    """The pre-training loop; returns loss and throughput statistics."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )
    model.train()
    data = batches(tokenizer, corpus, seed, batch)
    pad = tokenizer.pad_token_id
    losses: list[float] = []
    tokens, t0 = 0, time.perf_counter()
    every = max(1, steps // 20)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            batch = next(data)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr)
            opt.zero_grad(set_to_none=True)
            losses.append(batch_loss(model, batch, pad))
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            tokens += batch.n_tokens
            if (step + 1) % every == 0 or step + 1 == steps:
                dt = time.perf_counter() - t0
                recent = sum(losses[-every:]) / len(losses[-every:])
                log(f"step {step + 1}/{steps} loss {recent:.4f} {tokens / dt:,.0f} tok/s {dt:.0f}s")
    seconds = time.perf_counter() - t0
    tail = losses[-20:]
    return {
        "train_seconds": seconds,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "tokens": float(tokens),
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
    }


def _train(
    scale: str,
    steps: int,
    batch: int,
    seed: int,
    corpus: CorpusConfig | CodeCorpusConfig,
    threads: int,
    log: Log,
) -> tuple[Qwen3ForCausalLM, Any, dict[str, Any]]:
    """(trained model in eval mode, tokenizer, meta) of one tiny world. Its accuracy is not
    measured here (the world does not import the rewards): see ``marlow.worlds.tinyeval``."""
    spec = get_scale(scale)
    task = "code" if isinstance(corpus, CodeCorpusConfig) else "math"
    t0 = time.perf_counter()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokenizer = build_tokenizer()
        model = build_model(scale, len(tokenizer), seed)
        stats = train(
            model,
            tokenizer,
            corpus,
            steps=steps,
            lr=spec.pretrain_lr,
            seed=seed,
            log=log,
            batch=batch,
        )
        model.eval()
    finally:
        torch.set_num_threads(previous)
    meta = {
        "scale": spec.to_dict(),
        "model_config": model.config.to_dict(),
        "corpus": corpus.to_dict(),
        "task": task,
        "corpus_version": CODE_CORPUS_VERSION if task == "code" else CORPUS_VERSION,
        "steps": steps,
        "seed": seed,
        "lr": spec.pretrain_lr,
        "batch_examples": batch,
        "precision": PRECISION,
        "threads": threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "seconds": time.perf_counter() - t0,
        **stats,
    }
    return model, tokenizer, meta
