"""``marlow plan`` (marlow.plan): parameter counts of the shipped Qwen3 architectures against the
published figures and a real ``Qwen3ForCausalLM``, LoRA counts against a hand formula and PEFT,
memory figures against their formulas worked out here, and the fit verdict at its edge.

Every expected number is either a published figure (the Qwen3 model cards) or computed in this
file from the architecture's config.json fields, independently of marlow.plan's code."""

from __future__ import annotations

import json
import warnings
from functools import partial

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from marlow.archs import HUB_IDS, Shape, arch_config, arch_names
from marlow.config import ConfigError, load_config
from marlow.plan import GIB, activations, held_bytes, plan_run, render
from marlow.tiny.model import build_model, n_parameters
from marlow.tiny.tokenizer import build_tokenizer

# The Qwen3 model cards: "Number of Parameters" and "Number of Paramaters (Non-Embedding)", as
# printed (the number of decimals is the precision they are published to).
PUBLISHED = {
    "qwen3-0.6b": ("0.6", "0.44"),
    "qwen3-1.7b": ("1.7", "1.4"),
    "qwen3-4b": ("4.0", "3.6"),
}


def plan(*overrides: str, **kwargs):
    return plan_run(load_config(None, list(overrides)), **kwargs)


def fields(arch: str) -> dict:
    c = arch_config(arch)
    return {
        "h": c["hidden_size"],
        "a": c["num_attention_heads"],
        "g": c["num_key_value_heads"],
        "d": c["head_dim"],
        "I": c["intermediate_size"],
        "L": c["num_hidden_layers"],
        "V": c["vocab_size"],
    }


def hand_parameters(arch: str) -> tuple[int, int]:
    """(total, non-embedding) of a Qwen3 decoder with tied embeddings, from its config fields."""
    f = fields(arch)
    h, a, g, d, inter = f["h"], f["a"], f["g"], f["d"], f["I"]
    attention = h * a * d + 2 * h * g * d + a * d * h + 2 * d  # q, k, v, o; q_norm, k_norm
    layer = attention + 3 * h * inter + 2 * h  # SwiGLU; two RMSNorms
    non_embedding = f["L"] * layer + h  # + the final norm
    return non_embedding + f["V"] * h, non_embedding


def hand_lora(arch: str, r: int, targets=("q", "k", "v", "o", "gate", "up", "down")) -> int:
    """sum over layers of r * (in + out) per targeted linear."""
    f = fields(arch)
    h, q, kv, inter = f["h"], f["a"] * f["d"], f["g"] * f["d"], f["I"]
    shapes = {
        "q": (h, q),
        "k": (h, kv),
        "v": (h, kv),
        "o": (q, h),
        "gate": (h, inter),
        "up": (h, inter),
        "down": (inter, h),
    }
    return f["L"] * sum(r * (i + o) for i, o in (shapes[t] for t in targets))


def meta_qwen3(arch: str) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        return Qwen3ForCausalLM(Qwen3Config(**arch_config(arch)))


@pytest.mark.parametrize("arch", arch_names())
def test_counts_match_the_published_figures_and_a_real_qwen3(arch):
    p = plan(f"model.name={arch}")
    total, non_embedding = hand_parameters(arch)
    assert (p.parameters, p.non_embedding) == (total, non_embedding)
    real = meta_qwen3(arch)
    distinct = {id(t): t for t in real.parameters()}.values()
    assert sum(t.numel() for t in distinct) == total
    assert real.lm_head.weight is real.model.embed_tokens.weight  # tied: the cards count it once
    published_total, published_non_embedding = PUBLISHED[arch]
    decimals = len(published_non_embedding.split(".")[1])
    assert f"{p.parameters / 1e9:.1f}" == published_total
    assert f"{p.non_embedding / 1e9:.{decimals}f}" == published_non_embedding


def test_the_0_6b_count_to_three_places():
    assert f"{plan('model.name=qwen3-0.6b').parameters / 1e9:.3f}" == "0.596"


