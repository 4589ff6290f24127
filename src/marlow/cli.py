"""The ``marlow`` command. It only parses arguments and calls library functions.

Errors a user can fix (config, model id, run folder, a command-line flag) print one line and
exit 2, with rich markup escaped (a hint such as ``pip install 'marlow[data]'`` keeps its
``[data]``). An interrupt (Ctrl-C, or SIGINT or SIGTERM from a script or a scheduler) of
``train``, ``grid`` or ``quickstart`` exits 130 after one line saying what was kept and how to go
on. A run folder that ``train`` or ``eval`` created is removed again when the command
then fails on such an error before the run wrote its first record (``metrics.jsonl``): a failed
start leaves nothing behind, a run that trained keeps its files.
"""

from __future__ import annotations

import contextlib
import functools
import inspect as pyinspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from marlow.fileio import FULL_ERRNOS, NoSpace, no_space
from marlow.serving.limits import Limits


def _console(stderr: bool = False) -> Console:
    """A rich console for marlow's output, with rich's emoji codes off: a message quoting the
    user's text (``not_text:question: ...``, a run folder's name) prints it as written, where
    rich would turn ``:question:`` into an emoji."""
    return Console(stderr=stderr, emoji=False)


console = _console(stderr=True)


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
        except OSError as err:  # a device that filled up under a write of any command
            if err.errno not in FULL_ERRNOS:
                raise
            written = err.filename2 or err.filename or Path.cwd()  # a copy names (source, dest)
            full = err if isinstance(err, NoSpace) else no_space(err, written)
            console.print(f"[red]error:[/red] {escape(str(full))}", highlight=False, soft_wrap=True)
            sys.exit(2)
        except typer.TyperException as err:  # typer's own click: its usage errors derive from it
            where = f" (see {err.ctx.command_path} --help)" if getattr(err, "ctx", None) else ""
            message = " ".join(err.format_message().split())
            name = getattr(err, "option_name", "") or ""
            if name[1:2].isdigit() or name[1:2] == ".":  # a negative number read as an option
                message += "; to pass an argument that starts with '-', put `--` before it"
            console.print(
                f"[red]error:[/red] {escape(message)}{where}", highlight=False, soft_wrap=True
            )
            sys.exit(getattr(err, "exit_code", 2))
        sys.exit(code if isinstance(code, int) else 0)


USER_HELP = """Train multi-agent LLM workflows with GRPO, compare a shared policy with one
policy per role, and see per role why a run rose or fell.

[b]Start[/b]: marlow quickstart (a small comparison on the tiny world; no GPU needed).

[b]One run[/b]: marlow train CONFIG.yaml key=value ..., then marlow inspect RUN (per-role
diagnostics, detectors) and marlow eval RUN (its latest checkpoint).

[b]A study[/b]: marlow grid GRID.yaml, then marlow report RESULTS (an HTML page).

[b]Before a GPU run[/b]: marlow plan CONFIG.yaml --gpu-mem 80 (memory, without loading a model).

Settings are config fields as section.field=value (steps=50 policy.routing=sp optim.lr=1e-4):
marlow settings lists every one; marlow diff-presets paper official compares two presets. Each
command's --help has examples."""

ConfigArgs = Annotated[
    list[str] | None,
    typer.Argument(help="\\[CONFIG.yaml] \\[key=value ...]", show_default=False),
]
"""A command's run config: a config file, settings, or both (:func:`_split_args`)."""

app = typer.Typer(add_completion=False, no_args_is_help=True, help=USER_HELP, cls=_OneLineErrors)


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
    first record, remove it (a failed start leaves nothing behind), unless another process holds
    it (a run that made the same folder a moment later, and trains there)."""

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
                and out.is_dir()
                and not (out / "metrics.jsonl").exists()
            ):
                _remove_unheld(out)
            raise

    return wrapper


def _remove_unheld(folder: Path) -> None:
    """Remove ``folder`` while holding it (:func:`marlow.fileio.held`); leave it where another
    process holds it."""
    from marlow.fileio import FolderBusy, held

    try:
        with held(folder, "marlow command"):
            shutil.rmtree(folder, ignore_errors=True)
    except FolderBusy:
        pass


def _user_errors():
    from marlow.config import ConfigError
    from marlow.fileio import DamagedFileError, FolderBusy, NoSpace
    from marlow.models import ModelLoadError
    from marlow.rewards.user import RewardsMissing
    from marlow.rollout.vllm import VLLMEngineError
    from marlow.training.checkpoint import CheckpointError
    from marlow.training.nonfinite import NonFiniteRun
    from marlow.training.resume import ResumeError
    from marlow.training.sync import AdapterSyncError

    return (
        ConfigError,
        DamagedFileError,
        FolderBusy,
        NoSpace,
        ModelLoadError,
        FileExistsError,
        FileNotFoundError,
        CheckpointError,
        ResumeError,
        NonFiniteRun,
        AdapterSyncError,
        VLLMEngineError,
        RewardsMissing,
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
    """A library log line, dimmed, on stderr: one line each, never wrapped (a log file or a
    grep sees the whole message)."""
    console.print(f"[dim]{escape(message)}[/dim]", highlight=False, soft_wrap=True)


def _examples(*lines: str) -> str:
    """A command's ``--help`` epilog: examples, one per line (rich markup escaped)."""
    return "\n\n".join(["[b]Examples[/b]", *(escape(line) for line in lines)])


def _number(value: float | None) -> str:
    """A metric for people: counts as integers, other values to 3 decimals (4 significant
    digits below 0.01)."""
    if value is None:
        return "-"
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.3f}" if abs(value) >= 0.01 else f"{value:.4g}"


