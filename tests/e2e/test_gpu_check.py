"""The GPU check on the CPU, so that it cannot rot while no GPU is at hand: its dry run
(``bench/gpu_check.py --device cpu --dry-run``: the environment, the device tests, the HF
sampler alone on a shrunken Qwen3-0.6B stand-in beside its bandwidth bound, the stand-in's
update alone beside plan's prediction, the stand-in trained for a step) writes every field the GPU
run writes; a failing or overrunning child is recorded, not fatal; and docs/scaling.md's
"Measured on a GPU" section is what ``bench/gpu_docs.py`` makes of the committed JSON (or "Not
yet measured" while there is none)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from marlow.archs import arch_config
from marlow.plan import (
    OPTIMIZER_BYTES,
    Shape,
    activation_bytes,
    lora_shapes,
    non_embedding_parameters,
)
from marlow.policy.adapters import LoraSpec, adapter_parameters, attach_adapters

ROOT = Path(__file__).resolve().parents[2]


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = bench_module("gpu_check")
gpu_docs = bench_module("gpu_docs")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    command = [sys.executable, "bench/gpu_check.py", "--out", str(out), "--device", "cpu"]
    proc = subprocess.run([*command, "--dry-run"], cwd=ROOT, capture_output=True, text=True)
    return proc, json.loads((out / "gpu_check.json").read_text()), out


@pytest.mark.slow  # the dry run takes ~70 s on 2 cores: make test-gpu-check (in CI)
def test_the_dry_run_records_every_part_and_plan_beside_each_step(dry_run):
    proc, result, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: all ok" in proc.stdout
    log = (out / "gpu_check.log").read_text()
    assert "passed" in log and "trained to step 1" in log  # the children's output is kept
    assert result["check"]["device"] == "cpu" and result["check"]["dry_run"] is True
    assert result["check"]["finished"] >= result["check"]["started"]

    env = result["environment"]
    assert env["device"] == "cpu" and "gpu" not in env
    for name in ("torch", "transformers", "peft", "pydantic", "math-verify"):
        assert env["packages"][name], name
    assert env["unmet"] == []

    tests = result["tests"]
    assert tests["status"] == "ok" and tests["files"] == list(gpu_check.DRY_TESTS)
    assert tests["passed"] == tests["tests"] > 0 and tests["failed_tests"] == []

    assert list(result["sizes"]) == [s.name for s in gpu_check.DRY_SIZES]
    for size in gpu_check.DRY_SIZES:
        entry = result["sizes"][size.name]
        assert entry["settings"]["arch"] == size.arch and entry["stand_in_s"] >= 0
        assert [r["routing"] for r in entry["runs"]] == list(size.routings)
        for run in entry["runs"]:
            assert run["status"] == "ok", run
            assert [s["step"] for s in run["steps"]] == list(range(1, size.steps + 1))
            for step in run["steps"]:
                assert step["rollout_s"] > 0 and step["learn_s"] > 0
                parts = [step[f"{part}_s"] for part in gpu_check.LEARN_PARTS]
                assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(step["learn_s"])
                assert step["rollout_tokens_per_s"] > 0
                for phase in ("rollout", "learn"):  # the columns exist; the CPU has no figures
                    for kind in ("allocated", "reserved"):
                        assert step[f"{phase}_peak_{kind}_gib"] is None
            plan = run["plan"]
            assert plan["prompt_tokens_measured"] and plan["prompt_tokens"] > 50
            assert plan["max_batch"] == 48  # the paper preset's
            assert plan["forward_tokens"] == max(size.micro_tokens, plan["prompt_tokens"] + 8)
            parts = [plan[k] for k in ("base_gib", "adapters_gib", "activations_gib")]
            assert all(p > 0 for p in parts)
            assert plan["base_gib"] < 0.05  # shrunken: 2 narrow layers (the 0.6B's: 1.1 GiB)
            peak = plan["base_gib"] + plan["adapters_gib"]
            peak += max(plan["activations_gib"], plan["kv_cache_gib"])
            assert plan["peak_gib"] == pytest.approx(peak)
            for key in ("peak_allocated_gib", "peak_reserved_gib", "ratio", "learn_ratio"):
                assert run[key] is None


@pytest.mark.slow  # the dry run takes ~70 s on 2 cores: make test-gpu-check (in CI)
def test_the_dry_run_times_the_sampler_beside_its_bandwidth_bound(dry_run):
    part = dry_run[1]["sampler"]
    assert part["status"] == "ok", part
    assert part["settings"]["arch"] == "qwen3-0.6b" and part["settings"]["adapters"] == 4
    assert part["bandwidth_bytes_per_s"] > 0 and part["kv_bytes_per_token"] > 0
    assert 0 < part["adapter_bytes"] < part["weight_bytes"] < 0.05 * 2**30  # shrunken
    expected = gpu_check.configurations(gpu_check.DRY_SAMPLER)
    keys = ("rows", "adapters", "compile", "attention")
    assert [tuple(c[k] for k in keys) for c in part["configurations"]] == [
        tuple(c[k] for k in keys) for c in expected
    ]
    eager = [c for c in part["configurations"] if c["compile"] is False]
    assert len(eager) == 1 and eager[0]["rows"] == gpu_check.DRY_SAMPLER.eager_rows
    assert not any(c["compiled"] for c in part["configurations"])  # auto: eager on the CPU
    for c in part["configurations"]:
        sampler = gpu_check.DRY_SAMPLER
        tokens = sampler.eager_tokens if c["compile"] is False else sampler.new_tokens
        assert c["status"] == "ok" and c["new_tokens"] == tokens, c
        assert c["tokens_per_s"] > 0 and c["seconds"] > 0 and c["warmup_s"] > 0
        assert c["peak_allocated_gib"] is None  # the CPU has no figure
        assert c["given_up"] == []  # nothing compiled on the CPU, nothing given up
        used = min(c["rows"], c["adapters"])  # rows dealt to the adapters in turn
        step = part["weight_bytes"] + used * part["adapter_bytes"]
        step += c["rows"] * c["context_tokens"] * part["kv_bytes_per_token"]
        assert c["step_bytes"] == pytest.approx(step)
        bound = c["rows"] * part["bandwidth_bytes_per_s"] / step
        assert math.isfinite(c["bound_tokens_per_s"])
        assert c["bound_tokens_per_s"] == pytest.approx(bound)
        assert c["fraction_of_bound"] == pytest.approx(c["tokens_per_s"] / bound)
    profiled = [c for c in part["configurations"] if "profile" in c]
    sampler = gpu_check.DRY_SAMPLER
    k = sampler.adapters
    assert [(c["rows"], c["adapters"], c["compile"], c["attention"]) for c in profiled] == [
        *((rows, k, None, "span") for rows in sampler.profile_rows),
        *((rows, k, None, "rows") for rows in sampler.blocks_rows if rows in sampler.profile_rows),
    ]
    # some batches once more, their steps' flex attention reading each row's blocks (side by side)
    blocks = [c for c in part["configurations"] if c["attention"] == "rows"]
    assert [(c["rows"], c["adapters"], c["compile"]) for c in blocks] == [
        (rows, sampler.adapters, None) for rows in sampler.blocks_rows
    ]
    assert_profile(profiled[0]["profile"])
    # the refill pair: the same rows both ways, their completions of scattered lengths; and the
    # refilled call once more, each row's flex attention reading its own blocks
    off, on, by_blocks = part["refill"]
    assert [(c["refill"], c["attention"]) for c in part["refill"]] == [
        (False, "span"),
        (True, "span"),
        (True, "rows"),
    ]
    for c in (off, on, by_blocks):
        assert c["status"] == "ok" and c["tokens_per_s"] == pytest.approx(
            c["tokens"] / c["seconds"]
        )
        assert 1 <= c["mean_length"] <= c["longest"] <= sampler.refill.new_tokens
        assert c["mean_length"] < c["longest"] and c["compiled"] is False
    assert 0.5 <= on["same_samples"] <= 1  # seeded rows: the same tokens but for round-off


def assert_profile(profile: dict) -> None:
    """A profile of the CPU: its aten operations, the longest first, within their total."""
    assert profile["what"] == "aten operations" and profile["seconds"] > 0
    top = profile["top"]
    assert 0 < len(top) <= gpu_check.PROFILE_TOP and all(
        t["name"].startswith("aten::") for t in top
    )
    assert [t["s"] for t in top] == sorted((t["s"] for t in top), reverse=True)
    assert sum(t["calls"] for t in top) <= profile["count"]
    assert 0 < sum(t["s"] for t in top) <= profile["device_s"] + 1e-9
    # every operation's time in one kind; the CPU's matrix products among them
    kinds = profile["kinds"]
    assert list(kinds) == ["attention", "matrix products", "the rest"]
    assert abs(sum(kinds.values()) - profile["device_s"]) < 1e-6 and kinds["matrix products"] > 0
    products = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")
    listed = sum(t["s"] for t in top if t["name"] in products)
    assert kinds["matrix products"] >= listed - 1e-9
    # the same time by operation and what ran it: a line of code outside torch, or autograd's
    # node for a backward
    ops = profile["operations"]
    assert 0 < len(ops) <= gpu_check.PROFILE_TOP and all(
        o["name"].startswith("aten::") for o in ops
    )
    assert [o["s"] for o in ops] == sorted((o["s"] for o in ops), reverse=True)
    assert 0 < sum(o["s"] for o in ops) <= profile["device_s"] + 1e-9
    assert all(o["where"] != "?" and not o["where"].startswith("torch/") for o in ops)
    assert any(".py(" in o["where"] for o in ops)
    assert kinds["the rest"] >= sum(t["s"] for t in top if t["name"] == "aten::mul") - 1e-9


def test_a_sampler_child_that_dies_is_recorded_and_what_it_measured_kept(tmp_path, monkeypatch):
    """The configuration it was sampling takes its status and last line; those it never reached
    are skipped; its figures so far stay."""
    dies = """\
