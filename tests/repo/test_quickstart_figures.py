"""The quickstart's figures, one per fact: each page that states how long the quickstart takes or
how many cells it runs says what the code and the committed measurements say.

* **Its time** comes from ``bench/results/quickstart_cold/*.json``: ``bench/quickstart_cold.py
  --seed S`` (``--avx2`` for the AVX2 files) runs ``marlow quickstart`` from a cold cache and
  writes the wall time of the whole command (``wall_s``) and the cells' share
  (``timings_s.cells_s``). A page states the range over the seeds, rounded to the second as
  Python rounds (``93-97 s``), or the per-seed times to a tenth. The install before it (``make
  install``, which ``make quickstart`` runs first) is not timed by any committed measurement, so
  a page that gives the time says it is not timed rather than guessing a figure. The ``zen3``
  files are a CPU without AVX-512 run on its own kernels, the ``epyc`` ones an AMD EPYC with
  AVX-512; a page may give their cells' times too, rounded to the second.
* **Its cells** come from :func:`marlow.worlds.quickstart.quickstart_grid`: the cells the grid
  expands to, those that train (``steps`` above 0) and the base cells.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer

from marlow.cli import app
from marlow.grids.grid import expand
from marlow.worlds.quickstart import quickstart_grid

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "quickstart_cold"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def measured(kind: str) -> list[dict]:
    """The committed cold runs of one kernel set or CPU (``native``, ``avx2``, ``zen3``), by
    seed."""
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob(f"{kind}-*.json"))]
    assert runs, f"no {RESULTS}/{kind}-*.json"
    return sorted(runs, key=lambda r: r["seed"])


def span(values: list[float]) -> str:
    low, high = round(min(values)), round(max(values))
    return f"{low} s" if low == high else f"{low}-{high} s"


def per_seed(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values) + " s"


NATIVE, AVX2, ZEN3, EPYC = (measured(k) for k in ("native", "avx2", "zen3", "epyc"))
TIMES = {
    "whole": span([r["wall_s"] for r in NATIVE]),
    "whole avx2": span([r["wall_s"] for r in AVX2]),
    "whole per seed": per_seed([r["wall_s"] for r in NATIVE]),
    "whole avx2 per seed": per_seed([r["wall_s"] for r in AVX2]),
    "cells": span([r["timings_s"]["cells_s"] for r in NATIVE]),
    "cells avx2": span([r["timings_s"]["cells_s"] for r in AVX2]),
    "whole zen3": span([r["wall_s"] for r in ZEN3]),
    "cells zen3": span([r["timings_s"]["cells_s"] for r in ZEN3]),
    "whole epyc": span([r["wall_s"] for r in EPYC]),
    "cells epyc": span([r["timings_s"]["cells_s"] for r in EPYC]),
    **{
        f"cell zen3 {name}": span([r["cells"][name]["seconds"] for r in ZEN3])
        for name in ZEN3[0]["cells"]
    },
}
"""Every way a page may state the quickstart's time, from the committed JSON."""

