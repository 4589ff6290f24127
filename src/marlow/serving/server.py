"""``marlow serve``: a trained workflow behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

Endpoints:

* ``GET /v1/models``: the one workflow served, by name (``voting``, or the bundle's name);
* ``POST /v1/chat/completions``: the last ``user`` message is the problem; the answer is the
  workflow's final answer, as the assistant's message. ``usage`` counts every role's tokens
  (prompt and completion of every turn of every choice). ``temperature``, ``max_tokens`` (or
  ``max_completion_tokens``), ``seed`` and ``n`` are honoured (``n`` answers sample the workflow
  ``n`` times in one batch); ``stream: true`` streams the final answer as one chunk, then the
  end (the workflow has no answer before its last stage). A body with ``"trace": true`` (the
  ``openai`` client's ``extra_body``) gets each choice's turns (role, slot, round, adapter,
  prompt, completion) under ``choices[i].turns``. Settings marlow does not have (``top_p`` other
  than 1, ``stop``, ``tools``, ``logprobs``, penalties...) are refused with a 400 naming them,
  but not their "off" values (:data:`UNSUPPORTED`: ``stop: []``, ``tools: []``,
  ``response_format: {"type": "text"}``...), and a field sent as null reads as not sent;
  ``model`` must be the served name;
* ``GET /health``: ``{"status": "ok", "model": ..., "batches": ..., "waiting": ...}``, or a 503
  error when the batching worker has stopped (the server then answers no question).

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: a 4xx status
for a bad request (malformed JSON, no messages, an unknown model, a prompt or ``max_tokens``
past the model's context, a missing or wrong API key, a body over the limit), a 503 with
``Retry-After`` when the server is full or a request waited past its deadline, and a 500 for a
fault of the server or the workflow (type ``server_error``; one line on stderr), after which the
server keeps serving. Concurrent requests go through :class:`marlow.serving.batcher.Batcher`.
Stopping (SIGINT or SIGTERM) drains: the requests in flight are answered, and for at least
:data:`DRAIN_S` the server keeps accepting connections and answers every new request with a 503
``shutting_down`` (``Retry-After``, ``Connection: close``), so a client that was already
connecting is told rather than cut off; then uvicorn stops and the engine is closed. A second
signal stops at once. One line on stderr says the drain began and one what it answered.

Limits (:class:`Limits`, ``marlow serve`` options): a body of at most ``max_body_bytes`` (413
past it, read no further); ``max_tokens`` at most ``max_tokens`` and within the model's context
beside the question, where the model states it (400 naming ``max_tokens``); at most
``max_waiting`` questions waiting for the engine (503 at once past it); each request answered
within ``timeout_s`` of its arrival or given up with a 503 (dropped before its engine call where
that has not started). A request whose client disconnects while it waits is dropped likewise.
The body is parsed and the question tokenised off the event loop, in one thread with its own copy
of the tokenizer (a fast tokenizer is not safe to share between threads).

Choices of marlow: the system and earlier messages are not read (a workflow's roles have their
own prompts); ``max_tokens`` caps each turn of every role, as ``rollout.max_new_tokens`` does;
``finish_reason`` is the final answer's turn's (``stop`` or ``length``).
"""

import asyncio
import copy
import json
import secrets
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from marlow.serving.batcher import Batcher, Overloaded, Pending, Settings
from marlow.serving.limits import Limits
from marlow.serving.trained import TrainedWorkflow, question_tokens
from marlow.types import unicode_text

UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "top_p": (1,),
    "stop": ([], ""),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
}
"""Request fields marlow cannot honour, with the values that mean "off" (accepted, as is null:
a client may send a field it was not given as null, or as its empty default)."""
MAX_N = 16
POLL_S = 0.1
"""How often a waiting request checks whether its client is still there."""
RETRY_AFTER_S = 1
"""The Retry-After of a 503."""


