"""The glass box: every recorded step must equal an independent computation of that step."""

from __future__ import annotations

import subprocess
import sys
import json

import numpy as np
import pytest

from qkv.glass import Trace, trace
from qkv.reference import attention_ref
from qkv.glass.render import short

from .. import seeds


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(seeds.derive(request.node.nodeid))  # tests/seeds.py: fixed in CI, fresh locally


def _inputs(rng, n=5, d_model=7, width_qk=3, width_v=4, out=None):
    x = rng.normal(size=(n, d_model))
    w = [rng.normal(size=(d_model, width_qk)), rng.normal(size=(d_model, width_qk)), rng.normal(size=(d_model, width_v))]
    if out is not None:
        w.append(rng.normal(size=(width_v, out)))
    return x, w


def _with_dot(rng: np.random.Generator, q: np.ndarray, target: float) -> np.ndarray:
    """A random vector k with q·k == target."""
    r = rng.normal(size=q.shape)
    return r + (target - q @ r) / (q @ q) * q


# -- every step ------------------------------------------------------------------------------


def test_every_step_equals_independent_math(rng):
    x, (wq, wk, wv) = _inputs(rng)
    t = trace(x, wq, wk, wv)
    q, k, v = x @ wq, x @ wk, x @ wv
    np.testing.assert_allclose(t.x, x)
    np.testing.assert_allclose(t.q, q)
    np.testing.assert_allclose(t.k, k)
    np.testing.assert_allclose(t.v, v)
    np.testing.assert_allclose(t.scores, np.einsum("id,jd->ij", q, k))
    np.testing.assert_allclose(t.scaled, q @ k.T / np.sqrt(3))
    assert t.masked is None
    np.testing.assert_allclose(t.weights, _softmax(q @ k.T / np.sqrt(3)))
    np.testing.assert_allclose(t.output, _softmax(q @ k.T / np.sqrt(3)) @ v)
    np.testing.assert_allclose(t.output, attention_ref(q, k, v))
    assert (t.d_k, t.d_v, t.num_heads, t.d_model, t.n) == (3, 4, 1, 7, 5)
    assert t.tokens == ["t1", "t2", "t3", "t4", "t5"]
    assert t.projected is None and t.concat is None and t.heads == []
    for a in (t.q, t.scores, t.weights, t.output):
        assert a.dtype == np.float64


def test_rows_sum_to_one_and_top_keys(rng):
    x, (wq, wk, wv) = _inputs(rng, n=9)
    t = trace(x, wq, wk, wv)
    np.testing.assert_allclose(t.row_sums, np.ones(9))
    np.testing.assert_array_equal(t.top_keys, t.weights.argmax(-1))
    most = t.attends_most()
    assert [m[0] for m in most] == t.tokens
    assert most[0][1] == t.tokens[int(t.weights[0].argmax())]
    assert most[0][2] == pytest.approx(t.weights[0].max())


def test_single_token(rng):
    t = trace(rng.normal(size=(1, 3)), *(rng.normal(size=(3, 2)) for _ in range(3)), tokens=["solo"])
    np.testing.assert_allclose(t.weights, [[1.0]])
    np.testing.assert_allclose(t.output, t.v)


# -- the tutorials' worked example ------------------------------------------------------------


def _check_worked(t: Trace) -> None:
    np.testing.assert_allclose(t.scores[0], [112, 96])
    np.testing.assert_allclose(t.scaled[0], [14, 12])
    np.testing.assert_allclose(t.weights[0], [0.881, 0.119], atol=5e-4)
    np.testing.assert_allclose(t.weights[0], [1 / (1 + np.exp(-2)), 1 / (1 + np.exp(2))])
    assert t.d_k == 64


def test_worked_example_from_qkv(rng):
    q = rng.normal(size=(2, 64))
    k = np.stack([_with_dot(rng, q[0], 112.0), _with_dot(rng, q[0], 96.0)])
    v = rng.normal(size=(2, 5))
    t = Trace.from_qkv(q, k, v, tokens=["Thinking", "Machines"])
    _check_worked(t)
    assert t.x is None and t.w_q is None
    np.testing.assert_allclose(t.output[0], 0.8807970779778823 * v[0] + 0.11920292202211755 * v[1])
    assert "Q (given)" in t.to_string()


