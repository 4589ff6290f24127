"""A trained workflow, loaded once, answering new inputs through the engine that trained it.

:func:`load_workflow` takes what training and export leave behind:

* a run folder (holding ``config.yaml``): its latest checkpoint, or the base model when it has
  none yet;
* a checkpoint folder (``RUN/checkpoints/step_NNNNNN``, holding ``DONE``);
* a bundle written by ``marlow export RUN OUT`` (``export.json`` naming the workflow): the base
  (copied, or a hub id), the adapters, the workflow file, the prompt set when it is a file of
  one's own, the config and the routing, so it answers on another machine with marlow installed
  and nothing else of the run.

:meth:`TrainedWorkflow.answer` runs the workflow's stages on a batch of questions as validation
does (:func:`marlow.workflows.engine.run_episodes`: every stage's calls of every question in one
request list to the rollout engine, each role on its adapter), and returns each final answer
and, on request, every turn (role, slot, round, adapter, prompt, completion). Sampling is the
run's validation sampling: ``rollout.val_temperature`` (default ``rollout.temperature``), the
validation seed and ``rollout.max_new_tokens``, unless a call says otherwise; at temperature 0 it
gives exactly the final answers ``marlow eval`` gives on the same problems at
``rollout.val_temperature=0``. A question is a problem's prompt (what fills ``{problem}``); no
reward is computed.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marlow.config import ConfigError, RunConfig, load_config
from marlow.models import resolve_device, vocabulary
from marlow.rollout.base import check_backend
from marlow.training import checkpoint as ckpt
from marlow.training.export import TOOLS_DIR
from marlow.training.seeds import validation_seed
from marlow.types import Problem, SamplingParams, unicode_text
from marlow.workflows.agents import build_agents
from marlow.workflows.engine import run_episodes
from marlow.workflows.validate import check_run_config, workflow_copy

BUNDLE_JSON = "export.json"
"""The record of an export folder; with the workflow and routing in it, a bundle."""


@dataclass
class Answer:
    """One question's answer: the workflow's final answer, and what it cost in tokens."""

    question: str
    text: str
    prompt_tokens: int  # over every turn of the episode
    completion_tokens: int
    finish: str  # the final answer's turn's finish reason: stop or length ("" without one)
    turns: list[dict[str, Any]] | None = field(default=None)  # with trace=True


@dataclass(frozen=True)
class Source:
    """What :func:`load_workflow` loaded: the config file, the adapters' folder (None: the base
    model), the base's folder for a bundle, the style of its prompts, a label and the step."""

    config: Path
    adapters: Path | None
    base: Path | None
    style: str | None
    label: str
    step: int
    workflow: str | None = None  # a bundle's workflow name (its file is workflow.yaml)


def _source(path: Path) -> Source:
    path = Path(path)
    bundle = _bundle(path)
    if bundle is not None:
        base = path / bundle["base_folder"] if bundle["base_folder"] else None
        adapters = path / "adapters" if (path / "adapters").is_dir() else None
        return Source(
            path / "config.yaml",
            adapters,
            base,
            bundle["style"],
            f"bundle {path}",
            bundle["step"],
            bundle["workflow"],
        )
    if (path / "config.yaml").is_file():  # a run folder (a grid's cell holds a DONE of its own)
        latest = ckpt.latest(path)
        if latest is None:
            return Source(path / "config.yaml", None, None, None, f"the base model of {path}", 0)
        return _source(latest)
    if (path / "DONE").is_file():
        ckpt.check(path)
        run = path.parent.parent
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"{path} is a checkpoint outside a run folder (no config.yaml)")
        label = f"checkpoint {path}"
        return Source(run / "config.yaml", path / "adapters", None, None, label, ckpt.step_of(path))
    raise ConfigError(
        f"{path} is neither a run folder (config.yaml), a checkpoint (DONE) nor a bundle "
        f"({BUNDLE_JSON} of marlow export)"
    )


def _bundle(path: Path) -> dict[str, Any] | None:
    """An export folder's record, when it is a bundle (it names the workflow it answers with)."""
    record = path / BUNDLE_JSON
    if not record.is_file():
        return None
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{record} is not readable JSON ({err})") from None
    if not isinstance(data, dict) or "workflow" not in data or "style" not in data:
        raise ConfigError(
            f"{path} is an export without what answering needs (workflow, routing, style); "
            "export the run again with this marlow"
        )
    return data