def _summary(
    title: str,
    rows: list[tuple[str, str]],
    paths: list[tuple[str, Path]],
    out: Console | None = None,
) -> None:
    """The end of a long command: a two-column table, then the paths it wrote (on stdout, or
    ``out``)."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(escape(key), escape(value))
    out = out or _console()
    out.print(table)
    for what, path in paths:
        out.print(f"{what}: {escape(str(path))}", highlight=False, soft_wrap=True)


@app.command(
    epilog=_examples(
        "marlow train configs/voting-sp-tiny.yaml steps=50 --out runs/sp",
        "marlow train workflow=eval_opt policy.routing=ip optim.lr=5e-4 --out runs/eo",
        "marlow train configs/paper-voting-ip.yaml model.name=Qwen/Qwen3-0.6B device=cuda",
    )
)
@_run_folder
def train(
    args: ConfigArgs = None,
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
            "NPROC -m marlow train (rollout.seeding=auto picks request there)",
            min=1,
        ),
    ] = 1,
) -> None:
    """Train one cell (a workflow under one routing) with GRPO.

    Settings come from the config file (default: the tiny preset), then each key=value;
    marlow settings lists every setting with its default and valid values."""
    resuming = resume or resume_from is not None
    if nproc > 1:
        _launch_data_parallel(nproc, args or [], out, resume, resume_from)
        return
    trainer = None
    try:
        cfg = _train_config(args, out, resuming, resume_from)
        from marlow.training.trainer import Trainer

        started = time.monotonic()
        with (
            _terminate_as_interrupt(),
            Trainer(cfg, out, log=_log) as trainer,
            _StepProgress(cfg.steps) as progress,
        ):
            trainer.run(resume=resuming, resume_from=resume_from, on_step=progress.update)
    except NoSpace as full:  # a device that filled up: what the run kept, and how to go on
        _fail(f"{full}; {_kept(out)}; then resume with `marlow train --out {out} --resume`")
    except _user_errors() as err:
        _fail(str(err))
    except KeyboardInterrupt:  # Ctrl-C, SIGINT or SIGTERM from a script or a scheduler
        if os.environ.get("RANK", "0") == "0":
            _interrupted(out, started=trainer is not None)
        raise typer.Exit(130) from None
    if os.environ.get("RANK", "0") == "0":
        _train_summary(out, time.monotonic() - started)


def _kept(out: Path) -> str:
    """What a stopped run kept: its last checkpoint (a resume redoes the steps after it)."""
    from marlow.training import checkpoint as ckpt

    latest = ckpt.latest(out)
    if latest is None:
        return "no checkpoint yet (a resume starts from step 1)"
    return f"the last checkpoint is step {ckpt.step_of(latest)}"


def _interrupted(out: Path, started: bool) -> None:
    """What an interrupted ``marlow train`` kept and how to go on, in one line: the step it was
    in (one past the last step in ``metrics.jsonl``), the last checkpoint (a resume redoes the
    steps after it) and the command that resumes."""
    from marlow.diagnostics.sinks import read_metrics

    if not started or not (out / "metrics.jsonl").exists():
        console.print(
            "interrupted before the run's first record; nothing to resume: run the same "
            "command again to start it",
            highlight=False,
            soft_wrap=True,
        )
        return
    try:
        done = max((int(r["step"]) for r in read_metrics(out) if "step" in r), default=0)
    except ValueError:  # a half-written last line: the resume drops it
        done = 0
    console.print(
        escape(
            f"interrupted at step {done + 1}; {_kept(out)}; resume with "
            f"`marlow train --out {out} --resume`"
        ),
        highlight=False,
        soft_wrap=True,
    )


def _train_summary(out: Path, seconds: float) -> None:
    """The end of ``marlow train``: validation peak and final, time, and where things are."""
    from marlow.diagnostics.runstats import run_statistics
    from marlow.diagnostics.sinks import read_metrics
    from marlow.training import checkpoint as ckpt

    records = read_metrics(out)
    val = run_statistics(records).get("val")
    steps = max((int(r["step"]) for r in records if "step" in r), default=0)
    rows = [("steps", str(steps)), ("time", _clock(seconds))]
    if val:
        rows += [
            ("best val. accuracy", f"{val['peak_accuracy']:.3f} at step {val['peak_step']}"),
            ("final val. accuracy", f"{val['final_accuracy']:.3f} at step {val['final_step']}"),
        ]
    paths = [("run", out), ("metrics", out / "metrics.jsonl")]
    latest = ckpt.latest(out)
    if latest is not None:
        paths.append(("adapters", latest / "adapters"))
    _summary("training", rows, paths)
    _console().print(
        f"next: marlow inspect {escape(str(out))} (per-role diagnostics), marlow eval "
        f"{escape(str(out))} (evaluate its latest checkpoint)",
        highlight=False,
        soft_wrap=True,
    )


def _train_config(args: list[str] | None, out: Path, resuming: bool, resume_from: int | None):
    """The run's config: a resumed run's own (``marlow.training.resume``), else file + overrides."""
    from marlow.config import load_config
    from marlow.training.resume import resume_config

    config, overrides = _split_args(args)
    if resuming:
        return resume_config(out, config, overrides, resume_from)
    return load_config(config, overrides)


def _launch_data_parallel(
    nproc: int, args: list[str], out: Path, resume: bool, resume_from: int | None
) -> None:
    """``marlow train --nproc N``: check the settings here (one line, nothing launched), then run
    ``torchrun --standalone --nproc_per_node N -m marlow train ...`` and exit with its code.
    torchrun's log folder (its per-rank folders, empty: the ranks' output is not redirected) is a
    temporary one removed when it ends, where torchrun would leave a ``torchelastic_*`` folder in
    the system's temporary folder at every launch."""
    from marlow.training.distributed import check_ranks

    try:
        cfg = _train_config(args, out, resume or resume_from is not None, resume_from)
        check_ranks(cfg, nproc)
    except _user_errors() as err:
        _fail(str(err))
    with tempfile.TemporaryDirectory(prefix="marlow-torchrun-") as logs:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--log_dir", logs]
        command += ["--nproc_per_node", str(nproc), "-m", "marlow", "train", *args]
        command += ["--out", str(out)]
        if resume:
            command.append("--resume")
        if resume_from is not None:
            command += ["--resume-from", str(resume_from)]
        code = _run_forwarding_terminate(command)
    if code:
        raise typer.Exit(code)


