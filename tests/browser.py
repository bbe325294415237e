"""Headless Chromium for the tests that open qkv's pages (Debian's chromium + chromium-driver,
driven by Selenium). Selenium is pointed at both binaries explicitly, so Selenium Manager never
downloads a browser or a driver. Import the ``browser`` fixture into a test module to use it."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Iterator

import pytest

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1400,1000")


def skip_without_chromium() -> None:
    """Skip the calling module when Chromium or Selenium is missing."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        pytest.skip("headless Chromium is not installed: apt-get install chromium chromium-driver", allow_module_level=True)
    pytest.importorskip("selenium.webdriver", reason="the browser tests need Selenium: pip install selenium")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One headless Chromium per test module, its console log kept (``get_log("browser")``)."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        pytest.skip("headless Chromium is not installed: apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need Selenium: pip install selenium")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="qkv-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
