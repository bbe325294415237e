"""The HTML report in headless Chromium (Debian's chromium + chromium-driver, driven by Selenium).

Selenium is pointed at /usr/bin/chromedriver and /usr/bin/chromium explicitly, so Selenium
Manager never downloads a browser or a driver.
"""

from __future__ import annotations


import numpy as np
import pytest

from ..browser import browser, skip_without_chromium  # noqa: F401  (browser: the module's Chromium)
from ..helpers import bundled_model_dir

skip_without_chromium()
bundled_model_dir(module_level=True)

from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

from qkv.analysis import explain  # noqa: E402
from qkv.viz import save_html  # noqa: E402
from qkv.analysis.explain import SENTENCE  # noqa: E402

@pytest.fixture(scope="module")
def ex():
    return explain(SENTENCE, focus="she")


@pytest.fixture(scope="module")
def page(ex, tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "report.html"
    save_html(ex, path)
    return path


def _text(d, id_):
    return d.find_element(By.ID, id_).text


def test_page_opens_on_the_strongest_head_without_network(browser, page, ex):
    browser.get(page.as_uri())
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true"
    layer, head = ex.best_head
    assert _text(browser, "head-label") == f"Layer {layer} · Head {head}"
    assert _text(browser, "sel-token") == "she" and _text(browser, "top-token") == "alice"
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_select_layer_and_head_then_hover(browser, page, ex, tmp_path):
    browser.get(page.as_uri())
    Select(browser.find_element(By.ID, "layer")).select_by_value("5")
    browser.find_element(By.CSS_SELECTOR, '.head-btn[data-head="9"]').click()
    assert _text(browser, "head-label") == "Layer 5 · Head 9"
    for q in (8, 1, 18):  # she, alice, recommendation
        ActionChains(browser).move_to_element(browser.find_element(By.ID, f"q-{q}")).perform()
        expected = int(np.argmax(ex.maps[5, 9, q]))
        assert _text(browser, "sel-token") == ex.tokens[q]
        assert _text(browser, "top-token") == ex.tokens[expected]
        assert float(_text(browser, "top-weight")) == pytest.approx(float(ex.maps[5, 9, q, expected]), abs=1e-3)
        assert "top" in browser.find_element(By.ID, f"k-{expected}").get_attribute("class")
    lines = browser.find_elements(By.CSS_SELECTOR, "#lines line")
    assert lines and {ln.get_attribute("data-head") for ln in lines} == {"9"}

    # shift-click adds head 4: lines in two colours, the panel shows the mean of the two heads
    head4 = browser.find_element(By.CSS_SELECTOR, '.head-btn[data-head="4"]')
    ActionChains(browser).key_down(Keys.SHIFT).click(head4).key_up(Keys.SHIFT).perform()
    ActionChains(browser).move_to_element(browser.find_element(By.ID, "q-8")).perform()
    assert _text(browser, "head-label") == "Layer 5 · Heads 4, 9"
    mean = ex.maps[5, [4, 9], 8].mean(0)
    assert _text(browser, "top-token") == ex.tokens[int(np.argmax(mean))]
    assert {ln.get_attribute("data-head") for ln in browser.find_elements(By.CSS_SELECTOR, "#lines line")} == {"4", "9"}
    shot = tmp_path / "head_view.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 20_000


def test_model_view_grid_opens_a_head(browser, page, ex, tmp_path):
    browser.get(page.as_uri())
    browser.find_element(By.ID, "tab-model").click()
    assert not browser.find_element(By.ID, "head-view").is_displayed()
    cells = browser.find_elements(By.CSS_SELECTOR, "#grid .cell")
    assert len(cells) == ex.num_layers * ex.num_heads
    shot = tmp_path / "model_view.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
    browser.find_element(By.ID, "cell-2-4").click()
    assert browser.find_element(By.ID, "head-view").is_displayed()
    assert _text(browser, "head-label") == "Layer 2 · Head 4"
    assert _text(browser, "top-token") == ex.tokens[int(np.argmax(ex.maps[2, 4, 8]))]
