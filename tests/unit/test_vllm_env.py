"""The environment the vLLM engine's processes start with (no vLLM needed: the engine itself is
tested in tests/vllm, in the vLLM environment). The work folders are paths alone: nothing is
made there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from marlow.fileio import SOCKET_PATH_MAX
from marlow.rollout.vllm import CPU_STEP_TIMEOUT_S, _engine_env

WORK = Path("/dev/shm/marlow-vllm-a1b2c3d4")  # a work folder as the engine makes one
KEYS = (
    "VLLM_RPC_BASE_PATH",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)


def test_the_engines_sockets_go_into_its_work_folder_and_the_environment_is_restored():
    with _engine_env(WORK, None):
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(WORK)
        assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # a GPU's engine: no CPU settings
    assert not any(key in os.environ for key in KEYS)
    with _engine_env(WORK, 2):
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(WORK)
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
        assert os.environ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == str(CPU_STEP_TIMEOUT_S)
    assert not any(key in os.environ for key in KEYS)


def test_a_users_own_socket_folder_and_an_in_process_engine_keep_vllms_choice(monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/users/own")
    with _engine_env(WORK, None):
        assert os.environ["VLLM_RPC_BASE_PATH"] == "/users/own"
    assert os.environ["VLLM_RPC_BASE_PATH"] == "/users/own"
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM caches its environment
    with _engine_env(WORK, None):
        assert "VLLM_RPC_BASE_PATH" not in os.environ


def test_a_work_folder_too_long_for_a_socket_path_keeps_vllms_choice():
    fits = Path("/" + "d" * (SOCKET_PATH_MAX - 38))
    assert len(f"{fits}/{'0' * 36}") == SOCKET_PATH_MAX
    with _engine_env(fits, None):
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(fits)
    too_long = Path("/" + "d" * (SOCKET_PATH_MAX - 37))
    with _engine_env(too_long, None):
        assert "VLLM_RPC_BASE_PATH" not in os.environ
