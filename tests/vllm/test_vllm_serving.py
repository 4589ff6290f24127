"""A trained workflow answering on the vLLM backend: the same greedy answers as the HF loop, and
marlow serve on vLLM, quiet (no tokenizer warning, no leaked shared memory) and leaving no
engine process behind after SIGTERM."""

from __future__ import annotations

import signal

import pytest

from marlow.serving.trained import load_workflow
from tests.e2e.test_serve import server

pytestmark = pytest.mark.vllm
openai = pytest.importorskip("openai")

VLLM = ["rollout.backend=vllm", "rollout.vllm.kv_cache_gib=0.25", "rollout.vllm.cpu_threads=1"]
QUESTIONS = ["12*7", "59+19", "88-9", "4*21"]


def engine_processes() -> list[str]:
    import psutil

    return [p.name() for p in psutil.process_iter(["name"]) if p.name().startswith("VLLM")]


def test_vllm_answers_like_the_hf_loop_at_temperature_0(trained_voting):
    with load_workflow(trained_voting) as wf:
        want = [a.text for a in wf.answer(QUESTIONS, temperature=0)]
    with load_workflow(trained_voting, VLLM) as wf:
        assert wf.config.rollout.backend == "vllm"
        got = [a.text for a in wf.answer(QUESTIONS, temperature=0)]
    assert got == want
    assert engine_processes() == []


def test_marlow_serve_on_vllm_is_quiet_and_leaves_nothing_behind(trained_voting):
    with load_workflow(trained_voting) as wf:
        want = wf.answer("12*7", temperature=0).text
    with server(trained_voting, *VLLM) as (proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="voting", messages=[{"role": "user", "content": "12*7"}], temperature=0
        )
        assert reply.choices[0].message.content == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        said = proc.stdout.read() + proc.stderr.read()  # vLLM logs to stdout
    for noise in ("Tokenizer not available", "leaked shared_memory", "Traceback"):
        assert noise not in said, said
    assert engine_processes() == []
