"""The pre-training corpus: every role of every math workflow, with imperfect, tunable skill.

Each example is (prompt, completion): the prompt is rendered with the very templates the workflow
engine uses (``marlow.prompts``, style ``tiny``), the completion is what a role of a
given skill would answer. Pre-training on it teaches the tiny model every role's output format,
and the skill gaps written in here are the headroom RL works with.

Headroom must exist under greedy decoding too, not only under sampling. Random slips are
minority continuations that greedy decoding ignores, so the corpus also holds SYSTEMATIC slips
(:mod:`marlow.tiny.errors`), written the wrong way more often than not: a subtraction that needs
a borrow has it forgotten with probability ``borrow_bug``, a multiplication with a carry has it
forgotten with probability ``carry_bug``. The greedy mode of a model trained on this is wrong on
those kinds; the right token is still the second most likely one, so sampling finds it and RL
can promote it. For the same reason the evaluator is blind to these slips at
``eval_bug_blind``, and the aggregator and synthesizer follow the majority more often than they
check the working.

Everything is drawn from one ``random.Random`` per stream, so a corpus is a pure function of
(config, seed).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from marlow.prompts import numbered, render
from marlow.tiny.errors import Fix, check_line, expected_accuracy, first_error, slip, solve
from marlow.tiny.mathgen import Block, boxed, column_block, format_working, train_problems
from marlow.types import Problem

STRATEGIES = ("direct", "show carries", "check inverse")
"""Useful strategies: plain column working; every carry and borrow written, even zero ones (no
carry or borrow can be forgotten); and a check of the last block by its inverse (a wrong last
block is caught and redone)."""
BAD_STRATEGY = "left to right"
"""Ignores operator precedence: wrong on ``a+b*c``; the orchestrator sometimes proposes it."""

ROLES: tuple[tuple[str, str], ...] = (
    ("generator", "answer"),
    ("generator", "revise"),
    ("evaluator", "review"),
    ("aggregator", "select"),
    ("orchestrator", "plan"),
    ("worker", "solve"),
    ("synthesizer", "conclude"),
)
"""Every (role, prompt variant) of the built-in math workflows."""

N_CANDIDATES = 3  # Voting's generators and Orch-Workers' workers (the engine's default n)
MATH_WEIGHTS: dict[str, float] = {
    "generator/answer": 0.45,
    "generator/revise": 0.07,
    "evaluator/review": 0.10,
    "aggregator/select": 0.12,
    "orchestrator/plan": 0.04,
    "worker/solve": 0.13,
    "synthesizer/conclude": 0.06,
}
"""The math corpus's default role mixture (relative weights); the code corpus differs in two."""


