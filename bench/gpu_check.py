"""The GPU check: what marlow does on one CUDA GPU, measured in one go and written to one JSON.

    bench/gpu_check.sh OUT                        on the GPU machine (installs .whl/ first)
    python bench/gpu_check.py --out OUT [--device cuda] [--budget-s 420]
    python bench/gpu_check.py --out OUT --device cpu --dry-run     the smallest sizes, on the CPU

It writes ``OUT/gpu_check.json``, rewritten after every part so that a check stopped half-way
leaves what it measured, and appends every child process's output to ``OUT/gpu_check.log``.
The parts, each recorded whatever became of the others:

1. **environment**: the GPU (name, memory, compute capability), the driver, CUDA, Python, and the
   version of every package marlow needs, with those outside ``pyproject.toml``'s ranges. The
   GPU is read by a child process, so this process never holds a CUDA context of its own.
2. **tests**: the device tests (:data:`DEVICE_TESTS`; ``tests/conftest.py``'s
   ``MARLOW_TEST_DEVICE`` set to the device) in pytest: passed, failed, errors, skipped, and the
   failures' names, from pytest's JUnit XML.
3. **sizes**: for each size of :data:`SIZES` (:data:`DRY_SIZES` with ``--dry-run``), a stand-in
   of its architecture with random bfloat16 weights (:func:`marlow.archs.stand_in.save_stand_in`)
   trained by ``marlow train`` in a child process, once per routing: Voting, the paper preset
   (LoRA rank 64 on every linear, ``rollout.max_batch`` 48, ``grpo.micro_tokens`` 6,144), the HF
   rollout loop. Per step: rollout and learn seconds, sampled tokens per second, and the peak
   device memory of each phase (the trainer's ``memory/*`` metrics; none off CUDA). Beside them,
   ``marlow plan``'s prediction for the same config (:func:`marlow.plan.plan_run`) at the run's
   own longest prompt, and the ratios measured / predicted of the peak allocated memory: the
   step's (both phases) against plan's peak, the rollout's against base + adapters + KV cache,
   the learn phase's against base + adapters + activations.

Lengths: the study's Voting math sampled up to 5,120 new tokens for 64 problems x 8 episodes a
step; here one step of 4 problems x 4 episodes (48 generator turns: one rollout batch of 48) of
64 new tokens, validated on 1 problem before and after, with stand-ins of the 0.6B (both
routings), the 1.7B and the 4B (IP). Sized from the first checks on one H100 (HF rollout loop,
bfloat16), where sampling is bound by the Python of each forward: a 0.6B IP run of two 256-token
steps with 2 validation problems took 248 s (its second step 35 s of rollout and 4 s of learning,
its first 62 s and 18 s: warm-up), and of one 128-token step with 1 validation problem 140 s
(42 s of rollout, 17 s of learning). The budget, not the estimate, bounds the check; a size starts
only with its ``min_s`` left, so that no run is started to be stopped half-way. A stand-in's noise
almost never samples the end token, so nearly every turn runs to its limit and every run's steps
have the same size.

Failures are data: a run that fails (an out-of-memory error, a crash) is recorded with the steps
it finished and the last line it printed; one that outlasts the time left is stopped and recorded
likewise; a size whose minimum time is no longer left is recorded as skipped. The exit status is
1 when anything failed, else 0; the JSON is written either way.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from marlow.fileio import write_json

# marlow's other modules are imported where a part needs them, so that a package missing on the
# GPU machine fails that part alone (recorded in the JSON) and not the check
if TYPE_CHECKING:
    from marlow.config import RunConfig

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
MIN_RUN_S = 30
"""A run starts only with this many seconds of the budget left."""
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
    micro_tokens: int | None = None  # grpo.micro_tokens (None: the paper preset's 6,144)
    threads: int | None = None  # torch threads (None: every core)
    shrink: dict[str, int] = field(default_factory=dict)  # config fields over the arch's


SIZES = (
    Size("qwen3-0.6b", "qwen3-0.6b", ("ip", "sp"), 1, 4, 4, 64, 1, min_s=60),
    Size("qwen3-1.7b", "qwen3-1.7b", ("ip",), 1, 4, 4, 64, 1, min_s=75),
    Size("qwen3-4b", "qwen3-4b", ("ip",), 1, 4, 4, 64, 1, min_s=90),
)
DRY_SIZES = (
    # The 0.6B's vocabulary (which the stand-in's tokenizer needs) on 2 narrow layers; short
    # micro-batches keep its (tokens, 151,936) logits small on a CPU. One thread: on a 2-core
    # CPU shared with other work an IP run took 46 s with two, 8 s with one.
    Size(
        "qwen3-0.6b-shrunk",
        "qwen3-0.6b",
        ("ip", "sp"),
        1,
        1,
        2,
        8,
        1,
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

    def child(self, command: list[str], timeout: float, env: dict | None = None) -> dict:
        """Run ``command`` from the repository root, its output appended to the log, stopped
        (its whole process group) after ``timeout`` seconds: status, seconds, and the last line
        it printed when it failed."""
        self.log.flush()
        start = self.log.tell()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=max(timeout, 1))
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            status = "timeout"
        out: dict[str, Any] = {"status": status, "seconds": round(time.monotonic() - t0, 1)}
        if status != "ok":
            out["rc"] = rc
            out["error"] = _last_line(self.log.name, start) or f"exit status {rc}"
            if status == "timeout":
                out["error"] = f"stopped after {timeout:.0f} s (the budget); last: {out['error']}"
        return out


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


# -- 3. sizes ---------------------------------------------------------------------------------


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


def measure_size(check: Check, size: Size, device: str, work: Path, out: dict[str, Any]) -> None:
    """Every run of ``size`` into ``out`` (its entry in the JSON, saved after each run): the
    stand-in, then one child ``marlow train`` per routing."""
    out.update(settings=asdict(size), runs=[])
    if check.left() < size.min_s:
        out["runs"] = [_skipped(r, size, check) for r in size.routings]
        return
    folder = work / size.name
    out.update(
        guarded(check, f"{size.name} stand-in", lambda: _stand_in(check, size, folder, device))
    )
    if "error" in out:  # e.g. a full disk: this size fails, the next one runs
        shutil.rmtree(folder, ignore_errors=True)
        return
    for routing in size.routings:
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
    out: dict[str, Any] = {"routing": routing, **check.child(command, check.left())}
    metrics = run_dir / "metrics.jsonl"  # a killed run's half-written last line is left out
    records = list(read_jsonl(metrics)) if metrics.exists() else []
    out["steps"] = [step_row(r) for r in records if r["step"] > 0 and "time/learn_s" in r]
    longest = longest_prompt(run_dir / "samples.jsonl", model)
    out["plan"] = plan_row(cfg, longest)
    out.update(ratios(out["steps"], out["plan"]))
    return out


def step_row(record: dict[str, Any]) -> dict[str, Any]:
    """A step's seconds, sampled tokens per second and peak memory per phase (None off CUDA)."""
    row = {
        "step": record["step"],
        "rollout_s": record["time/rollout_s"],
        "learn_s": record["time/learn_s"],
        "rollout_tokens_per_s": record["time/rollout_tokens_per_s"],
    }
    for phase in PHASES:
        for kind in KINDS:
            key = f"{phase}_peak_{kind}_gib"
            row[key] = record.get(f"memory/{key}")
    return row


