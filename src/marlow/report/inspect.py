"""``marlow inspect RUN``: what a run folder says, per role, in one JSON-able report.

The report holds, for every role of the run's workflow (and ``all``): the latest training value
of each per-role metric (:data:`ROLE_METRICS`) with the step it was logged at (``latest_step``:
a metric sampled every ``diagnostics.every`` steps, like ``chi2_update``, is shown from its own
last step, not left out) and the latest validation values; the run-level
statistics (``runstats``); each adapter's latest grad norm, learning rate and update count; the
latest trajectory signatures; every detector's verdict recomputed now, with the run's own
thresholds (``detect.*`` of its ``config.yaml``), and the events the trainer logged.

Detectors are recomputed rather than only read from ``events.jsonl`` so that a finished run can
be inspected under other thresholds (``marlow inspect RUN detect.cliff_drop=0.1``) and so that a
verdict that did not fire still shows its evidence.

It lives in ``report`` (it reads a finished run folder, as ``report.results`` reads a grid's),
not in ``diagnostics``: it needs the run's workflow (roles, slots) and routing (adapters), and
diagnostics, which the trainer calls during a run, import no workflow.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from marlow.config import load_config
from marlow.diagnostics.detectors import describe, run_detectors
from marlow.diagnostics.metrics import TOOL_METRICS
from marlow.diagnostics.runstats import run_statistics
from marlow.diagnostics.signatures import latest_signatures, read_signatures
from marlow.diagnostics.sinks import read_metrics, read_stepped
from marlow.policy.routing import make_routing
from marlow.types import REWARD_MISSING
from marlow.workflows.validate import run_workflow

ROLE_METRICS = (
    "reward",
    "own_reward",
    *REWARD_MISSING,  # turns (all: episodes) a step left without a reward, by reason
    "accuracy",
    "entropy",
    "perplexity",
    "chi2_rollout",
    "rollout_abs_dlogp",
    "chi2_update",
    "kl_to_base",
    "grad_mass_share",
    "grad_norm_own",
    "clipfrac_low",
    "clipfrac_high",
    "ratio_max",
    "length_mean",
    "length_p50",
    "length_p95",
    "length_max",
    "truncation_rate",
)
"""Per-role training metrics shown in the table, in this order (absent ones are left out)."""

ADAPTER_METRICS = ("grad_norm", "grad_norm_max", "lr", "updates", "loss")


def _latest(records: list[dict], prefix: str) -> dict:
    """The last record holding any key that starts with ``prefix``."""
    for r in reversed(records):
        if any(k.startswith(prefix) for k in r):
            return r
    return {}


def _last_values(records: list[dict]) -> dict[str, tuple[int, float]]:
    """Every key's latest (step, value) over the records."""
    out: dict[str, tuple[int, float]] = {}
    for r in records:
        for key, value in r.items():
            if key != "step":
                out[key] = (r.get("step"), value)
    return out


