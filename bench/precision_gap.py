"""Benchmark: how far one learn step in bfloat16 lands from the same step in float32.

    .venv/bin/python bench/precision_gap.py [--out bench/results/precision_gap.json]

The test configuration of ``tests/integration/test_precision.py`` (the tiny preset shrunk to
seconds, on a briefly pre-trained tiny-s world in a temporary cache, on the CPU) for Voting-IP,
Eval-Opt-SP and Orch-Workers-IP: one float32 and one bfloat16 trainer, the float32 one's
rollout of 3 problems x 4 samples at temperature 0.7 (seed 5) with rewards alternating 0 and 1,
then one learn step of each on those same episodes. For each metric the step logs, the largest
difference over the three workflows, relative (|b - f| / |f|) and absolute, and for each
adapter the relative size of the difference of the two LoRA updates (|d16 - d32| / |d32|). The
test's tolerances are set from these figures.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = (("voting", "ip"), ("eval_opt", "sp"), ("orch_workers", "ip"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "precision_gap.json")
    args = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="marlow-precision-"))
    os.environ["MARLOW_CACHE"] = str(cache)
    sys.path.insert(0, str(ROOT))
    from tests.conftest import PRETRAIN_STEPS, shrunk_config

    from marlow.fileio import write_json
    from marlow.policy.adapters import adapter_parameters
    from marlow.tiny.pretrain import pretrain_tiny
    from marlow.training.trainer import Trainer

    pretrain_tiny("tiny-s", steps=PRETRAIN_STEPS, cache_dir=cache)
    relative: dict[str, float] = {}
    absolute: dict[str, float] = {}
    lora_update = 0.0

    def learn(trainer, episodes) -> tuple[dict, dict]:
        lora = {a: list(adapter_parameters(trainer.model, a).values()) for a in trainer.adapters}
        before = {a: [p.detach().clone() for p in ps] for a, ps in lora.items()}
        record = trainer.learn(1, episodes)
        delta = {
            a: [p.detach() - b for p, b in zip(ps, before[a], strict=True)]
            for a, ps in lora.items()
        }
        return record, delta

    for workflow, routing in WORKFLOWS:
        cfg = shrunk_config(
            device="cpu",
            diagnostics={"every": 1},
            workflow={"name": workflow},
            policy={"routing": routing},
        )
        out = Path(tempfile.mkdtemp(prefix="marlow-precision-run-"))
        f32 = Trainer(cfg, out / "f32")
        b16 = Trainer(cfg.model_copy(update={"dtype": "bfloat16"}), out / "b16")
        episodes = f32.rollout(f32.task.train_batch(0, 1, 3), 4, 0.7, seed=5)
        for ep in episodes:
            ep.reward = float(ep.sample % 2)
        want, d32 = learn(f32, episodes)
        got, d16 = learn(b16, episodes)
        for key, w in want.items():
            if key.startswith("time/"):
                continue
            metric, gap = key.rsplit("/", 1)[-1], abs(got[key] - w)
            absolute[metric] = max(absolute.get(metric, 0.0), gap)
            if w:
                relative[metric] = max(relative.get(metric, 0.0), gap / abs(w))
        for adapter, ref in d32.items():
            pairs = zip(d16[adapter], ref, strict=True)
            err = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in pairs))
            size = math.sqrt(sum(float(b.pow(2).sum()) for b in ref))
            lora_update = max(lora_update, err / size)
        print(f"{workflow}-{routing}: done", flush=True)
    result = {
        "workflows": [f"{w}-{r}" for w, r in WORKFLOWS],
        "relative": dict(sorted(relative.items())),
        "absolute": dict(sorted(absolute.items())),
        "lora_update_relative": lora_update,
    }
    write_json(args.out, result)
    for metric in sorted(absolute):
        rel = relative.get(metric)
        print(f"{metric}: abs {absolute[metric]:.2e}" + (f", rel {rel:.2e}" if rel else ""))
    print(f"LoRA update |d16 - d32| / |d32|: {lora_update:.3f} -> {args.out}")


if __name__ == "__main__":
    main()
