"""The tiny preset with bfloat16 base weights, end to end, against the same run in float32.
The learn step compares the two on the device tests' device (the CPU unless
MARLOW_TEST_DEVICE names another: ``tests/conftest.py``); the end-to-end run puts bfloat16 on
``device=auto`` (the accelerator, where the machine has one) against float32 on the CPU.

Tolerances come from measured differences (``bench/precision_gap.py``: this 2-core machine,
native bf16, torch 2.13.0), one learn step on the same episodes, float32 vs bfloat16 base (its
LoRA computing in bfloat16: ``lora_in_base_dtype``), largest over Voting-IP, Eval-Opt-SP and
Orch-Workers-IP; each tolerance is about 3-10x the largest measured:

    entropy, nll, perplexity (relative)      5.5e-4     tolerance 2e-3
    grad_norm, grad_norm_max, _own (rel.)    1.9e-2     tolerance 6e-2
    grad_mass_share (absolute)               1.3e-3     tolerance 1e-2
    loss (absolute)                          3.4e-4     tolerance 3e-3
    chi2_update (absolute)                   1.6e-3     tolerance 1e-2
    ratio_max (relative)                     5.7e-3     tolerance 6e-2
    chi2_rollout of bf16 scoring vs the
      float32 sampler (absolute)             1.1e-3     tolerance 5e-3 (float32: 1e-6)
    rollout_abs_dlogp, the same (absolute)   4.5e-3     tolerance 2e-2 (float32: 2.0e-7; 1e-6)
    LoRA update |d16 - d32| / |d32|          0.13       tolerance 0.3

LoRA computing in float32 (PEFT's own arithmetic) measured the same within 1.5x (grad_norm_max
2.0e-2, ratio_max 9.9e-3, chi2_update 2.4e-3).

Everything else a step logs (rewards, accuracy, lengths, clip fractions, kl_to_base at the first
step) is equal: the episodes are the same. Sampled end to end, the two runs draw different tokens
where their logits differ, so the runs' own episodes diverge: there only the aggregate entropy
and NLL are compared (measured over 2 steps: 0.42 % and 0.83 %; tolerance 5 %).

On an accelerator, a bfloat16 base's decoder layers compiled (``grpo.compile``: inductor's own
kernels there) are held no farther from float32 than its eager ones, as
tests/unit/test_compile_layers.py holds them on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from marlow import models
from marlow.diagnostics.sinks import read_metrics
from marlow.models import checkpoint_layers, compile_layers, completion_logprobs
from marlow.policy.adapters import adapter_parameters, use_adapter
from marlow.training import checkpoint
from marlow.training.trainer import Trainer
from tests.conftest import TEST_DEVICE
from tests.integration.reference import vary_rewards
from tests.unit.test_compile_layers import lora_model, rows

RTOL = {"entropy": 2e-3, "nll": 2e-3, "perplexity": 2e-3, "ratio_max": 6e-2}
RTOL |= dict.fromkeys(("grad_norm", "grad_norm_max", "grad_norm_own"), 6e-2)
ATOL = {"grad_mass_share": 1e-2, "loss": 3e-3, "chi2_update": 1e-2}


def lora_and_base(trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    lora = [p for a in trainer.adapters for p in adapter_parameters(trainer.model, a).values()]
    ids = {id(p) for p in lora}
    return lora, [p for p in trainer.model.parameters() if id(p) not in ids]


def test_bfloat16_learn_step_matches_float32_on_the_same_episodes(small_config, tmp_path, device):
    cfg = small_config(device=TEST_DEVICE, diagnostics={"every": 1})
    f32 = Trainer(cfg, tmp_path / "f32")
    b16 = Trainer(cfg.model_copy(update={"dtype": "bfloat16"}), tmp_path / "b16")
    assert f32.device == b16.device == device
    episodes = f32.rollout(f32.task.train_batch(0, 1, 3), 4, 0.7, seed=5)
    for ep in episodes:
        ep.reward = float(ep.sample % 2)

    def learn(trainer) -> tuple[dict, dict[str, list[torch.Tensor]]]:
        """The step's metrics, and each adapter's LoRA update."""
        lora = {a: list(adapter_parameters(trainer.model, a).values()) for a in trainer.adapters}
        before = {a: [p.detach().clone() for p in ps] for a, ps in lora.items()}
        record = trainer.learn(1, episodes)
        return record, {
            a: [p.detach() - b for p, b in zip(ps, before[a], strict=True)]
            for a, ps in lora.items()
        }

    want, d32 = learn(f32)
    got, d16 = learn(b16)
    for trainer, dtype in ((f32, torch.float32), (b16, torch.bfloat16)):
        lora, base = lora_and_base(trainer)
        assert {p.dtype for p in lora} == {torch.float32}
        assert {p.dtype for p in base} == {dtype}
    assert set(got) == set(want)
    for key, w in want.items():
        g, metric = got[key], key.rsplit("/", 1)[-1]
        if key.startswith("time/"):
            continue
        if metric == "chi2_rollout":  # bf16 scoring against the float32 sampler's log-probs
            assert abs(w) <= 1e-6 and abs(g) <= 5e-3, (key, w, g)
        elif metric == "rollout_abs_dlogp":  # the same mismatch as a mean |dlogp| per token
            assert w <= 1e-6 and 0 < g <= 2e-2, (key, w, g)  # measured 2.0e-7 and 4.5e-3
        elif metric == "engine_drift":  # the engine's unpadded probe vs padded rescoring
            assert w <= 1e-6 and g <= 2e-3, (key, w, g)  # measured 1.7e-7 and 7.5e-4
        elif metric in RTOL:
            assert g == pytest.approx(w, rel=RTOL[metric]), key
        elif metric in ATOL:
            assert g == pytest.approx(w, abs=ATOL[metric]), key
        else:
            assert g == w, key
    for adapter, ref in d32.items():
        err = math.sqrt(
            sum(float((a - b).pow(2).sum()) for a, b in zip(d16[adapter], ref, strict=True))
        )
        size = math.sqrt(sum(float(b.pow(2).sum()) for b in ref))
        assert size > 0 and err / size < 0.3, (adapter, err / size)


def test_bfloat16_tiny_run_end_to_end_against_float32(small_config, tmp_path):
    """Two steps of ``Trainer.run`` (rollout, scoring, update, diagnostics, validation,
    checkpoints), bfloat16 on ``device=auto``, float32 on ``device=cpu``."""
    runs = {}
    for dtype, device in (("float32", "cpu"), ("bfloat16", "auto")):
        cfg = small_config(dtype=dtype, device=device, rollout={"max_new_tokens": 16})
        trainer = vary_rewards(Trainer(cfg, tmp_path / dtype))
        accelerated = torch.cuda.is_available() or torch.backends.mps.is_available()
        if device == "auto" and accelerated:
            assert trainer.device.type != "cpu"
        else:
            assert trainer.device == torch.device("cpu")
        trainer.run()
        runs[dtype] = trainer
    b16 = runs["bfloat16"]
    lora, base = lora_and_base(b16)
    assert {p.dtype for p in lora} == {torch.float32}
    assert {p.dtype for p in base} == {torch.bfloat16}
    assert {p.device for p in b16.model.parameters()} == {b16.device}
    moments = [
        v for o in b16.optim.optimizers.values() for s in o.state.values() for v in s.values()
    ]
    assert {v.dtype for v in moments if v.dim() > 0} == {torch.float32}
    records = {d: read_metrics(tmp_path / d) for d in runs}
    assert [r["step"] for r in records["bfloat16"]] == [0, 1, 2]
    for want, got in zip(records["float32"][1:], records["bfloat16"][1:], strict=True):
        assert all(math.isfinite(v) for v in got.values()), got
        for key in ("train/all/entropy", "train/all/nll"):
            assert got[key] == pytest.approx(want[key], rel=0.05), key
    # its checkpoint resumes into a fresh bfloat16 trainer, LoRA still float32
    fresh = Trainer(b16.cfg, tmp_path / "again")
    assert (
        checkpoint.load(
            checkpoint.latest(tmp_path / "bfloat16"), fresh.model, fresh.adapters, fresh.optim
        )
        == 2
    )
    for a in fresh.adapters:
        for k, p in adapter_parameters(fresh.model, a).items():
            assert p.dtype == torch.float32 and torch.equal(p, adapter_parameters(b16.model, a)[k])


def test_compiled_bfloat16_layers_on_the_device_are_no_farther_from_float32(device, monkeypatch):
    """``grpo.compile`` on the device (on CUDA inductor's own kernels): a bfloat16 base's decoder
    layers, checkpointed as a run's, compiled, give log-probs and LoRA gradients no farther from
    the float32 model's than its eager layers do, and never fall back to eager. On the CPU
    tests/unit/test_compile_layers.py holds them so (its compilations are the CPU's slow tests)."""
    if device.type == "cpu":
        pytest.skip("on the CPU: tests/unit/test_compile_layers.py (slow)")

    monkeypatch.setattr(models, "_GAVE_UP", [])

    def run(model) -> list:
        out = []
        for n, length in ((3, 20), (5, 27)):
            batch = [t.to(device) for t in rows(n, n, length)]
            model.zero_grad(set_to_none=True)
            with use_adapter(model, "gen"):
                logp, _ = completion_logprobs(model, *batch, 0.8)
                (-(logp * batch[-1]).sum()).backward()
            grads = {k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None}
            out.append((logp.detach().float(), grads))
        return out

    exact = run(lora_model().to(device))
    model = lora_model(torch.bfloat16).to(device)
    checkpoint_layers(model)
    eager = run(model)
    compile_layers(model)
    compiled = run(model)
    compile_layers(model, on=False)
    assert not models._GAVE_UP

    def gap(ours) -> float:  # the largest relative error of a log-prob or a gradient
        worst = 0.0
        for (logp, grads), (ref_logp, ref_grads) in zip(ours, exact, strict=True):
            worst = max(worst, float((logp - ref_logp).abs().max() / ref_logp.abs().max()))
            assert grads.keys() == ref_grads.keys()
            for k, g in ref_grads.items():
                worst = max(worst, float((grads[k] - g).norm() / g.norm()))
        return worst

    assert gap(eager) > 0  # bfloat16 is not float32
    assert gap(compiled) <= 1.5 * gap(eager), (gap(compiled), gap(eager))