@pytest.mark.parametrize("hub_id", sorted(HUB_IDS))
def test_hub_ids_name_the_shipped_architecture_without_the_hub(hub_id, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = plan(f"model.name={hub_id}")
    assert p.source == f"shipped architecture {HUB_IDS[hub_id]}"
    assert p.parameters == hand_parameters(HUB_IDS[hub_id])[0]


def test_the_paper_preset_plans_qwen3_1_7b_in_bfloat16():
    p = plan("preset=paper")
    assert (p.model, p.dtype, p.parameters) == ("Qwen/Qwen3-1.7B", "bfloat16", 1_720_574_976)


@pytest.mark.parametrize(
    ("arch", "rank"), [("qwen3-0.6b", 8), ("qwen3-0.6b", 64), ("qwen3-1.7b", 64), ("qwen3-4b", 64)]
)
def test_lora_counts_equal_the_hand_formula_and_peft(arch, rank):
    p = plan(f"model.name={arch}", f"policy.lora_rank={rank}", "workflow.name=voting")
    assert [a.name for a in p.adapters] == ["generator", "aggregator"]  # IP: one per role type
    expected = hand_lora(arch, rank)
    assert [a.trainable for a in p.adapters] == [expected, expected]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
        peft_model = get_peft_model(
            meta_qwen3(arch), LoraConfig(r=rank, target_modules="all-linear")
        )
    assert peft_model.get_nb_trainable_parameters()[0] == expected


def test_lora_on_named_modules_and_the_routings():
    only_qv = ("policy.target_modules=[q_proj, v_proj]", "policy.lora_rank=4")
    p = plan("model.name=qwen3-0.6b", *only_qv, "policy.routing=sp")
    assert [(a.name, a.roles) for a in p.adapters] == [("shared", ["generator", "aggregator"])]
    assert p.adapters[0].trainable == hand_lora("qwen3-0.6b", 4, ("q", "v"))
    orch = plan("model.name=qwen3-0.6b", "workflow.name=orch_workers")
    assert [a.name for a in orch.adapters] == ["orchestrator", "worker", "synthesizer"]
    base = plan("model.name=qwen3-0.6b", "policy.routing=base")
    assert base.adapters == [] and base.adapter_bytes == 0 and base.activation_bytes == 0


def hand_activation_bytes(arch: str, b: int, r: int, tokens: int, checkpointed: bool) -> int:
    """The module docstring's model for LoRA on all 7 linears, written out for Qwen3: what the
    pass keeps throughout, and the larger of one layer's backward and the head's phase, whose
    logits go through the head a chunk of at most 256 MiB of float32 logits at a time; over a
    half-precision base, the adapter's factors cast to it, held whatever the tokens."""
    f = fields(arch)
    h, a, g, d, inter, L, V = (f[k] for k in ("h", "a", "g", "d", "I", "L", "V"))
    own = b * (4 * h + 3 * a * d + 3 * g * d + 4 * inter) + 4 * (2 + 2 * a + g)
    lora = b * 7 * r  # a layer's A outputs
    if checkpointed:
        kept, layer = L * b * h, own + lora + 2 * b * inter + b * h
    else:
        kept, layer = L * (own + lora), 3 * b * inter + 2 * b * h
    head = tokens * (3 * b * h + 4) + 2 * min(256 * 2**20, tokens * 4 * V)
    held = b * hand_lora(arch, r) if b == 2 else 0
    return held + tokens * kept + max(tokens * layer, head)


def test_the_held_factors_are_the_adapter_in_a_half_precision_base_dtype():
    assert held_bytes(2, 1000, dropout=False) == 2000
    assert held_bytes(4, 1000, dropout=False) == 0  # float32: LoRA computes as PEFT's
    assert held_bytes(2, 1000, dropout=True) == 0  # dropout: PEFT's forward casts its own
    shape = Shape.of(meta_qwen3("qwen3-0.6b").config)
    for checkpointed in (False, True):
        model = partial(activations, shape, 2, [(1024, 8)] * 196, True, checkpointed)
        for tokens in (0, 100, 10_000):  # whatever the tokens
            assert model(held=5000).bytes(tokens) - model().bytes(tokens) == 5000


@pytest.mark.parametrize(
    ("dtype", "micro_tokens", "prompt", "new", "checkpointing"),
    [
        ("bfloat16", 8192, 1024, 512, "auto"),
        ("bfloat16", 8192, 1024, 512, "off"),
        ("float32", 4096, 700, 3900, "off"),
        ("float16", 1000, 300, 200, "on"),
    ],
)
def test_memory_figures_equal_their_formulas(dtype, micro_tokens, prompt, new, checkpointing):
    arch, r, max_batch = "qwen3-0.6b", 32, 24
    p = plan(
        f"grpo.activation_checkpointing={checkpointing}",
        f"model.name={arch}",
        f"dtype={dtype}",
        f"policy.lora_rank={r}",
        f"grpo.micro_tokens={micro_tokens}",
        f"rollout.max_batch={max_batch}",
        f"rollout.max_new_tokens={new}",
        prompt_tokens=prompt,
    )
    b = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    f = fields(arch)
    total, _ = hand_parameters(arch)
    lora = hand_lora(arch, r)
    assert p.base_bytes == total * b
    assert [a.bytes for a in p.adapters] == [16 * lora, 16 * lora]  # f32 w, grad, m, v
    assert p.adapter_bytes == 2 * 16 * lora
    tokens = max(micro_tokens, prompt + new)  # a turn longer than micro_tokens is scored alone
    assert p.forward_tokens == tokens
    assert p.checkpointed == (checkpointing != "off")  # auto: on for a Hugging Face model
    assert p.activation_bytes == hand_activation_bytes(arch, b, r, tokens, p.checkpointed)
    kv = max_batch * (prompt + new) * f["L"] * 2 * f["g"] * f["d"] * b
    assert p.kv_cache_bytes == kv
    assert p.peak_bytes == total * b + 2 * 16 * lora + max(p.activation_bytes, kv)


def test_the_peak_takes_the_larger_of_rollout_and_update():
    small_update = plan("grpo.micro_tokens=64", "rollout.max_new_tokens=64")  # tiny-s
    assert small_update.kv_cache_bytes > small_update.activation_bytes
    assert small_update.peak_bytes == (
        small_update.base_bytes + small_update.adapter_bytes + small_update.kv_cache_bytes
    )
    small_rollout = plan("rollout.max_batch=1")
    assert small_rollout.activation_bytes > small_rollout.kv_cache_bytes
    assert small_rollout.peak_bytes == (
        small_rollout.base_bytes + small_rollout.adapter_bytes + small_rollout.activation_bytes
    )


def test_gpu_mem_verdict_at_its_edge():
    settings = ("model.name=tiny-m", "dtype=bfloat16", "grpo.micro_tokens=4096")
    peak = plan(*settings).peak_bytes
    assert plan(*settings).fits is None
    assert plan(*settings, gpu_mem_gib=peak / GIB).fits is True
    assert plan(*settings, gpu_mem_gib=(peak - 1) / GIB).fits is False


def test_the_largest_micro_tokens_that_fits_does_and_one_more_does_not():
    settings = ("model.name=tiny-m", "rollout.max_batch=8", "grpo.micro_tokens=65536")
    budget = 0.5  # GiB: a 65,536-token micro-batch needs ~4
    first = plan(*settings, gpu_mem_gib=budget)
    assert first.fits is False and first.max_micro_tokens is not None
    edge = first.max_micro_tokens
    assert plan(*settings, f"grpo.micro_tokens={edge}", gpu_mem_gib=budget).fits is True
    assert plan(*settings, f"grpo.micro_tokens={edge + 1}", gpu_mem_gib=budget).fits is False
    kv_bound = plan(*settings, "rollout.max_batch=4096", gpu_mem_gib=budget)
    assert kv_bound.fits is False and kv_bound.max_micro_tokens is None  # the rollout alone


def test_a_tiny_scale_uses_the_tiny_builder_without_pretraining(monkeypatch, tmp_path):
    monkeypatch.setenv("MARLOW_CACHE", str(tmp_path / "cache"))

    def no_pretraining(*args, **kwargs):
        raise AssertionError("plan pre-trained a tiny scale")

    monkeypatch.setattr("marlow.tiny.pretrain.pretrain_tiny", no_pretraining)
    p = plan("model.name=tiny-m")
    assert p.parameters == n_parameters(build_model("tiny-m", len(build_tokenizer())))
    assert not (tmp_path / "cache").exists()


def test_a_local_folder_with_a_config_json(tmp_path):
    folder = tmp_path / "my-qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(arch_config("qwen3-0.6b")))
    p = plan(f"model.name={folder}")
    assert p.source == f"folder {folder}"
    assert p.parameters == hand_parameters("qwen3-0.6b")[0]


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("Qwen/Qwen3-99B", "not a shipped architecture"),
        ("./no-such-folder", "no such folder"),
        ("tiny-xl", "not a shipped architecture"),
    ],
)
def test_a_model_it_cannot_plan_names_the_field_and_the_choices(name, needle, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as err:
        plan(f"model.name={name}")
    message = str(err.value)
    assert needle in message and "model.name" in message
    assert "qwen3-0.6b" in message and "tiny-s" in message


def test_a_folder_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        plan(f"model.name={tmp_path}")


def test_auto_micro_tokens_is_8192_without_a_card_and_sized_to_one_with_it():
    paper = ("preset=paper", "grpo.micro_tokens=auto", "rollout.max_batch=16")
    assert plan(*paper, "model.name=qwen3-0.6b").forward_tokens == 8192  # no card: off CUDA
    assert plan(*paper, "model.name=qwen3-0.6b", gpu_mem_gib=80).micro_tokens == 32768  # capped
    assert (
        plan(*paper, "model.name=qwen3-4b", "grpo.micro_tokens=6144", gpu_mem_gib=24).micro_tokens
        == 6144
    )
    sized = plan(*paper, "model.name=qwen3-4b", gpu_mem_gib=24)
    n = sized.micro_tokens
    assert sized.micro_tokens_auto and n % 1024 == 0 and 1024 <= n < 32768
    room = 0.5 * (24 * GIB - sized.base_bytes - sized.adapter_bytes)  # half of what is left

    def activations(tokens: int) -> int:
        return plan(*paper, "model.name=qwen3-4b", f"grpo.micro_tokens={tokens}").activation_bytes

    assert activations(n) <= room < activations(n + 1024)  # the most that fits, in steps of 1024


def test_checkpointing_auto_turns_off_where_every_layers_activations_fit_the_card():
    """On a card, auto keeps every layer's activations where the largest forward's, so kept,
    fit in half the memory left beside the weights and adapters (the share that sizes
    micro_tokens), and checkpoints them where they do not; no card (a CPU) and ``on`` keep
    them checkpointed, ``off`` and a tiny scale never do."""
    paper = ("preset=paper", "model.name=qwen3-1.7b")  # 6,144 tokens: micro and turn alike
    unchecked = plan(*paper, "grpo.activation_checkpointing=off")
    checked = plan(*paper)
    assert checked.checkpointed and not checked.auto_unchecked  # no card: as on the CPU
    assert unchecked.activation_bytes > 5 * checked.activation_bytes
    fixed = checked.base_bytes + checked.adapter_bytes
    edge = (fixed + 2 * unchecked.activation_bytes) / GIB  # room = activations exactly
    above, below = plan(*paper, gpu_mem_gib=edge + 0.01), plan(*paper, gpu_mem_gib=edge - 0.01)
    assert not above.checkpointed and above.auto_unchecked
    assert above.activation_bytes == unchecked.activation_bytes
    assert below.checkpointed and not below.auto_unchecked
    assert below.activation_bytes == checked.activation_bytes
    assert above.micro_tokens == below.micro_tokens == 6144  # the micro-batch is unchanged
    on = plan(*paper, "grpo.activation_checkpointing=on", gpu_mem_gib=10 * edge)
    assert on.checkpointed and not on.auto_unchecked
    tiny = plan("model.name=tiny-s", gpu_mem_gib=80)
    assert not tiny.checkpointed and not tiny.auto_unchecked

    def notes(p) -> str:
        return str(render(p)[1])

    hint = "a card that holds every layer's activations keeps them (--gpu-mem)"
    assert hint in notes(checked)  # auto, no card: what a card may do
    assert hint not in notes(below) and hint not in notes(on)
    assert "its layers not checkpointed (grpo.activation_checkpointing auto" in notes(above)


def test_checkpointing_auto_weighs_the_longest_turn_the_config_allows():
    """A turn is scored in one forward whatever micro_tokens says: the decision weighs
    ``rollout.max_prompt_tokens`` (else plan's 1,024-token prompt) + ``max_new_tokens``."""
    small = ("preset=paper", "model.name=qwen3-1.7b", "grpo.micro_tokens=1024")
    turn = plan(*small, "grpo.activation_checkpointing=off")  # forward: 1,024 + 5,120 tokens
    fixed = turn.base_bytes + turn.adapter_bytes
    enough = (fixed + 2 * turn.activation_bytes) / GIB + 0.01
    assert not plan(*small, gpu_mem_gib=enough).checkpointed
    capped = plan(*small, "rollout.max_prompt_tokens=4096", gpu_mem_gib=enough)
    assert capped.checkpointed  # 4,096 + 5,120 tokens with every layer's activations: too many


def test_checkpointing_auto_keeps_the_micro_tokens_it_sized():
    """micro_tokens=auto is sized with the layers checkpointed; auto then turns checkpointing
    off only where that micro-batch, with every layer's activations kept, fits too."""
    paper = ("preset=paper", "model.name=qwen3-0.6b", "grpo.micro_tokens=auto")
    h100, h200 = plan(*paper, gpu_mem_gib=79.2), plan(*paper, gpu_mem_gib=139.8)
    assert h100.micro_tokens == h200.micro_tokens == 32768  # the most auto takes
    assert h100.checkpointed and not h200.checkpointed
    room = 0.5 * (139.8 * GIB - h200.base_bytes - h200.adapter_bytes)
    assert h200.activation_bytes <= room
    kept = plan(*paper, "grpo.micro_tokens=32768", "grpo.activation_checkpointing=off")
    assert (
        h200.activation_bytes
        == kept.activation_bytes
        > 0.5 * (79.2 * GIB - h100.base_bytes - h100.adapter_bytes)
    )


def test_the_auto_settings_leave_a_vllm_engines_memory_beside_the_update():
    """vLLM runs in processes of its own on the trainer's card for the whole run: its KV cache
    (``rollout.vllm.kv_cache_gib``) and its copy of the base weights are left out of the room
    the auto settings fill, as if the card were that much smaller."""
    args = ("preset=paper", "model.name=qwen3-4b", "grpo.micro_tokens=auto")
    vllm = ("rollout.backend=vllm", "rollout.vllm.kv_cache_gib=10")
    hf = plan(*args, gpu_mem_gib=40)
    served = plan(*args, *vllm, gpu_mem_gib=40)
    smaller = plan(*args, gpu_mem_gib=40 - 10 - hf.base_bytes / GIB)
    assert served.micro_tokens == smaller.micro_tokens < hf.micro_tokens
    small = ("preset=paper", "model.name=qwen3-0.6b")  # 6,144 tokens, every layer's: 8.9 GiB
    assert not plan(*small, gpu_mem_gib=48).checkpointed
    assert plan(
        *small, "rollout.backend=vllm", "rollout.vllm.kv_cache_gib=30", gpu_mem_gib=48
    ).checkpointed


def test_a_vllm_runs_peak_holds_the_engine_beside_the_update():
    """vLLM keeps its KV cache and its copy of the weights on the card while the trainer
    updates: plan's peak adds them to the activations (no HF rollout batch then), and what it
    suggests for a run that does not fit makes it fit, each figure the largest that does."""
    args = ("preset=paper", "model.name=qwen3-4b", "rollout.backend=vllm")
    tp2 = plan(*args, "rollout.vllm.kv_cache_gib=20", "rollout.vllm.tensor_parallel_size=2")
    p = plan(*args, "rollout.vllm.kv_cache_gib=20")
    assert p.kv_cache_bytes == 0 and p.engine_bytes == 20 * GIB + p.base_bytes
    assert tp2.engine_bytes == 20 * GIB + p.base_bytes // 2  # the weights split across cards
    assert p.peak_bytes == p.base_bytes + p.adapter_bytes + p.engine_bytes + p.activation_bytes
    shown = "\n".join(str(r) for r in render(p)[1:2])
    assert "vLLM engine" in shown and "rollout.vllm.kv_cache_gib" in shown
    card = p.peak_bytes / GIB
    assert plan(*args, "rollout.vllm.kv_cache_gib=20", gpu_mem_gib=card).fits
    for kv, micro, key in (
        (70, 6144, "rollout.vllm.kv_cache_gib"),
        (55, 32768, "grpo.micro_tokens"),
    ):
        over = (*args, f"rollout.vllm.kv_cache_gib={kv}", f"grpo.micro_tokens={micro}")
        refused = plan(*over, gpu_mem_gib=80)
        assert not refused.fits and list(refused.suggestions) == [key]
        value = refused.suggestions[key]
        assert plan(*over, f"{key}={value}", gpu_mem_gib=80).fits
        step = 0.01 if key.endswith("gib") else 1
        assert not plan(*over, f"{key}={value + step:g}", gpu_mem_gib=80).fits


@pytest.mark.parametrize("value", [0, -5, "big", 1.5, True])
def test_micro_tokens_takes_auto_or_a_positive_whole_number(value):
    with pytest.raises(ConfigError, match=r"^config field 'grpo.micro_tokens': must be auto or"):
        load_config(None, [f"grpo.micro_tokens={value}"])
