"""Writes a long-run grid's summary page, titled TITLE, from its committed report and index.

    marlow report runs/tiny-long -o docs/results/tiny-long/report.html
    cp runs/tiny-long/index.json docs/results/tiny-long/index.json
    .venv/bin/python docs/results/long_summary.py docs/results/tiny-long "Long runs: tiny-long" \
        > docs/results/tiny-long.md

Reads ``report.json`` (every table of ``marlow report``) and ``index.json`` (each cell's wall
seconds, as the grid runner recorded them) from the folder, so the page is regenerated from
committed files alone. Per task, variant, scale and workflow: the mean peak and final validation
accuracy of IP and SP over seeds and the base; then the claims, the dose-response when the grid
has one (its table, and each row's slope with its interval in words), the mitigation
criterion, the detectors against the labels, the report's figures whose PNG is committed (shown;
the per-role ones folded) and the cell time. The page links the committed report.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def _fmt(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def accuracy_rows(tables: dict) -> list[dict]:
    """Per (task, scale with variant, workflow): IP and SP peak / final over seeds, and the base."""
    cells = tables["table-delta"]["rows"]
    groups: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in cells:
        g = groups[(r["task"], r["scale"], r["workflow"])]
        if r["policy"] in ("ip", "sp") and r["peak"] is not None:
            g[f"{r['policy']}_peak"].append(r["peak"])
            g[f"{r['policy']}_final"].append(r["final"])
        if r["base_accuracy"] is not None and r["policy"] == "ip":
            g["base"].append(r["base_accuracy"])
    return [
        {
            "task": task,
            "scale": scale,
            "workflow": wf,
            "base": _mean_sd(g["base"]),
            "IP peak": _mean_sd(g["ip_peak"]),
            "IP final": _mean_sd(g["ip_final"]),
            "SP peak": _mean_sd(g["sp_peak"]),
            "SP final": _mean_sd(g["sp_final"]),
            "seeds": len(g["ip_peak"]),
        }
        for (task, scale, wf), g in groups.items()
    ]


def timing_lines(index: dict) -> list[str]:
    seconds: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for cell in index["cells"].values():
        if cell["state"] == "done" and cell.get("seconds") is not None:
            seconds[(cell["task"], cell["scale"], cell["kind"])].append(cell["seconds"])
    rows = [
        {
            "task": task,
            "scale": scale,
            "kind": kind,
            "cells": len(v),
            "sum (min)": sum(v) / 60,
            "median (s)": statistics.median(v),
            "max (s)": max(v),
        }
        for (task, scale, kind), v in sorted(seconds.items())
    ]
    total = sum(sum(v) for v in seconds.values())
    return [
        *_table(rows, ["task", "scale", "kind", "cells", "sum (min)", "median (s)", "max (s)"]),
        "",
        f"Cell time summed over every cell: {total / 60:.1f} min (the runner ran two at a time).",
    ]


DOSE_LEFT_OUT = ("task", "scale", "variants", "cells", "df", "figure")
"""Columns of the report's dose table the page leaves out (the section names them once)."""


def dose_sentence(row: dict) -> str:
    """One dose row in words: its slope per doubling of n with its interval and test."""
    who = f"{row['workflow']} {row['policy'].upper()} {row['measure']} ({row['role']})"
    if row["slope"] is None:
        return f"- {who}: no slope (n never varies within a seed)."
    text = f"- {who}: {row['slope']:+.3f} per doubling of n"
    if row.get("ci_low") is not None:
        text += f" (95 % CI {row['ci_low']:+.3f} to {row['ci_high']:+.3f})"
    if row.get("p_value") is not None:
        text += f", p = {row['p_value']:.3g}"
        text += f" (smallest possible {row['min_p']:.3g})" if row.get("min_p") is not None else ""
    if row.get("detectable") is not None:
        text += f"; detectable with 80 % power: {row['detectable']:.3f}"
    return f"{text}: {row['verdict']}."


def dose_lines(tables: dict) -> list[str]:
    """The Dose-response section (nothing when the report has no dose table)."""
    if "table-dose" not in tables:
        return []
    table = tables["table-dose"]
    return [
        "## Dose-response of same-role parallelism",
        "",
        table["note"],
        "",
        *_table(table["rows"], [c for c in table["columns"] if c not in DOSE_LEFT_OUT]),
        "",
        *[dose_sentence(r) for r in table["rows"]],
        "",
    ]


def figure_lines(root: Path, figures: list[dict]) -> list[str]:
    """The Figures section: each figure of the report whose PNG is committed under ``root``, as
    an image under its title and caption; the per-role figures (``fig-roles-*``) folded under
    one title."""
    shown = [f for f in figures if (root / f["png"]).is_file()]
    grid = [f for f in shown if not f["id"].startswith("fig-roles-")]
    roles = [f for f in shown if f["id"].startswith("fig-roles-")]
    lines = ["## Figures", ""]
    for f in grid:
        lines += [f"**{f['title']}** (`{f['id']}`): {f['caption']}", "", _image(root, f), ""]
    if roles:
        lines += [f'??? note "Per-role series of every trained cell ({len(roles)} figures)"', ""]
        for f in roles:
            lines += [f"    **{f['title']}**", "", f"    {_image(root, f)}", ""]
    return lines


def _image(root: Path, figure: dict) -> str:
    """A figure as a Markdown image, loaded when it scrolls into view."""
    return f"![{figure['title']}]({root.name}/{figure['png']}){{ loading=lazy }}"


def main(folder: str, title: str) -> str:
    root = Path(folder)
    report = json.loads((root / "report.json").read_text())
    index = json.loads((root / "index.json").read_text())
    tables = report["tables"]
    claims_cols = [c for c in tables["table-claims"]["columns"] if c not in ("statement",)]
    lines = [
        f"# {title}",
        "",
        f'Generated by `docs/results/long_summary.py {folder} "{title}"` from the committed '
        f"report ([`{root.name}/report.html`]({root.name}/report.html), every table as CSV under "
        f"`{root.name}/report/`).",
        "",
        "## Headline",
        "",
        *[f"- {line}" for line in report["headline"]],
        "",
        "## Validation accuracy (mean ± sd over seeds)",
        "",
        *_table(accuracy_rows(tables), list(accuracy_rows(tables)[0]) if tables else []),
        "",
        "## Claims",
        "",
        tables["table-claims"]["note"],
        "",
        *_table(tables["table-claims"]["rows"], claims_cols),
        "",
        *dose_lines(tables),
        "## Mitigations on the unstable cells",
        "",
        tables["table-mitigations"]["note"],
        "",
        *_table(tables["table-mitigations"]["rows"], tables["table-mitigations"]["columns"]),
        "",
        "## Detectors judged on evidence",
        "",
        tables["table-detector-eval"]["note"],
        "",
        *_table(tables["table-detector-eval"]["rows"], tables["table-detector-eval"]["columns"]),
        "",
        f"Alarms against labelled events: {len(tables['table-detector-events']['rows'])} rows in "
        f"`{root.name}/report/table-detector-events.csv`.",
        "",
        *figure_lines(root, report["figures"]),
        "## Cell time",
        "",
        *timing_lines(index),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(main(sys.argv[1], sys.argv[2]))
