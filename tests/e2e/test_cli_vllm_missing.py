"""Without vLLM installed (the default environment), ``rollout.backend=vllm`` is refused in one line
that says how to install it, before a model loads or the run folder is written."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from marlow.cli import app

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here"
)


def test_backend_vllm_without_vllm_is_one_line(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "rollout.backend=vllm", "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "rollout.backend=vllm needs vLLM" in lines[0] and "make install-vllm" in lines[0]
    assert not out.exists()
