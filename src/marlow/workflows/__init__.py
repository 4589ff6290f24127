"""Workflows as data (spec.py), the built-in four (builtin.py), one engine (engine.py)."""

from marlow.workflows import builtin as _builtin  # noqa: F401  (registers the built-ins)
from marlow.workflows.spec import (
    EpisodeState,
    Stage,
    WorkflowSpec,
    build_workflow,
    register_workflow,
    workflow_names,
)

__all__ = [
    "EpisodeState",
    "Stage",
    "WorkflowSpec",
    "build_workflow",
    "register_workflow",
    "workflow_names",
]
