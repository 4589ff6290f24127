"""The one engine that runs every workflow spec.

For a batch of problems and ``n`` episodes each, the engine walks the spec's stages in order.
At each stage it collects the calls of *every* episode that runs the stage (all B x n episodes,
all slots) and sends them to the rollout engine in one request list, so a stage costs one
batched generation per adapter. Each turn keeps the exact prompt token ids it was sampled from.

Parse failures never stop an episode: they are counted in ``Episode.counters``.

Grading: a grader is a (text, problem) -> reward function. A grader that also has
``prefetch(pairs)`` (the code task's: one sandbox run per program, cached) is first handed every
(text, problem) this call will grade, in one batch, so the programs of a step run in parallel
and each distinct one once; the per-text calls that follow read its cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from marlow.chat import chat_prompt_ids
from marlow.policy.routing import Routing
from marlow.prompts import GENERIC_STRATEGY, numbered, render
from marlow.rollout.base import RolloutEngine
from marlow.types import Episode, GenRequest, Problem, SamplingParams, Turn
from marlow.workflows.credit import ANSWERING, assign_role_rewards
from marlow.workflows.spec import EpisodeState, Grader, WorkflowSpec


def context(state: EpisodeState, slot: int, style: str, n: int) -> dict[str, object]:
    """Every field a prompt template may use, from the episode so far."""
    gens = state.turns_of("generator")
    evals = state.turns_of("evaluator")
    workers = state.turns_of("worker")
    strategies = state.vars.get("strategies") or []
    strategy = strategies[slot] if slot < len(strategies) else None
    return {
        "problem": state.problem.prompt,
        "answer": gens[-1].completion_text.strip() if gens else "",
        "critique": evals[-1].completion_text.strip() if evals else "",
        "candidates": numbered([t.completion_text for t in gens], style),
        "solutions": numbered([t.completion_text for t in workers], style),
        "strategy": strategy if strategy is not None else GENERIC_STRATEGY[style],
        "n": n,
    }


def stage_seed(seed: int, stage_index: int) -> int:
    """A distinct, reproducible sampling seed per (call seed, stage)."""
    return (seed * 1_000_003 + stage_index * 7919) % (2**63 - 1)


def run_episodes(
    workflow: WorkflowSpec,
    problems: Sequence[Problem],
    n: int,
    *,
    engine: RolloutEngine,
    tokenizer: object,
    routing: Routing,
    grade: Grader,
    task: str,
    style: str,
    sampling: SamplingParams,
    credit: str = "broadcast",
) -> list[Episode]:
    """Run ``n`` episodes of ``workflow`` on each problem; grade each final answer (and, under
    ``credit="role"``, each turn: ``marlow.workflows.credit``)."""
    states = [
        EpisodeState(Episode(problem_id=p.id, group=g, sample=s), p)
        for g, p in enumerate(problems)
        for s in range(n)
    ]
    for index, stage in enumerate(workflow.stages):
        active = [st for st in states if stage.when is None or stage.when(st)]
        if not active:
            continue
        adapter = routing.adapter_for(stage.role)
        calls: list[tuple[EpisodeState, int, str, list[int]]] = []
        for st in active:
            for slot in range(stage.slots):
                fields = context(st, slot, style, workflow.n)
                text = render(style, task, stage.role, stage.variant, fields)
                calls.append((st, slot, text, chat_prompt_ids(tokenizer, text)))
        requests = [GenRequest(ids, adapter) for _, _, _, ids in calls]
        params = replace(sampling, seed=stage_seed(sampling.seed, index))
        completions = engine.generate(requests, params)
        new_turns: dict[int, list[Turn]] = {}
        for (st, slot, text, ids), c in zip(calls, completions, strict=True):
            turn = Turn(
                role=stage.role,
                slot=slot,
                round=stage.round,
                adapter=adapter,
                prompt_text=text,
                prompt_ids=ids,
                completion_ids=c.token_ids,
                sampler_logprobs=c.logprobs,
                finish_reason=c.finish_reason,
                completion_text=c.text,
            )
            st.episode.turns.append(turn)
            new_turns.setdefault(id(st), []).append(turn)
        if stage.parse is not None:
            for st in active:
                stage.parse(st, new_turns[id(st)])
    for st in states:
        st.episode.final_answer = workflow.answer(st)
    prefetch = getattr(grade, "prefetch", None)
    if prefetch is not None:  # the final answers and every answering turn (role credit, extras)
        prefetch(
            [
                (text, st.problem)
                for st in states
                for text in [
                    st.episode.final_answer,
                    *(t.completion_text for t in st.episode.turns if t.role in ANSWERING),
                ]
            ]
        )
    for st in states:
        ep = st.episode
        ep.reward = grade(ep.final_answer, st.problem)
        ep.correct = ep.reward >= 1.0
        if credit == "role":
            assign_role_rewards(ep.turns, ep.reward, lambda text, p=st.problem: grade(text, p))
        if workflow.extras is not None:
            ep.info.update(workflow.extras(st, grade))
    return [st.episode for st in states]