# (page, pattern): each group is a stated time, named by the figure it must equal
STATED: list[tuple[str, str, tuple[str, ...]]] = [
    ("README.md", r"then run \w+ cells: (\S+ s) on 2 cores", ("whole",)),
    ("README.md", r"\| whole command \| (\S+ s) \|", ("whole",)),
    ("docs/index.md", r"then run \w+ cells: (\S+ s) on 2 cores", ("whole",)),
    (
        "docs/tutorials/quickstart.md",
        r"The whole command took (\S+ s) \((\S+ s) with",
        ("whole", "whole avx2"),
    ),
    ("docs/tutorials/first-run.md", r"under the quickstart's (\S+ s)", ("whole",)),
    (
        "docs/benchmarks/quickstart.md",
        r"the whole command took (\S+ s) on the CPU's own kernels and (\S+ s) held to AVX2",
        ("whole", "whole avx2"),
    ),
    (
        "docs/benchmarks/quickstart.md",
        r"seeds 0 / 1 / 2: ([\d./ ]+ s) and ([\d./ ]+ s);",
        ("whole per seed", "whole avx2 per seed"),
    ),
    (
        "docs/benchmarks/quickstart.md",
        r"the \w+ cells (\S+ s) and\s+(\S+ s) of it",
        ("cells", "cells avx2"),
    ),
    (
        "README.md",
        r"seed 0 gave the Xeon's accuracies in (\S+ s) with AVX-512 and in (\S+ s) without",
        ("whole epyc", "whole zen3"),
    ),
    (
        "docs/benchmarks/quickstart.md",
        r"EPYC with AVX-512\*\* .*? --seed 0` took (\S+ s) \(the cells (\S+ s)\)",
        ("whole epyc", "cells epyc"),
    ),
    (
        "docs/benchmarks/quickstart.md",
        r"quickstart_cold.py --seed 0` took (\S+ s) \(the cells (\S+ s): Voting-IP (\S+ s), "
        r"Voting-SP (\S+ s), Single-SA (\S+ s), Voting-Base (\S+ s), Single-Base (\S+ s),",
        (
            "whole zen3",
            "cells zen3",
            *(
                f"cell zen3 {c}-tiny-s-Math"
                for c in ("Voting-IP", "Voting-SP", "Single-SA", "Voting-Base", "Single-Base")
            ),
        ),
    ),
]

# Seconds in a sentence that names the quickstart and are not its time: (page, figure)
OTHER_FIGURES = {
    # the full tiny-s recipe's pre-training, beside the quickstart's quicker world
    ("docs/concepts/tiny-world.md", "280-340 s"),
}
SECONDS = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)*(?:-\d+)?) s\b")


def text(page: str) -> str:
    """A page's text with its lines joined, so a sentence is found across a line break."""
    return " ".join((ROOT / page).read_text().split())


def paragraphs(page: Path) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", page.read_text())]


def clauses(page: Path) -> list[str]:
    """A page's sentences and the parts of a sentence between semicolons."""
    return [c for para in paragraphs(page) for c in re.split(r"(?<=[.;])\s+", para)]


def rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize(
    ("page", "pattern", "figures"), STATED, ids=[f"{p}:{'+'.join(f)}" for p, _, f in STATED]
)
def test_a_stated_quickstart_time_is_the_committed_measurement(page, pattern, figures):
    found = re.search(pattern, text(page))
    assert found, f"{page}: no longer says /{pattern}/; update STATED"
    for stated, figure in zip(found.groups(), figures, strict=True):
        assert stated == TIMES[figure], f"{page}: {stated}, measured {TIMES[figure]} ({figure})"


def test_a_page_giving_the_time_says_the_install_is_not_timed():
    """Where a page tells the reader to run ``make quickstart`` (install, then quickstart)."""
    pages = sorted({p for p, _, _ in STATED if "make quickstart" in text(p)})
    assert "README.md" in pages and "docs/index.md" in pages
    for page in pages:
        assert "not timed" in text(page), f"{page} times the quickstart, not saying the install"


def test_no_other_seconds_figure_is_given_for_the_quickstart():
    """A time in the same sentence (or the same part of one between semicolons) as the word
    quickstart, on any page, is one of the measured figures: an "about 95 s" typed again beside
    ``make quickstart`` fails here."""
    allowed = set(TIMES.values())
    stray = [
        f"{rel(page)}: {figure}: {clause[:80]}"
        for page in PAGES
        for clause in clauses(page)
        if "quickstart" in clause.lower()
        for figure in (m.group(0) for m in SECONDS.finditer(clause))
        if figure not in allowed and (rel(page), figure) not in OTHER_FIGURES
    ]
    assert stray == [], stray


