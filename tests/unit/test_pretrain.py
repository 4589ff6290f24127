"""Tiny-world pre-training: micro-batched loss, one precision recipe, threads, killed runs."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import marlow.tiny.pretrain as pretrain
from marlow.tiny.corpus import CorpusConfig
from marlow.tiny.model import build_model
from marlow.tiny.tokenizer import build_tokenizer
from tests.conftest import PRETRAIN_STEPS


def _first_batch(tok, seed: int = 0):
    return next(pretrain.batches(tok, CorpusConfig(), seed))


def test_micro_batches_cover_every_row_once_within_budget():
    tok = build_tokenizer()
    batch = _first_batch(tok)
    pad = tok.pad_token_id
    budget = 600
    seen = []
    for ids, labels in pretrain.micro_batches(batch.rows, pad, budget):
        b, width = ids.shape
        assert b * width <= budget or b == 1
        assert labels.shape == ids.shape
        for row_ids, row_labels in zip(ids.tolist(), labels.tolist(), strict=True):
            real = [t for t in row_ids if t != pad]
            n_label = sum(t != -100 for t in row_labels)
            seen.append((real, n_label))
    want = [(p + c, len(c)) for p, c in batch.rows]
    assert seen == want  # same rows, same order, labels exactly on the completion tokens


def test_micro_batched_loss_and_gradients_equal_the_whole_batch():
    """The summed micro-batch loss is the mean CE over the batch's completion tokens, as one
    forward of the whole right-padded batch computes it (transformers' own loss)."""
    tok = build_tokenizer()
    pad = tok.pad_token_id
    # A batch wide enough for the default budget to split it.
    batch = next(
        b
        for b in pretrain.batches(tok, CorpusConfig(), 0)
        if len(b.rows) * max(len(p) + len(c) for p, c in b.rows) > 2 * pretrain.MICRO_TOKENS
    )
    model = build_model("tiny-s", len(tok), seed=1).train()
    loss = pretrain.batch_loss(model, batch, pad)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    (ids, labels), *rest = pretrain.micro_batches(batch.rows, pad, budget=10**9)
    assert not rest  # one micro-batch: the whole batch
    whole = model(input_ids=ids, labels=labels).loss
    whole.backward()
    assert abs(loss - whole.item()) <= 1e-5
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)
    assert len(list(pretrain.micro_batches(batch.rows, pad))) > 1  # the default budget splits


def test_one_recipe_no_autocast_and_the_key_does_not_depend_on_the_cpu(monkeypatch):
    """No bf16 autocast in the loop on any CPU: every forward of a pre-training step runs in
    float32 (an autocast left on would show as bf16 activations)."""
    tok = build_tokenizer()
    model = build_model("tiny-s", len(tok))
    dtypes = set()
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda _m, _i, out: dtypes.add(out.dtype)
    )
    pretrain.train(model, tok, CorpusConfig(), steps=1, lr=1e-3, seed=0, log=lambda _m: None)
    hook.remove()
    assert dtypes == {torch.float32}
    key = pretrain.cache_key("tiny-s", 10, 0, CorpusConfig())
    code = "from marlow.tiny.pretrain import cache_key; from marlow.tiny.corpus import "
    code += "CorpusConfig; print(cache_key('tiny-s', 10, 0, CorpusConfig()))"
    env = {**os.environ, **pretrain.AVX2_ONLY}
    other = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert other.stdout.strip() == key


def test_the_batch_size_is_part_of_the_recipe_and_of_the_key(tmp_path):
    """``batch`` sets the examples per step; the default keeps the 64-example worlds' key."""
    tok = build_tokenizer()
    sizes = {len(b.rows) for b in itertools.islice(pretrain.batches(tok, CorpusConfig(), 0, 8), 40)}
    assert sizes == {8}
    default = pretrain.tiny_path("tiny-s", cache_dir=tmp_path, steps=2)
    assert pretrain.tiny_path("tiny-s", cache_dir=tmp_path, steps=2, batch=64) == default
    small = pretrain.pretrain_tiny("tiny-s", steps=2, batch=8, cache_dir=tmp_path, threads=1)
    assert small != default and small == pretrain.tiny_path(
        "tiny-s", cache_dir=tmp_path, steps=2, batch=8, threads=1
    )
    meta = json.loads((small / "meta.json").read_text())
    assert (meta["batch_examples"], meta["steps"]) == (8, 2)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        pretrain.tiny_path("tiny-s", batch=0)