def _run_forwarding_terminate(command: list[str]) -> int:
    """Run ``command`` and return its exit code; a SIGTERM to this process meanwhile is passed on
    to it (torchrun passes it on to its ranks, which stop as on Ctrl-C, rank 0 saying what was
    kept; torchrun then reports the signal in its own words) and its end awaited: then 130, as
    an interrupted ``marlow train`` exits."""
    import signal

    forwarded = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        proc.send_signal(signum)

    with subprocess.Popen(command) as proc:
        previous = signal.signal(signal.SIGTERM, forward)
        try:
            code = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    return 130 if forwarded and code else code


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler's stop, ``kill PID``) taken as Ctrl-C while the block runs: the
    command stops as on an interrupt, saying what it kept and how to go on (exit 130), where
    SIGTERM's default would end the process on the spot without a word."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@app.command(
    "eval",
    epilog=_examples(
        "# its latest checkpoint -> runs/a/evals/step-N\nmarlow eval runs/a",
        "marlow eval runs/a/checkpoints/step_000016 task.val_size=100 --name val100",
        "# the base model through that config's workflow\nmarlow eval configs/voting-sp-tiny.yaml",
    ),
)
def evaluate(
    args: Annotated[
        list[str] | None,
        typer.Argument(
            help="\\[RUN | CHECKPOINT | CONFIG.yaml] \\[key=value ...]", show_default=False
        ),
    ] = None,
    base: Annotated[bool, typer.Option(help="the run's base model, not its checkpoint")] = False,
    name: Annotated[
        str | None, typer.Option(help="the eval's folder name (default: step-N or base)")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="write the eval here instead (default: RUN/evals/NAME, or runs/eval)"),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an earlier eval of that name")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Evaluate a run's checkpoint (or a base model) on the validation split.

    A run's evals are written to RUN/evals/NAME/eval.json; an earlier one is never replaced
    without --overwrite."""
    from marlow.training.evaluate import evaluate as run_eval

    target, overrides = _split_args(args)
    if out is not None:
        _check_out(out)
    try:
        result = run_eval(
            target, overrides, base=base, name=name, out=out, overwrite=overwrite, log=_log
        )
    except _user_errors() as err:
        _fail(str(err))
    if as_json:
        print(json.dumps(result, indent=2))
        return
    what = result["checkpoint"] or "the base model"
    rows = [
        ("evaluated", what),
        ("step", str(result["step"])),
        ("workflow / routing", f"{result['workflow']} / {result['routing']}"),
        ("problems", _number(result.get("val/all/n_problems"))),
    ]
    rows += [
        (key.removeprefix("val/all/"), _number(value))
        for key, value in sorted(result.items())
        if key.startswith("val/all/") and key != "val/all/n_problems"
    ]
    rows.append(("time", f"{result.get('time/val_s', 0.0):.1f} s"))
    _summary("evaluation", rows, [("eval.json", Path(result["folder"]) / "eval.json")])


@app.command("pretrain-tiny")
def pretrain_tiny_cmd(
    scale: Annotated[str, typer.Option(help="tiny-s, tiny-m or tiny-l")] = "tiny-s",
    steps: Annotated[
        int | None, typer.Option(help="override the scale's pretraining steps")
    ] = None,
    batch: Annotated[
        int | None, typer.Option(help="examples per pretraining step (default 64)", min=1)
    ] = None,
    task: Annotated[str, typer.Option(help="the tiny world: math or code")] = "math",
    threads: Annotated[
        int | None,
        typer.Option(
            help="torch threads (default 2 on every machine; another count is another world)", min=1
        ),
    ] = None,
    report: Annotated[
        bool, typer.Option(help="measure the greedy generator on validation problems")
    ] = True,
    verify: Annotated[
        bool,
        typer.Option(
            help="rebuild the shipped world of this recipe in a temporary folder and compare "
            "its greedy accuracy with the shipped one's (exit 1 beyond the tolerance)"
        ),
    ] = False,
) -> None:
    """Pre-train a tiny world (cached) and report its greedy accuracy.

    The cache key is a hash of everything that sets the weights; the folder is printed last.
    Runs load the world marlow ships for a recipe when there is one (model.world=auto); the one
    built here is what model.world=rebuild loads."""
    from marlow.tiny.pretrain import pretrain_tiny
    from marlow.tiny.shipped import find_shipped

    if verify:
        if threads is not None:
            _fail("--verify rebuilds a shipped world with its own threads: drop --threads")
        _verify_world(scale, steps, batch, task)
        return
    try:
        started = time.monotonic()
        if find_shipped(scale, steps=steps, batch=batch, task=task) is not None and threads is None:
            _log(
                f"marlow ships this {scale} ({task}) world: runs load the shipped one; "
                "model.world=rebuild loads the one built here"
            )
        path = pretrain_tiny(scale, steps=steps, batch=batch, log=_log, task=task, threads=threads)
    except ValueError as err:
        _fail(str(err))
    meta = json.loads((path / "meta.json").read_text())
    rows = [("world", f"{scale} ({task})"), ("steps", str(meta.get("steps", "-")))]
    rows.append(("examples per step", str(meta.get("batch_examples", "-"))))
    rows.append(("time", _clock(time.monotonic() - started)))
    if report:
        from marlow.worlds.tinyeval import greedy_report

        scores = greedy_report(path, task)
        n, accuracy = int(scores["problems"]), scores["accuracy"]
        rows.append(("greedy accuracy", f"{accuracy:.3f} on {n} validation problems"))
        _log(f"{scale} ({task}): greedy generator accuracy {accuracy:.3f} on {n} val problems")
        if scores.get("sandbox_errors"):
            _log(
                f"WARNING: {int(scores['sandbox_errors'])} of {n} programs got no verdict (the "
                "sandbox failed to set up): the accuracy above undercounts"
            )
    _summary("tiny world", rows, [], out=console)  # stderr: stdout is the folder alone
    print(path)  # for scripts: folder=$(marlow pretrain-tiny)


def _verify_world(scale: str, steps: int | None, batch: int | None, task: str) -> None:
    """``pretrain-tiny --verify``: the table, and exit 1 when the worlds differ too much."""
    from marlow.worlds.verify import verify_world

    try:
        v = verify_world(scale, steps=steps, batch=batch, task=task, log=_log)
    except ValueError as err:  # no such shipped world, or a damaged one (DamagedFileError)
        _fail(str(err))
    rows = [
        ("world", v.world),
        ("shipped", f"greedy accuracy {v.shipped_accuracy:.3f} (built on {v.built_on})"),
        ("rebuilt here", f"greedy accuracy {v.rebuilt_accuracy:.3f} ({v.cpu_capability})"),
        ("gap", f"{v.gap:.3f} on {v.n_problems} problems (tolerance {v.tolerance:.3f})"),
        ("same weights", "yes, the same bytes" if v.same_weights else "no (another kernel set?)"),
        ("rebuild time", _clock(v.rebuild_s)),
        ("verdict", "PASSED" if v.passed else "FAILED"),
    ]
    _summary("shipped world check", rows, [], out=console)
    if not v.passed:
        console.print(
            f"[red]the rebuilt world's accuracy is {v.gap:.3f} away from the shipped one's, over "
            f"the tolerance {v.tolerance:.3f}[/red]",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


@app.command(
    epilog=_examples(
        "marlow quickstart",
        "marlow quickstart --task code --out qs-code",
        "marlow quickstart model.name=tiny-m optim.lr=5e-4 --steps 40",
    )
)
def quickstart(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="\\[key=value ...] settings for every cell", show_default=False),
    ] = None,
    out: Annotated[Path, typer.Option(help="output folder")] = Path("marlow-quickstart"),
    seed: Annotated[int, typer.Option()] = 0,
    steps: Annotated[
        int | None,
        typer.Option(help="training steps per cell (default: the quickstart preset's 12)"),
    ] = None,
    task: Annotated[str, typer.Option(help="the tiny world: math or code")] = "math",
) -> None:
    """The main demo: train Voting-IP, Voting-SP and single-agent RL on the tiny world.

    Loads the tiny world marlow ships (no pre-training) and runs five cells as a small grid:
    three trained (Voting-IP, Voting-SP and Single-SA, the single-agent RL control) and two base
    cells (the untrained model through Voting and through Single); prints each cell's accuracy
    and each Voting cell's gain over its base, and writes summary.json and val_curves.png."""
    from marlow.config import parse_overrides
    from marlow.worlds.quickstart import quickstart as run_quickstart

    _check_out(out)

    with _CellProgress(28) as bars, _terminate_as_interrupt():
        try:
            settings = parse_overrides(overrides or [])
            summary = run_quickstart(
                out,
                seed=seed,
                steps=steps,
                settings=settings,
                task=task,
                log=_log,
                on_progress=bars,
            )
        except (*_user_errors(), RuntimeError) as err:
            _fail(str(err))
        except KeyboardInterrupt:  # its grid stopped the running cells and wrote the index
            console.print(
                "interrupted; run the same `marlow quickstart` again to finish only what is "
                "missing",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(130) from None
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
    _console().print(table)
    for name, gain in summary["voting_gain_over_base"].items():
        _console().print(
            f"{name}: {gain['peak_minus_base']:+.1f} points over the base at its peak, "
            f"{gain['final_minus_base']:+.1f} at the end"
        )
    t = summary["timings_s"]
    _console().print(
        f"total {t['total_s']:.0f} s (pretrain/cache {t['pretrain_or_cache_s']:.0f} s, "
        f"cells {t['cells_s']:.0f} s); summary.json and val_curves.png in {out}"
    )


@app.command(
    epilog=_examples(
        "marlow grid configs/grids/tiny-demo.yaml steps=4 optim.lr=3e-3 --out runs/demo",
        "# the cells and their count\nmarlow grid configs/grids/tiny-matrix.yaml --dry-run",
        "marlow grid configs/grids/tiny-matrix.yaml --runner ray --workers 8",
    )
)
def grid(
    file: Annotated[Path, typer.Argument(help="a grid YAML file (axes and shared settings)")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="\\[key=value ...] settings for every cell, over the file's settings",
            show_default=False,
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="results folder")] = Path("runs/grid"),
    runner: Annotated[str, typer.Option(help="local or ray")] = "local",
    address: Annotated[
        str | None, typer.Option(help="Ray cluster address (default: start a local Ray)")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(help="cells at once (default: sized to cores and memory)", min=1),
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="list the cells, say how many, and stop")] = False,
) -> None:
    """Run every cell of a grid; finished cells are skipped, interrupted ones resumed.

    Besides one trained cell per workflow and policy, a grid runs controls: by default
    (no controls key) the SA-RL control (Single trained alone) and a base cell (no training)
    per workflow, so a grid of 2 workflows x 2 policies is 8 cells; controls: [] runs none.
    --dry-run prints the cells and their count."""
    from marlow.grids.grid import describe_cells, expand, load_grid
    from marlow.grids.runner import run_grid

    _check_out(out)

    try:
        spec = load_grid(file, overrides)
        if dry_run:
            cells = expand(spec)
            for cell in cells:
                print(cell.name)
            print(describe_cells(spec, cells))
            return
        started = time.monotonic()
        with _CellProgress(34) as bars, _terminate_as_interrupt():
            states = run_grid(
                spec,
                out,
                runner=runner,
                workers=workers,
                address=address,
                grid_text=_grid_text(file, overrides),
                log=_log,
                on_progress=bars,
            )
    except (*_user_errors(), RuntimeError) as err:
        _fail(str(err))
    except KeyboardInterrupt:  # the runner stopped the running cells and wrote the index
        console.print(
            escape(
                f"interrupted; {out / 'index.json'} marks the stopped cells pending; run the "
                "same `marlow grid` again to resume them"
            ),
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    counts = {s: sum(v == s for v in states.values()) for s in ("done", "failed", "pending")}
    rows = [(state, str(n)) for state, n in counts.items()]
    rows.append(("time", _clock(time.monotonic() - started)))
    paths = [("results", out), ("index", out / "index.json")]
    _summary(f"grid: {len(states)} cells", rows, paths)
    _console().print(f"next: marlow report {escape(str(out))}", highlight=False, soft_wrap=True)
    if counts["failed"]:
        raise typer.Exit(1)


def _grid_text(file: Path, overrides: list[str] | None) -> str:
    """The grid as given, for ``RESULTS/grid.yaml``: the file, and the overrides it ran with."""
    text = file.read_text()
    if overrides:
        text += f"\n# run with: {' '.join(overrides)}\n"
    return text


@app.command(
    epilog=_examples(
        "marlow inspect runs/sp",
        "marlow inspect runs/sp detect.cliff_drop=0.1 detect.cliff_patience=3",
        "marlow inspect runs/grid/cells/Voting-IP-tiny-s-Math-s0 --json",
    )
)
def inspect(
    run: Annotated[Path, typer.Argument(help="a run folder")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="\\[key=value ...] detector thresholds, e.g. detect.cliff_drop=0.1",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """A run's per-role metrics, statistics, signatures and detector verdicts."""
    from marlow.report.inspect import inspect_run, render

    try:
        report = inspect_run(run, overrides)
    except _user_errors() as err:
        _fail(str(err))
    if as_json:
        print(json.dumps(report, indent=2))
        return
    out = _console()
    for part in render(report):
        out.print(part)


@app.command(
    epilog=_examples(
        "marlow plan configs/paper-voting-ip.yaml --gpu-mem 80",
        "marlow plan preset=paper model.name=Qwen/Qwen3-4B policy.routing=sp",
        "marlow plan configs/qwen3-0.6b-smoke.yaml grpo.micro_tokens=4096 --json",
    )
)
def plan(
    args: ConfigArgs = None,
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
    """Size a run's memory without loading a model.

    Parameters, trainable LoRA parameters, memory of weights, adapters and optimizer state,
    activations and KV cache, on the meta device."""
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
    out = _console()
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
    """A grid's results as one HTML page, with CSV/JSON of every table.

    Table 1, Table 2, IP-vs-SP figures and paired tests, per-role time series, signatures and
    detectors."""
    from marlow.report import build_report

    try:
        page = build_report(results, out)
    except _user_errors() as err:
        _fail(str(err))
    figures = page.with_suffix("")
    rows = [
        ("tables (CSV)", str(len(list(figures.glob("*.csv"))))),
        ("figures (PNG)", str(len(list(figures.glob("*.png"))))),
    ]
    paths = [("page", page), ("data", page.with_suffix(".json")), ("tables and figures", figures)]
    _summary("report", rows, paths)


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="a run folder (marlow train --out)")],
    dest: Annotated[Path, typer.Argument(help="a new (or empty) folder to write")],
    step: Annotated[
        int | None, typer.Option(help="the checkpoint step (default: the latest)", min=0)
    ] = None,
) -> None:
    """Export a checkpoint as a folder plain transformers + PEFT load.

    The run's base model and the adapters of one checkpoint; no marlow, no cache needed."""
    from marlow.training.export import ExportError, export_run

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
    """Every setting on which two presets differ, with the source of each value."""
    from marlow.config import ConfigError, preset_diff, preset_diff_markdown
    from marlow.config.presets import PRESETS

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
    _console().print(table)


@app.command(
    epilog=_examples("marlow settings", "marlow settings grpo", "marlow settings rollout.vllm")
)
def settings(
    section: Annotated[
        str | None,
        typer.Argument(help="a section (top, grpo, rollout.vllm, ...); default: every one"),
    ] = None,
) -> None:
    """Every setting a config may give: its default, valid values and what it does, under what
    its section is for.

    Set one in a config file or as section.field=value after marlow train."""
    from rich.padding import Padding
    from rich.text import Text

    from marlow.config.describe import settings as described
    from marlow.config.describe import summary

    try:
        rows = described(section)
    except ValueError as err:
        _fail(str(err))
    out = _console()
    shown = None
    for row in rows:
        if row.section != shown:
            shown = row.section
            out.print(f"\n[b]{escape(shown)}[/b]", highlight=False)
            out.print(Text(summary(shown), style="dim"), highlight=False)
        valid = f"  ({row.valid})" if row.valid else ""
        out.print(Text(f"{row.key} = {row.default}{valid}"), highlight=False)
        out.print(Padding(Text(row.description), (0, 0, 0, 4)), highlight=False)


@app.command()
def tasks() -> None:
    """List the tasks task.name can name: the built-in ones and those installed packages publish
    (entry-point group marlow.tasks)."""
    from marlow.tasks.catalog import catalog

    table = Table("name", "from", "what")
    for info in catalog():
        table.add_row(escape(info.name), escape(info.origin), escape(info.description))
    _console().print(table)
    print("Your own file and reward: task.source=FILE task.reward=MODULE:FUNCTION (docs/tasks.md).")


@app.command(
    epilog=_examples(
        "marlow rescore runs/sums-ip --reward my_rewards.py:lenient",
        "marlow rescore runs/a --reward pkg.rewards:judge --form verl --threshold 0.5",
    )
)
def rescore(
    run: Annotated[Path, typer.Argument(help="a run folder")],
    reward: Annotated[str, typer.Option(help="MODULE:FUNCTION or FILE.py:FUNCTION")],
    form: Annotated[str, typer.Option(help="the reward's contract: trl or verl")] = "trl",
    threshold: Annotated[
        float | None, typer.Option(help="correct at this reward (default: the run's)")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="RUN/rescore/NAME.json (default: FUNCTION)")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option(help="replace an earlier rescore of that name")
    ] = False,
) -> None:
    """Grade a run's stored validation answers with another reward, without generating anything;
    the new figures go beside the run's own in RUN/rescore/NAME.json."""
    from marlow.report.rescore import FIGURES
    from marlow.report.rescore import rescore as rescore_run
    from marlow.rewards.user import REWARD_FORMS

    if form not in REWARD_FORMS:
        _fail(f"--form {form!r} is unknown; valid: {', '.join(REWARD_FORMS)}")
    try:
        result = rescore_run(
            run, reward, form=form, threshold=threshold, name=name, overwrite=overwrite, log=_log
        )
    except _user_errors() as err:
        _fail(str(err))
    table = Table("step", *(f"{k} {w}" for k in FIGURES for w in ("old", "new")), "no reward")
    for s in result["steps"]:
        cells = [_number(s[w][k]) for k in FIGURES for w in ("old", "new")]
        table.add_row(str(s["step"]), *cells, str(s["new"]["no_reward"]))
    _console().print(table)
    if result["failures"]:
        print(f"{len(result['failures'])} reward call(s) failed; last: {result['failures'][-1]}")
    print(f"written: {result['file']}")