def inspect_run(run_dir: str | Path, overrides: list[str] | None = None) -> dict:
    """The report of one run folder; ``overrides`` (``key=value``) change detector thresholds."""
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.exists() and (run / "index.json").is_file():
        cells = sorted(p.name for p in (run / "cells").glob("*") if (p / "metrics.jsonl").exists())
        example = run / "cells" / (cells[0] if cells else "NAME")
        raise FileNotFoundError(
            f"{run} is a grid's results folder, not a run: inspect one of its cells (marlow "
            f"inspect {example}) or make its report (marlow report {run})"
        )
    if not metrics.exists():
        raise FileNotFoundError(f"{run} holds no run: no metrics.jsonl (give a run folder)")
    cfg = load_config(run / "config.yaml", overrides)
    workflow = run_workflow(run, cfg)  # a file workflow: the run's own copy
    adapters = make_routing(cfg.policy.routing, workflow.roles, cfg.policy.role_map).adapters
    records = read_metrics(run)
    train, val = _latest(records, "train/"), _latest(records, "val/")
    stats = run_statistics(records)
    roles = {}
    last = _last_values(records)
    for role in [*workflow.roles, "all"]:
        keys = [(m, f"train/{role}/{m}") for m in ROLE_METRICS if f"train/{role}/{m}" in last]
        roles[role] = {
            # each metric's latest value and its step: chi2_update and kl_to_base are logged
            # only every diagnostics.every steps, so theirs is often older than the last step
            "latest": {m: last[k][1] for m, k in keys},
            "latest_step": {m: last[k][0] for m, k in keys},
            "val": {k.split("/")[2]: v for k, v in val.items() if k.startswith(f"val/{role}/")},
            "run": stats["roles"].get(role, {}),
        }
    signatures = read_signatures(run)
    slots = {role: workflow.slots_of(role) for role in workflow.roles}
    verdicts = run_detectors(records, signatures, slots, cfg.detect)
    events = read_stepped(run / "events.jsonl") if (run / "events.jsonl").exists() else []
    latest_sigs = latest_signatures(run)
    n_val = val.get("val/all/n_problems")
    sig_problems = cfg.diagnostics.signature_problems
    if n_val is not None:
        sig_problems = min(sig_problems, int(n_val))
    return {
        "run": str(run),
        "workflow": cfg.workflow.name,
        "routing": cfg.policy.routing,
        "model": cfg.model.name,
        "task": cfg.task.name,
        "step": records[-1]["step"] if records else None,
        "train_step": train.get("step"),
        "val_step": val.get("step"),
        "val": stats.get("val", {}),
        "run_level": {k: stats[k] for k in ("max_chi2", "max_grad_norm", "entropy_collapse_depth")},
        "roles": roles,
        "adapters": {
            a: {m: train[f"train/{a}/{m}"] for m in ADAPTER_METRICS if f"train/{a}/{m}" in train}
            for a in adapters
        },
        "tools": {
            name: {
                split: {
                    m: last[f"{split}/{name}/{m}"][1]
                    for m in TOOL_METRICS
                    if f"{split}/{name}/{m}" in last
                }
                for split in ("train", "val")
            }
            for name in workflow.tools
        },
        "signatures": (
            {"step": latest_sigs[0], "roles": latest_sigs[1], "problems": sig_problems}
            if latest_sigs is not None
            else None
        ),
        "detect": cfg.detect.model_dump(),
        "detectors": [{**asdict(v), "message": describe(v) if v.fired else None} for v in verdicts],
        "events": events,
    }


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def render(report: dict) -> list:
    """The report as rich renderables: a header, per-role tables, signatures, detectors."""
    from rich.table import Table
    from rich.text import Text

    out: list = []
    v = report["val"]
    head = (
        f"{report['run']}: {report['workflow']} / {report['routing']} / {report['model']} / "
        f"{report['task']}, step {report['step']}"
    )
    if v:
        head += (
            f"\nvalidation: peak {v['peak_accuracy']:.3f} (step {v['peak_step']}), final "
            f"{v['final_accuracy']:.3f} (step {v['final_step']}), terminal drop "
            f"{v['terminal_drop']:.3f}"
        )
    rl = report["run_level"]
    head += (
        f"\nover the whole run: largest chi2_update peak of any role {_fmt(rl['max_chi2'])}; "
        f"largest grad_norm_max of any adapter at any step {_fmt(rl['max_grad_norm'])} (the "
        "adapters table shows the latest step's); entropy collapse depth "
        f"{_fmt(rl['entropy_collapse_depth'])}"
    )
    out.append(Text(head))

    roles = report["roles"]
    names = [m for m in ROLE_METRICS if any(m in r["latest"] for r in roles.values())]
    step = report["train_step"]
    table = Table(
        title=f"latest training metrics (step {step}; an older value names its step)",
        title_justify="left",
    )
    table.add_column("metric")
    for role in roles:
        table.add_column(role, justify="right")
    for m in names:
        table.add_row(m, *(_at(r, m, step) for r in roles.values()))
    for m in sorted({k for r in roles.values() for k in r["val"]}):
        table.add_row(f"val {m}", *(_fmt(r["val"].get(m)) for r in roles.values()))
    out.append(table)

    table = Table(
        title="run level per role: each metric's peak over its first positive value after warmup",
        caption=(
            "peak/first is the raw ratio; gradient_amplification fires when a multi-slot role's "
            f"grad_norm median of {report['detect']['amp_window']} reaches "
            f"{_fmt(report['detect']['amp_rise'])}x its first while single-slot roles stay under "
            f"{_fmt(report['detect']['amp_flat'])}x, so a lone spike can read high unalarmed"
        ),
        title_justify="left",
        caption_justify="left",
    )
    for col in ("role", "metric", "first (step)", "peak (step)", "peak/first"):
        table.add_column(col)
    for role, r in roles.items():
        for metric, s in r["run"].items():
            if isinstance(s, dict):
                table.add_row(
                    role,
                    metric,
                    f"{_fmt(s['first'])} ({_fmt(s['first_step'])})",
                    f"{_fmt(s['peak'])} ({s['peak_step']})",
                    _fmt(s["peak_over_first"]),
                )
            else:
                table.add_row(role, metric, "", "", _fmt(s))
    out.append(table)

    if report["adapters"]:
        table = Table(title="adapters (latest step)")
        table.add_column("adapter")
        for m in ADAPTER_METRICS:
            table.add_column(m, justify="right")
        for a, vals in report["adapters"].items():
            table.add_row(a, *(_fmt(vals.get(m)) for m in ADAPTER_METRICS))
        out.append(table)

    if report.get("tools"):
        table = Table(title="tool stages (latest; per call unless said: calls per episode)")
        table.add_column("tool")
        for m in TOOL_METRICS:
            table.add_column(m, justify="right")
        for name, by_split in report["tools"].items():
            for split, vals in by_split.items():
                table.add_row(f"{name} ({split})", *(_fmt(vals.get(m)) for m in TOOL_METRICS))
        out.append(table)

    sig = report["signatures"]
    if sig:
        sroles = sig["roles"]
        table = Table(
            title=(
                f"trajectory signatures (validation, step {sig['step']}, the first "
                f"{sig['problems']} problems: n_turns counts a role's turns in their episodes)"
            ),
            title_justify="left",
        )
        table.add_column("signature")
        for role in sroles:
            table.add_column(role, justify="right")
        for name in sorted({k for s in sroles.values() for k in s}):
            table.add_row(name, *(_fmt(s.get(name)) for s in sroles.values()))
        out.append(table)

    table = Table(title="detectors (recomputed with the run's thresholds)")
    for col in ("detector", "verdict", "step", "evidence"):
        table.add_column(col)
    for d in report["detectors"]:
        verdict = "[red]FIRED[/red]" if d["fired"] else "quiet"
        table.add_row(d["name"], verdict, _fmt(d["step"]), d["message"] or _brief(d["evidence"]))
    out.append(table)
    for e in report["events"]:
        out.append(Text(f"event at step {e['step']}: {event_line(e)}"))
    return out


