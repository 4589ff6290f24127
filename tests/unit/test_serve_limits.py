"""The server's limits and failure modes, against a stand-in workflow (an engine whose calls can
be held, made to fail, and counted): errors in OpenAI's JSON shape for every status, engine
faults apart from client errors, the body limit, max_tokens within its bound and the context,
the bounded queue (503 with Retry-After), the per-request deadline, a client that leaves, /health
when the batching worker is dead, the API key compared in constant time, the usage chunk only on
request, and tokenising off the event loop."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from marlow.serving import server  # noqa: E402
from marlow.serving.limits import Limits  # noqa: E402
from marlow.serving.trained import Answer  # noqa: E402


class Tokenizer:
    """One token a word; records the threads it ran in."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        self.threads.append(threading.current_thread().name)
        return {"input_ids": text.split()}

    def __deepcopy__(self, memo) -> Tokenizer:
        return self  # one record of threads for the test to read


class Stand:
    """A stand-in TrainedWorkflow: ``hold`` keeps engine calls waiting until set, ``fail``
    makes them raise, ``calls`` lists the questions of each."""

    name = "stand"

    def __init__(self, positions: int | None = None) -> None:
        self.config = SimpleNamespace(rollout=SimpleNamespace(max_batch=8, max_new_tokens=16))
        self.positions = positions
        self.tokenizer = Tokenizer()
        self.calls: list[list[str]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.fail: Exception | None = None
        self.characters: str | None = None  # None: reads any text

    def unreadable(self, question: str) -> str:
        return (
            "" if self.characters is None else "".join(sorted(set(question) - set(self.characters)))
        )

    def answer(self, questions, *, trace, temperature, max_new_tokens, seed):
        self.calls.append(list(questions))
        self.hold.wait(30)
        if self.fail is not None:
            raise self.fail
        return [Answer(q, f"it is {q}", 3, 2, "stop", [] if trace else None) for q in questions]

    def close(self) -> None:
        pass


def ask(question: str = "1 + 1", **extra) -> dict:
    return {"model": "stand", "messages": [{"role": "user", "content": question}], **extra}


def client_for(stand: Stand, quiet: bool = True, **limits) -> TestClient:
    app = server.create_app(stand, limits=Limits(**limits), quiet=quiet)
    return TestClient(app, raise_server_exceptions=False)


def is_openai_error(reply, status: int, param: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


def wait_until(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def in_thread(call) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("reply", call()))
    thread.start()
    return thread, out


def test_an_engine_fault_is_a_json_500_and_the_server_goes_on():
    stand = Stand()
    with client_for(stand) as client:
        stand.fail = ValueError("the engine lost its adapters")
        error = is_openai_error(client.post("/v1/chat/completions", json=ask()), 500)
        assert error["type"] == "server_error" and error["code"] == "engine_error"
        assert "the engine lost its adapters" in error["message"]
        stand.fail = None
        assert client.post("/v1/chat/completions", json=ask()).status_code == 200


def test_any_fault_of_the_server_is_a_json_500(monkeypatch):
    def broken(*args):
        raise KeyError("a bug")

    monkeypatch.setattr(server, "parse_chat", broken)
    with client_for(Stand()) as client:
        error = is_openai_error(client.post("/v1/chat/completions", json=ask()), 500)
        assert error["type"] == "server_error" and "KeyError" in error["message"]
        assert client.get("/health").status_code == 200


def test_a_body_over_the_limit_is_a_413_declared_or_streamed():
    stand = Stand()
    with client_for(stand, max_body_bytes=1000) as client:
        big = json.dumps(ask("x " * 2000)).encode()
        is_openai_error(client.post("/v1/chat/completions", content=big), 413)

        def chunks():  # no content-length: read until the limit passes
            for i in range(0, len(big), 100):
                yield big[i : i + 100]

        is_openai_error(client.post("/v1/chat/completions", content=chunks()), 413)
        assert client.post("/v1/chat/completions", json=ask()).status_code == 200
    assert stand.calls == [["1 + 1"]]


def test_deep_json_odd_text_and_odd_numbers_are_400s():
    with client_for(Stand()) as client:
        deep = b"[" * 100_000 + b"]" * 100_000
        is_openai_error(client.post("/v1/chat/completions", content=deep), 400)
        surrogate = json.dumps(ask()).replace("1 + 1", "\\ud800").encode()
        is_openai_error(client.post("/v1/chat/completions", content=surrogate), 400, "messages")
        for field, value in [
            ("temperature", "NaN"),
            ("temperature", "1e999"),
            ("max_tokens", "1" + "0" * 400),
            ("seed", "-1"),
            ("n", "1.5"),
        ]:
            body = json.dumps(ask())[:-1] + f', "{field}": {value}}}'
            reply = client.post("/v1/chat/completions", content=body.encode())
            is_openai_error(reply, 400, field)


@pytest.mark.parametrize(
    "extra",
    [
        {"stop": []}, {"stop": None}, {"tools": []}, {"tool_choice": "none"},
        {"response_format": {"type": "text"}}, {"logit_bias": {}}, {"logprobs": None},
        {"top_p": 1.0}, {"presence_penalty": 0.0}, {"modalities": ["text"]},
        {"n": None}, {"stream": None}, {"trace": None}, {"seed": None}, {"max_tokens": None},
    ],
)  # fmt: skip
def test_a_field_sent_null_or_at_its_off_value_is_accepted(extra):
    """What clients send for settings they were not given: null, or the empty default."""
    with client_for(Stand()) as client:
        reply = client.post("/v1/chat/completions", json=ask(**extra))
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["choices"]) == 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": ["x"]}, "stop"), ({"stop": "x"}, "stop"), ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"), ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": True}, "logprobs"), ({"top_p": 0.9}, "top_p"), ({"top_p": True}, "top_p"),
        ({"presence_penalty": False}, "presence_penalty"), ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {}}, "audio"),
    ],
)  # fmt: skip
def test_a_setting_marlow_cannot_honour_is_a_400_naming_it(extra, param):
    with client_for(Stand()) as client:
        error = is_openai_error(client.post("/v1/chat/completions", json=ask(**extra)), 400, param)
        assert f"{param} is not supported" in error["message"]


