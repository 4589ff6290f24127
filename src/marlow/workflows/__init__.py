"""Workflows as data: a YAML file per workflow (schema.py, load.py), the built-in four shipped as
files (files/*.yaml, registered by name in spec.py), one engine (engine.py)."""

from marlow.workflows.load import ParamError, build_workflow, load_workflow
from marlow.workflows.schema import KINDS, WorkflowFileError
from marlow.workflows.spec import (
    EpisodeState,
    Stage,
    WorkflowSpec,
    register_workflow,
    workflow_names,
)

__all__ = [
    "KINDS",
    "EpisodeState",
    "ParamError",
    "Stage",
    "WorkflowFileError",
    "WorkflowSpec",
    "build_workflow",
    "load_workflow",
    "register_workflow",
    "workflow_names",
]