@dataclass(frozen=True)
class CorpusConfig:
    """Skill and error rates of every role, and the role mixture. Rates are probabilities."""

    # generator / answer
    gen_error: float = 0.25  # P(one random column of an answer slips: +-1 or +-10)
    borrow_bug: float = 0.6  # P(a subtraction block with borrows has them all forgotten)
    carry_bug: float = 0.6  # P(a multiplication block with carries has them all forgotten)
    # generator / revise (sees its previous answer and an Incorrect critique)
    revise_trust: float = 0.8  # P(the revision follows the critique's proposed column)
    revise_error: float = 0.1  # P(a random slip elsewhere in a revision that follows it)
    # evaluator / review
    review_wrong_share: float = 0.5  # share of reviewed answers that are wrong (class balance)
    eval_noise: float = 0.15  # P(the verdict is flipped), any answer
    eval_bug_blind: float = 0.6  # P(an answer whose first error is systematic is passed)
    eval_fix_noise: float = 0.15  # P(a right Incorrect verdict proposes a wrong column)
    # aggregator / select and synthesizer / conclude: each example follows one policy:
    # check (first candidate whose working checks out; majority if none), majority answer
    # (first of the most common, as Voting's majority metric), or a uniformly random pick.
    select_check: float = 0.3
    select_majority: float = 0.45  # the remainder (1 - check - majority) picks at random
    # orchestrator / plan
    plan_short: float = 0.1  # P(only 1 or 2 strategy lines)
    plan_repeat: float = 0.1  # P(one strategy written twice)
    plan_bad: float = 0.15  # P(one strategy replaced by "left to right")
    # worker / solve
    worker_error: float = 0.25  # P(a random slip): direct / check inverse / left to right
    careful_error: float = 0.15  # P(a random slip) under "show carries" (and no systematic slip)
    inverse_fix: float = 0.7  # P(a last block caught by "check inverse" is redone right)
    # role mixture: relative weights, one per entry of ROLES (generator / answer the largest)
    weights: dict[str, float] = field(default_factory=lambda: dict(MATH_WEIGHTS))

    def __post_init__(self) -> None:
        check_rates(self)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def check_rates(cfg: Any) -> None:
    """A corpus config's checks (math and code): every field but ``weights`` a probability,
    ``select_check + select_majority <= 1``, and ``weights`` keyed by :data:`ROLES` pairs, with
    non-negative weights and a positive sum."""
    name = type(cfg).__name__
    for field_name, value in asdict(cfg).items():
        if field_name != "weights" and not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}.{field_name} must be a probability, got {value}")
    if cfg.select_check + cfg.select_majority > 1.0:
        raise ValueError(f"{name}.select_check + select_majority must be <= 1")
    known = {f"{r}/{v}" for r, v in ROLES}
    unknown = set(cfg.weights) - known
    if unknown or any(w < 0 for w in cfg.weights.values()) or not sum(cfg.weights.values()):
        raise ValueError(
            f"{name}.weights: keys must be among {', '.join(sorted(known))} with "
            f"non-negative weights and a positive sum; got {cfg.weights}"
        )


@dataclass(frozen=True)
class Example:
    """One pre-training example: the user text of the prompt and the completion text."""

    role: str
    variant: str
    prompt: str  # user text, before the chat template
    completion: str  # without the closing <|im_end|>
    correct: bool | None = None  # answer roles: is the boxed value right; selectors: is the pick


Maker = Callable[[Problem, random.Random, Any], Example]


@dataclass(frozen=True)
class RoleCorpus:
    """A world's role corpus: one maker ``(problem, rng, cfg) -> Example`` per (role, variant) of
    :data:`ROLES`, each registered with :meth:`writes`, and the seeded stream of examples over
    the world's training problems. The math corpus (:data:`MATH`) and the code corpus
    (``marlow.tiny.codecorpus.CODE``) are two of these."""

    name: str  # how errors name it, e.g. "tiny corpus"
    default_config: Callable[[], Any]
    train_problems: Callable[[int], Iterator[Problem]]
    stream: str  # the example stream's rng is seeded with f"{stream}-{seed}"
    _makers: dict[str, Maker] = field(default_factory=dict, repr=False)

    def writes(self, role: str, variant: str) -> Callable[[Maker], Maker]:
        """Decorator: the function writes this corpus's examples of (role, variant)."""
        key = f"{role}/{variant}"
        if (role, variant) not in ROLES or key in self._makers:
            raise ValueError(f"{self.name}: {key} is not a (role, variant) of ROLES without maker")

        def register(maker: Maker) -> Maker:
            self._makers[key] = maker
            return maker

        return register

    def makers(self) -> dict[str, Maker]:
        """The makers by ``"role/variant"`` in :data:`ROLES` order (the order the example stream
        draws roles in, whatever order they were written in); every pair must have one."""
        missing = [f"{r}/{v}" for r, v in ROLES if f"{r}/{v}" not in self._makers]
        if missing:
            raise ValueError(f"{self.name} has no maker for {', '.join(missing)}")
        return {f"{r}/{v}": self._makers[f"{r}/{v}"] for r, v in ROLES}

    def make_example(
        self, role: str, variant: str, problem: Problem, rng: random.Random, cfg: Any
    ) -> Example:
        """One example of (role, variant) on ``problem``; the error lists the known pairs."""
        key = f"{role}/{variant}"
        if key not in self._makers:
            raise ValueError(f"no {self.name} role {key!r}; known: {', '.join(self.makers())}")
        return self._makers[key](problem, rng, cfg)

    def examples(
        self, cfg: Any | None = None, seed: int = 0, role: str | None = None
    ) -> Iterator[Example]:
        """An infinite, seeded stream of examples on training problems, one per problem, roles
        drawn by ``cfg.weights`` (or only ``role``, e.g. ``"aggregator/select"``)."""
        cfg = cfg or self.default_config()
        rng = random.Random(f"{self.stream}-{seed}")
        makers = self.makers()
        keys = [k for k in makers if cfg.weights.get(k, 0.0) > 0] if role is None else [role]
        weights = [cfg.weights.get(k, 1.0) for k in keys]
        for problem in self.train_problems(seed):
            key = rng.choices(keys, weights=weights)[0]
            yield self.make_example(*key.split("/", 1), problem, rng, cfg)


