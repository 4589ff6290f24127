"""The ``marlow`` command. It only parses arguments and calls library functions.

Errors a user can fix (config, model id, run folder, a command-line flag) print one line and
exit 2, with rich markup escaped (a hint such as ``pip install 'marlow[data]'`` keeps its
``[data]``). A run folder that ``train`` or ``eval`` created is removed again when the command
then fails on such an error before the run wrote its first record (``metrics.jsonl``): a failed
start leaves nothing behind, a run that trained keeps its files.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console(stderr=True)


class _OneLineErrors(typer.core.TyperGroup):
    """Click's usage errors (an unknown option, a missing argument, a value of the wrong type) in
    marlow's one-line form instead of a usage box, with the same exit code (2)."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except typer.Abort:
            sys.exit(1)
        except typer.TyperException as err:  # typer's own click: its usage errors derive from it
            where = f" (see {err.ctx.command_path} --help)" if getattr(err, "ctx", None) else ""
            message = " ".join(err.format_message().split())
            console.print(
                f"[red]error:[/red] {escape(message)}{where}", highlight=False, soft_wrap=True
            )
            sys.exit(getattr(err, "exit_code", 2))
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, cls=_OneLineErrors)


@app.callback()
def _quiet_libraries() -> None:
    """marlow draws its own progress; Hugging Face's per-file bars ("Loading weights") are noise.
    Set through the environment so that spawned cell processes inherit it."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _check_out(out: Path) -> None:
    """An ``--out`` folder that can be made: not empty or the current folder, not a file, and no
    file on the way to it."""
    if str(out) in ("", ".") or out.resolve() == Path.cwd().resolve():
        _fail(f"--out {str(out)!r} is the current folder; give a folder for the run's files")
    if out.exists() and not out.is_dir():
        _fail(f"--out {out} is a file; give a folder (new or a run's)")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            _fail(f"--out {out}: {parent} is a file, not a folder; give a folder path")


def _run_folder(command: Callable) -> Callable:
    """Check ``--out`` first; when the command made it and then exits 2 before the run wrote its
    first record, remove it (a failed start leaves nothing behind)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        out: Path = kwargs["out"]
        _check_out(out)
        existed = out.exists()
        try:
            return command(*args, **kwargs)
        except typer.Exit as stop:
            first = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 owns the folder
            if (
                stop.exit_code == 2
                and first
                and not existed
                and not (out / "metrics.jsonl").exists()
            ):
                shutil.rmtree(out, ignore_errors=True)
            raise

    return wrapper


def _user_errors():
    from marlow.config import ConfigError
    from marlow.fileio import DamagedFileError
    from marlow.models import ModelLoadError
    from marlow.train.checkpoint import CheckpointError
    from marlow.train.nonfinite import NonFiniteRun
    from marlow.train.resume import ResumeError
    from marlow.train.sync import AdapterSyncError

    return (
        ConfigError,
        DamagedFileError,
        ModelLoadError,
        FileExistsError,
        FileNotFoundError,
        CheckpointError,
        ResumeError,
        NonFiniteRun,
        AdapterSyncError,
    )


def _split_args(args: list[str] | None) -> tuple[Path | None, list[str]]:
    """The first argument without '=' is the config; the rest are key=value overrides."""
    config: Path | None = None
    overrides: list[str] = []
    for arg in args or []:
        if "=" not in arg and config is None:
            config = Path(arg)
        else:
            overrides.append(arg)
    return config, overrides


def _log(message: str) -> None:
    console.print(f"[dim]{escape(message)}[/dim]", highlight=False)


@app.command()
@_run_folder
def train(
    args: Annotated[
        list[str] | None, typer.Argument(help="[CONFIG.yaml] [key=value ...]", show_default=False)
    ] = None,
    out: Annotated[Path, typer.Option(help="run folder")] = Path("runs/run"),
    resume: Annotated[
        bool,
        typer.Option(
            help="continue the run in --out with its own config.yaml (settings given with it "
            "may only extend steps or change logging and sinks)"
        ),
    ] = False,
    resume_from: Annotated[
        int | None,
        typer.Option(help="resume from this checkpoint step instead of the latest", min=0),
    ] = None,
    nproc: Annotated[
        int,
        typer.Option(
            help="data-parallel processes on this machine: launches torchrun --nproc_per_node "
            "NPROC -m marlow train (needs rollout.seeding=request)",
            min=1,
        ),
    ] = 1,
) -> None:
    """Train one cell with GRPO."""
    resuming = resume or resume_from is not None
    if nproc > 1:
        _launch_data_parallel(nproc, args or [], out, resume, resume_from)
        return
    try:
        cfg = _train_config(args, out, resuming, resume_from)
        from marlow.train.trainer import Trainer

        trainer = Trainer(cfg, out, log=_log)
        with _progress(cfg.steps) as (progress, task):

            def on_step(step: int, record: dict) -> None:
                acc = record.get("val/all/accuracy")
                reward = record.get("train/all/reward")
                desc = f"reward {reward:.3f}" if reward is not None else ""
                if acc is not None:
                    desc += f"  val acc {acc:.3f}"
                progress.update(task, completed=step, description=desc)

            trainer.run(resume=resuming, resume_from=resume_from, on_step=on_step)
    except _user_errors() as err:
        _fail(str(err))
    console.print(f"run written to {out}")


