"""Rows that share a prompt are scored with it forwarded once: the same log-probs, entropies,
losses and gradients as one row a sequence, a layout checked by hand, and the cost rule."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from marlow import models
from marlow.algo.policy_loss import policy_loss_names
from marlow.policy.adapters import LoraSpec, attach_adapters
from marlow.shared_prompts import layout_cost, pack_shared_prompts, packable
from marlow.training.batch import Chunk
from tests.unit.scoring_checks import LossAndGrads, assert_same_scoring

QWEN3_06B = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def adapted(make_model, attention: str):
    """conftest's tiny random Qwen3 (two layers, grouped-query attention) with two LoRA adapters
    moved off zero."""
    model = attach_adapters(
        make_model(seed=0, vocab_size=96, attn_implementation=attention),
        ["voter", "judge"],
        LoraSpec(4, 8),
        seed=0,
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def chunk_of(rows: list[tuple[list[int], list[int]]]) -> Chunk:
    """A right-padded micro-batch of (prompt ids, completion ids) rows."""
    width = max(len(p) + len(c) for p, c in rows)
    longest = max(len(c) for _, c in rows)
    T = len(rows)
    ids = torch.zeros(T, width, dtype=torch.long)
    attention = torch.zeros(T, width, dtype=torch.long)
    targets = torch.zeros(T, longest, dtype=torch.long)
    mask = torch.zeros(T, longest, dtype=torch.bool)
    for r, (p, c) in enumerate(rows):
        ids[r, : len(p) + len(c)] = torch.tensor(p + c)
        attention[r, : len(p) + len(c)] = 1
        targets[r, : len(c)] = torch.tensor(c)
        mask[r, : len(c)] = True
    return Chunk(
        list(range(T)), ids, attention, torch.tensor([len(p) for p, _ in rows]), targets, mask
    )


def grouped_rows(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Three prompts of 6-11 tokens sampled 4, 3 and 1 times (completions of 1-9 tokens, one
    of a single token), interleaved as a length sort leaves them."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(3, 96, (n,), generator=gen).tolist()

    prompts = [draw(6), draw(11), draw(8)]
    plan = [(0, 5), (1, 9), (0, 1), (2, 4), (1, 3), (0, 7), (1, 6), (0, 2)]
    return [(prompts[p], draw(n)) for p, n in plan]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("loss_name", policy_loss_names())
def test_packed_scoring_equals_one_row_a_sequence(
    make_model, monkeypatch, attention, temperature, loss_name
):
    model = adapted(make_model, attention)
    chunk = chunk_of(grouped_rows())
    cfg = model.get_base_model().config
    packing = pack_shared_prompts(chunk.ids, chunk.prompt_len, chunk.mask, cfg, torch.float32)
    assert packing is not None and packing.ids.shape[0] == 3  # one sequence per prompt
    run = LossAndGrads(model, chunk, "judge", loss_name, temperature)
    ours = run()
    with monkeypatch.context() as mp:
        mp.setattr(models, "pack_shared_prompts", lambda *a: None)
        theirs = run()
    assert_same_scoring(ours, theirs, chunk.mask, logp_atol=1e-5)


def test_the_layout_of_two_rows_after_one_prompt():
    """Prompt [5, 6, 7], completions [8, 9, 10] and [11, 12] beside a row with prompt [5, 6]."""
    chunk = chunk_of([([5, 6, 7], [8, 9, 10]), ([5, 6], [20]), ([5, 6, 7], [11, 12])])
    cfg = Qwen3Config(**QWEN3_06B)
    cfg._attn_implementation = "sdpa"
    p = pack_shared_prompts(chunk.ids, chunk.prompt_len, chunk.mask, cfg, torch.float32)
    assert p is not None
    # the shared prompt, row 0's inputs 8, 9, row 2's input 11; the lone row's prompt alone
    assert p.ids.tolist() == [[5, 6, 7, 8, 9, 11], [5, 6, 0, 0, 0, 0]]
    assert p.positions.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 0, 0, 0, 0]]
    W = 6
    # row 0: 8 from the prompt's last state (2), 9 from 8 (3), 10 from 9 (4); row 1: 20 from 6;
    # row 2: 11 from the prompt's last state, 12 from 11 (5)
    assert p.index.tolist() == [[2, 3, 4], [W + 1, 0, 0], [2, 5, 0]]
    allowed = p.mask[0, 0].int().tolist()
    assert allowed[4] == [1, 1, 1, 1, 1, 0]  # 9 sees the prompt, 8 and itself
    assert allowed[5] == [1, 1, 1, 0, 0, 1]  # 11 sees the prompt and itself, not row 0
    assert p.mask.dtype == torch.bool


def test_no_shared_prompt_or_long_completions_stay_plain():
    cfg = Qwen3Config(**QWEN3_06B)
    cfg._attn_implementation = "sdpa"
    prompt = list(range(3, 203))

    def packs(rows) -> bool:
        c = chunk_of(rows)
        return pack_shared_prompts(c.ids, c.prompt_len, c.mask, cfg, torch.float32) is not None

    assert not packs([([3, 4], [5, 6]), ([3, 5], [5, 6])])  # no two rows share a prompt
    assert not packs([([], [7] * 4) for _ in range(8)])  # no prompt: no state predicts token 0
    assert packs([(prompt, [7] * 128) for _ in range(8)])
    assert not packs([(prompt, [7] * 512) for _ in range(8)])
    # the figures the module's docstring quotes, at Qwen3-0.6B's widths
    short = layout_cost(cfg, 1, 200 + 8 * 127) / layout_cost(cfg, 8, 328)
    long = layout_cost(cfg, 1, 200 + 8 * 511) / layout_cost(cfg, 8, 712)
    assert round(short, 2) == 0.56 and round(long, 2) == 1.34


def test_models_that_cannot_take_the_block_mask_are_not_packed():
    cfg = Qwen3Config(**QWEN3_06B)
    cfg._attn_implementation = "sdpa"
    assert packable(cfg)
    for attention in ("flash_attention_2", "flex_attention"):
        other = Qwen3Config(**QWEN3_06B)
        other._attn_implementation = attention
        assert not packable(other)
    windowed = Qwen3Config(**QWEN3_06B, use_sliding_window=True, sliding_window=64)
    windowed._attn_implementation = "sdpa"
    assert not packable(windowed)


def test_the_tiny_worlds_scoring_packs(make_model):
    """The tiny world's model takes the packed forward (its config is packable)."""
    model = make_model(seed=0)
    assert packable(model.config)
