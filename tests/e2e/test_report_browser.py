"""The HTML report opened in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``make test`` installs) shows every table and every figure.

The page is built from the synthetic results folder of ``tests/unit/test_report.py`` and opened
from disk (``file://``): the report is one self-contained file, so no server is needed. Chromium
runs with the flags this machine needs (no sandbox as root, no GPU, no background networking: the
network is closed) and a fresh profile folder.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from marlow.report import build_report
from tests.unit.test_report import write_results

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)
TABLES = (
    "table-cells",
    "table-missing",
    "table1",
    "table-delta",
    "table-paired",
    "table-instability",
    "table2",
    "table-signatures",
    "table-detectors",
    "table-claims",
    "table-detector-eval",
    "table-detector-events",
    "table-mitigations",
)
FIGURES = ("fig-delta", "fig-scatter", "fig-dynamics-math-tiny-s", "fig-instability")
# and one per-role figure per trained cell that finished: Voting IP and SP, Eval-Opt IP (two seeds
# each), Eval-Opt SP (seed 1 failed) and SA-RL (two seeds)
ROLE_FIGURES = 9

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Debian's Chromium is not installed (/usr/bin/chromium); `make test` installs it "
    "with apt-get install chromium chromium-driver",
)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="marlow-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    # the driver's path is given, so Selenium Manager never tries to download one
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def page(browser, tmp_path_factory):
    root = write_results(tmp_path_factory.mktemp("grid"))
    html = build_report(root)
    browser.get(html.resolve().as_uri())
    return browser


def test_every_table_is_shown(page):
    from selenium.webdriver.common.by import By

    for table_id in TABLES:
        table = page.find_element(By.ID, table_id)
        page.execute_script("arguments[0].scrollIntoView();", table)
        assert table.is_displayed(), table_id
        assert table.size["width"] > 0 and table.size["height"] > 0, table_id
        assert table.find_elements(By.CSS_SELECTOR, "tbody tr"), table_id
    table1 = page.find_element(By.ID, "table1").text
    assert "0.650 \u00b1 0.071 (n=2)" in table1  # Voting IP over the two seeds
    assert "Eval-Opt-SP-tiny-s-Math-s1" in page.find_element(By.ID, "table-missing").text


def test_every_figure_is_shown_and_decoded(page):
    from selenium.webdriver.common.by import By

    for fig_id in FIGURES:
        figure = page.find_element(By.ID, fig_id)
        img = figure.find_element(By.TAG_NAME, "img")
        page.execute_script("arguments[0].scrollIntoView();", img)
        assert figure.is_displayed() and img.is_displayed(), fig_id
        assert img.get_attribute("src").startswith("data:image/png;base64,"), fig_id
    images = page.find_elements(By.TAG_NAME, "img")
    assert len(images) == len(FIGURES) + ROLE_FIGURES
    widths = page.execute_script(
        "return Array.from(document.images).map(i => [i.complete, i.naturalWidth]);"
    )
    assert all(done and width > 0 for done, width in widths), widths


def test_page_ids_are_exactly_the_reports(page):
    ids = page.execute_script(
        "return Array.from(document.querySelectorAll('table[id], figure[id]')).map(e => e.id);"
    )
    roles = [i for i in ids if i.startswith("fig-roles-")]
    assert len(roles) == ROLE_FIGURES
    assert sorted(set(ids) - set(roles)) == sorted(TABLES + FIGURES)


# Read from the page: for every figure, its image's box, alt text and caption; and the layout
# problems the report found in the figure's own text boxes (matplotlib's extents).
FIGURE_FACTS = """
return Array.from(document.querySelectorAll('figure')).map(f => {
  const img = f.querySelector('img'), cap = f.querySelector('figcaption');
  const r = img.getBoundingClientRect();
  return {id: f.id, alt: img.alt, caption: cap ? cap.textContent : '',
          box: [r.left + scrollX, r.top + scrollY, r.right + scrollX, r.bottom + scrollY],
          natural: [img.naturalWidth, img.naturalHeight],
          problems: Array.from(f.querySelectorAll('p.problem')).map(p => p.textContent)};
});
"""


def test_every_figure_has_alt_text_a_caption_and_a_clean_layout(page):
    facts = page.execute_script(FIGURE_FACTS)
    assert len(facts) == len(FIGURES) + ROLE_FIGURES
    width = page.execute_script("return document.documentElement.clientWidth;")
    for fig in facts:
        assert len(fig["alt"].split()) >= 4, fig["id"]  # a sentence, not a file name
        assert len(fig["caption"].split()) >= 6, fig["id"]
        assert not fig["problems"], (fig["id"], fig["problems"])  # no text overlaps or clipping
        left, top, right, bottom = fig["box"]
        assert left >= 0 and right <= width + 0.5, (fig["id"], fig["box"], width)  # not clipped
        assert right - left > 0 and bottom - top > 0
    boxes = sorted(f["box"] for f in facts)
    for a, b in zip(boxes, boxes[1:], strict=False):  # figures never sit on one another
        assert a[3] <= b[1] + 0.5 or a[2] <= b[0] + 0.5, (a, b)


def test_the_headline_opens_the_page(page):
    from selenium.webdriver.common.by import By

    first = page.execute_script("return document.querySelector('h1').nextElementSibling.id;")
    assert first == "headline"
    items = [li.text for li in page.find_elements(By.CSS_SELECTOR, "#headline li")]
    assert len(items) == 4, items
    assert "beat the base model" in items[0] and "matched pairs" in items[1]
    assert items[2].startswith("The study's claims here: C1 ")
    assert items[3].startswith("Detectors fired:")


def test_each_claim_links_to_the_figure_that_shows_it(page):
    from selenium.webdriver.common.by import By

    links = page.find_elements(By.CSS_SELECTOR, "#table-claims a[href^='#fig-']")
    assert len(links) == 4
    for link in links:
        target = link.get_attribute("href").split("#", 1)[1]
        assert page.find_elements(By.ID, target), target  # the figure is on the page