class RequestError(Exception):
    """A failed request: its HTTP status, message and the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str = "") -> dict:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code or None}}


def error_response(err: RequestError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else None
    body = error_body(err.status, err.message, err.param, err.code)
    return JSONResponse(body, err.status, headers=headers)


DRAIN_S = 1.0
"""The least time a stopping server keeps answering new requests with a 503."""


class Drain:
    """A stopping server's state, shared by the app (:class:`_Guard`) and :func:`serve`:
    requests in flight, and since when (monotonic seconds) the server has been stopping."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.since: float | None = None
        self.refused = 0
        self.answered = 0

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()
            print(
                f"marlow serve: stopping: answering the {self.in_flight} request(s) in flight; "
                "new requests get a 503 (signal again to stop now)",
                file=sys.stderr,
            )

    def over(self) -> bool:
        """Stopping, :data:`DRAIN_S` gone and nothing in flight."""
        return (
            self.since is not None
            and time.monotonic() - self.since >= DRAIN_S
            and self.in_flight == 0
        )


class _Guard:
    """The outermost layer of the app (pure ASGI, so a waiting request still sees its client
    leave): the API key of every request but /health, compared in constant time; any exception
    the app lets through answered as a 500 in OpenAI's shape, in one line on stderr, where the
    response has not started; and, unless ``quiet``, one access line per request on stderr
    (client, method, path, status, seconds; status ``-`` where no response was sent)."""

    def __init__(self, app, api_key: str | None, drain: Drain, quiet: bool = False) -> None:
        self.app = app
        self.key = None if api_key is None else f"Bearer {api_key}".encode()
        self.drain = drain
        self.quiet = quiet

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status: int | None = None

        async def tracked(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.drain.in_flight += 1
        try:
            if self.drain.since is not None:  # stopping: a new request is told so
                self.drain.refused += 1
                await _stopping(scope, receive, tracked)
            else:
                await self._answer(scope, receive, tracked, lambda: status is not None)
                self.drain.answered += self.drain.since is not None
        finally:
            self.drain.in_flight -= 1
            if not self.quiet:
                client = (scope.get("client") or ("-",))[0]
                path = scope["path"] if len(scope["path"]) <= 200 else scope["path"][:200] + "..."
                print(
                    f"marlow serve: {client} {scope['method']} {path} {status or '-'} "
                    f"{time.perf_counter() - start:.3f} s",
                    file=sys.stderr,
                )

    async def _answer(self, scope, receive, send, started: Callable[[], bool]) -> None:
        if self.key is not None and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.key):
                err = RequestError(
                    401, "a valid API key is required (Authorization: Bearer KEY)",
                    code="invalid_api_key",
                )  # fmt: skip
                return await error_response(err)(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        except Exception as err:  # noqa: BLE001 - a fault is a 500, never a dead connection
            line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"marlow serve: {scope['path']}: {line}", file=sys.stderr)
            if not started():
                failure = RequestError(500, f"the server failed: {line}", code="server_error")
                await error_response(failure)(scope, receive, send)


async def _stopping(scope, receive, send) -> None:
    """The 503 of a request that arrived while the server stops; the connection is closed."""
    err = RequestError(503, "the server is stopping; try again shortly", code="shutting_down")
    response = error_response(err)
    response.headers["connection"] = "close"
    await response(scope, receive, send)


class _ClientGone(Exception):  # noqa: N818 - control flow, not an error
    """The client disconnected while its request waited."""


