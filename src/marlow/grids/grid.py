"""Grids: axes and shared settings in one YAML file, expanded to named cells.

A grid file::

    workflows: [voting, eval_opt, orch_workers]   # the multi-agent workflows to train
    policies: [ip, sp]
    scales: [tiny-s, tiny-m]                       # tiny scales or Hugging Face ids / paths
    tasks: [math, code]                            # or custom, or an installed task
    seeds: [0, 1]
    controls: [base, sa-rl, transfer]              # any of these; default: base and sa-rl,
                                                   # so a grid without this key runs them too
    settings: {steps: 24, optim: {lr: 1e-3}}       # config for every cell (preset default: tiny)
    variants:                                      # optional: named settings, each a copy of
      lr3e-3: {optim: {lr: 3e-3}}                  # the whole grid over those settings
      kl: {optim: {lr: 3e-3}, mitigate: {kl_coef: {generator: 0.1}}}
    exclude:                                       # optional: combinations not to run
      - {scale: tiny-m, task: code}

expands to, for every (task, scale, seed):

* one **trained** cell per (workflow, policy): ``Voting-IP-tiny-s-Math``;
* **base** controls: every workflow of the grid (and Single when SA-RL is on) on the untrained
  model, validation only: ``Voting-Base-tiny-s-Math``;
* the **SA-RL** control: Single trained with the same settings: ``Single-SA-tiny-s-Math``;
* **transfer** diagnostics: the SA-RL adapter on the generator role of each multi-agent workflow,
  every other role on the base, validation only: ``Voting-Transfer-tiny-s-Math`` (runs after its
  SA-RL cell). Orch-Workers has no generator role, so, to the letter of the paper (A.2: "the
  evaluator, aggregator, orchestrator, worker, and synthesizer roles fall through to the base
  model"), its transfer cell runs every role on the base and needs no SA-RL cell: it must equal
  its base cell, a check on the pair.

A task is any name ``task.name`` takes (``marlow tasks``): ``math``, ``code``, an installed
task (its own name in cell names: ``Voting-IP-tiny-s-Sums``), or ``custom`` with its data and
reward in ``settings`` (``task: {source: ..., reward: ...}``: ``Voting-IP-tiny-s-Custom``); an
unknown name fails when the grid is loaded, with the valid ones.

Names follow ``{Workflow}-{Policy}-{Scale}-{Task}[-{variant}][-s{seed}]``; the seed
suffix is written when the grid has more than one seed. **Variants** (a choice of marlow): each
named variant is the whole grid again, controls included, under its settings merged over
``settings``; its cells carry the variant's name, and the report keeps variants apart by showing
the scale as ``tiny-s lr3e-3`` (so an IP cell is matched with the SP cell of its own variant, and
compared with its own variant's base and SA-RL). Choices of marlow: ``single`` in ``workflows``
adds no trained cells of its own (under one role, SP and IP are the same run: it *is* the SA-RL
control, which it switches on); a Hugging Face scale is named by its last path part without a
``Qwen3-`` prefix (``Qwen/Qwen3-1.7B`` -> ``1.7B``). Settings are layered preset -> ``settings``
-> the cell's own axes, and every cell is validated when the grid is loaded, so a bad grid
fails before anything runs.

**Exclude** (as in a CI build matrix): each entry names axis values (``workflow``, ``policy``,
``scale``, ``task``, ``seed``, ``variant``); every cell that matches all of an entry's values is
dropped, controls included (a control's ``policy`` is its kind: ``base``, ``sa-rl``,
``transfer``; the SA-RL control's workflow is ``single``). A value that is not on its axis is an
error, as is an exclusion that leaves a transfer cell without its SA-RL cell, so a typo cannot
silently keep or drop cells.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from marlow.config import ConfigError, RunConfig, merge, resolve, yaml_problem
from marlow.config.titles import POLICY_TITLES, scale_title
from marlow.rollout.base import check_backend_name
from marlow.training.distributed import resolve_seeding
from marlow.workflows.load import workflow_title
from marlow.workflows.spec import is_workflow_file, workflow_names
from marlow.workflows.validate import check_run_config

CONTROLS = ("base", "sa-rl", "transfer")
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
Kind = Literal["trained", "base", "sa-rl", "transfer"]


class CellResources(BaseModel):
    """What each cell asks Ray for (``marlow grid --runner ray``); the local runner sizes itself
    (:func:`marlow.grids.pools.plan_workers`) and only logs them."""

    model_config = ConfigDict(extra="forbid")

    gpus: float = Field(0.0, ge=0.0, description="GPUs per cell (a fraction shares one GPU)")
    cpus: int | None = Field(None, ge=1, description="CPUs per cell (default: its torch threads)")
    custom: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources per cell, e.g. {A100: 1}"
    )


class GridSpec(BaseModel):
    """A grid file's top level: the axes whose values multiply into cells, the control cells, the
    settings every cell gets and what each cell asks a Ray cluster for."""

    model_config = ConfigDict(extra="forbid")

    workflows: list[str] = Field(
        default_factory=lambda: ["voting"],
        min_length=1,
        description="built-in workflow names or workflow files (.yaml)",
    )
    policies: list[Literal["ip", "sp"]] = Field(
        default_factory=lambda: ["ip", "sp"], description="the routings trained per workflow"
    )
    scales: list[str] = Field(
        default_factory=lambda: ["tiny-s"],
        min_length=1,
        description="models: tiny scales or Hugging Face ids / paths",
    )
    tasks: list[str] = Field(
        default_factory=lambda: ["math"], min_length=1, description="task names (marlow tasks)"
    )
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, description="run seeds")
    controls: list[Literal["base", "sa-rl", "transfer"]] = Field(
        default_factory=lambda: ["base", "sa-rl"],
        description="control cells: base (each workflow on the untrained model, validation "
        "only), sa-rl (Single trained with the same settings), transfer (the SA-RL adapter on "
        "each workflow's generator role, the others on the base, validation only)",
    )
    settings: dict[str, Any] = Field(
        default_factory=dict, description="config settings every cell gets (nested, as in a config)"
    )
    variants: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="named setting sets; each multiplies the grid's cells (e.g. a mitigation)",
    )
    exclude: list[dict[Literal["workflow", "policy", "scale", "task", "seed", "variant"], Any]] = (
        Field(
            default_factory=list,
            description="cells left out: each entry names axis values, and a cell matching all "
            "of one entry's is excluded",
        )
    )
    resources: CellResources = Field(
        default_factory=CellResources, description="what each cell asks a Ray cluster for"
    )

    @field_validator("variants")
    @classmethod
    def _variant_names(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in v:
            if not VARIANT_NAME.fullmatch(name):
                raise ValueError(
                    f"variant name {name!r} must be letters, digits, '.', '_' or '-' (it goes "
                    "into cell names)"
                )
        return v

    @field_validator("workflows")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        unknown = [w for w in v if w not in workflow_names() and not is_workflow_file(w)]
        if unknown:
            raise ValueError(
                f"unknown workflow {unknown[0]!r}; valid: {', '.join(workflow_names())}, "
                "or the path of a workflow file (.yaml)"
            )
        return v

    @model_validator(mode="after")
    def _exclusions_name_axis_values(self) -> GridSpec:
        axes = {
            "workflow": [*self.workflows, "single"],
            "policy": [*self.policies, *CONTROLS],
            "scale": self.scales,
            "task": self.tasks,
            "seed": self.seeds,
            "variant": list(self.variants),
        }
        for i, entry in enumerate(self.exclude):
            if not entry:
                raise ValueError(f"exclude[{i}] is empty; name at least one axis value")
            for axis, value in entry.items():
                if value not in axes[axis]:
                    valid = (
                        ", ".join(str(v) for v in axes[axis]) or "none (the grid has no such axis)"
                    )
                    raise ValueError(
                        f"exclude[{i}].{axis} = {value!r} is not on the grid; valid: {valid}"
                    )
        return self


@dataclass(frozen=True)
class Cell:
    """One run of a grid: its name, what it is, and its resolved config."""

    name: str
    kind: Kind
    workflow: str
    policy: str  # ip | sp | base | sa-rl | transfer
    scale: str
    task: str
    seed: int
    config: RunConfig = field(repr=False, compare=False)
    needs: tuple[str, ...] = ()  # cells that must finish first (a transfer needs its SA-RL)
    variant: str | None = None  # the grid variant it belongs to, if the grid has variants
    title: str = ""  # the workflow's title, as in the cell's name (the report calls it so)

    def matches(self, entry: dict[str, Any]) -> bool:
        """Whether every axis value of an ``exclude`` entry is this cell's."""
        return all(getattr(self, axis) == value for axis, value in entry.items())

    def describe(self) -> dict[str, Any]:
        """The cell's identity as stored in ``cell.json`` (everything but the config)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "workflow": self.workflow,
            "title": self.title or workflow_title(self.workflow),
            "policy": self.policy,
            "scale": self.scale,
            "task": self.task,
            "seed": self.seed,
            "needs": list(self.needs),
            **({"variant": self.variant} if self.variant is not None else {}),
        }


def cell_name(
    workflow: str, policy: str, scale: str, task: str, seed: int | None, variant: str | None = None
) -> str:
    parts = [workflow_title(workflow), POLICY_TITLES[policy], scale_title(scale), task.title()]
    parts += [variant] if variant is not None else []
    return "-".join(parts) + (f"-s{seed}" if seed is not None else "")


def load_grid(path: str | Path, overrides: list[str] | None = None) -> GridSpec:
    """The grid file at ``path``; ``overrides`` (``key=value``, as for ``marlow train``) are
    merged over its ``settings``, so they reach every cell (and each cell's checks)."""
    spec = _read_grid(Path(path))
    if overrides:
        from marlow.config import parse_overrides

        spec = spec.model_copy(
            update={"settings": merge(spec.settings, parse_overrides(overrides))}
        )
    return spec


def describe_cells(grid: GridSpec, cells: list[Cell]) -> str:
    """The line ``marlow grid --dry-run`` ends with: how many cells, trained and controls, and
    whether the controls are the default ones (which a grid gets without a ``controls`` key)."""
    trained = sum(c.kind == "trained" for c in cells)
    kinds = {k: sum(c.kind == k for c in cells) for k in ("sa-rl", "base", "transfer")}
    parts = [f"{n} {k}" for k, n in kinds.items() if n]
    line = f"{len(cells)} cells: {trained} trained" + "".join(f", {p}" for p in parts)
    if "controls" not in grid.model_fields_set and grid.controls:
        line += (
            f" (controls {', '.join(grid.controls)} are the default: set `controls: []` in the "
            "grid file for none)"
        )
    return line


def _read_grid(path: Path) -> GridSpec:
    if not path.is_file():
        raise FileNotFoundError(f"grid file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"grid file {path}: byte {err.start} is not UTF-8 text; save it as UTF-8"
        ) from None
    except yaml.YAMLError as err:
        line, problem = yaml_problem(err)
        where = f" at line {line}" if line is not None else ""
        raise ConfigError(f"grid file {path} is not valid YAML{where}: {problem}") from None
    return parse_grid(data, str(path))


def parse_grid(data: dict[str, Any], where: str = "grid") -> GridSpec:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a grid is a mapping of axes; valid keys: {_keys()}")
    try:
        return GridSpec.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        path, msg = list(first["loc"]), first["msg"].removeprefix("Value error, ")
        if not path:  # a check across keys (exclude against the axes): the message names them
            raise ConfigError(f"{where}: {msg}") from None
        if path[-1] == "[key]":  # a mapping key that is not allowed, e.g. an exclude axis
            path, msg = path[:-2], f"{msg}, not {path[-2]!r}"
        loc = ".".join(str(p) for p in path)
        if first["type"] == "extra_forbidden":
            raise ConfigError(f"{where}: grid key {loc!r} is unknown; valid: {_keys()}") from None
        raise ConfigError(f"{where}: grid key {loc!r}: {msg}") from None


def _keys() -> str:
    return ", ".join(GridSpec.model_fields)


def expand(grid: GridSpec) -> list[Cell]:
    """Every cell of the grid, controls included, in a stable order (trained cells first, so a
    partial grid has the comparisons before the controls)."""
    trained: list[Cell] = []
    controls: list[Cell] = []
    for variant in list(grid.variants) or [None]:
        for task in grid.tasks:
            for scale in grid.scales:
                for seed in grid.seeds:
                    point = _Point(grid, task, scale, seed, variant)
                    trained += point.trained()
                    controls += point.controls()
    cells = [c for c in trained + controls if not any(c.matches(e) for e in grid.exclude)]
    seen: set[str] = set()
    for c in cells:
        if c.name in seen:
            raise ConfigError(f"two cells are both named {c.name}; make the axes distinct")
        seen.add(c.name)
    for c in cells:
        lost = [n for n in c.needs if n not in seen]
        if lost:
            raise ConfigError(
                f"exclude drops {lost[0]}, which {c.name} needs; exclude both or neither"
            )
    return cells


@dataclass(frozen=True)
class _Point:
    """One (task, scale, seed[, variant]) of a grid: its trained cells and its controls."""

    grid: GridSpec
    task: str
    scale: str
    seed: int
    variant: str | None = None

    @property
    def multi(self) -> list[str]:
        return [w for w in self.grid.workflows if w != "single"]

    @property
    def sa_rl(self) -> bool:
        g = self.grid
        return "sa-rl" in g.controls or "single" in g.workflows or "transfer" in g.controls

    def name(self, workflow: str, policy: str) -> str:
        suffix = self.seed if len(self.grid.seeds) > 1 else None
        return cell_name(workflow, policy, self.scale, self.task, suffix, self.variant)

    def cell(self, kind: Kind, workflow: str, title: str, needs=(), **over: Any) -> Cell:
        """A cell named ``{workflow}-{title}-...``; ``over`` are its own config settings."""
        name = self.name(workflow, title)
        settings = merge(self.grid.settings, self.grid.variants.get(self.variant or "", {}))
        config = merge(
            merge({} if "preset" in settings else {"preset": "tiny"}, settings),
            {
                "seed": self.seed,
                "model": {"name": self.scale},
                "task": {"name": self.task},
                "workflow": {"name": workflow},
                **over,
            },
        )
        try:
            # a cell runs in one process: rollout.seeding=auto is call, as its config.yaml says
            resolved, _ = resolve_seeding(resolve(config), 1)
            spec = check_run_config(resolved)  # workflow name, params, roles: before anything runs
            check_backend_name(resolved)
        except ConfigError as err:
            raise ConfigError(f"cell {name}: {err}") from None
        return Cell(
            name,
            kind,
            workflow,
            title,
            self.scale,
            self.task,
            self.seed,
            resolved,
            tuple(needs),
            self.variant,
            spec.title,
        )

    def trained(self) -> list[Cell]:
        return [
            self.cell("trained", w, p, policy={"routing": p})
            for w in self.multi
            for p in self.grid.policies
        ]

    def controls(self) -> list[Cell]:
        out: list[Cell] = []
        if self.sa_rl:
            out.append(self.cell("sa-rl", "single", "sa-rl", policy={"routing": "ip"}))
        if "base" in self.grid.controls:
            for w in (["single"] if self.sa_rl else []) + self.multi:
                out.append(self.cell("base", w, "base", policy={"routing": "base"}, steps=0))
        if "transfer" in self.grid.controls:
            sa_name = self.name("single", "sa-rl")
            for w in self.multi:
                role_map = _transfer_map(w)
                needs = (sa_name,) if "generator" in role_map else ()
                routing = {"routing": "map", "role_map": role_map}
                out.append(self.cell("transfer", w, "transfer", needs, policy=routing, steps=0))
        return out


def _transfer_map(workflow: str) -> dict[str, str]:
    """Generator -> the SA-RL adapter (named ``generator``: Single under IP), the rest on base."""
    from marlow.types import BASE
    from marlow.workflows import build_workflow

    roles = build_workflow(workflow).roles
    return {r: ("generator" if r == "generator" else BASE) for r in roles}
