"""The one engine that runs every workflow spec.

For a batch of problems and ``n`` episodes each, the engine walks the spec's stages in order.
At each stage it collects the calls of *every* episode that runs the stage (all B x n episodes,
all slots) and sends them to the rollout engine in one request list, so a stage costs one
batched generation per adapter. Each turn keeps the exact prompt token ids it was sampled from.

Parse failures never stop an episode: they are counted in ``Episode.counters``.

Grading: a grader is a (text, problem) -> reward function. A grader that also has
``prefetch(pairs)`` (the code task's: one sandbox run per program, cached) is first handed every
(text, problem) this call will grade, in one batch, so the programs of a step run in parallel
and each distinct one once; the per-text calls that follow read its cache. A user's reward
(``marlow.rewards.user``) is called the same way, one call per batch. A grader may return NaN
(``marlow.rewards.user.NoReward``): the item has no reward, is never correct, and the trainer
leaves it out of its group (``marlow.training.batch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from marlow.parsers import plan_of, selection_of, strategies_of, verdict_of
from marlow.policy.routing import Routing
from marlow.prompts import DEFAULT_SET, GENERIC_STRATEGY, fill, numbered, template
from marlow.prompts.chat import chat_prompt_ids
from marlow.rollout.base import RolloutEngine
from marlow.types import (
    Completion,
    Episode,
    GenRequest,
    Problem,
    SamplingParams,
    Turn,
)
from marlow.workflows.role_rewards import assign_role_rewards
from marlow.workflows.spec import EpisodeRules, EpisodeState, Grader, Stage, WorkflowSpec
from marlow.workflows.stage_kinds import StageContext, kind_conditions, stage_kind
from marlow.workflows.votes import selection_extras


def _text(turns: list[Turn]) -> str:
    return turns[-1].completion_text.strip() if turns else ""


def read(state: EpisodeState, source: str, role: str, slot: int, style: str) -> str:
    """One declared read (``SOURCE.ROLE``, marlow.workflows.schema.SOURCES) of a slot's prompt."""
    if source == "last":
        return _text(state.turns_of(role))
    if source == "own":
        return _text([t for t in state.turns_of(role) if t.slot == slot])
    if source == "plan":
        plan = state.plans.get(role, [])
        strategy = plan[slot] if slot < len(plan) else None
        return strategy if strategy is not None else GENERIC_STRATEGY[style]
    latest = state.latest.get(role, [])
    if source == "others":
        latest = [t for t in latest if t.slot != slot]
    return numbered([t.completion_text for t in latest], style)


def stage_reads(state: EpisodeState, stage: Stage, slot: int, style: str) -> dict[str, str]:
    """The stage's declared reads in a slot of an episode, by field name."""
    return {r.field: read(state, r.source, r.role, slot, style) for r in stage.reads}


def prompt_fields(
    state: EpisodeState, stage: Stage, slot: int, style: str, params: dict[str, int]
) -> dict[str, object]:
    """Every field the stage's prompt may use: the problem, the parameters, its reads."""
    return {"problem": state.problem.prompt, **params, **stage_reads(state, stage, slot, style)}


def prompt_text(
    workflow: WorkflowSpec, stage: Stage, style: str, task: str, fields, prompts: str = DEFAULT_SET
) -> str:
    """The stage's prompt: a template of the prompt set ``prompts`` (``ROLE/VARIANT``;
    :func:`marlow.prompts.template`) or the role's own, filled."""
    if "/" in stage.prompt:
        role, variant = stage.prompt.split("/")
        text = template(style, task, role, variant, prompts)
        return fill(text, fields, f"{prompts if style == 'chat' else style}/{task}/{stage.prompt}")
    own = workflow.prompts[(stage.role, stage.prompt)]
    text = next((own[k] for k in ((style, task), (style, "*"), ("*", "*")) if k in own), None)
    label = f"workflow {workflow.name} role {stage.role} prompt {stage.prompt}"
    if text is None:
        known = ", ".join(f"{s}/{t}" for s, t in sorted(own))
        raise ValueError(f"{label} has no template for style {style}, task {task}; has: {known}")
    return fill(text, fields, label)


