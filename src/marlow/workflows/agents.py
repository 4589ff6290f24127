"""The agents a workflow acts through: the base model with a LoRA adapter for each adapter its
routing names, the tokenizer, the routing, the prompts' family and style, the episode rules held
within the model's context, and the rollout engine that samples from them.

:func:`build_agents` builds them for a training run (:class:`marlow.training.trainer.Trainer`)
and for a trained workflow (:func:`marlow.serving.trained.load_workflow`), so a run's
validation and its trained workflow's answers come from the same model, prompts and engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from marlow.config import ConfigError, RunConfig
from marlow.models import load_base, prompt_style, task_family
from marlow.policy.adapters import LoraSpec, attach_adapters, load_adapter_weights
from marlow.policy.routing import Routing, make_routing
from marlow.rollout.base import engine_for_run, served_positions
from marlow.workflows.spec import EpisodeRules, WorkflowSpec


@dataclass
class Agents:
    """What :func:`build_agents` built; :meth:`close` stops the engine (a vLLM engine runs in
    processes of its own)."""

    base: Any  # the frozen base model
    tokenizer: Any
    model: Any  # the base with its adapters (the base itself when the routing has none)
    routing: Routing
    family: str  # the task family the prompts are written for
    style: str  # the prompts' style: tiny or chat
    positions: int | None  # the longest sequence the engine serves (None: the model does not say)
    rules: EpisodeRules  # held within ``positions``
    engine: Any

    @property
    def adapters(self) -> list[str]:
        return self.routing.adapters

    def close(self) -> None:
        self.engine.close()


def build_agents(
    config: RunConfig,
    workflow: WorkflowSpec,
    device: torch.device,
    *,
    log: Callable[[str], None] | None = None,
    base_folder: Path | None = None,
    style: str | None = None,
    weights: Path | None = None,
) -> Agents:
    """The agents of ``config``'s model, ``workflow``'s roles and ``config.policy``'s routing,
    on ``device``. ``base_folder``: a copy of the base's weights to load instead of
    ``model.name`` (an export's); ``style``: the prompts' style recorded with it (default: the
    model's, :func:`marlow.models.prompt_style`); ``weights``: a folder of saved adapters
    (``NAME/`` for each adapter) loaded before the engine starts, where a trained workflow
    answers (a run starts from the adapters' initialisation, seeded by ``config.seed``)."""
    family = task_family(config.model, config.task)
    base, tokenizer = load_base(
        config.model, log=log, task=family, dtype=config.dtype, device=device, folder=base_folder
    )
    positions = served_positions(config, base)  # None: the model does not say
    rules = EpisodeRules.of(config).within_context(positions, config.rollout.max_new_tokens)
    pol = config.policy
    routing = make_routing(pol.routing, workflow.roles, pol.role_map)
    model = base
    if routing.adapters:
        lora = LoraSpec(pol.lora_rank, pol.lora_alpha, pol.lora_dropout, pol.target_modules)
        model = attach_adapters(base, routing.adapters, lora, seed=config.seed)
        if weights is not None:
            _load_weights(model, weights, routing, pol.routing)
    engine = engine_for_run(config, model, tokenizer, device)
    return Agents(
        base,
        tokenizer,
        model,
        routing,
        family,
        style or prompt_style(config.model.name),
        positions,
        rules,
        engine,
    )


def _load_weights(model: Any, folder: Path, routing: Routing, name: str) -> None:
    missing = [a for a in routing.adapters if not (folder / a).is_dir()]
    if missing:
        there = ", ".join(sorted(p.name for p in folder.iterdir() if p.is_dir())) or "none"
        raise ConfigError(
            f"{folder} has no adapter {missing[0]!r} for the routing {name}; adapters there: "
            f"{there}"
        )
    load_adapter_weights(model, folder, routing.adapters)