def _train_config(args: list[str] | None, out: Path, resuming: bool, resume_from: int | None):
    """The run's config: a resumed run's own (``marlow.train.resume``), else file + overrides."""
    from marlow.config import load_config
    from marlow.train.resume import resume_config

    config, overrides = _split_args(args)
    if resuming:
        return resume_config(out, config, overrides, resume_from)
    return load_config(config, overrides)


def _launch_data_parallel(
    nproc: int, args: list[str], out: Path, resume: bool, resume_from: int | None
) -> None:
    """``marlow train --nproc N``: check the settings here (one line, nothing launched), then run
    ``torchrun --standalone --nproc_per_node N -m marlow train ...`` and exit with its code."""
    from marlow.train.distributed import check_world

    try:
        cfg = _train_config(args, out, resume or resume_from is not None, resume_from)
        check_world(cfg, nproc)
    except _user_errors() as err:
        _fail(str(err))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(nproc), "-m", "marlow", "train", *args, "--out", str(out)]
    if resume:
        command.append("--resume")
    if resume_from is not None:
        command += ["--resume-from", str(resume_from)]
    code = subprocess.run(command).returncode
    if code:
        raise typer.Exit(code)


@app.command("eval")
@_run_folder
def evaluate(
    args: Annotated[
        list[str] | None,
        typer.Argument(help="[CONFIG.yaml | RUN_DIR] [key=value ...]", show_default=False),
    ] = None,
    checkpoint: Annotated[
        Path | None, typer.Option(help="a checkpoint folder (default: the base)")
    ] = None,
    out: Annotated[Path, typer.Option(help="where to write the evaluation")] = Path("runs/eval"),
) -> None:
    """Evaluate the base model or a checkpoint through a workflow on the validation split."""
    from marlow.train.evaluate import evaluate as run_eval

    config, overrides = _split_args(args)
    try:
        result = run_eval(config, overrides, checkpoint=checkpoint, out=out, log=_log)
    except _user_errors() as err:
        _fail(str(err))
    print(json.dumps(result, indent=2))


@app.command("pretrain-tiny")
def pretrain_tiny_cmd(
    scale: Annotated[str, typer.Option(help="tiny-s, tiny-m or tiny-l")] = "tiny-s",
    steps: Annotated[
        int | None, typer.Option(help="override the scale's pretraining steps")
    ] = None,
    task: Annotated[str, typer.Option(help="the tiny world: math or code")] = "math",
    threads: Annotated[
        int | None, typer.Option(help="torch threads (default: every core)", min=1)
    ] = None,
    report: Annotated[
        bool, typer.Option(help="measure the greedy generator on validation problems")
    ] = True,
) -> None:
    """Pre-train a tiny scale (cached by a hash of its config), report its greedy generator's
    accuracy and print its folder."""
    from marlow.tiny.pretrain import pretrain_tiny

    try:
        path = pretrain_tiny(scale, steps=steps, log=_log, task=task, threads=threads)
    except ValueError as err:
        _fail(str(err))
    if report:
        from marlow.experiments.tinyeval import greedy_report

        scores = greedy_report(path, task)
        n, accuracy = int(scores["problems"]), scores["accuracy"]
        _log(f"{scale} ({task}): greedy generator accuracy {accuracy:.3f} on {n} val problems")
        if scores.get("sandbox_errors"):
            _log(
                f"WARNING: {int(scores['sandbox_errors'])} of {n} programs got no verdict (the "
                "sandbox failed to set up): the accuracy above undercounts"
            )
    print(path)


