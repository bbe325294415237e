"""Any call torch SDPA accepts gives SDPA's answer, through every qkv backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import qkv

from ..helpers import max_err


@st.composite
def sdpa_calls(draw):
    b = draw(st.integers(1, 2))
    hk = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    hq = hk * group
    nq, nk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    d, dv = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, nk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, nk, dv, generator=g, dtype=torch.float64)
    kw = {"enable_gqa": group > 1}
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "bool_heads"]))
    if mask_kind == "bool":
        kw["attn_mask"] = torch.rand(nq, nk, generator=g) > 0.4
    elif mask_kind == "bool_heads":
        kw["attn_mask"] = torch.rand(b, hq, nq, nk, generator=g) > 0.2
    elif mask_kind == "float":
        kw["attn_mask"] = torch.randn(b, 1, nq, nk, generator=g, dtype=torch.float64)
    kw["is_causal"] = draw(st.booleans())
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.05, 2.0))
    return q, k, v, kw


@settings(max_examples=60, deadline=None)
@given(sdpa_calls(), st.sampled_from(["auto", "math", "chunked", "sdpa"]))
def test_matches_torch_sdpa(call, backend):
    q, k, v, kw = call
    try:
        expected = F.scaled_dot_product_attention(q, k, v, **kw)
    except RuntimeError:  # a call SDPA refuses (qkv accepts a superset)
        assume(False)
    got = qkv.attention(q, k, v, backend=backend, **kw)
    assert got.shape == expected.shape
    assert max_err(got, expected) < 1e-12


def test_ranks_broadcast_like_sdpa():
    q, k, v = torch.randn(2, 4, 8, 16, dtype=torch.float64), torch.randn(4, 9, 16, dtype=torch.float64), torch.randn(4, 9, 5, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, k, v)
    for backend in ("auto", "math", "chunked"):
        assert max_err(qkv.attention(q, k, v, backend=backend), expected) < 1e-12
        assert max_err(qkv.attention(q, k[0], v[0], backend=backend), F.scaled_dot_product_attention(q, k[0], v[0])) < 1e-12


def test_positional_arguments_like_sdpa():
    q, k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(7, 7) > 0.3
    # attn_mask, dropout_p, is_causal, scale (keyword in SDPA), enable_gqa
    assert max_err(qkv.attention(q, k, v, mask, 0.0, True), F.scaled_dot_product_attention(q, k, v, mask, 0.0, True)) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_torch_sdpa(dtype):
    q, k, v = (torch.randn(2, 4, 19, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.rand(19, 19) > 0.3
    gout = torch.randn(2, 4, 19, 16, dtype=dtype)
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(gout)
    expected = [t.grad.clone() for t in (q, k, v)]
    for backend in ("math", "chunked"):
        for t in (q, k, v):
            t.grad = None
        qkv.attention(q, k, v, attn_mask=mask, backend=backend).backward(gout)
        for t, e in zip((q, k, v), expected):
            assert max_err(t.grad, e) < (1e-5 if dtype == torch.float32 else 5e-2)
