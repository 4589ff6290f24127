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
  than 1, ``stop``, ``tools``, ``logprobs``, penalties...) are refused with a 400 naming them;
  ``model`` must be the served name;
* ``GET /health``: ``{"status": "ok", "model": ..., "batches": ...}``.

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx
status for a bad request (malformed JSON, no messages, an unknown model, a prompt longer than
the model's context, a missing or wrong API key) and the server keeps serving. Concurrent
requests go through :class:`marlow.serving.batcher.Batcher`. uvicorn stops on SIGINT or SIGTERM
after the requests in flight are answered; the engine is closed then.

Choices of marlow: the system and earlier messages are not read (a workflow's roles have their
own prompts); ``max_tokens`` caps each turn of every role, as ``rollout.max_new_tokens`` does;
``finish_reason`` is the final answer's turn's (``stop`` or ``length``).
"""

import json
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from marlow.serving.batcher import Batcher, Settings
from marlow.serving.workflow import TrainedWorkflow

UNSUPPORTED = {
    "top_p": 1,
    "stop": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "logprobs": False,
    "top_logprobs": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "response_format": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
}
"""Request fields marlow cannot honour, with the value that means "off" (accepted)."""
IGNORED = ("user", "metadata", "store", "stream_options", "parallel_tool_calls", "service_tier")
"""Fields accepted and ignored: they change nothing about the answer."""
MAX_N = 16


class RequestError(Exception):
    """A bad request: its HTTP status, message and the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str = "") -> dict:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code or None}}


def create_app(workflow: TrainedWorkflow, *, api_key: str | None = None):
    """The FastAPI application serving ``workflow`` (module docstring)."""
    batcher = Batcher(workflow, max_questions=max(workflow.config.rollout.max_batch, MAX_N))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()
            workflow.close()

    app = FastAPI(title="marlow", lifespan=lifespan)
    app.state.batcher = batcher

    def fail(err: RequestError) -> JSONResponse:
        return JSONResponse(error_body(err.status, err.message, err.param, err.code), err.status)

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, err: RequestError) -> JSONResponse:
        return fail(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        return fail(RequestError(400, f"invalid request: {first.get('msg', 'unreadable body')}"))

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, err: HTTPException) -> JSONResponse:
        return fail(RequestError(err.status_code, str(err.detail)))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if given != f"Bearer {api_key}":
                return fail(RequestError(401, "a valid API key is required (Authorization: "
                                         "Bearer KEY)", code="invalid_api_key"))  # fmt: skip
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": workflow.name, "batches": batcher.batches}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(workflow)]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError as err:
            raise RequestError(400, f"the body is not valid JSON ({err})") from None
        question, settings, n, stream = parse_chat(body, workflow)
        try:
            answers = await batcher.answer([question] * n, settings)
        except ValueError as err:  # a setting the workflow refused
            raise RequestError(400, str(err)) from None
        reply = completion(workflow, answers, settings.trace)
        if not stream:
            return reply
        return StreamingResponse(_chunks(reply), media_type="text/event-stream")

    return app


def _model_card(workflow: TrainedWorkflow) -> dict[str, Any]:
    return {"id": workflow.name, "object": "model", "created": 0, "owned_by": "marlow"}


def parse_chat(body: Any, workflow: TrainedWorkflow) -> tuple[str, Settings, int, bool]:
    """The question, its sampling settings, n and stream of a chat request, or a RequestError."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    model = body.get("model")
    if model != workflow.name:
        raise RequestError(
            404,
            f"model {model!r} is not served here; valid: {workflow.name}",
            "model",
            "model_not_found",
        )
    for key, off in UNSUPPORTED.items():
        if key in body and body[key] not in (off, None):
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
    temperature = _number(body, "temperature", 0.0, 2.0)
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1
    ):
        raise RequestError(400, "max_tokens must be an integer >= 1", "max_tokens")
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise RequestError(400, f"n must be an integer from 1 to {MAX_N}", "n")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(400, "seed must be an integer", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be true or false", "stream")
    trace = body.get("trace", False)
    if not isinstance(trace, bool):
        raise RequestError(400, "trace must be true or false", "trace")
    limit = workflow.question_limit(tokens)
    if limit is not None and workflow.question_tokens(question) > limit:
        raise RequestError(
            400,
            f"the question is {workflow.question_tokens(question)} tokens; this model's context "
            f"leaves {limit} for a question beside {tokens or workflow.config.rollout.max_new_tokens}"
            " new tokens",
            "messages",
            "context_length_exceeded",
        )
    return question, Settings(temperature, tokens, seed, trace), n, stream


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        ]
        if len(parts) == len(content):
            return "\n".join(parts)
    raise RequestError(400, "a user message's content must be text", "messages")


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


async def _chunks(reply: dict[str, Any]) -> AsyncIterator[str]:
    """The reply as server-sent chunks: each choice's answer in one delta, then its end."""
    base = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for c in reply["choices"]:
        delta = {"role": "assistant", "content": c["message"]["content"]}
        yield _event(
            {**base, "choices": [{"index": c["index"], "delta": delta, "finish_reason": None}]}
        )
        end = {"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}
        yield _event({**base, "choices": [end]})
    yield _event({**base, "choices": [], "usage": reply["usage"]})
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def serve(workflow: TrainedWorkflow, *, host: str, port: int, api_key: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM: uvicorn stops taking requests, answers those in flight,
    closes the engine (the app's lifespan), and returns. uvicorn hands the signal back to the
    handler it found once it is done; a handler that does nothing makes that a plain return
    (exit 0), where Python's own would raise KeyboardInterrupt or kill the process."""
    import uvicorn

    app = create_app(workflow, api_key=api_key)
    previous = {s: signal.signal(s, _done) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _done(_signum: int, _frame: object) -> None:
    """The signal handler uvicorn calls back once it has shut down: nothing left to do."""