import json, sys
rows = [{"rows": 2, "adapters": 1, "new_tokens": 8, "status": "ok", "tokens_per_s": 9.0},
        {"rows": 2, "adapters": 4, "new_tokens": 8, "status": "running"}]
json.dump({"bandwidth_bytes_per_s": 1e9, "configurations": rows}, open(sys.argv[1], "w"))
raise SystemExit("CUDA error: an illegal memory access was encountered")
"""
    monkeypatch.setattr(gpu_check, "SAMPLER_CHILD", dies)
    check = gpu_check.Check(tmp_path, "cpu", dry_run=True, budget_s=300)
    part = gpu_check.measure_sampler(check, "cpu", True, tmp_path)
    assert part["status"] == "failed" and part["bandwidth_bytes_per_s"] == 1e9
    assert [c["status"] for c in part["configurations"]] == ["ok", "failed"] + ["skipped"] * 4
    assert part["configurations"][1]["error"].startswith("CUDA error: an illegal memory")
    assert part["configurations"][2]["error"] == gpu_check.NOT_REACHED

    short = gpu_check.Check(tmp_path, "cpu", dry_run=True, budget_s=60)  # the sizes need 60 s
    part = gpu_check.measure_sampler(short, "cpu", True, tmp_path)
    assert part["status"] == "skipped" and len(part["configurations"]) == 6
    assert {c["status"] for c in part["configurations"]} == {"skipped"}


@pytest.mark.slow  # the dry run takes ~70 s on 2 cores: make test-gpu-check (in CI)
def test_the_dry_run_times_the_update_alone_beside_plans_prediction(dry_run):
    """Every micro-batch measured, and plan's figures and the FLOPs equal to their formulas on
    the same stand-in shape built on the meta device."""
    result, log = dry_run[1], (dry_run[2] / "gpu_check.log").read_text()
    update = gpu_check.DRY_UPDATE
    for size in gpu_check.DRY_SIZES:
        part = result["sizes"][size.name]["update"]
        assert part["status"] == "ok", part
        settings = {**dataclasses.asdict(update), "update_s": size.update_s}
        assert part["settings"] == json.loads(json.dumps(settings))  # tuples as lists
        assert log.index(f"{size.name} update: ok") < log.index(f"{size.name} ip: training")
        assert part["matmul_flops_per_s"] > 0 and part["load_s"] >= 0
        config = Qwen3Config(**{**arch_config(size.arch), **size.shrink})
        with torch.device("meta"):
            base = Qwen3ForCausalLM(config).to(torch.bfloat16)
            base_bytes = sum(p.numel() * 2 for p in {id(p): p for p in base.parameters()}.values())
            assert part["non_embedding_parameters"] == non_embedding_parameters(base)
            model = attach_adapters(base, ["policy"], LoraSpec(rank=64), seed=0)
        n = sum(p.numel() for p in adapter_parameters(model, "policy").values())
        assert part["weight_bytes"] == base_bytes and part["adapter_parameters"] == n
        lora = lora_shapes(model, "policy")
        assert [m["tokens"] for m in part["micro_batches"]] == list(update.tokens)
        assert [("profile" in m) for m in part["micro_batches"]] == [True, False]
        assert_profile(part["micro_batches"][0]["profile"])
        # eager and checkpointed, as a run's layers are by default, and each micro-batch once
        # more not checkpointed, beside plan's figure for that (always in the dry run, so that
        # CI runs that path)
        assert part["compiled"] is False
        for m in part["micro_batches"]:
            unchecked = m["unchecked"]
            assert unchecked["status"] == "ok", unchecked
            assert unchecked["tokens_per_s"] == pytest.approx(m["tokens"] / unchecked["seconds"])
            assert unchecked["warmup_s"] > 0 and unchecked["peak_allocated_gib"] is None
            shape = Shape.of(config)
            activations = activation_bytes(shape, 2, lora, m["tokens"], True, False, False, 2 * n)
            assert unchecked["plan"]["activations_gib"] == pytest.approx(activations / 2**30)
            checked = m["plan"]["activations_gib"]
            assert unchecked["plan"]["activations_gib"] > checked  # every layer's own, kept
        # the first once more through transformers' own rotary embedding, through torch's
        # checkpoint and with the head's logits computed again in the backward; then each with
        # its layers compiled, checkpointed and not (the first's profiled), side by side with
        # the eager figures
        first, second = part["micro_batches"]
        compiled = gpu_check.COMPILED
        assert [(r["key"], r["what"], r["against"]) for r in first["side_by_side"]] == [
            ("transformers_rotary", "transformers' own rotary embedding", "through marlow's"),
            ("torch_checkpoint", "torch.utils.checkpoint", "through marlow's"),
            (
                "recomputed_head",
                "an LM head whose backward computes each chunk's logits again",
                "through marlow's",
            ),
            ("compiled_layers", compiled, "with eager layers"),
            (
                "compiled_layers",
                f"{compiled}, not checkpointed",
                "with eager layers not checkpointed",
            ),
        ]
        assert [r["what"] for r in second["side_by_side"]] == [
            compiled,
            f"{compiled}, not checkpointed",
        ]
        for m in (first, second):
            for own in m["side_by_side"]:
                assert own["status"] == "ok", own
                assert own["tokens_per_s"] == pytest.approx(m["tokens"] / own["seconds"])
                assert own["warmup_s"] > 0 and own["peak_allocated_gib"] is None
                profiled = (
                    own["key"] == "compiled_layers" and m is first and own["what"] == compiled
                )
                assert ("profile" in own) == profiled
            eager = [m["tokens_per_s"], m["unchecked"]["tokens_per_s"]]
            assert [r["against_tokens_per_s"] for r in m["side_by_side"][-2:]] == eager
        profile = first["side_by_side"][3]["profile"]
        assert profile["count"] > 0 and profile["top"] and profile["operations"]
        # the first compiled pass compiles; the larger micro-batch, both ways, nothing more
        # (dynamic shapes; the layers not checkpointed run the recompute's graphs)
        assert first["side_by_side"][3]["graphs"] > 0
        assert [r["graphs"] for r in second["side_by_side"]] == [0, 0]
        for m in part["micro_batches"]:
            assert m["status"] == "ok" and m["rows"] * update.row == m["tokens"], m
            assert m["tokens_per_s"] == pytest.approx(m["tokens"] / m["seconds"])
            assert m["tokens_per_s"] > 0 and m["warmup_s"] > 0
            # the factors in bfloat16, held for the pass: 2 bytes a LoRA parameter
            shape = Shape.of(config)
            activations = activation_bytes(shape, 2, lora, m["tokens"], True, True, False, 2 * n)
            plan = [base_bytes, OPTIMIZER_BYTES * n, activations]
            expect = dict(zip(("base_gib", "adapters_gib", "activations_gib"), plan, strict=True))
            expect = {k: v / 2**30 for k, v in expect.items()} | {"peak_gib": sum(plan) / 2**30}
            assert m["plan"] == pytest.approx(expect)
            s = Shape.of(config)
            flops = 4 * (part["non_embedding_parameters"] + n) * m["tokens"]
            flops += 4 * s.L * m["tokens"] * (update.row + 1) / 2 * s.a * s.d * 2
            assert m["flops"] == pytest.approx(flops)
            fraction = flops / m["seconds"] / part["matmul_flops_per_s"]
            assert math.isfinite(m["fraction_of_peak"]) and m["fraction_of_peak"] > 0
            assert m["fraction_of_peak"] == pytest.approx(fraction)
            assert m["peak_allocated_gib"] is None and m["ratio"] is None  # the CPU has no figure


def test_an_update_child_that_dies_is_recorded_and_the_runs_go_on(tmp_path, monkeypatch):
    """The micro-batch it was at takes its status and last line, the next is skipped; a budget
    short of the runs' ``min_s`` and the update's cap skips the update, not the runs."""
    dies = """\
