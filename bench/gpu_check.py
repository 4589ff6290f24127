"""The GPU check: what marlow does on one CUDA GPU, measured in one go and written to one JSON.

    bench/gpu_check.sh OUT                        on the GPU machine (installs .whl/ first)
    python bench/gpu_check.py --out OUT [--device cuda] [--budget-s 550]
    python bench/gpu_check.py --out OUT --device cpu --dry-run     the smallest sizes, on the CPU

It writes ``OUT/gpu_check.json``, rewritten after every part so that a check stopped half-way
leaves what it measured, and appends every child process's output to ``OUT/gpu_check.log``.
The parts, each recorded whatever became of the others:

1. **environment**: the GPU (name, memory, compute capability), the driver, CUDA, Python, and the
   version of every package marlow needs, with those outside ``pyproject.toml``'s ranges. The
   GPU is read by a child process, so this process never holds a CUDA context of its own.
2. **sampler**: marlow's HF rollout engine alone (:class:`marlow.rollout.hf.HFEngine` with its
   defaults: ``max_batch`` 256, the lean forward, unmerged adapters, every adapter's rows in one
   pass, the decode step compiled on CUDA and eager on the CPU), in one child process: a
   stand-in of the 0.6B (the 0.6B entry of the sizes below, its ``shrink`` and ``threads``
   included), drawn on the device by :func:`marlow.archs.stand_in.save_stand_in` in that child
   (which ends with its CUDA context, as a stand-in child of the sizes does) and loaded as a run
   loads its base (:func:`marlow.models.load_base`, bfloat16), with :data:`SAMPLER`'s 4 LoRA
   adapters of rank 64 (alpha 32, the paper's) on every linear. ``attach_adapters`` starts each B
   factor at zero (every adapter would compute the base), so they are drawn from a normal of the
   config's ``initializer_range`` (0.02) as standard deviation. For each batch of ``rows`` rows,
   once with 1 adapter and once with 4 mixed (row i answered by adapter i mod 4): distinct short
   prompts (``Problem i: what is i + i?``, 25-31 bytes, one token a byte), temperature 1.0,
   ``new_tokens`` new tokens (the stop id is the vocabulary size, an id no row samples, so every
   row runs to the limit), each decode step attending by SDPA over its span (the engine's
   default); then the ``blocks_rows`` batches (64 and 256) with 4 adapters once more, each
   decode step attending by flex attention over each row's own blocks of columns
   (:func:`marlow.rollout.lean.attention_by_blocks`: what that gives, side by side); last, the
   ``eager_rows`` batch once more with 4 adapters and the decode step eager
   (``compile=False``: what compiling gives, side by side), for
   ``eager_tokens`` new tokens (on an H200 its 512 took the part's last 100 s and did not
   finish: a step of eager kernels is that slow); one untimed warm-up call
   (``warmup_s``: it compiles and captures CUDA graphs on first use), then the timed call (another seed): tokens/s = rows x new tokens / seconds (the
   device synchronized around it), on CUDA its peak allocated memory, and what the process's
   compiled decode steps have given up so far (``given_up``:
   :func:`marlow.rollout.lean.given_up`, each after a warning in the log). Each ``profile_rows``
   batch (64 and 256) with 4 adapters, by either attention, is then sampled once more for
   ``profile_tokens`` new tokens under
   ``torch.profiler`` (:func:`profiled`: on CUDA the kernels its graph replays launch, how
   many, their seconds and the longest of them), to say where a decode step's time goes.
   Before the eager batch, **refill** (:class:`Refill`, :func:`measure_refill`): one call of
   256 rows, 4 adapters mixed, at most 64 at a time (``max_batch``), 256 new tokens, a random
   32nd of the vocabulary's ids stopping a row (so completions end at scattered lengths, a
   few at the limit), a seed per request; with ``rollout.refill`` off (batches of 64 one after
   the other, each until its longest row ends), on (waiting rows take stopped rows'
   places), and on with each step's attention flex attention over each row's own blocks (rows
   at scattered columns: what reading only those gives there): sampled tokens/s of each, the
   mean and longest completion, and the share of rows that sampled the same tokens with
   refill off and on.
   Beside each, the bound
   of the device's memory bandwidth, the tokens/s of one decode step that serves every row at
   once and reads each byte it needs once::

       bytes per step = W + k x A + rows x (prompt + new tokens / 2) x 2 x L x g x d x b
       bound tokens/s = rows / (bytes per step / bandwidth)

   W is the base's weights (its distinct parameters: a tied embedding once, the LM head
   included; an untied input embedding would count whole, though a step reads only its rows), A
   one adapter's LoRA factors (float32, as PEFT keeps them beside a bfloat16 base), k the
   adapters the rows use; the last term is the KV cache read (keys and values of L layers, g
   key-value heads of d dimensions, b = 2 bytes; :func:`marlow.plan.kv_cache_bytes`) at the
   call's average context: the rows' mean prompt plus half the new tokens. The bandwidth is
   measured in the same child: bytes read + written per second of :data:`COPY_REPEATS`
   back-to-back device-to-device ``copy_`` calls of :data:`COPY_BYTES` (after an untimed one).

   Time: the part takes at most :data:`SAMPLER_S` of the budget, and never the time the first
   size's runs need to start (its ``min_s`` per routing); the child's start, the stand-in and the
   loading count. Configurations run by rows, so the 256-row ones come last but the eager one;
   each starts only
   with its estimated seconds left: 2 x new tokens (warm-up and timed call) x the most seconds
   per decode step of the timed calls so far (the first starts with any time left; a
   compilation on the way is not in the estimate). The estimate takes a step's time not to grow
   with the rows, as where a forward is bound by launches; where it grows (the KV cache reads of
   256 rows), a configuration the part's end cuts off is recorded as stopped.
3. **sizes**: for each size of :data:`SIZES` (:data:`DRY_SIZES` with ``--dry-run``), a stand-in
   of its architecture with random bfloat16 weights (:func:`marlow.archs.stand_in.save_stand_in`),
   its update measured alone (below), then trained by ``marlow train`` in a child process, once
   per routing: Voting, the paper preset
   (LoRA rank 64 on every linear, ``rollout.max_batch`` 48, ``grpo.micro_tokens`` 6,144), the HF
   rollout loop. Per step: rollout and learn seconds (the learn phase's parts:
   :data:`LEARN_PARTS`), sampled tokens per second, and the peak device memory of each phase
   (the trainer's ``memory/*`` metrics; none off CUDA). Beside them, ``marlow plan``'s
   prediction for the same config (:func:`marlow.plan.plan_run`) at the run's own longest
   prompt and on the card (``--gpu-mem`` of its memory: the update's layers checkpointed or
   not as the run's trainer resolves ``grpo.activation_checkpointing``), and the ratios
   measured / predicted of the peak allocated memory: the step's (both phases) against plan's
   peak, the rollout's against base + adapters + KV cache, the learn phase's against base +
   adapters + activations.

   **The update alone**, in one child process per size, right after its stand-in is drawn and
   before its runs: the stand-in loaded as a run loads its base (:func:`marlow.models.load_base`,
   bfloat16, as the paper preset's runs have it on the CPU too), one LoRA adapter of rank 64
   (alpha 32) on every linear (:func:`marlow.policy.adapters.attach_adapters`), active and in
   ``train()`` mode, and for each micro-batch of :data:`UPDATE` (:data:`DRY_UPDATE`): rows of
   ``row`` tokens, the first ``prompt`` of them prompt and the rest completion, every id drawn
   uniformly below the vocabulary (seed 0); ``score_chunk(model, chunk, temperature=1.0,
   entropy=False)`` (:func:`marlow.training.logprobs.score_chunk`: the chunked head where it
   applies; no entropies, as an update whose logp_old was scored before it), the loss
   ``-(logp x mask).sum() / mask.sum()`` and its ``backward()``. One untimed warm-up pass, an
   AdamW step (torch's defaults; so that the timed pass runs beside the adapter's two float32
   moments, as a learn phase does and as plan counts), then the timed pass, which adds its
   gradients to the warm-up's as a mini-batch's later micro-batch does (the device synchronized
   around it; on CUDA its peak allocated memory, the peak reset before it); the first
   micro-batch's pass once more under ``torch.profiler`` (:func:`profiled`). The figures::

       tokens/s = tokens / seconds
       FLOPs    = 4 x (N + n) x tokens + 4 x L x tokens x c x a x d x 2
       fraction of bf16 peak = FLOPs / seconds / (measured bf16 matmul FLOP/s)

   N is the base's non-embedding parameters (:func:`marlow.plan.non_embedding_parameters`: the
   input embedding and the tied output embedding left out), n the adapter's; 4 = 2 for the
   forward's multiply-adds and 2 for the backward's input gradients (the frozen base has no
   weight gradients). The attention's two matmuls (scores, and their product with the values)
   take 4 x tokens x c x a x d a layer (L layers, a query heads of d dimensions) at the rows'
   mean causal context c = (row + 1) / 2, x 2 for its backward counted as one forward. Left
   out: the LM head's matmuls (the completion tokens' forward, and the backward's recomputation
   and gradient), the adapter's weight gradients, and the attention backward's work beyond one
   forward; so the fraction is a lower bound of the card's use. The decoder layers are
   checkpointed first (``grpo.activation_checkpointing=on``,
   :func:`marlow.models.checkpoint_layers`), so the backward runs each layer's forward again:
   FLOPs the formula leaves out too (it counts the work the update needs, not the recompute,
   about one forward more). The card's bf16 matmul
   throughput is measured in the same child: :data:`MATMUL_REPEATS` products of two square
   bfloat16 matrices of side :data:`MATMUL_N` (by device type) after an untimed one, 2 x n^3
   FLOPs each.

   Beside each micro-batch, ``marlow plan``'s prediction for the same, from the formulas
   :func:`marlow.plan.plan_run` uses: base (the distinct parameters x 2 bytes) + the adapter
   (:data:`marlow.plan.OPTIMIZER_BYTES` x its parameters) + activations
   (:func:`marlow.plan.activation_bytes` at the micro-batch's tokens, layers checkpointed, from
   :func:`marlow.plan.lora_shapes` of the adapter and the chunked head where
   :func:`marlow.models.decoder_and_head` applies), and the ratio measured / predicted of the
   peak allocated memory (None off CUDA).

   The layers are eager, as a run's are by default (``grpo.compile`` auto). After the last
   micro-batch, each that succeeded is timed once more with its layers not checkpointed
   (``grpo.activation_checkpointing=off``; ``unchecked``: the same warm-up and timed passes, the
   peak allocated memory and plan's prediction without checkpointing), side by side: what the
   recomputation costs in time (about one forward of the layers more: the 4 of the formula's
   factor become 6) and saves in memory, where the time left passes the estimate (2 x the
   checkpointed pass's seconds; always in the dry run, so that CI runs that path) and plan's
   peak fits the card (:func:`time_unchecked`; the 4B's 32,768 tokens would not fit an H200).
   Then the first micro-batch once more, checkpointed, through transformers' own rotary
   embedding, once more through ``torch.utils.checkpoint`` and once more with an LM head whose
   backward computes its chunks' logits again (the row's ``side_by_side``), each beside the
   row's, which runs marlow's own (:func:`marlow.models.fuse_rotary`, as a run's loaded base
   does; marlow's recomputation of checkpointed layers; the head's slopes taken in the
   forward): :func:`time_instead`, :data:`SIDE_BY_SIDE`. Last, every micro-batch once more with
   its decoder layers and its LM head's chunks compiled (``grpo.compile=on``), checkpointed
   and, where its eager layers were timed so, not checkpointed, beside the eager figures, the
   first's compiled pass profiled: :func:`time_compiled`.

   Time: the child takes at most the size's ``update_s`` (100 s for the 0.6B, 110 for the
   1.7B, 120 for the 4B: the child's start, the load, the matmuls, the passes and the
   compilation of the layers count; the 0.6B's took 24 s on an H200 without that
   compilation, the 1.7B's 23 and the 4B's 31), and runs only
   with the size's ``min_s`` per routing plus ``update_s`` left, so that its runs keep the time
   they need to start; otherwise it is skipped. The first micro-batch runs with any time left;
   each next one only after the one before succeeded and with its estimate left: 2 (warm-up
   and timed pass) x the one before's timed seconds x the ratio of their tokens. Plan predicts
   2.70 and 5.49 GiB for the 0.6B's two micro-batches, 5.99 and 11.21 for the 1.7B's, 12.20
   and 20.40 for the 4B's: every one fits an H100. What the part costs the default budget
   comes out of the runs after it: at most ``update_s`` a size, mostly the child's start, the
   loading of the stand-in and the compilation, the passes that fit being a fraction of a
   second each at an H100's bf16 rate (by the formula above, 18 TFLOPs for the 0.6B's 8,192
   tokens, 128 for the 4B's).

4. **tests**, last, with the time left (at most :data:`TESTS_S`, and only with
   :data:`MIN_TESTS_S` left): the device tests (:data:`DEVICE_TESTS`; ``tests/conftest.py``'s
   ``MARLOW_TEST_DEVICE`` set to the device) in pytest: passed, failed, errors, skipped, and the
   failures' names, from pytest's JUnit XML. Last, because CI runs the same tests on the CPU
   and the figures are what only a GPU gives; a lease whose call ends before them runs them in
   a second call (``--skip sampler --skip update --skip runs``).

Lengths: the study's Voting math sampled up to 5,120 new tokens for 64 problems x 8 episodes a
step; here two steps of 4 problems x 4 episodes (48 generator turns: one rollout batch of 48) of
64 new tokens, validated on 1 problem before and after, with stand-ins of the 0.6B (both
routings), the 1.7B and the 4B (IP). The second step is what a run's steps cost once the first
has warmed up (on an H200 the first learn phase of the 0.6B's IP run took 9.0 s, its SP run's
3.2 s, with one step each; on the CPU's Python-bound stand-in, 28 layers at width 64, the IP
learn phases took no longer than SP's), and shows whether the first left memory behind
(``learn_start_allocated_gib``); it costs each run its second step's seconds. Sized from the
first checks on one H100 (HF rollout loop, bfloat16), where sampling is bound by the Python of
each forward: a 0.6B IP run of two 256-token steps with 2 validation problems took 248 s (its
second step 35 s of rollout and 4 s of learning, its first 62 s and 18 s: warm-up), and of one
128-token step with 1 validation problem 140 s (42 s of rollout, 17 s of learning). The budget,
not the estimate, bounds the check; a size starts only with its ``min_s`` left, so that no run
is started to be stopped half-way. A stand-in's noise almost never samples the end token, so
nearly every turn runs to its limit and every run's steps have the same size.

Failures are data: a run that fails (an out-of-memory error, a crash) is recorded with the steps
it finished and the last line it printed; one that outlasts the time left is stopped and recorded
likewise; one that printed its summary but has not exited :data:`EXIT_GRACE_S` later is stopped
and recorded as "exit_timeout" with its steps (the sampler's and the update's children
likewise, after their last line, :data:`CHILD_DONE`); a stopped child writes its threads' stacks
to the log first (Python's ``faulthandler``); a size whose minimum time is no longer left is
recorded as skipped. A sampler configuration that raises (an out-of-memory error) is recorded as
failed and the next one runs; one the sampler's child was running when it crashed or was stopped
takes its status and last line, and those it never reached are recorded as skipped; the
update's micro-batches likewise, and the size's runs go on. The exit status is 1 when anything
failed, else 0; the JSON is written either way.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from marlow.fileio import write_json

# marlow's other modules are imported where a part needs them, so that a package missing on the
# GPU machine fails that part alone (recorded in the JSON) and not the check
if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from marlow.config import RunConfig
    from marlow.rollout.hf import HFEngine
    from marlow.training.batch import Chunk
    from marlow.types import GenRequest

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30

DEVICE_TESTS = (
    "tests/unit/test_device.py",
    "tests/integration/test_precision.py",
    "tests/integration/test_engine_sync.py",
)
"""The tests that put their tensors on ``MARLOW_TEST_DEVICE``."""
DRY_TESTS = ("tests/unit/test_device.py",)
TESTS_S = 240
"""The most seconds the tests part may take."""
MIN_TESTS_S = 30
"""The tests part runs only with this many seconds of the budget left."""
MIN_RUN_S = 30
"""A run starts only with this many seconds of the budget left."""
EXIT_GRACE_S = 15.0
"""The seconds a run has to exit after its summary (:meth:`Check.child`'s ``final``)."""
PHASES = ("rollout", "learn")
KINDS = ("allocated", "reserved")


@dataclass(frozen=True)
class Size:
    """One model size of the check and the settings its runs use."""

    name: str  # the label in the JSON and the docs
    arch: str  # a shipped architecture (marlow.archs)
    routings: tuple[str, ...]
    steps: int
    problems: int  # grpo.batch_problems
    group: int  # grpo.group_size
    new_tokens: int  # rollout.max_new_tokens
    val_problems: int  # task.val_size
    min_s: float = MIN_RUN_S  # start each run only with this many seconds of the budget left
    update_s: float = 100  # the most seconds of the update alone (module docstring)
    micro_tokens: int | None = None  # grpo.micro_tokens (None: the paper preset's 6,144)
    threads: int | None = None  # torch threads (None: every core)
    shrink: dict[str, int] = field(default_factory=dict)  # config fields over the arch's


SIZES = (
    Size("qwen3-0.6b", "qwen3-0.6b", ("ip", "sp"), 2, 4, 4, 64, 1, min_s=60),
    Size("qwen3-1.7b", "qwen3-1.7b", ("ip",), 2, 4, 4, 64, 1, min_s=75, update_s=110),
    Size("qwen3-4b", "qwen3-4b", ("ip",), 2, 4, 4, 64, 1, min_s=90, update_s=120),
)
DRY_SIZES = (
    # The 0.6B's vocabulary (which the stand-in's tokenizer needs) on 2 narrow layers; short
    # micro-batches keep its (tokens, 151,936) logits small on a CPU. One thread: on a 2-core
    # CPU shared with other work an IP run took 46 s with two, 8 s with one. The update's
    # bound is a CPU's: on one without native bfloat16 (AVX2) bfloat16 matmuls run at a fifth
    # of float32's (bench/half_matmul.py), and the update child took 16 s of its 150 at
    # micro-batches of 32 and 128 on a 2-core Zen 3.
    Size(
        "qwen3-0.6b-shrunk",
        "qwen3-0.6b",
        ("ip", "sp"),
        1,
        1,
        2,
        8,
        1,
        update_s=150,
        micro_tokens=512,
        threads=1,
        shrink={
            "num_hidden_layers": 2,
            "max_window_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
        },
    ),
)


@dataclass(frozen=True)
class Refill:
    """The sampler part's call of more rows than ``max_batch`` whose rows stop at scattered
    lengths, sampled with ``rollout.refill`` off and on (module docstring)."""

    rows: int
    max_batch: int
    new_tokens: int
    stop_share: float  # the share of the vocabulary's ids that stop a row (drawn at random)


@dataclass(frozen=True)
class Sampler:
    """The sampler part's configurations (module docstring)."""

    rows: tuple[int, ...]  # the batches, each sampled with 1 adapter and with ``adapters`` mixed
    new_tokens: int  # SamplingParams.max_new_tokens
    eager_rows: int  # the batch sampled once more with ``adapters`` mixed, the step eager
    eager_tokens: int  # the new tokens of that eager call
    profile_rows: tuple[int, ...]  # the batches whose ``adapters``-mixed call is profiled
    profile_tokens: int  # the new tokens of the profiled call
    refill: Refill | None = None  # the call measured with rows refilled and without
    blocks_rows: tuple[int, ...] = ()  # the batches sampled once more, flex attention by blocks
    adapters: int = 4
    rank: int = 64  # LoRA rank, alpha 32 (LoraSpec's defaults: the paper's)
    temperature: float = 1.0


SAMPLER_ARCH = "qwen3-0.6b"
"""The architecture the sampler part samples: its entry of :data:`SIZES` (:data:`DRY_SIZES`)."""
SAMPLER = Sampler(
    (16, 64, 256), 512, 16, 64, (64, 256), 64, Refill(256, 64, 256, 1 / 32), (64, 256)
)
DRY_SAMPLER = Sampler((2, 4), 8, 4, 4, (4,), 4, Refill(8, 4, 8, 1 / 4), (4,))
SAMPLER_S = 230
"""The most seconds the sampler part may take."""
COPY_BYTES = {"cuda": GIB, "cpu": 64 * 2**20}
"""The buffer whose device-to-device copy measures the bandwidth, by device type."""
COPY_REPEATS = 5


@dataclass(frozen=True)
class Update:
    """The update-alone measurement's micro-batches (module docstring)."""

    tokens: tuple[int, ...]  # the micro-batches, each run after the one before succeeded
    row: int  # tokens a row
    prompt: int  # prompt tokens a row (the rest is completion)
    rank: int = 64  # LoRA rank, alpha 32 (LoraSpec's defaults: the paper's)
    temperature: float = 1.0


UPDATE = Update((8192, 32768), 1024, 256)
UNCHECKED_MARGIN = 1.1
"""A micro-batch is timed with its layers not checkpointed only where plan's peak for it, times
this, fits the device's memory left to the process (free, and what its allocator holds)."""
DRY_UPDATE = Update((32, 128), 16, 8)
UPDATE_ADAPTER = "policy"
"""The adapter's name ("update" is taken: PEFT keeps adapters in ``ModuleDict``s)."""
MATMUL_N = {"cuda": 8192, "cpu": 256}
"""The side of the square bfloat16 matrices whose products measure the matmul throughput."""
MATMUL_REPEATS = 5
PROFILE_TOP = 15
"""The kernels (operations) a profile names, the longest first."""
KERNEL_KINDS = {
    "attention": ("flash", "fmha", "attention", "sdpa", "flex"),
    "matrix products": (
        "gemm",
        "nvjet",
        "cutlass",
        "xmma",
        "cublas",
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
    ),
}
"""What a kernel's (an aten operation's) name holds, lower-cased, for :func:`kernel_kind`: the
first kind that matches (attention first: a memory-efficient attention kernel's name holds
"cutlass" too); any other is "the rest" (elementwise work, reductions, copies)."""


def kernel_kind(name: str) -> str:
    """The :data:`KERNEL_KINDS` kind of a profiled kernel or aten operation, else "the rest"."""
    low = name.lower()
    for kind, marks in KERNEL_KINDS.items():
        if any(mark in low for mark in marks):
            return kind
    return "the rest"


PROBE = """\
import json, sys, torch
from marlow.models import resolve_device
device = resolve_device(sys.argv[1])
out = {"device": str(device), "torch_cuda": torch.version.cuda}
if device.type == "cuda":
    p = torch.cuda.get_device_properties(device)
    out.update(gpu=p.name, gpu_memory_gib=p.total_memory / 2**30,
               capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
               cudnn=torch.backends.cudnn.version(), bf16=torch.cuda.is_bf16_supported())
print(json.dumps(out))
"""
"""Run in a child process: the device as marlow resolves it, and the GPU's properties."""


class Check:
    """The check's JSON and log, and its clock."""

    def __init__(self, out: Path, device: str, dry_run: bool, budget_s: float) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "gpu_check.json"
        self.log: TextIO = (out / "gpu_check.log").open("a", buffering=1)
        self.deadline = time.monotonic() + budget_s
        self.started = time.monotonic()
        self.result: dict[str, Any] = {
            "check": {
                "started": datetime.now(UTC).isoformat(timespec="seconds"),
                "device": device,
                "dry_run": dry_run,
                "budget_s": budget_s,
            }
        }

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, line: str) -> None:
        stamped = f"[gpu_check {time.monotonic() - self.started:6.1f} s] {line}"
        print(stamped, flush=True)
        self.log.write(stamped + "\n")

    def save(self) -> None:
        self.result["check"]["seconds"] = round(time.monotonic() - self.started, 1)
        write_json(self.path, self.result)

    def child(
        self,
        command: list[str],
        timeout: float,
        env: dict | None = None,
        final: str | None = None,
    ) -> dict:
        """Run ``command`` from the repository root, its output appended to the log, stopped
        (its whole process group) after ``timeout`` seconds: status, seconds, and the last line
        it printed when it failed.

        ``final`` marks the child's last line of work (``marlow train``'s summary): once a line
        holding it is printed, the child has :data:`EXIT_GRACE_S` more to exit, and one that
        does not is stopped with the status "exit_timeout" (its work done, its exit hung)
        rather than left to take the rest of the budget. A child stopped either way gets SIGABRT
        first, so that Python's ``faulthandler`` (``PYTHONFAULTHANDLER``, set for every child)
        writes each thread's stack to the log: where it was, or where its exit hung."""
        self.log.flush()
        start = self.log.tell()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = t0 + max(timeout, 1)
        status, rc, seen = "timeout", None, start
        while (now := time.monotonic()) < deadline:
            try:
                rc = proc.wait(timeout=min(1.0, deadline - now))
                status = "ok" if rc == 0 else "failed"
                break
            except subprocess.TimeoutExpired:
                pass
            if final is not None and seen >= 0:
                seen = _find(self.log.name, seen, final)
                if seen < 0:  # the final line is out: from now on, the grace
                    deadline = min(deadline, time.monotonic() + EXIT_GRACE_S)
                    status = "exit_timeout"
        last = _last_line(self.log.name, start)  # before the stacks below follow it
        if rc is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGABRT)  # faulthandler: the stacks, to the log
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=3)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        out: dict[str, Any] = {"status": status, "seconds": round(time.monotonic() - t0, 1)}
        if status != "ok":
            out["rc"] = rc
            out["error"] = last or f"exit status {rc}"
            if status == "timeout":
                out["error"] = f"stopped after {timeout:.0f} s (the budget); last: {out['error']}"
            elif status == "exit_timeout":
                out["error"] = (
                    f"its work done, it did not exit within {EXIT_GRACE_S:.0f} s and was "
                    "stopped (the threads' stacks are in the log)"
                )
        return out


