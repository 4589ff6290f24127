"""The shipped worlds are what marlow's code makes: each rebuilt here from its recipe reaches the
shipped one's greedy accuracy within ``verify_world.TOLERANCE`` (``marlow pretrain-tiny --verify``).

CI checks the quick world (the quickstart's, 8 x 4,800 steps) with ``make verify-worlds``, the
CLI's check run on its own beside the suite (2-3 minutes on a quiet 2-core machine, which the
default suite does not pay). The slow tests check every shipped world through the CLI, and the
quick world again with torch's kernels held to AVX2 (``marlow.tiny.pretrain.AVX2_ONLY``: how a
CPU without AVX-512 runs), the other kernel set the tolerance was measured on.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from marlow.tiny import shipped
from marlow.tiny.pretrain import AVX2_ONLY

MARLOW = [sys.executable, "-m", "marlow.cli"]


def verify_cli(world: shipped.ShippedWorld, tmp_path, env: dict[str, str] | None = None):
    args = ["pretrain-tiny", "--verify", "--scale", world.scale, "--task", world.task]
    args += ["--steps", str(world.steps), "--batch", str(world.batch)]
    env = {**os.environ, "MARLOW_CACHE": str(tmp_path / "cache"), **(env or {})}
    return subprocess.run([*MARLOW, *args], capture_output=True, text=True, env=env, timeout=3600)


@pytest.mark.slow
@pytest.mark.parametrize("folder", [w.folder for w in shipped.shipped_worlds()])
def test_every_shipped_world_rebuilds_within_the_tolerance(folder, tmp_path):
    world = next(w for w in shipped.shipped_worlds() if w.folder == folder)
    done = verify_cli(world, tmp_path)
    assert done.returncode == 0 and "PASSED" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "cache").exists()  # the rebuild never lands in the user's cache


@pytest.mark.slow
def test_the_quick_world_rebuilt_on_avx2_kernels_is_within_the_tolerance(tmp_path):
    world = shipped.find_shipped("tiny-s", steps=4800, batch=8)
    done = verify_cli(world, tmp_path, AVX2_ONLY)
    assert done.returncode == 0 and "PASSED" in done.stderr, done.stderr[-3000:]
    assert "AVX2" in done.stderr


def test_verify_names_the_shipped_recipes_when_there_is_none(tmp_path):
    world = shipped.ShippedWorld("x", "tiny-l", "math", 2000, 64, 0, 2, {}, 0.0, 0, "")
    done = verify_cli(world, tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "ships no tiny-l math world" in done.stderr and "tiny-s code" in done.stderr
