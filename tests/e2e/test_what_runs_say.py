"""What a run says while it works: before pre-training an uncached
tiny world, what happens, an estimate of how long, and that ``preset=quickstart`` has a world of
its own; and a warning naming the role and ``rollout.max_new_tokens`` when most turns are cut."""

from __future__ import annotations

import os
import subprocess
import sys


def test_an_uncached_world_and_cut_turns_are_said_in_one_line_each(tmp_path):
    env = {**os.environ, "MARLOW_CACHE": str(tmp_path / "empty-cache"), "OMP_NUM_THREADS": "1"}
    settings = [
        "steps=1",
        "threads=1",
        "workflow=voting",  # the shorthand for workflow.name (item 4)
        "model.pretrain_steps=2",  # a world of 2 steps: pre-trained in seconds, answers nothing
        "task.val_size=2",
        "rollout.max_new_tokens=3",  # every turn is cut
        "grpo.batch_problems=2",
        "grpo.group_size=2",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "marlow", "train", *settings, "--out", "run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = " ".join(done.stderr.split())
    assert "the tiny world tiny-s (math) is not cached: pre-training it first (2 steps" in said
    assert "about a minute or less on 2 CPU cores (an estimate), once" in said
    assert "preset=quickstart uses the world marlow ships (no pre-training)" in said
    for role in ("generator", "aggregator"):
        warned = [line for line in done.stderr.splitlines() if f"of the {role} turns" in line]
        assert len(warned) == 2, done.stderr[-3000:]  # once in training, once in validation
        assert "rollout.max_new_tokens=3" in warned[0] and "WARNING step 0" in warned[0]
    assert (tmp_path / "run" / "config.yaml").read_text().count("name: voting") == 1
