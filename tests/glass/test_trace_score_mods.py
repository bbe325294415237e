"""The glass box with a score function and sinks: the ``modified`` step, the sink's share of each
row, and every view of them (terminal, prose in English and Chinese, HTML, the page's data, PNG),
checked against the float64 oracle ``qkv.attention_ref``."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qkv.glass import Trace, trace
from qkv.reference import attention_ref  # noqa: E402
from qkv.glass.render import short  # noqa: E402
from qkv.glass.toy import sentence_trace  # noqa: E402
from qkv.score_mods import ALiBi, RelativeBias, Softcap, alibi_slopes  # noqa: E402

N, H, D_MODEL, D_K = 5, 2, 4, 3
TOKENS = ["the", "cat", "sat", "on", "mats"]


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _inputs(rng, heads=H):
    x = rng.normal(size=(N, D_MODEL))
    return x, [rng.normal(size=(D_MODEL, heads * D_K)) for _ in range(3)]


def _split(a, heads):
    """(N, H·d) → (H, N, d), the layout attention_ref takes."""
    return a.reshape(a.shape[0], heads, -1).transpose(1, 0, 2)


def _oracle(t, heads, **kw):
    """(weights, output, lse) from attention_ref: with the identity as V, the output is the weights."""
    q, k, v = _split(t.q, heads), _split(t.k, heads), _split(t.v, heads)
    weights = attention_ref(q, k, np.broadcast_to(np.eye(N), (heads, N, N)), **kw)
    out, lse = attention_ref(q, k, v, return_lse=True, **kw)
    return weights, out, lse


def _bias_fn(scale):
    """A closure reading a tensor, with the head and both indices: FlexAttention's contract."""
    table = torch.tensor([[0.0, -0.5, 0.25], [0.75, 0.0, -1.0]], dtype=torch.float64)

    def distance_bias(score, batch, head, q_idx, kv_idx):
        return score + scale * table[head, (kv_idx - q_idx).abs().clamp(max=2)]

    return distance_bias


SCORE_MODS = {
    "softcap": lambda: Softcap(0.8),
    "alibi": lambda: ALiBi(alibi_slopes(H)),
    "alibi_symmetric": lambda: ALiBi(torch.tensor([0.5, 0.125]), symmetric=True),
    "relative_bias": lambda: RelativeBias(torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(8, H)),
    "closure": lambda: _bias_fn(1.5),
    "partial": lambda: functools.partial(lambda s, b, h, i, j, w: s * w - 0.1 * (h + 1) * (i - j).abs(), w=0.5),
}