def test_worked_example_via_trace_with_identity_input(rng):
    q = rng.normal(size=(2, 64))
    k = np.stack([_with_dot(rng, q[0], 112.0), _with_dot(rng, q[0], 96.0)])
    t = trace(np.eye(2), q, k, rng.normal(size=(2, 3)), tokens=["Thinking", "Machines"])
    _check_worked(t)
    en = t.explain()
    assert "112" in en and "96" in en and "14" in en and "12" in en and "0.881" in en and "0.119" in en
    assert 'attends most to itself' in en


# -- masks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [True, "top_left", "bottom_right"])
def test_causal_mask(rng, is_causal):
    x, (wq, wk, wv) = _inputs(rng, n=6)
    t = trace(x, wq, wk, wv, is_causal=is_causal)
    above = np.triu(np.ones((6, 6), dtype=bool), k=1)
    assert np.isneginf(t.masked[above]).all()
    np.testing.assert_allclose(t.masked[~above], t.scaled[~above])
    assert (t.weights[above] == 0).all()
    np.testing.assert_allclose(t.row_sums, np.ones(6))
    np.testing.assert_allclose(t.weights[0], np.eye(6)[0])
    np.testing.assert_allclose(t.output, attention_ref(t.q, t.k, t.v, is_causal=True))
    assert t.mask_kinds == ("causal",)
    assert "causal" in t.to_string()


def test_boolean_mask_and_fully_masked_row(rng):
    x, (wq, wk, wv) = _inputs(rng, n=4)
    allowed = rng.random((4, 4)) > 0.4
    allowed[2] = False  # a query with nothing to look at
    allowed[0, 1] = True
    t = trace(x, wq, wk, wv, attn_mask=allowed)
    assert np.isneginf(t.masked[~allowed]).all()
    assert (t.weights[~allowed] == 0).all()
    np.testing.assert_array_equal(t.weights[2], 0.0)
    np.testing.assert_array_equal(t.output[2], 0.0)
    assert t.row_sums[2] == 0 and t.top_keys[2] == -1 and np.isneginf(t.lse[2])
    np.testing.assert_allclose(t.row_sums[[0, 1, 3]][allowed[[0, 1, 3]].any(-1)], 1.0)
    assert "every key masked" in t.to_string()
    assert "nothing" in t.explain(token=2) and "zero vector" in t.explain(token=2)
    assert "零向量" in t.explain("zh", token=2)


def test_boolean_mask_as_nested_lists(rng):
    x, (wq, wk, wv) = _inputs(rng, n=2)
    t = trace(x, wq, wk, wv, attn_mask=[[True, False], [True, True]])
    assert np.isneginf(t.masked[0, 1]) and t.weights[0, 1] == 0


def test_float_mask_is_added(rng):
    x, (wq, wk, wv) = _inputs(rng, n=3)
    bias = rng.normal(size=(3, 3))
    bias[1, 2] = -np.inf
    t = trace(x, wq, wk, wv, attn_mask=bias)
    np.testing.assert_allclose(t.masked, t.scaled + bias)
    np.testing.assert_allclose(t.weights, _softmax(t.scaled + bias))
    assert t.mask_kinds == ("float",)
    assert "The mask adds" in t.explain(token=0)
    assert "becomes -inf" in t.explain(token=1)


def test_causal_explained_for_a_later_token(rng):
    x, (wq, wk, wv) = _inputs(rng, n=3)
    t = trace(x, wq, wk, wv, is_causal=True, tokens=["a", "b", "c"])
    en, zh = t.explain(token="b"), t.explain("zh", token=1)
    assert '"c"' in en and "causal mask forbids looking ahead" in en
    assert "因果掩码" in zh and "“c”位于“b”之后" in zh


# -- several heads ---------------------------------------------------------------------------