MATH = RoleCorpus("tiny corpus", CorpusConfig, train_problems, "marlow-tiny-corpus")


# ---- one example per role ----------------------------------------------------------------


def generator_blocks(problem: str, rng: random.Random, cfg: CorpusConfig) -> list[Block]:
    """A generator/answer working under ``cfg``'s error model."""
    return solve(
        problem, rng, error=cfg.gen_error, borrow_bug=cfg.borrow_bug, carry_bug=cfg.carry_bug
    )


def expected_generator_accuracy(problem: str, cfg: CorpusConfig) -> float:
    """P(a generator/answer example of ``problem`` is right) under ``cfg``: exact, for tests."""
    return expected_accuracy(problem, cfg.gen_error, cfg.borrow_bug, cfg.carry_bug)


def _fields(problem: Problem, **extra: object) -> dict[str, object]:
    return {"problem": problem.prompt, "n": N_CANDIDATES, **extra}


def _right(blocks: list[Block], problem: Problem) -> bool:
    return blocks[-1].result == int(problem.answer)


@MATH.writes("generator", "answer")
def generator_answer(problem: Problem, rng: random.Random, cfg: CorpusConfig) -> Example:
    blocks = generator_blocks(problem.prompt, rng, cfg)
    prompt = render("tiny", "math", "generator", "answer", _fields(problem))
    return Example("generator", "answer", prompt, format_working(blocks), _right(blocks, problem))


def critique(blocks: list[Block], rng: random.Random, cfg: CorpusConfig) -> tuple[str, Fix | None]:
    """The evaluator's critique of a working, and what it asks a revision to change (None when
    it accepts): ``5-1=4 bad, 5-1-1=3; \boxed{Incorrect}`` or ``ok; \boxed{Correct}``."""
    accept = "ok; " + boxed("Correct")
    found = first_error(blocks)
    if found is not None:
        blind = found.systematic and rng.random() < cfg.eval_bug_blind
        if blind or rng.random() < cfg.eval_noise:
            return accept, None
        value = found.right_value
        if rng.random() < cfg.eval_fix_noise:
            value = slip(value, rng, digit=blocks[found.block].op == "-")
        text = f"{found.written} bad, {found.right_lhs}={value}; " + boxed("Incorrect")
        trusted = None if value == found.right_value else value
        return text, Fix(found.block, found.column, trusted)
    if rng.random() < cfg.eval_noise:  # a right answer rejected, with a wrong "correction"
        i = rng.randrange(len(blocks))
        j = rng.randrange(len(blocks[i].columns))
        col = blocks[i].columns[j]
        value = slip(col.value, rng, digit=blocks[i].op == "-")
        text = f"{col.text} bad, {col.text.rsplit('=', 1)[0]}={value}; " + boxed("Incorrect")
        return text, Fix(i, j, value)
    return accept, None


