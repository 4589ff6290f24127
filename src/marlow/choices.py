"""The choices a config field offers, as types: the config's schema declares its fields with
them, and each module that acts on a choice derives its tuple of valid values from the same
type (``PARSE_RULES = get_args(ParseRule)``), so a new value is added in one place. This module
imports nothing of marlow's, so the lowest layers can read it."""

from __future__ import annotations

from typing import Literal

BuiltinTask = Literal["math", "code"]
"""``task.name`` values marlow ships (each with a tiny world); others are custom or installed."""

TaskFamily = Literal["math", "code", "general"]
"""``task.family``: which prompt templates a task's roles read."""

World = Literal["auto", "shipped", "rebuild"]
"""``model.world``: where a tiny model's weights come from."""

CodeBlockRule = Literal["fallback", "last-block"]
"""``task.code_block``: which fenced block of an answer is the program."""

ParseRule = Literal["last-box", "first-match"]
"""``workflow.parse``: how a verdict or a selection is read from a role's text."""

RoutingKind = Literal["sp", "ip", "map", "base"]
"""``policy.routing``: which adapter each role samples and trains."""

AdvantageScope = Literal["problem", "role", "slot", "trajectory"]
"""``grpo.advantage_scope``: the groups a turn's reward is normalised within."""

ScheduleStepping = Literal["per-step", "per-role-update", "shared-uncapped"]
"""``optim.schedule_stepping``: what advances each adapter's learning-rate schedule."""

SandboxRequire = Literal["none", "namespaces"]
"""``rewards.sandbox.require``: the isolation a run refuses to grade code without."""
