"""Load on ``marlow serve``: N chat requests at concurrency C, then the same N one at a time,
against one real server process, in one run; the ratio says what batching concurrent requests
into shared engine calls buys.

The script starts ``marlow serve RUN`` on a free port (its settings after RUN, e.g.
``rollout.backend=vllm``), waits for ``/health``, sends ``--requests`` questions (the tiny
world's arithmetic, each one different) with ``--concurrency`` threads through the official
``openai`` client at temperature 0, then the same questions one after another, and stops the
server with SIGINT. It prints requests per second, p50 / p95 latency and errors for each phase,
the throughput ratio, and the engine calls the server made (``/health``'s ``batches``), and
writes them as JSON.

    .venv/bin/python bench/serve_load.py marlow-quickstart/cells/Voting-SP-tiny-s-Math
    .venv-vllm/bin/python bench/serve_load.py RUN rollout.backend=vllm --json bench/results/serve_load_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai


def questions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    ops = ["+", "-", "*"]
    out: list[str] = []
    while len(out) < n:
        q = f"{rng.randint(2, 99)}{rng.choice(ops)}{rng.randint(2, 99)}"
        if q not in out:
            out.append(q)
    return out


def start(run: str, settings: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "marlow", "serve", run, "--port", str(port), *settings],
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(3000):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not answer /health in 5 minutes")


def phase(client: openai.OpenAI, model: str, items: list[str], concurrency: int) -> dict:
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(q: str) -> None:
        t0 = time.perf_counter()
        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": q}], temperature=0
            )
        except Exception as err:  # counted, the load goes on
            with lock:
                errors.append(f"{type(err).__name__}: {err}"[:200])
            return
        with lock:
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, items))
    wall = time.perf_counter() - t0
    ordered = sorted(latencies)
    return {
        "requests": len(items),
        "concurrency": concurrency,
        "seconds": round(wall, 3),
        "requests_per_s": round(len(latencies) / wall, 3),
        "p50_s": round(statistics.median(ordered), 4) if ordered else None,
        "p95_s": round(ordered[int(0.95 * (len(ordered) - 1))], 4) if ordered else None,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def batches(url: str) -> int:
    return json.loads(urllib.request.urlopen(f"{url}/health").read())["batches"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run folder, checkpoint or bundle")
    ap.add_argument("settings", nargs="*", help="key=value settings for marlow serve")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--json", type=Path, default=Path("bench/results/serve_load.json"))
    args = ap.parse_args()
    proc, url = start(args.run, args.settings)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        items = questions(args.requests)
        phase(client, model, items[:8], 8)  # warm-up: first calls, allocations
        before = batches(url)
        loaded = phase(client, model, items, args.concurrency)
        loaded["engine_calls"] = batches(url) - before
        before = batches(url)
        alone = phase(client, model, items, 1)
        alone["engine_calls"] = batches(url) - before
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    result = {
        "run": args.run,
        "settings": args.settings,
        "cpus": os.cpu_count(),
        "concurrent": loaded,
        "one_at_a_time": alone,
        "throughput_ratio": round(loaded["requests_per_s"] / alone["requests_per_s"], 2),
        "server_exit": code,
    }
    for name in ("concurrent", "one_at_a_time"):
        r = result[name]
        print(
            f"{name:>13}: {r['requests']} requests at concurrency {r['concurrency']}: "
            f"{r['requests_per_s']:.2f} req/s, p50 {r['p50_s']} s, p95 {r['p95_s']} s, "
            f"{r['errors']} errors, {r['engine_calls']} engine calls"
        )
    print(f"throughput ratio: {result['throughput_ratio']}x; server exit {code}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