def _find(path: str, offset: int, text: str) -> int:
    """-1 when ``text`` is in the file at ``path`` after byte ``offset``; else the offset to
    search from next time (a little before the end, so that a line split by a write is found)."""
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    if text.encode() in chunk:
        return -1
    return max(offset, offset + len(chunk) - len(text.encode()))


def _last_line(path: str, start: int) -> str:
    with open(path, "rb") as f:
        f.seek(start)
        lines = [x.strip() for x in f.read().decode(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else ""


# -- 1. environment ---------------------------------------------------------------------------


def environment(device: str) -> dict[str, Any]:
    """The device and GPU (from a child process), the driver, Python and package versions."""
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, device], cwd=ROOT, capture_output=True, text=True
    )
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"]
        raise RuntimeError(f"--device {device}: {lines[-1].split('Error: ', 1)[-1]}")
    out: dict[str, Any] = json.loads(probe.stdout.strip().splitlines()[-1])
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        smi = subprocess.run(query, capture_output=True, text=True)
        out["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    out["python"] = sys.version.split()[0]
    out["packages"], out["unmet"] = packages()
    return out


def packages() -> tuple[dict[str, str | None], list[str]]:
    """The installed version of every package ``pyproject.toml`` requires (and pydantic-core,
    accelerate), and the requirements they do not meet."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = [Requirement(r) for r in project["dependencies"]]
    names = [r.name for r in required] + ["pydantic-core", "accelerate"]
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    unmet = [
        f"{r} (installed: {versions[r.name]})"
        for r in required
        if versions[r.name] is None or not r.specifier.contains(versions[r.name], True)
    ]
    return versions, unmet


# -- 2. tests ---------------------------------------------------------------------------------


def run_tests(check: Check, device: str, files: tuple[str, ...], work: Path) -> dict[str, Any]:
    """The device tests on ``device``: counts and failures from pytest's JUnit XML."""
    xml = work / "tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", f"--junitxml={xml}", *files]
    timeout = min(TESTS_S, check.left())
    if timeout < MIN_TESTS_S:
        check.say(f"tests: skipped, {check.left():.0f} s of the budget left")
        return {"files": list(files), "status": "skipped", "error": "not enough of the budget left"}
    out = {"files": list(files), **check.child(command, timeout, {"MARLOW_TEST_DEVICE": device})}
    if xml.exists():
        out.update(junit_counts(xml))
    return out


