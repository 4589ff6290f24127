"""Requests that arrive together are answered together: one engine call per batch.

The server puts each request's questions on a queue; one worker takes whatever has queued up
(waiting up to ``window_s`` after the first for more, at most ``max_questions``), groups it by
sampling settings (temperature, max_tokens, seed, trace), and answers each group with one
:meth:`TrainedWorkflow.answer` call in a worker thread, so that every stage of every question in
the group is one request list to the rollout engine, as training batches episodes. Only that one
thread ever touches the engine. A failed call fails the requests of its group, not the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

from marlow.serving.workflow import Answer, TrainedWorkflow


@dataclass(frozen=True)
class Settings:
    """What one engine call shares."""

    temperature: float | None
    max_tokens: int | None
    seed: int | None
    trace: bool


@dataclass
class _Pending:
    questions: list[str]
    settings: Settings
    future: asyncio.Future = field(repr=False)


class Batcher:
    def __init__(
        self, workflow: TrainedWorkflow, *, window_s: float = 0.005, max_questions: int = 256
    ):
        self.workflow = workflow
        self.window_s = window_s
        self.max_questions = max_questions
        self.batches = 0  # engine calls made, for the server's /health
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self._engine_lock = threading.Lock()

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Answer what is queued, then stop."""
        if self._task is None:
            return
        await self._queue.join()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def answer(self, questions: list[str], settings: Settings) -> list[Answer]:
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(questions, settings, future))
        return await future

    async def _run(self) -> None:
        while True:
            first = await self._queue.get()
            taken = [first]
            size = len(first.questions)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.window_s
            while size < self.max_questions:
                timeout = deadline - loop.time()
                try:
                    more = (
                        self._queue.get_nowait()
                        if timeout <= 0
                        else await asyncio.wait_for(self._queue.get(), timeout)
                    )
                except (asyncio.QueueEmpty, TimeoutError):
                    break
                taken.append(more)
                size += len(more.questions)
            groups: dict[Settings, list[_Pending]] = {}
            for p in taken:
                groups.setdefault(p.settings, []).append(p)
            for settings, pending in groups.items():
                await self._answer_group(settings, pending)
            for _ in taken:
                self._queue.task_done()

    async def _answer_group(self, settings: Settings, pending: list[_Pending]) -> None:
        questions = [q for p in pending for q in p.questions]
        try:
            answers = await asyncio.to_thread(self._call, questions, settings)
        except Exception as err:  # a bad batch fails its requests, never the server
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(err)
            return
        start = 0
        for p in pending:
            mine = answers[start : start + len(p.questions)]
            start += len(p.questions)
            if not p.future.done():
                p.future.set_result(mine)

    def _call(self, questions: list[str], s: Settings) -> list[Any]:
        with self._engine_lock:
            self.batches += 1
            return self.workflow.answer(
                questions,
                trace=s.trace,
                temperature=s.temperature,
                max_new_tokens=s.max_tokens,
                seed=s.seed,
            )