import json, sys
rows = [{"tokens": 64, "rows": 2, "row_tokens": 32, "prompt": 8, "status": "running"}]
json.dump({"matmul_flops_per_s": 1e12, "micro_batches": rows}, open(sys.argv[1], "w"))
raise SystemExit("torch.OutOfMemoryError: CUDA out of memory")
"""
    monkeypatch.setattr(gpu_check, "UPDATE_CHILD", dies)
    done = []
    monkeypatch.setattr(gpu_check, "_stand_in", lambda *a: {"stand_in_s": 0.0})
    monkeypatch.setattr(gpu_check, "measure_run", lambda c, s, r, *a: done.append(r) or {})
    size = gpu_check.DRY_SIZES[0]
    check = gpu_check.Check(tmp_path, "cpu", dry_run=True, budget_s=300)
    entry = {}
    gpu_check.measure_size(check, size, "cpu", True, tmp_path, entry)
    part = entry["update"]
    assert part["status"] == "failed" and part["matmul_flops_per_s"] == 1e12
    assert [m["status"] for m in part["micro_batches"]] == ["failed", "skipped"]
    assert part["micro_batches"][0]["error"].startswith("torch.OutOfMemoryError: CUDA out of")
    assert part["micro_batches"][1]["error"] == gpu_check.NOT_REACHED
    assert done == list(size.routings)  # the runs went on

    short = size.min_s * len(size.routings) + size.update_s - 5
    check = gpu_check.Check(tmp_path, "cpu", dry_run=True, budget_s=short)
    entry, done[:] = {}, []
    gpu_check.measure_size(check, size, "cpu", True, tmp_path, entry)
    part = entry["update"]
    assert part["status"] == "skipped" and "needed with the runs" in part["error"]
    assert [m["status"] for m in part["micro_batches"]] == ["skipped", "skipped"]
    assert done == list(size.routings)

    # --skip runs: the update needs no time for the runs, which are recorded as left out
    check = gpu_check.Check(tmp_path, "cpu", dry_run=True, budget_s=short)
    entry, done[:] = {}, []
    gpu_check.measure_size(check, size, "cpu", True, tmp_path, entry, skip=("runs",))
    assert entry["update"]["status"] == "failed" and done == []  # it ran (and died, as above)
    assert [(r["routing"], r["status"]) for r in entry["runs"]] == [
        (r, "skipped") for r in size.routings
    ]
    assert {r["error"] for r in entry["runs"]} == {"left out (--skip runs)"}


def test_a_micro_batch_waits_for_the_one_before_and_its_estimate():
    ok = {"tokens": 64, "status": "ok", "seconds": 2.0}
    assert gpu_check.not_yet(None, {"tokens": 64}, 0.0) is None  # the first: any time left
    assert gpu_check.not_yet(ok, {"tokens": 256}, 17.0) is None  # 2 x 2 s x 4 = 16 s
    assert gpu_check.not_yet(ok, {"tokens": 256}, 15.0) == "estimated 16 s, 15 s left"
    failed = {"tokens": 8192, "status": "failed"}
    assert gpu_check.not_yet(failed, {"tokens": 32768}, 99.0) == (
        "the 8,192-token micro-batch did not succeed"
    )


def test_measured_over_predicted_takes_each_phase_peak_over_the_steps():
    plan = {"base_gib": 1.0, "adapters_gib": 1.0, "kv_cache_gib": 2.0, "activations_gib": 4.0}
    plan["peak_gib"] = 6.0
    steps = [
        {"rollout_peak_allocated_gib": 3.0, "learn_peak_allocated_gib": 5.4},
        {"rollout_peak_allocated_gib": 3.5, "learn_peak_allocated_gib": 4.5},
    ]
    for s, reserved in zip(steps, (7.0, 8.0), strict=True):
        s |= {"rollout_peak_reserved_gib": 4.0, "learn_peak_reserved_gib": reserved}
    got = gpu_check.ratios(steps, plan)
    assert got == {
        "rollout_peak_allocated_gib": 3.5,
        "rollout_ratio": 3.5 / 4.0,  # against base + adapters + KV cache
        "learn_peak_allocated_gib": 5.4,
        "learn_ratio": 5.4 / 6.0,  # against base + adapters + activations
        "peak_allocated_gib": 5.4,
        "peak_reserved_gib": 8.0,
        "ratio": 5.4 / 6.0,  # against plan's peak
    }
    assert gpu_check.ratios([], plan)["ratio"] is None  # a run that finished no step


def test_a_failing_or_overrunning_child_is_recorded_and_the_check_goes_on(tmp_path):
    check = gpu_check.Check(tmp_path, "cpu", dry_run=True, budget_s=60)
    failed = check.child(
        [sys.executable, "-c", "print('step 1'); raise SystemExit('OOM here')"], 30
    )
    assert failed["status"] == "failed" and failed["rc"] == 1 and failed["error"] == "OOM here"
    slow = check.child([sys.executable, "-c", "import time; print('started'); time.sleep(60)"], 1)
    assert slow["status"] == "timeout" and "started" in slow["error"]
    assert check.child([sys.executable, "-c", "print('fine')"], 30)["status"] == "ok"
    assert "OOM here" in (tmp_path / "gpu_check.log").read_text()


def test_a_child_whose_exit_hangs_after_its_final_line_is_stopped_with_its_stacks(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(gpu_check, "EXIT_GRACE_S", 1.0)
    check = gpu_check.Check(tmp_path, "cpu", dry_run=True, budget_s=60)
    hangs = (  # a non-daemon thread holds the exit, as the interpreter waits for it
        "import threading, time\n"
        "def stuck_thread_body(): time.sleep(60)\n"
        "threading.Thread(target=stuck_thread_body).start()\n"
        "print('next: done here')\n"
    )
    got = check.child([sys.executable, "-c", hangs], 30, final="next: done")
    assert got["status"] == "exit_timeout" and got["seconds"] < 15
    assert "did not exit within 1 s" in got["error"]
    assert "stuck_thread_body" in (tmp_path / "gpu_check.log").read_text()  # faulthandler's
    # the marker seen in time, a child that exits is ok; one that never prints it runs on
    quick = "import time; print('next: done'); time.sleep(0.3)"
    fine = check.child([sys.executable, "-c", quick], 30, final="next: done")
    assert fine["status"] == "ok"
    slow = check.child([sys.executable, "-c", "import time; time.sleep(3)"], 30, final="next:")
    assert slow["status"] == "ok" and slow["seconds"] >= 3


def test_junit_counts_name_the_failures(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="1" skipped="1">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="assert 1 == 2&#10;more"/>'
        '</testcase><testcase classname="tests.b" name="test_err"><error message="boom"/>'
        '</testcase><testcase classname="tests.b" name="test_skip"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    assert gpu_check.junit_counts(xml) == {
        "tests": 4,
        "failures": 1,
        "errors": 1,
        "skipped": 1,
        "passed": 1,
        "failed_tests": ["tests.a::test_bad: assert 1 == 2", "tests.b::test_err: boom"],
    }


# -- docs/scaling.md's generated section ------------------------------------------------------


def test_the_committed_section_is_what_the_committed_json_gives():
    page = gpu_docs.PAGE.read_text()
    assert gpu_docs.render_page(page, gpu_docs.read_result(gpu_docs.RESULT)) == page, (
        "docs/scaling.md is stale: run python bench/gpu_docs.py"
    )
    if not gpu_docs.RESULT.exists():
        assert f"{gpu_docs.BEGIN}\n{gpu_docs.NOT_YET}\n{gpu_docs.END}" in page


def test_merge_takes_each_part_from_the_call_that_measured_it():
    left = gpu_check._left_out
    env = {"device": "cuda:0", "gpu": "card"}

    def call(seconds, budget, tests, sampler, update, ip, sp):
        size = {"stand_in_s": seconds, "update": update, "runs": [ip, sp]}
        check = {"started": f"t{seconds}", "seconds": seconds, "budget_s": budget}
        return {
            "check": check,
            "environment": env,
            "tests": tests,
            "sampler": sampler,
            "sizes": {"s": size},
        }

    ip = {"routing": "ip", "status": "ok", "steps": [{"step": 1}]}
    sp = {"routing": "sp", "status": "timeout", "error": "stopped after 9 s (the budget)"}
    calls = [
        call(
            10,
            20,
            left("tests"),
            {"status": "ok"},
            {"status": "ok"},
            ip | left("runs"),
            {"routing": "sp"} | left("runs"),
        ),
        call(30, 40, left("tests"), left("sampler"), left("update"), ip, sp),
        call(
            50,
            60,
            {"status": "ok", "passed": 3},
            left("sampler"),
            left("update"),
            {"routing": "ip"} | left("runs"),
            {"routing": "sp"} | left("runs"),
        ),
    ]
    merged = gpu_docs.merge(calls)
    assert merged["tests"] == {"status": "ok", "passed": 3}  # the third call's
    assert merged["sampler"] == {"status": "ok"}  # the first's
    size = merged["sizes"]["s"]
    assert size["update"] == {"status": "ok"} and size["stand_in_s"] == 10
    assert size["runs"] == [ip, sp]  # the second's: a timeout is a measurement, not left out
    assert merged["check"]["started"] == "t10" and merged["check"]["seconds"] == 90
    assert merged["check"]["calls"] == [
        {"seconds": 10, "budget_s": 20},
        {"seconds": 30, "budget_s": 40},
        {"seconds": 50, "budget_s": 60},
    ]
    assert gpu_docs._calls(merged["check"]) == (
        ", in 3 calls (10 s of a 20 s budget, 30 s of a 40 s budget, 50 s of a 60 s budget), "
        "each leaving out what the others measured"
    )
    assert gpu_docs._calls(calls[0]["check"]) == ""  # one call: nothing to say
    # a part no call measured stays left out
    only = gpu_docs.merge(calls[1:2])
    assert only["sampler"] == left("sampler") and only["sizes"]["s"]["update"] == left("update")
    with pytest.raises(gpu_docs.DocsError, match="nothing to merge"):
        gpu_docs.merge([])


def as_gpu_run(result: dict) -> dict:
    """The dry run's JSON as a CUDA run would write it: a card, and memory in every step."""
    gpu = copy.deepcopy(result)
    gpu["environment"] |= {
        "device": "cuda:0",
        "gpu": "NVIDIA H100 80GB HBM3",
        "gpu_memory_gib": 79.19,
        "driver": "580.159.04",
        "torch_cuda": "13.0",
    }
    for entry in gpu["sizes"].values():
        for run in entry["runs"]:
            for step in run["steps"]:
                step |= {
                    "rollout_peak_allocated_gib": 0.5,
                    "rollout_peak_reserved_gib": 0.75,
                    "rollout_start_allocated_gib": 0.25,
                    "learn_peak_allocated_gib": 1.25,
                    "learn_peak_reserved_gib": 1.5,
                    "learn_start_allocated_gib": 0.375,
                }
            run |= gpu_check.ratios(run["steps"], run["plan"])
        for m in entry["update"]["micro_batches"]:
            m["peak_allocated_gib"] = 3.0
            m["ratio"] = 3.0 / m["plan"]["peak_gib"]
            if "unchecked" in m:
                u = m["unchecked"]
                u["peak_allocated_gib"], u["ratio"] = 4.0, 4.0 / u["plan"]["peak_gib"]
    for c in gpu["sampler"]["configurations"]:
        c["peak_allocated_gib"] = 2.5
        c["compiled"] = c["compile"] is None  # CUDA's default: a compiled decode step
    for c in gpu["sampler"]["refill"]:
        c["compiled"] = True
    return gpu