def load_workflow(
    path: str | Path, overrides: Sequence[str] = (), *, log: Any = None
) -> TrainedWorkflow:
    """Load a run, checkpoint or bundle (module docstring) to answer with; ``overrides`` are
    settings as everywhere (``rollout.max_new_tokens=256``, ``rollout.backend=vllm``)."""
    src = _source(Path(path))
    bundle = src.style is not None
    extra = list(overrides)
    root = src.config.parent
    if bundle:
        extra = [f"workflow.name={root / 'workflow.yaml'}", *extra]
        tools = root / TOOLS_DIR  # the tool files it carries, as modules (marlow export)
        if tools.is_dir() and str(tools) not in sys.path:
            sys.path.insert(0, str(tools))
        if (root / "prompts.yaml").is_file():
            extra = [f"workflow.prompts={root / 'prompts.yaml'}", *extra]
    if src.adapters is None:
        extra.append("policy.routing=base")
    config = load_config(src.config, extra)
    return TrainedWorkflow(config, src, None if bundle else workflow_copy(root), log=log)


class TrainedWorkflow:
    """A workflow with its adapters, ready to answer (module docstring). Use it as a context
    manager, or call :meth:`close`: a vLLM engine runs in processes of its own."""

    def __init__(
        self, config: RunConfig, source: Source, copy: Path | None = None, *, log: Any = None
    ):
        self.config = config
        self.source = source
        self.spec = check_run_config(config, copy)
        check_backend(config)
        self.device = resolve_device(config.device)
        self.agents = build_agents(
            config,
            self.spec,
            self.device,
            log=log,
            base_folder=source.base,
            style=source.style,
            weights=source.adapters,
        )
        self.agents.model.requires_grad_(False).eval()  # answering never trains
        self.tokenizer = self.agents.tokenizer
        self.characters = vocabulary(config.model.name)  # None: it reads any text
        self.positions = self.agents.positions  # None: the model does not say

    @property
    def name(self) -> str:
        """The workflow's name as ``marlow serve`` lists it."""
        return self.source.workflow or self.spec.name

    def close(self) -> None:
        self.agents.close()

    def __enter__(self) -> TrainedWorkflow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def unreadable(self, question: str) -> str:
        """The characters of ``question`` the model cannot read (a tiny model reads printable
        ASCII and newlines; training skips such rows), sorted; "" when it reads them all."""
        if self.characters is None:
            return ""
        return "".join(sorted(set(question) - set(self.characters)))

    def sampling(
        self, temperature: float | None = None, max_new_tokens: int | None = None
    ) -> SamplingParams:
        r = self.config.rollout
        if temperature is None:
            temperature = r.val_temperature if r.val_temperature is not None else r.temperature
        if not (isinstance(temperature, int | float) and math.isfinite(temperature)) or (
            temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        tokens = r.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {tokens!r}")
        return SamplingParams(float(temperature), tokens, validation_seed(self.config.seed))

    def answer(
        self,
        questions: str | Sequence[str],
        *,
        trace: bool = False,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        seed: int | None = None,
    ) -> Answer | list[Answer]:
        """The final answer to one question (an :class:`Answer`) or to each of a list, in order,
        all through the engine at once; ``trace`` adds every turn."""
        one = isinstance(questions, str)
        items = [questions] if one else list(questions)
        bad = [q for q in items if not isinstance(q, str) or not q.strip() or not unicode_text(q)]
        if bad:
            raise ValueError(
                f"a question must be non-empty text, valid unicode (no lone surrogate), got "
                f"{bad[0]!r}"
            )
        odd = next((q for q in items if self.unreadable(q)), None)
        if odd is not None:
            raise ValueError(
                f"question {odd[:60]!r} holds characters this model cannot read: "
                f"{self.unreadable(odd)!r} (a tiny model reads printable ASCII and newlines)"
            )
        params = self.sampling(temperature, max_new_tokens)
        if seed is not None:
            params = SamplingParams(params.temperature, params.max_new_tokens, int(seed))
        problems = [Problem(f"q{i}", q, "") for i, q in enumerate(items)]
        a = self.agents
        episodes = run_episodes(
            self.spec,
            problems,
            1,
            engine=a.engine,
            tokenizer=a.tokenizer,
            routing=a.routing,
            grade=_no_reward,
            task=a.family,
            style=a.style,
            sampling=params,
            rules=a.rules,
        )
        out = []
        for q, ep in zip(items, episodes, strict=True):
            final = ep.final_turn()
            out.append(
                Answer(
                    question=q,
                    text=ep.final_answer,
                    prompt_tokens=sum(len(t.prompt_ids) for t in ep.turns),
                    completion_tokens=sum(len(t.completion_ids) for t in ep.turns),
                    finish=final.finish_reason if final is not None else "",
                    turns=ep.transcript() if trace else None,
                )
            )
        return out[0] if one else out


def question_tokens(tokenizer, question: str) -> int:
    """How many tokens ``question`` is under ``tokenizer``, alone (no special tokens)."""
    return len(tokenizer(question, add_special_tokens=False)["input_ids"])


def _no_reward(_text: str, _problem: Problem) -> float:
    """Answering grades nothing: every episode's reward is 0."""
    return 0.0
