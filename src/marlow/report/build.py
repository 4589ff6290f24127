"""``marlow report DIR``: every table and figure of a grid results folder, written to disk.

:func:`make_report` computes (nothing written); :func:`build_report` writes, for
``out = DIR/report.html`` (the default):

* ``report.html``: the page, self-contained (figures embedded);
* ``report.json``: every table (title, note, columns, rows) and the figure list, with NaN and
  infinities written as ``null`` so any JSON reader takes it;
* ``report/<table id>.csv`` for every table and ``report/<figure id>.png`` for every figure
  (the folder is named after the page without its suffix).

Every file is written atomically (``marlow.fileio``: a ``.tmp`` sibling, then ``os.replace``), the
page last, so a reader never sees half a file and a present page means a complete report. Choices
of marlow: the default place is inside the results folder; the output path must end in
``.html`` (or ``.htm``), so that the page, its JSON and its folder cannot collide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from marlow.config import ConfigError
from marlow.fileio import write_bytes, write_json, write_text
from marlow.report.dose import dose_figures, dose_series, dose_table
from marlow.report.evidence import claims_table, detector_evaluation, mitigation_table
from marlow.report.figures import (
    Plot,
    delta_figure,
    dynamics_figures,
    instability_figure,
    role_figures,
    scatter_figure,
)
from marlow.report.html import page, table_csv
from marlow.report.results import GridRuns, load_results
from marlow.report.runtables import detectors_table, signatures_table, table2
from marlow.report.tables import (
    Table,
    cells_table,
    delta_table,
    instability_table,
    matched_pairs,
    missing_table,
    paired_table,
    table1,
    tools_table,
)
from marlow.workflows.load import workflow_title


@dataclass
class Report:
    results: GridRuns
    tables: dict[str, Table]  # id -> table, in page order
    plots: dict[str, Plot]  # id -> figure, in page order
    sections: list[tuple[str, str, list[str]]]  # (anchor, heading, table and figure ids)

    @property
    def headline(self) -> list[str]:
        return headline(self.tables)

    @property
    def summary(self) -> str:
        res = self.results
        return (
            f"{res.root}: {len(res.ids) + _unidentified(res)} cells, {len(res.runs)} done, "
            f"{len(res.missing)} missing; {len(matched_pairs(res))} matched IP/SP pairs"
        )


def headline(tables: dict[str, Table]) -> list[str]:
    """The page's opening sentences, written from the tables: which trained cells beat their
    base (peak, mean over seeds), IP against SP with the paired test over every matched pair,
    and which detectors fired where."""
    out = []
    means: dict[tuple, list[float]] = {}
    for r in tables["table-delta"].rows:
        if r["delta_peak"] is not None and r["policy"] in ("ip", "sp"):
            key = (
                workflow_title(r["workflow"]),
                r["policy"].upper(),
                r["scale"],
                r["task"].title(),
            )
            means.setdefault(key, []).append(r["delta_peak"])
    if means:
        gains = {k: sum(v) / len(v) for k, v in means.items()}
        up = [k for k, g in gains.items() if g > 0]
        best = max(gains, key=gains.get)
        out.append(
            f"{len(up)} of {len(gains)} trained multi-agent cells beat the base model at their "
            f"peak (mean over seeds); the largest gain is {' '.join(best)} "
            f"({100 * gains[best]:+.1f} points)."
        )
    pooled = [r for r in tables["table-paired"].rows if r["workflow"] == "all"]
    if pooled and pooled[0]["n"]:
        r = pooled[0]
        higher = "IP" if r["mean_diff"] > 0 else "SP" if r["mean_diff"] < 0 else "neither"
        p = "" if r["p_value"] is None else f", paired sign-flip p = {r['p_value']:.3g}"
        floor = f" (the smallest p possible with {r['n']} pairs is {r['min_p']:.3g})"
        out.append(
            f"IP vs SP over {r['n']} matched pairs: {higher} peaks higher on average, by "
            f"{100 * abs(r['mean_diff']):.1f} points{p}{floor if r['min_p'] > 0.05 else ''}."
        )
    by_variant: dict[str | None, list[str]] = {}
    for r in tables["table-claims"].rows:
        by_variant.setdefault(r.get("variant"), []).append(f"{r['claim']} {r['verdict']}")
    out.append(
        "The study's claims here: "
        + "; ".join(
            (f"{variant}: " if variant else "") + ", ".join(verdicts)
            for variant, verdicts in by_variant.items()
        )
        + " (the Claims section gives effects, intervals and tests)."
    )
    if "table-dose" in tables:
        judged = [r for r in tables["table-dose"].rows if r["verdict"] != "no prediction"]
        out.append(
            "Dose-response over the parallel role's slots n (slope per doubling): "
            + "; ".join(
                f"{workflow_title(r['workflow'])} {r['policy'].upper()} {r['measure']} "
                f"{r['verdict']}" + ("" if r["slope"] is None else f" ({r['slope']:+.3g}/doubling)")
                for r in judged
            )
            + " (the Dose-response section gives intervals, tests and detectable effects)."
        )
    fired: dict[str, list[str]] = {}
    for r in tables["table-detectors"].rows:
        if r["fired"]:
            fired.setdefault(r["detector"], []).append(r["cell"])
    if tables["table-detectors"].rows:
        if fired:
            where = "; ".join(
                f"{name} in {len(cells)} cell{'s' * (len(cells) > 1)} ({', '.join(cells[:3])}"
                f"{', ...' if len(cells) > 3 else ''})"
                for name, cells in fired.items()
            )
            out.append(f"Detectors fired: {where}.")
        else:
            out.append("No detector fired in any trained cell.")
    return out


def _unidentified(res: GridRuns) -> int:
    """Missing cells whose index entry had no identity (they are not in ``res.ids``)."""
    known = {i.name for i in res.ids}
    return sum(1 for m in res.missing if m["name"] not in known)


def make_report(results_dir: str | Path) -> Report:
    """Load ``results_dir`` and compute every table and figure."""
    res = load_results(results_dir)
    delta, inst = delta_table(res), instability_table(res)
    tables = [
        cells_table(res),
        missing_table(res),
        table1(res),
        delta,
        paired_table(res),
        inst,
        table2(res),
        signatures_table(res),
        detectors_table(res),
    ]
    dynamics, roles = dynamics_figures(res), role_figures(res)
    tables = [
        claims_table(res, delta, [p.id for p in dynamics]),
        *tables,
        *detector_evaluation(res),
        mitigation_table(res),
    ]
    plots = [
        delta_figure(delta),
        scatter_figure(res),
        *dynamics,
        instability_figure(inst),
        *roles,
    ]
    # only a grid whose cells differ in one role's slot count has a dose-response
    doses = dose_series(res)
    dose, dose_plots = dose_table(doses), dose_figures(doses)
    dose_ids = ["table-dose", *(p.id for p in dose_plots)] if dose is not None else []
    tables[1:1] = [dose] if dose is not None else []
    plots += dose_plots
    tools = tools_table(res)
    tables += [tools] if tools is not None else []
    sections = [
        ("sec-claims", "Claims C1-C4", ["table-claims"]),
        *([("sec-dose", "Dose-response of same-role parallelism", dose_ids)] if dose_ids else []),
        ("sec-table1", "Table 1: peak accuracy and residuals vs SA-RL", ["table1"]),
        ("sec-delta", "Delta against the base", ["fig-delta", "table-delta"]),
        ("sec-ip-sp", "IP vs SP", ["fig-scatter", "table-paired"]),
        ("sec-dynamics", "Training dynamics", [p.id for p in dynamics]),
        ("sec-instability", "Instability amplitude", ["fig-instability", "table-instability"]),
        ("sec-roles", "Per-role training series", [p.id for p in roles]),
        ("sec-table2", "Table 2: per-role peak-over-first ratios", ["table2"]),
        ("sec-signatures", "Trajectory signatures", ["table-signatures"]),
        *([("sec-tools", "Tool stages", ["table-tools"])] if tools is not None else []),
        ("sec-detectors", "Detector verdicts", ["table-detectors"]),
        (
            "sec-detector-eval",
            "Detectors judged on evidence",
            ["table-detector-eval", "table-detector-events"],
        ),
        ("sec-mitigations", "Mitigations on the unstable cells", ["table-mitigations"]),
        ("sec-cells", "Cells", ["table-cells", "table-missing"]),
    ]
    return Report(res, {t.id: t for t in tables}, {p.id: p for p in plots}, sections)


def _finite(obj: object) -> object:
    """``obj`` with every NaN / infinity replaced by None (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def build_report(results_dir: str | Path, out_html: str | Path | None = None) -> Path:
    """Write the report of ``results_dir`` (default ``results_dir/report.html``); return the
    page's path. Raises FileNotFoundError / ConfigError for a folder without a grid index."""
    out = Path(out_html) if out_html is not None else Path(results_dir) / "report.html"
    if out.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(f"report output {out} must end in .html (its CSV folder is beside it)")
    report = make_report(results_dir)
    folder = out.with_suffix("")
    for t in report.tables.values():
        write_text(folder / f"{t.id}.csv", table_csv(t))
    for p in report.plots.values():
        write_bytes(folder / f"{p.id}.png", p.png)
    payload = {
        "results_dir": str(report.results.root),
        "summary": report.summary,
        "headline": report.headline,
        "grid": report.results.grid,
        "tables": {
            t.id: {"title": t.title, "note": t.note, "columns": t.columns, "rows": t.rows}
            for t in report.tables.values()
        },
        "figures": [
            {
                "id": p.id,
                "title": p.title,
                "caption": p.caption,
                "png": f"{folder.name}/{p.id}.png",
                "layout_problems": list(p.problems),
            }
            for p in report.plots.values()
        ],
    }
    write_json(out.with_suffix(".json"), _finite(payload))
    items = {**report.tables, **report.plots}
    sections = [(a, h, [items[i] for i in ids]) for a, h, ids in report.sections]
    write_text(out, page("marlow report", report.summary, sections, report.headline))
    return out