@pytest.mark.parametrize("name", SCORE_MODS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sinks", [None, [0.3, -1.2]])
def test_every_step_matches_the_oracle(rng, name, causal, sinks):
    x, w = _inputs(rng)
    fn = SCORE_MODS[name]()
    t = trace(x, *w, num_heads=H, is_causal=causal, score_mod=fn, sinks=sinks, tokens=TOKENS)
    weights, out, lse = _oracle(t, H, is_causal=causal, score_mod=fn, sinks=None if sinks is None else np.array(sinks))
    np.testing.assert_allclose(t.weights, weights, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(t.output, out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(t.lse, lse, rtol=1e-12, atol=1e-14)
    assert t.modified.shape == (H, N, N) and (t.masked is not None) == causal
    for h in range(H):  # the per-head traces hold the same numbers as the stacked arrays
        np.testing.assert_array_equal(t.heads[h].modified, t.modified[h])
        np.testing.assert_array_equal(t.heads[h].weights, t.weights[h])
    if causal:
        above = np.triu(np.ones((N, N), bool), 1)
        assert np.isneginf(t.masked[:, above]).all()
        np.testing.assert_array_equal(t.masked[:, ~above], t.modified[:, ~above])  # the mask follows the score function
    np.testing.assert_allclose(t.row_sums + t.sink_share, 1.0, rtol=1e-12)
    assert (t.sink_share > 0).all() == (sinks is not None)


def test_the_modified_numbers_themselves(rng):
    """Each built-in's step against its formula, head by head (per-head slopes and table columns)."""
    x, w = _inputs(rng)
    j_minus_i = np.arange(N)[None, :] - np.arange(N)[:, None]
    t = trace(x, *w, num_heads=H, score_mod=Softcap(0.8))
    np.testing.assert_allclose(t.modified, 0.8 * np.tanh(t.scaled / 0.8), rtol=1e-14)
    assert (np.abs(t.modified) < 0.8).all()
    slopes = alibi_slopes(H)
    t = trace(x, *w, num_heads=H, score_mod=ALiBi(slopes))
    for h in range(H):
        np.testing.assert_allclose(t.modified[h], t.scaled[h] + float(slopes[h]) * j_minus_i, rtol=1e-14, atol=1e-15)
    t = trace(x, *w, num_heads=H, score_mod=ALiBi(slopes, symmetric=True))
    for h in range(H):
        np.testing.assert_allclose(t.modified[h] - t.scaled[h], -float(slopes[h]) * np.abs(j_minus_i), atol=1e-14)
    table = torch.arange(16, dtype=torch.float64).reshape(8, H)  # column h belongs to head h
    t = trace(x, *w, num_heads=H, score_mod=RelativeBias(table))
    assert (t.modified[0] - t.scaled[0]).round(9).astype(int).tolist()[0][0] == 0  # bucket 0, column 0
    assert (t.modified[1] - t.scaled[1]).round(9).astype(int).tolist()[0][0] == 1  # bucket 0, column 1
    assert t.score_mod["kind"] == "relative_bias" and t.score_mod["buckets"] == 8


def test_from_qkv_float_mask_and_a_row_that_sees_nothing(rng):
    q, k, v = rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), rng.normal(size=(3, 2))
    mask = np.array([[0.0, -1.0, 0.5], [-np.inf, -np.inf, -np.inf], [0.0, 0.0, -np.inf]])
    fn = _bias_fn(1.0)
    t = Trace.from_qkv(q, k, v, attn_mask=mask, score_mod=fn, sinks=0.25)
    out, lse = attention_ref(q[None], k[None], v[None], attn_mask=mask, score_mod=fn, sinks=np.array([0.25]),
                             return_lse=True)
    np.testing.assert_allclose(t.output, out[0], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(t.lse, lse[0], rtol=1e-12)
    finite = np.isfinite(mask)
    np.testing.assert_allclose(t.masked[finite], (t.modified + mask)[finite])  # the float mask adds to s′
    assert t.score_mod == {"kind": "function", "name": "distance_bias", "text": "distance_bias"}
    # the middle row sees no key: weight 0 everywhere, the sink takes the whole row, lse = the sink
    assert (t.weights[1] == 0).all() and t.sink_share[1] == 1.0 and t.lse[1] == 0.25 and t.top_keys[1] == -1
    assert t.sinks.shape == (1,)


def test_without_a_score_function_or_sinks_nothing_changes(rng):
    x, w = _inputs(rng)
    t = trace(x, *w, num_heads=H)
    assert t.modified is None and t.score_mod is None and t.sinks is None
    assert (t.sink_share == 0).all() and "score function" not in t.to_string() and "sink" not in t.to_string()
    d = t.to_dict()
    assert d["steps"]["modified"] is None and d["score_mod"] is None and d["sinks"] is None and d["sink_share"] is None


def test_to_dict_round_trips_and_old_dicts_still_load(rng):
    x, w = _inputs(rng)
    t = trace(x, *w, num_heads=H, is_causal=True, score_mod=ALiBi(alibi_slopes(H)), sinks=[0.5, float("-inf")],
              tokens=TOKENS)
    d = json.loads(json.dumps(t.to_dict(), allow_nan=False))
    assert d["schema_version"] == 2
    assert d["score_mod"]["kind"] == "alibi" and d["score_mod"]["slopes"] == [0.0625, 0.00390625]
    assert d["sinks"] == [0.5, None]  # a sink of −∞ (no sink on head 1) is JSON null, like a masked score
    back = Trace.from_dict(d)
    for name in ("modified", "masked", "weights", "output", "lse", "sinks", "sink_share"):
        np.testing.assert_array_equal(getattr(back, name), getattr(t, name))
    assert back.score_mod == t.score_mod and back.heads[1].sinks.tolist() == [-np.inf]
    np.testing.assert_array_equal(back.heads[0].modified, t.modified[0])
    assert back.to_string() == t.to_string() and back.explain("zh", token=2) == t.explain("zh", token=2)
    # a schema-1 dict has no modified step, score function or sinks
    old = trace(x, *w).to_dict()
    old["schema_version"] = 1
    for key in ("score_mod", "sinks", "sink_share"):
        del old[key]
    del old["steps"]["modified"]
    back = Trace.from_dict(old)
    assert back.modified is None and back.sinks is None and back.score_mod is None


# -- the views ------------------------------------------------------------------------------------


def test_terminal_view_shows_the_step_between_scaled_and_masked(rng):
    x, w = _inputs(rng)
    t = trace(x, *w, num_heads=H, is_causal=True, score_mod=Softcap(0.8), sinks=[0.3, -1.2], tokens=TOKENS)
    text = t.to_string()
    assert "score function: softcap 0.8·tanh(s/0.8)" in text and "sinks: 0.3 -1.2" in text
    for h, sub in ((0, "₀"), (1, "₁")):
        i_scaled = text.index(f"scaled{sub} = scores{sub} / √d_k")
        i_mod = text.index(f"modified{sub} = 0.8·tanh(scaled{sub} / 0.8)")
        i_masked = text.index(f"masked{sub} = modified{sub} + mask")
        assert i_scaled < i_mod < i_masked
        assert f"sink{sub} = {t.sinks[h]:.3f}" in text
    assert "squashed smoothly into (−0.8, 0.8)" in text
    assert "each row plus its sink's share sums to 1 ✓" in text
    share = t.heads[0].sink_share[0]
    assert f"the {t.weights[0, 0].sum():.3f} (sink {share:.3f})" in text
    only = t.to_string(steps=("modified",))
    assert "modified₀" in only and "weights₀" not in only
    zh = t.to_string(lang="zh")
    assert "打分函数：softcap" in zh and "平滑地压进 (−0.8, 0.8)" in zh and "汇聚项" in zh and "每行之和加上汇聚项的份额都为 1 ✓" in zh
    alibi = trace(x, *w, num_heads=H, score_mod=ALiBi(alibi_slopes(H), symmetric=True)).to_string()
    assert "modified₁ = scaled₁ − m₁·|j − i|" in alibi and "this head's slope m = 0.0039" in alibi
    fn = trace(x, *w, num_heads=H, score_mod=_bias_fn(1.0)).to_string()
    assert "modified₀ = distance_bias(scaled₀, b, h, i, j)" in fn


def test_english_and_chinese_prose_tell_the_step(rng):
    x, w = _inputs(rng)
    t = trace(x, w[0][:, :D_K], w[1][:, :D_K], w[2][:, :D_K], score_mod=Softcap(0.8), sinks=0.4, tokens=TOKENS)
    en = t.explain("en", token=1)
    pct = short(100 * t.sink_share[1], 1)
    assert "4. Score function. softcap 0.8·tanh(s/0.8) squashes every score smoothly into (−0.8, 0.8)" in en
    assert "5. Softmax." in en and "6. Weighted sum." in en and "Mask" not in en
    assert f"the sink absorbs {pct}% of row 1's attention" in en
    assert f"become {short(t.modified[1, 0])}" in en
    zh = t.explain("zh", token=1)
    assert "4. 打分函数。softcap 0.8·tanh(s/0.8) 把每个分数都平滑地压进 (−0.8, 0.8)" in zh
    assert f"汇聚项吸收了第 1 行 {pct}% 的注意力" in zh and "5. Softmax 归一化" in zh

    x5, w5 = _inputs(rng)
    a = trace(x5, *w5, num_heads=H, is_causal=True, score_mod=ALiBi(alibi_slopes(H)), tokens=TOKENS)
    en = a.explain("en", token=3)
    assert "runs steps 2–7" in en and "4. Score function. ALiBi" in en and "5. Mask." in en and "6. Softmax." in en
    assert "Farther keys are penalised by slope·distance" in en and "head 0's slope m = 0.0625" in en
    assert '"the" loses 0.188 (3 away)' in en  # 0.0625 · 3
    zh = a.explain("zh", token=3)
    assert "独立完成第 2–7 步" in zh and "距离越远的键被罚得越多" in zh and "“the”减去 0.188（相隔 3）" in zh

    r = trace(x5, *w5, num_heads=H, score_mod=RelativeBias(torch.ones(8, H)))
    assert "A learned number, looked up by how far each key is from the query, is added: 1 for" in r.explain()
    f = trace(x5, *w5, num_heads=H, score_mod=_bias_fn(1.0))
    assert "distance_bias is called on every scaled score" in f.explain()
    assert "distance_bias 作用在每个缩放后的分数上" in f.explain("zh")


def test_a_sink_that_outweighs_every_key_is_named_in_the_verdict(rng):
    q, k, v = rng.normal(size=(3, 2)), rng.normal(size=(3, 2)), rng.normal(size=(3, 2))
    t = Trace.from_qkv(q, k, v, sinks=5.0)
    assert "the sink absorbs even more" in t.explain() and "汇聚项吸收的更多" in t.explain("zh")


def test_html_tables_show_the_step(rng):
    x, w = _inputs(rng)
    t = trace(x, *w, num_heads=H, score_mod=Softcap(0.8), sinks=[0.3, -1.2], tokens=TOKENS)
    html = t.to_html()
    assert "<code>modified₀ = 0.8·tanh(scaled₀ / 0.8)</code>" in html and "squashed smoothly" in html
    assert "sink₁ = -1.200" in html and "<script" not in html
    assert "平滑地压进" in t.to_html(lang="zh")


def test_page_data_carries_the_step_and_the_sinks_through_the_causal_toggle(rng):
    from qkv.glass.page import PAGE_SCHEMA_VERSION, page_data, render_trace_page

    x, w = _inputs(rng)
    fn = ALiBi(alibi_slopes(H), symmetric=True)
    for causal in (False, True):
        t = trace(x, *w, num_heads=H, is_causal=causal, score_mod=fn, sinks=[0.3, -1.2], tokens=TOKENS)
        flipped = trace(x, *w, num_heads=H, is_causal=not causal, score_mod=fn, sinks=[0.3, -1.2], tokens=TOKENS)
        d = page_data(t)
        assert d["schema_version"] == PAGE_SCHEMA_VERSION == 2
        assert d["steps"][:6] == ["x", "qkv", "scores", "scaled", "modified", "mask"]
        assert d["score_mod"]["kind"] == "alibi" and d["score_mod"]["symmetric"] is True and d["sinks"] == [0.3, -1.2]
        same, other = d["variants"]["causal" if causal else "full"], d["variants"]["full" if causal else "causal"]
        for h in range(H):
            np.testing.assert_allclose(same["heads"][h]["modified"]["v"], t.modified[h], rtol=1e-9)
            np.testing.assert_allclose(other["heads"][h]["modified"]["v"], flipped.modified[h], rtol=1e-9)
            np.testing.assert_allclose(other["heads"][h]["weights"]["v"], flipped.weights[h], rtol=1e-9, atol=1e-15)
            np.testing.assert_allclose(other["heads"][h]["output"]["v"], flipped.output[h], rtol=1e-9, atol=1e-15)
    page = render_trace_page(t)
    assert '"modified"' in page


def test_the_page_script_has_both_languages_words_for_the_step():
    from qkv.locale import messages

    en, zh = messages("en", "page."), messages("zh", "page.")
    for key in ("s_modified", "f_modified", "m_modified", "e_modified_softcap", "e_modified_alibi", "n_mod_softcap",
                "n_mod_alibi", "n_mod_rel", "n_mod_fn", "c_mod", "e_weights_sink", "n_weights_sink", "c_sink", "sub_score",
                "sub_sinks"):
        assert key in en and key in zh, key


def test_png_draws_the_step_and_the_sink(rng, tmp_path):
    pytest.importorskip("matplotlib")
    from qkv.glass.png import save_trace_png, trace_figure

    x, w = _inputs(rng)
    t = trace(x, *w, num_heads=H, is_causal=True, score_mod=Softcap(0.8), sinks=[0.3, -1.2], tokens=TOKENS)
    fig = trace_figure(t, head=1)
    try:
        axes = {ax.get_gid(): ax for ax in fig.axes if ax.get_gid()}
        assert {"modified", "masked", "weights"} <= set(axes)
        assert "softcap 0.8" in axes["modified"].get_title() and "sink -1.2" in axes["weights"].get_title()
        shown = [tx.get_text() for tx in axes["modified"].texts if (tx.get_gid() or "").startswith("cell:")]
        assert shown[:2] == [f"{v:.2f}" for v in t.modified[1, 0, :2]]
        flow = [tx.get_text() for ax in fig.axes for tx in ax.texts if tx.get_gid() == "flow"]
        assert "score fn\nsoftcap 0.8" in flow and "softmax\n+ sink" in flow
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert save_trace_png(t, tmp_path / "t.png").endswith("t.png")


# -- mistakes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(score_mod=ALiBi(alibi_slopes(3))), ValueError, "ALiBi has 3 slopes but the call has 2 query heads"),
        (dict(score_mod=RelativeBias(torch.zeros(8, 3))), ValueError, "table has 3 heads"),
        (dict(score_mod=30.0), TypeError, "score_mod must be callable"),
        (dict(score_mod=lambda s, b: s), TypeError, "five positional arguments"),
        (dict(score_mod=lambda s, b, h, i, j: s * float("nan")), ValueError, "NaN or \\+inf"),
        (dict(score_mod=lambda s, b, h, i, j: s[..., :2]), ValueError, "one score per"),
        (dict(sinks=[1.0, 2.0, 3.0]), ValueError, r"sinks has shape \(3,\) but the trace has 2 heads"),
        (dict(sinks=[float("nan"), 0.0]), ValueError, "sinks contains NaN"),
    ],
)
def test_bad_score_functions_and_sinks_are_named(rng, kw, error, match):
    x, w = _inputs(rng)
    with pytest.raises(error, match=match):
        trace(x, *w, num_heads=H, **kw)


def test_sentence_trace_passes_them_on():
    t = sentence_trace("the cat sat", heads=2, score_mod=Softcap(1.0), sinks=0.5)
    assert t.score_mod["cap"] == 1.0 and t.sinks.tolist() == [0.5, 0.5]