def parse(
    stage: Stage, state: EpisodeState, turn: Turn, rule: str = "last-box", workers: str = "fixed"
) -> None:
    """What the stage's parser reads from its turn into the episode's state (counted); ``rule``
    reads verdicts and selections (``marlow.parsers.PARSE_RULES``); ``workers="parsed"`` reads a
    plan the official code's way (``marlow.parsers.plan_of``: 1..n strategies, no generic one)."""
    text = turn.completion_text
    if stage.parser == "verdict":
        state.verdict = verdict_of(text, rule)
        state.count(
            {True: "verdict_correct", False: "verdict_incorrect", None: "verdict_unparsed"}[
                state.verdict
            ]
        )
    elif stage.parser == "selection":
        source = next(r for r in stage.reads if r.source == "outputs")
        turns = state.latest.get(source.role, [])
        state.candidates = [t.completion_text for t in turns]
        choice = selection_of(text, len(state.candidates), rule)
        if choice is None:
            state.count("selection_fallback")  # the first candidate
        state.selected_turn = turns[choice or 0] if turns else None
        state.selected = state.selected_turn.completion_text if turns else ""
    elif stage.parser == "strategies" and workers == "parsed":
        state.plans[stage.role] = plan_of(text, stage.count)
        state.count("strategies_parsed", len(state.plans[stage.role]))
    elif stage.parser == "strategies":
        strategies = strategies_of(text, stage.count)
        parsed = sum(s is not None for s in strategies)
        state.count("strategies_parsed", parsed)
        if parsed < stage.count:
            state.count("strategy_missing", stage.count - parsed)
        state.plans[stage.role] = strategies  # None: generic


def final_turn(workflow: WorkflowSpec, state: EpisodeState) -> Turn | None:
    """The turn whose text is the episode's answer (``workflow.answer``), None without one."""
    if workflow.answer == "selected":
        return state.selected_turn
    if workflow.answer == "latest":
        turns = [t for t in state.episode.turns if t.kind == "answer"]
    else:
        turns = state.turns_of(workflow.answer.split(".", 1)[1])
    return turns[-1] if turns else None


def extras(
    workflow: WorkflowSpec, state: EpisodeState, grade: Grader, correct_at: float = 1.0
) -> dict[str, float]:
    """``rounds_used`` (a workflow with rounds: the highest round the episode reached) and, beside
    a selection, pass@N and majority-vote accuracy over its candidates."""
    out: dict[str, float] = {}
    if workflow.rounds:
        out["rounds_used"] = float(max((t.round for t in state.episode.turns), default=0))
    if any(s.parser == "selection" for s in workflow.stages):
        out.update(selection_extras(state.candidates, state.problem, grade, correct_at))
    return out


def conversation(state: EpisodeState) -> list[tuple[str, str]]:
    """The episode so far as one chat (``workflow.context=conversation``, the official code's
    shared history): its first prompt as the user, then every turn's output, in order, as the
    assistant; empty before the first turn."""
    turns = state.episode.turns
    if not turns:
        return []
    return [("user", turns[0].prompt_text), *(("assistant", t.completion_text) for t in turns)]


def slots_of(stage: Stage, state: EpisodeState, workers: str) -> int:
    """The stage's slots in this episode: ``stage.slots``; under ``workers="parsed"``, a stage
    that reads a plan runs one slot per strategy of it (1..slots)."""
    if workers == "parsed":
        for r in stage.reads:
            if r.source == "plan":
                return max(1, min(stage.slots, len(state.plans.get(r.role, []))))
    return stage.slots


def holds(condition: str, state: EpisodeState) -> bool:
    """Whether a stage's ``when`` (marlow.workflows.schema.CONDITIONS, or a stage kind's
    condition) holds for an episode."""
    if condition == "verdict_incorrect":
        return state.verdict is not True
    if condition == "verdict_correct":
        return state.verdict is True
    if condition == "always":
        return True
    return kind_conditions()[condition][1].holds(state)


