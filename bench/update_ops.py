"""The update's operations on one micro-batch, counted on the CPU where a GPU's kernels are what
bounds it: the Python-bound stand-in of the 0.6B (``bench/lean_lora.py``'s: 28 layers at width
64, bfloat16, its RMSNorms fused as a loaded base's are: ``marlow.models.fuse_norms``) with one
LoRA adapter on every linear, of rank 4 (a sixteenth of the width, as 64 is of the 0.6B's
1,024, so that its low-rank outputs are not counted over every token), in training mode, its
decoder layers checkpointed as a run's are by default (``grpo.activation_checkpointing``) and
not, each with the rotary embedding a loaded base computes (``marlow.models.fuse_rotary``) and
with transformers' own.

    .venv/bin/python bench/update_ops.py [--rows 4] [--row-tokens 128] [--repeats 5]

One pass is what the trainer's update makes of a micro-batch (its LoRA factors cast once for
the forward and the recompute: ``marlow.policy.adapters.held_factors``): ``score_chunk`` over
``rows`` x ``row-tokens`` random ids (the last 3/4 of each row its completion; no entropies, as an update
whose logp_old was scored before it), the loss
``-(logp x mask).sum() / mask.sum()`` and its ``backward()``, after an untimed one. Printed for
each: the ATen operations it runs (views left out), the matrix products among them, and the
operations whose output holds at least tokens x width elements ("over every token": on a GPU at
thousands of tokens, each such elementwise operation is a pass over the micro-batch's
activations through the card's memory), by name and dtype. These counts, not the CPU's seconds,
say what a GPU's update is bound by: its elementwise passes and small kernels, or its matrix
products. Then the median milliseconds of ``repeats`` timed passes (one thread). Last, the
host's work a pass, where the arithmetic is least (one row of 16 tokens): not checkpointed, and
checkpointed through marlow's recomputation (``marlow.models.checkpoint_layers``) and through
``torch.utils.checkpoint``, timed in turn.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from contextlib import nullcontext

import torch

from lean_lora import GEMMS, operations, proxy  # bench/ is the script's folder: on sys.path
from marlow.models import (
    checkpoint_layers,
    fuse_norms,
    fuse_rotary,
    torch_checkpoint,
    transformers_rotary,
)
from marlow.policy.adapters import LoraSpec, attach_adapters, held_factors, use_adapter
from marlow.tiny.tokenizer import build_tokenizer
from marlow.training.batch import Chunk
from marlow.training.logprobs import score_chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--row-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="timed passes of each; the median")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = build_tokenizer()
    base = proxy(len(tok)).to(torch.bfloat16)
    fuse_norms(base)  # as a run's loaded base computes them, and its rotary embedding
    fuse_rotary()
    model = attach_adapters(base, ["policy"], LoraSpec(rank=4), seed=0)
    model.train()
    rows, width = args.rows, args.row_tokens
    prompt = width // 4
    ids = torch.randint(0, len(tok), (rows, width), generator=torch.Generator().manual_seed(0))
    chunk = Chunk.full_rows(ids, prompt)

    def one_pass() -> None:
        with held_factors():  # as the trainer's mini-batch: the LoRA factors cast once
            scored = score_chunk(model, chunk, temperature=1.0, entropy=False)
            (-(scored.logp * scored.mask).sum() / scored.mask.sum()).backward()

    layers = model.config.num_hidden_layers
    every = ids.numel() * model.config.hidden_size
    print(f"one micro-batch of {rows} x {width} tokens, {layers} layers")
    for checkpointed, own in itertools.product((True, False), (False, True)):
        checkpoint_layers(model, on=checkpointed)
        with use_adapter(model, "policy"), transformers_rotary() if own else nullcontext():
            one_pass()
            names, large = operations(one_pass, every)
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                one_pass()
                seconds.append(time.perf_counter() - start)
        total, products = sum(names.values()), sum(names[n] for n in GEMMS)
        over = sum(large.values())
        elementwise = over - sum(n for (name, _), n in large.items() if name in GEMMS)
        rotary = "transformers'" if own else "marlow's"
        print(
            f"{'checkpointed' if checkpointed else 'not checkpointed'}, "
            f"{rotary} rotary embedding: {total:,} operations "
            f"({total / layers:.0f} a layer), {products:,} matrix products; over every token: "
            f"{over:,} ({over / layers:.0f} a layer), {elementwise:,} of them not matrix "
            f"products ({elementwise / layers:.0f} a layer); "
            f"{statistics.median(seconds) * 1000:.0f} ms a pass"
        )
        print(
            "  over every token, the most:",
            ", ".join(f"{n}x {k[0]} {k[1]}" for k, n in large.most_common(8)),
        )
    host(model, tok, args.repeats)


def host(model, tok, repeats: int) -> None:
    """The host's work a pass: the median milliseconds of a pass over one row of 16 tokens,
    where the arithmetic is least, not checkpointed, checkpointed through marlow's own
    recomputation and through ``torch.utils.checkpoint``, timed in turn ``4 x repeats`` times."""
    ids = torch.randint(0, len(tok), (1, 16), generator=torch.Generator().manual_seed(1))
    chunk = Chunk.full_rows(ids, 4)

    def one_pass() -> None:
        with held_factors():
            scored = score_chunk(model, chunk, temperature=1.0, entropy=False)
            (-(scored.logp * scored.mask).sum() / scored.mask.sum()).backward()

    ways = {
        "not checkpointed": (False, nullcontext),
        "checkpointed through marlow's recomputation": (True, nullcontext),
        "checkpointed through torch.utils.checkpoint": (True, torch_checkpoint),
    }
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    with use_adapter(model, "policy"):
        for _ in range(4 * repeats):
            for way, (checkpointed, context) in ways.items():
                checkpoint_layers(model, on=checkpointed)
                with context():
                    one_pass()  # untimed: the switch's first pass
                    start = time.perf_counter()
                    one_pass()
                    seconds[way].append(time.perf_counter() - start)
    print(
        "the host's work, one row of 16 tokens: "
        + ", ".join(f"{way} {statistics.median(s) * 1000:.0f} ms" for way, s in seconds.items())
    )


if __name__ == "__main__":
    main()