def test_multi_head_concat_and_projection(rng):
    n, d_model, h, d_k, d_v, d_out = 5, 6, 3, 2, 4, 5
    x = rng.normal(size=(n, d_model))
    wq, wk = rng.normal(size=(d_model, h * d_k)), rng.normal(size=(d_model, h * d_k))
    wv, wo = rng.normal(size=(d_model, h * d_v)), rng.normal(size=(h * d_v, d_out))
    t = trace(x, wq, wk, wv, w_o=wo, num_heads=h, is_causal=True)

    # independent: split heads with a reshape, attend per head, merge back
    q = (x @ wq).reshape(n, h, d_k).transpose(1, 0, 2)  # (H, N, d_k)
    k = (x @ wk).reshape(n, h, d_k).transpose(1, 0, 2)
    v = (x @ wv).reshape(n, h, d_v).transpose(1, 0, 2)  # (H, N, d_v)
    out = attention_ref(q, k, v, is_causal=True)  # (H, N, d_v)
    concat = out.transpose(1, 0, 2).reshape(n, h * d_v)  # (N, H·d_v)

    assert t.scores.shape == t.weights.shape == t.masked.shape == (h, n, n)
    assert t.output.shape == (h, n, d_v) and t.q.shape == (n, h * d_k)
    np.testing.assert_allclose(t.scores, q @ k.transpose(0, 2, 1))
    np.testing.assert_allclose(t.output, out)
    np.testing.assert_allclose(t.concat, concat)
    np.testing.assert_allclose(t.projected, concat @ wo)
    np.testing.assert_allclose(t.result, concat @ wo)
    np.testing.assert_allclose(t.row_sums, np.ones((h, n)))
    assert len(t.heads) == h
    for i, head in enumerate(t.heads):
        assert head.head == i and head.d_k == d_k and head.num_heads == 1
        np.testing.assert_allclose(head.q, q[i])
        np.testing.assert_allclose(head.v, v[i])
        np.testing.assert_allclose(head.weights, t.weights[i])
        np.testing.assert_allclose(head.output, out[i])
    text = t.to_string()
    # heads are counted from 0, as in heads[h] and the JSON
    assert "Head 2 of heads 0–2" in text and "concat = [output₀ | output₁ | output₂]" in text
    assert "Head 3" not in text and "Q₀ = Q[:, 0:2]" in text
    assert "projected = concat·W_O" in text
    en = t.explain()
    assert "3 heads" in en and short(t.projected[0][0]) in en
    with pytest.raises(ValueError, match="per head"):
        t.attends_most()


def test_single_head_projection(rng):
    x, (wq, wk, wv, wo) = _inputs(rng, out=3)
    t = trace(x, wq, wk, wv, w_o=wo)
    np.testing.assert_allclose(t.projected, t.output @ wo)
    assert t.concat is None
    assert "projected = output·W_O" in t.to_string()


# -- explanations ------------------------------------------------------------------------------


def test_narratives_quote_the_numbers(rng):
    x, (wq, wk, wv) = _inputs(rng, n=3)
    t = trace(x, wq, wk, wv, tokens=["Thinking", "Machines", "think"])
    top = t.tokens[int(t.weights[0].argmax())]
    for lang in ("en", "zh"):
        text = t.explain(lang)
        for j in range(3):
            assert short(t.scores[0, j]) in text
            assert short(t.scaled[0, j]) in text
            assert short(t.weights[0, j]) in text
        assert short(t.output[0, 0]) in text
        assert "√3 ≈ 1.732" in text
        assert top in text
    en, zh = t.explain("en"), t.explain("zh")
    assert "attends most to" in en and "Dot products" in en and "Softmax" in en
    for word in ("查询", "键", "值", "缩放", "归一化", "点积", "加权求和", "最关注"):
        assert word in zh
    assert '"Machines"' in t.explain(token="Machines").splitlines()[0]
    assert t.explain(token=-1) == t.explain(token=2)


def test_long_vectors_are_abbreviated_in_prose(rng):
    t = Trace.from_qkv(rng.normal(size=(2, 64)), rng.normal(size=(2, 64)), rng.normal(size=(2, 2)))
    assert "∈ ℝ⁶⁴" in t.explain() and "∈ ℝ⁶⁴" in t.explain(lang="zh")


