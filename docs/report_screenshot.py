"""Screenshot the top of a ``marlow report`` page in headless Chromium (the README's picture).

    python docs/report_screenshot.py runs/pm/report.html docs/img/report-top.png

Needs Debian's ``chromium`` and ``chromium-driver`` (``make browser``) and selenium (the test
extra). The window is 1280 x 900 CSS pixels; the picture is what a reader sees first.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--window-size=1280,900",
)


def main(page: Path, out: Path) -> None:
    profile = tempfile.mkdtemp(prefix="marlow-shot-")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(page.resolve().as_uri())
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    print(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
