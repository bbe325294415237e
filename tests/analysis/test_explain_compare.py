"""qkv explain --compare: two texts through the bundled model, checked against maps computed
independently (the model run with output_attentions) and against the distance written out."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qkv.cli import main
from qkv.analysis.compare import align_tokens, compare
from qkv.viz.compare import render_compare_html, save_compare_html, save_compare_png

from ..browser import browser  # noqa: F401  (the headless Chromium driver, module scope)

models = pytest.importorskip("qkv.models")

BIG = "The trophy didn't fit in the suitcase because it was too big."
SMALL = "The trophy didn't fit in the suitcase because it was too small."


@pytest.fixture(scope="module")
def model(bundled_model):
    return bundled_model


@pytest.fixture(scope="module")
def cmp(model):
    return compare(BIG, SMALL, focus="it", model=model)


def _maps(model, text):
    ids, mask = model.tokenize([text])
    with torch.inference_mode():
        att = model(ids, mask, output_attentions=True).attentions
    toks = [model.tokenizer.id_to_token(int(i)) for i in ids[0]]
    return torch.stack([a[0] for a in att]).double().numpy(), toks  # (L, H, N, N)


def test_distance_is_total_variation_written_out(model, cmp):
    ma, ta = _maps(model, BIG)
    mb, tb = _maps(model, SMALL)
    assert cmp.a.tokens == ta and cmp.b.tokens == tb
    i_big, i_small = ta.index("big"), tb.index("small")
    assert cmp.pairs == [(i, i) for i in range(len(ta)) if i != i_big]  # one word differs, same length
    f = ta.index("it")
    assert cmp.a.focus_index == cmp.b.focus_index == f
    ra, rb = ma[:, :, f], mb[:, :, f]  # (L, H, N)
    keep = [i for i in range(len(ta)) if i != i_big]
    want = 0.5 * (np.abs(ra[..., keep] - rb[..., keep]).sum(-1) + ra[..., i_big] + rb[..., i_small])
    assert np.abs(cmp.distance - want).max() < 1e-5
    sa = ra[..., keep] / ra[..., keep].sum(-1, keepdims=True)
    sb = rb[..., keep] / rb[..., keep].sum(-1, keepdims=True)
    assert np.abs(cmp.shared - 0.5 * np.abs(sa - sb).sum(-1)).max() < 1e-5
    l, h, d = cmp.top_changes(1)[0]
    assert d == pytest.approx(want.max(), abs=1e-5) and want[l, h] == pytest.approx(want.max(), abs=1e-5)
    (i, lost), (j, won) = cmp.moved(l, h)
    assert ta[i] == "big" and tb[j] == "small"  # the changed word carries the change in the top head
    assert lost == pytest.approx(ra[l, h, i_big], abs=1e-5) and won == pytest.approx(rb[l, h, i_small], abs=1e-5)
    diff, ia, ib = cmp.difference(l, h)
    assert np.abs(diff - (mb[l, h][np.ix_(ib, ib)] - ma[l, h][np.ix_(ia, ia)])).max() < 1e-5


def test_same_text_has_zero_distance(model):
    c = compare(BIG, BIG, focus="it", model=model)
    assert np.abs(c.distance).max() < 1e-6 and np.abs(c.shared).max() < 1e-6
    assert c.notes == []


def test_alignment_of_different_lengths():
    a = ["[CLS]", "the", "cat", "sat", "[SEP]"]
    b = ["[CLS]", "the", "black", "cat", "sat", "down", "[SEP]"]
    assert align_tokens(a, b) == [(0, 0), (1, 1), (2, 3), (3, 4), (4, 6)]


def test_focus_follows_the_alignment_when_lengths_differ(model):
    c = compare("She read the book.", "Yesterday she quietly read the long book.", focus="book", model=model)
    assert c.a.tokens[c.a.focus_index] == c.b.tokens[c.b.focus_index] == "book"
    assert 0 <= c.distance.min() and c.distance.max() <= 1 + 1e-9
    assert "only in B: yesterday quietly long" in c.to_string()


def test_report_text_json_and_files(cmp, tmp_path, capsys):
    text = cmp.to_string()
    assert "only in A: big, only in B: small" in text and "total variation" in text
    assert "全变差" in cmp.to_string(lang="zh")
    png, page = tmp_path / "c.png", tmp_path / "c.html"
    assert main(["explain", BIG, "--compare", SMALL, "--focus", "it", "--json", "--png", str(png), "--html", str(page)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["a"]["tokens"] == cmp.a.tokens and d["b"]["tokens"] == cmp.b.tokens
    assert np.abs(np.array(d["distance"]) - cmp.distance).max() < 1e-4
    assert d["top_changes"][0]["lost"]["token"] == "big" and d["selected"] == {
        "layer": d["top_changes"][0]["layer"], "head": d["top_changes"][0]["head"]}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    html = page.read_text()
    assert "https://" not in html and "http://" not in html and "</script" not in html.split("qkv-data")[1].split("</script>")[0]


def test_cli_errors(capsys):
    assert main(["explain", BIG, "--compare", SMALL, "--pair", "x"]) == 2
    assert "--compare and --pair" in capsys.readouterr().err
    assert main(["explain", BIG, "--compare", "   "]) == 2
    assert "second text" in capsys.readouterr().err
    assert main(["explain", BIG, "--compare", "Nothing alike here.", "--focus", "trophy"]) == 2
    assert "--compare" in capsys.readouterr().err


def test_tokens_cannot_break_out_of_the_page(model):
    c = compare("a </script><b>x</b> & y", "a </script> & z", model=model)
    html = render_compare_html(c)
    data = html.split('id="qkv-data">')[1].split("</script>")[0]
    assert "<" not in data and json.loads(data)["a"]["text"].startswith("a </script>")


def test_page_in_chromium(browser, cmp, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    path = tmp_path / "cmp.html"
    save_compare_html(cmp, path)
    browser.get(path.as_uri())
    assert browser.execute_script("return document.body.dataset.ready") == "1"
    l, h, d = cmp.top_changes(1)[0]
    assert f"Layer {l}, head {h}" in browser.find_element(By.ID, "head-title").text
    n = len(cmp.a.tokens)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#map-a tbody td")) == n * n
    cells = browser.find_elements(By.CSS_SELECTOR, "#grid td")
    assert len(cells) == cmp.num_layers * cmp.num_heads
    cells[0].click()  # layer 0, head 0
    assert "Layer 0, head 0" in browser.find_element(By.ID, "head-title").text
    rows = browser.find_elements(By.CSS_SELECTOR, "#rows tr")[1:]
    f = cmp.a.focus_index
    shown = {r.find_elements(By.TAG_NAME, "td")[0].text: float(r.find_elements(By.TAG_NAME, "td")[1].text)
             for r in rows if r.find_elements(By.TAG_NAME, "td")[1].text}
    assert shown["trophy"] == pytest.approx(cmp.a.focus_weights[0, 0, cmp.a.tokens.index("trophy")], abs=6e-4)
    assert len(rows) == len(cmp.pairs) + (n - len(cmp.pairs)) + (len(cmp.b.tokens) - len(cmp.pairs))
    assert f == cmp.a.tokens.index("it")
    browser.find_element(By.TAG_NAME, "body").send_keys("\ue014")  # arrow right
    assert "Layer 0, head 1" in browser.find_element(By.ID, "head-title").text
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    # B − A has a colour scale, and no difference prints as "-0.000"
    lo, hi = browser.find_element(By.ID, "scale-lo").text, browser.find_element(By.ID, "scale-hi").text
    assert lo.startswith("-") and hi.startswith("+") and float(hi) == -float(lo) > 0
    assert "gradient" in browser.find_element(By.ID, "scale-bar").get_attribute("style")
    diffs = [r.find_elements(By.TAG_NAME, "td")[4].text for r in browser.find_elements(By.CSS_SELECTOR, "#rows tr")[1:]]
    assert diffs and "-0.000" not in diffs


def test_long_texts_compare_focus_rows_without_maps(model, tmp_path):
    c = compare(BIG, SMALL, focus="it", model=model, max_map_tokens=0)
    full = compare(BIG, SMALL, focus="it", model=model)
    assert c.a.maps is None and c.b.maps is None
    assert np.abs(c.distance - full.distance).max() < 1e-5  # the focus rows alone give the same distances
    with pytest.raises(ValueError, match="maps were not kept"):
        c.difference(0, 0)
    png = save_compare_png(c, tmp_path / "rows.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_chinese_report_figure_and_page(cmp, tmp_path, capsys):
    png, page = tmp_path / "zh.png", tmp_path / "zh.html"
    assert main(["explain", BIG, "--compare", SMALL, "--focus", "it", "--lang", "zh", "--png", str(png),
                 "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "全变差距离" in out and "说明：目标“big”在 B 中没有对应的词元" in out and "已写入 HTML" in out
    html = page.read_text()
    assert '<html lang="zh-Hans">' in html and "两个句子的对比" in html and "Click a head" not in html
    assert png.stat().st_size > 20_000
    with pytest.raises(ValueError, match="lang"):
        render_compare_html(cmp, lang="fr")


def test_unknown_tokens_align_only_on_the_same_characters(model):
    c = compare("I feel 🙂 today", "I feel 🙃 today", model=model)
    unk = c.a.tokens.index("[UNK]")
    assert c.b.tokens[unk] == "[UNK]" and (unk, unk) not in c.pairs and len(c.pairs) == len(c.a.tokens) - 1
    same = compare("I feel 🙂 today", "I feel 🙂 today", model=model)
    assert (unk, unk) in same.pairs and np.abs(same.distance).max() < 1e-6


def test_library_bad_arguments(model):
    with pytest.raises(TypeError, match="other must be a string"):
        compare(BIG, None, model=model)
    with pytest.raises(ValueError, match="second text is empty"):
        compare(BIG, "", model=model)
    with pytest.raises(TypeError, match="text must be a string"):
        compare(b"bytes", SMALL, model=model)


def test_a_notebook_shows_the_comparison_page(cmp):
    """In a notebook a comparison renders as its page (grid, both maps, B − A), not plain text."""
    import html as pyhtml

    frame = cmp._repr_html_()
    assert frame.startswith('<iframe srcdoc="') and 'sandbox="allow-scripts"' in frame
    page = pyhtml.unescape(frame.split('srcdoc="', 1)[1].split('" style=', 1)[0])
    assert "<script" in page and "https://" not in page and "http://" not in page
