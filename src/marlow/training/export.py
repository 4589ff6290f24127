"""``marlow export RUN DIR``: a run's base and adapters as a folder that needs no marlow.

The folder ``DIR`` holds::

    base/                 the base model as a Hugging Face folder (tiny scale or local folder;
                          absent for a hub id, which the adapters name instead)
    adapters/<name>/      each adapter of the chosen checkpoint, in PEFT format, its
                          adapter_config.json naming "base" (or the hub id) as its base
    export.json           the run, the step, the run's dtype and its base record (base.json)
    config.yaml           the run's config, for the record
    workflow.yaml         the workflow file answering reads (prompts.yaml: a prompt set of one's own)
    tools/                the files of tools the workflow calls by path, as modules of their own

so that, from ``DIR`` as the working folder (or with ``DIR/base`` spelled out)::

    base = AutoModelForCausalLM.from_pretrained("base", dtype=...)  # export.json's dtype
    model = PeftModel.from_pretrained(base, "adapters/<name>")

computes the run's logits. Choices of marlow, not fixed by the study: the latest checkpoint
unless ``step`` is given; a local-folder base *is* copied here (a standalone folder is the point
of an export; the run itself only names it); the base copied must still have the weights the
run recorded (sha256), else nothing is written. ``DIR`` must be absent or empty; it is built in a
temporary sibling and renamed into place, so a failed export leaves nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from marlow.config import ConfigError, RunConfig, load_config
from marlow.fileio import write_json
from marlow.policy.adapters import CONFIG_NAME, WEIGHTS_NAME
from marlow.training import checkpoint, runbase
from marlow.workflows.spec import is_workflow_file


class ExportError(ValueError):
    """A run that cannot be exported as asked, in one line naming the folder and the fix."""


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    """Write the standalone folder of ``run_dir``'s checkpoint ``step`` (default: the latest) to
    ``out_dir`` (module docstring); returns ``out_dir``. Every check comes before any write."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(
            f"no run folder {run_dir} (no config.yaml); give the --out of a `marlow train`"
        )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(
            f"{out_dir} already exists (a file or a non-empty folder); give a new one"
        )
    ckpt = _checkpoint(run_dir, step)
    record_path = run_dir / runbase.BASE_JSON
    if not record_path.is_file():
        raise ExportError(
            f"{run_dir} has no {runbase.BASE_JSON} (a run from an older marlow); resume it once "
            f"with `marlow train --out {run_dir} --resume` to record its base, then export"
        )
    record = runbase.BaseRecord.read(record_path)
    source = _base_source(run_dir, record)
    try:
        cfg = load_config(run_dir / "config.yaml")
    except ConfigError as err:
        raise ExportError(str(err)) from None
    dtype = cfg.dtype
    prompts = Path(cfg.workflow.prompts)
    if is_workflow_file(cfg.workflow.prompts) and not prompts.is_file():
        raise ExportError(
            f"the run's prompt set {prompts} is missing; restore it (a bundle carries its copy)"
        )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        named = record.name if source is None else runbase.BASE_DIR
        if source is not None:
            runbase.copy_hf_folder(source, tmp / runbase.BASE_DIR)
        adapters = ckpt / "adapters"  # absent when every role runs on the frozen base
        names = (
            sorted(p.name for p in adapters.iterdir() if p.is_dir()) if adapters.is_dir() else []
        )
        for name in names:
            _copy_adapter(adapters / name, tmp / "adapters" / name, named)
        shutil.copyfile(run_dir / "config.yaml", tmp / "config.yaml")
        answering = _answering(run_dir, cfg, tmp)
        write_json(
            tmp / "export.json",
            {
                "run": str(run_dir.resolve()),
                "step": checkpoint.step_of(ckpt),
                "dtype": dtype,
                "adapters": names,
                "base": asdict(record),
                "base_folder": runbase.BASE_DIR if source is not None else None,
                **answering,
            },
        )
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _answering(run_dir: Path, cfg: RunConfig, folder: Path) -> dict[str, Any]:
    """What answering needs beyond the weights, for ``marlow answer`` / ``serve`` on the bundle:
    the workflow file (``workflow.yaml``: the run's own copy, or the built-in's text), a prompt
    set of one's own (``prompts.yaml``), and in ``export.json`` the workflow's name and title,
    the routing (role -> adapter), the prompts' style and family, and the sampling settings."""
    from marlow.models import is_tiny, task_family
    from marlow.policy.routing import make_routing
    from marlow.workflows.spec import workflow_path
    from marlow.workflows.validate import run_workflow, workflow_copy

    spec = run_workflow(run_dir, cfg)
    source = workflow_copy(run_dir) or workflow_path(cfg.workflow.name)
    text = _carry_tools(Path(source).read_text(), spec.tools, folder)
    (folder / "workflow.yaml").write_text(text)
    if is_workflow_file(cfg.workflow.prompts):
        shutil.copyfile(cfg.workflow.prompts, folder / "prompts.yaml")
    routing = make_routing(cfg.policy.routing, spec.roles, cfg.policy.role_map)
    r = cfg.rollout
    return {
        "workflow": spec.name,
        "title": spec.title,
        "routing": {role: routing.adapter_for(role) for role in spec.roles},
        "style": "tiny" if is_tiny(cfg.model.name) else "chat",
        "family": task_family(cfg.model, cfg.task),
        "sampling": {
            "temperature": r.val_temperature if r.val_temperature is not None else r.temperature,
            "max_new_tokens": r.max_new_tokens,
        },
    }


