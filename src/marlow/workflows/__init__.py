"""Workflows as data: a YAML file per workflow (schema.py, load.py), the built-in ones shipped as
files (files/*.yaml, registered by name in spec.py), one engine (engine.py), and the kinds of
stage that are not a role speaking (stage_kinds.py; the tool stage, tools.py, and the built-in
tools of code tasks, codetools.py)."""

from marlow.workflows.load import ParamError, build_workflow, load_workflow
from marlow.workflows.schema import KINDS, WorkflowFileError
from marlow.workflows.spec import (
    EpisodeState,
    Stage,
    WorkflowSpec,
    register_workflow,
    workflow_names,
)
from marlow.workflows.stage_kinds import Condition, StageContext, StageKind, register_stage_kind

__all__ = [
    "KINDS",
    "Condition",
    "StageContext",
    "StageKind",
    "EpisodeState",
    "ParamError",
    "Stage",
    "WorkflowFileError",
    "WorkflowSpec",
    "build_workflow",
    "load_workflow",
    "register_stage_kind",
    "register_workflow",
    "workflow_names",
]
