"""Device and precision: which device a config's ``device`` names on this
machine, and which dtype each tensor kind has when the base is bfloat16 (base weights bfloat16;
LoRA weights, their gradients, AdamW state and log-probs float32), on the device tests' device
(the CPU unless MARLOW_TEST_DEVICE names another: ``tests/conftest.py``); and the per-phase
peak memory metrics, which only a CUDA device has."""

from __future__ import annotations

import pytest
import torch

from marlow.algo.turn_advantages import CreditRows
from marlow.config import ConfigError
from marlow.models import resolve_device
from marlow.policy.adapters import LoraSpec, adapter_parameters, attach_adapters, use_adapter
from marlow.rollout.hf import HFEngine
from marlow.training.batch import build_batches
from marlow.training.logprobs import score_rows
from marlow.training.memory import phase_peaks, start_phase
from marlow.training.optim import AdapterOptimizers
from marlow.types import GenRequest, SamplingParams, Turn

NO_ACCELERATOR = not torch.cuda.is_available() and not torch.backends.mps.is_available()


def machine(monkeypatch, cuda: int = 0, mps: bool = False) -> None:
    """Pretend the machine has ``cuda`` CUDA devices (the current one: the last) and maybe mps."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda - 1)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


@pytest.mark.skipif(not NO_ACCELERATOR, reason="this machine has an accelerator")
def test_auto_is_the_cpu_here_and_cpu_is_the_cpu():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_prefers_cuda_then_mps_then_cpu(monkeypatch):
    machine(monkeypatch, cuda=2, mps=True)
    assert resolve_device("auto") == torch.device("cuda", 1)  # the current device, with its index
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    machine(monkeypatch, cuda=0, mps=True)
    assert resolve_device("auto") == torch.device("mps")
    machine(monkeypatch, cuda=0, mps=False)
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize(
    ("cuda", "mps", "name", "message"),
    [
        (0, False, "cuda", "'device' is 'cuda' but this machine has no such device: torch sees "
         "0 CUDA device(s)"),
        (1, False, "cuda:1", "'device' is 'cuda:1' but this machine has no such device: torch "
         "sees 1 CUDA device(s); valid here: auto, cpu, cuda, cuda:0"),
        (0, True, "cuda", "valid here: auto, cpu, mps"),
        (1, False, "mps", "'device' is 'mps' but this machine has no such device: "
         "torch.backends.mps.is_available() is False; valid here: auto, cpu, cuda, cuda:0"),
        (1, True, "meta", "'device': unknown device 'meta'; valid: auto, cpu, cuda, cuda:N, mps"),
        (1, True, "tpu", "'device': unknown device 'tpu'; valid: auto, cpu, cuda, cuda:N, mps"),
        (1, True, "cuda:", "unknown device 'cuda:'"),
    ],
)  # fmt: skip
def test_a_device_the_machine_lacks_is_one_line_listing_those_it_has(
    monkeypatch, cuda, mps, name, message
):
    machine(monkeypatch, cuda=cuda, mps=mps)
    with pytest.raises(ConfigError) as err:
        resolve_device(name)
    assert message in str(err.value) and "\n" not in str(err.value)


# -- dtypes under a bfloat16 base ------------------------------------------------------------


def test_lora_weights_gradients_and_adamw_state_are_float32_on_a_bfloat16_base(make_model, device):
    bf16 = make_model().to(device, torch.bfloat16)
    model = attach_adapters(bf16, ["gen", "agg"], LoraSpec(8, 16), 0)
    lora = {n: adapter_parameters(model, n) for n in ("gen", "agg")}
    lora_ids = {id(p) for params in lora.values() for p in params.values()}
    assert {p.dtype for params in lora.values() for p in params.values()} == {torch.float32}
    assert {p.device for p in model.parameters()} == {device}
    base = [p for p in model.parameters() if id(p) not in lora_ids]
    assert base and {p.dtype for p in base} == {torch.bfloat16}
    optim = AdapterOptimizers(
        {n: list(params.values()) for n, params in lora.items()},
        lr=1e-2,
        warmup=0,
        total=10,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        stepping="per-step",
    )
    ids = torch.randint(4, 60, (2, 12)).to(device)
    for name in ("gen", "agg"):
        with use_adapter(model, name):
            logits = model(input_ids=ids).logits  # (2, 12, V) in the base's dtype
            assert logits.dtype == torch.bfloat16
            logits.float().logsumexp(-1).mean().backward()
        assert {p.grad.dtype for p in lora[name].values()} == {torch.float32}
        assert optim.update(name) > 0
        state = optim.optimizers[name].state
        moments = [v for s in state.values() for k, v in s.items() if k != "step"]
        assert moments and {v.dtype for v in moments} == {torch.float32}
        snapshot = optim.snapshot(name)  # the non-finite guard's copy keeps dtype and device
        assert {w.dtype for w in snapshot["weights"]} == {torch.float32}
        assert {w.device for w in snapshot["weights"]} == {device}


def make_turn(prompt: list[int], completion: list[int]) -> Turn:
    return Turn(
        role="generator",
        slot=0,
        round=0,
        adapter="gen",
        prompt_text="",
        completion_text="",
        prompt_ids=prompt,
        completion_ids=completion,
        sampler_logprobs=[0.0] * len(completion),
        finish_reason="stop",
    )


def test_scored_logprobs_and_entropies_are_float32_arithmetic_on_bfloat16_logits(
    make_model, device
):
    """The scorer's log-probs equal a float64 log-softmax of the same bfloat16 logits within
    1e-5; a bfloat16 log-softmax is off by up to ~1e-2 (its step at |logp| ~ 2 is 1/64)."""
    bf16 = make_model(seed=1).to(device, torch.bfloat16)
    model = attach_adapters(bf16, ["gen"], LoraSpec(8, 16), 0)
    prompt, completion = [5, 17, 9, 30, 12], [40, 8, 22, 3]
    turn = make_turn(prompt, completion)
    rows = CreditRows([0], [0], ["generator"], [0], [0], [0.0], [None])
    batch = build_batches([turn], rows, torch.zeros(1), pad_id=0, device=device)["gen"]
    with torch.no_grad():
        (_, scored), *_ = score_rows(model, batch, [0], temperature=0.7, micro_tokens=1000)
        ids = torch.tensor([prompt + completion], device=device)
        logits = model(input_ids=ids).logits[0]  # (S, V) bf16
    assert logits.dtype == torch.bfloat16
    assert scored.logp.dtype == scored.entropy.dtype == torch.float32
    assert scored.logp.device == device
    z = logits[len(prompt) - 1 : -1].double() / 0.7  # (L, V) the logits of the completion
    taken = torch.tensor(completion, device=device)[:, None]
    want = torch.log_softmax(z, -1).gather(-1, taken)[:, 0]
    entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(scored.logp[0].double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(scored.entropy[0].double(), entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype, temperature", [(torch.float32, 0.7), (torch.bfloat16, 1.0)])
def test_a_frozen_heads_slopes_give_float64s_gradient_on_the_device(
    device, dtype, temperature, monkeypatch
):
    """The LM head's chunks on the device, frozen as LoRA leaves it (37 tokens in chunks of 5, a
    vocabulary of 1,000): log-probs, entropies and the hidden state's gradient through the
    forward's slopes, eager and, on CUDA, compiled (``marlow.models.compiled_head``: inductor's
    own kernels there), against float64 on the CPU (the CPU's compiled head is held to its eager
    one in tests/unit/test_head_chunks.py). Float32 within round-off; bfloat16 within a rounding
    of its logits (log-probs) and of the largest slope (the gradient)."""
    from marlow import models
    from marlow.algo.estimators import head_logprobs_and_entropy

    gen = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 1000
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) * 0.3).to(dtype)
    bias = torch.randn(v, generator=gen).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    exact = hidden.double().requires_grad_()
    z = torch.nn.functional.linear(exact, weight.double(), bias.double()) / temperature
    logp = torch.log_softmax(z, -1)
    (logp.gather(-1, targets[:, None])[:, 0] * upstream.double()).sum().backward()
    want_logp = logp.gather(-1, targets[:, None])[:, 0].detach()
    want_ent = -(logp.exp() * logp).sum(-1).detach()
    largest = float(exact.grad.abs().max())
    assert largest > 0.5  # a real gradient
    monkeypatch.setattr(models, "_COMPILED_HEAD", [])  # compiled anew, its fallbacks counted
    monkeypatch.setattr(models, "_GAVE_UP", [])
    ways = {"eager": None}
    if device.type == "cuda":
        ways["compiled"] = models.compiled_head()
    for way, ops in ways.items():
        leaf = hidden.to(device, copy=True).requires_grad_()
        on = [t.to(device) for t in (weight, bias, targets)]
        ours, ent = head_logprobs_and_entropy(leaf, *on, temperature, 5, ops=ops)
        (ours * upstream.to(device)).sum().backward()
        assert ours.device == leaf.grad.device == device and leaf.grad.dtype == dtype, way
        tol = 1e-5 if dtype == torch.float32 else 0.05  # bfloat16: logits under 8, steps of 2^-5
        torch.testing.assert_close(ours.cpu().double(), want_logp, atol=tol, rtol=0)
        torch.testing.assert_close(ent.cpu().double(), want_ent, atol=tol, rtol=0)
        error = float((leaf.grad.cpu().double() - exact.grad).abs().max())
        assert error <= (1e-5 if dtype == torch.float32 else 2**-7) * largest, (way, error)
    assert not models._GAVE_UP  # compiled for real, not fallen back to eager


def test_sampler_logprobs_are_float32_on_a_bfloat16_base(make_model, tokenizer, device):
    """bfloat16 log-probs would all be bfloat16 numbers; float32 arithmetic gives values that
    bfloat16 cannot hold (a float32 log-softmax of the bfloat16 logits)."""
    bf16 = make_model(seed=2).to(device, torch.bfloat16)
    model = attach_adapters(bf16, ["gen"], LoraSpec(8, 16), 0)
    reqs = [GenRequest(tokenizer.encode(p, add_special_tokens=False), "gen") for p in ("1+2=", "9")]
    out = HFEngine(model, tokenizer).generate(reqs, SamplingParams(0.8, 12, seed=3))
    logps = torch.tensor([lp for c in out for lp in c.logprobs])  # float32 from the engine
    assert len(logps) > 10
    held = logps.to(torch.bfloat16).float() == logps
    assert held.float().mean() < 0.5, logps


def test_graphed_decode_steps_sample_what_eager_steps_sample(
    make_model, tokenizer, device, monkeypatch
):
    """The fixed-shape decode step (``compile=True``): on CUDA its CUDA graphs captured and
    replayed, elsewhere the same buffers run eagerly; float32, three adapters mixed in one batch,
    spans of 8 columns (several captures a call), rows that stop and leave (compactions): the
    eager step's tokens, greedy and seeded, and log-probs within float32 round-off."""
    from marlow.rollout import lean

    roles = ("gen", "agg", "crit")
    if device.type != "cuda":
        monkeypatch.setattr(lean, "_graphs_on", lambda device: True)
    monkeypatch.setattr(lean, "SPAN_STEP", 8)
    monkeypatch.setattr(lean, "_GAVE_UP", set())
    model = attach_adapters(make_model(seed=0), roles, LoraSpec(4, 8), 0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model = model.to(device).eval()
    texts = ("1+2=", "9*9", "12-7=", "40+2", "3*", "7")
    reqs = [
        GenRequest(tokenizer.encode(t, add_special_tokens=False), roles[i % 3], seed=i)
        for i, t in enumerate(texts * 2)
    ]
    stops = [7, 11, 23]
    eager = HFEngine(model, tokenizer, stop_ids=stops, compile=False, read_every=4)
    graphed = HFEngine(model, tokenizer, stop_ids=stops, compile=True, read_every=4)
    for params in (SamplingParams(0.0, 30, seed=0), SamplingParams(1.0, 30, seed=0)):
        want, got = eager.generate(reqs, params), graphed.generate(reqs, params)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.logprobs, w.logprobs, atol=1e-4, rtol=0)
    assert {c.finish_reason for c in got} == {"stop", "length"}
    assert not lean._GAVE_UP  # neither the compiled layers nor the graphs fell back


# -- peak memory per step phase --------------------------------------------------------------


def test_peak_memory_metrics_exist_on_cuda_alone(monkeypatch):
    """On the CPU nothing is read; on CUDA each phase resets the device's peaks and reads them
    back in GiB (the CUDA calls are simulated here; a run on a GPU checks them for real:
    tests/integration/test_engine_sync.py)."""
    cpu = torch.device("cpu")
    assert start_phase(cpu) is None
    assert phase_peaks(cpu, "rollout", None) == {}
    cuda = torch.device("cuda", 1)
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", calls.append)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 2**29)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**29)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 5 * 2**30)
    start = start_phase(cuda)
    assert calls == [cuda] and start == 2**29
    assert phase_peaks(cuda, "learn", start) == {
        "memory/learn_peak_allocated_gib": 1.5,
        "memory/learn_peak_reserved_gib": 5.0,
        "memory/learn_start_allocated_gib": 0.5,
    }
