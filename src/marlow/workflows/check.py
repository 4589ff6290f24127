"""Checks of a run config that need its workflow's roles: run before anything is loaded or written.

``marlow.config`` validates every field on its own but cannot know a workflow's roles (it stays
below the workflows layer); these checks close that gap, so that a role map or role weight naming
a role the workflow does not have, or a workflow parameter its factory refuses, is one line
naming the field instead of a traceback minutes into a run.
"""

from __future__ import annotations

from marlow.config import ConfigError, RunConfig
from marlow.policy.routing import make_routing
from marlow.workflows.spec import WorkflowSpec, build_workflow


def check_run_config(cfg: RunConfig) -> WorkflowSpec:
    """The run's workflow, built; raises ConfigError naming the field a role-level setting
    gets wrong (``workflow.params``, ``policy.role_map``, ``grpo.role_weights``)."""
    try:
        workflow = build_workflow(cfg.workflow.name, **cfg.workflow.params)
    except ValueError as err:
        raise ConfigError(f"config field 'workflow.params': {err}") from None
    roles = list(workflow.roles)
    try:
        make_routing(cfg.policy.routing, roles, cfg.policy.role_map)
    except ValueError as err:
        raise ConfigError(f"config field 'policy.role_map': {err}") from None
    unknown = sorted(set(cfg.grpo.role_weights) - set(roles))
    if unknown:
        raise ConfigError(
            f"config field 'grpo.role_weights' names {', '.join(unknown)}, not a role of "
            f"workflow {cfg.workflow.name}; valid: {', '.join(roles)}"
        )
    return workflow