@pytest.mark.slow  # the dry run takes ~70 s on 2 cores: make test-gpu-check (in CI)
def test_the_section_of_a_gpu_run_gives_the_date_the_card_and_each_figure(dry_run):
    result = as_gpu_run(dry_run[1])
    entry = next(iter(result["sizes"].values()))
    entry["runs"].append({"routing": "sp", "status": "skipped", "error": "not enough time"})
    text = gpu_docs.section(result)
    date = result["check"]["started"][:10]
    assert text.startswith(f"Measured on {date} on one NVIDIA H100 80GB HBM3 (79 GiB, driver ")
    assert f"{result['tests']['passed']} passed, 0 failed, 0 errors, 0 skipped" in text
    name, run = entry["settings"]["name"], entry["runs"][0]
    assert f"| {name} | ip | 1 | " in text and "| 0.50 / 1.25 | 0.75 / 1.50 |" in text
    plan = run["plan"]
    peak = f"1.25 / {plan['peak_gib']:.2f} ({1.25 / plan['peak_gib']:.2f})"
    assert f"| {name} | ip | {plan['prompt_tokens']:,} |" in text and peak in text
    assert f"* {name} sp: skipped: not enough time" in text
    fixed = plan["base_gib"] + plan["adapters_gib"]
    assert (
        "Allocated when the rollout and the learn phase began, against plan's base + adapters "
        f"(GiB): {name} ip step 1: 0.25 / 0.38 against {fixed:.2f}"
    ) in text
    part = result["sampler"]
    bandwidth = f"({part['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s, measured in the same run)"
    assert "| batch | adapters | decode step | tokens/s | bound tokens/s |" in text
    assert bandwidth in text
    for c in part["configurations"]:
        step = "compiled" if c["compiled"] else "eager"
        step += ", " + gpu_docs.ATTENTION[c["attention"]] if c["compiled"] else ""
        assert (
            f"| {c['rows']} | {c['adapters']} | {step} | {c['tokens_per_s']:,.0f} "
            f"| {c['bound_tokens_per_s']:,.0f} | {c['fraction_of_bound']:.3f} "
            f"| {c['warmup_s']:,.1f} |"
        ) in text
    assert text.index("| batch |") < text.index("| model | routing | step |")
    for c in part["refill"]:
        way = ("on" if c["refill"] else "off") + ", " + gpu_docs.ATTENTION[c["attention"]]
        assert (
            f"| {way} | {c['tokens']:,} | {c['mean_length']:.1f} / "
            f"{c['longest']} | {c['seconds']:,.2f} | {c['tokens_per_s']:,.0f} |"
        ) in text
    assert f"refill off and on: {part['refill'][1]['same_samples']:.3f}." in text
    assert "Given up by" not in text
    old = gpu_docs.PAGE.read_text()
    page = gpu_docs.render_page(old, result)
    assert text in page and gpu_docs.NOT_YET not in page and page.count(gpu_docs.BEGIN) == 1
    # the page's other text is left as it was
    assert page.split(gpu_docs.BEGIN)[0] == old.split(gpu_docs.BEGIN)[0]
    assert page.split(gpu_docs.END)[1] == old.split(gpu_docs.END)[1]
    # what the compiled decode steps gave up, named
    part["configurations"][-1]["given_up"] = ["attention", "graphs"]
    assert "steps going on without it): the compiled flex attention, the CUDA graphs." in (
        gpu_docs.section(result)
    )