def test_the_figures_are_what_the_committed_runs_give():
    """The derivation itself, on the committed files (2026-11-26, a 2-core Xeon)."""
    assert len(NATIVE) == len(AVX2) == 3
    assert all(r["cpu_capability"] == "AVX2" for r in AVX2)
    assert TIMES["whole"] == "93-97 s" and TIMES["whole avx2"] == "110-112 s"
    assert len(ZEN3) == 1 and ZEN3[0]["cpu_capability"] == "AVX2"  # 2026-11-29, a Zen 3 EPYC
    assert TIMES["whole zen3"] == "230 s" and TIMES["cells zen3"] == "213 s"  # cells forked
    assert len(EPYC) == 1 and EPYC[0]["cpu_capability"] == "AVX512"  # 2026-12-01, quiet
    assert TIMES["whole epyc"] == "110 s" and TIMES["cells epyc"] == "102 s"


# -- how many cells ------------------------------------------------------------------------------

CELLS = expand(quickstart_grid())
COUNTS = {
    "cells": len(CELLS),
    "trained": sum(c.config.steps > 0 for c in CELLS),
    "base": sum(c.kind == "base" for c in CELLS),
}
WORDS = {w: i for i, w in enumerate(["one", "two", "three", "four", "five", "six"], 1)}
NUMBER = r"(\d+|" + "|".join(WORDS) + ")"
# a count of the quickstart's cells, and what it counts
COUNTED = [
    (re.compile(rf"\b{NUMBER}\s+trained\b", re.I), "trained"),
    (re.compile(rf"\btrains\s+(?:the\s+)?{NUMBER}\b", re.I), "trained"),
    (re.compile(rf"\b{NUMBER}\s+(?:base|untrained)\s+cells\b", re.I), "base"),
    (re.compile(rf"\b{NUMBER}\s+cells\b", re.I), "cells"),
]


def counts(para: str) -> list[tuple[str, int]]:
    """The cell counts ``para`` states: (what, number)."""
    out = []
    for pattern, what in COUNTED:
        for m in pattern.finditer(para):
            word = m.group(1).lower()
            out.append((what, int(word) if word.isdigit() else WORDS[word]))
    return out


def quickstart_help() -> str:
    return " ".join((typer.main.get_command(app).commands["quickstart"].help or "").split())


def test_the_quickstart_grid_has_trained_and_base_cells():
    assert COUNTS["trained"] + COUNTS["base"] == COUNTS["cells"]
    assert COUNTS == {"cells": 5, "trained": 3, "base": 2}  # the pages' words, checked below


def test_the_cli_help_states_the_quickstarts_cell_counts():
    stated = counts(quickstart_help())
    assert {what for what, _ in stated} == {"cells", "trained", "base"}, stated
    for what, n in stated:
        assert n == COUNTS[what], f"marlow quickstart --help: {n} {what}, the grid has {COUNTS}"


def test_every_page_states_the_quickstarts_cell_counts_as_the_grid_has_them():
    stated = [
        (rel(page), what, n)
        for page in PAGES
        for para in paragraphs(page)
        if "quickstart" in para.lower()
        for what, n in counts(para)
    ]
    pages = {page for page, _, _ in stated}
    for page in ("README.md", "docs/index.md", "docs/tutorials/quickstart.md"):
        assert page in pages, f"{page} no longer says how many cells the quickstart runs"
    wrong = [f"{p}: {n} {what}" for p, what, n in stated if n != COUNTS[what]]
    assert wrong == [], f"{wrong}; the grid has {COUNTS}"


@pytest.mark.parametrize(
    ("para", "expected"),
    [
        ("trains and compares five cells", [("cells", 5)]),
        ("then train and compare 5 cells", [("cells", 5)]),
        ("trains the three cells", [("trained", 3), ("cells", 3)]),
        ("three trained and two base cells", [("trained", 3), ("base", 2)]),
    ],
)
def test_a_count_is_read_from_its_words(para, expected):
    assert sorted(counts(para)) == sorted(expected)