def test_max_tokens_is_bounded_by_the_limit_and_the_context():
    with client_for(Stand(positions=100), max_tokens=64) as client:
        post = lambda body: client.post("/v1/chat/completions", json=body)  # noqa: E731
        error = is_openai_error(post(ask(max_tokens=65)), 400, "max_tokens")
        assert "from 1 to 64" in error["message"]
    with client_for(Stand(positions=100), max_tokens=1000) as client:
        post = lambda body: client.post("/v1/chat/completions", json=body)  # noqa: E731
        question = "w " * 50  # 50 tokens: 50 left for new ones
        error = is_openai_error(post(ask(question, max_tokens=60)), 400, "max_tokens")
        assert "at most 50" in error["message"]
        assert post(ask(question, max_tokens=50)).status_code == 200
        error = is_openai_error(post(ask("w " * 95)), 400, "messages")  # beside the default 16
        assert error["code"] == "context_length_exceeded"


@contextmanager
def engine_held(**limits):
    """A server whose engine is held by a first request ("a"), in a thread until released:
    yields (stand, client, post, that thread, its reply box)."""
    stand = Stand()
    stand.hold.clear()
    with client_for(stand, **limits) as client:
        post = lambda body: client.post("/v1/chat/completions", json=body)  # noqa: E731
        first, one = in_thread(lambda: post(ask("a")))
        wait_until(lambda: len(stand.calls) == 1)  # in the engine: the queue is empty again
        try:
            yield stand, client, post, first, one
        finally:
            stand.hold.set()


def test_a_full_queue_answers_503_with_retry_after_at_once():
    with engine_held(max_waiting=2) as (stand, client, post, first, one):
        second, two = in_thread(lambda: post(ask("b", n=2)))
        wait_until(lambda: client.get("/health").json()["waiting"] == 2)
        full = post(ask("c"))
        error = is_openai_error(full, 503)
        assert error["code"] == "overloaded" and full.headers["retry-after"] == "1"
        stand.hold.set()
        first.join(10)
        second.join(10)
    assert one["reply"].status_code == 200 and two["reply"].status_code == 200
    assert stand.calls == [["a"], ["b", "b"]]


def test_a_request_past_its_deadline_is_a_503_and_costs_no_engine_call_if_not_started():
    with engine_held(timeout_s=0.5) as (stand, client, post, first, one):
        late = post(ask("b"))  # queued behind the held call until its deadline
        assert is_openai_error(late, 503)["code"] == "timeout"
        first.join(10)
        assert is_openai_error(one["reply"], 503)["code"] == "timeout"
        stand.hold.set()
        wait_until(lambda: client.get("/health").json()["waiting"] == 0)
        assert client.post("/v1/chat/completions", json=ask("c")).status_code == 200
        batcher = client.app.state.batcher
    assert stand.calls == [["a"], ["c"]] and batcher.dropped == 1


