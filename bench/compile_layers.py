"""Benchmark: an update pass with the decoder layers compiled (``grpo.compile``,
:func:`marlow.models.compile_layers`) and eager, side by side; or (``--steps``) whole training
steps of ``bench/vs_trl.py``'s marlow run with each.

    .venv/bin/python bench/compile_layers.py [--proxy] [--layers 4] [--rows 2]
        [--row-tokens 512] [--repeats 5] [--vocab 4096] [--device cpu]
        [--out bench/results/compile_layers.json]
    .venv/bin/python bench/compile_layers.py --steps 8 [--max-new 12]
        [--out bench/results/compile_layers_steps.json]

The model: a Qwen3 of Qwen3-0.6B's widths (hidden 1,024, MLP 3,072, 16 query and 8 key-value
heads of 128) with ``--layers`` layers, or with ``--proxy`` the Python-bound stand-in of
``bench/lean_lora.py`` (the 0.6B's 28 layers at width 64: the arithmetic is negligible, so what
is timed is the per-operation cost, as where a GPU's update is bound by its kernels); a
4,096-id vocabulary (the head is not what is measured) or ``--vocab``'s (151,936, the 0.6B's:
the head's chunks are then most of a pass, and compiled with the layers), random weights in
bfloat16, one LoRA
adapter of rank 64 (alpha 32) on every linear layer, in training mode, the layers checkpointed
as a run's update of a Hugging Face model has them. One pass is what the trainer's update makes
of a micro-batch (:func:`marlow.models.completion_logprobs` over ``rows`` x ``row-tokens``
random ids, the last 3/4 of each row its completion, and the backward of the summed log-probs).
The compiled layers' first pass (their compilation) is timed apart and its compilations
counted (torch's count of the graphs compiled; and that count after every pass); then each is
timed ``repeats`` times after an untimed one, alternating round by round (so that a machine's
drift falls on both), and the median of each is reported with their ratio.

``--steps N``: ``bench/vs_trl.py``'s single-agent marlow run (the tiny-s math world, float32,
32 problems x 8 samples, ``--max-new`` new tokens, 2 threads; its :func:`marlow_config`) trained
for 1 + N steps three times, one after another: the CPU's default (eager layers, LoRA folded:
``grpo.fold_lora`` auto), eager unfolded, and compiled (``grpo.compile=on``, which leaves the
LoRA unfolded). Each reports every step's seconds and its update's (``time/update_s``), and the
medians of the steps after the first; the steps that compiled are the first and any that met a
new shape (a one-row micro-batch).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from lora_dtype import adapted_stand_in, update_pass
from marlow.fileio import write_json
from marlow.models import checkpoint_layers, compile_layers
from marlow.policy.adapters import use_adapter

LAYERS = ("eager", "compiled")
PROXY = {
    "num_hidden_layers": 28,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proxy", action="store_true", help="28 layers of width 64 (Python-bound)")
    ap.add_argument("--layers", type=int, default=4, help="layers at the 0.6B's widths")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--row-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=4096, help="151936: the 0.6B's (its head)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=0, help="train steps of vs_trl's run instead")
    ap.add_argument("--max-new", type=int, default=12, help="new tokens a turn (--steps)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.steps:
        return steps(args)
    args.out = args.out or Path("bench/results/compile_layers.json")
    device = torch.device(args.device)
    shape = PROXY if args.proxy else {"num_hidden_layers": args.layers}
    model = adapted_stand_in({**shape, "vocab_size": args.vocab}, device)
    checkpoint_layers(model)
    one_pass = update_pass(model, args.rows, args.row_tokens)

    def one(layers: str) -> float:
        compile_layers(model, on=layers == "compiled")
        return one_pass()

    seconds: dict[str, list[float]] = {a: [] for a in LAYERS}
    graphs = counters["stats"]
    with use_adapter(model, "policy"):
        one("eager")  # untimed
        first = one("compiled")  # the compilation
        first_graphs = graphs["unique_graphs"]
        for _ in range(args.repeats):
            for a in LAYERS:
                seconds[a].append(one(a))
    median = {a: statistics.median(s) for a, s in seconds.items()}
    result = {
        "settings": {**vars(args), "out": str(args.out), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "first_compiled_s": first,
        "compilations": {"first_pass": first_graphs, "in_all": graphs["unique_graphs"]},
        "seconds": seconds,
        "median_s": median,
        "tokens_per_s": {a: args.rows * args.row_tokens / m for a, m in median.items()},
        "eager_over_compiled": median["eager"] / median["compiled"],
    }
    write_json(args.out, result)
    print(
        f"compiled layers: first pass {first:.1f} s, {first_graphs} compilations; "
        f"{graphs['unique_graphs']} in all"
    )
    for a in LAYERS:
        print(f"{a} layers: {median[a]:.3f} s a pass (median of {args.repeats})")
    print(f"eager / compiled: {result['eager_over_compiled']:.2f}x -> {args.out}")


SETTINGS = {
    "eager, folded (the CPU's default)": {"compile": "off", "fold_lora": "auto"},
    "eager, unfolded": {"compile": "off", "fold_lora": "off"},
    "compiled": {"compile": "on", "fold_lora": "auto"},
}


def steps(args: argparse.Namespace) -> None:
    """``--steps``: the training steps of each setting (module docstring)."""
    import tempfile

    from marlow.training.trainer import Trainer
    from vs_trl import marlow_config

    out = args.out or Path("bench/results/compile_layers_steps.json")
    run = argparse.Namespace(routing="sp", micro_tokens=4096, max_new=args.max_new, threads=2)
    run.seed, run.compile = 0, "auto"  # vs_trl's defaults; each setting's own below
    result: dict = {"settings": {"steps": args.steps, "max_new": args.max_new}, "runs": {}}
    for label, grpo in SETTINGS.items():
        cfg = marlow_config(run)
        cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update=grpo)})
        with tempfile.TemporaryDirectory() as tmp, Trainer(cfg, Path(tmp) / "run") as trainer:
            rows = []
            for step in range(args.steps + 1):
                t0 = time.perf_counter()
                record = trainer.train_step(step)
                rows.append(
                    {"step_s": time.perf_counter() - t0, "update_s": record["time/update_s"]}
                )
        later = rows[1:]
        result["runs"][label] = {
            "steps": rows,
            "median_step_s": statistics.median(r["step_s"] for r in later),
            "median_update_s": statistics.median(r["update_s"] for r in later),
        }
        r = result["runs"][label]
        print(
            f"{label}: first step {rows[0]['step_s']:.1f} s, then {r['median_step_s']:.3f} s a "
            f"step (median), update {r['median_update_s']:.3f} s; slowest later step "
            f"{max(x['step_s'] for x in later):.1f} s"
        )
    result["torch"] = torch.__version__
    write_json(out, result)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
