"""Measuring a tiny CODE model's roles: the code twin of :mod:`marlow.tiny.evaluate`.

Programs are graded by :func:`marlow.rewards.code.score_code_batch` in suite mode (one sandbox
run per distinct program). Pre-training records the generator's greedy scores in ``meta.json``;
the other functions measure a model's roles by hand (they are what the code world's numbers in
the report were measured with).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from marlow.rewards.code import CodeScore, code_key, extract_code, score_code_batch
from marlow.rewards.math import last_boxed
from marlow.tiny.codecorpus import CodeCorpusConfig, make_example
from marlow.tiny.evaluate import generate, probe_roles
from marlow.types import Problem
from marlow.workflows.builtin import majority_index
from marlow.workflows.prompts import numbered, render

TIMEOUT_S = 2.0  # per test: the tiny programs run in microseconds


def grade(texts: Sequence[str], problems: Sequence[Problem]) -> list[float]:
    """Reward (fraction of hidden tests passed) of each completion; equal programs run once."""
    return [score.reward for score in grade_details(texts, problems)]


def grade_details(texts: Sequence[str], problems: Sequence[Problem]) -> list[CodeScore]:
    """The ``CodeScore`` of each completion; equal programs run once."""
    unique: dict[tuple[str, str | None], int] = {}
    items = []
    for t, p in zip(texts, problems, strict=True):
        key = (p.id, extract_code(t))
        if key not in unique:
            unique[key] = len(items)
            items.append((t, p.meta["tests"]))
    scores = score_code_batch(items, suite=True, timeout_s=TIMEOUT_S)
    return [scores[unique[(p.id, extract_code(t))]] for t, p in zip(texts, problems, strict=True)]


def generator_texts(
    model: Any, tokenizer: Any, problems: Sequence[Problem], *, temperature: float = 0.0, seed=0
) -> list[str]:
    prompts = [
        render("tiny", "code", "generator", "answer", {"problem": p.prompt}) for p in problems
    ]
    return generate(model, tokenizer, prompts, temperature=temperature, seed=seed)


def generator_scores(
    model: Any, tokenizer: Any, problems: Sequence[Problem], *, temperature: float = 0.0, seed=0
) -> dict[str, float]:
    """The generator through the Single workflow's prompt: mean reward and full-pass accuracy,
    overall and per family (``accuracy/<family>``), and ``sandbox_errors``: completions whose
    program got no verdict because the sandbox failed to set up (they count as 0)."""
    texts = generator_texts(model, tokenizer, problems, temperature=temperature, seed=seed)
    scores = grade_details(texts, problems)
    rewards = [s.reward for s in scores]
    out = {
        "reward": sum(rewards) / max(1, len(rewards)),
        "accuracy": sum(r >= 1.0 for r in rewards) / max(1, len(rewards)),
        "sandbox_errors": sum(s.sandbox_error is not None for s in scores),
    }
    fams: dict[str, list[float]] = {}
    for p, r in zip(problems, rewards, strict=True):
        fams.setdefault(p.meta["family"], []).append(r)
    for fam, rs in sorted(fams.items()):
        out[f"accuracy/{fam}"] = sum(r >= 1.0 for r in rs) / len(rs)
    return out


def voting_eval(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    n: int = 3,
    temperature: float = 0.7,
    seed: int = 0,
) -> dict[str, float]:
    """Voting with the model in every role: ``n`` sampled candidates, a greedy aggregator.
    pass@n, majority (identical normalised programs) and aggregator accuracy."""
    cands = [
        generator_texts(model, tokenizer, problems, temperature=temperature, seed=seed + k)
        for k in range(n)
    ]
    sets = [[cands[k][i] for k in range(n)] for i in range(len(problems))]
    flat = [t for s in sets for t in s]
    rewards = grade(flat, [p for p in problems for _ in range(n)])
    prompts = [
        render(
            "tiny",
            "code",
            "aggregator",
            "select",
            {"problem": p.prompt, "candidates": numbered(s, "tiny"), "n": n},
        )
        for p, s in zip(problems, sets, strict=True)
    ]
    picks = generate(model, tokenizer, prompts, temperature=0.0, max_new_tokens=16)
    stats: Counter = Counter()
    for i, pick in enumerate(picks):
        right = [r >= 1.0 for r in rewards[i * n : (i + 1) * n]]
        choice = (last_boxed(pick) or "").strip()
        k = int(choice) - 1 if choice.isdigit() and 1 <= int(choice) <= n else 0
        stats["fallback"] += choice != str(k + 1)
        m = majority_index(sets[i], key=code_key) or 0
        stats["pass"] += any(right)
        stats["agg"] += right[k]
        stats["maj"] += right[m]
        stats["cand"] += sum(right) / n
    total = max(1, len(problems))
    return {
        "candidate_accuracy": stats["cand"] / total,
        "pass_at_n": stats["pass"] / total,
        "majority_accuracy": stats["maj"] / total,
        "aggregator_accuracy": stats["agg"] / total,
        "selection_fallback_rate": stats["fallback"] / total,
    }


def role_rates(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    cfg: CodeCorpusConfig | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Greedy output of every role on corpus-style prompts: the share that parses, per role;
    for roles that write programs, their accuracy; for the evaluator, verdict accuracy."""
    out: dict[str, float] = {}
    cfg = cfg or CodeCorpusConfig()
    for key, role, exs, texts in probe_roles(
        make_example, model, tokenizer, problems, cfg, seed, 128
    ):
        out[f"{key}/parse_rate"] = sum(parses(role, t) for t in texts) / max(1, len(texts))
        if role in ("generator", "worker", "synthesizer"):
            rewards = grade(texts, problems)
            out[f"{key}/accuracy"] = sum(r >= 1.0 for r in rewards) / max(1, len(rewards))
        if role == "evaluator":
            reviewed = [e.prompt.split("\nA: ", 1)[1].rsplit("\nCheck:", 1)[0] for e in exs]
            truth = [r >= 1.0 for r in grade(reviewed, problems)]
            said = [(last_boxed(t) or "").strip() == "Correct" for t in texts]
            out[f"{key}/verdict_accuracy"] = sum(
                a == b for a, b in zip(truth, said, strict=True)
            ) / max(1, len(texts))
    return out


def parses(role: str, text: str) -> bool:
    """Whether a completion has the format the workflow parser of ``role`` reads."""
    box = (last_boxed(text) or "").strip()
    if role == "evaluator":
        return box in ("Correct", "Incorrect")
    if role == "aggregator":
        return box in ("1", "2", "3")
    if role == "orchestrator":
        return text.strip().startswith("STRATEGY 1:")
    return code_key(text) is not None and "```" in text