def test_to_string_layout(rng):
    x, (wq, wk, wv) = _inputs(rng, n=2, d_model=4)
    t = trace(x, wq, wk, wv, tokens=["Thinking", "Machines"])
    text = t.to_string(precision=2)
    for formula in ("X ", "W_Q", "Q = X·W_Q", "K = X·W_K", "V = X·W_V", "scores = Q·Kᵀ",
                    "scaled = scores / √d_k", "weights = softmax(scaled)", "output = weights·V"):
        assert formula in text
    assert "each row sums to 1 ✓" in text
    assert f"{t.weights[0, 1]:.2f}" in text
    lines = text.splitlines()
    i = lines.index(next(line for line in lines if line.startswith("scores = Q·Kᵀ")))
    assert lines[i + 1].split() == ["Thinking", "Machines"]
    assert lines[i + 2].split()[0] == "Thinking"
    assert len({len(lines[i + 1]), len(lines[i + 2]), len(lines[i + 3])}) == 1  # aligned columns
    only = t.to_string(steps=("weights",))
    assert "weights = softmax" in only and "scores = Q·Kᵀ" not in only
    assert "每行之和都为 1" in t.to_string(lang="zh")
    with pytest.raises(ValueError, match="precision"):
        t.to_string(precision=-1)


def test_repr_shows_shapes(rng):
    x, (wq, wk, wv) = _inputs(rng, n=2, d_model=4)
    r = repr(trace(x, wq, wk, wv))
    assert r.startswith("Trace(") and "x=2×4" in r and "scores=2×2" in r and "masked=None" in r


# -- export ------------------------------------------------------------------------------------


def test_to_dict_round_trips_through_json(rng):
    x, (wq, wk, wv, wo) = _inputs(rng, n=4, width_qk=4, width_v=4, out=3)
    t = trace(x, wq, wk, wv, w_o=wo, num_heads=2, is_causal=True, tokens=list("abcd"))
    d = t.to_dict()
    s = json.dumps(d, allow_nan=False)  # strict JSON: masked -inf becomes null
    assert json.loads(s) == d
    assert d["tokens"] == list("abcd") and d["d_k"] == 2 and d["num_heads"] == 2
    assert set(d["steps"]) >= {"x", "q", "k", "v", "scores", "scaled", "masked", "weights", "output"}
    assert d["steps"]["masked"][0][0][1] is None
    assert len(d["heads"]) == 2 and d["projected"] is not None
    back = Trace.from_dict(json.loads(s))
    for name in ("x", "q", "scores", "masked", "weights", "output", "concat", "projected", "w_o"):
        np.testing.assert_array_equal(getattr(back, name), getattr(t, name))
    np.testing.assert_array_equal(back.heads[1].weights, t.heads[1].weights)
    assert back.tokens == t.tokens and back.is_causal is True


def test_html_is_self_contained(rng):
    x, (wq, wk, wv) = _inputs(rng, n=3)
    t = trace(x, wq, wk, wv, is_causal=True, tokens=["<b>", "a&b", "c"])
    h = t.to_html()
    assert "<table" in h and "</table>" in h and "rgba(" in h
    assert "http" not in h.lower() and "<script" not in h.lower()
    assert "&lt;b&gt;" in h and "a&amp;b" in h and "<b>" not in h
    assert "scores = Q·Kᵀ" in h and "每行之和" in t.to_html(lang="zh")


# -- inputs ------------------------------------------------------------------------------------