EVENTS = {
    "data": "the data's rows read, kept and skipped by reason, when the run started",
    "resume": "the run went on from a checkpoint, with the settings that changed",
    "detector": "a detector fired (an alarm; the detectors table says why)",
    "rollback": "detect.on_alarm=rollback went back to the best checkpoint",
    "nonfinite_skip": "an adapter's update was skipped for a NaN or inf loss or gradient",
    "nonfinite_stop": "the run stopped after train.max_nonfinite skips in a row",
    "reward_error": "a user's reward call raised: its items got no reward",
    "reward_timeout": "a user's reward call ran past task.reward_timeout_s",
}
"""The kinds of record in ``events.jsonl``, as ``marlow inspect`` lists them under ``event at
step N``."""


def event_line(event: dict) -> str:
    """One readable line of an ``events.jsonl`` record (:data:`EVENTS`)."""
    action = event.get("action")
    if "detector" in event:
        return f"alarm {event['detector']} (fired at step {event.get('fired_at')})"
    if action == "data":
        skipped = event.get("skipped")
        kinds = skipped.items() if isinstance(skipped, dict) else ()  # a hand-edited record
        skipped = ", ".join(f"{k} {v}" for k, v in kinds) or "none"
        return (
            f"data read {event.get('rows_read')} rows of {event.get('source')}, kept "
            f"{event.get('kept')}, skipped {skipped}"
        )
    if action == "resume":
        changed = event.get("changed") or []
        return f"resumed from {event.get('checkpoint')}" + (
            f" (changed: {', '.join(map(str, changed))})"
            if isinstance(changed, list) and changed
            else ""
        )
    if action == "rollback":
        return f"rolled back to the checkpoint of step {event.get('to_step')} (detect.on_alarm)"
    if action == "nonfinite_skip":
        return (
            f"update of adapter {event.get('adapter')} skipped ({event.get('reason')}), "
            f"{event.get('consecutive')} in a row"
        )
    if action == "nonfinite_stop":
        return f"stopped: adapter {event.get('adapter')} had train.max_nonfinite skips in a row"
    if "event" in event:
        return (
            f"{event['event']} ({event.get('split')}): {event.get('items')} item(s) without a "
            f"reward" + (f"; {event['error']}" if event.get("error") else "")
        )
    return _brief({k: v for k, v in event.items() if k != "step"})


def _at(role: dict, metric: str, step: int | None) -> str:
    """A role's latest value of ``metric``, with its step when older than the last one."""
    value, taken = role["latest"].get(metric), role.get("latest_step", {}).get(metric)
    if value is None or taken is None or taken == step:
        return _fmt(value)
    return f"{_fmt(value)} (step {taken})"


def _brief(evidence: dict) -> str:
    """A short line of a quiet verdict's evidence."""
    parts = []
    for key, value in evidence.items():
        if isinstance(value, dict | list) and len(str(value)) > 60:
            continue
        parts.append(f"{key}={_fmt(value)}")
    return ", ".join(parts)