def test_threads_are_honoured_and_restored(tmp_path, monkeypatch):
    seen = []
    real_train = pretrain.train

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_train(*args, **kwargs)

    monkeypatch.setattr(pretrain, "train", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        path = pretrain.pretrain_tiny("tiny-s", steps=2, cache_dir=tmp_path, threads=1)
        assert seen == [1] and torch.get_num_threads() == 2
        # Unasked, the recipe's count, whatever this machine's cores and the caller's setting.
        torch.set_num_threads(1)
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
        default = pretrain.pretrain_tiny("tiny-s", steps=2, cache_dir=tmp_path)
        assert seen == [1, pretrain.THREADS] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert json.loads((path / "meta.json").read_text())["threads"] == 1
    assert json.loads((default / "meta.json").read_text())["threads"] == pretrain.THREADS


def test_the_thread_count_is_part_of_the_key(tmp_path):
    """Float32 sums split across threads give other bytes, so another count is another world; the
    recipe's count adds nothing to the key (every world cached before it keeps its folder)."""
    default = pretrain.tiny_path("tiny-s", cache_dir=tmp_path)
    assert pretrain.tiny_path("tiny-s", cache_dir=tmp_path, threads=pretrain.THREADS) == default
    assert default.name == "tiny-s-5f26d65acb7f"
    one, four = (pretrain.tiny_path("tiny-s", cache_dir=tmp_path, threads=n) for n in (1, 4))
    assert len({default, one, four}) == 3
    with pytest.raises(ValueError, match="threads must be >= 1"):
        pretrain.tiny_path("tiny-s", threads=0)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        pretrain.pretrain_tiny("tiny-s", steps=2, cache_dir=tmp_path, threads=0)


def test_a_killed_pretraining_leaves_nothing_and_the_next_run_starts_clean(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    code = (
        "import sys; from marlow.tiny.pretrain import pretrain_tiny; "
        f"pretrain_tiny('tiny-s', steps=100000, cache_dir={str(root)!r}, threads=1, "
        "log=lambda m: print(m, flush=True))"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        lines = iter(child.stdout.readline, "")
        # The first progress line is printed after 5000 steps; the start line comes first.
        first = next(itertools.islice(lines, 1))
        assert first.startswith("pre-training tiny-s")
        time.sleep(2.0)  # training, in memory
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    leftovers = [p.name for p in root.iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []
    # A temporary folder that a kill during the save left behind is removed by the next run.
    final = pretrain.tiny_path("tiny-s", cache_dir=root, steps=2, threads=1)
    stale = root / f".{final.name}.tmp-dead"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"torn")
    assert pretrain.pretrain_tiny("tiny-s", steps=2, cache_dir=root, threads=1) == final
    assert not stale.exists() and (final / "meta.json").exists()


@pytest.mark.slow
def test_the_same_world_on_avx2_kernels(tiny_cache, tmp_path):
    """The conftest world's training (20 steps) repeated in a child whose torch and oneDNN are
    held to AVX2, as on a CPU without native bf16: the same cache folder name and weights equal
    to rounding (other kernels and thread counts sum in another order: not bit for bit)."""
    path = pretrain.tiny_path("tiny-s", cache_dir=tiny_cache, steps=PRETRAIN_STEPS)
    code = f"""
import sys, torch
from marlow.tiny import pretrain
from marlow.tiny.corpus import CorpusConfig
from marlow.tiny.model import build_model, get_scale
from marlow.tiny.tokenizer import build_tokenizer
torch.set_num_threads(1)
tok = build_tokenizer()
model = build_model("tiny-s", len(tok), 0)
lr = get_scale("tiny-s").pretrain_lr
pretrain.train(model, tok, CorpusConfig(), steps={PRETRAIN_STEPS}, lr=lr, seed=0, log=print)
torch.save(model.state_dict(), sys.argv[1])
print(pretrain.tiny_path("tiny-s", cache_dir="x", steps={PRETRAIN_STEPS}).name)
"""
    env = {**os.environ, **pretrain.AVX2_ONLY}
    weights = tmp_path / "avx2.pt"
    done = subprocess.run(
        [sys.executable, "-c", code, str(weights)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == path.name
    mine, _ = pretrain.load_tiny(path)
    theirs = torch.load(weights)
    for name, a in mine.state_dict().items():
        torch.testing.assert_close(a, theirs[name], atol=1e-4, rtol=0, msg=name)
