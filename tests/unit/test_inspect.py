"""What `marlow inspect` prints reads as what it shows: the run-level header names what each
figure is the largest of, signatures say how many problems they were taken on, a ratio's table
says when it alarms, and every kind of event is a sentence."""

from __future__ import annotations

import json

import marlow
from marlow.config.loading import dump_config
from marlow.diagnostics.runstats import RUN_LEVEL, run_statistics
from marlow.diagnostics.signatures import write_signatures
from marlow.report.inspect import EVENTS, event_line, inspect_run, render


def _text(report: dict) -> str:
    from rich.console import Console

    console = Console(record=True, width=400)
    for part in render(report):
        console.print(part)
    return " ".join(console.export_text().split())  # a title wraps at its table's width


def test_inspect_rows_say_what_they_show(tmp_path):
    cfg = marlow.make_config(preset="tiny", workflow={"name": "voting"})
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    records = [
        {"step": 0, "val/all/accuracy": 0.4, "val/all/n_problems": 60.0},
        {"step": 1, "train/all/reward": 0.5, "train/policy/grad_norm": 1.0,
         "train/policy/grad_norm_max": 6.25, "train/generator/grad_norm": 1.0},
        {"step": 2, "train/all/reward": 0.5, "train/policy/grad_norm": 1.0,
         "train/policy/grad_norm_max": 2.0, "train/generator/grad_norm": 4.0,
         "val/all/accuracy": 0.5, "val/all/n_problems": 60.0},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    events = [
        {"step": 0, "action": "data", "dataset": "custom", "source": "my.jsonl",
         "rows_read": 103, "kept": 100, "skipped": {"blank_line": 1, "no_prompt": 2}},
        {"step": 1, "split": "train", "event": "reward_error", "function": "score",
         "error": "KeyError: 'x'", "items": 3},
        {"step": 2, "action": "resume", "checkpoint": "step_000001", "changed": ["lr"]},
    ]  # fmt: skip
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    write_signatures(
        tmp_path, 2, {"generator": {"n_turns": 180.0}, "aggregator": {"n_turns": 60.0}}
    )
    report = inspect_run(tmp_path)
    text = _text(report)
    # the header's grad norm is the run's largest per-micro-batch norm, not the latest step's
    assert "largest grad_norm_max of any adapter at any step 6.25" in text
    # 60 validation problems, fewer than diagnostics.signature_problems (100): all 60
    assert report["signatures"]["problems"] == 60
    assert "the first 60 problems: n_turns counts" in text
    assert f"reaches {cfg.detect.amp_rise:g}x its first" in text
    assert "event at step 0: data read 103 rows of my.jsonl, kept 100, skipped blank_line 1, " \
        "no_prompt 2" in text  # fmt: skip
    assert "event at step 1: reward_error (train): 3 item(s) without a reward; KeyError" in text
    assert "event at step 2: resumed from step_000001 (changed: lr)" in text


def test_every_event_kind_reads_as_a_sentence():
    assert event_line({"step": 3, "detector": "terminal_cliff", "fired_at": 2}) == (
        "alarm terminal_cliff (fired at step 2)"
    )
    assert "skipped (nan loss), 2 in a row" in event_line(
        {"action": "nonfinite_skip", "adapter": "policy", "reason": "nan loss", "consecutive": 2}
    )
    assert "step 4" in event_line({"action": "rollback", "to_step": 4})
    assert event_line({"step": 1, "action": "new_kind", "x": 1}) == "action=new_kind, x=1"


def test_every_event_kind_and_run_level_figure_is_described():
    for kind in EVENTS:  # each has a sentence of its own, not the fallback's key=value list
        record = {"step": 1, "detector": kind} if kind == "detector" else {"step": 1}
        if kind.startswith("reward_"):
            record["event"] = kind
        elif kind != "detector":
            record["action"] = kind
        assert "=" not in event_line(record), kind
    shown = set(run_statistics([{"step": 1, "train/all/entropy": 1.0}])) - {
        "roles",
        "warmup_end_step",
    }
    assert shown | {"peak/first"} == set(RUN_LEVEL)
