"""Cost of the real-scale smoke: two Voting-IP steps on the CPU with the Qwen3-0.6B architecture
(random bfloat16 weights, a local tokenizer in the Qwen3 chat format: ``marlow.archs.stand_in``),
settings in ``configs/qwen3-0.6b-smoke.yaml`` (2 problems x group 2, 16 new tokens, LoRA rank 64
on every linear, paper preset otherwise).

The stand-in is written to a temporary folder by this process; the run is ``marlow train`` in a
child process, so its peak RSS (``getrusage(RUSAGE_CHILDREN).ru_maxrss``: the largest of the
child and its own children) is the run's alone. Seconds per step are the trainer's own
``time/rollout_s + time/learn_s`` of each step (validation and checkpoints apart).

    .venv/bin/python bench/qwen3_smoke.py [key=value ...]

Measured once (2 cores shared with other jobs, load average ~3.7; AMD EPYC with avx512_bf16,
torch 2.13.0+cpu, transformers 5.23, peft 0.21.2):

    step 1: 509.8 s (rollout 224.2 s, learn 285.6 s, 1.1 sampled tokens/s)
    step 2: 230.0 s (rollout 184.5 s, learn 45.4 s, 1.4 sampled tokens/s)
    mean 369.9 s/step over 2 steps
    peak RSS of the run: 13,418 MiB
    stand-in written in 19.7 s; the whole run (load, 2 validations 204.0 s, checkpoint) 970.1 s

Step 1 also runs the sampled diagnostics (chi2_update and kl_to_base: steps 1, 1 + every, ...)
and every first-call cost; step 2 is the plain step. For comparison, ``marlow plan
configs/qwen3-0.6b-smoke.yaml model.name=qwen3-0.6b --prompt-tokens 400`` puts weights,
adapters and the activations of its 2,048-token forward at 11.75 GiB (the 11.38 GiB KV cache it
adds assumes a full rollout.max_batch of 256 sequences; this run samples 12 at a time).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from marlow.archs.stand_in import save_stand_in

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen3-0.6b-smoke.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="key=value settings over the smoke's config")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = save_stand_in("qwen3-0.6b", Path(tmp) / "qwen3-0.6b-random")
        t_build = time.perf_counter() - t0
        out = Path(tmp) / "run"
        command = [
            *(sys.executable, "-m", "marlow.cli", "train", str(CONFIG)),
            *(f"model.name={folder}", *args.overrides, "--out", str(out)),
        ]
        t0 = time.perf_counter()
        subprocess.run(command, check=True)
        t_run = time.perf_counter() - t0
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    per_step = [r["time/rollout_s"] + r["time/learn_s"] for r in steps]
    for r, s in zip(steps, per_step, strict=True):
        print(
            f"step {r['step']}: {s:.1f} s (rollout {r['time/rollout_s']:.1f} s, learn "
            f"{r['time/learn_s']:.1f} s, {r['time/rollout_tokens_per_s']:.1f} sampled tokens/s)"
        )
    val = [r["time/val_s"] for r in records if "time/val_s" in r]
    print(f"mean {sum(per_step) / len(per_step):.1f} s/step over {len(per_step)} steps")
    print(f"peak RSS of the run: {peak_mib:,.0f} MiB")
    print(
        f"stand-in written in {t_build:.1f} s; the whole run (load, {len(val)} validations "
        f"{sum(val):.1f} s, checkpoint) {t_run:.1f} s"
    )


if __name__ == "__main__":
    main()
