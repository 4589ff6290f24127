"""The four workflows of the paper (SPEC §2) as specs, and the parsers they use.

Choices the spec leaves open, made here:

* Eval-Opt does not call the evaluator after the last allowed revision: its verdict could change
  nothing. Rounds used = number of revisions made.
* Voting's fallback for an unparseable or out-of-range selection is the first candidate
  (counted as ``selection_fallback``). Majority-vote accuracy breaks ties by first appearance;
  candidates with no boxed answer do not vote. On code problems (a problem whose ``meta`` holds
  ``tests``) the "answer" a candidate votes with is its program, normalised by
  ``marlow.rewards.code.code_key`` (identical programs agree; no hidden test is run to vote);
  candidates with no code do not vote.
* Orch-Workers keeps the first ``n`` distinct ``STRATEGY i:`` lines with 1 <= i <= n, by index;
  each missing index is filled with the prompt style's generic strategy (counted as ``strategy_missing``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from marlow.parsers import selection_of, strategies_of, verdict_of
from marlow.rewards.code import code_key
from marlow.rewards.math import last_boxed, normalize_answer
from marlow.types import Problem, Turn
from marlow.workflows.spec import (
    EpisodeState,
    Grader,
    Stage,
    WorkflowSpec,
    last_text,
    register_workflow,
)


def parse_verdict(state: EpisodeState, turns: list[Turn]) -> None:
    """Evaluator verdict: ``\\boxed{Correct}`` accepts; anything unparseable counts as Incorrect."""
    verdict = verdict_of(turns[-1].completion_text)
    state.vars["accepted"] = verdict is True
    state.count(
        {True: "verdict_correct", False: "verdict_incorrect", None: "verdict_unparsed"}[verdict]
    )


def parse_strategies(n: int) -> Callable[[EpisodeState, list[Turn]], None]:
    def parse(state: EpisodeState, turns: list[Turn]) -> None:
        strategies = strategies_of(turns[-1].completion_text, n)
        parsed = sum(s is not None for s in strategies)
        state.count("strategies_parsed", parsed)
        if parsed < n:
            state.count("strategy_missing", n - parsed)
        state.vars["strategies"] = strategies  # None: generic

    return parse


def parse_selection(n: int) -> Callable[[EpisodeState, list[Turn]], None]:
    def parse(state: EpisodeState, turns: list[Turn]) -> None:
        choice = selection_of(turns[-1].completion_text, n)
        state.vars["choice"] = 0 if choice is None else choice
        if choice is None:
            state.count("selection_fallback")

    return parse


def voting_answer(state: EpisodeState) -> str:
    candidates = state.turns_of("generator")
    return candidates[state.vars.get("choice", 0)].completion_text if candidates else ""


def boxed_key(text: str) -> str | None:
    """A math answer for voting: the last boxed answer, normalised (None: no box)."""
    boxed = last_boxed(text)
    return normalize_answer(boxed) if boxed is not None else None


def answer_key(problem: Problem) -> Callable[[str], str | None]:
    """How a candidate's answer is read for voting on ``problem``: its program on a code
    problem (``meta["tests"]``), else its boxed answer."""
    return code_key if "tests" in problem.meta else boxed_key


def majority_index(texts: list[str], key: Callable[[str], str | None] = boxed_key) -> int | None:
    """Majority vote over the candidates' answers read by ``key`` (default: boxed, normalised):
    the index of the first candidate holding the most common answer; ties go to the answer seen
    first; None when no candidate has an answer."""
    votes: Counter[str] = Counter()
    first_of: dict[str, int] = {}
    for i, text in enumerate(texts):
        key_i = key(text)
        if key_i is not None:
            key_i = str(key_i)
            votes[key_i] += 1
            first_of.setdefault(key_i, i)
    if not votes:
        return None
    top = max(votes.values())
    winner = min((k for k, v in votes.items() if v == top), key=first_of.__getitem__)
    return first_of[winner]


def voting_extras(state: EpisodeState, grade: Grader) -> dict[str, float]:
    """pass@N (any candidate correct) and majority-vote accuracy beside the aggregator's."""
    texts = [t.completion_text for t in state.turns_of("generator")]
    correct = [grade(t, state.problem) >= 1.0 for t in texts]
    m = majority_index(texts, answer_key(state.problem))
    return {
        "pass_at_n": float(any(correct)),
        "majority_correct": float(m is not None and correct[m]),
    }


def single() -> WorkflowSpec:
    return WorkflowSpec("single", (Stage("generator", "answer"),), last_text("generator"))


def eval_opt(rounds: int = 3) -> WorkflowSpec:
    """Generator, evaluator, then up to ``rounds`` revisions while the verdict is Incorrect."""
    if rounds < 0:
        raise ValueError(f"eval_opt rounds must be >= 0, got {rounds}")

    def rejected(state: EpisodeState) -> bool:
        return not state.vars.get("accepted", False)

    stages = [Stage("generator", "answer"), Stage("evaluator", "review", parse=parse_verdict)]
    for r in range(1, rounds + 1):
        stages.append(Stage("generator", "revise", round=r, when=rejected))
        if r < rounds:
            stages.append(Stage("evaluator", "review", round=r, when=rejected, parse=parse_verdict))

    def extras(state: EpisodeState, grade: Grader) -> dict[str, float]:
        return {"rounds_used": float(len(state.turns_of("generator")) - 1)}

    return WorkflowSpec("eval_opt", tuple(stages), last_text("generator"), extras)


def voting(n: int = 3) -> WorkflowSpec:
    """``n`` generators answer independently; the aggregator selects one by number."""
    if n < 1:
        raise ValueError(f"voting n must be >= 1, got {n}")
    stages = (
        Stage("generator", "answer", slots=n),
        Stage("aggregator", "select", parse=parse_selection(n)),
    )
    return WorkflowSpec("voting", stages, voting_answer, voting_extras, n=n)


def orch_workers(n: int = 3) -> WorkflowSpec:
    """Orchestrator proposes ``n`` strategies; ``n`` workers follow one each; synthesizer ends."""
    if n < 1:
        raise ValueError(f"orch_workers n must be >= 1, got {n}")
    stages = (
        Stage("orchestrator", "plan", parse=parse_strategies(n)),
        Stage("worker", "solve", slots=n),
        Stage("synthesizer", "conclude"),
    )
    return WorkflowSpec("orch_workers", stages, last_text("synthesizer"), n=n)


for _name, _factory in (
    ("single", single),
    ("eval_opt", eval_opt),
    ("voting", voting),
    ("orch_workers", orch_workers),
):
    register_workflow(_name, _factory)