def _reviewed_answer(problem: Problem, rng: random.Random, cfg: CorpusConfig) -> list[Block]:
    """A generator answer, drawn wrong with probability ``review_wrong_share``."""
    want_wrong = rng.random() < cfg.review_wrong_share
    blocks = generator_blocks(problem.prompt, rng, cfg)
    for _ in range(50):
        if _right(blocks, problem) != want_wrong:
            break
        blocks = generator_blocks(problem.prompt, rng, cfg)
    return blocks


@MATH.writes("evaluator", "review")
def evaluator_review(problem: Problem, rng: random.Random, cfg: CorpusConfig) -> Example:
    blocks = _reviewed_answer(problem, rng, cfg)
    text, _ = critique(blocks, rng, cfg)
    fields = _fields(problem, answer=format_working(blocks))
    prompt = render("tiny", "math", "evaluator", "review", fields)
    verdict_right = text.endswith(boxed("Correct")) == _right(blocks, problem)
    return Example("evaluator", "review", prompt, text, verdict_right)


@MATH.writes("generator", "revise")
def generator_revise(problem: Problem, rng: random.Random, cfg: CorpusConfig) -> Example:
    """A revision after an Incorrect critique (the only case where Eval-Opt revises)."""
    for _ in range(100):
        blocks = _reviewed_answer(problem, rng, cfg)
        text, fix = critique(blocks, rng, cfg)
        if fix is not None:
            break
    else:  # the evaluator never rejected (unlikely): a bare rejection, no column named
        text, fix = "bad; " + boxed("Incorrect"), None
    if fix is not None and rng.random() < cfg.revise_trust:
        new = solve(
            problem.prompt,
            rng,
            error=cfg.revise_error,
            borrow_bug=cfg.borrow_bug,
            carry_bug=cfg.carry_bug,
            fix=fix,
        )
    else:
        new = generator_blocks(problem.prompt, rng, cfg)
    fields = _fields(problem, answer=format_working(blocks), critique=text)
    prompt = render("tiny", "math", "generator", "revise", fields)
    return Example("generator", "revise", prompt, format_working(new), _right(new, problem))


def pick(
    values: list, gold: object, rng: random.Random, cfg: Any, key: Callable = lambda v: v
) -> int:
    """Index chosen by one of the three selection policies (see CorpusConfig): check (the first
    value equal to ``gold``), majority (the first value whose ``key`` is the most common one;
    a None key does not vote; 0 when none votes) or a uniformly random one. Shared by the math
    corpus (values: boxed answers) and the code corpus (programs, voting by ``code_key``)."""
    u = rng.random()
    if u < cfg.select_check:
        for i, v in enumerate(values):
            if v == gold:
                return i
    elif u >= cfg.select_check + cfg.select_majority:
        return rng.randrange(len(values))
    keys = [key(v) for v in values]
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return 0
    top = max(votes.values())
    return next(i for i, k in enumerate(keys) if k is not None and votes[k] == top)


@MATH.writes("aggregator", "select")
def aggregator_select(problem: Problem, rng: random.Random, cfg: CorpusConfig) -> Example:
    cands = [generator_blocks(problem.prompt, rng, cfg) for _ in range(N_CANDIDATES)]
    values: list[int | None] = [c[-1].result for c in cands]
    k = pick(values, int(problem.answer), rng, cfg)
    fields = _fields(problem, candidates=numbered([format_working(c) for c in cands], "tiny"))
    prompt = render("tiny", "math", "aggregator", "select", fields)
    return Example("aggregator", "select", prompt, boxed(k + 1), values[k] == int(problem.answer))