def junit_counts(xml: Path) -> dict[str, Any]:
    """Tests, failures, errors, skipped and passed, and each failure's test and first line."""
    root = ET.parse(xml).getroot()
    suites = list(root.iter("testsuite"))
    kinds = ("tests", "failures", "errors", "skipped")
    counts: dict[str, Any] = {k: sum(int(s.get(k, 0)) for s in suites) for k in kinds}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = []
    for case in root.iter("testcase"):
        bad = case.find("failure")
        bad = case.find("error") if bad is None else bad
        if bad is not None:
            message = (bad.get("message") or "").strip().splitlines()
            failed.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:200]}")
    counts["failed_tests"] = failed
    return counts


# -- 3. sampler -------------------------------------------------------------------------------


SAMPLER_CHILD = """\
import json, sys
sys.path.insert(0, "bench")
from gpu_check import CHILD_DONE, sample
sample(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), float(sys.argv[5]))
print(CHILD_DONE, flush=True)
"""
"""Run in a child process from the repository root: :func:`sample`, given the dry run as JSON and
the deadline as a number; last, :data:`CHILD_DONE`."""
CHILD_DONE = "gpu_check child: done"
"""The last line a part's child prints, its work done (:meth:`Check.child`'s ``final``): a child
whose exit then hangs is stopped after :data:`EXIT_GRACE_S`, not at its part's time."""
NOT_REACHED = "the part's child process ended before it"


def sampler_size(sizes: tuple[Size, ...]) -> Size:
    """The entry of ``sizes`` whose stand-in the sampler part samples (:data:`SAMPLER_ARCH`)."""
    return next(s for s in sizes if s.arch == SAMPLER_ARCH)