def stage_context(index: int, style: str, rules: EpisodeRules) -> StageContext:
    """What a stage kind's run gets (:mod:`marlow.workflows.stage_kinds`): each episode's slots
    and reads exactly as a role's stage at ``index`` would have them."""
    return StageContext(
        index,
        style,
        rules,
        slots=lambda stage, st: slots_of(stage, st, rules.workers),
        reads=lambda stage, st, slot: stage_reads(st, stage, slot, style),
    )


def stage_seed(seed: int, stage_index: int) -> int:
    """A distinct, reproducible sampling seed per (call seed, stage)."""
    return (seed * 1_000_003 + stage_index * 7919) % (2**63 - 1)


def request_seed(stage: int, group: int, sample: int, slot: int) -> int:
    """A request's own seed (``rollout.seeding=request``): a function of the stage's seed and the
    turn's place in the step (problem index in the whole batch, sample, slot), never of the
    rank or the batch it is generated in."""
    return (stage * 2_654_435_761 + group * 40_503 + sample * 977 + slot * 31 + 1) % (2**63 - 1)


Call = tuple[EpisodeState, int, str, list[int]]  # an episode, a slot, its prompt text and ids


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
    rules: EpisodeRules = EpisodeRules(),
    first_group: int = 0,
) -> list[Episode]:
    """Run ``n`` episodes of ``workflow`` on each problem under ``rules`` (:class:`EpisodeRules`:
    credit, seeding, parsing, workers, context, prompt cap); grade each final answer (and, under
    ``credit="role"``, each turn: ``marlow.workflows.role_rewards``). Problem i's episodes are group
    ``first_group + i`` (a data-parallel rank's shard starts at its offset in the whole batch).
    An episode ended by the prompt cap runs none of its later stages; its answer is the
    workflow's answer from the turns it has (empty when it has none), graded as any other. A
    turn's ``prompt_text`` is its own message; its ``prompt_ids`` are everything the sampler saw
    (under ``context="conversation"``, the episode's chat so far first)."""
    states = [
        EpisodeState(Episode(problem_id=p.id, group=first_group + g, sample=s), p)
        for g, p in enumerate(problems)
        for s in range(n)
    ]
    for index, stage in enumerate(workflow.stages):
        active = [st for st in states if not st.ended and holds(stage.when, st)]
        if stage.options is not None:  # a registered stage kind's stage (a tool's)
            stage_kind(stage.kind).run(stage, active, stage_context(index, style, rules))
            continue
        adapter = routing.adapter_for(stage.role)
        calls = stage_calls(workflow, stage, active, tokenizer, task, style, rules)
        active = [st for st in active if not st.ended]  # the prompt cap may have ended some
        if not active:
            continue
        params = replace(sampling, seed=stage_seed(sampling.seed, index))
        completions = engine.generate(gen_requests(calls, adapter, params, rules), params)
        record_turns(stage, adapter, active, calls, completions, rules)
    grade_episodes(workflow, states, grade, rules)
    return [st.episode for st in states]


def stage_calls(
    workflow: WorkflowSpec,
    stage: Stage,
    active: Sequence[EpisodeState],
    tokenizer: object,
    task: str,
    style: str,
    rules: EpisodeRules,
) -> list[Call]:
    """The stage's calls in every active episode, one per slot, in episode order. An episode one
    of whose prompts is longer than ``rules.max_prompt_tokens`` is ended instead (counted
    ``prompt_cap``) and makes no call."""
    cap = rules.max_prompt_tokens
    calls: list[Call] = []
    for st in active:
        mine = episode_calls(workflow, stage, st, tokenizer, task, style, rules)
        if cap is not None and any(len(c[3]) > cap for c in mine):
            st.ended = True
            st.count("prompt_cap")
            continue
        calls += mine
    return calls


