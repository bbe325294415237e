"""The cross-attention of qkv.nn.Transformer in the attention report: maps recorded during the
forward pass against each decoder layer asked for its weights directly (need_weights=True),
and the report's rectangular head view (decoder tokens left, source tokens right) in Chromium."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkv.nn import Transformer
from qkv.analysis import explain_cross_attention
from qkv.viz import save_html, save_png

from ..browser import browser  # noqa: F401  (the headless Chromium driver, module scope)

SRC = ["le", "chat", "noir", "dort", "ici"]  # 5 source tokens
TGT = ["<s>", "the", "black", "cat"]  # 4 decoder tokens


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = Transformer(32, 4, 2, 2, 64, dropout=0.0).eval()
    src, tgt = torch.randn(1, len(SRC), 32), torch.randn(1, len(TGT), 32)
    with torch.no_grad():
        ex = explain_cross_attention(model, lambda: model(src, tgt), TGT, SRC, focus="black", model_name="toy")
    return model, src, tgt, ex


def _direct(model, src, tgt) -> np.ndarray:
    """(L, H, T, S): every decoder layer's cross-attention asked for its weights directly."""
    seen = []
    hooks = [layer.cross_attn.register_forward_pre_hook(lambda m, a, k: seen.append((m, a[0], a[1])), with_kwargs=True)
             for layer in model.decoder.layers]
    try:
        with torch.no_grad():
            model(src, tgt)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():  # asked again, hooks gone: the module's own weights path, not the recorder's
        return torch.stack([m(q, kv, need_weights=True, average_attn_weights=False)[1][0] for m, q, kv in seen]).numpy()


def test_maps_are_the_cross_attention_weights(setup):
    model, src, tgt, ex = setup
    want = _direct(model, src, tgt)
    assert ex.maps.shape == want.shape == (2, 4, len(TGT), len(SRC))
    assert np.abs(ex.maps - want).max() < 1e-6
    assert ex.tokens == TGT and ex.key_tokens == SRC and ex.keys == SRC
    f = TGT.index("black")
    assert ex.focus_index == f and np.abs(ex.focus_weights - want[:, :, f]).max() < 1e-6
    assert ex.target_index == int(np.argmax(want[:, :, f].max(axis=(0, 1))))  # the source token it reads most
    l, h, w = ex.top_heads(1)[0]
    assert w == pytest.approx(want[:, :, f, ex.target_index].max(), abs=1e-6)
    assert [i for i, _ in ex.top_tokens(l, h, 5)] == list(np.argsort(-want[l, h, f], kind="stable"))


def test_report_names_source_tokens(setup, tmp_path):
    model, src, tgt, ex = setup
    ex2 = explain_cross_attention(model, lambda: model(src, tgt), TGT, SRC, focus="black", target="noir")
    assert ex2.keys[ex2.target_index] == "noir"
    text = ex2.to_string()
    assert '"black" most strongly to "noir"' in text and "uniform over 5 tokens" in text
    d = ex2.to_dict()
    assert d["key_tokens"] == SRC and d["target"]["token"] == "noir"
    assert all(t["token"] in SRC for t in d["heads"][0][0]["top_tokens"])
    png = save_png(ex2, tmp_path / "x.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_bad_calls(setup):
    model, src, tgt, _ = setup
    with pytest.raises(ValueError, match="match no capture point"):
        explain_cross_attention(model, lambda: model(src, tgt), TGT, SRC, modules="*nothing")
    with pytest.raises(ValueError, match="called no attention module"):
        explain_cross_attention(model, lambda: None, TGT, SRC)
    with pytest.raises(ValueError, match="query_tokens"):
        explain_cross_attention(model, lambda: model(src, tgt), TGT[:2], SRC)
    with pytest.raises(ValueError, match="not in the text"):
        explain_cross_attention(model, lambda: model(src, tgt), TGT, SRC, target="zebra")


def test_page_shows_decoder_and_source_columns(browser, setup, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    _, _, _, ex = setup
    path = tmp_path / "cross.html"
    save_html(ex, path)
    browser.get(path.as_uri())
    assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#left .tok")] == TGT
    assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#right .tok")] == SRC
    l, h = ex.best_head
    shown = browser.find_element(By.ID, "top-list").find_elements(By.TAG_NAME, "li")[0].text.split()
    top = ex.top_tokens(l, h, 1)[0]
    assert shown[0] == SRC[top[0]] and float(shown[1]) == pytest.approx(top[1], abs=1e-3)
    browser.find_element(By.ID, "q-0").click()  # another decoder token: its row over the source
    assert browser.find_element(By.ID, "sel-token").text == TGT[0]
    browser.find_element(By.ID, "tab-model").click()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#grid canvas")) == 2 * 4
    assert browser.execute_script("return document.querySelector('#grid canvas').width") == len(SRC)
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    summary = browser.find_element(By.ID, "summary").text
    assert "2 layers × 4 heads" in summary, summary
    assert browser.find_element(By.ID, "first-col").get_attribute("textContent") == f'on "{SRC[0]}"'  # a token, quoted
