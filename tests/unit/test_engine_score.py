"""``HFEngine.score``: teacher-forced log-probs of given completions, the same
definition ``generate`` records, under each request's adapter."""

from __future__ import annotations

import pytest
import torch

from marlow.policy.adapters import active_adapter, attach_adapters, use_adapter
from marlow.rollout.hf import HFEngine
from marlow.types import BASE, GenRequest, SamplingParams
from tests.unit.test_rollout_hf import SPEC, encode, perturb_lora_b


@pytest.fixture
def engine(make_model, tokenizer) -> HFEngine:
    model = attach_adapters(make_model(seed=0), ["gen", "agg"], SPEC, seed=0)
    perturb_lora_b(model, "gen", seed=1)
    perturb_lora_b(model, "agg", seed=2)
    return HFEngine(model, tokenizer)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_score_gives_back_what_generate_recorded(engine, tokenizer, temperature):
    prompts = [encode(tokenizer, "what is 7-5?"), encode(tokenizer, "2+2=")]
    requests = [
        GenRequest(prompts[0], "gen"),
        GenRequest(prompts[1], "agg"),
        GenRequest(prompts[0], BASE),
    ]
    sampled = engine.generate(requests, SamplingParams(temperature, 12, seed=3))
    scored = engine.score(requests, [c.token_ids for c in sampled], temperature)
    for comp, logp in zip(sampled, scored, strict=True):
        assert len(logp) == len(comp.token_ids) > 0
        # generate reads them off a batched, cached decode; score does one full forward
        torch.testing.assert_close(
            torch.tensor(logp), torch.tensor(comp.logprobs), atol=1e-5, rtol=0
        )


def test_score_uses_the_request_adapter_and_restores_the_active_one(engine, tokenizer):
    prompt, completion = encode(tokenizer, "3*4="), encode(tokenizer, "12")
    with use_adapter(engine.model, "agg"):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        gen, agg = engine.score(
            [GenRequest(prompt, "gen"), GenRequest(prompt, "agg")], [completion, completion], 0.0
        )
        assert active_adapter(engine.model) == "agg"
    assert agg == ref.tolist()  # one unpadded forward, as here: bit for bit
    assert gen != agg


def test_score_refuses_mismatched_or_unknown_input(engine, tokenizer):
    prompt = encode(tokenizer, "1+1=")
    with pytest.raises(ValueError, match="1 requests but 2 completions"):
        engine.score([GenRequest(prompt, "gen")], [[5], [6]], 1.0)
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        engine.score([GenRequest(prompt, "nope")], [[5]], 1.0)