@pytest.mark.slow  # the dry run takes ~70 s on 2 cores: make test-gpu-check (in CI)
def test_the_section_lists_sampler_configurations_that_did_not_complete(dry_run):
    result = as_gpu_run(dry_run[1])
    last = result["sampler"]["configurations"][-1]
    last.update(status="skipped", error="estimated 90 s, 40 s left")
    text = gpu_docs.section(result)
    assert last["compile"] is False  # the eager batch runs last in the dry run
    assert f"| {last['rows']} | {last['adapters']} | eager | skipped | - | - | - |" in text
    assert f"* batch {last['rows']}, 4 adapters, eager: skipped: estimated 90 s, 40 s left" in text
    result["sampler"] = {"status": "failed", "error": "CUDA error: out of memory"}
    assert "The sampler part measured nothing: CUDA error: out of memory." in (
        gpu_docs.section(result)
    )
    del result["sampler"]  # a check's JSON without the part: the section has no sampler lines
    text = gpu_docs.section(result)
    assert "sampler" not in text and "| batch |" not in text


@pytest.mark.slow  # the dry run takes ~70 s on 2 cores: make test-gpu-check (in CI)
def test_the_section_of_a_gpu_run_has_the_update_alone_table(dry_run):
    result = as_gpu_run(dry_run[1])
    name, entry = next(iter(result["sizes"].items()))
    part = entry["update"]
    text = gpu_docs.section(result)
    assert (
        "| model | tokens | layers | tokens/s | other tokens/s | fraction of bf16 peak "
        "| peak allocated GiB |"
    ) in text
    assert f"(measured in each size's run, TFLOP/s: {name} " in text
    for m in part["micro_batches"]:
        other = f"{m['unchecked']['tokens_per_s']:,.0f}" if "unchecked" in m else "-"
        assert (
            f"| {name} | {m['tokens']:,} | eager | {m['tokens_per_s']:,.0f} | {other} "
            f"| {m['fraction_of_peak']:.3f} | 3.00 | {m['plan']['peak_gib']:.2f} "
            f"| {3.0 / m['plan']['peak_gib']:.2f} |"
        ) in text
    unchecked = [  # each micro-batch's figures not checkpointed
        f"{name} {m['tokens']:,} tokens: 4.00 against plan's {plan:.2f} (ratio {4.0 / plan:.2f})"
        for m in part["micro_batches"]
        if (plan := m["unchecked"]["plan"]["peak_gib"])
    ]
    assert len(unchecked) == 2
    assert f"Not checkpointed, peak allocated GiB: {'; '.join(unchecked)}." in text
    first = part["micro_batches"][0]
    for own in first["side_by_side"]:
        theirs = own.get("against_tokens_per_s", first["tokens_per_s"])
        compiled = (
            f" (first pass {own['warmup_s']:.1f} s, {own['graphs']} graphs compiled)"
            if own["key"] == "compiled_layers"
            else ""
        )
        assert (
            f"Through {own['what']}: {name} {first['tokens']:,} tokens: "
            f"{own['tokens_per_s']:,.0f} tokens/s against {theirs:,.0f} {own['against']}"
            f"{compiled}"
        ) in text
    assert "Through torch.utils.checkpoint: " in text
    assert f"Profile of the {name} update of {first['tokens']:,} tokens, decoder layers " in text
    assert text.index("| batch |") < text.index("| model | tokens |")
    assert text.index("| model | tokens |") < text.index("| model | routing | step |")

    last = part["micro_batches"][-1]
    last.update(status="failed", error="torch.OutOfMemoryError: CUDA out of memory")
    text = gpu_docs.section(result)
    plan = f"{last['plan']['peak_gib']:.2f}"
    assert f"| {name} | {last['tokens']:,} | eager | failed | - | - | - | {plan} | - |" in text
    assert f"* {name} {last['tokens']:,} tokens: failed: torch.OutOfMemoryError: CUDA" in text
    entry["update"] = {"error": "RuntimeError: boom"}  # the part raised before it started
    text = gpu_docs.section(result)
    assert f"The update alone measured nothing: {name}: RuntimeError: boom." in text
    del entry["update"]  # a check's JSON without the part: no update lines
    assert "update alone" not in gpu_docs.section(result)


