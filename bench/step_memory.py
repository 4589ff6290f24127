"""Benchmark: what one training step holds on the CPU, phase by phase, beside ``marlow plan``.

    .venv/bin/python bench/step_memory.py [--routing sp] [--micro-tokens 6144] [--problems 4]
        [--new-tokens 128]

One step of a Voting run (the paper preset, as ``bench/gpu_check.py`` configures its runs) on
the GPU check's CPU stand-in (the Qwen3-0.6B's vocabulary on 2 layers of width 64, random
weights, saved once under ``MARLOW_CACHE``), in float32 on one thread, under
:class:`marlow.training.memory.LiveBytes`: the most bytes the tensors made during the step held
at once while the rollout ran, and while each part of the learn phase ran (the scoring of the
old and the base's log-probs, the update, the statistics, the adapter-sync probe); what was
alive when the learn phase began (what the rollout left) is in every learn part's figure. Beside
them ``marlow plan``'s activations for the step's largest micro-batch that built a graph, and its
adapter state less the adapters' weights (made before the step): what the learn phase should
hold. On a GPU the trainer's ``memory/*`` metrics measure the same with the allocator's blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

import gpu_check  # bench/ is the script's folder: on sys.path
from marlow.archs.stand_in import save_stand_in
from marlow.models import resolve_device
from marlow.plan import plan_run
from marlow.tiny.pretrain import default_cache_dir
from marlow.training import logprobs, trainer
from marlow.training.memory import LiveBytes

PARTS = (
    "score_old",
    "score_base",
    "update_adapter",
    "pre_update_stats",
    "kl_to_base_stats",
    "post_update_stats",
    "engine_drift",
)
"""The learn phase's parts, by the trainer's names for them (each counted while it runs)."""

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routing", choices=["sp", "ip"], default="sp")
    ap.add_argument("--micro-tokens", type=int, default=6144)
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    size = dataclasses.replace(
        gpu_check.DRY_SIZES[0],
        micro_tokens=args.micro_tokens,
        problems=args.problems,
        new_tokens=args.new_tokens,
    )
    folder = default_cache_dir() / "bench" / "step-memory-stand-in"
    if not (folder / "config.json").exists():
        save_stand_in(size.arch, folder, overrides=size.shrink, device=resolve_device("cpu"))
    cfg = gpu_check.run_config(size, args.routing, folder, "cpu")
    with tempfile.TemporaryDirectory() as out:
        run = trainer.Trainer(cfg, Path(out) / "run")
        counter = LiveBytes(run.model.state_dict().values())
        graphs: list[int] = []  # the tokens of each micro-batch scored with a graph
        phases = iter(["rollout", "learn"])
        start_phase = trainer.start_phase

        def phase(device):
            counter.phase = next(phases)
            return start_phase(device)

        def counted(name, fn):
            def call(*a, **k):
                before, counter.phase = counter.phase, name
                try:
                    return fn(*a, **k)
                finally:
                    counter.phase = before

            return call

        scored = logprobs.completion_logprobs

        def noted(model, ids, *a, **k):
            if torch.is_grad_enabled():
                graphs.append(ids.numel())
            return scored(model, ids, *a, **k)

        trainer.start_phase = phase
        logprobs.completion_logprobs = noted
        for name in PARTS:
            setattr(trainer, name, counted(name, getattr(trainer, name)))
        with counter:
            run.train_step(1)
    largest = max(graphs)
    grpo = cfg.grpo.model_copy(update={"micro_tokens": largest})
    plan = plan_run(cfg.model_copy(update={"grpo": grpo}), prompt_tokens=0)
    weights = sum(a.trainable for a in plan.adapters) * 4  # float32 LoRA weights
    print(
        f"one {args.routing.upper()} Voting step, micro-batches of {args.micro_tokens:,} tokens "
        f"(the largest with a graph {largest:,}): MiB made during the step and alive at once"
    )
    for name, peak in counter.peaks.items():
        print(f"  {name}: {peak / MIB:,.1f}")
    print(
        f"plan: activations {plan.activation_bytes / MIB:,.1f} MiB + adapter state "
        f"{(plan.adapter_bytes - weights) / MIB:,.1f} MiB "
        f"({'checkpointed' if plan.checkpointed else 'not checkpointed'})"
    )


if __name__ == "__main__":
    main()
