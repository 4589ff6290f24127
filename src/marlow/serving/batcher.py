"""Requests that arrive together are answered together: one engine call per batch.

The server puts each request's questions on a queue; one worker takes whatever has queued up
(waiting up to ``window_s`` after the first for more, at most ``max_questions``), groups it by
sampling settings (temperature, max_tokens, seed, trace), and answers each group with one
:meth:`TrainedWorkflow.answer` call in a worker thread, so that every stage of every question in
the group is one request list to the rollout engine, as training batches episodes. Only that one
thread ever touches the engine. A failed call fails the requests of its group, not the server.

The queue is bounded: at most ``max_waiting`` questions wait for the engine; a request that
would go past it is refused at once (:class:`Overloaded`), never queued to hang. A request whose
caller gave up (its deadline passed, its client left) before the worker took it is dropped
without an engine call; one given up after its batch started is computed and its answer
discarded (an engine call cannot be stopped half-way).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from marlow.serving.trained import TrainedWorkflow


class Overloaded(Exception):  # noqa: N818 - the server's 503
    """The queue holds ``max_waiting`` questions already."""


@dataclass(frozen=True)
class Settings:
    """What one engine call shares."""

    temperature: float | None
    max_tokens: int | None
    seed: int | None
    trace: bool


@dataclass
class Pending:
    """One request's questions on the queue; cancel its future to give it up."""

    questions: list[str]
    settings: Settings
    future: asyncio.Future = field(repr=False)


class Batcher:
    def __init__(
        self,
        workflow: TrainedWorkflow,
        *,
        window_s: float = 0.005,
        max_questions: int = 256,
        max_waiting: int = 1024,
    ):
        self.workflow = workflow
        self.window_s = window_s
        self.max_questions = max_questions
        self.max_waiting = max_waiting
        self.batches = 0  # engine calls made, for the server's /health
        self.dropped = 0  # requests given up before an engine call answered them
        self.waiting = 0  # questions queued and not yet taken by the worker
        self._queue: asyncio.Queue[Pending] | None = None
        self._task: asyncio.Task | None = None
        self._engine_lock = threading.Lock()

    @property
    def alive(self) -> bool:
        """Whether the worker is running (the server's /health fails without it)."""
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Answer what is queued, then stop."""
        if self._task is None:
            return
        if self.alive:
            await self._queue.join()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def submit(self, questions: list[str], settings: Settings) -> Pending:
        """Queue ``questions``; await the returned future for their answers. Raises
        :class:`Overloaded` when they would take the queue past ``max_waiting``."""
        if self.waiting + len(questions) > self.max_waiting:
            raise Overloaded(
                f"{self.waiting} questions are waiting for the engine (the most is "
                f"{self.max_waiting}); try again shortly"
            )
        pending = Pending(questions, settings, asyncio.get_running_loop().create_future())
        self.waiting += len(questions)
        self._queue.put_nowait(pending)
        return pending

    async def _run(self) -> None:
        while True:
            taken = await self._take()
            try:
                groups: dict[Settings, list[Pending]] = {}
                for p in taken:
                    if p.future.done():  # given up while it waited: no engine call for it
                        self.dropped += 1
                        continue
                    groups.setdefault(p.settings, []).append(p)
                for settings, pending in groups.items():
                    await self._answer_group(settings, pending)
            except Exception as err:  # noqa: BLE001 - the worker outlives any batch
                print(f"marlow serve: a batch failed: {type(err).__name__}: {err}", file=sys.stderr)
                for p in taken:
                    if not p.future.done():
                        p.future.set_exception(err)
            finally:
                for _ in taken:
                    self._queue.task_done()

    async def _take(self) -> list[Pending]:
        """What has queued up: the first request, then more for up to ``window_s``."""
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
        self.waiting -= sum(len(p.questions) for p in taken)
        return taken

    async def _answer_group(self, settings: Settings, pending: list[Pending]) -> None:
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
