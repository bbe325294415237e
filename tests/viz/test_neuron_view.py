"""The report's neuron view in headless Chromium: the query and key vectors behind one weight,
checked against the Explanation's own vectors and maps."""

from __future__ import annotations

import numpy as np
import pytest

from ..browser import browser  # noqa: F401  (the headless Chromium driver, module scope)
from .test_browser import By, ex, page  # noqa: F401  (the report fixtures)


def test_neuron_view_expands_a_weight_into_its_dot_product(browser, page, ex):  # noqa: F811
    browser.get(page.as_uri())
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true"
    assert ex.vectors is not None and ex.vectors.shape[1:] == (2, ex.num_heads, len(ex.tokens), 32)
    layer, head = ex.best_head
    f, t = ex.focus_index, ex.target_index
    panel = browser.find_element(By.ID, "neuron")
    assert panel.is_displayed()  # opens on the focus → target pair
    terms = ex.score_terms(layer, head, f, t)
    rows = browser.find_elements(By.CSS_SELECTOR, "#neuron-table tbody tr")
    assert len(rows) == 32
    for d in (0, 7, 31):
        cells = [c.text for c in rows[d].find_elements(By.TAG_NAME, "td")]
        assert float(cells[3]) == pytest.approx(terms[d], abs=1e-3)
    summary = browser.find_element(By.ID, "neuron-sum")
    assert float(summary.get_attribute("data-score")) == pytest.approx(terms.sum(), abs=1e-4)
    assert float(summary.get_attribute("data-weight")) == pytest.approx(float(ex.maps[layer, head, f, t]), abs=1e-4)
    # another key: the panel follows the click
    j = 1
    browser.find_element(By.ID, f"k-{j}").click()
    want = ex.score_terms(layer, head, f, j).sum()
    assert float(browser.find_element(By.ID, "neuron-sum").get_attribute("data-score")) == pytest.approx(want, abs=1e-4)
    assert f'"{ex.tokens[j]}"' in browser.find_element(By.ID, "neuron-title").text
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_page_data_keeps_vectors_exactly(ex):  # noqa: F811
    import base64

    from qkv.viz.html import page_data

    d = page_data(ex)
    v = np.frombuffer(base64.b64decode(d["vectors"]), dtype="<f4").reshape(ex.vectors.shape)
    assert np.array_equal(v, ex.vectors) and d["head_dim"] == 32 and d["scale"] == pytest.approx(32**-0.5)