def plan_lines(
    rng: random.Random,
    cfg: Any,
    strategies: tuple[str, ...] = STRATEGIES,
    bad: str = BAD_STRATEGY,
) -> list[str]:
    """Strategies of one orchestrator plan (before the ``STRATEGY i:`` prefixes): the world's
    three ``strategies`` shuffled, one repeated at ``cfg.plan_repeat``, one replaced by the
    ``bad`` one at ``cfg.plan_bad``, cut to 1 or 2 at ``cfg.plan_short``. Shared by the math and
    code corpora."""
    lines = list(strategies)
    rng.shuffle(lines)
    if rng.random() < cfg.plan_repeat:
        i = rng.randrange(3)
        lines[i] = lines[(i + rng.choice((1, 2))) % 3]
    if rng.random() < cfg.plan_bad:
        lines[rng.randrange(3)] = bad
    if rng.random() < cfg.plan_short:
        lines = lines[: rng.choice((1, 2))]
    return lines


@MATH.writes("orchestrator", "plan")
def orchestrator_plan(problem: Problem, rng: random.Random, cfg: CorpusConfig) -> Example:
    text = "\n".join(f"STRATEGY {i}: {s}" for i, s in enumerate(plan_lines(rng, cfg), 1))
    prompt = render("tiny", "math", "orchestrator", "plan", _fields(problem))
    return Example("orchestrator", "plan", prompt, text, None)


def worker_text(
    problem: str, strategy: str, rng: random.Random, cfg: CorpusConfig
) -> tuple[str, int]:
    """(working in the strategy's style, its boxed value). Unknown strategies work directly."""
    bugs = {"borrow_bug": cfg.borrow_bug, "carry_bug": cfg.carry_bug}
    if strategy == "show carries":
        blocks = solve(problem, rng, error=cfg.careful_error, explicit=True, **bugs)
        return format_working(blocks), blocks[-1].result
    order = "left" if strategy == BAD_STRATEGY else "precedence"
    blocks = solve(problem, rng, error=cfg.worker_error, order=order, **bugs)
    if strategy != "check inverse":
        return format_working(blocks), blocks[-1].result
    last = blocks[-1]
    line, ok = check_line(last)
    parts = [*(b.text() for b in blocks), line]
    value = last.result
    if not ok:  # redo the last block: right at inverse_fix, else with a fresh slip
        slip_col = -1 if rng.random() < cfg.inverse_fix else rng.randrange(len(last.columns))
        redo = column_block(
            last.a,
            last.op,
            last.b,
            edit=lambda c, v: slip(v, rng, digit=last.op == "-") if c == slip_col else v,
        )
        parts.append(redo.text())
        value = redo.result
    return "; ".join([*parts, boxed(value)]), value


@MATH.writes("worker", "solve")
def worker_solve(problem: Problem, rng: random.Random, cfg: CorpusConfig) -> Example:
    strategy = rng.choice((*STRATEGIES, BAD_STRATEGY))
    text, value = worker_text(problem.prompt, strategy, rng, cfg)
    prompt = render("tiny", "math", "worker", "solve", _fields(problem, strategy=strategy))
    return Example("worker", "solve", prompt, text, value == int(problem.answer))


@MATH.writes("synthesizer", "conclude")
def synthesizer_conclude(problem: Problem, rng: random.Random, cfg: CorpusConfig) -> Example:
    plan = plan_lines(rng, cfg)
    plan += ["direct"] * (N_CANDIDATES - len(plan))  # the engine fills missing ones with "direct"
    sols = [worker_text(problem.prompt, s, rng, cfg) for s in plan]
    values: list[int | None] = [v for _, v in sols]
    k = pick(values, int(problem.answer), rng, cfg)
    fields = _fields(problem, solutions=numbered([t for t, _ in sols], "tiny"))
    prompt = render("tiny", "math", "synthesizer", "conclude", fields)
    completion = f"use {k + 1}; " + boxed(values[k])
    return Example("synthesizer", "conclude", prompt, completion, values[k] == int(problem.answer))


MAKERS = MATH.makers()
make_example = MATH.make_example
examples = MATH.examples
