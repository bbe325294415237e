"""The static trace figure: a real PNG whose numbers are the trace's numbers, in English or Chinese."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="the PNG renderer needs matplotlib: pip install matplotlib")
PIL = pytest.importorskip("PIL.Image", reason="Pillow comes with matplotlib: pip install matplotlib")

from qkv.glass.block import toy_block_trace  # noqa: E402
from qkv.glass.render import fmt  # noqa: E402
from qkv.glass.toy import sentence_trace  # noqa: E402
from qkv.glass.trace import trace  # noqa: E402
from qkv.viz import figure
from qkv.glass.png import MAX_COLS, cjk_font, save_trace_png, trace_figure  # noqa: E402


def _axes(fig) -> dict:
    return {ax.get_gid(): ax for ax in fig.axes if ax.get_gid()}


def _cells(ax) -> dict[tuple[int, int], str]:
    out = {}
    for t in ax.texts:
        gid = t.get_gid() or ""
        if gid.startswith("cell:"):
            _, r, c = gid.split(":")
            out[int(r), int(c)] = t.get_text()
    return out


def _framed_row(ax) -> int | None:
    rows = [p.get_y() + 0.5 for p in ax.patches if p.get_edgecolor()[:3] != (0, 0, 0) and not p.get_fill()]
    return int(round(rows[0])) if rows else None


def _check_png(path: str) -> None:
    assert os.path.isabs(path) and os.path.getsize(path) > 20_000
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    img = np.asarray(PIL.open(path).convert("RGB"), dtype=np.float64)
    assert img.shape[0] > 400 and img.shape[1] > 800
    assert img.std() > 20  # not a blank canvas
    assert len(np.unique(img.reshape(-1, 3)[::7], axis=0)) > 50  # heatmaps: many distinct colours


def _no_glyph_warnings(record: list) -> None:
    missing = [str(w.message) for w in record if "missing from" in str(w.message) or "Glyph" in str(w.message)]
    assert not missing, missing


def test_single_head_figure_numbers_match_the_trace(tmp_path) -> None:
    import matplotlib.pyplot as plt

    t = sentence_trace("Thinking Machines rock", causal=True)
    fig = trace_figure(t, token="Machines")
    try:
        axes = _axes(fig)
        assert {"x", "q", "k", "v", "masked", "weights", "output"} <= set(axes)
        for step in ("x", "q", "k", "v", "masked", "weights", "output"):
            arr = getattr(t, step)
            cells = _cells(axes[step])
            assert len(cells) == arr.size, step
            for (r, c), text in cells.items():
                assert text == fmt(float(arr[r, c]), 2), (step, r, c)
        assert _cells(axes["masked"])[0, 2] == "-inf"
        for step in ("x", "q", "weights", "output"):
            assert _framed_row(axes[step]) == 1  # the narrated token's row
        assert _framed_row(axes["k"]) is None  # keys are not query rows
        flow = [t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == "flow"]
        assert any("softmax" in s for s in flow) and any("÷√d_k" in s for s in flow) and len(flow) == 10
    finally:
        plt.close(fig)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        path = save_trace_png(t, tmp_path / "t.png")
    _no_glyph_warnings(record)
    _check_png(path)


def test_multi_head_defaults_to_head_0_and_says_so() -> None:
    import matplotlib.pyplot as plt

    t = sentence_trace("the cat sat on", heads=3, d_model=4, d_k=2)
    for head in (None, 2):
        fig = trace_figure(t, head=head)
        try:
            axes = _axes(fig)
            h = 0 if head is None else head
            for (r, c), text in _cells(axes["weights"]).items():
                assert text == fmt(float(t.heads[h].weights[r, c]), 2)
            for (r, c), text in _cells(axes["q"]).items():
                assert text == fmt(float(t.heads[h].q[r, c]), 2)
            title = fig._suptitle.get_text()
            assert f"head {h} of 3" in title
            assert ("default" in title) == (head is None)
            assert "projected" in axes
        finally:
            plt.close(fig)
    t.meta = {"model": "all-MiniLM-L6-v2", "layer": 1, "head": 2, "source": "model"}
    fig = trace_figure(t, head=2)
    assert fig._suptitle.get_text().startswith("all-MiniLM-L6-v2, layer 1: ")
    plt.close(fig)
    with pytest.raises(ValueError, match="heads 0 to 2"):
        trace_figure(t, head=3)
    with pytest.raises(ValueError, match="token"):
        trace_figure(t, token="dog")


def test_block_figure_shows_every_step(tmp_path) -> None:
    import matplotlib.pyplot as plt

    b = toy_block_trace("Thinking Machines rock")
    fig = trace_figure(b, token=2, head=1)
    try:
        axes = _axes(fig)
        for step in ("embeddings", "positional", "x", "residual1", "norm1", "ffn_hidden", "ffn_relu", "ffn_out",
                     "residual2", "output"):
            arr = getattr(b, step)
            cells = _cells(axes[step])
            assert len(cells) == arr.size, step
            assert all(text == fmt(float(arr[r, c]), 2) for (r, c), text in cells.items()), step
            assert _framed_row(axes[step]) == 2
        for (r, c), text in _cells(axes["weights"]).items():
            assert text == fmt(float(b.attention.heads[1].weights[r, c]), 2)
        flow = " ".join(t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == "flow")
        assert "LayerNorm" in flow and "residual" in flow and "positional" in flow
    finally:
        plt.close(fig)
    _check_png(save_trace_png(b, tmp_path / "b.png"))


def test_large_trace_is_summarised() -> None:
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(3)
    n, d = 20, 40
    t = trace(rng.normal(size=(n, d)), rng.normal(size=(d, 2 * 16)), rng.normal(size=(d, 2 * 16)),
              rng.normal(size=(d, 2 * 16)), num_heads=2)
    fig = trace_figure(t)
    try:
        axes = _axes(fig)
        assert not _cells(axes["weights"])  # 20 rows: colours only
        assert axes["x"].images[0].get_array().shape == (n, MAX_COLS)
        assert f"first {MAX_COLS} of {d} columns" in axes["x"].get_title()
        assert axes["weights"].images[0].get_array().shape == (n, n)  # every key of a query × key map
    finally:
        plt.close(fig)


def test_chinese_without_a_cjk_font_falls_back_to_english(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(figure, "cjk_font", lambda: None)
    t = trace(np.eye(3), np.eye(3), np.eye(3), np.eye(3), tokens=["注", "意", "cat"])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        path = save_trace_png(t, tmp_path / "zh.png", lang="zh")
    messages = [str(w.message) for w in record]
    assert any("English labels" in m for m in messages), messages
    _no_glyph_warnings(record)  # no empty boxes: the Chinese tokens were relabelled
    _check_png(path)
    import matplotlib.pyplot as plt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig = trace_figure(t, lang="zh")
    try:
        labels = [lab.get_text() for lab in _axes(fig)["x"].get_yticklabels()]
        assert labels == ["#0", "#1", "cat"]
        assert "Self-attention" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


@pytest.mark.skipif(cjk_font() is None, reason="no font with Chinese glyphs here (e.g. apt-get install fonts-noto-cjk)")
def test_chinese_labels_with_a_cjk_font(tmp_path) -> None:
    import matplotlib.pyplot as plt

    b = toy_block_trace(["注意", "力"])
    fig = trace_figure(b, lang="zh")
    try:
        texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts) + fig._suptitle.get_text()
        for zh in ("查询", "键", "值", "层归一化", "残差", "红框"):
            assert zh in texts
        for en in ("query", "LayerNorm", "residual", "framed", "embeddings"):
            assert en not in texts
        assert [lab.get_text() for lab in _axes(fig)["x"].get_yticklabels()] == ["注意", "力"]
    finally:
        plt.close(fig)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        path = save_trace_png(b, tmp_path / "zh.png", lang="zh")
    _no_glyph_warnings(record)
    _check_png(path)


def test_bad_arguments() -> None:
    t = sentence_trace("a b")
    with pytest.raises(ValueError, match="lang"):
        trace_figure(t, lang="fr")
    with pytest.raises(TypeError, match="Trace or BlockTrace"):
        trace_figure(np.eye(2))
    with pytest.raises(TypeError, match="head"):
        trace_figure(t, head="0")
