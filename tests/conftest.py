"""Shared fixtures: a tiny random Qwen3 model and a character-level tokenizer, built offline."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from marlow.config import ConfigError, RunConfig, resolve
from marlow.models import resolve_device
from marlow.tiny.pretrain import pretrain_tiny

# Tiny models gain nothing from intra-op threads, while two processes each spinning 2 OpenMP threads
# on a 2-core machine slowed the rollout tests ~150x (1 s -> 187 s). One thread keeps tests steady.
torch.set_num_threads(1)

TEST_DEVICE = os.environ.get("MARLOW_TEST_DEVICE", "cpu")
"""Where the device tests put their tensors and runs (tests/unit/test_device.py,
tests/integration/test_precision.py and test_engine_sync.py: bench/gpu_check.py's
``DEVICE_TESTS``): the CPU, unless the environment variable MARLOW_TEST_DEVICE names another
device (a config's ``device`` value; the GPU check sets ``cuda``)."""


def pytest_configure(config: pytest.Config) -> None:
    try:
        resolve_device(TEST_DEVICE)
    except ConfigError as err:  # one line naming the devices this machine has
        raise pytest.UsageError(f"MARLOW_TEST_DEVICE={TEST_DEVICE}: {err}") from None


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device tests' device (:data:`TEST_DEVICE`), resolved on this machine."""
    return resolve_device(TEST_DEVICE)


DATA = Path(__file__).resolve().parent / "data"
"""Real public data the conformance tests read (GSM8K test, MATH-500, HumanEval): a copy kept in
the repository, so that no test depends on a folder outside it (tests/data/README.md)."""

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHARS = "0123456789+-*=()\\{}.,:?! \nabcdefghijklmnopqrstuvwxyzABCDEFGH"  # 60 symbols


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """64 ids: 4 specials then one id per character. eos is the chat end token ``<|im_end|>``."""
    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(r"[\s\S]"), behavior="isolated"
    )  # 1 char = 1 token
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.add_special_tokens(SPECIALS)
    # transformers 5: padding_side must go to the constructor to survive save/load.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_tiny_qwen3(seed: int = 0, vocab_size: int = 64, **overrides) -> Qwen3ForCausalLM:
    """A tiny random Qwen3; ``overrides`` replace fields of its config (heads, RoPE, ...)."""
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,  # peaked logits, so greedy argmax has no near-ties to flip on round-off
        pad_token_id=0,
        eos_token_id=3,
        bos_token_id=None,
    )
    config = Qwen3Config(**{**fields, **overrides})
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


@pytest.fixture
def make_model() -> Callable[..., Qwen3ForCausalLM]:
    """Factory: ``make_model(seed=0)`` builds a fresh tiny Qwen3 (the same weights for one seed)."""
    return build_tiny_qwen3


# -- the tiny world, briefly pre-trained once per session (integration and e2e tests) --

PRETRAIN_STEPS = 20  # enough to emit the formats sometimes; the tests check mechanics, not skill


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("marlow-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("MARLOW_CACHE", str(root))
    pretrain_tiny("tiny-s", steps=PRETRAIN_STEPS, cache_dir=root)
    yield str(root)
    mp.undo()


def in_process(args: list[str], cwd: Path):
    """``marlow ARGS`` run in this process from ``cwd`` (typer's runner: its exit code, stdout
    and stderr), for the commands that read a run or refuse: a process of its own costs seconds
    of imports, and the tests beside each keep the command's own process."""
    import contextlib

    from typer.testing import CliRunner

    from marlow.cli import app

    with contextlib.chdir(cwd):
        return CliRunner().invoke(app, [str(a) for a in args])


def shrunk_config(**over) -> RunConfig:
    """A tiny-preset config shrunk to seconds per step; pass overrides as a nested dict. Needs
    the ``tiny_cache`` fixture (module-scoped fixtures call it directly)."""
    base = {
        "preset": "tiny",
        "steps": 2,
        "val_every": 2,
        "ckpt_every": 1,
        "threads": 1,
        "model": {"name": "tiny-s", "pretrain_steps": PRETRAIN_STEPS},
        "task": {"val_size": 8},
        "rollout": {"max_new_tokens": 24},
        "grpo": {
            "batch_problems": 3,
            "group_size": 4,
            "minibatch_turns": 16,
            "credit": "broadcast",
        },
        "optim": {"warmup_steps": 0, "weight_decay": 0.0},
    }
    for key, value in over.items():
        if isinstance(value, dict):
            base[key] = {**base.get(key, {}), **value}
        else:
            base[key] = value
    return resolve(base)


@pytest.fixture
def small_config(tiny_cache):
    """:func:`shrunk_config`, once the tiny world is cached."""
    return shrunk_config


@pytest.fixture
def one_row_a_sequence(monkeypatch):
    """Every row forwards its own prompt (``marlow.shared_prompts`` off). For tests that hold
    an updated weight to another computation's within a small share of the learning rate: a
    packed row's round-off depends on its batch-mates, and AdamW's first step (about lr x
    sign(g)) turns it into a visible difference on a weight whose gradient is near zero.
    Packing's own equality: tests/unit/test_shared_prompts.py."""
    import marlow.models

    monkeypatch.setattr(marlow.models, "pack_shared_prompts", lambda *a: None)


@pytest.fixture(scope="session")
def trained_voting(tiny_cache, tmp_path_factory) -> Path:
    """A Voting-SP run of 2 steps on the quickstart's shipped world, which answers arithmetic
    (so answers differ per question), its shared adapter moved off the base by varied rewards."""
    from marlow.training.trainer import Trainer
    from tests.integration.reference import vary_rewards

    out = tmp_path_factory.mktemp("trained-voting") / "run"
    cfg = shrunk_config(
        workflow={"name": "voting"},
        policy={"routing": "sp"},
        model={"name": "tiny-s", "pretrain_steps": 4800, "pretrain_batch": 8},
        rollout={"max_new_tokens": 48},
    )
    with vary_rewards(Trainer(cfg, out)) as trainer:
        trainer.run()
    return out
