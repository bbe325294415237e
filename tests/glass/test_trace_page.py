"""The interactive trace page: its embedded data (plain Python) and the page itself in headless
Chromium (Debian's chromium + chromium-driver through Selenium, as in test_browser.py).

Every number a cell explanation shows is compared with the float64 Trace it came from, to the
page's displayed precision.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from qkv.glass import trace
from qkv.glass.block import toy_block_trace
from qkv.glass.toy import sentence_trace
from qkv.glass.trace import Trace
from qkv.glass.page import TOP_TERMS, page_data, render_trace_page, save_trace_page
from ..browser import browser  # noqa: F401  (the headless Chromium driver, module scope)

SENTENCE = "Thinking Machines are learning"
HALF_ULP = 0.5e-3 + 1e-9  # the pages below show 3 decimals


def _embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="qkv-trace-data">(.*?)</script>', html, re.S)
    assert m, "the page carries its data in #qkv-trace-data"
    return json.loads(m.group(1))


def _model_sized(seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(12, 384))
    w = [rng.normal(scale=384 ** -0.5, size=(384, 64)) for _ in range(3)]
    b = rng.normal(scale=0.1, size=64)
    return trace(x, *w, b_q=b, num_heads=2, tokens=[f"w{i}" for i in range(12)],
                 meta={"model": "all-MiniLM-L6-v2", "layer": 1, "head": 3, "source": "model"})


# -- the embedded data, without a browser -----------------------------------------------------


def test_embedded_json_round_trips_to_the_trace_numbers():
    t = sentence_trace(SENTENCE, heads=2)
    d = _embedded(render_trace_page(t, token="are"))
    assert d == json.loads(json.dumps(page_data(t, token="are")))
    assert d["tokens"] == t.tokens and d["token"] == 2 and d["num_heads"] == 2 and d["kind"] == "attention"
    assert d["steps"] == ["x", "qkv", "scores", "scaled", "mask", "weights", "output", "concat", "projected"]
    v = d["variants"]["full"]
    for h in range(2):
        np.testing.assert_allclose(v["heads"][h]["weights"]["v"], t.heads[h].weights, rtol=1e-9)
        np.testing.assert_allclose(v["heads"][h]["scores"]["v"], t.heads[h].scores, rtol=1e-9)
        np.testing.assert_allclose(d["heads"][h]["raw"]["q"], t.heads[h].q, rtol=1e-9)
        np.testing.assert_allclose(d["heads"][h]["v"]["v"], t.heads[h].v, rtol=1e-9)
    np.testing.assert_allclose(v["concat"]["v"], t.concat, rtol=1e-9)
    np.testing.assert_allclose(v["projected"]["v"], t.projected, rtol=1e-9)


def test_the_other_mask_variant_is_the_reference_trace_with_the_mask_flipped():
    for causal in (False, True):
        t = sentence_trace(SENTENCE, heads=2, causal=causal)
        flipped = sentence_trace(SENTENCE, heads=2, causal=not causal)
        other = page_data(t)["variants"]["causal" if not causal else "full"]
        for h in range(2):
            np.testing.assert_allclose(other["heads"][h]["weights"]["v"], flipped.heads[h].weights, rtol=1e-9, atol=1e-15)
            np.testing.assert_allclose(other["heads"][h]["output"]["v"], flipped.heads[h].output, rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(other["projected"]["v"], flipped.projected, rtol=1e-9, atol=1e-15)


def test_masks_survive_the_toggle_and_a_causal_trace_with_its_own_mask_cannot_be_unmasked():
    t0 = sentence_trace(SENTENCE)
    keep = np.ones((4, 4), bool)
    keep[:, 0] = False  # hide the first key from everyone but itself
    keep[0, 0] = True
    t = trace(t0.x, t0.w_q, t0.w_k, t0.w_v, attn_mask=keep)
    d = page_data(t)
    assert d["causal_toggle"] and d["other_masks"] == ["bool"]
    both = trace(t0.x, t0.w_q, t0.w_k, t0.w_v, attn_mask=keep, is_causal=True)
    np.testing.assert_allclose(d["variants"]["causal"]["heads"][0]["weights"]["v"], both.weights, rtol=1e-9, atol=1e-15)
    d2 = page_data(both)
    assert not d2["causal_toggle"] and list(d2["variants"]) == ["causal"]


def test_biases_and_from_qkv_traces():
    t = _model_sized()
    d = page_data(t)
    assert d["bias"] == {"q": True, "k": False, "v": False}
    cell = d["heads"][1]["q"]["cells"][0][0]
    c = d["heads"][1]["q"]["cols"][0]
    assert len(cell["t"]) == TOP_TERMS and cell["rn"] == 384 - TOP_TERMS and cell["m"] == 384
    total = sum(a * b for _, a, b in cell["t"]) + cell["rest"] + cell["b"]
    assert total == pytest.approx(t.heads[1].q[0, c], abs=1e-8)
    shown = sorted(abs(a * b) for _, a, b in cell["t"])
    products = np.sort(np.abs(t.x[0] * t.w_q[:, 32 + c]))
    np.testing.assert_allclose(shown, products[-TOP_TERMS:], rtol=1e-8)  # the largest terms are listed
    g = Trace.from_qkv(t.heads[0].q, t.heads[0].k, t.heads[0].v, tokens=t.tokens)
    dg = page_data(g)
    assert dg["steps"][0] == "qkv" and not dg["has_x"] and "cells" not in dg["heads"][0]["q"]


def test_model_sized_page_is_summarised_and_small():
    t = _model_sized()
    html = render_trace_page(t)
    assert len(html.encode()) < 1_000_000, len(html.encode())
    d = _embedded(html)
    x = d["inputs"]["x"]
    assert x["shape"] == [12, 384] and None in x["cols"] and len(x["cols"]) < 12
    np.testing.assert_allclose(x["norm"], np.linalg.norm(t.x, axis=1), rtol=1e-9)
    assert "all-MiniLM-L6-v2 · layer 1 · head 3" in html


def test_tokens_cannot_break_out_of_the_script_and_the_page_needs_no_network():
    tokens = ["</script><script>alert(1)</script>", "a&b", "<!--", "“q”"]
    t = trace(np.eye(4), np.eye(4), np.eye(4), np.eye(4), tokens=tokens)
    html = render_trace_page(t)
    assert html.lower().count("</script>") == 3  # the data block's own end, the words block's and the script's
    assert _embedded(html)["tokens"] == tokens
    assert not re.search(r"https?:", html, re.I) and "src=" not in html and "@import" not in html


def test_block_page_data():
    b = toy_block_trace("the cat sat", causal=False)
    d = page_data(b, lang="zh")
    assert d["kind"] == "block" and d["steps"][0] == "positional" and d["steps"][-5:] == [
        "residual1", "norm1", "ffn", "residual2", "norm2"]
    causal = toy_block_trace("the cat sat", causal=True)
    np.testing.assert_allclose(d["variants"]["causal"]["block_output"]["v"], causal.output, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(d["variants"]["full"]["norm1"]["v"], b.norm1, rtol=1e-9)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"lang": "fr"}, "lang='fr'"),
        ({"precision": -1}, "precision=-1"),
        ({"precision": True}, "precision=True"),
        ({"token": 9}, "token=9 is out of range"),
        ({"token": "robot"}, "token='robot' is not one of the tokens"),
        ({"token": 1.5}, "token must be an int"),
    ],
)
def test_bad_arguments_are_named(kwargs, words):
    t = sentence_trace(SENTENCE)
    with pytest.raises((ValueError, TypeError), match=re.escape(words)):
        render_trace_page(t, **kwargs)


def test_not_a_trace():
    with pytest.raises(TypeError, match="trace must be a qkv.glass.Trace or BlockTrace"):
        render_trace_page(np.eye(3))


def test_save_returns_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = save_trace_page(sentence_trace("a b"), "page.html", lang="zh", token=-1)
    assert path == str(tmp_path / "page.html")
    assert _embedded((tmp_path / "page.html").read_text(encoding="utf-8"))["token"] == 1


# -- the page in a browser ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy():
    return sentence_trace(SENTENCE, heads=2)


@pytest.fixture(scope="module")
def toy_page(toy, tmp_path_factory):
    return tmp_path_factory.mktemp("page") / "toy.html"


def _open(browser, t, path, **kw):
    save_trace_page(t, path, **kw)
    browser.get(path.as_uri())
    assert browser.execute_script("return document.body.dataset.ready") == "true"
    return browser


def _by(browser, css):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, css)


def _step(browser, step):
    _by(browser, f'#step-list button[data-step="{step}"]')[0].click()
    assert _current(browser) == step


def _current(browser):
    flow = browser.execute_script("return document.querySelector('#flow .node.current').dataset.step")
    listed = _by(browser, '#step-list button[aria-current="step"]')
    assert len(listed) == 1 and listed[0].get_attribute("data-step") == flow
    assert browser.execute_script("return document.body.dataset.step") == flow
    return flow


def _hover(browser, matrix, r, c):
    from selenium.webdriver.common.action_chains import ActionChains

    (cell,) = _by(browser, f'td[data-m="{matrix}"][data-r="{r}"][data-c="{c}"]')
    ActionChains(browser).move_to_element(cell).perform()
    return cell


def _num(text):
    return float(text.replace("(", "").replace(")", "").replace("−", "-"))


def _nums(browser, css):
    return [_num(e.text) for e in _by(browser, "#explain-body " + css)]


def _close(shown, expected):
    assert len(shown) == len(expected), (shown, expected)
    for s, e in zip(shown, expected):
        assert abs(s - e) <= HALF_ULP, (shown, expected)


def test_page_loads_offline_without_errors(browser, toy, toy_page):
    _open(browser, toy, toy_page)
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert "counted from 0" in _by(browser, "#counting")[0].text
    assert _current(browser) == "x"


def test_every_step_by_button_and_by_keyboard(browser, toy, toy_page):
    from selenium.webdriver.common.keys import Keys

    _open(browser, toy, toy_page)
    steps = page_data(toy)["steps"]
    seen = [_current(browser)]
    for _ in steps[1:]:
        _by(browser, "#next")[0].click()
        seen.append(_current(browser))
        assert _by(browser, "#matrices table"), f"step {seen[-1]} shows no matrix"
    assert seen == steps and not _by(browser, "#next")[0].is_enabled()
    body = _by(browser, "body")[0]
    for key in (Keys.ARROW_LEFT, "k"):
        body.send_keys(key)
    assert _current(browser) == steps[-3]
    body.send_keys(Keys.HOME)
    assert _current(browser) == steps[0]
    for key in (Keys.ARROW_RIGHT, "j"):
        body.send_keys(key)
    assert _current(browser) == steps[2]
    _by(browser, '#flow g.node[data-step="weights"]')[0].click()
    assert _current(browser) == "weights"
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_score_scaled_weight_and_output_cells_explain_themselves(browser, toy, toy_page):
    _open(browser, toy, toy_page)
    h = toy.heads[0]
    i, j = 1, 2
    _step(browser, "scores")
    _hover(browser, "scores", i, j)
    _close(_nums(browser, ".term .a"), h.q[i])
    _close(_nums(browser, ".term .b"), h.k[j])
    _close(_nums(browser, ".term .p"), h.q[i] * h.k[j])
    _close(_nums(browser, ".total"), [h.scores[i, j]])

    _step(browser, "scaled")
    _hover(browser, "scaled", i, j)
    _close(_nums(browser, ".root") + _nums(browser, ".total"), [math.sqrt(3), h.scaled[i, j]])

    _step(browser, "weights")
    _hover(browser, "weights", i, j)
    row = h.scaled[i]
    e = np.exp(row - row.max())
    _close(_nums(browser, ".max"), [row.max()])
    _close(_nums(browser, ".exp .e"), e)
    _close(_nums(browser, ".sum") + _nums(browser, ".numerator") + _nums(browser, ".total"),
           [e.sum(), e[j], h.weights[i, j]])

    _step(browser, "output")
    _hover(browser, "output", i, 2)
    _close(_nums(browser, ".term .a"), h.weights[i])
    _close(_nums(browser, ".term .b"), h.v[:, 2])
    _close(_nums(browser, ".total"), [h.output[i, 2]])

    _step(browser, "qkv")
    _hover(browser, "k", 3, 1)
    _close(_nums(browser, ".term .a"), toy.x[3])
    _close(_nums(browser, ".term .b"), toy.w_k[:, 1])
    _close(_nums(browser, ".total"), [h.k[3, 1]])


def test_a_pinned_cell_stays_until_escape(browser, toy, toy_page):
    from selenium.webdriver.common.keys import Keys

    _open(browser, toy, toy_page)
    _step(browser, "scores")
    _hover(browser, "scores", 0, 0).click()
    _hover(browser, "scores", 3, 3)
    assert _by(browser, "#explain-body")[0].get_attribute("data-r") == "0"
    _by(browser, "body")[0].send_keys(Keys.ESCAPE)
    assert _by(browser, "#explain-body .hint")


def test_causal_toggle_hides_later_keys_and_rows_still_sum_to_one(browser, toy, toy_page):
    _open(browser, toy, toy_page)
    _step(browser, "weights")

    def row(i):
        return [(_num(c.text), "masked" in c.get_attribute("class")) for c in _by(browser, f'td[data-m="weights"][data-r="{i}"]')]

    before = row(1)
    assert before[3][0] > 0 and not before[3][1]
    _by(browser, "#causal-toggle")[0].click()
    after = row(1)
    assert after[3] == (0.0, True) and after[2][1] and not after[1][1]
    assert abs(sum(v for v, _ in after) - 1) <= 3 * HALF_ULP
    causal = sentence_trace(SENTENCE, heads=2, causal=True)
    _close([v for v, _ in after], causal.heads[0].weights[1])
    _step(browser, "mask")
    _hover(browser, "masked", 1, 3)
    assert "causal mask" in _by(browser, "#explain-body")[0].text


def test_head_switch_shows_head_1(browser, toy, toy_page):
    from selenium.webdriver.support.ui import Select

    _open(browser, toy, toy_page)
    _step(browser, "weights")
    Select(_by(browser, "#head-select")[0]).select_by_value("1")
    shown = [_num(c.text) for c in _by(browser, 'td[data-m="weights"][data-r="2"]')]
    _close(shown, toy.heads[1].weights[2])
    assert "(head 1)" in _by(browser, "figure.matrix figcaption")[0].text


def test_language_switch_changes_every_label(browser, toy, toy_page):
    from selenium.webdriver.support.ui import Select

    _open(browser, toy, toy_page)
    _step(browser, "weights")
    en = browser.execute_script("return document.body.innerText")
    Select(_by(browser, "#lang-select")[0]).select_by_value("zh")
    zh = browser.execute_script("return document.body.innerText")
    assert "注意力权重" in zh and "上一步" in zh and "从 0 开始编号" in zh and "把最多的注意力给了" in zh
    latin = [w for w in re.findall(r"[A-Za-z]{4,}", zh) if w not in toy.tokens and w not in ("English", "softmax", "Python", "JSON", "model")]
    assert not latin, latin  # only tokens, names (English, Python, JSON, softmax) and d_model stay Latin
    assert browser.execute_script("return document.documentElement.lang") == "zh-Hans"
    Select(_by(browser, "#lang-select")[0]).select_by_value("en")
    assert browser.execute_script("return document.body.innerText") == en


def test_chinese_tokens_and_initial_language_and_token(browser, tmp_path):
    t = sentence_trace("我爱你")
    assert t.tokens == ["我", "爱", "你"]
    _open(browser, t, tmp_path / "zh.html", lang="zh", token="爱")
    assert _by(browser, "#token-select")[0].get_attribute("value") == "1"
    assert "“爱”" in _by(browser, "#narrative")[0].text
    assert [th.text for th in _by(browser, 'figure.matrix tbody th')] == ["0 我", "1 爱", "2 你"]
    assert _by(browser, "#head-control")[0].is_displayed() is False  # one head: no head switch


def test_model_sized_page_summarises_and_expands_the_largest_terms(browser, tmp_path):
    t = _model_sized()
    _open(browser, t, tmp_path / "model.html")
    assert "all-MiniLM-L6-v2 · layer 1 · head 3" in browser.title
    heads = [th.text for th in _by(browser, 'figure.matrix thead th')]
    assert "…" in heads and "‖row‖" in heads and len(heads) < 12
    _step(browser, "qkv")
    cols = page_data(t)["heads"][0]["q"]["cols"]
    _hover(browser, "q", 5, 1)
    assert len(_by(browser, "#explain-body .term")) == TOP_TERMS
    rest, bias, total = _nums(browser, ".restsum"), _nums(browser, ".biasval"), _nums(browser, ".total")
    _close(total, [t.heads[0].q[5, cols[1]]])
    _close(bias, [t.b_q[cols[1]]])
    terms = t.x[5] * t.w_q[:, cols[1]]
    top = np.argsort(-np.abs(terms))[:TOP_TERMS]
    _close(rest, [terms.sum() - terms[top].sum()])
    _step(browser, "scores")
    _hover(browser, "scores", 2, 7)
    assert len(_by(browser, "#explain-body .term")) == 32  # d_k = 32: every term, in a scrolling list
    _close(_nums(browser, ".total"), [t.heads[0].scores[2, 7]])


def test_block_page_walks_the_whole_block(browser, tmp_path):
    b = toy_block_trace("the cat sat")
    _open(browser, b, tmp_path / "block.html")
    assert _current(browser) == "positional"
    _hover(browser, "positional", 2, 1)
    _close(_nums(browser, ".total"), [b.positional[2, 1]])
    _step(browser, "norm1")
    _hover(browser, "norm1", 1, 2)
    _close(_nums(browser, ".total"), [b.norm1[1, 2]])
    assert f"{b.mean1[1]:.3f}" in _by(browser, "#explain-body")[0].text
    _step(browser, "ffn")
    _hover(browser, "ffn_out", 0, 3)
    _close(_nums(browser, ".term .a"), b.ffn_relu[0])
    _close(_nums(browser, ".total"), [b.ffn_out[0, 3]])
    _step(browser, "norm2")
    _hover(browser, "block_output", 2, 0)
    _close(_nums(browser, ".total"), [b.output[2, 0]])
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_score_function_step_and_sinks_explain_themselves(browser, tmp_path):
    from selenium.webdriver.support.ui import Select

    pytest.importorskip("torch")
    from qkv.score_mods import Softcap

    t = sentence_trace(SENTENCE, heads=2, score_mod=Softcap(1.0), sinks=[0.5, -1.0])
    _open(browser, t, tmp_path / "softcap.html", token=1)
    steps = [b.get_attribute("data-step") for b in _by(browser, "#step-list button")]
    assert steps[3:6] == ["scaled", "modified", "mask"]
    assert "score function: softcap 1·tanh(s/1) · sinks 0.5, -1" in _by(browser, "#page-sub")[0].text
    _step(browser, "modified")
    h, i, j = t.heads[0], 1, 2
    assert "s′ = 1 · tanh(s / 1)" in _by(browser, "#step-formula")[0].text
    assert "squashes every score smoothly into (−1, 1)" in _by(browser, "#narrative")[0].text
    shown = [_num(c.text) for c in _by(browser, 'td[data-m="modified"][data-r="1"]')]
    _close(shown, h.modified[1])
    _hover(browser, "modified", i, j)
    _close(_nums(browser, ".total"), [h.modified[i, j]])

    _step(browser, "weights")
    assert "exp(sink_h − max_i)" in _by(browser, "#step-formula")[0].text
    share = 100 * h.sink_share[i]
    assert f"absorbs {share:.1f}% of row {i}'s attention" in _by(browser, "#narrative")[0].text
    _hover(browser, "weights", i, j)
    row = h.modified[i]
    e = np.exp(row - row.max())
    _close(_nums(browser, ".exp .e"), e)
    _close(_nums(browser, ".sink .e"), [np.exp(0.5 - row.max())])
    _close(_nums(browser, ".sum") + _nums(browser, ".total"), [e.sum() + np.exp(0.5 - row.max()), h.weights[i, j]])

    _by(browser, "#causal-toggle")[0].click()  # the score function's output stays; the mask now follows it
    _step(browser, "mask")
    assert "s′ + M" in _by(browser, "#step-formula")[0].text
    _hover(browser, "masked", 2, 1)
    assert "modified score passes unchanged" in _by(browser, "#explain-body")[0].text
    causal = sentence_trace(SENTENCE, heads=2, causal=True, score_mod=Softcap(1.0), sinks=[0.5, -1.0])
    _step(browser, "weights")
    _close([_num(c.text) for c in _by(browser, 'td[data-m="weights"][data-r="2"]')], causal.heads[0].weights[2])

    Select(_by(browser, "#lang-select")[0]).select_by_value("zh")
    assert "吸收了第 1 行" in _by(browser, "#narrative")[0].text
    _step(browser, "modified")
    assert _by(browser, "#step-title")[0].text == "打分函数" and "平滑地压进" in _by(browser, "#narrative")[0].text
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_alibi_slope_follows_the_head(browser, tmp_path):
    from selenium.webdriver.support.ui import Select

    pytest.importorskip("torch")
    from qkv.score_mods import ALiBi, alibi_slopes

    t = sentence_trace(SENTENCE, heads=2, score_mod=ALiBi(alibi_slopes(2), symmetric=True))
    _open(browser, t, tmp_path / "alibi.html")
    _step(browser, "modified")
    assert "head 0: m = 0.0625" in _by(browser, "#step-formula")[0].text
    Select(_by(browser, "#head-select")[0]).select_by_value("1")
    assert "head 1: m = 0.00391" in _by(browser, "#step-formula")[0].text
    assert "penalises farther keys by slope·distance" in _by(browser, "#narrative")[0].text
    _hover(browser, "modified", 0, 3)
    assert "0.00391 · |3 − 0|" in _by(browser, "#explain-body")[0].text
    _close(_nums(browser, ".total"), [t.heads[1].modified[0, 3]])


@pytest.mark.parametrize("n", [22, 64])
def test_long_inputs_scroll_inside_their_matrix_and_keep_the_panels_in_view(browser, tmp_path, n):
    """A 22- or 64-token trace at the softmax step: the page never scrolls sideways, every matrix
    stays inside the main column (scrolling in its own box where wider), and the step list and
    the cell panel stay on screen. Screenshots are kept beside the page."""
    words = " ".join(f"w{i}" for i in range(n))
    _open(browser, sentence_trace(words, heads=2, causal=True), tmp_path / f"long{n}.html")
    _step(browser, "weights")
    geometry = browser.execute_script(
        """
        const main = document.querySelector('main').getBoundingClientRect();
        const aside = document.querySelector('aside#explain').getBoundingClientRect();
        const side = document.querySelector('.side').getBoundingClientRect();
        const figs = [...document.querySelectorAll('#matrices figure.matrix')].map(f => {
          const r = f.getBoundingClientRect();
          return {right: r.right, scroll: f.scrollWidth, client: f.clientWidth};
        });
        return {page: document.documentElement.scrollWidth, view: window.innerWidth, main: main.right,
                aside: aside.left, sideTop: side.top, figs};
        """
    )
    assert geometry["page"] <= geometry["view"], geometry  # no sideways scroll of the whole page
    assert geometry["figs"] and all(f["right"] <= geometry["main"] + 1 for f in geometry["figs"]), geometry
    assert geometry["main"] <= geometry["aside"] + 1, geometry  # the matrices do not run under the cell panel
    if n == 64:
        assert any(f["scroll"] > f["client"] for f in geometry["figs"]), geometry  # wide: scrolls in its box
    browser.execute_script("window.scrollTo(0, document.body.scrollHeight)")
    assert browser.execute_script("return document.querySelector('.side').getBoundingClientRect().top") >= -1
    shot = tmp_path / f"long{n}.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
