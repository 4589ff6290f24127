"""A loaded base's RMSNorms through torch's ``rms_norm`` (``marlow.models.fuse_norms``): one
fused kernel each way on CUDA; transformers' values bit for bit in float32, one rounding instead
of two in bfloat16, and the same arithmetic in the lean sampling forward."""

from __future__ import annotations

import copy

import torch

from marlow.models import fuse_norms, fused_norm, load_base
from marlow.policy.adapters import LoraSpec, attach_adapters, lora_in_base_dtype, use_adapter
from tests.conftest import build_tiny_qwen3, shrunk_config


def forward_and_grads(model, ids):
    """Logits of ``ids`` and the gradient of their sum for every norm weight and LoRA factor."""
    for p in model.parameters():
        p.grad = None
    params = [p for n, p in model.named_parameters() if "norm" in n or "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    logits = model(ids).logits
    logits.float().sum().backward()
    return logits.detach(), [p.grad.clone() for p in params]


def test_fused_norms_equal_transformers_bit_for_bit_in_float32():
    """Logits and gradients (the norms' weights', the LoRA factors') of the fused model equal
    transformers' exactly; each of the 2 layers' 4 norms and the final one is fused."""
    model = attach_adapters(build_tiny_qwen3(), ["policy"], LoraSpec(4, 8), seed=0)
    ids = torch.randint(4, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    theirs = forward_and_grads(model, ids)
    fused = copy.deepcopy(model)
    assert fuse_norms(fused) == 2 * 4 + 1
    assert fuse_norms(fused) == 0  # once only
    assert fused_norm(fused.base_model.model.model.norm) and not fused_norm(model.model.model.norm)
    ours = forward_and_grads(fused, ids)
    assert torch.equal(ours[0], theirs[0])
    assert len(ours[1]) == len(theirs[1]) > 9
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(a, b)


def test_fused_norms_in_bfloat16_round_once_and_outside_autocast(monkeypatch):
    """bfloat16: within one bfloat16 step of transformers' (x / rms(x) is not rounded before the
    weight multiplies it), closer to the float32 model's; the norm runs outside the scoring's
    autocast (under which CUDA's rms_norm would return float32) and returns bfloat16."""
    model = build_tiny_qwen3()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # not all ones: the weight's product is rounded
    truth = model.model.norm(torch.randn(64, 64, generator=torch.Generator().manual_seed(2)) * 3)
    x = (torch.randn(64, 64, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    norm = copy.deepcopy(model.model.norm).bfloat16()
    theirs = norm(x)
    fuse_norms(norm)
    ours = norm(x)
    assert ours.dtype == torch.bfloat16
    assert (ours != theirs).any()  # another rounding: the comparison is not vacuous
    step = theirs.float().abs() * 2**-7
    assert ((ours.float() - theirs.float()).abs() <= step).all()
    assert (ours.float() - truth).abs().mean() <= (theirs.float() - truth).abs().mean()

    seen = []
    rms = torch.nn.functional.rms_norm
    monkeypatch.setattr(
        torch.nn.functional,
        "rms_norm",
        lambda *a, **k: seen.append(torch.is_autocast_enabled("cpu")) or rms(*a, **k),
    )
    adapted = attach_adapters(build_tiny_qwen3().bfloat16(), ["policy"], LoraSpec(4, 8), seed=0)
    fuse_norms(adapted)
    with use_adapter(adapted, "policy"), lora_in_base_dtype(adapted):
        assert torch.is_autocast_enabled("cpu")
        logits = adapted(torch.randint(4, 64, (2, 6))).logits
    assert logits.dtype == torch.bfloat16
    assert seen and not any(seen)


def test_a_loaded_base_computes_its_norms_fused(tiny_cache):
    """load_base fuses the tiny world's norms (and any transformers Qwen3's, Qwen2's, Llama's,
    Mistral's)."""
    model, _ = load_base(shrunk_config().model, task="math")
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert norms and all(fused_norm(m) for m in norms)
