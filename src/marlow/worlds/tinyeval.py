"""How well a tiny model plays each role, on the tiny math or code world (``task``).

The tiny world itself (:mod:`marlow.tiny`: tokenizer, model, corpora, pre-training) never
measures its models, so that it imports neither the rollout engine nor the rewards; these
functions do, for ``marlow pretrain-tiny`` (its greedy report), ``bench/tiny_pretrain.py`` and the
tests. One function serves both tasks wherever the two worlds differ only in grading.

Sampling goes through the rollout engine (``marlow.rollout.hf``) with the base model: pure
temperature sampling, greedy at temperature 0, stopping at ``<|im_end|>``. Prompts are the
``tiny`` templates the workflows render, filled here stage by stage (not through the workflow
engine), and role outputs are read with the workflows' own rules (:mod:`marlow.parsers`,
``majority_index``). Math answers are graded by ``marlow.rewards.math.grade_math``; programs
by the tiny code task's grader (:class:`marlow.tasks.base.CodeGrader`: suite mode, one sandbox run
per distinct program, :data:`~marlow.tasks.base.TINY_CODE_TIMEOUT_S` per test).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from marlow.choices import BuiltinTask
from marlow.parsers import selection_of, strategies_of, verdict_of
from marlow.parsers.code import code_key
from marlow.prompts import numbered, render
from marlow.prompts.chat import chat_prompt_ids
from marlow.rewards.math import grade_math, last_boxed
from marlow.rollout.hf import HFEngine
from marlow.tasks.base import TINY_CODE_TIMEOUT_S, CodeGrader
from marlow.tiny import codecorpus, codegen, corpus, mathgen
from marlow.tiny.corpus import N_CANDIDATES
from marlow.tiny.pretrain import load_tiny
from marlow.types import BASE, GenRequest, Problem, SamplingParams
from marlow.workflows.votes import answer_key, majority_index

TASKS: tuple[str, ...] = get_args(BuiltinTask)
REPORT_PROBLEMS = 200  # validation problems of the greedy report (:func:`greedy_report`)
ANSWER_ROLES = ("generator", "worker", "synthesizer")  # the roles whose output is graded
PROBED_ROLES = (
    "generator/revise",
    "evaluator/review",
    "aggregator/select",
    "orchestrator/plan",
    "worker/solve",
    "synthesizer/conclude",
)
PROBE_TOKENS = {"math": 160, "code": 128}  # new tokens of a probed role's greedy completion


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


def grade(
    texts: Sequence[str], problems: Sequence[Problem], task: str = "math"
) -> tuple[list[float], int]:
    """(the reward of each completion, sandbox errors). Math: ``grade_math`` (1 when the last
    boxed answer equals the problem's). Code: the fraction of hidden tests passed, equal programs
    run once; sandbox errors are the programs that got no verdict because the sandbox failed to
    set up (they score 0). Math has none."""
    _check_task(task)
    if task == "math":
        return [grade_math(t, p.answer) for t, p in zip(texts, problems, strict=True)], 0
    grader = CodeGrader(TINY_CODE_TIMEOUT_S)
    pairs = list(zip(texts, problems, strict=True))
    grader.prefetch(pairs)
    return [grader(t, p) for t, p in pairs], grader.sandbox_errors


def correct(texts: Sequence[str], problems: Sequence[Problem], task: str = "math") -> list[bool]:
    """Whether each completion is right (reward 1: the answer, or every hidden test)."""
    return [r >= 1.0 for r in grade(texts, problems, task)[0]]


def generator_texts(
    model: Any, tokenizer: Any, problems: Sequence[Problem], task: str = "math", **sampling: Any
) -> list[str]:
    """The generator's completions through the Single workflow's prompt; ``sampling`` is passed
    to :func:`generate` (``temperature``, ``seed``; greedy by default)."""
    prompts = [render("tiny", task, "generator", "answer", {"problem": p.prompt}) for p in problems]
    return generate(model, tokenizer, prompts, **sampling)


def answer_scores(
    texts: Sequence[str], problems: Sequence[Problem], task: str = "math"
) -> dict[str, float]:
    """Scores of answers (one completion per problem): ``accuracy`` (reward 1) and, on code,
    the mean ``reward``, ``accuracy/<family>`` and ``sandbox_errors`` (programs with no verdict,
    counted as 0)."""
    rewards, sandbox_errors = grade(texts, problems, task)
    out = {"accuracy": _share([r >= 1.0 for r in rewards])}
    if task == "code":
        out |= {"reward": sum(rewards) / max(1, len(rewards)), "sandbox_errors": sandbox_errors}
        fams: dict[str, list[bool]] = {}
        for p, r in zip(problems, rewards, strict=True):
            fams.setdefault(p.meta["family"], []).append(r >= 1.0)
        out |= {f"accuracy/{fam}": _share(ok) for fam, ok in sorted(fams.items())}
    return out


def greedy_report(
    path: str | Path, task: str = "math", n_problems: int | None = None
) -> dict[str, float]:
    """:func:`answer_scores` of the greedy generator (the Single workflow's prompt) of the
    pre-trained world in ``path`` on the first ``n_problems`` (default :data:`REPORT_PROBLEMS`)
    validation problems of ``task``, with ``problems``: their number."""
    _check_task(task)
    model, tokenizer = load_tiny(path)
    gen = codegen if task == "code" else mathgen
    problems = gen.val_problems(REPORT_PROBLEMS if n_problems is None else n_problems)
    texts = generator_texts(model, tokenizer, problems, task)
    return {**answer_scores(texts, problems, task), "problems": float(len(problems))}


def voting_eval(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    task: str = "math",
    n: int = 3,
    temperature: float = 0.7,
    seed: int = 0,
) -> dict[str, float]:
    """Voting with the model in every role: ``n`` sampled candidates, a greedy aggregator.

    Returns the mean candidate accuracy, pass@n, majority (the workflow's vote: boxed answers, or
    identical normalised programs) and aggregator accuracy over all problems, and on the sets
    with at least one correct candidate (``*_on_solvable``): there checking can beat the majority.
    """
    cands = [
        generator_texts(model, tokenizer, problems, task, temperature=temperature, seed=seed + k)
        for k in range(n)
    ]
    sets = [[cands[k][i] for k in range(n)] for i in range(len(problems))]
    right = correct([t for s in sets for t in s], [p for p in problems for _ in range(n)], task)
    prompts = [
        render(
            "tiny",
            task,
            "aggregator",
            "select",
            {"problem": p.prompt, "candidates": numbered(s, "tiny"), "n": n},
        )
        for p, s in zip(problems, sets, strict=True)
    ]
    picks = generate(model, tokenizer, prompts, temperature=0.0, max_new_tokens=16)
    stats: Counter = Counter()
    for i, (p, s, pick) in enumerate(zip(problems, sets, picks, strict=True)):
        ok = right[i * n : (i + 1) * n]
        choice = selection_of(pick, n)
        k = 0 if choice is None else choice  # the workflow's fallback: the first candidate
        m = majority_index(s, answer_key(p)) or 0
        stats["fallback"] += choice is None
        stats["cand"] += sum(ok) / n
        stats["pass"] += any(ok)
        stats["agg"] += ok[k]
        stats["maj"] += ok[m]
        if any(ok):
            stats["solvable"] += 1
            stats["agg_s"] += ok[k]
            stats["maj_s"] += ok[m]
    total, solv = max(1, len(problems)), max(1, stats["solvable"])
    return {
        "candidate_accuracy": stats["cand"] / total,
        "pass_at_n": stats["pass"] / total,
        "majority_accuracy": stats["maj"] / total,
        "aggregator_accuracy": stats["agg"] / total,
        "majority_on_solvable": stats["maj_s"] / solv,
        "aggregator_on_solvable": stats["agg_s"] / solv,
        "solvable_sets": float(stats["solvable"]),
        "selection_fallback_rate": stats["fallback"] / total,
    }


def role_rates(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    task: str = "math",
    cfg: corpus.CorpusConfig | codecorpus.CodeCorpusConfig | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Greedy output of every role of :data:`PROBED_ROLES` on corpus-style prompts (the corpus
    examples of ``problems``, one seeded rng): the share that parses (``<role>/<variant>/
    parse_rate``), for the roles that answer their accuracy, and on code the evaluator's verdict
    accuracy (its verdict against the reviewed program's real result)."""
    _check_task(task)
    world = codecorpus if task == "code" else corpus
    cfg = cfg or (codecorpus.CodeCorpusConfig() if task == "code" else corpus.CorpusConfig())
    rng = random.Random(seed)
    out: dict[str, float] = {}
    for key in PROBED_ROLES:
        role, variant = key.split("/")
        exs = [world.make_example(role, variant, p, rng, cfg) for p in problems]
        texts = generate(
            model, tokenizer, [e.prompt for e in exs], max_new_tokens=PROBE_TOKENS[task]
        )
        out[f"{key}/parse_rate"] = _share([parses(role, t, N_CANDIDATES, task) for t in texts])
        if role in ANSWER_ROLES:
            out[f"{key}/accuracy"] = _share(correct(texts, problems, task))
        if role == "evaluator" and task == "code":
            reviewed = [e.prompt.split("\nA: ", 1)[1].rsplit("\nCheck:", 1)[0] for e in exs]
            truth = correct(reviewed, problems, task)
            said = [verdict_of(t) is True for t in texts]
            out[f"{key}/verdict_accuracy"] = _share(
                [a == b for a, b in zip(truth, said, strict=True)]
            )
    return out


def parses(role: str, text: str, n: int, task: str = "math") -> bool:
    """Whether a completion of ``role`` has the format its workflow parser reads, for ``n``
    candidates or strategies: a verdict, a selection in 1..n, at least one ``STRATEGY i:`` line
    with i in 1..n, or an answer (a boxed integer; on code a fenced program)."""
    if role == "evaluator":
        return verdict_of(text) is not None
    if role == "aggregator":
        return selection_of(text, n) is not None
    if role == "orchestrator":
        return any(s is not None for s in strategies_of(text, n))
    if task == "code":
        return code_key(text) is not None and "```" in text
    return (last_boxed(text) or "").strip().lstrip("-").isdigit()


def _share(flags: Sequence[bool]) -> float:
    return sum(flags) / max(1, len(flags))


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"tiny task {task!r} is unknown; valid: {', '.join(TASKS)}")