def episode_calls(
    workflow: WorkflowSpec,
    stage: Stage,
    st: EpisodeState,
    tokenizer: object,
    task: str,
    style: str,
    rules: EpisodeRules,
) -> list[Call]:
    """One episode's calls of the stage, one per slot: the filled prompt and the token ids the
    sampler sees (under ``context="conversation"``, the episode's chat so far first)."""
    shared = rules.context == "conversation" and workflow.conversation
    history = conversation(st) if shared else []
    params = dict(workflow.params)  # the workflow's parameters, prompt fields too
    calls: list[Call] = []
    for slot in range(slots_of(stage, st, rules.workers)):
        fields = prompt_fields(st, stage, slot, style, params)
        text = prompt_text(workflow, stage, style, task, fields, rules.prompts)
        calls.append((st, slot, text, chat_prompt_ids(tokenizer, text, history)))
    return calls


def gen_requests(
    calls: Sequence[Call], adapter: str, params: SamplingParams, rules: EpisodeRules
) -> list[GenRequest]:
    """The rollout engine's requests for the calls, under ``adapter``: each with its own seed
    (:func:`request_seed`), or none under ``rules.seeding="call"`` (then the call's generator,
    from the stage's seed ``params.seed``, samples them in order)."""
    return [
        GenRequest(
            ids,
            adapter,
            None
            if rules.seeding == "call"
            else request_seed(params.seed, st.episode.group, st.episode.sample, slot),
        )
        for st, slot, _, ids in calls
    ]


def record_turns(
    stage: Stage,
    adapter: str,
    active: Sequence[EpisodeState],
    calls: Sequence[Call],
    completions: Sequence[Completion],
    rules: EpisodeRules,
) -> None:
    """Each call's completion as a turn of its episode; then in every active episode the stage's
    turns become its latest of the role, and the stage's parser reads the last of them."""
    new_turns: dict[int, list[Turn]] = {id(st): [] for st in active}
    for (st, slot, text, ids), c in zip(calls, completions, strict=True):
        turn = Turn(
            role=stage.role,
            kind=stage.kind,
            slot=slot,
            round=stage.round,
            adapter=adapter,
            prompt_text=text,
            prompt_ids=ids,
            completion_ids=c.token_ids,
            sampler_logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            completion_text=c.text,
            trajectory=stage.trajectory_of(slot),
        )
        st.episode.turns.append(turn)
        new_turns[id(st)].append(turn)
    for st in active:
        st.keep(stage.role, new_turns[id(st)])
        if stage.parser is not None:
            parse(stage, st, new_turns[id(st)][-1], rules.parse, rules.workers)


def grade_episodes(
    workflow: WorkflowSpec, states: Sequence[EpisodeState], grade: Grader, rules: EpisodeRules
) -> None:
    """Each episode's final answer, then its reward, correctness, role rewards (``credit="role"``)
    and extras; a grader with ``prefetch`` first gets every text it will grade, in one batch."""
    for st in states:
        st.episode.set_final(final_turn(workflow, st))
    prefetch = getattr(grade, "prefetch", None)
    if prefetch is not None:  # the final answers and every answering turn (role credit, extras)
        prefetch([(text, st.problem) for st in states for text in graded_texts(st.episode)])
    for st in states:
        grade_episode(workflow, st, grade, rules)


def graded_texts(ep: Episode) -> list[str]:
    """The texts of an episode a grader reads: its final answer, then its answering turns'."""
    return [ep.final_answer, *(t.completion_text for t in ep.turns if t.kind == "answer")]


def grade_episode(
    workflow: WorkflowSpec, st: EpisodeState, grade: Grader, rules: EpisodeRules
) -> None:
    """The episode's reward and correctness, its turns' rewards under ``credit="role"``
    (``marlow.workflows.role_rewards``) and its extras."""
    ep = st.episode
    ep.reward = grade(ep.final_answer, st.problem)
    ep.correct = ep.reward >= rules.correct_at  # False for a missing (NaN) reward
    if rules.credit == "role":
        assign_role_rewards(
            ep.turns,
            ep.reward,
            lambda text: grade(text, st.problem),
            workflow.credit,
            rules.parse,
            rules.correct_at,
        )
    ep.info.update(extras(workflow, st, grade, rules.correct_at))