TOOLS_DIR = "tools"
"""A bundle's folder of the tool files its workflow calls by path (on ``sys.path`` when it
answers)."""


def _carry_tools(text: str, tools: dict[str, str], folder: Path) -> str:
    """The workflow file's ``text`` for a bundle: each tool that calls a file by path
    (``path/file.py:function``, relative to the working folder, as the run read it) has its file
    copied into ``folder/tools`` as a module of a name of its own (``marlow_tool_<sha>``), and
    its ``call:`` rewritten to that module, so the bundle answers from any folder. The file is
    copied alone: modules it imports must be installed where the bundle answers. A file that is
    not found from here is an :class:`ExportError`."""
    import hashlib

    import yaml

    by_path = {name: call.rpartition(":") for name, call in tools.items() if ".py:" in call}
    if not by_path:
        return text
    renamed: dict[str, str] = {}
    for name, (where, _, function) in by_path.items():
        path = Path(where).expanduser()
        if not path.is_file():
            raise ExportError(
                f"tool {name} calls {where}, which is not found from {Path.cwd()}; export from "
                "the folder the run was started in"
            )
        module = "marlow_tool_" + hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        (folder / TOOLS_DIR).mkdir(exist_ok=True)
        shutil.copyfile(path, folder / TOOLS_DIR / f"{module}.py")
        renamed[tools[name]] = f"{module}:{function}"
    data = yaml.safe_load(text)

    def rewrite(stages: list) -> None:
        for stage in stages or []:
            if isinstance(stage, dict):
                if stage.get("call") in renamed:
                    stage["call"] = renamed[stage["call"]]
                rewrite(stage.get("stages"))

    rewrite(data.get("stages"))
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    done = {checkpoint.step_of(p): p for p in checkpoint.all_done(run_dir)}
    if not done:
        raise ExportError(
            f"{run_dir} has no checkpoint yet (checkpoints/step_*/DONE); "
            "train until a checkpoint is written (ckpt_every), then export"
        )
    if step is None:
        step = max(done)
    if step not in done:
        raise ExportError(
            f"--step {step}: {run_dir} has no such checkpoint; valid: {', '.join(map(str, done))}"
        )
    damage = checkpoint.verify(done[step])
    if damage is not None:
        raise ExportError(f"checkpoint {done[step]} is damaged: {damage}")
    return done[step]


def _base_source(run_dir: Path, record: runbase.BaseRecord) -> Path | None:
    """The folder to copy as ``base/`` (None for a hub id), after checking that its weights are
    still the ones the run recorded."""
    if record.kind == "hub":
        return None
    folder = run_dir / runbase.BASE_DIR if record.kind == "tiny" else Path(record.path)
    if not (folder / "config.json").is_file():
        raise ExportError(f"the run's base folder {folder} is missing; restore it to export")
    if runbase.weight_hashes(folder) != record.weights:
        raise ExportError(
            f"the weights in {folder} differ from those {run_dir / runbase.BASE_JSON} recorded "
            "(sha256); the adapters would not reproduce the run on them"
        )
    return folder


def _copy_adapter(src: Path, dst: Path, base_name: str) -> None:
    """One adapter folder, its config naming ``base_name`` as its base."""
    dst.mkdir(parents=True)
    shutil.copyfile(src / WEIGHTS_NAME, dst / WEIGHTS_NAME)
    config = json.loads((src / CONFIG_NAME).read_text())
    config["base_model_name_or_path"] = base_name
    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