@app.command()
def quickstart(
    overrides: Annotated[
        list[str] | None, typer.Argument(help="key=value settings for every cell")
    ] = None,
    out: Annotated[Path, typer.Option(help="output folder")] = Path("marlow-quickstart"),
    seed: Annotated[int, typer.Option()] = 0,
    steps: Annotated[
        int | None, typer.Option(help="training steps per cell (default: tiny preset)")
    ] = None,
    task: Annotated[str, typer.Option(help="the tiny world: math or code")] = "math",
) -> None:
    """Pre-train the tiny model, train Voting-IP, Voting-SP and SA-RL, compare with the base."""
    from marlow.config import parse_overrides
    from marlow.experiments.quickstart import quickstart as run_quickstart

    _check_out(out)

    bars = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not sys.stderr.isatty(),
    )
    tasks: dict[str, int] = {}

    def on_progress(name: str, step: int, total: int) -> None:
        if name not in tasks:
            tasks[name] = bars.add_task(name, total=max(total, 1))
        bars.update(tasks[name], completed=step if total else 1)

    with bars:
        try:
            settings = parse_overrides(overrides or [])
            summary = run_quickstart(
                out,
                seed=seed,
                steps=steps,
                settings=settings,
                task=task,
                log=_log,
                on_progress=on_progress,
            )
        except (*_user_errors(), RuntimeError) as err:
            _fail(str(err))
    table = Table(title=f"validation accuracy ({out})")
    for col in ("cell", "peak", "peak step", "final", "n val"):
        table.add_column(col)
    for name, row in summary["cells"].items():
        table.add_row(
            name,
            f"{row['peak_accuracy']:.3f}",
            str(row["peak_step"]),
            f"{row['final_accuracy']:.3f}",
            str(row["n_val"]),
        )
    Console().print(table)
    for name, gain in summary["voting_gain_over_base"].items():
        Console().print(
            f"{name}: {gain['peak_minus_base']:+.1f} points over the base at its peak, "
            f"{gain['final_minus_base']:+.1f} at the end"
        )
    t = summary["timings_s"]
    Console().print(
        f"total {t['total_s']:.0f} s (pretrain/cache {t['pretrain_or_cache_s']:.0f} s, "
        f"cells {t['cells_s']:.0f} s); summary.json and val_curves.png in {out}"
    )


