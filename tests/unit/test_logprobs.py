"""Micro-batching of turns for scoring: a partition by length, and results that do not depend on it."""

from __future__ import annotations

import random

import torch

from marlow.algo.turn_advantages import CreditRows
from marlow.config.schema import MICRO_TOKENS_OFF_CUDA
from marlow.models import padding_mask
from marlow.training.batch import Chunk, build_batches
from marlow.training.logprobs import micro_batches, score_rows
from marlow.types import Turn


def make_turn(prompt_len: int, completion_len: int, rng: random.Random) -> Turn:
    return Turn(
        role="generator",
        slot=0,
        round=0,
        adapter="p",
        prompt_text="",
        completion_text="",
        prompt_ids=[rng.randrange(4, 64) for _ in range(prompt_len)],
        completion_ids=[rng.randrange(4, 64) for _ in range(completion_len)],
        sampler_logprobs=[0.0] * completion_len,
        finish_reason="stop",
    )


def mixed_turns(seed: int = 0) -> list[Turn]:
    """Short voter-like turns interleaved with long aggregator-like ones, as under SP."""
    rng = random.Random(seed)
    turns = []
    for i in range(24):
        long = i % 4 == 3
        turns.append(
            make_turn(rng.randint(60, 80) if long else rng.randint(5, 9), rng.randint(3, 12), rng)
        )
    return turns


def test_micro_batches_partition_sorted_by_length_with_little_padding():
    turns = mixed_turns()
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in turns]
    chunks = micro_batches(lengths, micro_tokens=400)
    assert sorted(i for c in chunks for i in c) == list(range(len(turns)))
    for c in chunks:
        padded = max(lengths[i] for i in c) * len(c)
        assert padded <= 400 or len(c) == 1
        assert padded - sum(lengths[i] for i in c) <= 0.25 * padded
    # short and long turns never share a batch
    assert all(len({lengths[i] > 40 for i in c}) == 1 for c in chunks)


def test_a_single_turn_over_budget_gets_its_own_batch():
    chunks = micro_batches([8, 100, 9], micro_tokens=50)
    assert [1] in chunks and sorted(i for c in chunks for i in c) == [0, 1, 2]


def test_micro_batches_by_key_never_mix_keys_and_keep_each_key_consecutive():
    keys = ["a", "b", "a", "b", "a"]
    chunks = micro_batches([5, 50, 6, 51, 7], micro_tokens=10**6, keys=keys)
    assert chunks == [[0, 2, 4], [1, 3]]


def batch_of(turns):
    n = len(turns)
    rows = CreditRows(range(n), [0] * n, ["generator"] * n, [0] * n, [0] * n, [0.0] * n, [None] * n)
    return build_batches(turns, rows, torch.zeros(n, dtype=torch.float64), pad_id=0)["p"]


def test_scores_do_not_depend_on_the_partition(make_model):
    model = make_model(seed=3)
    turns = mixed_turns(seed=2)
    batch = batch_of(turns)

    def per_turn(micro_tokens: int) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(turns)
        with torch.no_grad():
            for rows, s in score_rows(
                model, batch, range(len(turns)), temperature=0.7, micro_tokens=micro_tokens
            ):
                for j, i in enumerate(rows):
                    assert int(s.mask[j].sum()) == len(turns[i].completion_ids)
                    out[i] = s.logp[j, : len(turns[i].completion_ids)]
        return out  # type: ignore[return-value]

    one_batch, many, alone = per_turn(10**6), per_turn(120), per_turn(1)
    for a, b, c in zip(one_batch, many, alone, strict=True):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=0)
        torch.testing.assert_close(b, c, atol=1e-5, rtol=0)
        assert bool((c < 0).all())  # real log-probs, not padding zeros


def test_an_auto_budget_no_card_sized_cuts_at_8192_tokens():
    lengths = [100] * 200  # 20,000 tokens
    assert micro_batches(lengths, "auto") == micro_batches(lengths, MICRO_TOKENS_OFF_CUDA)
    assert MICRO_TOKENS_OFF_CUDA == 8192 and [len(c) for c in micro_batches(lengths, "auto")] == [
        81,
        81,
        38,
    ]


def test_a_chunk_of_full_rows_scores_every_token_after_the_prompt():
    ids = torch.arange(12).view(2, 6)
    chunk = Chunk.full_rows(ids, 2)
    assert chunk.rows == [0, 1] and chunk.prompt_len.tolist() == [2, 2]
    assert chunk.attention.tolist() == [[1] * 6] * 2
    assert chunk.targets.tolist() == [[2, 3, 4, 5], [8, 9, 10, 11]]
    assert chunk.mask.dtype == torch.bool and chunk.mask.all() and chunk.mask.shape == (2, 4)


def test_only_a_mask_of_right_padding_is_left_to_the_causal_one():
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert padding_mask(right) is None
    assert padding_mask(torch.ones(3, 1, dtype=torch.long)) is None
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    hole = torch.tensor([[1, 0, 1, 0]])
    assert padding_mask(left) is left and padding_mask(hole) is hole


def test_padded_rows_learn_as_each_row_alone_and_the_model_sees_no_mask(make_model):
    """A right-padded micro-batch's log-probs and gradients are those of each row scored alone,
    and its decoder is called without a mask (the causal kernels)."""
    model = make_model(seed=5)
    turns = mixed_turns(seed=4)[:6]
    batch = batch_of(turns)
    lengths = [batch.seq_len[i] for i in range(len(turns))]
    chunks = [batch.chunk(c) for c in micro_batches(lengths, 10**6)]
    assert any(not bool(c.attention.all()) for c in chunks)  # some rows are padded
    masks: list = []
    model.model.register_forward_pre_hook(
        lambda _m, _a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True
    )

    def grads(rows, micro_tokens):
        model.zero_grad()
        total = 0.0
        for _, s in score_rows(
            model, batch, rows, temperature=0.7, micro_tokens=micro_tokens, share_prompts=False
        ):
            loss = s.logp.sum()
            loss.backward()
            total += loss.item()
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    together, g_together = grads(range(len(turns)), 10**6)
    assert len(masks) == len(chunks) and all(m is None for m in masks)
    assert model.model.embed_tokens.weight.grad is not None
    alone, g_alone = 0.0, None
    for i in range(len(turns)):
        value, g = grads([i], 10**6)
        alone += value
        g_alone = g if g_alone is None else {n: g_alone[n] + g[n] for n in g}
    assert abs(together - alone) < 1e-3
    for name, g in g_together.items():
        torch.testing.assert_close(g, g_alone[name], atol=2e-5, rtol=1e-4, msg=name)
