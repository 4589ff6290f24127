"""A real ``marlow serve`` under abuse: a few hundred generated malformed and borderline requests
(wrong types, huge, negative and non-finite numbers, unicode, empty and missing fields, oversized
and bad bodies, wrong methods and paths), each answered with a 4xx JSON error in OpenAI's shape
or a valid reply, the server answering a good request all along; and more concurrent clients
than its queue holds, each answered or refused with a 503 before its deadline."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from urllib.parse import urlsplit

from tests.e2e.test_serve import ask, server

GOOD = ask("12+30", temperature=0, max_tokens=4)
FIELDS = ("model", "messages", "temperature", "max_tokens", "n", "seed", "stream", "trace",
          "stream_options", "max_completion_tokens", "top_p", "stop")  # fmt: skip
ODD = [None, True, False, 0, -1, 1.5, -(10**30), 10**400, "", "x", "\u0000", "😀" * 50, [], {},
       [1, 2], {"a": 1}, "NaN", 2**63, -0.0, "1"]  # fmt: skip
TEXTS = ["", " ", "\u0000", "\ud800", "مرحبا", "😀" * 200, "a" * 5000, "\n\t", "12+30"]
RAW = [b"", b"{", b"{}", b"[]", b"null", b"\xff\xfe", b'{"model": "voting"} trailing',
       b"[" * 5000 + b"]" * 5000, b'{"model": NaN}', b'{"messages": Infinity}', b"\x00" * 64]  # fmt: skip


def cases(seed: int = 0, count: int = 300) -> list[tuple[str, str, bytes, dict]]:
    """(method, path, body, headers) of ``count`` generated requests, the same for one seed."""
    rng = random.Random(seed)
    out = []
    chat = "/v1/chat/completions"
    for _ in range(count):
        kind = rng.randrange(7)
        body, method, path, headers = b"", "POST", chat, {"content-type": "application/json"}
        if kind == 0:  # one field of a good request set to an odd value
            request = dict(GOOD)
            request[rng.choice(FIELDS)] = rng.choice(ODD)
            body = json.dumps(request).encode()
        elif kind == 1:  # a field left out, or several odd ones
            request = dict(GOOD)
            for key in rng.sample(FIELDS, rng.randint(1, 4)):
                if rng.random() < 0.5:
                    request.pop(key, None)
                else:
                    request[key] = rng.choice(ODD)
            body = json.dumps(request).encode()
        elif kind == 2:  # odd messages
            content = rng.choice(TEXTS + ODD[:6] + [[{"type": "image_url"}], [{"type": "text"}]])
            role = rng.choice(["user", "system", "assistant", "", None, 5])
            body = json.dumps(ask("1", messages=[{"role": role, "content": content}])).encode()
        elif kind == 3:  # bodies that are not JSON, or not the right JSON
            body = rng.choice(RAW)
        elif kind == 4:  # bodies over the limit
            body = json.dumps(ask("9 " * rng.randint(40_000, 200_000))).encode()
        elif kind == 5:  # wrong methods and paths
            method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "POST"])
            path = rng.choice([chat, "/v1/nope", "/v1/models/x", "/../etc/passwd", "/v1//chat",
                               "/" + "a" * 3000, "/health?x=" + "%" * 10])  # fmt: skip
            body = json.dumps(GOOD).encode() if method != "GET" else b""
        else:  # odd headers
            headers = rng.choice([{"content-type": "text/plain"}, {"content-type": ""},
                                  {"authorization": "Bearer \u00e9".encode().decode("latin-1")},
                                  {"content-type": "application/json; charset=utf-16"}])  # fmt: skip
            body = json.dumps(GOOD).encode()
        out.append((method, path, body, headers))
    return out


def send(url: str, method: str, path: str, body: bytes, headers: dict, timeout: float = 60):
    """(status, headers, body) of one raw HTTP request; None where the server hung up."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(method, path, body=body or None, headers=headers)
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    except (ConnectionError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def good(url: str) -> bool:
    got = send(url, "POST", "/v1/chat/completions", json.dumps(GOOD).encode(),
               {"content-type": "application/json"})  # fmt: skip
    return got is not None and got[0] == 200 and json.loads(got[2])["choices"][0]["message"]


def test_generated_bad_requests_get_json_errors_and_the_server_keeps_answering(trained_voting):
    with server(trained_voting, "--max-body-bytes", "65536", "--quiet") as (proc, url):
        statuses: dict[int, int] = {}
        for i, (method, path, body, headers) in enumerate(cases()):
            got = send(url, method, path, body, headers)
            assert got is not None, (i, method, path, body[:80])
            status, _, raw = got
            statuses[status] = statuses.get(status, 0) + 1
            reply = json.loads(raw)  # JSON, whatever the status
            if status == 200:
                assert reply.get("choices") or reply.get("data") or reply.get("status"), reply
            else:
                assert 400 <= status < 500, (i, status, reply)
                assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
            models = send(url, "GET", "/v1/models", b"", {})  # through the app after each one
            assert models is not None and models[0] == 200, (i, method, path, body[:80])
            if i % 10 == 0:
                assert good(url), (i, method, path, body[:80])
        assert good(url)
        assert proc.poll() is None
    errors = proc.stderr.read()
    assert "Traceback" not in errors, errors[-2000:]
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > 150, statuses


def test_more_clients_than_the_queue_holds_get_a_reply_or_a_503_in_time(trained_voting):
    waiting, timeout_s = 4, 60
    args = (
        "--max-waiting",
        str(waiting),
        "--timeout-s",
        str(timeout_s),
        "rollout.max_new_tokens=96",
    )
    with server(trained_voting, *args) as (proc, url):
        results: list = []

        def one(question: str, n: int = 1) -> None:
            t0 = time.monotonic()
            body = json.dumps(ask(question, temperature=1.0, n=n)).encode()
            got = send(url, "POST", "/v1/chat/completions", body,
                       {"content-type": "application/json"}, timeout=timeout_s + 30)  # fmt: skip
            results.append((got, time.monotonic() - t0))

        busy = threading.Thread(target=one, args=("12*7", 16))  # holds the engine a while
        busy.start()
        time.sleep(0.5)
        clients = [threading.Thread(target=one, args=(f"{i}+1",)) for i in range(4 * waiting)]
        for t in clients:
            t.start()
        for t in [busy, *clients]:
            t.join(timeout_s + 60)
        assert proc.poll() is None
    assert len(results) == 4 * waiting + 1
    statuses = sorted(got[0] for got, _ in results if got is not None)
    assert len(statuses) == len(results)  # nobody was left without a reply
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses, statuses
    assert all(seconds < timeout_s + 5 for _, seconds in results)
    for got, _ in results:
        if got[0] == 503:
            assert got[1].get("retry-after") == "1" or got[1].get("Retry-After") == "1"