@app.command()
def grid(
    file: Annotated[Path, typer.Argument(help="a grid YAML file (axes and shared settings)")],
    out: Annotated[Path, typer.Option(help="results folder")] = Path("runs/grid"),
    runner: Annotated[str, typer.Option(help="local or ray")] = "local",
    address: Annotated[
        str | None, typer.Option(help="Ray cluster address (default: start a local Ray)")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="cells at once (default: sized to cores and memory)")
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="list the cells and stop")] = False,
) -> None:
    """Run every cell of a grid (skipping finished ones, resuming interrupted ones)."""
    from marlow.experiments.grid import expand, load_grid
    from marlow.experiments.runner import run_grid

    _check_out(out)

    try:
        spec = load_grid(file)
        if dry_run:
            for cell in expand(spec):
                print(cell.name)
            return
        bars = Progress(
            TextColumn("{task.description:<34}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[state]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not sys.stderr.isatty(),
        )
        tasks: dict[str, int] = {}

        def on_progress(name: str, state: str, step: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bars.add_task(name, total=max(total, 1), state=state)
            bars.update(tasks[name], completed=step if total else 1, state=state)

        started = time.monotonic()
        with bars:
            states = run_grid(
                spec,
                out,
                runner=runner,
                workers=workers,
                address=address,
                grid_text=file.read_text(),
                log=_log,
                on_progress=on_progress,
            )
    except (*_user_errors(), RuntimeError) as err:
        _fail(str(err))
    counts = {s: sum(v == s for v in states.values()) for s in ("done", "failed", "pending")}
    minutes = (time.monotonic() - started) / 60
    console.print(
        f"{counts['done']} done, {counts['failed']} failed of {len(states)} cells in "
        f"{minutes:.1f} min; index in {out / 'index.json'}"
    )
    if counts["failed"]:
        raise typer.Exit(1)


@app.command()
def inspect(
    run: Annotated[Path, typer.Argument(help="a run folder")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="key=value detector thresholds, e.g. detect.cliff_drop=0.1"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Per-role metrics, run-level statistics, signatures and detector verdicts of a run."""
    from marlow.report.inspect import inspect_run, render

    try:
        report = inspect_run(run, overrides)
    except _user_errors() as err:
        _fail(str(err))
    if as_json:
        print(json.dumps(report, indent=2))
        return
    out = Console()
    for part in render(report):
        out.print(part)


@app.command()
def plan(
    args: Annotated[
        list[str] | None, typer.Argument(help="[CONFIG.yaml] [key=value ...]", show_default=False)
    ] = None,
    gpu_mem: Annotated[
        float | None, typer.Option(help="GiB of accelerator memory: say whether the run fits")
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            help="prompt tokens of a rollout sequence, for the KV cache (the default is printed)",
            min=0,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Size a run without loading a model (meta device): parameters, trainable LoRA parameters,
    memory of weights, adapters and optimizer state, activations and KV cache."""
    from marlow.config import load_config
    from marlow.plan import plan_run
    from marlow.plan import render as render_plan

    if gpu_mem is not None and not 0 < gpu_mem < float("inf"):
        _fail(f"--gpu-mem must be a positive number of GiB, got {gpu_mem}")
    config, overrides = _split_args(args)
    extra = {} if prompt_tokens is None else {"prompt_tokens": prompt_tokens}
    try:
        result = plan_run(load_config(config, overrides), gpu_mem_gib=gpu_mem, **extra)
    except _user_errors() as err:
        _fail(str(err))
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    out = Console()
    for part in render_plan(result):
        out.print(part)


@app.command()
def report(
    results: Annotated[Path, typer.Argument(help="a grid results folder (marlow grid --out)")],
    out: Annotated[
        Path | None,
        typer.Option("-o", "--out", help="the HTML page (default: RESULTS/report.html)"),
    ] = None,
) -> None:
    """Table 1, Table 2, IP-vs-SP figures and tests, signatures and detectors of a grid, as one
    HTML page with CSV/JSON of every table beside it."""
    from marlow.report import build_report

    try:
        page = build_report(results, out)
    except _user_errors() as err:
        _fail(str(err))
    console.print(f"report written to {page}")


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="a run folder (marlow train --out)")],
    dest: Annotated[Path, typer.Argument(help="a new (or empty) folder to write")],
    step: Annotated[
        int | None, typer.Option(help="the checkpoint step (default: the latest)", min=0)
    ] = None,
) -> None:
    """Write a run's base model and the adapters of one checkpoint as a standalone folder that
    plain transformers + PEFT load (no marlow, no cache)."""
    from marlow.train.export import ExportError, export_run

    try:
        folder = export_run(run, dest, step)
    except (*_user_errors(), ExportError) as err:
        _fail(str(err))
    console.print(f"exported to {folder} (export.json names its base, adapters and dtype)")


@app.command("diff-presets")
def diff_presets(
    left: Annotated[str, typer.Argument(help="a preset: paper, official or tiny")] = "paper",
    right: Annotated[str, typer.Argument(help="another preset")] = "official",
    markdown: Annotated[bool, typer.Option(help="print a Markdown table")] = False,
) -> None:
    """Every setting on which two presets differ (per task), with the source of each value."""
    from marlow.config import ConfigError, preset_diff, preset_diff_markdown
    from marlow.presets import PRESETS

    for name in (left, right):
        if name not in PRESETS:
            _fail(f"preset {name!r} is unknown; valid: {', '.join(PRESETS)}")
    try:
        if markdown:
            print(preset_diff_markdown(left, right), end="")
            return
        rows = preset_diff(left, right)
    except ConfigError as err:
        _fail(str(err))
    table = Table("field", "task", left, right, "what", f"source ({left})", f"source ({right})")
    for d in rows:
        table.add_row(*(escape(cell) for cell in d.cells()))
    Console().print(table)


workflows_app = typer.Typer(no_args_is_help=False)
app.add_typer(workflows_app, name="workflows")


@workflows_app.callback(invoke_without_command=True)
def workflows(ctx: typer.Context) -> None:
    """List the built-in workflows; `marlow workflows check FILE` checks a workflow file."""
    from marlow.workflows.show import builtin_table

    if ctx.invoked_subcommand is not None:
        return
    table = Table("name", "title", "roles (kind)", "params")
    for row in builtin_table():
        table.add_row(row["name"], row["title"], row["roles"], row["params"])
    Console().print(table)
    print("A workflow file's path works wherever a name does (workflow.name=my.yaml).")


@workflows_app.command("check")
def workflows_check(
    file: Annotated[str, typer.Argument(help="a workflow file (.yaml) or a built-in name")],
    style: Annotated[str, typer.Option(help="prompt style of the example: tiny or chat")] = "tiny",
    task: Annotated[str, typer.Option(help="task of the example's prompts: math or code")] = "math",
) -> None:
    """Check a workflow file; print its stages, roles, kinds and an example episode's prompts."""
    from marlow.prompts import STYLES
    from marlow.workflows.load import build_workflow
    from marlow.workflows.show import describe

    if style not in STYLES:
        _fail(f"--style {style!r} is unknown; valid: {', '.join(STYLES)}")
    try:
        lines = describe(build_workflow(file), style=style, task=task)
    except ValueError as err:
        _fail(str(err))
    print("\n".join(lines))


class _progress:
    def __init__(self, total: int) -> None:
        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            disable=not sys.stderr.isatty(),
        )
        self.total = total

    def __enter__(self):
        self.progress.start()
        return self.progress, self.progress.add_task("", total=self.total)

    def __exit__(self, *exc) -> None:
        self.progress.stop()


if __name__ == "__main__":
    app()
