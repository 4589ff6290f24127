"""marlow serve as a user meets it: a real server process on a free port, talked to with the
official openai client (and raw HTTP for what a client would never send), its errors, its
batching of concurrent requests, and its shutdown on SIGINT and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

openai = pytest.importorskip("openai")

from marlow.serving.trained import load_workflow  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(run, *args: str, api_key: str | None = None):
    """``marlow serve RUN`` in its own process; yields (process, base URL) once /health answers."""
    port = free_port()
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("MARLOW_API_KEY", None)
    if api_key is not None:
        env["MARLOW_API_KEY"] = api_key
    proc = subprocess.Popen(
        [sys.executable, "-m", "marlow", "serve", str(run), "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise AssertionError(f"the server exited: {proc.stderr.read()}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=body,
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def ask(question: str, **extra) -> dict:
    return {"model": "voting", "messages": [{"role": "user", "content": question}], **extra}


def test_the_openai_client_gets_the_workflows_answer_usage_and_turns(trained_voting):
    with load_workflow(trained_voting) as wf:
        want = wf.answer(["12*7", "59+19"], temperature=0, trace=True)
    with server(trained_voting) as (proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["voting"]
        reply = client.chat.completions.create(
            model="voting",
            messages=[
                {"role": "system", "content": "ignored: the roles have their own prompts"},
                {"role": "user", "content": "12*7"},
            ],
            temperature=0,
        )
        assert reply.choices[0].message.content == want[0].text
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.prompt_tokens == want[0].prompt_tokens
        assert reply.usage.completion_tokens == want[0].completion_tokens
        assert reply.usage.total_tokens == want[0].prompt_tokens + want[0].completion_tokens
        traced = client.chat.completions.create(
            model="voting",
            messages=[{"role": "user", "content": "59+19"}],
            temperature=0,
            extra_body={"trace": True},
        )
        turns = traced.choices[0].model_extra["turns"]
        assert [t["role"] for t in turns] == ["generator"] * 3 + ["aggregator"]
        assert turns == want[1].turns
        several = client.chat.completions.create(
            model="voting", messages=[{"role": "user", "content": "12*7"}], n=3, temperature=0
        )
        assert [c.message.content for c in several.choices] == [want[0].text] * 3
        assert several.usage.completion_tokens == 3 * want[0].completion_tokens
        stream = client.chat.completions.create(
            model="voting", messages=[{"role": "user", "content": "12*7"}], temperature=0,
            stream=True,
        )  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == want[0].text


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(trained_voting):
    with server(trained_voting) as (proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        cases = [
            (b"{not json", 400, "not valid JSON"),
            (json.dumps({"model": "voting", "messages": []}).encode(), 400, "messages"),
            (json.dumps({"model": "voting"}).encode(), 400, "messages"),
            (json.dumps(ask("1+1", model="gpt-4")).encode(), 404, "'gpt-4' is not served"),
            (json.dumps(ask("1+1", top_p=0.5)).encode(), 400, "top_p is not supported"),
            (json.dumps(ask("1+1", n=0)).encode(), 400, "n must be"),
            (json.dumps(ask("1+1", temperature=-1)).encode(), 400, "temperature must be"),
            (json.dumps(ask("1+1", max_tokens=0)).encode(), 400, "max_tokens must be"),
            (json.dumps(ask("9" * 600)).encode(), 400, "context"),
            (json.dumps([1, 2]).encode(), 400, "JSON object"),
        ]
        for body, status, message in cases:
            got, reply = post(url, body)
            assert got == status, (body[:60], reply)
            assert set(reply["error"]) == {"message", "type", "param", "code"}
            assert message in reply["error"]["message"], reply
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "1"}]
            )
        with pytest.raises(openai.BadRequestError, match="stop is not supported"):
            client.chat.completions.create(
                model="voting", messages=[{"role": "user", "content": "1"}], stop=["x"]
            )
        reply = client.chat.completions.create(
            model="voting", messages=[{"role": "user", "content": "1+1"}]
        )
        assert reply.choices[0].message.content  # still serving
        assert proc.poll() is None


def test_an_api_key_is_checked_on_every_request(trained_voting):
    with server(trained_voting, api_key="s3cret") as (_proc, url):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        status, reply = post(url, json.dumps(ask("1+1")).encode())
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret")
        assert [m.id for m in client.models.list().data] == ["voting"]


def test_concurrent_requests_share_engine_batches(trained_voting):
    questions = [f"{a}+{b}" for a in range(10, 14) for b in range(3, 7)]  # 16
    with load_workflow(trained_voting) as wf:
        want = {
            q: a.text for q, a in zip(questions, wf.answer(questions, temperature=0), strict=True)
        }
    with server(trained_voting) as (_proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        got: dict[str, str] = {}

        def one(q: str) -> None:
            r = client.chat.completions.create(
                model="voting", messages=[{"role": "user", "content": q}], temperature=0
            )
            got[q] = r.choices[0].message.content

        threads = [threading.Thread(target=one, args=(q,)) for q in questions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        batches = json.loads(urllib.request.urlopen(f"{url}/health").read())["batches"]
    assert got == want  # greedy answers do not depend on what shares their batch
    assert 1 <= batches < len(questions)  # requests arriving together went through together


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_drains_answering_the_request_in_flight_and_refusing_new_ones(trained_voting, sig):
    with server(trained_voting, "rollout.max_new_tokens=96") as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps(ask("12*7", temperature=0, n=16)).encode()
        # in flight: its headers are in, its body is still coming when the signal arrives
        held = socket.create_connection(("127.0.0.1", port), timeout=60)
        held.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body[:10]
        )
        time.sleep(0.3)
        proc.send_signal(sig)
        time.sleep(0.2)
        late, said = post(url, json.dumps(ask("1+1")).encode())  # arrives while it stops
        held.sendall(body[10:])
        reply = b""
        while chunk := held.recv(65536):
            reply += chunk
        held.close()
        assert proc.wait(timeout=60) == 0
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert len(json.loads(payload)["choices"]) == 16
        assert late == 503 and said["error"]["code"] == "shutting_down"
        err = proc.stderr.read()
        assert "Traceback" not in err, err
        assert "stopping: answering the 1 request(s) in flight" in err, err[-600:]
        assert "1 request(s) were answered and 1 told 503" in err


def test_a_port_in_use_is_one_line_before_the_model_loads(trained_voting):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "marlow", "serve", str(trained_voting), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": "300"},
        )
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()  # no line of the model's loading, no "serving"
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there (")
    assert "in use" in lines[0]


def test_port_0_serves_on_a_port_the_system_picks_and_says_which(trained_voting):
    proc = subprocess.Popen(
        [sys.executable, "-m", "marlow", "serve", str(trained_voting), "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    )
    try:
        said = next(line for line in iter(proc.stderr.readline, "") if "serving" in line)
        url = said.split(" on ")[-1].strip()
        port = int(url.removesuffix("/v1").rsplit(":", 1)[1])
        assert port > 0 and url == f"http://127.0.0.1:{port}/v1", said
        for _ in range(600):  # it listens once uvicorn has started
            try:
                with urllib.request.urlopen(f"{url.removesuffix('/v1')}/health", timeout=1) as r:
                    assert json.loads(r.read())["status"] == "ok"
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        else:
            raise AssertionError(f"nothing answered on {url}")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
