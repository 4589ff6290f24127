"""What ``marlow workflows`` prints: the built-ins, and one workflow's stages, roles, kinds and the
prompts of an example episode.

The example episode runs the real engine on a stub problem with a stub sampler, so its prompts are
exactly the ones a run would render: every completion is the placeholder ``<ROLE output k>``
(k counts the role's completions over the episode), which parses as no verdict, no selection and no strategies, so
the fallbacks show (a judge's unparseable verdict counts as Incorrect: every revision round runs).
"""

from __future__ import annotations

from collections.abc import Sequence

from marlow.policy.routing import make_routing
from marlow.types import Completion, GenRequest, Problem, SamplingParams
from marlow.workflows.engine import run_episodes
from marlow.workflows.load import build_workflow
from marlow.workflows.spec import WorkflowSpec, workflow_names
from marlow.workflows.stage_kinds import prepare_stages

STUB = Problem("stub", "What is 12 + 30?", "42")


class _Placeholders:
    """A sampler whose k-th completion for an adapter is ``<ADAPTER output k>`` (IP: adapter =
    role), k counting over the whole episode, so a revision's prompt shows the answer it revises
    by its own number (``<generator output 2>`` is the generator's second answer, not its
    first)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def generate(self, requests: Sequence[GenRequest], params: SamplingParams) -> list[Completion]:
        texts = []
        for r in requests:
            self.calls[r.adapter] = k = self.calls.get(r.adapter, 0) + 1
            texts.append(f"<{r.adapter} output {k}>")
        return [Completion([0] * len(t), [0.0] * len(t), "stop", t) for t in texts]


class _Plain:
    """A tokenizer stand-in: the chat template is the text itself."""

    def apply_chat_template(self, messages, **_kw) -> str:
        return messages[0]["content"]

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [0] * len(text)}


def builtin_table() -> list[dict[str, str]]:
    """One row per built-in workflow: name, title, roles with their kinds, parameters."""
    rows = []
    for name in workflow_names():
        wf = build_workflow(name)
        rows.append(
            {
                "name": name,
                "title": wf.title,
                "roles": ", ".join(f"{r} ({k})" for r, k in wf.kinds.items()),
                "params": ", ".join(f"{k}={v}" for k, v in wf.params.items()) or "-",
            }
        )
    return rows


def describe(wf: WorkflowSpec, style: str = "tiny", task: str = "math") -> list[str]:
    """Lines that show ``wf``: roles and kinds, stages, answer, credit, and the prompts of one
    example episode on a stub problem (``style`` and ``task`` pick the templates)."""
    prepare_stages(wf)  # a tool's function imports (the example calls it)
    lines = [f"{wf.title} ({wf.name}, {wf.source})"]
    lines.append("roles: " + ", ".join(f"{r} ({k})" for r, k in wf.kinds.items()))
    if wf.params:
        lines.append("params: " + ", ".join(f"{k}={v}" for k, v in wf.params.items()))
    lines.append("stages:")
    for i, s in enumerate(wf.stages, 1):
        parts = [f"{s.role} x{s.slots}", f"prompt {s.prompt}", f"round {s.round}"]
        if s.options is not None:  # a stage kind's: its name, then its own fields
            own = {k: v for k, v in s.options.model_dump().items() if k != s.kind}
            parts = [f"{s.kind} {s.role} x{s.slots}", *(f"{k} {v}" for k, v in own.items())]
            parts.append(f"round {s.round}")
        if s.when != "always":
            parts.append(f"when {s.when}")
        if s.parser:
            parts.append(f"parser {s.parser}")
        if s.reads:
            parts.append("reads " + ", ".join(f"{r.field}={r.source}.{r.role}" for r in s.reads))
        lines.append(f"  {i}. " + "; ".join(parts))
    lines.append(f"answer: {wf.answer}")
    used = dict.fromkeys(wf.kinds.values())
    lines.append("credit (grpo.credit=role): " + ", ".join(f"{k} {wf.credit[k]}" for k in used))
    episode = run_episodes(
        wf,
        [STUB],
        1,
        engine=_Placeholders(),
        tokenizer=_Plain(),
        routing=make_routing("ip", wf.roles, None),
        grade=lambda text, problem: 0.0,
        task=task,
        style=style,
        sampling=SamplingParams(0.7, 16, 0),
    )[0]
    lines.append(f"example episode ({style} prompts, {task}; stub problem {STUB.prompt!r}):")
    for i, t in enumerate([*episode.turns, None]):
        for c in (c for c in episode.tools if c.after == i):
            lines.append(f"--- tool {c.tool} slot {c.slot} round {c.round} ({c.status}) output:")
            lines.extend(c.completion_text.splitlines())
        if t is not None:
            lines.append(f"--- {t.role} slot {t.slot} round {t.round} ({t.kind}) prompt:")
            lines.extend(t.prompt_text.splitlines())
    lines.append(f"--- final answer: {episode.final_answer}")
    return lines
