"""Math grader latency and agreement on MATH-500.

    .venv/bin/python bench/grade_latency.py [--data tests/data/math500_test.jsonl]
                                            [--timeout 2.0]

Every MATH-500 ``answer`` is graded, one call at a time, as ``\\boxed{answer}`` against itself
(must be 1.0) and as ``\\boxed{perturbed answer}`` against itself (must be 0.0; the perturbation
appends a 7 to the first digit run, or else changes the first ``\\text{}`` word, or else puts a
factor 2 in front). Latency is per answer, wall clock, split by the path that decided it:
``int`` (integer fast path), ``normalise`` (string/fraction normaliser), ``verify`` (math-verify
in the worker process), ``timeout``/``error`` (math-verify did not answer in time / failed).
``verify-self`` times math-verify alone on the non-integer answers against themselves (the
normaliser decides those by string equality in normal grading). The one-time worker start is
measured separately and excluded. A final line times the batch form
(on a fresh, warmed-up worker, so math-verify's parse cache starts empty).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

from marlow.rewards import _verify_pool, grade_math_batch
from marlow.rewards.math import DEFAULT_TIMEOUT_S, _grade_paths

DEFAULT_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "math500_test.jsonl"


def perturb(answer: str) -> str:
    m = re.search(r"\d+", answer)
    if m:
        return answer[: m.end()] + "7" + answer[m.end() :]
    m = re.search(r"\\text\{[^{}]*\}", answer)
    if m:
        return answer[: m.end() - 1] + "q" + answer[m.end() - 1 :]
    return "2" + answer


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per answer (math-verify)")
    args = ap.parse_args()
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    golds = [r["answer"] for r in rows]

    t0 = time.perf_counter()
    _grade_paths([r"\boxed{\sqrt{4}}"], ["2"], -0.1, args.timeout)  # start the worker
    startup = time.perf_counter() - t0

    lat: dict[str, list[float]] = defaultdict(list)
    agree = {"self": 0, "perturbed": 0}
    bad: list[str] = []
    for kind, preds in (("self", golds), ("perturbed", [perturb(a) for a in golds])):
        want = 1.0 if kind == "self" else 0.0
        for pred, gold in zip(preds, golds, strict=True):
            t = time.perf_counter()
            ((score, path),) = _grade_paths([f"\\boxed{{{pred}}}"], [gold], -0.1, args.timeout)
            lat[path].append((time.perf_counter() - t) * 1000)
            if score == want:
                agree[kind] += 1
            else:
                bad.append(f"{kind}: {pred!r} vs {gold!r} -> {score} ({path})")

    # The normaliser decides every self-grade by string equality; time math-verify on the same
    # answers as well (non-integer ones, straight to the worker), as if the normaliser were absent.
    # A fresh worker, so no parse is cached (pred and gold are the same string: one parse each).
    forced = [a for a in golds if not re.fullmatch(r"[+-]?\d+", a.strip())]
    _verify_pool.shutdown()
    _grade_paths([r"\boxed{\sqrt{4}}"], ["2"], -0.1, args.timeout)
    forced_ok = 0
    for a in forced:
        t = time.perf_counter()
        (r,) = _verify_pool.verify_pairs([(a, a)], args.timeout or DEFAULT_TIMEOUT_S)
        lat["verify-self"].append((time.perf_counter() - t) * 1000)
        forced_ok += r == "true"

    n = len(golds)
    n_perturbed = sum(perturb(a) != a for a in golds)
    print(f"MATH-500 rows: {n}   perturbable: {n_perturbed}")
    print(f"self-grade 1.0:        {agree['self']}/{n}")
    print(
        f"perturbed grade 0.0:   {agree['perturbed']}/{n}   (disagreements: {n - agree['perturbed']})"
    )
    for line in bad:
        print("  MISMATCH", line)
    print(f"math-verify alone, self-grade true: {forced_ok}/{len(forced)} non-integer answers")
    print(f"worker start (excluded below): {startup * 1000:.0f} ms")
    print(f"{'path':<10} {'answers':>8} {'median ms':>10} {'p99 ms':>10} {'max ms':>10}")
    for path in ("int", "normalise", "verify", "timeout", "error", "verify-self"):
        xs = lat.get(path)
        if xs:
            print(
                f"{path:<10} {len(xs):>8} {statistics.median(xs):>10.3f} {p99(xs):>10.3f}"
                f" {max(xs):>10.3f}"
            )
    _verify_pool.shutdown()  # a fresh worker: its parse cache would flatter the batch timing
    _grade_paths([r"\boxed{\sqrt{4}}"], ["2"], -0.1, args.timeout)
    t = time.perf_counter()
    grade_math_batch([f"\\boxed{{{perturb(a)}}}" for a in golds], golds, timeout_s=args.timeout)
    print(f"batch form, 500 perturbed answers: {(time.perf_counter() - t) * 1000:.0f} ms total")
    print(f"workers started/killed: {_verify_pool.stats()}")


if __name__ == "__main__":
    main()
