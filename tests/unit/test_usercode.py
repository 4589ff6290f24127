"""The guard around a user's function (marlow.usercode.call_guarded): coroutines on one event loop
for the whole process (loop-bound state such as a semaphore works from call to call), a coroutine
past its time cancelled and a loop held by blocking code left behind, a spinning call past its
time stopped, calls blocked in C capped, and a thread that cannot start reported, never raised."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from marlow import usercode
from marlow.usercode import CallFailed, CallTimedOut, call_guarded


def alive(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_coroutines_share_one_loop_so_loop_bound_state_works_on_every_call():
    state: dict = {}

    async def reward() -> int:
        if "gate" not in state:  # made on the first call, as a module-level client would be
            state["gate"] = asyncio.Semaphore(2)
        async with state["gate"]:
            await asyncio.sleep(0)
            return len(state)

    assert [call_guarded(reward, 5) for _ in range(3)] == [1, 1, 1]


def test_a_coroutine_past_its_time_is_cancelled_and_the_loop_goes_on():
    cancelled = threading.Event()

    async def hangs() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def quick() -> str:
        return "ok"

    with pytest.raises(CallTimedOut, match="longer than 0.2 s"):
        call_guarded(hangs, 0.2)
    assert cancelled.wait(5)
    assert call_guarded(quick, 5) == "ok"


def test_a_loop_held_by_blocking_code_is_left_behind():
    async def blocks() -> None:
        time.sleep(3)  # no await: cancelling cannot reach it

    async def quick() -> str:
        return "ok"

    held = usercode._LOOP.get()
    with pytest.raises(CallTimedOut):
        call_guarded(blocks, 0.2)
    t0 = time.monotonic()
    assert call_guarded(quick, 5) == "ok"
    assert time.monotonic() - t0 < 2  # a new loop answered, not the held one after its sleep
    assert usercode._LOOP.get() is not held


def test_a_spinning_call_past_its_time_is_stopped():
    def spins() -> None:
        while True:
            pass

    with pytest.raises(CallTimedOut):
        call_guarded(spins, 0.2, "marlow-test-spin")
    end = time.monotonic() + 5
    while alive("marlow-test-spin") and time.monotonic() < end:
        time.sleep(0.05)
    assert not alive("marlow-test-spin")


def test_calls_blocked_past_their_time_are_capped_then_called_again_once_they_end(monkeypatch):
    monkeypatch.setattr(usercode, "COOLDOWN_S", 0.0)  # the cap alone
    release = threading.Event()

    def blocked() -> str:
        release.wait(30)  # blocked in C: the raised Abandoned waits for it to return
        return "late"

    name = "marlow-test-blocked"
    for _ in range(usercode.MAX_ABANDONED):
        with pytest.raises(CallTimedOut, match="longer than"):
            call_guarded(blocked, 0.05, name)
    t0 = time.monotonic()
    with pytest.raises(CallTimedOut, match="not called: 4 earlier calls"):
        call_guarded(blocked, 10, name)
    assert time.monotonic() - t0 < 1  # refused at once, no thread started
    release.set()
    end = time.monotonic() + 5
    while alive(name) and time.monotonic() < end:
        time.sleep(0.05)
    assert call_guarded(lambda: "ok", 5, name) == "ok"


def test_anything_raised_is_one_line_and_a_thread_that_cannot_start_is_a_failure(monkeypatch):
    def raises() -> None:
        raise SystemExit("bye\nsecond line")

    with pytest.raises(CallFailed, match="^SystemExit: bye$"):
        call_guarded(raises, 5)

    def no_thread(self) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(CallFailed, match="can't start new thread"):
        call_guarded(lambda: 1, 5)


def test_a_function_whose_calls_all_time_out_rests_then_is_tried_again(monkeypatch):
    monkeypatch.setattr(usercode, "COOLDOWN_S", 0.5)
    calls = []

    def spins() -> None:
        calls.append(1)
        while len(calls) < 100:
            pass

    name = "marlow-test-rest"
    for _ in range(usercode.MAX_ABANDONED):
        with pytest.raises(CallTimedOut, match="longer than"):
            call_guarded(spins, 0.05, name)
    with pytest.raises(CallTimedOut, match="its last 4 calls ran past their time limit"):
        call_guarded(spins, 5, name)  # refused at once: not called
    assert len(calls) == usercode.MAX_ABANDONED
    time.sleep(0.6)
    assert call_guarded(lambda: "back", 5, name) == "back"
    with pytest.raises(CallTimedOut, match="longer than"):
        call_guarded(spins, 0.05, name)  # one late call after an answer: no rest
    assert call_guarded(lambda: "again", 5, name) == "again"


def test_a_file_can_import_the_modules_beside_it(tmp_path, monkeypatch):
    from marlow.usercode import load_callable

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "helpers_for_marlow_test.py").write_text("def double(x):\n    return 2 * x\n")
    (folder / "my_reward.py").write_text(
        "from helpers_for_marlow_test import double\n\n"
        "def score(prompts, completions, **kw):\n    return [double(0.5) for _ in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    fn = load_callable("mine/my_reward.py:score", "task.reward")
    assert fn(["q"], ["a", "b"]) == [1.0, 1.0]
