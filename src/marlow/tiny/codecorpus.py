"""The code pre-training corpus: every role of every workflow on the tiny code problems.

The code twin of :mod:`marlow.tiny.corpus` (read its docstring first): examples are rendered
with the engine's own templates (style ``tiny``, task ``code``), and the skill gaps written in
here are RL's headroom. Greedy decoding must have headroom too, so the errors are SYSTEMATIC
(:data:`marlow.tiny.codegen.SLIP_KINDS`): on a problem whose family has a classic bug, a
generator writes that bug with probability ``bug`` (0.6: more often than not), so the greedy
program of a model trained on this is wrong on those kinds while the right program is the second
most likely continuation, one token away, and sampling finds it. Random TYPOS (one constant off
by one, the wrong aggregate) come on top at ``typo``.

Formats taught (what the workflow parsers read):

* generator / answer, worker / solve, generator / revise: one fenced python block;
* evaluator / review: ``ok; \\boxed{Correct}`` or ``fix: <right line>; \\boxed{Incorrect}`` (the
  first line where the reviewed program differs from the program the evaluator has in mind);
* aggregator / select: ``\\boxed{k}``;
* orchestrator / plan: ``STRATEGY i: <strategy>`` lines;
* synthesizer / conclude: ``use k;`` then the chosen worker's program as a fenced block.

Choices of marlow: the evaluator is blind to a systematic slip at ``eval_bug_blind``; a
revision follows the critique's line at ``revise_trust``; the aggregator and synthesizer check
(first candidate that is right), follow the majority (identical normalised programs) or pick at
random, as in the math corpus. Strategies: ``direct`` (the generator's rates), ``check edges``
(never the systematic slip, more typos), ``test small`` (half the systematic rate); the bad
strategy ``quick`` always writes the systematic slip where there is one.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from marlow.parsers.code import code_key
from marlow.prompts import numbered, render
from marlow.tiny.codegen import Spec, fence, spec_of, train_problems
from marlow.tiny.corpus import (
    MATH_WEIGHTS,
    N_CANDIDATES,
    Example,
    RoleCorpus,
    check_rates,
    pick,
    plan_lines,
)
from marlow.types import Problem

STRATEGIES = ("direct", "check edges", "test small")
BAD_STRATEGY = "quick"


@dataclass(frozen=True)
class CodeCorpusConfig:
    """Skill and error rates of every role on code, and the role mixture (probabilities)."""

    bug: float = 0.6  # P(a generator writes its problem's systematic slip, where there is one)
    typo: float = 0.15  # P(a random typo, when the systematic slip was not written)
    revise_trust: float = 0.8  # P(a revision writes the program the critique's line points to)
    review_wrong_share: float = 0.5
    eval_noise: float = 0.15  # P(the verdict is flipped)
    eval_bug_blind: float = 0.6  # P(a systematic slip is passed as Correct)
    eval_fix_noise: float = 0.15  # P(a right Incorrect verdict points to a typo'd line)
    select_check: float = 0.3
    select_majority: float = 0.45
    plan_short: float = 0.1
    plan_repeat: float = 0.1
    plan_bad: float = 0.15
    careful_typo: float = 0.25  # typo rate under "check edges"
    weights: dict[str, float] = field(
        default_factory=lambda: {
            **MATH_WEIGHTS,
            "orchestrator/plan": 0.03,
            "synthesizer/conclude": 0.07,
        }
    )

    def __post_init__(self) -> None:
        check_rates(self)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


CODE = RoleCorpus("tiny code corpus", CodeCorpusConfig, train_problems, "marlow-tiny-code-corpus")


def write_program(spec: Spec, rng: random.Random, bug: float, typo: float) -> str:
    """A program for ``spec`` by a writer of the given skill (no fences)."""
    if spec.bug is not None and rng.random() < bug:
        return spec.bug
    if spec.typos and rng.random() < typo:
        return rng.choice(spec.typos)
    return spec.right


def expected_pass_rate(spec: Spec, cfg: CodeCorpusConfig) -> float:
    """P(a generator/answer program of ``spec`` is right) under ``cfg``: exact, for tests."""
    p = 1.0 - cfg.bug if spec.bug is not None else 1.0
    return p * (1.0 - cfg.typo if spec.typos else 1.0)


def _fields(problem: Problem, **extra: object) -> dict[str, object]:
    return {"problem": problem.prompt, "n": N_CANDIDATES, **extra}


@CODE.writes("generator", "answer")
def generator_answer(problem: Problem, rng: random.Random, cfg: CodeCorpusConfig) -> Example:
    spec = spec_of(problem)
    code = write_program(spec, rng, cfg.bug, cfg.typo)
    prompt = render("tiny", "code", "generator", "answer", _fields(problem))
    return Example("generator", "answer", prompt, fence(code), code == spec.right)


def first_diff(code: str, target: str) -> str:
    """The first line of ``target`` (stripped) where ``code`` differs from it."""
    a, b = code.splitlines(), target.splitlines()
    for i, line in enumerate(b):
        if i >= len(a) or a[i] != line:
            return line.strip()
    return b[-1].strip()


def critique(
    spec: Spec, code: str, rng: random.Random, cfg: CodeCorpusConfig
) -> tuple[str, str | None]:
    """(the evaluator's text, the program a trusting revision writes; None when it accepts)."""
    accept = "ok; \\boxed{Correct}"
    if code != spec.right:
        if (
            code == spec.bug and rng.random() < cfg.eval_bug_blind
        ) or rng.random() < cfg.eval_noise:
            return accept, None
        target = spec.right
        if spec.typos and rng.random() < cfg.eval_fix_noise:
            target = rng.choice(spec.typos)
        if target == code:
            target = spec.right
    elif rng.random() < cfg.eval_noise and spec.typos:  # a right program rejected
        target = rng.choice(spec.typos)
    else:
        return accept, None
    return f"fix: {first_diff(code, target)}; \\boxed{{Incorrect}}", target


def _reviewed(spec: Spec, rng: random.Random, cfg: CodeCorpusConfig) -> str:
    """A generator program, drawn wrong with probability ``review_wrong_share``."""
    want_wrong = rng.random() < cfg.review_wrong_share
    wrongs = [w for w in (spec.bug, *spec.typos) if w is not None]
    if not want_wrong or not wrongs:
        return spec.right
    for _ in range(50):
        code = write_program(spec, rng, cfg.bug, max(cfg.typo, 0.5))
        if code != spec.right:
            return code
    return rng.choice(wrongs)


@CODE.writes("evaluator", "review")
def evaluator_review(problem: Problem, rng: random.Random, cfg: CodeCorpusConfig) -> Example:
    spec = spec_of(problem)
    code = _reviewed(spec, rng, cfg)
    text, _ = critique(spec, code, rng, cfg)
    prompt = render("tiny", "code", "evaluator", "review", _fields(problem, answer=fence(code)))
    right = text.endswith("{Correct}") == (code == spec.right)
    return Example("evaluator", "review", prompt, text, right)


@CODE.writes("generator", "revise")
def generator_revise(problem: Problem, rng: random.Random, cfg: CodeCorpusConfig) -> Example:
    """A revision after an Incorrect critique (the only case where Eval-Opt revises)."""
    spec = spec_of(problem)
    for _ in range(100):
        code = _reviewed(spec, rng, cfg)
        text, target = critique(spec, code, rng, cfg)
        if target is not None:
            break
    else:
        text, target = "fix: check it; \\boxed{Incorrect}", None
    if target is not None and rng.random() < cfg.revise_trust:
        new = target
    else:
        new = write_program(spec, rng, cfg.bug, cfg.typo)
    fields = _fields(problem, answer=fence(code), critique=text)
    prompt = render("tiny", "code", "generator", "revise", fields)
    return Example("generator", "revise", prompt, fence(new), new == spec.right)


def _vote_key(code: str) -> str | None:
    return code_key(fence(code))


@CODE.writes("aggregator", "select")
def aggregator_select(problem: Problem, rng: random.Random, cfg: CodeCorpusConfig) -> Example:
    spec = spec_of(problem)
    codes = [write_program(spec, rng, cfg.bug, cfg.typo) for _ in range(N_CANDIDATES)]
    k = pick(codes, spec.right, rng, cfg, key=_vote_key)
    fields = _fields(problem, candidates=numbered([fence(c) for c in codes], "tiny"))
    prompt = render("tiny", "code", "aggregator", "select", fields)
    return Example("aggregator", "select", prompt, f"\\boxed{{{k + 1}}}", codes[k] == spec.right)


@CODE.writes("orchestrator", "plan")
def orchestrator_plan(problem: Problem, rng: random.Random, cfg: CodeCorpusConfig) -> Example:
    text = "\n".join(
        f"STRATEGY {i}: {s}"
        for i, s in enumerate(plan_lines(rng, cfg, STRATEGIES, BAD_STRATEGY), 1)
    )
    prompt = render("tiny", "code", "orchestrator", "plan", _fields(problem))
    return Example("orchestrator", "plan", prompt, text, None)


def worker_program(spec: Spec, strategy: str, rng: random.Random, cfg: CodeCorpusConfig) -> str:
    """A worker's program under a strategy; unknown strategies work as ``direct``."""
    if strategy == "check edges":
        return write_program(spec, rng, 0.0, cfg.careful_typo)
    if strategy == "test small":
        return write_program(spec, rng, cfg.bug / 2, cfg.typo)
    if strategy == BAD_STRATEGY:
        return write_program(spec, rng, 1.0, cfg.typo)
    return write_program(spec, rng, cfg.bug, cfg.typo)


@CODE.writes("worker", "solve")
def worker_solve(problem: Problem, rng: random.Random, cfg: CodeCorpusConfig) -> Example:
    spec = spec_of(problem)
    strategy = rng.choice((*STRATEGIES, BAD_STRATEGY))
    code = worker_program(spec, strategy, rng, cfg)
    prompt = render("tiny", "code", "worker", "solve", _fields(problem, strategy=strategy))
    return Example("worker", "solve", prompt, fence(code), code == spec.right)


@CODE.writes("synthesizer", "conclude")
def synthesizer_conclude(problem: Problem, rng: random.Random, cfg: CodeCorpusConfig) -> Example:
    spec = spec_of(problem)
    plan = plan_lines(rng, cfg, STRATEGIES, BAD_STRATEGY)
    plan += ["direct"] * (N_CANDIDATES - len(plan))  # the engine fills missing ones with "direct"
    codes = [worker_program(spec, s, rng, cfg) for s in plan]
    k = pick(codes, spec.right, rng, cfg, key=_vote_key)
    fields = _fields(problem, solutions=numbered([fence(c) for c in codes], "tiny"))
    prompt = render("tiny", "code", "synthesizer", "conclude", fields)
    completion = f"use {k + 1};\n" + fence(codes[k])
    return Example("synthesizer", "conclude", prompt, completion, codes[k] == spec.right)


MAKERS = CODE.makers()
make_example = CODE.make_example
examples = CODE.examples