def longest_prompt(samples: Path, model: Path) -> int | None:
    """The most tokens of any prompt the run sampled from, as the sampler saw it (chat template
    applied; ``sample_episodes`` keeps every episode); None when it sampled none."""
    if not samples.exists():
        return None
    from transformers import AutoTokenizer

    from marlow.chat import chat_prompt_ids
    from marlow.diagnostics.sinks import read_jsonl

    tokenizer = AutoTokenizer.from_pretrained(model)
    turns = (t for episode in read_jsonl(samples) for t in episode["turns"])
    prompts = {t["prompt"] for t in turns if "prompt" in t}  # a tool call has none
    return max((len(chat_prompt_ids(tokenizer, p)) for p in prompts), default=None)


def plan_row(cfg: RunConfig, prompt_tokens: int | None) -> dict[str, Any]:
    """``marlow plan``'s figures for the run, in GiB, at its longest prompt (plan's default when
    the run sampled nothing)."""
    from marlow.plan import PROMPT_TOKENS, plan_run

    plan = plan_run(cfg, prompt_tokens=prompt_tokens or PROMPT_TOKENS)
    return {
        "prompt_tokens": plan.prompt_tokens,
        "prompt_tokens_measured": prompt_tokens is not None,
        "forward_tokens": plan.forward_tokens,
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


# -- the check --------------------------------------------------------------------------------


def guarded(check: Check, label: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work()``, or ``{"error": its exception in one line}``: the next part runs either way."""
    try:
        return work()
    except Exception as err:
        text = f"{type(err).__name__}: {err}".strip().splitlines()
        check.say(f"{label}: {text[0]}")
        return {"error": text[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON and the log")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="the smallest sizes and tests")
    ap.add_argument("--budget-s", type=float, default=420.0, help="seconds for the whole check")
    args = ap.parse_args(argv)
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
        files = DRY_TESTS if args.dry_run else DEVICE_TESTS
        tests = guarded(check, "tests", lambda: run_tests(check, args.device, files, work))
        check.result["tests"] = tests
        check.save()
        failed |= tests.get("status") != "ok"
        check.say(f"tests: {tests.get('status', 'error')}, {tests.get('passed')} passed")
        sizes = check.result["sizes"] = {}
        for size in DRY_SIZES if args.dry_run else SIZES:
            entry = sizes[size.name] = {}
            measure_size(check, size, args.device, work, entry)
            check.save()
            statuses = {r["status"] for r in entry["runs"]}
            failed |= "error" in entry or bool(statuses - {"ok", "skipped"})
    check.result["check"]["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    check.save()
    check.say(f"done: {'something failed' if failed else 'all ok'} -> {check.path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