def create_app(
    workflow: TrainedWorkflow,
    *,
    api_key: str | None = None,
    limits: Limits | None = None,
    quiet: bool = False,
    drain: Drain | None = None,
):
    """The FastAPI application serving ``workflow`` (module docstring); ``drain`` is the state
    :func:`serve` stops it by."""
    limits = limits or Limits()
    batcher = Batcher(
        workflow,
        max_questions=max(workflow.config.rollout.max_batch, MAX_N),
        max_waiting=limits.max_waiting,
    )
    # one thread parses bodies and counts tokens, with a tokenizer no other thread uses
    parser = ThreadPoolExecutor(1, thread_name_prefix="marlow-parse")
    tokenizer = copy.deepcopy(workflow.tokenizer)

    def count(question: str) -> int:
        return question_tokens(tokenizer, question)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()
            parser.shutdown(wait=False)
            workflow.close()

    app = FastAPI(title="marlow", lifespan=lifespan)
    app.state.batcher = batcher
    app.add_middleware(_Guard, api_key=api_key, drain=drain or Drain(), quiet=quiet)
    fail = error_response

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, err: RequestError) -> JSONResponse:
        return fail(err)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, err: HTTPException) -> JSONResponse:
        return fail(RequestError(err.status_code, str(err.detail)))

    @app.get("/health")
    async def health():
        if not batcher.alive:
            why = "the batching worker has stopped: no question is answered; restart the server"
            return fail(RequestError(503, why, code="worker_stopped"))
        return {
            "status": "ok",
            "model": workflow.name,
            "batches": batcher.batches,
            "waiting": batcher.waiting,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(workflow)]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        arrived = asyncio.get_running_loop().time()
        raw = await _read_body(request, limits.max_body_bytes)
        loop = asyncio.get_running_loop()
        asked = await loop.run_in_executor(parser, parse_chat, raw, workflow, limits, count)
        try:
            pending = batcher.submit([asked.question] * asked.n, asked.settings)
        except Overloaded as err:
            raise RequestError(503, str(err), code="overloaded") from None
        try:
            answers = await _wait(request, pending, arrived + limits.timeout_s, limits.timeout_s)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        reply = completion(workflow, answers, asked.settings.trace)
        if not asked.stream:
            return reply
        chunks = _chunks(reply, asked.include_usage)
        return StreamingResponse(chunks, media_type="text/event-stream")

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to pass ``limit`` bytes (read no further)."""
    too_big = RequestError(
        413, f"the body is over {limit} bytes (marlow serve --max-body-bytes)", code="too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait(request: Request, pending: Pending, deadline: float, timeout_s: float) -> list:
    """``pending``'s answers; given up (its future cancelled: no engine call where its batch has
    not started) when its client leaves or ``deadline`` (the loop's clock) passes."""
    loop = asyncio.get_running_loop()
    while not pending.future.done():
        left = deadline - loop.time()
        if left <= 0:
            pending.future.cancel()
            raise RequestError(
                503,
                f"not answered within {timeout_s:g} s (marlow serve --timeout-s); the server "
                "is busy, try again",
                code="timeout",
            )
        await asyncio.wait({pending.future}, timeout=min(POLL_S, left))
        if not pending.future.done() and await request.is_disconnected():
            pending.future.cancel()
            raise _ClientGone
    if pending.future.cancelled():
        raise _ClientGone
    err = pending.future.exception()
    if err is not None:  # the workflow's fault, not the client's
        line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        print(f"marlow serve: the workflow failed to answer: {line}", file=sys.stderr)
        raise RequestError(500, f"the workflow failed to answer: {line}", code="engine_error")
    return pending.future.result()


def _model_card(workflow: TrainedWorkflow) -> dict[str, Any]:
    return {"id": workflow.name, "object": "model", "created": 0, "owned_by": "marlow"}


@dataclass(frozen=True)
class Chat:
    """What a chat request asks: the question, its sampling settings, how many answers, and
    whether they stream (with a usage chunk)."""

    question: str
    settings: Settings
    n: int
    stream: bool
    include_usage: bool


def parse_chat(
    raw: bytes, workflow: TrainedWorkflow, limits: Limits, count: Callable[[str], int]
) -> Chat:
    """A chat request's body as a :class:`Chat`, or a RequestError naming the field at fault;
    ``count`` gives the question's tokens."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        why = str(err) if isinstance(err, ValueError) else "nested too deep"
        raise RequestError(400, f"the body is not valid JSON ({why})") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    model = body.get("model")
    if model != workflow.name:
        raise RequestError(
            404,
            f"model {_short(model)} is not served here; valid: {workflow.name}",
            "model",
            "model_not_found",
        )
    for key, off in UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and not any(_same(value, o) for o in off):
            raise RequestError(
                400,
                f"{key} is not supported: a marlow workflow samples with temperature alone",
                key,
                "unsupported_parameter",
            )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", "messages")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise RequestError(400, "messages hold no user message: it is the question", "messages")
    question = _text(users[-1].get("content"))
    if not question.strip():
        raise RequestError(400, "the last user message is empty", "messages")
    odd = workflow.unreadable(question)
    if odd:
        raise RequestError(
            400,
            f"the question holds characters this model cannot read: {_short(odd)} (a tiny "
            "model reads printable ASCII and newlines)",
            "messages",
            "unsupported_characters",
        )
    temperature = _number(body, "temperature", 0.0, 2.0)
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if tokens is not None and (
        isinstance(tokens, bool)
        or not isinstance(tokens, int)
        or not 1 <= tokens <= limits.max_tokens
    ):
        raise RequestError(
            400,
            f"max_tokens must be an integer from 1 to {limits.max_tokens} "
            "(marlow serve --max-tokens)",
            "max_tokens",
        )
    n = _given(body, "n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise RequestError(400, f"n must be an integer from 1 to {MAX_N}", "n")
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63
    ):
        raise RequestError(400, "seed must be an integer from 0 to 2**63 - 1", "seed")
    stream = _given(body, "stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be true or false", "stream")
    include_usage = _stream_options(body.get("stream_options"), stream)
    trace = _given(body, "trace", False)
    if not isinstance(trace, bool):
        raise RequestError(400, "trace must be true or false", "trace")
    _within_context(workflow, count(question), tokens)
    return Chat(question, Settings(temperature, tokens, seed, trace), n, stream, include_usage)


def _given(body: dict, key: str, default: Any) -> Any:
    """``body[key]``, or ``default`` where it is absent or null (OpenAI's clients send an unset
    field as null)."""
    value = body.get(key)
    return default if value is None else value


def _same(value: Any, off: Any) -> bool:
    """Whether a request's ``value`` is the "off" value ``off``: equal, and of the same kind
    (``true`` is no ``1``, ``0`` no ``false``, whatever Python's equality says)."""
    if isinstance(off, int | float) and not isinstance(off, bool):
        return isinstance(value, int | float) and not isinstance(value, bool) and value == off
    return type(value) is type(off) and value == off


def _within_context(workflow: TrainedWorkflow, question: int, tokens: int | None) -> None:
    """A 400 where the question and the new tokens do not fit the model's context: naming
    ``max_tokens`` where the request's own value is what does not fit, else the question."""
    if workflow.positions is None:
        return
    room = workflow.positions - question  # for new tokens, beside this question
    if tokens is not None and tokens > room > 0:
        raise RequestError(
            400,
            f"max_tokens is {tokens}; this model's context holds {workflow.positions} tokens, "
            f"{question} of them the question: at most {room}",
            "max_tokens",
            "context_length_exceeded",
        )
    new = tokens or workflow.config.rollout.max_new_tokens
    if question > workflow.positions - new:
        raise RequestError(
            400,
            f"the question is {question} tokens; this model's context leaves "
            f"{max(workflow.positions - new, 0)} for a question beside {new} new tokens",
            "messages",
            "context_length_exceeded",
        )


def _stream_options(options: Any, stream: bool) -> bool:
    """Whether a streamed reply ends with a usage chunk (``stream_options.include_usage``)."""
    if options is None:
        return False
    if not stream:
        raise RequestError(
            400, "stream_options is allowed only with stream: true", "stream_options"
        )
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(usage, bool):
        raise RequestError(
            400, "stream_options must be an object whose include_usage is true or false",
            "stream_options",
        )  # fmt: skip
    return usage


def _short(value: Any, limit: int = 60) -> str:
    """``value``'s repr, cut to ``limit`` characters (an error message quotes it)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts; valid unicode
    (JSON's escapes can spell a lone surrogate, which no tokenizer takes)."""
    text = None
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content) and all(isinstance(t, str) for t in parts):
            text = "\n".join(parts)
    if text is None:
        raise RequestError(400, "a user message's content must be text", "messages")
    if not unicode_text(text):
        raise RequestError(
            400, "a user message's content is not valid unicode (a lone surrogate)", "messages"
        )
    return text


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise RequestError(400, f"{key} must be a number from {lo:g} to {hi:g}", key)
    return float(value)


def completion(workflow: TrainedWorkflow, answers: list, trace: bool) -> dict[str, Any]:
    """OpenAI's chat.completion object for ``answers`` (one per choice)."""
    prompt = sum(a.prompt_tokens for a in answers)
    done = sum(a.completion_tokens for a in answers)
    choices = []
    for i, a in enumerate(answers):
        choice: dict[str, Any] = {
            "index": i,
            "message": {"role": "assistant", "content": a.text},
            "finish_reason": "length" if a.finish == "length" else "stop",
            "logprobs": None,
        }
        if trace:
            choice["turns"] = a.turns
        choices.append(choice)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": workflow.name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
        },
    }