@pytest.mark.slow  # the dry run takes ~70 s on 2 cores: make test-gpu-check (in CI)
def test_the_section_shows_each_profile_and_leaves_out_runs_that_took_no_step(dry_run):
    result = as_gpu_run(dry_run[1])
    name, entry = next(iter(result["sizes"].items()))
    text = gpu_docs.section(result)
    sampler, update = gpu_check.DRY_SAMPLER, entry["update"]["micro_batches"][0]
    configuration = next(c for c in result["sampler"]["configurations"] if "profile" in c)
    rows, k, new = sampler.profile_rows[0], sampler.adapters, sampler.profile_tokens
    how = gpu_docs.ATTENTION[configuration["attention"]]
    for what, profile in (
        (
            f"sampling {rows} rows of {k} adapters for {new} new tokens, {how}",
            configuration["profile"],
        ),
        (f"the {name} update of {update['tokens']:,} tokens", update["profile"]),
    ):
        assert f"Profile of {what} (" in text
        assert f"{profile['count']:,} aten operations, {profile['device_s']:.3f} s" in text
        kinds = profile["kinds"]
        products = round(100 * kinds["matrix products"] / profile["device_s"])
        assert (
            f"included), of which {round(100 * kinds['attention'] / profile['device_s'])}% " in text
        )
        assert f"% attention, {products}% matrix products, " in text
        top = profile["top"][: gpu_docs.PROFILE_ROWS]
        assert len(top) > 1
        assert all(f"| `{t['name']}` | {t['calls']:,} | {t['s']:.4f} |" in text for t in top)
        ops = profile["operations"][: gpu_docs.PROFILE_ROWS]
        assert len(ops) > 1 and all(
            f"| `{o['name']}` | `{o['where']}` | {o['calls']:,} | {o['s']:.4f} |" in text
            for o in ops
        )
    assert text.index("| model | tokens |") < text.index("Profile of")
    for run in entry["runs"]:
        run.update(steps=[], status="skipped", error="left out (--skip runs)")
    text = gpu_docs.section(result)
    assert "| model | routing | step |" not in text and "No training run took a step." in text
    assert f"* {name} ip: skipped: left out (--skip runs)" in text


@pytest.mark.slow  # the dry run takes ~70 s on 2 cores: make test-gpu-check (in CI)
def test_the_section_refuses_a_cpu_run_and_a_page_without_its_markers(dry_run, tmp_path):
    with pytest.raises(gpu_docs.DocsError, match="ran on 'cpu' .a dry run"):
        gpu_docs.section(dry_run[1])
    with pytest.raises(gpu_docs.DocsError, match="no section between"):
        gpu_docs.render_page("# a page\n", None)
    page = tmp_path / "page.md"
    page.write_text(gpu_docs.PAGE.read_text())
    cpu = dry_run[2] / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "bench/gpu_docs.py", "--json", str(cpu), "--page", str(page)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "a dry run" in done.stderr and page.read_text() == gpu_docs.PAGE.read_text()