@app.command(
    epilog=_examples(
        'marlow answer marlow-quickstart/cells/Voting-SP-tiny-s-Math "59+19"',
        'marlow answer runs/a "12*7" --trace rollout.val_temperature=0',
        "marlow answer runs/a --input questions.jsonl --out answers.jsonl \\\n    --field question",
    )
)
def answer(
    run: Annotated[str, typer.Argument(help="a run folder, a checkpoint or an exported bundle")],
    args: Annotated[
        list[str] | None,
        typer.Argument(help='"QUESTION" and/or key=value settings', show_default=False),
    ] = None,
    trace: Annotated[bool, typer.Option(help="every role's turns, not only the answer")] = False,
    input: Annotated[
        Path | None, typer.Option("--input", help="a .jsonl file of questions to answer")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="where --input's answers go (.jsonl)")] = None,
    field: Annotated[
        str | None, typer.Option(help="--input's question column (default: the task's)")
    ] = None,
    batch: Annotated[int, typer.Option(min=1, help="questions per engine batch")] = 64,
    temperature: Annotated[
        float | None, typer.Option(help="default: the run's validation temperature")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing --out")] = False,
) -> None:
    """Answer a question, or a file of them, with a trained workflow (its roles, prompts and
    adapters, through the engine that trained it)."""
    from marlow.serving.trained import load_workflow
    from marlow.tasks.loaders import prompt_column

    settings = [a for a in args or [] if _is_setting(a)]
    questions = [a for a in args or [] if not _is_setting(a)]
    if out is not None and input is None:
        _fail("--out is where --input's answers go; give --input FILE")
    if input is None and len(questions) != 1:
        _fail('give one "QUESTION" (quoted), or --input FILE --out FILE')
    if input is not None and (questions or out is None):
        _fail("--input answers a file into --out; give --out, and no question beside it")
    if input is not None:
        from marlow.serving.files import check_paths

        try:
            check_paths(input, out, overwrite)  # before a model loads
        except (ValueError, OSError) as err:
            _fail(str(err))
    try:
        with load_workflow(run, settings, log=_log) as workflow:
            if input is None:
                result = workflow.answer(questions[0], trace=trace, temperature=temperature)
                if trace:
                    for t in result.turns:
                        if "tool" in t:  # a tool stage's call: its inputs and what it returned
                            print(f"--- tool {t['tool']} (slot {t['slot']}, {t['status']})")
                            print(f"inputs: {json.dumps(t['inputs'])}\noutput:\n{t['output']}")
                            continue
                        print(f"--- {t['role']} (slot {t['slot']}, adapter {t['adapter']})")
                        print(f"prompt:\n{t['prompt']}\ncompletion:\n{t['completion']}")
                    print("--- final answer")
                print(result.text)
                return
            from marlow.serving.files import answer_file

            column = field or prompt_column(
                workflow.config.task.dataset, workflow.config.task.prompt_field
            )
            report = answer_file(
                workflow,
                input,
                out,
                field=column,
                batch=batch,
                trace=trace,
                overwrite=overwrite,
                temperature=temperature,
                progress=lambda done, total: _log(f"answered {done}/{total}"),
            )
    except (*_user_errors(), ValueError) as err:
        _fail(str(err))
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(report.skipped.items())) or "none"
    print(f"read {report.read}, answered {report.answered}, skipped {skipped} -> {out}")