async def _chunks(reply: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    """The reply as server-sent chunks: each choice's answer in one delta, then its end; a last
    chunk of no choices with the usage where the request's ``stream_options`` asked for it."""
    base = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for c in reply["choices"]:
        delta = {"role": "assistant", "content": c["message"]["content"]}
        yield _event(
            {**base, "choices": [{"index": c["index"], "delta": delta, "finish_reason": None}]}
        )
        end = {"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}
        yield _event({**base, "choices": [end]})
    if include_usage:
        yield _event({**base, "choices": [], "usage": reply["usage"]})
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (port 0: one the system picks), not yet
    listening, for :func:`serve`: bound before the model loads, so that a port in use or an
    address not of this machine is one line (a ValueError naming ``--host``/``--port``) before
    anything is loaded, never a server that says it serves and then cannot. As uvicorn binds:
    IPv6 where the host has a colon, ``SO_REUSEADDR`` (a restarted server takes its port back
    at once)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(
            f"--host {host} --port {port}: cannot listen there ({err.strerror or err}); give a "
            "free port (0: any), and an address of this machine (127.0.0.1, 0.0.0.0)"
        ) from None
    return sock


def serve(
    workflow: TrainedWorkflow,
    sock: socket.socket,
    *,
    api_key: str | None = None,
    limits: Limits | None = None,
    quiet: bool = False,
) -> None:
    """Serve on ``sock`` (:func:`bound_socket`) until SIGINT or SIGTERM, then drain (module
    docstring), close the engine (the app's lifespan) and return. uvicorn hands the signal back
    to the handler it found once it is done; a handler that does nothing makes that a plain
    return (exit 0), where Python's own would raise KeyboardInterrupt or kill the process."""
    import uvicorn

    class Draining(uvicorn.Server):
        """uvicorn's server, whose first signal starts a drain instead of the stop."""

        def handle_exit(self, sig, frame) -> None:
            if drain.since is None:
                self._captured_signals.append(sig)
                drain.begin()
            else:  # a second signal: stop now
                super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if drain.over():
                self.should_exit = True
            return await super().on_tick(counter)

    drain = Drain()
    app = create_app(workflow, api_key=api_key, limits=limits, quiet=quiet, drain=drain)
    previous = {s: signal.signal(s, _done) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        Draining(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if drain.since is not None:
        print(
            f"marlow serve: stopped; while stopping {drain.answered} request(s) were answered "
            f"and {drain.refused} told 503",
            file=sys.stderr,
        )


def _done(_signum: int, _frame: object) -> None:
    """The signal handler uvicorn calls back once it has shut down: nothing left to do."""