def test_a_client_that_leaves_is_dropped_before_its_engine_call():
    stand = Stand()
    stand.hold.clear()
    app = server.create_app(stand, quiet=True)
    with TestClient(app) as client:
        first, _ = in_thread(lambda: client.post("/v1/chat/completions", json=ask("a")))
        wait_until(lambda: len(stand.calls) == 1)
        body = json.dumps(ask("b")).encode()
        sent: list[dict] = []

        async def leaving() -> None:
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict:  # the body, then the client is gone
                return messages.pop() if messages else {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {
                "type": "http", "method": "POST", "path": "/v1/chat/completions",
                "headers": [(b"content-type", b"application/json")], "query_string": b"",
                "http_version": "1.1", "scheme": "http", "server": ("test", 80),
                "client": ("test", 1), "root_path": "", "raw_path": b"/v1/chat/completions",
            }  # fmt: skip
            await app(scope, receive, send)

        client.portal.call(leaving)  # returns once the request gave up
        stand.hold.set()
        first.join(10)
        wait_until(lambda: app.state.batcher.dropped == 1)
    assert stand.calls == [["a"]]


def test_health_fails_when_the_batching_worker_is_dead():
    with client_for(Stand()) as client:
        assert client.get("/health").status_code == 200
        task = client.app.state.batcher._task
        client.portal.call(lambda: task.cancel())
        wait_until(task.done)
        assert is_openai_error(client.get("/health"), 503)["code"] == "worker_stopped"


def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    compared = []
    real = server.secrets.compare_digest
    monkeypatch.setattr(
        server.secrets, "compare_digest", lambda a, b: compared.append(1) or real(a, b)
    )
    app = server.create_app(Stand(), api_key="s3cret", quiet=True)
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401
        headers = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=headers).status_code == 200
        assert client.get("/health").status_code == 200  # no key needed
    assert len(compared) == 2


def test_a_stream_ends_with_usage_only_when_asked():
    def chunks(reply) -> list:
        lines = [line for line in reply.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line[6:]) for line in lines[:-1]]

    with client_for(Stand()) as client:
        post = lambda body: client.post("/v1/chat/completions", json=body)  # noqa: E731
        plain = chunks(post(ask(stream=True)))
        assert all(c["choices"] for c in plain)  # choices[0] is there in every chunk
        usage = chunks(post(ask(stream=True, stream_options={"include_usage": True})))
        assert usage[-1]["choices"] == [] and usage[-1]["usage"]["total_tokens"] == 5
        is_openai_error(post(ask(stream_options={"include_usage": True})), 400, "stream_options")
        is_openai_error(post(ask(stream=True, stream_options=[1])), 400, "stream_options")


def test_the_question_is_tokenised_once_off_the_event_loop():
    stand = Stand()
    with client_for(stand) as client:
        assert client.post("/v1/chat/completions", json=ask("two words")).status_code == 200
    assert len(stand.tokenizer.threads) == 1
    assert stand.tokenizer.threads[0].startswith("marlow-parse")


def test_characters_the_model_cannot_read_are_a_400_naming_them():
    stand = Stand()
    stand.characters = "0123456789+ "
    with client_for(stand) as client:
        error = is_openai_error(
            client.post("/v1/chat/completions", json=ask("12+13+é")), 400, "messages"
        )
        assert error["code"] == "unsupported_characters" and "'é'" in error["message"]
        assert client.post("/v1/chat/completions", json=ask("12+13")).status_code == 200
    assert stand.calls == [["12+13"]]


def test_one_access_line_per_request_unless_quiet(capsys):
    for quiet in (False, True):
        with client_for(Stand(), quiet=quiet) as client:
            client.post("/v1/chat/completions", json=ask())
            client.get("/nope")
        lines = [ln for ln in capsys.readouterr().err.splitlines() if "marlow serve:" in ln]
        if quiet:
            assert lines == []
        else:
            assert len(lines) == 2
            assert " POST /v1/chat/completions 200 " in lines[0] and lines[0].endswith(" s")
            assert " GET /nope 404 " in lines[1]
