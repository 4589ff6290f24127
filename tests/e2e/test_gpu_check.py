"""The GPU check on the CPU, so that it cannot rot while no GPU is at hand: its dry run
(``bench/gpu_check.py --device cpu --dry-run``: the environment, the device tests, a shrunken
Qwen3-0.6B stand-in trained for a step) writes every field the GPU run writes; a failing or
overrunning child is recorded, not fatal."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = bench_module("gpu_check")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    command = [sys.executable, "bench/gpu_check.py", "--out", str(out), "--device", "cpu"]
    proc = subprocess.run([*command, "--dry-run"], cwd=ROOT, capture_output=True, text=True)
    return proc, json.loads((out / "gpu_check.json").read_text()), out


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
