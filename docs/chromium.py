"""Debian's headless Chromium for the scripts that photograph qkv's pages (make_images.py,
make_studio_images.py). Selenium is pointed at /usr/bin/chromium and /usr/bin/chromedriver, so
Selenium Manager is never asked to download anything."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")


@contextmanager
def headless_chromium(size: str = "1400,900") -> Iterator[Any]:
    """A Selenium driver of a fresh headless Chromium with a ``size`` ("W,H") window; quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="qkv-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (*FLAGS, f"--window-size={size}", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
