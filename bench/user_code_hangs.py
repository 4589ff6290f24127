"""What a hung user function costs the run, and what stopping it costs, side by side in one run:

- the run's own Python (a fixed pure-Python workload, the best of 3) alone, then beside 4 calls
  of a spinning function (``while True: pass``) past their time: stopped as marlow stops them
  (:func:`marlow.usercode.call_guarded` raises ``Abandoned`` in their threads), and left running
  (what happened before: the stop switched off);
- the other way to bound user code, a worker process that can be killed: a call's round trip
  through a warm worker (``multiprocessing``, spawn, the arguments a reward call gets for 16
  completions of 200 characters), and starting a new worker after a kill (what every timed-out
  call would cost).

    .venv/bin/python bench/user_code_hangs.py
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time

from marlow import usercode
from marlow.usercode import CallTimedOut, call_guarded


def workload() -> float:
    """Seconds of a fixed pure-Python loop, the best of 3."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(2_000_000):
            total += i % 7
        best = min(best, time.perf_counter() - t0)
    return best


def spins() -> None:
    while True:
        pass


def hang_four(name: str) -> None:
    for _ in range(4):
        with contextlib.suppress(CallTimedOut):
            call_guarded(spins, 0.05, name)
    time.sleep(0.5)  # the stopped ones end


def echo(args):
    return len(args[0])


def main() -> None:
    # the worker process first: the spinning calls left running at the end slow everything
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    pool = ctx.Pool(1)
    pool.apply(echo, (["x" * 200] * 16,))
    start = time.perf_counter() - t0
    args = (["x" * 200] * 16, ["q" * 100] * 16)
    t0 = time.perf_counter()
    for _ in range(200):
        pool.apply(echo, (args,))
    trip = (time.perf_counter() - t0) / 200
    pool.terminate()
    print(f"worker process: a call's round trip {trip * 1000:.2f} ms; a new worker {start:.2f} s")

    alone = workload()
    hang_four("bench-stopped")
    stopped = workload()
    usercode._CALLS.timed_out = lambda name, thread=None: None  # the stop switched off
    hang_four("bench-left")
    left = workload()
    print(f"run's Python alone: {alone * 1000:.0f} ms")
    print(f"  beside 4 spinning calls stopped: {stopped * 1000:.0f} ms ({stopped / alone:.2f}x)")
    print(f"  beside 4 spinning calls left running: {left * 1000:.0f} ms ({left / alone:.2f}x)")


if __name__ == "__main__":
    main()