def test_torch_tensors_are_accepted(rng):
    torch = pytest.importorskip("torch")
    x, (wq, wk, wv) = _inputs(rng, n=3)
    t_np = trace(x, wq, wk, wv)
    to = lambda a: torch.tensor(a, dtype=torch.float32, requires_grad=True)  # noqa: E731
    t = trace(to(x), to(wq), to(wk), to(wv), attn_mask=torch.ones(3, 3, dtype=torch.bool))
    assert isinstance(t.output, np.ndarray) and t.output.dtype == np.float64
    np.testing.assert_allclose(t.output, t_np.output, rtol=1e-5, atol=1e-5)
    f = Trace.from_qkv(torch.tensor(t_np.q), torch.tensor(t_np.k), torch.tensor(t_np.v))
    np.testing.assert_allclose(f.weights, t_np.weights)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(w_q=np.ones((5, 3))), r"w_q has 5 rows but x has d_model=4 columns; w_q must be \(d_model, d_k·num_heads\)"),
        (dict(w_k=np.ones((4, 2))), "w_q has 3 columns but w_k has 2"),
        (dict(w_v=np.ones((3, 3))), "w_v has 3 rows but x has d_model=4"),
        (dict(num_heads=2), "w_q has 3 columns, which does not split evenly into num_heads=2"),
        (dict(num_heads=0), "num_heads=0 must be a positive int"),
        (dict(tokens=["a", "b", "c"]), "tokens has 3 entries but x has N=2 rows"),
        (dict(tokens="a b"), r"tokens must be a list of strings.*split\(\)"),
        (dict(attn_mask=np.ones((3, 3), dtype=bool)), r"attn_mask has shape \(3, 3\) but the scores are \(N, N\) = \(2, 2\)"),
        (dict(attn_mask=np.full((2, 2), np.nan)), "attn_mask contains NaN"),
        (dict(w_o=np.ones((4, 2))), r"w_o has 4 rows but the concatenated heads have num_heads·d_v = 1·3 = 3"),
        (dict(x=np.ones(4)), r"x must be a 2-D matrix \(N, d_model\).*reshape\(1, -1\)"),
        (dict(x=np.array([[1.0, np.nan, 0, 0], [0, 0, 0, 0]])), "x contains NaN"),
        (dict(is_causal="sideways"), "is_causal='sideways' is not understood"),
    ],
)
def test_bad_inputs_raise_clear_errors(change, match):
    args = dict(x=np.ones((2, 4)), w_q=np.ones((4, 3)), w_k=np.ones((4, 3)), w_v=np.ones((4, 3)))
    args.update(change)
    kw = {k: args.pop(k) for k in list(args) if k not in ("x", "w_q", "w_k", "w_v")}
    with pytest.raises((ValueError, TypeError), match=match):
        trace(args["x"], args["w_q"], args["w_k"], args["w_v"], **kw)


def test_from_qkv_errors_and_explain_errors():
    with pytest.raises(ValueError, match="q has 3 columns but k has 2"):
        Trace.from_qkv(np.ones((2, 3)), np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="self-attention"):
        Trace.from_qkv(np.ones((2, 3)), np.ones((3, 3)), np.ones((3, 2)))
    t = Trace.from_qkv(np.eye(2), np.eye(2), np.eye(2), tokens=["a", "b"])
    with pytest.raises(ValueError, match="lang='fr' is not available; use 'en'"):
        t.explain("fr")
    with pytest.raises(ValueError, match="token='z' is not one of"):
        t.explain(token="z")
    with pytest.raises(ValueError, match="index from -2 to 1"):
        t.explain(token=2)
    with pytest.raises(KeyError, match="unknown step"):
        t.step("logits")