@app.command(
    epilog=_examples(
        "marlow serve marlow-quickstart/cells/Voting-SP-tiny-s-Math --port 8000",
        "MARLOW_API_KEY=secret marlow serve runs/a-bundle --host 0.0.0.0 \\\n"
        "    rollout.backend=vllm",
    )
)
def serve(
    run: Annotated[str, typer.Argument(help="a run folder, a checkpoint or an exported bundle")],
    settings: Annotated[
        list[str] | None, typer.Argument(help="key=value settings", show_default=False)
    ] = None,
    host: Annotated[str, typer.Option(help="the address to listen on")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="the port (0: one the system picks)")
    ] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="MARLOW_API_KEY", help="require this key (Authorization: Bearer)"),
    ] = None,
    max_body_bytes: Annotated[
        int, typer.Option(min=1, help="the largest request body; larger ones get a 413")
    ] = Limits.max_body_bytes,
    max_tokens: Annotated[
        int,
        typer.Option(min=1, help="the largest max_tokens a request may ask (and the context's)"),
    ] = Limits.max_tokens,
    max_waiting: Annotated[
        int,
        typer.Option(min=1, help="questions that may wait for the engine; past it, a 503"),
    ] = Limits.max_waiting,
    timeout_s: Annotated[
        float,
        typer.Option(min=0.001, help="seconds a request may wait for its answer; then a 503"),
    ] = Limits.timeout_s,
    quiet: Annotated[bool, typer.Option(help="no access line per request on stderr")] = False,
) -> None:
    """Serve a trained workflow as an OpenAI-compatible API (/v1/chat/completions, /v1/models,
    /health); concurrent requests are answered in shared batches. Ctrl-C stops it once the
    requests in flight are answered."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        _fail("marlow serve needs FastAPI and uvicorn: pip install 'marlow[serve]'")
    from marlow.serving.server import bound_socket
    from marlow.serving.server import serve as serve_app
    from marlow.serving.trained import load_workflow

    bad = [a for a in settings or [] if not _is_setting(a)]
    if bad:
        _fail(f"{bad[0]!r} is not a key=value setting")
    try:
        sock = bound_socket(host, port)
    except ValueError as err:
        _fail(str(err))
    try:
        workflow = load_workflow(run, settings or [], log=_log)
    except (*_user_errors(), ValueError) as err:
        sock.close()
        _fail(str(err))
    if host not in ("127.0.0.1", "localhost", "::1"):
        _log(f"WARNING listening on {host}: reachable from other machines"
             + ("" if api_key else "; no --api-key is set"))  # fmt: skip
    where = f"[{host}]" if ":" in host else host
    url = f"http://{where}:{sock.getsockname()[1]}/v1"
    _log(f"serving {workflow.name} ({workflow.source.label}) on {url}")
    limits = Limits(max_body_bytes, max_tokens, max_waiting, timeout_s)
    serve_app(workflow, sock, api_key=api_key, limits=limits, quiet=quiet)


def _is_setting(arg: str) -> bool:
    """``key=value`` whose key is a config field's dotted path (``rollout.max_new_tokens=64``);
    a question such as ``x=3, so what is 2x?`` is not one."""
    from marlow.config import RunConfig

    key, eq, _ = arg.partition("=")
    return bool(eq) and key.split(".")[0] in RunConfig.model_fields and key.strip() == key


task_app = typer.Typer(no_args_is_help=True, help="Check a task before training on it.")
app.add_typer(task_app, name="task")


@task_app.command(
    "check",
    epilog=_examples(
        "marlow task check examples/sums/config.yaml",
        "marlow task check task.source=my.jsonl task.reward=my_rewards.py:score \\\n"
        "    --problems 8",
        "marlow task check examples/sums/config.yaml --show 2",
    ),
)
def task_check(
    args: ConfigArgs = None,
    problems: Annotated[int, typer.Option(min=1, help="training problems to sample")] = 4,
    show: Annotated[
        int, typer.Option(min=0, help="print this many sampled episodes as text (the base model's)")
    ] = 0,
) -> None:
    """Load the task, grade its gold answers, and sample a few episodes on the model: whether the
    rewards vary within groups; --show N prints N of them as text. Exits 1 with one line on any
    problem."""
    from marlow.config import load_config
    from marlow.training.taskcheck import check_task

    config, overrides = _split_args(args)
    try:
        cfg = load_config(config, overrides)
        report = check_task(cfg, problems=problems, show=show, log=_log)
    except _user_errors() as err:
        _fail(str(err))
    for line in report.lines:
        print(line)
    for line in report.problems[1:]:
        print(f"problem: {line}")
    if report.problems:
        _fail(report.problems[0])
    print("task check: no problem found")


workflows_app = typer.Typer(no_args_is_help=False)
app.add_typer(workflows_app, name="workflows")


@workflows_app.callback(invoke_without_command=True)
def workflows(ctx: typer.Context) -> None:
    """List the built-in workflows; marlow workflows check FILE checks a workflow file."""
    from marlow.workflows.show import builtin_table

    if ctx.invoked_subcommand is not None:
        return
    table = Table("name", "title", "roles (kind)", "params")
    for row in builtin_table():
        table.add_row(row["name"], row["title"], row["roles"], row["params"])
    _console().print(table)
    print("A workflow file's path works wherever a name does (workflow.name=my.yaml).")


@workflows_app.command("check")
def workflows_check(
    file: Annotated[str, typer.Argument(help="a workflow file (.yaml) or a built-in name")],
    style: Annotated[str, typer.Option(help="prompt style of the example: tiny or chat")] = "tiny",
    task: Annotated[str, typer.Option(help="task of the example's prompts: math or code")] = "math",
) -> None:
    """Check a workflow file and show its stages, roles and an example episode's prompts."""
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


