"""The dose-response grid's power, before it runs, from the long grid's own variances.

    .venv/bin/python docs/results/dose_power.py --scale "tiny-m lr3e-3" --scale "tiny-m lr1e-3" \\
        > docs/results/dose_power.md
    .venv/bin/python docs/results/dose_power.py --json                # the same numbers as JSON

Reads the committed long grid (``docs/results/tiny-long``: ``report/table-cells.csv``,
``report/table2.csv`` and ``index.json`` for its validation size), takes its trained **math**
cells of one ``scale`` as the report titles it (with its variant: ``tiny-m lr3e-3``), and
estimates, per measure, the standard deviation over seeds *within* a (workflow, policy) group,
pooled over the groups with their degrees of freedom as weights (s^2 = sum (n_g - 1) s_g^2 /
sum (n_g - 1)):

* ``peak``, ``terminal_drop`` (peak - final) from ``table-cells.csv``;
* ``amplitude``: log2 of the parallel role's ``grad_norm_ratio`` (the role with several slots:
  Voting's generators; Eval-Opt has none and is left out) from ``table2.csv``, the measure the
  report's dose table uses;
* ``mass_share``: no column of the committed report holds it (the long grid's report has no
  per-role mass share), so it is **skipped**: its power is not estimated here.

**Validation size.** A validation accuracy on V problems carries a binomial part on top of the
seed-to-seed spread. The model: var(V) = var_seed + c / V, with c / V0 (V0 = the long grid's
``task.val_size``, 100) estimated as p (1 - p) / V0 for the peak and 2 p (1 - p) / V0 for a drop
(two accuracies, taken as independent), p the mean over the scale's cells of the accuracies the
measure is made of (peaks; peaks and finals); var_seed = the pooled variance minus c / V0,
floored at 0. **Choice of this script**: where c / V0 exceeds the pooled variance itself (in the
long grid the peak at both rates and the drop at lr1e-3; the output shows the model's binomial
sd beside the one used), the binomial part is capped at the pooled variance, so that sigma at V0 is always the observed spread. Without
the cap a design at the long grid's own V0 would be given a larger sigma than the long grid
showed. Why the observed spread can be smaller: every seed validates on the same V0 problems,
so the problems' draw is shared by the seeds and only the answers' sampling differs between
them; p (1 - p) / V0 counts both. Two caveats: the peak is the largest of 16 validations, so
its noise is not purely binomial; and the seed part is assumed not to change with V. The
amplitude has no binomial part. A scale whose cells did not fall (tiny-m lr1e-3: drops of
0-0.05) gives the spread of stable runs, not that of runs at the edge of stability the dose grid
is meant to sit at: plan with the unstable rate's.

**Designs.** S seeds, doses log2 n in {0, 1, 2} (n = 1, 2, 4), one cell per (seed, dose,
policy); sigma is assumed the same at every n and under IP and SP, and independent across a
seed's cells (no seed effect shared between doses: the within-seed slope would only gain from
one). Then, for the dose table's tests (``marlow.report.significance.detectable_effect``: the effect a
two-sided test at alpha 0.05 finds with 80 % power, (t(0.975, df) + t(0.80, df)) SE):

* slope per doubling: SE = sigma / sqrt(Sxx), Sxx = S * sum_d (x_d - xbar)^2 = 2 S,
  df = N - S - 1 = 2 S - 1;
* IP - SP difference of the two slopes: SE = sqrt(2) sigma / sqrt(2 S), df = 2 S - 1 (the
  smaller of the two, equal here);
* IP - SP difference of means at one n, paired by seed: SE = sqrt(2 / S) sigma, df = S - 1 (the
  paired sign-flip test the report runs on such pairs reaches p < 0.05 only from 6 seeds on:
  its smallest p is 2 / 2^S).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from marlow.report.significance import detectable_effect

ROOT = Path(__file__).parent / "tiny-long"
SEEDS = (3, 4, 5, 6, 8)
DOSES = (0.0, 1.0, 2.0)  # log2 n for n = 1, 2, 4
VAL_SIZES = (100, 200, 300)
MEASURES = ("peak", "terminal_drop", "amplitude")


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def samples(root: Path, scale: str) -> dict[str, dict[tuple[str, str], list[float]]]:
    """measure -> (workflow, policy) -> the values over seeds, for the math cells of ``scale``."""
    out: dict[str, dict[tuple[str, str], list[float]]] = {m: defaultdict(list) for m in MEASURES}
    for r in _rows(root / "report" / "table-cells.csv"):
        if r["kind"] == "trained" and r["task"] == "math" and r["scale"] == scale:
            out["peak"][r["workflow"], r["policy"]].append(float(r["peak"]))
            out["terminal_drop"][r["workflow"], r["policy"]].append(float(r["terminal_drop"]))
    for r in _rows(root / "report" / "table2.csv"):
        parallel = int(r["slots"]) > 1 and r["grad_norm_ratio"]
        if r["kind"] == "trained" and r["task"] == "math" and r["scale"] == scale and parallel:
            ratio = float(r["grad_norm_ratio"])
            out["amplitude"][r["workflow"], r["policy"]].append(math.log2(ratio))
    return out


def pooled(groups: dict[tuple[str, str], list[float]]) -> tuple[float, int]:
    """The df-weighted pooled within-group variance and its degrees of freedom."""
    parts = [(len(v) - 1, statistics.variance(v)) for v in groups.values() if len(v) >= 2]
    df = sum(d for d, _ in parts)
    if not df:
        raise SystemExit("no group has two seeds: no within-group variance to pool")
    return sum(d * var for d, var in parts) / df, df


def binomial_part(root: Path, scale: str, measure: str, v0: int) -> float:
    """c / V0 of the validation-size model (0 for the amplitude)."""
    cells = [
        r
        for r in _rows(root / "report" / "table-cells.csv")
        if r["kind"] == "trained" and r["task"] == "math" and r["scale"] == scale
    ]
    if measure == "peak":
        p = statistics.fmean(float(r["peak"]) for r in cells)
        return p * (1 - p) / v0
    if measure == "terminal_drop":
        p = statistics.fmean(float(r[k]) for r in cells for k in ("peak", "final"))
        return 2 * p * (1 - p) / v0
    return 0.0


def analyse(root: Path, scale: str) -> dict:
    """The pooled spreads of ``scale`` and the detectable effects of every candidate design."""
    v0 = json.loads((root / "index.json").read_text())["grid"]["settings"]["task"]["val_size"]
    groups = samples(root, scale)
    spread, designs = {}, []
    for measure in MEASURES:
        if not groups[measure]:
            raise SystemExit(f"no trained math cell of scale {scale!r} in {root}")
        var, df = pooled(groups[measure])
        model = binomial_part(root, scale, measure, v0)
        binom = min(model, var)  # capped: sigma at V0 is the observed spread
        var_seed = var - binom
        spread[measure] = {
            "groups": len(groups[measure]),
            "cells": sum(len(v) for v in groups[measure].values()),
            "df": df,
            "sd": math.sqrt(var),
            "sd_binomial_model": math.sqrt(model),
            "sd_binomial": math.sqrt(binom),
            "sd_seed": math.sqrt(var_seed),
        }
        for seeds in SEEDS:
            for val in VAL_SIZES if binom else (None,):
                sigma = math.sqrt(var_seed + (binom * v0 / val if val else 0.0))
                xbar = statistics.fmean(DOSES)
                sxx = seeds * sum((x - xbar) ** 2 for x in DOSES)
                df_slope = len(DOSES) * seeds - seeds - 1
                designs.append(
                    {
                        "measure": measure,
                        "seeds": seeds,
                        "val_size": val,
                        "sigma": sigma,
                        "slope": detectable_effect(sigma / math.sqrt(sxx), df_slope),
                        "slope_diff": detectable_effect(sigma * math.sqrt(2 / sxx), df_slope),
                        "mean_diff": detectable_effect(sigma * math.sqrt(2 / seeds), seeds - 1),
                    }
                )
    return {"scale": scale, "val_size_long": v0, "spread": spread, "designs": designs}


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(results: list[dict], command: str) -> str:
    lines = [
        "# Power of the dose-response grid",
        "",
        f"Generated by `{command}` from the committed long grid (`docs/results/tiny-long/`); "
        "the model and its assumptions are in the script's docstring.",
        "",
        "Detectable: the true effect a two-sided test at alpha 0.05 finds with 80 % power, "
        "(t(0.975, df) + t(0.80, df)) SE (`marlow.report.significance.detectable_effect`). slope: per "
        "doubling of n (doses n = 1, 2, 4, one cell per seed, dose and policy); slope IP - SP: "
        "the difference of the two policies' slopes; mean IP - SP: IP minus SP at one n, paired "
        "by seed. peak and drop in accuracy (fractions); amplitude in log2 of the parallel "
        "role's grad-norm peak over first (1 = a doubling). The gradient mass share has no "
        "column in the committed long report: its power is not estimated. The within-seed "
        "permutation test of a slope can reach p < 0.05 with every design here (its smallest p "
        "is 2 / 6^S); the paired sign-flip test of IP - SP at one n only from 6 seeds on "
        "(2 / 2^S).",
        "",
    ]
    for res in results:
        lines += [
            f"## {res['scale']} (math)",
            "",
            "Within-group spread over seeds, pooled over (workflow, policy) groups (df-weighted); "
            f"binomial part at the long grid's {res['val_size_long']} validation problems.",
            "",
            "| measure | groups | cells | df | sd | binomial sd (model) | binomial sd (used) "
            "| seed sd |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for measure, s in res["spread"].items():
            lines.append(
                f"| {measure} | {s['groups']} | {s['cells']} | {s['df']} | {_f(s['sd'])} | "
                f"{_f(s['sd_binomial_model'])} | {_f(s['sd_binomial'])} | {_f(s['sd_seed'])} |"
            )
        lines += [
            "",
            "| measure | seeds | val size | cells (2 workflows) | sigma | slope | slope IP - SP "
            "| mean IP - SP |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for d in res["designs"]:
            cells = d["seeds"] * len(DOSES) * 2 * 2
            lines.append(
                f"| {d['measure']} | {d['seeds']} | {d['val_size'] or '-'} | {cells} | "
                f"{_f(d['sigma'])} | {_f(d['slope'])} | {_f(d['slope_diff'])} | "
                f"{_f(d['mean_diff'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scale",
        action="append",
        help='a scale of the long grid as its report titles it (repeatable; default "tiny-m '
        'lr3e-3")',
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="the long grid's folder")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    scales = args.scale or ["tiny-m lr3e-3"]
    results = [analyse(args.root, scale) for scale in scales]
    if args.json:
        return json.dumps(results, indent=2) + "\n"
    command = "docs/results/dose_power.py " + " ".join(f'--scale "{s}"' for s in scales)
    return markdown(results, command)


if __name__ == "__main__":
    sys.stdout.write(main())
