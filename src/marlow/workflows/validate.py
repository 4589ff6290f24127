"""Checks of a run config that need the workflow registry: run before anything is loaded or written.

``marlow.config`` validates every field on its own but cannot know the registered workflows or
their roles (it stays below the workflows layer and imports nothing of it); these checks close
that gap, so that an unknown workflow name, a bad workflow file, a workflow parameter it does not
take or refuses, or a role map or role weight naming a role the workflow does not have, is one
line naming the field instead of a traceback minutes into a run. The trainer runs them first thing,
and a grid runs them on every cell when it is expanded.
"""

from __future__ import annotations

from pathlib import Path

from marlow.config import ConfigError, RunConfig, WorkflowConfig
from marlow.policy.routing import make_routing
from marlow.prompts import prompt_set
from marlow.workflows.load import ParamError, build_workflow
from marlow.workflows.spec import WorkflowSpec
from marlow.workflows.stage_kinds import prepare_stages


def check_workflow(cfg: WorkflowConfig, copy: Path | None = None) -> WorkflowSpec:
    """The workflow ``cfg`` names (a built-in name or a workflow file's path), built; ``copy``: a
    run folder's own copy of that file, read instead of the typed path
    (:func:`workflow_copy`). Raises ConfigError naming ``workflow.name``
    (an unknown name, a bad file) or ``workflow.params``."""
    try:
        workflow = build_workflow(cfg.name, cfg.rounds_count, copy=copy, **cfg.params)
    except ParamError as err:
        raise ConfigError(f"config field 'workflow.params': {err}") from None
    except ValueError as err:
        raise ConfigError(f"config field 'workflow.name': {err}") from None
    return workflow


WORKFLOW_COPY = "workflow.yaml"
"""A file workflow's text as the run started with it, in the run folder
(:func:`marlow.training.resume.record_workflow_file` writes it): ``config.yaml`` names only its
path, as typed (relative to the folder it was typed in), so every command that reads a run reads
this copy instead (:func:`workflow_copy`)."""


def workflow_copy(run_dir: Path) -> Path | None:
    """The run's own copy of its workflow file, once the run has records (``metrics.jsonl``);
    None for a built-in workflow or a folder no run has written to yet (a fresh start reads the
    path as typed and then keeps its text here). Inspect, eval, resume and the report read this,
    never the typed path, so a run folder reads the same from any folder and after its source
    file changed or moved."""
    copy = run_dir / WORKFLOW_COPY
    return copy if copy.is_file() and (run_dir / "metrics.jsonl").exists() else None


def run_workflow(run_dir: Path, cfg: RunConfig) -> WorkflowSpec:
    """The workflow spec of the run in ``run_dir`` trained with ``cfg``: a file workflow from the
    run's own copy (:func:`workflow_copy`). Raises ConfigError naming the field."""
    return check_workflow(cfg.workflow, copy=workflow_copy(run_dir))


def check_run_config(cfg: RunConfig, copy: Path | None = None) -> WorkflowSpec:
    """The run's workflow, built (``copy``: as in :func:`check_workflow`); raises ConfigError naming the field a workflow- or role-level
    setting gets wrong (``workflow.name``, ``workflow.params``, ``policy.role_map``,
    ``grpo.role_weights``, ``mitigate.kl_coef``, ``workflow.prompts``)."""
    workflow = check_workflow(cfg.workflow, copy)
    try:
        prepare_stages(workflow)
    except ConfigError as err:
        raise ConfigError(f"config field 'workflow.name': {err}") from None
    try:
        prompts = prompt_set(cfg.workflow.prompts)
    except ValueError as err:
        raise ConfigError(f"config field 'workflow.prompts': {err}") from None
    if prompts.style != "chat":
        raise ConfigError(
            f"config field 'workflow.prompts': {prompts.name} is a {prompts.style} set; it must "
            "be a chat set (a tiny model reads the tiny set by itself)"
        )
    from marlow.tiny.model import SCALES  # a tiny model reads the tiny set: no chat set runs

    chat = cfg.model.name not in SCALES
    if chat and prompts.context == "conversation" and cfg.workflow.context != "conversation":
        raise ConfigError(
            f"config field 'workflow.prompts': set {prompts.name} relies on the shared "
            "conversation (its reviewer sees 'the solution above'); set "
            "workflow.context=conversation, or choose a set whose context is any (marlow)"
        )
    roles = list(workflow.roles)
    try:
        make_routing(cfg.policy.routing, roles, cfg.policy.role_map)
    except ValueError as err:
        raise ConfigError(f"config field 'policy.role_map': {err}") from None
    for field, named in (
        ("grpo.role_weights", cfg.grpo.role_weights),
        ("mitigate.kl_coef", cfg.mitigate.kl_coef),
    ):
        unknown = sorted(
            set(named) - set(roles) - ({"*"} if field == "mitigate.kl_coef" else set())
        )
        if unknown:
            raise ConfigError(
                f"config field '{field}' names {', '.join(unknown)}, not a role of "
                f"workflow {cfg.workflow.name}; valid: {', '.join(roles)}"
            )
    return workflow