PLAIN_EVERY_S = 30.0
"""Without a terminal, a progress line at most this often (and at every validation)."""


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _bars(*columns) -> Progress:
    """Rich progress bars with the elapsed time, drawn only on a terminal."""
    return Progress(*columns, TimeElapsedColumn(), console=console, disable=not sys.stderr.isatty())


class _StepProgress:
    """A training run's progress. On a terminal: a rich bar. Elsewhere (a file, a pipe, CI): one
    plain line at every validation and at most every 30 s, with step, reward, validation
    accuracy, seconds per step and the time left."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stderr.isatty()
        self.bar = _bars(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.description}")
        )
        self.task = self.bar.add_task("", total=total)
        self.start = self.last = self.said = time.monotonic()
        self.first: int | None = None  # the step before the first one this process ran

    def __enter__(self) -> _StepProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def update(self, step: int, record: dict) -> None:
        now = time.monotonic()
        if self.first is None and step > 0:  # the clock starts when this process's first step did
            self.first, self.start = step - 1, self.last
        self.last = now
        acc = record.get("val/all/accuracy")
        reward = record.get("train/all/reward")
        words = [f"reward {reward:.3f}"] if reward is not None else []
        missing = _no_reward(record, "train")
        if missing:
            words.append(f"{missing} episodes without a reward")
        if acc is not None:
            words.append(f"val acc {acc:.3f}")
            missing = _no_reward(record, "val")
            if missing:  # accuracy is over the graded episodes alone
                words[-1] += f" (of the graded; {missing} without a reward)"
        self.bar.update(self.task, completed=step, description="  ".join(words))
        due = acc is not None or now - self.said >= PLAIN_EVERY_S or step == self.total
        if self.tty or not due:
            return
        self.said = now
        if self.first is not None:
            rate = (now - self.start) / (step - self.first)
            words += [f"{rate:.2f} s/step", f"ETA {_clock(rate * (self.total - step))}"]
        print(f"step {step}/{self.total}  " + "  ".join(words), file=sys.stderr, flush=True)


def _no_reward(record: dict, split: str) -> int:
    """How many of a step's ``split`` episodes have no reward (a user's reward that failed)."""
    from marlow.types import REWARD_MISSING

    return int(sum(record.get(f"{split}/all/{reason}", 0) for reason in REWARD_MISSING))


class _CellProgress:
    """A grid's (or the quickstart's) progress per cell. On a terminal: a rich bar per cell.
    Elsewhere: at most every 30 s one plain line with the running cells' steps and the counts of
    cells done, failed and waiting (the runner logs each cell's end as it happens)."""

    def __init__(self, width: int) -> None:
        self.tty = sys.stderr.isatty()
        self.bars = _bars(
            TextColumn(f"{{task.description:<{width}}}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[state]}"),
        )
        self.tasks: dict[str, int] = {}
        self.cells: dict[str, tuple[str, int, int]] = {}  # name -> (state, step, total)
        self.start = self.said = time.monotonic()

    def __enter__(self) -> _CellProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bars.stop()

    def __call__(self, name: str, state: str, step: int, total: int) -> None:
        if name not in self.tasks:
            self.tasks[name] = self.bars.add_task(name, total=max(total, 1), state=state)
        self.bars.update(self.tasks[name], completed=step if total else 1, state=state)
        self.cells[name] = (state, step, total)
        now = time.monotonic()
        if self.tty or now - self.said < PLAIN_EVERY_S:
            return
        self.said = now
        running = [f"{n} {st}/{t}" for n, (s, st, t) in self.cells.items() if s == "running"]
        ended = [s for s, _, _ in self.cells.values() if s in ("done", "failed")]
        counts = f"{ended.count('done')} done, {ended.count('failed')} failed"
        line = f"[{_clock(now - self.start)}] {counts}; running: {', '.join(running) or 'none'}"
        print(line, file=sys.stderr, flush=True)


def reflowed(text: str) -> str:
    """A help text as rich should wrap it: the lines of each paragraph joined into one (rich keeps
    a docstring's line breaks, which break a sentence mid-way on a narrow terminal). A paragraph
    whose lines are indented (examples, a list) keeps its breaks."""
    paragraphs = pyinspect.cleandoc(text).split("\n\n")
    return "\n\n".join(
        p
        if any(line.startswith((" ", "-", "*")) for line in p.splitlines()[1:])
        else " ".join(line.strip() for line in p.splitlines())
        for p in paragraphs
    )


def _reflow_help(typer_app: typer.Typer) -> None:
    """Every command's and group's help of ``typer_app`` :func:`reflowed`."""
    if typer_app.info.help:
        typer_app.info.help = reflowed(typer_app.info.help)
    for info in typer_app.registered_commands:
        info.help = reflowed(info.help or pyinspect.getdoc(info.callback) or "")
    for group in typer_app.registered_groups:
        sub = group.typer_instance
        if sub is not None:
            for callback in (sub.registered_callback,):
                if callback is not None and callback.callback is not None and not callback.help:
                    callback.help = reflowed(pyinspect.getdoc(callback.callback) or "")
            _reflow_help(sub)


_reflow_help(app)


if __name__ == "__main__":
    app()
