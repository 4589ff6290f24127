"""How far the vLLM engine's log-probs drift from the trainer's on the same weights: the figure the
adapter-sync check's tolerances (``marlow.training.sync.TOLERANCE``) are set from.

For each dtype, a model with two adapters of random LoRA weights is served by a vLLM engine;
completions of ``--tokens`` tokens are sampled from it (temperature 1) for ``--turns`` prompts
spread over the base and the adapters, and each turn is scored teacher-forced at temperature 1 by
both vLLM and the trainer's forward (``HFEngine.score``: transformers + PEFT, the LoRA weights in
float32 on any base dtype, as the trainer holds them). A turn's drift is the mean |difference|
over its tokens, the quantity ``marlow.training.sync.engine_drift`` compares with the tolerance.

    .venv-vllm/bin/python bench/sync_drift.py                      # tiny-s world, both dtypes
    .venv-vllm/bin/python bench/sync_drift.py --model qwen3-0.6b --turns 6 --dtypes bfloat16

``--model tiny-s`` pre-trains the tiny-s world briefly (``--pretrain-steps``, into a temporary
cache) so that its logits are peaked like a trained model's; a folder (a shipped world) is loaded
as it is; ``qwen3-0.6b`` is the architecture with random weights (``marlow.archs.stand_in``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from marlow.config import VLLMConfig
from marlow.policy.adapters import LoraSpec, adapter_parameters, attach_adapters
from marlow.rollout.hf import HFEngine
from marlow.rollout.vllm import VLLMEngine
from marlow.types import BASE, GenRequest, SamplingParams

ADAPTERS = ["generator", "aggregator"]


def load(model: str, folder: Path, dtype: str, pretrain_steps: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if Path(model).is_dir():
        source = Path(model)
    elif model == "tiny-s":
        from marlow.tiny.pretrain import pretrain_tiny

        source = pretrain_tiny("tiny-s", steps=pretrain_steps, cache_dir=folder)
    else:
        from marlow.archs.stand_in import save_stand_in

        source = folder / model
        if not source.exists():
            save_stand_in(model, source)
    tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
    base = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype)).eval()
    for p in base.parameters():
        p.requires_grad_(False)
    peft = attach_adapters(base, ADAPTERS, LoraSpec(16, 32, 0.0, "all-linear"), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an update's worth of change, in the adapters' float32
        for name in ADAPTERS:
            for p in adapter_parameters(peft, name).values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return peft, tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-s", help="tiny-s, qwen3-0.6b or a model folder")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--turns", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--pretrain-steps", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            model, tokenizer = load(args.model, Path(tmp), dtype, args.pretrain_steps)
            settings = VLLMConfig(kv_cache_gib=0.5, max_model_len=512)
            vllm = VLLMEngine(model, tokenizer, settings=settings, dtype=dtype)
            hf = HFEngine(model, tokenizer)
            try:
                g = torch.Generator().manual_seed(0)
                vocab = min(tokenizer.vocab_size, 90)
                requests = [
                    GenRequest(
                        torch.randint(4, vocab, (24,), generator=g).tolist(),
                        [BASE, *ADAPTERS][i % 3],
                        seed=i,
                    )
                    for i in range(args.turns)
                ]
                sampled = vllm.generate(requests, SamplingParams(1.0, args.tokens, 0))
                plain = [GenRequest(r.prompt_ids, r.adapter) for r in requests]
                completions = [c.token_ids for c in sampled]
                ours = vllm.score(plain, completions, 1.0)
                theirs = hf.score(plain, completions, 1.0)
            finally:
                vllm.close()
            drift = [
                sum(abs(a - b) for a, b in zip(o, t, strict=True)) / len(o)
                for o, t in zip(ours, theirs, strict=True)
                if o
            ]
            token_max = max(
                abs(a - b)
                for o, t in zip(ours, theirs, strict=True)
                for a, b in zip(o, t, strict=True)
            )
            by = {
                a: [d for d, r in zip(drift, plain, strict=True) if r.adapter == a]
                for a in [BASE, *ADAPTERS]
            }
            print(
                f"{args.model} {dtype}: drift per turn over {len(drift)} turns: mean "
                f"{statistics.mean(drift):.3g}, median {statistics.median(drift):.3g}, max "
                f"{max(drift):.3g}; largest single token {token_max:.3g}; max per adapter "
                + ", ".join(f"{a} {max(v):.3g}" for a, v in by.items() if v),
                flush=True,
            )


if __name__ == "__main__":
    main()