def configurations(sampler: Sampler) -> list[dict[str, Any]]:
    """Each configuration of ``sampler``, in the order they run: by rows, 1 adapter then all,
    with the engine's own choice of a compiled step (``compile`` None, ``attention`` "span":
    SDPA over each step's span); each ``blocks_rows`` batch with all adapters once more, its
    attention flex attention over each row's own blocks of columns (``attention`` "rows":
    :func:`marlow.rollout.lean.attention_by_blocks`, side by side); and last the
    ``eager_rows`` batch with all adapters eager (``compile`` False: the slowest per step)."""
    n = sampler.new_tokens
    out = [
        {"rows": rows, "adapters": k, "new_tokens": n, "compile": None, "attention": "span"}
        for rows in sampler.rows
        for k in (1, sampler.adapters)
    ]
    blocks = [
        {"rows": rows, "adapters": sampler.adapters, "new_tokens": n, "compile": None}
        for rows in sampler.blocks_rows
    ]
    eager = {
        "rows": sampler.eager_rows,
        "adapters": sampler.adapters,
        "new_tokens": sampler.eager_tokens,
    }
    return [
        *out,
        *(c | {"attention": "rows"} for c in blocks),
        eager | {"compile": False, "attention": "span"},
    ]


def measure_sampler(check: Check, device: str, dry_run: bool, work: Path) -> dict[str, Any]:
    """The sampler part (module docstring) in one child process: its figures, and every
    configuration's (one the child was sampling when it ended takes the child's status and
    error; one it did not reach is skipped)."""
    sampler, sizes = (DRY_SAMPLER, DRY_SIZES) if dry_run else (SAMPLER, SIZES)
    out: dict[str, Any] = {"settings": {"arch": SAMPLER_ARCH, **asdict(sampler)}}
    seconds = min(SAMPLER_S, check.left() - sizes[0].min_s * len(sizes[0].routings))
    if seconds < MIN_RUN_S:
        check.say(f"sampler: skipped, {check.left():.0f} s of the budget left")
        skipped = {"status": "skipped", "error": "not enough of the budget left"}
        out.update(skipped, configurations=[c | skipped for c in configurations(sampler)])
        return out
    check.say(f"sampler: at most {seconds:.0f} s")
    path, folder = work / "sampler.json", work / "sampler"
    deadline = time.monotonic() + seconds  # CLOCK_MONOTONIC: the child's clock too
    args = [str(path), str(folder), device, json.dumps(dry_run), repr(deadline)]
    child = [sys.executable, "-c", SAMPLER_CHILD, *args]
    out.update(check.child(child, seconds, final=CHILD_DONE))
    shutil.rmtree(folder, ignore_errors=True)
    read_child(out, path, "configurations", configurations(sampler))
    for row in out.get("refill", []):  # the way it was sampling when the child ended
        if row["status"] == "running":
            row.update(status=out["status"], error=out["error"])
    return out


def read_child(out: dict[str, Any], path: Path, key: str, planned: list[dict]) -> None:
    """Into ``out`` (a part's entry, with its child's status and error): the figures the child
    wrote to ``path``, and under ``key`` its rows: the one it was at when it ended ("running")
    takes the child's status and error, and those of ``planned`` it never reached are skipped."""
    measured = json.loads(path.read_text()) if path.exists() else {}
    reached = measured.pop(key, [])
    out.update(measured)
    out[key] = [
        r | {"status": out["status"], "error": out["error"]} if r["status"] == "running" else r
        for r in reached
    ]
    out[key] += [{**r, "status": "skipped", "error": NOT_REACHED} for r in planned[len(reached) :]]


