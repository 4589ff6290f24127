"""Measuring a tiny model's roles: a small self-contained sampler and role accuracies.

Pre-training records the generator's greedy accuracy in its ``meta.json`` and
``bench/tiny_pretrain.py`` measures the rest with these functions. Sampling goes through the
rollout engine (``marlow.rollout.hf``) with the base model: pure temperature sampling, greedy at
temperature 0, stopping at ``<|im_end|>``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from marlow.chat import chat_prompt_ids
from marlow.rewards.math import grade_math, last_boxed
from marlow.rollout.hf import HFEngine
from marlow.tiny.corpus import CorpusConfig, make_example
from marlow.types import BASE, GenRequest, Problem, SamplingParams
from marlow.workflows.builtin import majority_index
from marlow.workflows.prompts import numbered, render


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    temperature: float = 0.0,
    max_new_tokens: int = 160,
    seed: int = 0,
    batch_size: int = 128,
) -> list[str]:
    """Completions (special tokens removed) of user texts ``prompts``, in order, by the base."""
    engine = HFEngine(model, tokenizer, max_batch=batch_size)
    requests = [GenRequest(chat_prompt_ids(tokenizer, p), BASE) for p in prompts]
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    return [c.text for c in engine.generate(requests, params)]


def accuracy(texts: Sequence[str], problems: Sequence[Problem]) -> float:
    """Fraction of completions whose last boxed answer equals the problem's."""
    if not problems:
        return 0.0
    graded = [grade_math(t, p.answer) >= 1.0 for t, p in zip(texts, problems, strict=True)]
    return sum(graded) / len(graded)


def generator_texts(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[str]:
    prompts = [
        render("tiny", "math", "generator", "answer", {"problem": p.prompt}) for p in problems
    ]
    return generate(model, tokenizer, prompts, temperature=temperature, seed=seed)


def generator_accuracy(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    temperature: float = 0.0,
    seed: int = 0,
) -> float:
    """The generator's accuracy through the Single workflow's prompt."""
    texts = generator_texts(model, tokenizer, problems, temperature=temperature, seed=seed)
    return accuracy(texts, problems)


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

    Returns pass@n, majority and aggregator accuracy over all problems, and on the sets with
    at least one correct candidate (``*_on_solvable``): there checking can beat the majority.
    """
    cands = [
        generator_texts(model, tokenizer, problems, temperature=temperature, seed=seed + k)
        for k in range(n)
    ]
    sets = [[cands[k][i] for k in range(n)] for i in range(len(problems))]
    prompts = [
        render(
            "tiny",
            "math",
            "aggregator",
            "select",
            {"problem": p.prompt, "candidates": numbered(s, "tiny"), "n": n},
        )
        for p, s in zip(problems, sets, strict=True)
    ]
    picks = generate(model, tokenizer, prompts, temperature=0.0, max_new_tokens=16)
    stats = Counter()
    for p, s, pick in zip(problems, sets, picks, strict=True):
        right = [grade_math(t, p.answer) >= 1.0 for t in s]
        choice = (last_boxed(pick) or "").strip()
        k = int(choice) - 1 if choice.isdigit() and 1 <= int(choice) <= n else 0
        stats["fallback"] += choice != str(k + 1)
        m = majority_index(s) or 0
        stats["pass"] += any(right)
        stats["agg"] += right[k]
        stats["maj"] += right[m]
        if any(right):
            stats["solvable"] += 1
            stats["agg_s"] += right[k]
            stats["maj_s"] += right[m]
    total, solv = max(1, len(problems)), max(1, stats["solvable"])
    return {
        "pass_at_n": stats["pass"] / total,
        "majority_accuracy": stats["maj"] / total,
        "aggregator_accuracy": stats["agg"] / total,
        "majority_on_solvable": stats["maj_s"] / solv,
        "aggregator_on_solvable": stats["agg_s"] / solv,
        "solvable_sets": float(stats["solvable"]),
        "selection_fallback_rate": stats["fallback"] / total,
    }


PROBED_ROLES = (
    "generator/revise",
    "evaluator/review",
    "aggregator/select",
    "orchestrator/plan",
    "worker/solve",
    "synthesizer/conclude",
)


def probe_roles(
    make: Callable, model: Any, tokenizer: Any, problems: Sequence[Problem], cfg, seed: int, tokens
) -> Iterator[tuple[str, str, list, list[str]]]:
    """For each role of ``PROBED_ROLES``: (key, role, corpus examples ``make`` wrote on
    ``problems`` with one seeded rng, the model's greedy completions of their prompts)."""
    rng = random.Random(seed)
    for key in PROBED_ROLES:
        role, variant = key.split("/")
        exs = [make(role, variant, p, rng, cfg) for p in problems]
        yield (
            key,
            role,
            exs,
            generate(model, tokenizer, [e.prompt for e in exs], max_new_tokens=tokens),
        )


def role_format_rates(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    cfg: CorpusConfig | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Greedy output of every role on corpus-style prompts: the share that parses, per role,
    and the share agreeing with the corpus's skilled answer where one exists (``*_right``)."""
    out: dict[str, float] = {}
    probes = probe_roles(make_example, model, tokenizer, problems, cfg or CorpusConfig(), seed, 160)
    for key, role, _exs, texts in probes:
        ok = [_parses(role, t) for t in texts]
        out[f"{key}/parse_rate"] = sum(ok) / max(1, len(ok))
        if role in ("generator", "worker", "synthesizer"):
            out[f"{key}/accuracy"] = accuracy(texts, problems)
    return out


def _parses(role: str, text: str) -> bool:
    box = (last_boxed(text) or "").strip()
    if role == "evaluator":
        return box in ("Correct", "Incorrect")
    if role == "aggregator":
        return box in ("1", "2", "3")
    if role == "orchestrator":
        return text.strip().startswith("STRATEGY 1:")
    return box.lstrip("-").isdigit()
