"""qkv.linear_attention and qkv.nn.LinearAttention against the explicit N × N formula in float64
(qkv.reference.linear), plus FAVOR+ against softmax attention, gradients, decoding and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import qkv
from qkv.linear import LinearAttentionState, favor_features, linear_attention
from qkv.reference.linear import favor_projection, linear_attention_ref, linear_steps

from .helpers import assert_within_rule, max_err

f64 = torch.float64
MAPS = ["elu", "relu", "favor"]


def _qkv(*shape_q, nk=None, dv=None, dtype=f64, scale=1.0):
    *batch, nq, d = shape_q
    nk = nq if nk is None else nk
    dv = d if dv is None else dv
    q = torch.randn(*batch, nq, d, dtype=dtype) * scale
    k = torch.randn(*batch, nk, d, dtype=dtype) * scale
    v = torch.randn(*batch, nk, dv, dtype=dtype)
    return q, k, v


def _ref(q, k, v, fm, **kw):
    proj = None
    if fm == "favor":
        proj = favor_projection(q.shape[-1], kw.pop("num_features", None) or max(q.shape[-1], math.ceil(q.shape[-1] * math.log(max(q.shape[-1], 2)))), kw.pop("seed", 0))
    return torch.from_numpy(np.ascontiguousarray(linear_attention_ref(q, k, v, fm, projection=proj, **kw)))


@pytest.mark.parametrize("fm", MAPS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,chunk", [(1, 64), (97, 16), (130, 64), (64, 64)])
def test_matches_the_explicit_formula_in_float64(fm, causal, n, chunk):
    q, k, v = _qkv(2, 3, n, 8, dv=5)
    out = linear_attention(q, k, v, feature_map=fm, is_causal=causal, chunk_size=chunk)
    want = _ref(q, k, v, fm, is_causal=causal)
    assert out.shape == (2, 3, n, 5) and out.dtype == f64
    assert max_err(out, want) < 1e-12


def test_cross_lengths_padding_broadcast_and_callable_map():
    q, k, v = _qkv(2, 4, 7, 6, nk=11)
    kp = torch.rand(2, 1, 11) > 0.3
    for fm in ("elu", "favor", lambda x: torch.nn.functional.softplus(x)):
        out = linear_attention(q, k, v, feature_map=fm, key_padding_mask=kp)
        if callable(fm):
            want = torch.from_numpy(linear_attention_ref(q, k, v, lambda a: np.logaddexp(0, a), key_padding_mask=kp.numpy()))
        else:
            want = _ref(q, k, v, fm, key_padding_mask=kp.numpy())
        assert max_err(out, want) < 1e-12
    # broadcast batch dims: one key/value set for every head
    out = linear_attention(q, k[:, :1], v[:, :1])
    assert max_err(out, _ref(q, k[:, :1].expand_as(k), v[:, :1].expand_as(v), "elu")) < 1e-12


def test_favor_features_large_inputs_stay_finite_and_exact():
    q, k, v = _qkv(1, 2, 40, 16, scale=6.0)  # exp(q·k/4) far beyond float64's range without the shifts
    out = linear_attention(q, k, v, feature_map="favor", num_features=64, is_causal=True)
    assert torch.isfinite(out).all()
    small_q, small_k = q / 6, k / 6
    out2 = linear_attention(small_q, small_k, v, feature_map="favor", num_features=64, is_causal=True)
    assert max_err(out2, _ref(small_q, small_k, v, "favor", num_features=64, is_causal=True)) < 1e-12


def test_favor_approaches_softmax_as_features_grow():
    torch.manual_seed(0)
    q, k, v = _qkv(1, 4, 64, 16, scale=0.5)
    exact = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v
    errs = []
    for m in (16, 256, 4096):
        runs = [linear_attention(q, k, v, feature_map="favor", num_features=m, seed=s) for s in range(3)]
        errs.append(sum(float((r - exact).pow(2).mean().sqrt()) for r in runs) / 3)
    print("FAVOR+ rms error by num_features 16/256/4096:", errs)
    assert errs[0] > errs[1] > errs[2] and errs[2] < 0.02


@pytest.mark.parametrize("fm", MAPS)
def test_gradients_match_the_explicit_formula(fm):
    q, k, v = _qkv(1, 2, 37, 4)
    for causal in (False, True):
        args = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = linear_attention(*args, feature_map=fm, is_causal=causal, chunk_size=8)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, args, g)

        def explicit(q, k, v):  # the N × N form in torch (favor with the same features, no shift)
            if fm == "elu":
                fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
            elif fm == "relu":
                fq, fk = q.relu(), k.relu()
            else:
                w = favor_features(4, max(4, math.ceil(4 * math.log(4))), 0)
                phi = lambda x: torch.exp(x * 4 ** -0.25 @ w.T - 0.5 * (x * 4 ** -0.25).pow(2).sum(-1, keepdim=True)) / math.sqrt(w.shape[0])  # noqa: E731
                fq, fk = phi(q), phi(k)
            a = fq @ fk.transpose(-1, -2)
            if causal:
                a = a.tril()
            return (a @ v) / (a.sum(-1, keepdim=True) + 1e-6)

        args2 = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = torch.autograd.grad(explicit(*args2), args2, g)
        for a, b in zip(got, want):
            assert max_err(a, b) < 1e-10


def test_gradcheck_causal_chunked():
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 1, 9, 3))
    assert torch.autograd.gradcheck(lambda q, k, v: linear_attention(q, k, v, is_causal=True, chunk_size=4), (q, k, v))


@pytest.mark.parametrize("fm", MAPS)
def test_recurrent_decoding_equals_the_full_causal_pass(fm):
    q, k, v = _qkv(2, 2, 23, 8)
    full = linear_attention(q, k, v, feature_map=fm, is_causal=True)
    out, st = linear_attention(q[..., :10, :], k[..., :10, :], v[..., :10, :], feature_map=fm, is_causal=True, return_state=True)
    outs = [out]
    for i in range(10, 23):
        o, st = linear_attention(q[..., i : i + 1, :], k[..., i : i + 1, :], v[..., i : i + 1, :], feature_map=fm,
                                 is_causal=True, state=st, return_state=True)
        outs.append(o)
    assert st.length == 23 and isinstance(st, LinearAttentionState)
    assert max_err(torch.cat(outs, -2), full) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_rule(dtype):
    q, k, v = _qkv(2, 2, 200, 16, dtype=dtype)
    ref = _ref(q.double(), k.double(), v.double(), "elu", is_causal=True)
    # baseline: the explicit formula in the same dtype
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    a = (fq @ fk.transpose(-1, -2)).tril()
    base = (a @ v) / (a.sum(-1, keepdim=True) + 1e-6)
    out = linear_attention(q, k, v, is_causal=True)
    assert out.dtype == dtype
    assert_within_rule(out, base, ref, dtype, what=f"{dtype} linear attention")


def test_empty_sizes_and_fully_padded_rows():
    q, k, v = _qkv(2, 0, 4)
    assert linear_attention(q, k, v, is_causal=True).shape == (2, 0, 4)
    q, k, v = _qkv(1, 5, 4, nk=3)
    out = linear_attention(q, k, v, key_padding_mask=torch.zeros(1, 3, dtype=torch.bool), feature_map="favor")
    assert torch.equal(out, torch.zeros_like(out))  # nothing to attend to: 0, not NaN


def test_module_matches_manual_heads_and_decodes():
    torch.manual_seed(3)
    mha = qkv.nn.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=f64)
    lin = qkv.nn.LinearAttention.from_attention(mha, feature_map="elu")
    x = torch.randn(2, 9, 16, dtype=f64)
    kp = torch.ones(2, 9, dtype=torch.bool)
    kp[1, 6:] = False
    out, st = lin(x, key_padding_mask=kp)
    assert st is None
    q = mha.q_proj(x).view(2, 9, 4, 4).transpose(1, 2)
    k = mha.k_proj(x).view(2, 9, 2, 4).transpose(1, 2).repeat_interleave(2, 1)
    v = mha.v_proj(x).view(2, 9, 2, 4).transpose(1, 2).repeat_interleave(2, 1)
    heads = _ref(q, k, v, "elu", key_padding_mask=kp[:, None].numpy())
    want = mha.out_proj(heads.transpose(1, 2).reshape(2, 9, 16))
    assert max_err(out, want) < 1e-12
    full, _ = lin(x, is_causal=True)
    a, st = lin(x[:, :5], is_causal=True, return_state=True)
    b, st = lin(x[:, 5:], is_causal=True, state=st, return_state=True)
    assert max_err(torch.cat([a, b], 1), full) < 1e-12


def test_steps_show_the_state_and_the_normaliser():
    q, k, v = (np.random.default_rng(0).standard_normal((6, 3)) for _ in range(3))
    s = linear_steps(q, k, v, "elu")
    assert np.allclose(s.phi_q @ s.state, s.numerator)  # φ(Q)(φ(K)ᵀV) = (φ(Q)φ(K)ᵀ)V
    assert np.allclose(s.phi_q @ s.normaliser, s.denominator)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"feature_map": "softmax"}, "feature_map='softmax' is unknown"),
        ({"num_features": 8}, "only applies to feature_map='favor'"),
        ({"feature_map": "favor", "num_features": 0}, "num_features=0"),
        ({"eps": 0.0}, "eps=0.0"),
        ({"eps": float("nan")}, "eps=nan"),
        ({"chunk_size": 0}, "chunk_size=0"),
        ({"is_causal": True, "query": torch.randn(1, 5, 4)}, "is_causal=True pairs"),
        ({"key_padding_mask": torch.ones(1, 3)}, "key_padding_mask must be a bool"),
        ({"key_padding_mask": torch.ones(1, 4, dtype=torch.bool)}, "last dim must be Nk = 3"),
        ({"state": (1, 2)}, "state must be a LinearAttentionState"),
        ({"query": torch.randn(1, 3, 5)}, "head dim 5"),
        ({"value": torch.randn(1, 4, 4)}, "3 positions but value has 4"),
        ({"query": torch.randn(3)}, "must be \\(..., N, D\\)"),
        ({"query": torch.ones(1, 3, 4, dtype=torch.long)}, "floating-point"),
    ],
)
def test_bad_arguments_name_the_fix(kw, match):
    args = {"query": torch.randn(1, 3, 4), "key": torch.randn(1, 3, 4), "value": torch.randn(1, 3, 4)}
    for name in ("query", "key", "value"):
        if name in kw:
            args[name] = kw.pop(name)
    with pytest.raises((ValueError, TypeError), match=match):
        linear_attention(args["query"], args["key"], args["value"], **kw)
    with pytest.raises(ValueError, match="num_features"):
        qkv.nn.LinearAttention(8, 2, num_features=4)


def test_glass_box_shows_state_normaliser_and_softmax_side_by_side():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((4, 3)) for _ in range(3))
    s = linear_steps(q, k, v, "elu", is_causal=True)
    text = s.to_string(tokens=["a", "b", "c", "d"])
    for label in ("φ(Q)", "φ(K)", "S = φ(K)ᵀ·V", "z = Σ_j φ(k_j)", "softmax attention", "prefix sums"):
        assert label in text
    assert np.allclose(s.weights.sum(-1), 1.0) and np.allclose(np.triu(s.weights, 1), 0.0)
    w = s.softmax_weights()
    assert np.allclose(w.sum(-1), 1.0) and np.allclose(np.triu(w, 1), 0.0)
    zh = s.to_string(lang="zh")
    assert "线性注意力" in zh and "归一化" in zh
    with pytest.raises(ValueError, match="lang='fr'"):
        s.to_string(lang="fr")