def sample(out: str, folder: str, device: str, dry_run: bool, deadline: float) -> None:
    """The sampler part's measurements (module docstring), in its child process, written to
    ``out`` as JSON before and after every configuration so that what was measured outlives a
    crash; a configuration that raises (an out-of-memory error) is recorded as failed and the
    next one runs. ``deadline``: the :func:`time.monotonic` at which the part ends."""
    import torch

    from marlow.models import resolve_device
    from marlow.policy.adapters import adapter_names
    from marlow.rollout.hf import HFEngine
    from marlow.rollout.lean import attention_by_blocks, given_up
    from marlow.types import GenRequest, SamplingParams

    sampler, sizes = (DRY_SAMPLER, DRY_SIZES) if dry_run else (SAMPLER, SIZES)
    size = sampler_size(sizes)
    if size.threads is not None:
        torch.set_num_threads(size.threads)
    dev = resolve_device(device)
    model, tokenizer, result = adapted_stand_in(size, sampler, folder, dev)
    bandwidth = result["bandwidth_bytes_per_s"] = copy_bandwidth(dev, COPY_BYTES[dev.type])
    result["configurations"] = []
    names = adapter_names(model)
    engines = {
        flag: HFEngine(model, tokenizer, stop_ids=[model.config.vocab_size], compile=flag)
        for flag in (None, False)
    }
    prompts = [
        tokenizer.encode(f"Problem {i}: what is {i} + {i}?", add_special_tokens=False)
        for i in range(max(sampler.rows))
    ]
    per_token = 0.0  # the most seconds per new token (one decode step) of a timed call so far
    for row in configurations(sampler):
        if row["compile"] is False and sampler.refill is not None:  # before the slowest call
            result["refill"] = []
            measure_refill(model, tokenizer, sampler, dev, deadline, per_token, result, out)
        result["configurations"].append(row)
        n, k = row["new_tokens"], row["adapters"]
        estimate, left = 2 * n * per_token, deadline - time.monotonic()
        if estimate > left:
            row.update(status="skipped", error=f"estimated {estimate:.0f} s, {left:.0f} s left")
            write_json(out, result)
            continue
        row["status"] = "running"
        write_json(out, result)
        step = "eager" if row["compile"] is False else "default"
        print(f"sampler: {row['rows']} rows, {k} adapters, {step} step", flush=True)
        requests = [GenRequest(prompts[i], names[i % k]) for i in range(row["rows"])]
        try:
            engine = engines[row["compile"]]
            how = attention_by_blocks if row["attention"] == "rows" else contextlib.nullcontext
            with how():
                timed = time_calls(engine, requests, sampler, n, dev)
            del timed["samples"]
            row.update(timed, compiled=engine.compiled, given_up=given_up(dev))
        except Exception as err:
            row.update(status="failed", error=one_line(err))
            print(f"sampler: {row['error']}", flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()  # what the failed call held, for the next one
            write_json(out, result)
            continue
        per_token = max(per_token, row["seconds"] / n)
        context = sum(len(r.prompt_ids) for r in requests) / len(requests) + n / 2
        lora = len({r.adapter for r in requests}) * result["adapter_bytes"]
        step = result["weight_bytes"] + lora + row["rows"] * context * result["kv_bytes_per_token"]
        bound = row["rows"] / (step / bandwidth)
        row.update(
            status="ok",
            context_tokens=context,
            step_bytes=step,
            bound_tokens_per_s=bound,
            fraction_of_bound=row["tokens_per_s"] / bound,
        )
        mixed = (k, row["compile"]) == (sampler.adapters, None)  # either attention
        if mixed and row["rows"] in sampler.profile_rows:
            params = SamplingParams(sampler.temperature, sampler.profile_tokens, 2)
            with how():  # the attention of the call it profiles
                row["profile"] = profiled(partial(engine.generate, requests, params), dev)
        write_json(out, result)
        print(f"sampler: {row['tokens_per_s']:.0f} tokens/s, bound {bound:.0f}", flush=True)


def measure_refill(
    model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    sampler: Sampler,
    device: torch.device,
    deadline: float,
    per_token: float,
    result: dict[str, Any],
    out: str,
) -> None:
    """The sampler part's :class:`Refill` call into ``result["refill"]``, written to ``out``
    after each way: ``refill.rows`` rows of the sampler's adapters mixed (a seed per request,
    so both ways sample the same tokens but for round-off), at most ``refill.max_batch`` at a
    time, stopped by a random ``refill.stop_share`` of the vocabulary's ids; batches one after
    the other (``refill=False``), then refilled, then refilled with each step's attention flex
    attention over each row's own blocks (:func:`marlow.rollout.lean.attention_by_blocks`: what
    reading each row's own blocks gives where rows sit at scattered columns). Each way starts
    only with its estimate left:
    2 calls x the decode steps of batches one after the other x ``per_token``."""
    import torch

    from marlow.policy.adapters import adapter_names
    from marlow.rollout.hf import HFEngine
    from marlow.rollout.lean import attention_by_blocks, given_up
    from marlow.types import GenRequest

    r = sampler.refill
    vocab = model.config.vocab_size
    draws = torch.Generator().manual_seed(0)
    stops = torch.randperm(vocab, generator=draws)[: max(1, round(vocab * r.stop_share))].tolist()
    names = adapter_names(model)
    requests = [
        GenRequest(
            tokenizer.encode(f"Problem {i}: what is {i} + {i}?", add_special_tokens=False),
            names[i % sampler.adapters],
            seed=i,
        )
        for i in range(r.rows)
    ]
    samples = {}
    for refill, attention in ((False, "span"), (True, "span"), (True, "rows")):
        row: dict[str, Any] = {
            "refill": refill,
            "attention": attention,
            "stop_ids": len(stops),
            "status": "running",
        }
        result["refill"].append(row)
        steps = -(-r.rows // r.max_batch) * r.new_tokens
        estimate, left = 2 * steps * per_token, deadline - time.monotonic()
        if estimate > left:
            row.update(status="skipped", error=f"estimated {estimate:.0f} s, {left:.0f} s left")
            write_json(out, result)
            continue
        write_json(out, result)
        print(
            f"sampler: {r.rows} rows, refill {'on' if refill else 'off'}, {attention}", flush=True
        )
        engine = HFEngine(model, tokenizer, stop_ids=stops, max_batch=r.max_batch, refill=refill)
        try:
            with attention_by_blocks() if attention == "rows" else contextlib.nullcontext():
                timed = time_calls(engine, requests, sampler, r.new_tokens, device)
        except Exception as err:
            row.update(status="failed", error=one_line(err))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_json(out, result)
            continue
        samples[refill, attention] = timed.pop("samples")
        lengths = [len(t) for t in samples[refill, attention]]
        row.update(
            timed,
            status="ok",
            compiled=engine.compiled,
            given_up=given_up(device),
            mean_length=sum(lengths) / len(lengths),
            longest=max(lengths),
        )
        write_json(out, result)
        print(f"sampler: {row['tokens_per_s']:.0f} tokens/s", flush=True)
    off, on = samples.get((False, "span")), samples.get((True, "span"))
    if off and on:  # the share of rows that sampled the same tokens both ways
        same = sum(a == b for a, b in zip(off, on, strict=True))
        result["refill"][1]["same_samples"] = same / r.rows


def adapted_stand_in(
    size: Size, sampler: Sampler, folder: str, device: torch.device
) -> tuple[PeftModel, PreTrainedTokenizerBase, dict[str, Any]]:
    """The stand-in of ``size`` drawn on ``device`` into ``folder`` and loaded in bfloat16, with
    the sampler's adapters, their B factors drawn (module docstring); and its figures: seconds to
    draw and to load (adapters included), and the bytes of the base's weights, of one adapter's
    factors and of one token's KV cache."""
    import torch

    from marlow.archs import Shape
    from marlow.archs.stand_in import save_stand_in
    from marlow.config import ModelConfig
    from marlow.models import load_base
    from marlow.plan import kv_cache_bytes
    from marlow.policy.adapters import LoraSpec, adapter_parameters, attach_adapters

    t0 = time.monotonic()
    save_stand_in(size.arch, folder, overrides=size.shrink, device=device)
    t1 = time.monotonic()
    base, tokenizer = load_base(ModelConfig(name=folder), dtype="bfloat16", device=device)
    figures: dict[str, Any] = {
        "weight_bytes": distinct_bytes(base.parameters()),
        "kv_bytes_per_token": kv_cache_bytes(Shape.of(base.config), base.dtype.itemsize, 1, 1),
    }
    names = [f"adapter{i}" for i in range(sampler.adapters)]
    model = attach_adapters(base, names, LoraSpec(rank=sampler.rank), seed=0)
    draws = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name in names:
            for path, p in adapter_parameters(model, name).items():
                if ".lora_B." in path:
                    p.normal_(0, base.config.initializer_range, generator=draws)
    figures["adapter_bytes"] = distinct_bytes(adapter_parameters(model, names[0]).values())
    figures["stand_in_s"] = round(t1 - t0, 1)
    figures["load_s"] = round(time.monotonic() - t1, 1)
    return model, tokenizer, figures


def time_calls(
    engine: HFEngine,
    requests: list[GenRequest],
    sampler: Sampler,
    new_tokens: int,
    device: torch.device,
) -> dict[str, Any]:
    """One untimed warm-up call of ``engine`` on ``requests`` for ``new_tokens`` new tokens and
    the timed one (seeds 0 and 1): their seconds, the tokens/s of the timed one and, on CUDA, its
    peak allocated memory."""
    import torch

    from marlow.types import SamplingParams

    cuda = device.type == "cuda"
    seconds = []
    for seed in (0, 1):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = synchronized(device)
        out = engine.generate(requests, SamplingParams(sampler.temperature, new_tokens, seed))
        seconds.append(synchronized(device) - t0)
    warmup, timed = seconds
    lengths = [len(c.token_ids) for c in out]
    return {
        "warmup_s": warmup,
        "seconds": timed,
        "tokens": sum(lengths),
        "tokens_per_s": sum(lengths) / timed,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
        "samples": [c.token_ids for c in out],
    }


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second of :data:`COPY_REPEATS` back-to-back copies of an
    ``nbytes`` buffer into another on ``device``, after an untimed one."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = synchronized(device)
    for _ in range(COPY_REPEATS):
        dst.copy_(src)
    return 2 * nbytes * COPY_REPEATS / (synchronized(device) - t0)


def synchronized(device: torch.device) -> float:
    """:func:`time.perf_counter` once ``device`` has finished its queued work."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()


def distinct_bytes(params: Iterable[torch.Tensor]) -> int:
    """The bytes of ``params``, each tensor once (a tied embedding is one)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())


# -- 4. sizes ---------------------------------------------------------------------------------


def run_config(size: Size, routing: str, model: Path, device: str) -> RunConfig:
    """The config of one run of ``size`` (module docstring)."""
    from marlow.config import resolve

    grpo: dict[str, Any] = {"batch_problems": size.problems, "group_size": size.group}
    if size.micro_tokens is not None:
        grpo["micro_tokens"] = size.micro_tokens
    return resolve(
        {
            "preset": "paper",
            "device": device,
            "steps": size.steps,
            "threads": size.threads,
            "val_every": size.steps,
            "ckpt_every": size.steps,
            "sample_episodes": size.problems * size.group,  # every prompt, for its length
            "model": {"name": str(model)},
            "task": {"val_size": size.val_problems},
            "workflow": {"name": "voting"},
            "policy": {"routing": routing},
            "rollout": {"backend": "hf", "max_new_tokens": size.new_tokens},
            "grpo": grpo,
            "diagnostics": {"signature_problems": size.val_problems},
        }
    )


def measure_size(
    check: Check,
    size: Size,
    device: str,
    dry_run: bool,
    work: Path,
    out: dict[str, Any],
    skip: Collection[str] = (),
) -> None:
    """Every measurement of ``size`` into ``out`` (its entry in the JSON, saved after each): the
    stand-in, the update alone (:func:`measure_update`), then one child ``marlow train`` per
    routing; the parts ``skip`` names ("update", "runs") recorded as left out."""
    out.update(settings=asdict(size), runs=[])
    routings = () if "runs" in skip else size.routings
    if "runs" in skip:
        out["runs"] = [{"routing": r} | _left_out("runs") for r in size.routings]
    if check.left() < size.min_s:
        out["runs"] += [_skipped(r, size, check) for r in routings]
        return
    folder = work / size.name
    out.update(
        guarded(check, f"{size.name} stand-in", lambda: _stand_in(check, size, folder, device))
    )
    if "error" in out:  # e.g. a full disk: this size fails, the next one runs
        shutil.rmtree(folder, ignore_errors=True)
        return
    out["update"] = (
        guarded(
            check,
            f"{size.name} update",
            lambda: measure_update(check, size, folder, device, dry_run, work, len(routings)),
        )
        if "update" not in skip
        else _left_out("update")
    )
    check.save()
    for routing in routings:
        if check.left() < size.min_s:
            out["runs"].append(_skipped(routing, size, check))
            continue
        check.say(f"{size.name} {routing}: training ({check.left():.0f} s left)")
        run = guarded(
            check,
            f"{size.name} {routing}",
            lambda r=routing: measure_run(check, size, r, folder, device, work),
        )
        out["runs"].append({"routing": routing, "status": "failed", **run})
        check.say(f"{size.name} {routing}: {out['runs'][-1]['status']}")
        check.save()
    shutil.rmtree(folder, ignore_errors=True)


STAND_IN = """\
import json, sys
from marlow.archs.stand_in import save_stand_in
from marlow.models import resolve_device
arch, folder, overrides, device = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
save_stand_in(arch, folder, overrides=overrides, device=resolve_device(device))
"""
"""Run in a child process: a stand-in whose weights are drawn on the check's device (a CPU took
35 s for the 0.6B's on the H100 machine), by a process whose CUDA context ends with it."""


def _stand_in(check: Check, size: Size, folder: Path, device: str) -> dict[str, Any]:
    args = [size.arch, str(folder), json.dumps(size.shrink), device]
    done = check.child([sys.executable, "-c", STAND_IN, *args], check.left())
    if done["status"] != "ok":
        raise RuntimeError(f"the stand-in was not written: {done['error']}")
    return {"stand_in_s": done["seconds"]}


def _skipped(routing: str, size: Size, check: Check) -> dict[str, Any]:
    check.say(f"{size.name} {routing}: skipped, {check.left():.0f} s of the budget left")
    return {"routing": routing, "status": "skipped", "error": "not enough of the budget left"}


def measure_run(
    check: Check, size: Size, routing: str, model: Path, device: str, work: Path
) -> dict[str, Any]:
    """One child ``marlow train`` run: its steps, beside plan's prediction."""
    from marlow.config import dump_config
    from marlow.diagnostics.sinks import read_jsonl
    from marlow.fileio import write_text

    cfg = run_config(size, routing, model, device)
    run_dir = work / f"{size.name}-{routing}"
    config = write_text(work / f"{size.name}-{routing}.yaml", dump_config(cfg))
    command = [sys.executable, "-m", "marlow.cli", "train", str(config), "--out", str(run_dir)]
    final = "next: marlow inspect"  # the summary's last line (marlow.cli)
    out: dict[str, Any] = {"routing": routing, **check.child(command, check.left(), final=final)}
    metrics = run_dir / "metrics.jsonl"  # a killed run's half-written last line is left out
    records = list(read_jsonl(metrics)) if metrics.exists() else []
    out["steps"] = [step_row(r) for r in records if r["step"] > 0 and "time/learn_s" in r]
    longest = longest_prompt(run_dir / "samples.jsonl", model)
    out["plan"] = plan_row(cfg, longest, check.result["environment"].get("gpu_memory_gib"))
    out.update(ratios(out["steps"], out["plan"]))
    return out


LEARN_PARTS = ("scoring", "update", "stats", "kl_to_base")
"""The learn phase's parts a step's record times (``time/<part>_s``, ``marlow.training.trainer``):
logp_old and the base's log-probs; the adapters' updates; the statistics after them (the
adapter-sync probe among them) less the KL to the base, timed on its own."""


def step_row(record: dict[str, Any]) -> dict[str, Any]:
    """A step's seconds (the learn phase's parts too), sampled tokens per second, and per phase
    its peak memory and what was allocated when it began (None off CUDA)."""
    row = {
        "step": record["step"],
        "rollout_s": record["time/rollout_s"],
        "learn_s": record["time/learn_s"],
        **{f"{part}_s": record.get(f"time/{part}_s") for part in LEARN_PARTS},
        "rollout_tokens_per_s": record["time/rollout_tokens_per_s"],
    }
    for phase in PHASES:
        for kind in KINDS:
            key = f"{phase}_peak_{kind}_gib"
            row[key] = record.get(f"memory/{key}")
        key = f"{phase}_start_allocated_gib"
        row[key] = record.get(f"memory/{key}")
    return row


def longest_prompt(samples: Path, model: Path) -> int | None:
    """The most tokens of any prompt the run sampled from, as the sampler saw it (chat template
    applied; ``sample_episodes`` keeps every episode); None when it sampled none."""
    if not samples.exists():
        return None
    from transformers import AutoTokenizer

    from marlow.diagnostics.sinks import read_jsonl
    from marlow.prompts.chat import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model)
    turns = (t for episode in read_jsonl(samples) for t in episode["turns"])
    prompts = {t["prompt"] for t in turns if "prompt" in t}  # a tool call has none
    return max((len(chat_prompt_ids(tokenizer, p)) for p in prompts), default=None)


