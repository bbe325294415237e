"""PNG heatmaps and the offline HTML report, on synthetic attention (no model needed)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from qkv.analysis import explain_attentions, match_word
from qkv.viz import render_html, save_html, save_png
from qkv.locale import Note
from qkv.viz.html import decode_weights

PIL = pytest.importorskip("PIL.Image", reason="Pillow comes with matplotlib: pip install matplotlib")
pytest.importorskip("matplotlib", reason="the PNG renderer needs matplotlib: pip install matplotlib")

TEXT = "Alice said she <b>likes</b> & tests"
TOKENS = ["[CLS]", "alice", "said", "she", "<", "b", ">", "likes", "<", "/", "b", ">", "&", "tests", "[SEP]"]


def _offsets(text: str, tokens: list[str]) -> list[tuple[int, int]]:
    out, pos, low = [], 0, text.lower()
    for t in tokens:
        if t.startswith("["):
            out.append((0, 0))
            continue
        s = low.index(t.lstrip("#"), pos)
        out.append((s, s + len(t.lstrip("#"))))
        pos = s + len(t.lstrip("#"))
    return out


def _maps(L: int = 3, H: int = 4, N: int = len(TOKENS), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    s = rng.normal(scale=2.0, size=(L, H, N, N))
    s[1, 2, 3, 1] += 8.0  # layer 1, head 2: "she" -> "alice"
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)).astype(np.float32)  # (L, H, N, N)


@pytest.fixture(scope="module")
def ex():
    return explain_attentions(list(_maps()), TOKENS, focus="she", text=TEXT, offsets=_offsets(TEXT, TOKENS))


def test_explanation_finds_the_planted_link(ex):
    assert ex.focus_index == 3 and ex.tokens[ex.target_index] == "alice" and not ex.target_given
    assert ex.best_head == (1, 2) and ex.mode == "maps"
    np.testing.assert_allclose(ex.focus_weights.sum(-1), 1.0, atol=1e-5)
    assert ex.stats["entropy"].shape == (3, 4) and np.all(ex.stats["entropy"] >= 0)
    assert "Explanation(" in repr(ex) and "L1 H2" in ex.to_string()


def test_png_is_a_sensible_image(ex, tmp_path):
    path = save_png(ex, tmp_path / "maps.png")
    with PIL.open(path) as im:
        assert im.format == "PNG"
        w, h = im.size
        assert 800 <= w <= 5000 and 400 <= h <= 3000
        px = np.asarray(im.convert("L"), dtype=np.float64)
    assert px.std() > 10  # not blank


def test_png_in_statistics_mode(tmp_path):
    ex = explain_attentions(list(_maps()), TOKENS, focus="she", text=TEXT, offsets=_offsets(TEXT, TOKENS), keep_maps=False)
    assert ex.mode == "stats" and ex.maps is None
    with PIL.open(save_png(ex, tmp_path / "stats.png")) as im:
        assert im.format == "PNG" and im.size[0] >= 600


def test_html_is_self_contained_and_carries_the_data(ex, tmp_path):
    page = open(save_html(ex, tmp_path / "r.html"), encoding="utf-8").read()
    for bad in ("http://", "https://", "//cdn", "<script src", "<link", "@import", "url(", "@font-face"):
        assert bad not in page.lower(), bad
    assert page.count("<script") == 2  # the data and the code: the text's "<b>" cannot open a tag
    assert "&lt;b&gt;likes&lt;/b&gt; &amp; tests" in page  # the text, escaped
    blob = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S).group(1)
    d = json.loads(blob)
    assert d["tokens"] == TOKENS and d["mode"] == "maps" and d["focus"]["index"] == 3
    assert d["initial"] == {"layer": 1, "head": 2} and d["top_heads"][0]["layer"] == 1
    np.testing.assert_allclose(decode_weights(d["maps"], (3, 4, len(TOKENS), len(TOKENS))), ex.maps, atol=2e-5)
    np.testing.assert_allclose(decode_weights(d["focus_weights"], (3, 4, len(TOKENS))), ex.focus_weights, atol=2e-5)


def test_notebook_repr_embeds_the_page(ex):
    frame = ex._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and "qkv-data" in frame and "https://" not in frame


def test_html_leaves_out_maps_that_are_too_big(ex):
    page = render_html(ex, max_map_bytes=100)
    d = json.loads(re.search(r'id="qkv-data">(.*?)</script>', page, re.S).group(1))
    assert d["maps"] is None and d["mode"] == "stats" and any("focus token's attention only" in n for n in d["notes"])


def test_to_dict_is_json_with_the_documented_keys(ex):
    d = json.loads(json.dumps(ex.to_dict(), allow_nan=False))
    assert {"model", "text", "tokens", "num_layers", "num_heads", "mode", "notes", "focus", "target",
            "top_heads", "heads"} <= set(d)
    cell = d["heads"][1][2]
    assert {"layer", "head", "focus_weights", "top_tokens", "target_weight", "entropy", "max_weight",
            "first_weight", "last_weight", "mean_entropy"} <= set(cell)
    assert cell["top_tokens"][0]["token"] == "alice" and len(cell["focus_weights"]) == len(TOKENS)


def test_words_map_to_subword_tokens():
    text = "Zylphoria met Alice; she smiled."
    toks = ["[CLS]", "z", "##yl", "##ph", "##oria", "met", "alice", ";", "she", "smiled", ".", "[SEP]"]
    offs = [(0, 0), (0, 1), (1, 3), (3, 5), (5, 9), (10, 13), (14, 19), (19, 20), (21, 24), (25, 31), (31, 32), (0, 0)]
    assert match_word("zylphoria", text, toks, offs) == ([1, 2, 3, 4], [])
    assert match_word("ALICE", text, toks, offs)[0] == [6]
    assert match_word("zylphoria", text, toks)[0] == [1, 2, 3, 4]  # no offsets: spelled by subwords
    assert match_word("#9", text, toks, offs)[0] == [9]
    assert match_word("[SEP]", text, toks, offs)[0] == [11]
    idx, notes = match_word("he", text, toks, offs)  # only inside "she"
    assert idx == [8] and "not a whole word" in notes[0]
    with pytest.raises(ValueError, match="not in the text"):
        match_word("bob", text, toks, offs)
    ex = explain_attentions(list(_maps(N=len(toks))), toks, focus="Zylphoria", text=text, offsets=offs)
    assert ex.focus_index == 1 and any("split into 4 tokens" in n for n in ex.notes)


def test_head_out_of_range_is_refused_before_drawing(ex, tmp_path):
    for save in (save_png, save_html):
        with pytest.raises(ValueError, match=r"layer 3, head 0 is out of range; the model has layers 0 to 2 and heads 0 to 3"):
            save(ex, tmp_path / "x", 3, 0)
        with pytest.raises(TypeError, match="head must be an int"):
            save(ex, tmp_path / "x", 0, "1")
        assert not (tmp_path / "x").exists()
    assert ex.select(0) == (0, ex.best_head[1])  # the missing one is the best head's
    assert json.loads(re.search(r'id="qkv-data">(.*?)</script>', render_html(ex, head=1)).group(1))["initial"] == {
        "layer": ex.best_head[0], "head": 1}


def test_explain_refuses_nan_and_negative_limits():
    from qkv.analysis import explain

    for kw in ({"max_map_bytes": float("nan")}, {"max_map_tokens": -1}):
        with pytest.raises(ValueError, match=r"must be >= 0 \(math.inf: no limit\)"):
            explain("Alice said she likes tests", model=object(), **kw)
    with pytest.raises(TypeError, match="text must be a string, got list"):
        explain(["Alice"], model=object())


# -- Chinese reports --------------------------------------------------------------------------

EN_LABELS = ("Model:", "Tokens:", "Focus:", "Where", "Heads that link", "Per-head statistics", "on average",
             "weight", "Note:", "its top token")


def _all_notes_ex():
    ex = explain_attentions(list(_maps()), TOKENS, focus="she", text=TEXT, offsets=_offsets(TEXT, TOKENS))
    ex.notes.extend([Note("note.repeated", w="she", n=2), Note("note.tokens_target", w="it", n=3),
                     Note("note.split", w="Zylphoria", n=4, parts="z ##yl ##ph ##oria", t="z"),
                     Note("note.text_cut", n=600, m=512, k=511, t="[SEP]"),
                     Note("note.stats_mode", n=900, mb="233", lt=512, lb="50")])
    return ex


def test_terminal_report_in_chinese():
    ex = _all_notes_ex()
    en, zh = ex.to_string(), ex.to_string(lang="zh")
    assert en == ex.to_string(lang="en") and "Heads that link" in en
    for label in ("模型：", "词元：", "关注词元：", "最关注哪里", "联系得最紧的头", "熵", "平均而言", "说明："):
        assert label in zh, label
    for label in EN_LABELS:
        assert label not in zh, label
    assert zh.count("说明：") == len(ex.notes)
    assert "出现了 2 次" in zh and "被切分成 4 个词元" in zh and "最多读取 512 个" in zh and "233 MB" in zh
    assert "L1 H2  权重 0.999" in zh  # the same numbers as the English report
    with pytest.raises(ValueError, match="lang"):
        ex.to_string(lang="fr")


HTML_EN = ("Attention report", "Head view", "Model view", "all heads", "show every head", "click a head",
           "query (attends)", "key (attended to)", "attends most to", "entropy of the weights", "Statistics of the",
           "Each cell is one head", ">head<", ">max<", ">first<", ">last<", "Layer <select")


def test_html_report_in_chinese(ex, tmp_path):
    en = render_html(ex)
    assert en == render_html(ex, lang="en") and '<html lang="en">' in en
    for label in HTML_EN:
        assert label in en, label
    page = open(save_html(ex, tmp_path / "zh.html", lang="zh"), encoding="utf-8").read()
    static = page.split('<script type="application/json"')[0]
    for label in HTML_EN:
        assert label not in static, label
    for label in ("注意力报告", "注意力头视图", "模型视图", "全部头", "查询（发出关注）", "键（被关注）", "最关注", "熵"):
        assert label in static, label
    assert '<html lang="zh-CN">' in page
    d = json.loads(re.search(r'id="qkv-data">(.*?)</script>', page, re.S).group(1))
    for key, template in d["labels"].items():  # every text the script builds
        words = re.sub(r"\{\w+\}", "", template)  # the placeholders are filled with data
        assert not re.search(r"\b(tokens|layers?|heads?|Focus|target|strongest|on)\b", words, re.I), (key, template)
    d_small = json.loads(re.search(r'id="qkv-data">(.*?)</script>', render_html(ex, max_map_bytes=100, lang="zh"),
                                   re.S).group(1))
    assert d_small["notes"] and all("focus token" not in n for n in d_small["notes"])
    with pytest.raises(ValueError, match="lang"):
        render_html(ex, lang="fr")


def _texts(fig) -> str:
    parts = [fig._suptitle.get_text() if fig._suptitle else ""]
    for ax in fig.axes:
        parts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()] + [t.get_text() for t in ax.texts]
    return " ".join(parts + [t.get_text() for t in fig.texts])


@pytest.mark.parametrize("keep_maps", [True, False])
def test_png_labels_in_chinese(keep_maps, monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    from qkv.viz import figure, png
    from qkv.glass import png as trace_png

    ex = explain_attentions(list(_maps()), TOKENS, focus="she", text=TEXT, offsets=_offsets(TEXT, TOKENS),
                            keep_maps=keep_maps)
    fig = png.figure(ex)
    en = _texts(fig)
    plt.close(fig)
    assert "key (attended-to token)" in en and "attention" in en
    if trace_png.cjk_font() is not None:
        fig = png.figure(ex, lang="zh")
        zh = _texts(fig)
        plt.close(fig)
        assert "键（被关注的词元）" in zh or "层 · 头" in zh
        for label in ("key (", "query (", "Layer ", "attention of", "Statistics mode", "All "):
            assert label not in zh, label
        with PIL.open(save_png(ex, tmp_path / "zh.png", lang="zh")) as im:
            assert im.format == "PNG"
    monkeypatch.setattr(figure, "cjk_font", lambda: None)  # a machine without a Chinese font
    with pytest.warns(UserWarning, match="English labels"):
        fig = png.figure(ex, lang="zh")
    assert "key (attended-to token)" in _texts(fig)
    plt.close(fig)
