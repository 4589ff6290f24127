"""The report as one self-contained HTML page, and each table as CSV.

The page needs nothing beside itself: the CSS is inline and every figure is a PNG in a
``data:image/png;base64`` URI. Each table is a ``<table id=...>`` and each figure a
``<figure id=...>`` holding one ``<img>``, with the ids of :mod:`marlow.report.tables` /
:mod:`marlow.report.figures`, so a reader (or a test) can find them. Every text is HTML-escaped.
Wide tables sit in a horizontally scrolling box; numbers are right-aligned; fired detector
verdicts are highlighted. A section holding one table shows the section heading only (the
table's caption says what it holds); in a section of several tables each gets its title.

CSV choices: the header is the table's ``columns``; None and non-finite numbers are empty
fields; numbers keep full precision (Python's shortest round-trip ``repr``); booleans are
``true`` / ``false``.
"""

from __future__ import annotations

import base64
import csv
import io
import math
import re
from collections.abc import Sequence
from html import escape

from marlow.report.figures import Plot
from marlow.report.tables import Table, fmt

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
h1 { margin-bottom: 0.2em; }
nav a { margin-right: 1em; }
section { margin: 2em 0; }
.scroll { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; font-size: 13px; margin: 0.5em 0; }
caption { text-align: left; color: #555; padding: 0.3em 0; caption-side: top; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: left; white-space: nowrap; }
th { background: #f3f3f3; }
td.num { text-align: right; }
td.wrap { white-space: normal; min-width: 24em; }
tr.fired td { background: #fde2e2; }
tr.none td { color: #888; text-align: center; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; }
#headline ul { font-size: 15px; line-height: 1.5; padding-left: 1.2em; }
p.summary { color: #555; }
p.problem { color: #a00; font-size: 13px; }
"""
WRAP_COLUMNS = {
    "evidence",
    "reason",
    "statement",
    "measure",
}  # long free text; every other column stays on one line
_NUMBER = re.compile(r"[-+\u2212]?\d|\u2013$")  # a number, or the en dash of a missing one


def _cell(column: str, text: str) -> str:
    """Numbers right-aligned, text left-aligned, free text wrapped; a figure's id (the claims'
    ``figure`` column) links to the figure on the page."""
    if column == "figure" and text.startswith("fig-"):
        return f'<td><a href="#{escape(text)}">{escape(text)}</a></td>'
    cls = "wrap" if column in WRAP_COLUMNS else ("num" if _NUMBER.match(text) else "")
    return f'<td class="{cls}">{escape(text)}</td>' if cls else f"<td>{escape(text)}</td>"


def table_html(table: Table) -> str:
    view = table.view or [(c, lambda row, c=c: fmt(row.get(c), column=c)) for c in table.columns]
    head = "".join(f"<th>{escape(h)}</th>" for h, _ in view)
    body = []
    for row in table.rows:
        cls = ' class="fired"' if row.get("fired") is True else ""
        cells = "".join(_cell(h, show(row)) for h, show in view)
        body.append(f"<tr{cls}>{cells}</tr>")
    if not body:
        body.append(f'<tr class="none"><td colspan="{len(view)}">none</td></tr>')
    caption = f"<caption>{escape(table.note)}</caption>" if table.note else ""
    return (
        f'<div class="scroll"><table id="{escape(table.id)}">{caption}'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )


def figure_html(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    problems = "".join(f'<p class="problem">layout problem: {escape(p)}</p>' for p in plot.problems)
    return (
        f'<figure id="{escape(plot.id)}"><img alt="{escape(plot.alt)}" '
        f'src="data:image/png;base64,{data}"><figcaption>{escape(plot.caption)}</figcaption>'
        f"{problems}</figure>"
    )


def page(
    title: str,
    summary: str,
    sections: Sequence[tuple[str, str, list[Table | Plot]]],
    headline: Sequence[str] = (),
) -> str:
    """The whole page; ``headline`` is the list of sentences at its top; ``sections`` are
    (anchor, heading, tables and figures in order)."""
    nav = " ".join(f'<a href="#{escape(a)}">{escape(h.split(":")[0])}</a>' for a, h, _ in sections)
    lines = "".join(f"<li>{escape(s)}</li>" for s in headline)
    parts = [
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<section id="headline"><ul>{lines}</ul></section>' if headline else "",
        f'<p class="summary">{escape(summary)}</p><nav>{nav}</nav>',
    ]
    for anchor, heading, items in sections:
        parts.append(f'<section id="{escape(anchor)}"><h2>{escape(heading)}</h2>')
        for item in items:
            if isinstance(item, Table):
                title = f"<h3>{escape(item.title)}</h3>" if len(items) > 1 else ""
                parts.append(title + table_html(item))
            else:
                parts.append(figure_html(item))
        parts.append("</section>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _csv_value(value: object) -> object:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def table_csv(table: Table) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.columns)
    for row in table.rows:
        writer.writerow([_csv_value(row.get(c)) for c in table.columns])
    return buf.getvalue()