def plan_row(cfg: RunConfig, prompt_tokens: int | None, card_gib: float | None) -> dict[str, Any]:
    """``marlow plan``'s figures for the run, in GiB, at its longest prompt (plan's default when
    the run sampled nothing), on the card of ``card_gib`` GiB (None off CUDA), whose memory
    resolves ``grpo.activation_checkpointing`` auto as the run's trainer does."""
    from marlow.plan import PROMPT_TOKENS, plan_run

    plan = plan_run(cfg, prompt_tokens=prompt_tokens or PROMPT_TOKENS, gpu_mem_gib=card_gib)
    return {
        "prompt_tokens": plan.prompt_tokens,
        "prompt_tokens_measured": prompt_tokens is not None,
        "forward_tokens": plan.forward_tokens,
        "checkpointed": plan.checkpointed,
        "max_batch": plan.max_batch,
        "base_gib": plan.base_bytes / GIB,
        "adapters_gib": plan.adapter_bytes / GIB,
        "activations_gib": plan.activation_bytes / GIB,
        "kv_cache_gib": plan.kv_cache_bytes / GIB,
        "peak_gib": plan.peak_bytes / GIB,
    }


def ratios(steps: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    """The run's peak allocated memory (largest over its steps) and its ratios to plan's."""
    fixed = plan["base_gib"] + plan["adapters_gib"]
    predicted = {
        "rollout": fixed + plan["kv_cache_gib"],
        "learn": fixed + plan["activations_gib"],
    }
    out: dict[str, Any] = {}
    for phase in PHASES:
        seen = [s[f"{phase}_peak_allocated_gib"] for s in steps]
        peak = max(seen) if seen and None not in seen else None
        out[f"{phase}_peak_allocated_gib"] = peak
        out[f"{phase}_ratio"] = peak / predicted[phase] if peak is not None else None
    both = [out[f"{phase}_peak_allocated_gib"] for phase in PHASES]
    out["peak_allocated_gib"] = max(both) if None not in both else None
    reserved = [s[f"{p}_peak_reserved_gib"] for s in steps for p in PHASES]
    out["peak_reserved_gib"] = max(reserved) if reserved and None not in reserved else None
    peak = out["peak_allocated_gib"]
    out["ratio"] = peak / plan["peak_gib"] if peak is not None else None
    return out


# -- 4. sizes: the update alone --------------------------------------------------------------


UPDATE_CHILD = """\
import json, sys
sys.path.insert(0, "bench")
from gpu_check import CHILD_DONE, time_update
time_update(*sys.argv[1:4], json.loads(sys.argv[4]), sys.argv[5], float(sys.argv[6]))
print(CHILD_DONE, flush=True)
"""
"""Run in a child process from the repository root: :func:`time_update`, given the dry run as
JSON and the deadline as a number; last, :data:`CHILD_DONE`."""


def update_rows(update: Update) -> list[dict[str, Any]]:
    """Each micro-batch of ``update``, in the order they run."""
    return [
        {"tokens": t, "rows": t // update.row, "row_tokens": update.row, "prompt": update.prompt}
        for t in update.tokens
    ]


def measure_update(
    check: Check, size: Size, folder: Path, device: str, dry_run: bool, work: Path, runs: int
) -> dict[str, Any]:
    """The update alone of ``size`` (module docstring) on its stand-in in ``folder``, in one child
    process: its figures and every micro-batch's (one the child was at when it ended takes the
    child's status and error; one it did not reach is skipped); skipped, every micro-batch with
    it, without the size's ``min_s`` for each of the ``runs`` after it plus ``update_s`` left."""
    update = DRY_UPDATE if dry_run else UPDATE
    out: dict[str, Any] = {"settings": {**asdict(update), "update_s": size.update_s}}
    needed = size.min_s * runs + size.update_s
    if check.left() < needed:
        check.say(f"{size.name} update: skipped, {check.left():.0f} s of the budget left")
        why = f"{check.left():.0f} s of the budget left, {needed:.0f} s needed with the runs"
        skipped = {"status": "skipped", "error": why}
        out.update(skipped, micro_batches=[r | skipped for r in update_rows(update)])
        return out
    check.say(f"{size.name} update: at most {size.update_s:.0f} s")
    path = work / f"{size.name}-update.json"
    deadline = time.monotonic() + size.update_s  # CLOCK_MONOTONIC: the child's clock too
    args = [str(path), str(folder), device, json.dumps(dry_run), size.name, repr(deadline)]
    child = [sys.executable, "-c", UPDATE_CHILD, *args]
    out.update(check.child(child, size.update_s, final=CHILD_DONE))
    read_child(out, path, "micro_batches", update_rows(update))
    statuses = [r["status"] for r in out["micro_batches"]]
    check.say(f"{size.name} update: {out['status']}, micro-batches {', '.join(statuses)}")
    return out


def time_update(
    out: str, folder: str, device: str, dry_run: bool, size_name: str, deadline: float
) -> None:
    """The update alone's measurements (module docstring) on the stand-in in ``folder``, in its
    child process, written to ``out`` as JSON before and after every micro-batch so that what
    was measured outlives a crash; a micro-batch that raises (an out-of-memory error) is
    recorded as failed. ``deadline``: the :func:`time.monotonic` at which the measurement ends."""
    import torch

    from marlow.config import ModelConfig
    from marlow.models import checkpoint_layers, load_base, resolve_device
    from marlow.plan import non_embedding_parameters
    from marlow.policy.adapters import LoraSpec, adapter_parameters, attach_adapters, use_adapter

    update, sizes = (DRY_UPDATE, DRY_SIZES) if dry_run else (UPDATE, SIZES)
    size = next(s for s in sizes if s.name == size_name)
    if size.threads is not None:
        torch.set_num_threads(size.threads)
    dev = resolve_device(device)
    t0 = time.monotonic()
    base, _ = load_base(ModelConfig(name=folder), dtype="bfloat16", device=dev)
    b = base.dtype.itemsize
    result: dict[str, Any] = {
        "weight_bytes": distinct_bytes(base.parameters()),
        "non_embedding_parameters": non_embedding_parameters(base),
    }
    model = attach_adapters(base, [UPDATE_ADAPTER], LoraSpec(rank=update.rank), seed=0)
    checkpoint_layers(model)  # first checkpointed, then each micro-batch not (time_unchecked)
    result["compiled"] = False  # eager, as a run's layers are by default (grpo.compile auto)
    params = list(adapter_parameters(model, UPDATE_ADAPTER).values())
    result["adapter_parameters"] = sum(p.numel() for p in params)
    result["load_s"] = round(time.monotonic() - t0, 1)
    result["matmul_flops_per_s"] = matmul_throughput(dev, MATMUL_N[dev.type])
    optimizer = torch.optim.AdamW(params)
    model.train()
    draws = torch.Generator(dev).manual_seed(0)
    result["micro_batches"] = []
    before: dict[str, Any] | None = None  # the micro-batch before this one
    done: list[tuple[dict[str, Any], Chunk]] = []  # the micro-batches that succeeded
    with use_adapter(model, UPDATE_ADAPTER):
        for row in update_rows(update):
            result["micro_batches"].append(row)
            row["plan"] = update_plan(model, b, result, row["tokens"])
            why = not_yet(before, row, deadline - time.monotonic())
            before = row
            if why is not None:
                row.update(status="skipped", error=why)
                write_json(out, result)
                continue
            row["status"] = "running"
            write_json(out, result)
            print(f"update: {row['tokens']:,} tokens", flush=True)
            try:
                chunk = update_chunk(row, model.config.vocab_size, dev, draws)
                row.update(time_passes(model, chunk, optimizer, update.temperature, dev))
            except Exception as err:
                row.update(status="failed", error=one_line(err))
            if row["status"] == "failed":  # past the except block: its traceback's tensors freed
                print(f"update: {row['error']}", flush=True)
                optimizer.zero_grad()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()  # what the failed pass held
                write_json(out, result)
                continue
            if row is result["micro_batches"][0]:  # the first: profiled once more
                row["profile"] = profiled(
                    partial(update_pass, model, chunk, update.temperature), dev
                )
                optimizer.zero_grad()
            done.append((row, chunk))
            flops = update_flops(model.config, result, row)
            measured = row["peak_allocated_gib"]
            row.update(
                status="ok",
                flops=flops,
                fraction_of_peak=flops / row["seconds"] / result["matmul_flops_per_s"],
                ratio=None if measured is None else measured / row["plan"]["peak_gib"],
            )
            write_json(out, result)
            print(f"update: {row['tokens_per_s']:.0f} tokens/s", flush=True)
        args = (model, optimizer, update.temperature, dev, dry_run, deadline)
        for ran in done:  # each once more, its layers not checkpointed
            plan = update_plan(model, b, result, ran[0]["tokens"], checkpointed=False)
            time_unchecked(ran, plan, *args)
            write_json(out, result)
        for module, key, what in SIDE_BY_SIDE if done else ():  # the first once more each
            time_instead(done[0], getattr(importlib.import_module(module), key), key, what, *args)
            write_json(out, result)
        if done:  # each once more with its layers compiled, last: the compilation takes longest
            time_compiled(done, partial(write_json, out, result), *args)


def time_unchecked(
    ran: tuple[dict[str, Any], Chunk],
    plan: dict[str, float],
    model: PeftModel,
    optimizer: torch.optim.Optimizer,
    temperature: float,
    dev: torch.device,
    dry_run: bool,
    deadline: float,
) -> None:
    """A micro-batch's passes (``ran``: its row and chunk) timed once more with the layers not
    checkpointed (:func:`marlow.models.checkpoint_layers` off,
    ``grpo.activation_checkpointing=off``) into its row's ``unchecked``, beside ``plan``, plan's
    prediction without checkpointing (:func:`update_plan`); where the time left passes 2 x the
    checkpointed pass's seconds (always in the dry run, so that CI runs that path) and, on CUDA,
    where plan's peak fits the device's free memory with :data:`UNCHECKED_MARGIN` to spare
    (plan's update peaks were within 3% of the measured ones on an H200). The layers are
    checkpointed again afterwards, as the check's others are."""
    import torch

    from marlow.models import checkpoint_layers

    row, chunk = ran
    if (short := time_short(row, dry_run, deadline)) is not None:
        row["unchecked"] = {"status": "skipped", "error": short, "plan": plan}
        return
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev)
        if plan["peak_gib"] * UNCHECKED_MARGIN > free / GIB:
            why = f"plan predicts {plan['peak_gib']:.1f} GiB, {free / GIB:.1f} GiB free"
            row["unchecked"] = {"status": "skipped", "error": why, "plan": plan}
            return
    print("update: layers not checkpointed", flush=True)
    row["unchecked"] = {"status": "running", "plan": plan}
    checkpoint_layers(model, on=False)
    try:
        timed = time_passes(model, chunk, optimizer, temperature, dev)
        measured = timed["peak_allocated_gib"]
        ratio = None if measured is None else measured / plan["peak_gib"]
        row["unchecked"].update(status="ok", ratio=ratio, **timed)
    except Exception as err:
        row["unchecked"].update(status="failed", error=one_line(err))
    checkpoint_layers(model)
    optimizer.zero_grad()
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the un-checkpointed activations' blocks


SIDE_BY_SIDE = (
    ("marlow.models", "transformers_rotary", "transformers' own rotary embedding"),
    ("marlow.models", "torch_checkpoint", "torch.utils.checkpoint"),
    (
        "marlow.algo.estimators",
        "recomputed_head",
        "an LM head whose backward computes each chunk's logits again",
    ),
)
"""The first micro-batch's re-timings (:func:`time_instead`): the module and name of the context
manager that runs something instead of marlow's own (the name also the key of its figures), and
what it runs: transformers' rotary embedding in place of :func:`marlow.models.fuse_rotary`'s (the
same values in fewer kernels), ``torch.utils.checkpoint`` in place of marlow's recomputation of
checkpointed layers (the same values with less of the host's work a layer), the head's chunks
computed again in the backward in place of the slopes its forward takes
(:func:`marlow.algo.estimators.head_logprobs_and_entropy`: one head product and log-softmax a
chunk fewer)."""


def time_instead(
    ran: tuple[dict[str, Any], Chunk],
    instead: Callable[[], contextlib.AbstractContextManager],
    key: str,
    what: str,
    model: PeftModel,
    optimizer: torch.optim.Optimizer,
    temperature: float,
    dev: torch.device,
    dry_run: bool,
    deadline: float,
) -> None:
    """A micro-batch's passes (``ran``: its row and chunk) timed once more inside the context
    manager ``instead()`` (:data:`SIDE_BY_SIDE`'s ``key``: ``what`` in place of marlow's own),
    appended to its row's ``side_by_side`` (``key`` and ``what`` with the figures), side by
    side: what marlow's saves; its layers checkpointed as the row's. Where the time left passes
    2 x the row's pass's seconds (always in the dry run, so that CI runs that path)."""
    row, chunk = ran
    entry = {"key": key, "what": what, "against": "through marlow's"}
    row.setdefault("side_by_side", []).append(entry)
    if (short := time_short(row, dry_run, deadline)) is not None:
        entry.update(status="skipped", error=short)
        return
    print(f"update: {what}", flush=True)
    try:
        with instead():
            timed = time_passes(model, chunk, optimizer, temperature, dev)
        entry.update(status="ok", **timed)
    except Exception as err:
        entry.update(status="failed", error=one_line(err))
        optimizer.zero_grad()


COMPILED = "decoder layers and LM head compiled (grpo.compile=on)"
"""What :func:`time_compiled`'s entries run, checkpointed; not checkpointed, with
``", not checkpointed"`` after it."""


def time_compiled(
    done: list[tuple[dict[str, Any], Chunk]],
    save: Callable[[], None],
    model: PeftModel,
    optimizer: torch.optim.Optimizer,
    temperature: float,
    dev: torch.device,
    dry_run: bool,
    deadline: float,
) -> None:
    """Each micro-batch that succeeded (``done``: its row and chunk) timed once more with its
    decoder layers and LM head compiled (:func:`marlow.models.compile_layers`,
    ``grpo.compile=on``), checkpointed as the row's, and once more not checkpointed where its
    eager layers were timed so (the row's ``unchecked`` succeeded: plan's peak fitted the
    card), each appended to its row's ``side_by_side`` (key ``compiled_layers``, with the eager
    figure it stands beside: ``against_tokens_per_s``); the first micro-batch's compiled
    checkpointed pass is profiled too. One compilation serves every micro-batch (dynamic shapes)
    and both ways (the layers not checkpointed run the recompute's graphs); its seconds are the
    first pass's ``warmup_s``, and ``graphs`` counts the graphs torch compiled during the
    entry's passes. Each only where the time left passes 2 x the eager pass's seconds (always in
    the dry run, so that CI runs that path); compiled layers that fell back to eager (a
    compiler's error: ``marlow.models``' warning) are a failure, not a figure. ``save`` writes
    the figures so far. The layers are eager and checkpointed again afterwards."""
    from torch._dynamo.utils import counters

    import marlow.models
    from marlow.models import checkpoint_layers, compile_layers

    compile_layers(model)
    try:
        for i, (row, chunk) in enumerate(done):
            for checkpointed in (True, False):
                eager = row if checkpointed else row.get("unchecked", {})
                if eager.get("status") != "ok":
                    continue
                entry = {
                    "key": "compiled_layers",
                    "what": COMPILED + ("" if checkpointed else ", not checkpointed"),
                    "against": "with eager layers" + ("" if checkpointed else " not checkpointed"),
                    "against_tokens_per_s": eager["tokens_per_s"],
                }
                row.setdefault("side_by_side", []).append(entry)
                if (short := time_short(eager, dry_run, deadline)) is not None:
                    entry.update(status="skipped", error=short)
                    continue
                print(f"update: {row['tokens']:,} tokens, {entry['what']}", flush=True)
                entry["status"] = "running"
                save()
                checkpoint_layers(model, on=checkpointed)
                try:
                    graphs = counters["stats"]["unique_graphs"]
                    timed = time_passes(model, chunk, optimizer, temperature, dev)
                    timed["graphs"] = counters["stats"]["unique_graphs"] - graphs
                    if marlow.models._GAVE_UP:
                        raise RuntimeError(f"the layers ran eager: {marlow.models._GAVE_UP[0]}")
                    if i == 0 and checkpointed:
                        work = partial(update_pass, model, chunk, temperature)
                        timed["profile"] = profiled(work, dev)
                        optimizer.zero_grad()
                    entry.update(status="ok", **timed)
                except Exception as err:
                    entry.update(status="failed", error=one_line(err))
                    optimizer.zero_grad()
                save()
    finally:
        compile_layers(model, on=False)
        checkpoint_layers(model)


def time_short(row: dict[str, Any], dry_run: bool, deadline: float) -> str | None:
    """Why micro-batch ``row``'s passes are not timed once more, or None: less time left than
    2 x its timed pass's seconds (never in the dry run, so that CI runs every path)."""
    left = deadline - time.monotonic()
    return None if dry_run or left >= 2 * row["seconds"] else f"{left:.0f} s left"


def not_yet(before: dict[str, Any] | None, row: dict[str, Any], left: float) -> str | None:
    """Why micro-batch ``row`` is skipped after ``before`` with ``left`` seconds left, or None:
    the one before did not succeed, or the estimate (module docstring) passes the time left."""
    if before is None:
        return None
    if before["status"] != "ok":
        return f"the {before['tokens']:,}-token micro-batch did not succeed"
    estimate = 2 * before["seconds"] * row["tokens"] / before["tokens"]
    return f"estimated {estimate:.0f} s, {left:.0f} s left" if estimate > left else None


def update_plan(
    model: PeftModel, b: int, figures: dict[str, Any], tokens: int, checkpointed: bool = True
) -> dict[str, float]:
    """``marlow plan``'s figures in GiB for one micro-batch of ``tokens`` tokens of ``model``
    (``b`` bytes a base weight): base (``figures``' weight bytes), the adapter
    (:data:`marlow.plan.OPTIMIZER_BYTES` x its parameters) and activations
    (:func:`marlow.plan.activation_bytes`, its layers ``checkpointed`` or not, with the factors
    it holds: :func:`marlow.plan.held_bytes`), and their sum."""
    from marlow.archs import Shape
    from marlow.models import decoder_and_head
    from marlow.plan import OPTIMIZER_BYTES, activation_bytes, held_bytes, lora_shapes

    shape, lora = Shape.of(model.config), lora_shapes(model, UPDATE_ADAPTER)
    chunked = decoder_and_head(model) is not None
    held = held_bytes(b, figures["adapter_parameters"], False)
    activations = activation_bytes(shape, b, lora, tokens, chunked, checkpointed, False, held)
    out = {
        "base_gib": figures["weight_bytes"] / GIB,
        "adapters_gib": OPTIMIZER_BYTES * figures["adapter_parameters"] / GIB,
        "activations_gib": activations / GIB,
    }
    out["peak_gib"] = sum(out.values())
    return out


def update_flops(config: Any, figures: dict[str, Any], row: dict[str, Any]) -> float:
    """The FLOPs of one update pass over micro-batch ``row`` (module docstring's formula), from
    ``figures``' parameter counts and the attention's shape in ``config``."""
    from marlow.archs import Shape

    s, tokens = Shape.of(config), row["tokens"]
    dense = 4 * (figures["non_embedding_parameters"] + figures["adapter_parameters"]) * tokens
    context = (row["row_tokens"] + 1) / 2
    return dense + 4 * s.L * tokens * context * s.a * s.d * 2


def update_chunk(
    row: dict[str, Any], vocab: int, device: torch.device, draws: torch.Generator
) -> Chunk:
    """A micro-batch of ``row["rows"]`` rows of ``row["row_tokens"]`` ids drawn below ``vocab``:
    the first ``row["prompt"]`` of each its prompt, the rest its completion."""
    import torch

    from marlow.training.batch import Chunk

    shape = (row["rows"], row["row_tokens"])
    ids = torch.randint(0, vocab, shape, generator=draws, device=device)
    return Chunk.full_rows(ids, row["prompt"])


def time_passes(
    model: PeftModel,
    chunk: Chunk,
    optimizer: torch.optim.Optimizer,
    temperature: float,
    device: torch.device,
) -> dict[str, Any]:
    """The untimed warm-up pass, an AdamW step, then the timed pass (module docstring): their
    seconds, the tokens/s of the timed one and, on CUDA, its peak allocated memory."""
    import torch

    cuda = device.type == "cuda"
    seconds = []
    for timed in (False, True):
        if timed:
            optimizer.step()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
        t0 = synchronized(device)
        update_pass(model, chunk, temperature)
        seconds.append(synchronized(device) - t0)
    optimizer.zero_grad()
    warmup, timed = seconds
    return {
        "warmup_s": warmup,
        "seconds": timed,
        "tokens_per_s": chunk.ids.numel() / timed,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
    }


def update_pass(model: PeftModel, chunk: Chunk, temperature: float) -> None:
    """One pass of the update over ``chunk``: :func:`marlow.training.logprobs.score_chunk`
    (without the entropies, which an update whose logp_old was scored before it does not
    compute), the loss ``-(logp x mask).sum() / mask.sum()`` and its ``backward()``, its LoRA
    factors cast once for the forward and the recompute, as a mini-batch of one micro-batch
    holds them (:func:`marlow.policy.adapters.held_factors`)."""
    from marlow.policy.adapters import held_factors
    from marlow.training.logprobs import score_chunk

    with held_factors():
        scored = score_chunk(model, chunk, temperature=temperature, entropy=False)
        (-(scored.logp * scored.mask).sum() / scored.mask.sum()).backward()


def profiled(work: Callable[[], object], device: torch.device) -> dict[str, Any]:
    """``work()`` once more under ``torch.profiler``: its seconds (the device synchronized), and
    the device's work in it: on CUDA its kernels (CUDA graph replays' included), on the CPU its
    aten operations; how many, their total seconds, those seconds by :func:`kernel_kind`
    (``kinds``: what share of the device's time its matrix products take), and the
    :data:`PROFILE_TOP` names that took the longest (their calls and seconds)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = synchronized(device)
    with profile(activities=activities, with_stack=True) as prof:
        work()
        synchronized(device)
    seconds = time.perf_counter() - t0
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        own = [(e.key, e.count, e.self_device_time_total) for e in events]
    else:
        events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        own = [(e.key, e.count, e.self_cpu_time_total) for e in events]
    own.sort(key=lambda e: -e[2])
    kinds = dict.fromkeys([*KERNEL_KINDS, "the rest"], 0.0)
    for name, _, us in own:
        kinds[kernel_kind(name)] += us / 1e6
    return {
        "seconds": seconds,
        "what": "CUDA kernels" if cuda else "aten operations",
        "count": sum(calls for _, calls, _ in own),
        "device_s": sum(us for _, _, us in own) / 1e6,
        "kinds": kinds,
        "top": [{"name": n[:120], "calls": c, "s": us / 1e6} for n, c, us in own[:PROFILE_TOP]],
        "operations": operations(prof, cuda),
    }


def operations(prof: Any, cuda: bool) -> list[dict[str, Any]]:
    """The :data:`PROFILE_TOP` aten operations of a profile (taken ``with_stack``) whose own
    device time (on CUDA the kernels each launched, its children's left out; on the CPU its own
    time) is the longest, by operation and :func:`caller`: what each kernel of the list above
    was for."""
    totals: dict[tuple[str, str], list] = {}
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            entry = totals.setdefault((e.name, caller(e)), [0, 0.0])
            entry[0] += 1
            entry[1] += us
    found = [
        {"name": name, "where": where[:120], "calls": calls, "s": us / 1e6}
        for (name, where), (calls, us) in totals.items()
    ]
    found.sort(key=lambda o: -o["s"])
    return found[:PROFILE_TOP]


def caller(event: Any) -> str:
    """What ran a profiled operation: the nearest enclosing line of Python outside torch
    (``file.py(line): function``), or autograd node (``MulBackward0``: the backward of an
    operation autograd recorded, which no line of Python calls); "?" for neither."""
    parent = event.cpu_parent
    while parent is not None:
        name = parent.name
        if ":" not in name and name.endswith(("Backward", "Backward0", "Backward1")):
            return name
        if "): " in name and not name.startswith("torch/"):
            return name
        parent = parent.cpu_parent
    return "?"


def matmul_throughput(device: torch.device, n: int) -> float:
    """FLOPs per second of :data:`MATMUL_REPEATS` products of two ``n`` x ``n`` bfloat16 matrices
    on ``device``, after an untimed one."""
    import torch

    gen = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen, device=device, dtype=torch.bfloat16) for _ in "ab")
    a @ b
    t0 = synchronized(device)
    for _ in range(MATMUL_REPEATS):
        a @ b
    return 2 * n**3 * MATMUL_REPEATS / (synchronized(device) - t0)


# -- the check --------------------------------------------------------------------------------


SKIPPABLE = ("tests", "sampler", "update", "runs")
"""The parts ``--skip`` leaves out (the sizes' runs are chosen with ``--size``)."""


def _left_out(part: str) -> dict[str, Any]:
    return {"status": "skipped", "error": f"left out (--skip {part})"}


def guarded(check: Check, label: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work()``, or ``{"error": its exception in one line}``: the next part runs either way."""
    try:
        return work()
    except Exception as err:
        check.say(f"{label}: {one_line(err)}")
        return {"error": one_line(err)}


def one_line(err: Exception) -> str:
    """``err``'s type and the first line of its message."""
    return f"{type(err).__name__}: {err}".strip().splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON and the log")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="the smallest sizes and tests")
    ap.add_argument("--budget-s", type=float, default=550.0, help="seconds for the whole check")
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=SKIPPABLE,
        help="leave a part out, recorded as skipped (repeatable): to re-measure a fix",
    )
    ap.add_argument(
        "--size",
        action="append",
        dest="sizes",
        help="measure only this size (repeatable; default: every size)",
    )
    args = ap.parse_args(argv)
    chosen = DRY_SIZES if args.dry_run else SIZES
    unknown = set(args.sizes or ()) - {size.name for size in chosen}
    if unknown:
        names = ", ".join(size.name for size in chosen)
        ap.error(f"--size {sorted(unknown)[0]}: not a size of this check; choose from {names}")
    if args.budget_s <= 0:
        ap.error(f"--budget-s must be > 0, got {args.budget_s:g}")
    check = Check(args.out, args.device, args.dry_run, args.budget_s)
    check.say(f"device {args.device}, budget {args.budget_s:.0f} s -> {check.path}")
    env = check.result["environment"] = guarded(
        check, "environment", lambda: environment(args.device)
    )
    check.save()
    if "error" in env:
        return 2  # no such device: nothing else can run
    check.say(f"environment: {env.get('gpu', env['device'])}, unmet: {env['unmet'] or 'none'}")
    failed = bool(env["unmet"])
    with tempfile.TemporaryDirectory(prefix="marlow-gpu-check-") as tmp:
        work = Path(tmp)
        check.result["tests"] = {"status": "skipped", "error": "not reached"}  # last (below)
        sampler = check.result["sampler"] = (
            _left_out("sampler")
            if "sampler" in args.skip
            else guarded(
                check, "sampler", lambda: measure_sampler(check, args.device, args.dry_run, work)
            )
        )
        check.save()
        statuses = [c["status"] for c in sampler.get("configurations", [])]
        failed |= sampler.get("status") not in ("ok", "skipped")
        failed |= bool(set(statuses) - {"ok", "skipped"})
        check.say(
            f"sampler: {sampler.get('status', 'error')}, "
            f"{statuses.count('ok')} of {len(statuses)} configurations measured"
        )
        sizes = check.result["sizes"] = {}
        for size in chosen:
            if args.sizes and size.name not in args.sizes:
                continue
            entry = sizes[size.name] = {}
            measure_size(check, size, args.device, args.dry_run, work, entry, args.skip)
            check.save()
            update = entry.get("update", {})
            statuses = {r["status"] for r in entry["runs"] + update.get("micro_batches", [])}
            failed |= "error" in entry or bool(statuses - {"ok", "skipped"})
            failed |= update.get("status", "ok") not in ("ok", "skipped")
        files = DRY_TESTS if args.dry_run else DEVICE_TESTS
        tests = (
            _left_out("tests")
            if "tests" in args.skip
            else guarded(check, "tests", lambda: run_tests(check, args.device, files, work))
        )
        check.result["tests"] = tests
        check.save()
        failed |= tests.get("status") not in ("ok", "skipped")
        check.say(f"tests: {tests.get('status', 'error')}, {tests.get('passed')} passed")
    check.result["check"]["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    check.save()
    check.say(f"done: {'something failed' if failed else 'all ok'} -> {check.path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
