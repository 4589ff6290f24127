"""The online detectors judged against the labels (:mod:`marlow.report.evidence.labels`).

For each detector the report gives precision and recall against its label, and the lead: the
step its alarm fired minus the step the labelled event began (negative: the alarm came first).
Thresholds are **tuned on the first half of the seeds**, rounded up (the :data:`TUNE_GRID` point
with the best F1, ties to the defaults), and **reported on the others**: all but the last seed
with 2 or 3 seeds, 0-2 against 3-5 with 6 (marlow's choice: with one held-out seed of six, a grid
may hold no labelled event on it at all). With one seed the defaults are reported on it, and the
page says so. A detector counts as *judged* only when both sets hold a labelled event.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

from marlow.config import DetectConfig
from marlow.diagnostics.detectors import run_detectors
from marlow.report.evidence.labels import (
    AMP_OVER,
    AMP_RATIO,
    CAPTURE_CLOSE,
    CAPTURE_SHARE,
    CLIFF_DROP,
    LABELS,
    Label,
    trained_runs,
)
from marlow.report.results import CellRun, GridRuns
from marlow.report.tables import Table

DETECTORS = tuple(LABELS)  # a label per detector
TUNE_GRID: dict[str, dict[str, tuple]] = {
    "terminal_cliff": {"cliff_drop": (0.03, 0.05, 0.08, 0.10), "cliff_patience": (1, 2, 3)},
    "gradient_amplification": {"amp_rise": (2.0, 3.0, 4.0, 6.0), "amp_flat": (1.5, 2.0, 3.0)},
    "sp_role_capture": {"capture_share": (0.55, 0.6, 0.7, 0.8), "capture_close": (0.3, 0.5)},
}
"""The thresholds tried for each detector when tuning (the defaults are among them)."""


def _outcomes(runs: Sequence[CellRun], detector: str, thresholds: dict):
    """Each run with its label and the verdict of ``detector`` under ``thresholds``."""
    cfg = DetectConfig(**thresholds)
    for run in runs:
        verdict = next(
            v
            for v in run_detectors(run.records, run.signatures, run.slots, cfg)
            if v.name == detector
        )
        yield run, LABELS[detector](run), verdict


def _lead(label: Label, verdict) -> int | None:
    """The step the alarm fired minus the step the labelled event began (both needed)."""
    if verdict.fired and label.positive and verdict.step is not None and label.began is not None:
        return verdict.step - label.began
    return None


def _score(runs: Sequence[CellRun], detector: str, thresholds: dict) -> dict:
    """TP/FP/FN, precision, recall, F1 and the median lead of ``detector`` over ``runs``."""
    tp = fp = fn = 0
    leads = []
    for _, label, verdict in _outcomes(runs, detector, thresholds):
        if verdict.fired and label.positive:
            tp += 1
            if (lead := _lead(label, verdict)) is not None:
                leads.append(lead)
        elif verdict.fired:
            fp += 1
        elif label.positive:
            fn += 1
    precision = tp / (tp + fp) if tp + fp else None
    recall = tp / (tp + fn) if tp + fn else None
    f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else None
    return {
        "cells": len(runs),
        "labelled": tp + fn,
        "fired": tp + fp,
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "median_lead": statistics.median(leads) if leads else None,
    }


def tune(runs: Sequence[CellRun], detector: str) -> dict:
    """The :data:`TUNE_GRID` thresholds of ``detector`` with the best F1 on ``runs`` (the
    defaults when nothing is labelled or fired, and on ties)."""
    defaults = DetectConfig()
    grid = TUNE_GRID[detector]
    best = {k: getattr(defaults, k) for k in grid}
    best_f1 = _score(runs, detector, best)["f1"]
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values, strict=True))
        f1 = _score(runs, detector, point)["f1"]
        if f1 is not None and (best_f1 is None or f1 > best_f1 + 1e-12):
            best, best_f1 = point, f1
    return best


def detector_evaluation(res: GridRuns) -> tuple[Table, Table]:
    """The detectors' precision and recall on the held-out seeds (thresholds tuned on the
    others), and, per cell, each labelled event or alarm: the step the event began, the step
    the alarm fired (under the same thresholds) and the lead between them."""
    runs = trained_runs(res)
    seeds = sorted({r.id.seed for r in runs})
    # the first half of the seeds (rounded up) tune, the others report: all but the last seed
    # up to 3 seeds, and more held out beyond, so a grid of many seeds is not judged on one
    split = (len(seeds) + 1) // 2 if len(seeds) > 1 else 0
    tuning = [r for r in runs if r.id.seed in seeds[:split]]
    held = [r for r in runs if r.id.seed in seeds[split:]]
    rows, events = [], []
    for detector in DETECTORS:
        thresholds = (
            tune(tuning, detector)
            if tuning
            else {k: getattr(DetectConfig(), k) for k in TUNE_GRID[detector]}
        )
        score = _score(held, detector, thresholds)
        tuned_on = sum(LABELS[detector](r).positive for r in tuning)
        rows.append(
            {
                "detector": detector,
                "tuned_on_seeds": ", ".join(str(s) for s in seeds[:split]) or "none (defaults)",
                "reported_on_seeds": ", ".join(str(s) for s in seeds[split:]),
                "thresholds": ", ".join(f"{k}={v}" for k, v in thresholds.items()),
                "labelled_tuning": tuned_on,
                "judged": tuned_on >= 1 and score["labelled"] >= 1,
                **score,
            }
        )
        for run, label, verdict in _outcomes(runs, detector, thresholds):
            if label.positive or verdict.fired:
                events.append(
                    {
                        "cell": run.id.name,
                        "seed": run.id.seed,
                        "set": "tuning" if run in tuning else "reported",
                        "detector": detector,
                        "labelled": label.positive,
                        "began": label.began,
                        "fired": verdict.fired,
                        "fired_step": verdict.step if verdict.fired else None,
                        "lead": _lead(label, verdict),
                    }
                )
    cols = [
        "detector",
        "tuned_on_seeds",
        "reported_on_seeds",
        "thresholds",
        "labelled_tuning",
        "judged",
        "cells",
        "labelled",
        "fired",
        "tp",
        "fp",
        "fn",
        "precision",
        "recall",
        "f1",
        "median_lead",
    ]
    note = (
        f"Each trained cell labelled by the rules of marlow.report.evidence (cliff: final at "
        f"least {CLIFF_DROP} under the peak; amplification: a multi-slot role's grad-norm peak "
        f"over first >= {AMP_RATIO} and >= {AMP_OVER}x every single-slot role's; capture: a "
        f"role's late grad-mass share >= {CAPTURE_SHARE} while another's length closes "
        f">= {CAPTURE_CLOSE} of the gap). Thresholds tuned for F1 on the first half of the seeds "
        "(rounded up); precision and recall on the others. labelled_tuning: the labelled events "
        "on the tuning seeds (cells, labelled: on the reported ones); judged: whether both sets hold a "
        "labelled event, the least a detector needs to be tuned on evidence and scored on "
        "other evidence (else its precision and recall say nothing of it). median_lead: fired "
        "step minus the step the labelled event began (negative: the alarm came first)."
    )
    event_cols = [
        "cell",
        "seed",
        "set",
        "detector",
        "labelled",
        "began",
        "fired",
        "fired_step",
        "lead",
    ]
    event_note = (
        "Every cell a rule labelled or a detector fired on, under the tuned thresholds above: "
        "began is the step the labelled event began, fired_step the step the alarm fired, lead "
        "their difference (negative: the alarm came first). set: whether the cell's seed tuned "
        "the thresholds or is the reported one."
    )
    return (
        Table("table-detector-eval", "Detectors judged on evidence", cols, rows, note),
        Table(
            "table-detector-events",
            "Alarms against labelled events",
            event_cols,
            events,
            event_note,
        ),
    )