def test_the_glass_box_and_the_oracle_import_no_torch():
    """A learner's ``qkv trace`` starts in a fraction of a second: the glass box, the oracle and the
    mask rules load without torch (and without matplotlib or jinja2 until a page is drawn)."""
    code = ("import sys, qkv, qkv.glass, qkv.reference, qkv.masks\n"
            "qkv.glass.sentence_trace().to_string(); qkv.reference.attention_ref([[1.0]], [[1.0]], [[1.0]])\n"
            "print(sorted(m for m in ('torch', 'matplotlib', 'jinja2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


# -- biases, meta, schema, wide matrices ----------------------------------------------------------


def test_biases_are_added_to_every_row(rng):
    x, (wq, wk, wv) = _inputs(rng, n=4, width_qk=6, width_v=4)
    bq, bk, bv = rng.normal(size=6), rng.normal(size=6), rng.normal(size=4)
    t = trace(x, wq, wk, wv, b_q=bq, b_k=bk, b_v=bv, num_heads=2)
    q, k, v = x @ wq + bq, x @ wk + bk, x @ wv + bv
    np.testing.assert_allclose(t.q, q)
    for h in range(2):
        s = q[:, 3 * h : 3 * h + 3] @ k[:, 3 * h : 3 * h + 3].T / np.sqrt(3)
        np.testing.assert_allclose(t.weights[h], _softmax(s))
        np.testing.assert_allclose(t.output[h], _softmax(s) @ v[:, 2 * h : 2 * h + 2])
    np.testing.assert_array_equal(t.b_v, bv)
    single = trace(x, wq[:, :3], wk[:, :3], wv, b_q=bq[:3])
    text = single.to_string()
    assert "Q = X·W_Q + b_Q" in text and "b_Q " in text and "K = X·W_K\n" not in text
    assert "biases b_Q, b_K, b_V are added" in single.explain()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(b_q=np.ones(4)), r"b_q has 4 entries but w_q has 3 columns"),
        (dict(b_v=np.ones((2, 3))), r"b_v must be a vector \(3,\)"),
        (dict(b_k=np.array([1.0, np.inf, 0.0])), "b_k contains NaN or infinite"),
        (dict(meta=["model"]), "meta must be a dict"),
    ],
)
def test_bad_biases_and_meta(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        trace(np.ones((2, 4)), np.ones((4, 3)), np.ones((4, 3)), np.ones((4, 3)), **change)


def test_to_dict_schema_meta_biases_and_precision(rng):
    x, (wq, wk, wv) = _inputs(rng, n=3)
    meta = {"model": "m", "layer": np.int64(1), "head": 2, "source": "model"}
    t = trace(x, wq, wk, wv, b_q=rng.normal(size=3), meta=meta)
    d = json.loads(json.dumps(t.to_dict(), allow_nan=False))
    assert d["schema_version"] == 2 and d["kind"] == "attention"
    assert d["meta"] == {"model": "m", "layer": 1, "head": 2, "source": "model"}
    assert len(d["params"]["b_q"]) == 3 and d["params"]["b_k"] is None
    back = Trace.from_dict(d)
    np.testing.assert_array_equal(back.b_q, t.b_q)
    assert back.b_k is None and back.meta == d["meta"]
    r = t.to_dict(precision=2)
    assert r["steps"]["weights"][0][0] == round(float(t.weights[0, 0]), 2)
    assert all(round(v, 2) == v for row in r["steps"]["q"] for v in row)
    with pytest.raises(ValueError, match="precision"):
        t.to_dict(precision=16)


def test_from_dict_reads_dicts_written_before_the_schema(rng):
    x, (wq, wk, wv) = _inputs(rng, n=3)
    t = trace(x, wq, wk, wv)
    old = t.to_dict()
    for key in ("schema_version", "kind", "meta"):
        del old[key]
    for key in ("b_q", "b_k", "b_v"):
        del old["params"][key]
    back = Trace.from_dict(old)
    np.testing.assert_array_equal(back.weights, t.weights)
    assert back.meta == {} and back.b_q is None
    with pytest.raises(ValueError, match="upgrade qkv"):
        Trace.from_dict({**t.to_dict(), "schema_version": 99})
    with pytest.raises(ValueError, match="not an attention trace"):
        Trace.from_dict({**t.to_dict(), "kind": "block"})


def test_wide_matrices_are_summarised_not_dumped(rng):
    n, d_model, d_k = 5, 384, 32
    x = rng.normal(size=(n, d_model))
    w = [rng.normal(size=(d_model, d_k)) for _ in range(3)]
    t = trace(x, *w, tokens=list("abcde"), meta={"model": "toy-model", "layer": 1, "head": 3, "source": "model"})
    text = t.to_string()
    lines = text.splitlines()
    assert max(len(line) for line in lines) < 120  # no 384-column dump
    i = lines.index(next(line for line in lines if line.startswith("X ")))
    assert lines[i + 1].split() == ["0", "1", "2", "3", "…", "382", "383", "‖row‖"]
    row = lines[i + 2].split()
    assert row[0] == "a" and row[5] == "…" and float(row[-1]) == pytest.approx(np.linalg.norm(x[0]), abs=1e-3)
    assert "(columns 0–3, 382–383 of 384 shown" in text and "(rows 0–5, 382–383 of 384 shown)" in text
    assert "model: toy-model, layer 1, head 3" in text and "layer 1, head 3: its 32 of the layer's 384 columns" in text
    # token × token matrices keep every key
    j = lines.index(next(line for line in lines if line.startswith("weights = softmax")))
    assert lines[j + 1].split() == list("abcde")
    zh = t.to_string(lang="zh")
    assert "显示第 0–3, 382–383 列，共 384 列" in zh and "模型：toy-model" in zh
    html = t.to_html()
    assert "<th>‖row‖</th>" in html and "<th>⋮</th>" in html
    assert "<th>200</th>" not in html and html.count("<th>383</th>") == 4  # X's last column, W_Q/W_K/W_V's last row


def test_narrow_traces_look_as_before(rng):
    x, (wq, wk, wv) = _inputs(rng, n=3, d_model=10, width_qk=10)
    text = trace(x, wq, wk, wv).to_string()
    assert "…" not in text and "‖row‖" not in text and "shown" not in text


def test_long_dot_products_are_quoted_by_their_largest_terms(rng):
    q, k = rng.normal(size=(3, 32)), rng.normal(size=(3, 32))
    t = Trace.from_qkv(q, k, rng.normal(size=(3, 4)), tokens=["a", "b", "c"])
    j = int(t.top_keys[0])
    prod = q[0] * k[j]
    top = np.argsort(-np.abs(prod))[:4]
    en = t.explain(precision=3)
    assert f"d_k = 32 products; for \"{t.tokens[j]}\" the largest are q[{top[0]}]·k[{top[0]}]" in en
    assert f"the other 28 add up to {short(prod.sum() - prod[top].sum())}" in en
    assert f"the total is {short(prod.sum())}" in en and short(prod.sum()) == short(t.scores[0, j])
    zh = t.explain("zh")
    assert "其余 28 项之和为" in zh and f"总和为 {short(prod.sum())}" in zh


def test_many_tokens_weighted_sum_quotes_the_heaviest(rng):
    t = Trace.from_qkv(rng.normal(size=(14, 3)), rng.normal(size=(14, 3)), rng.normal(size=(14, 2)))
    en = t.explain()
    assert "the other 9 tokens' weighted values (weight" in en
    assert "其余 9 个词元的加权值" in t.explain("zh")


def test_heads_and_tokens_are_counted_from_0(rng):
    x, (wq, wk, wv) = _inputs(rng, n=3, width_qk=4, width_v=4)
    t = trace(x, wq, wk, wv, num_heads=2, tokens=["a", "b", "c"])
    en = t.explain(token=1)
    assert '"b" (token 1 of tokens 0–2)' in en and "Here is head 0:" in en and "  head 1: " in en
    assert "head 2" not in en
    zh = t.explain("zh", token=1)
    assert "词元 1，编号 0–2" in zh and "下面以头 0 为例" in zh and "  头 1：" in zh


def test_a_notebook_shows_the_interactive_stepper(rng):
    """_repr_html_ is the stepper page in a sandboxed iframe: self-contained (no network), with the
    trace's own tokens and numbers inside, escaped once for the srcdoc attribute."""
    import html as pyhtml

    x, (wq, wk, wv) = _inputs(rng, n=3)
    t = trace(x, wq, wk, wv, is_causal=True, tokens=["<b>", "a&b", "c"])
    frame = t._repr_html_()
    assert frame.startswith('<iframe srcdoc="') and 'sandbox="allow-scripts"' in frame
    page = pyhtml.unescape(frame.split('srcdoc="', 1)[1].split('" style=', 1)[0])
    assert "<script" in page and "http://" not in page and "https://" not in page
    # the tokens travel as JSON with <, > and & escaped: no markup of theirs reaches the page
    assert "a\\u0026b" in page and "\\u003cb\\u003e" in page and "<b>" not in page
