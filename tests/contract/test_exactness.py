"""Regression tests for calls that once gave wrong answers, NaN or crashes: each test is named
after the behaviour it pins down."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import qkv
from qkv.reference import attention_ref

from ..helpers import assert_lse_of_16_bit_inputs, assert_within_rule, make_qkv, max_err

BACKENDS = ["auto", "sdpa", "chunked", "math"]


def _ref(q, k, v, **kw):
    kw = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
    return attention_ref(q, k, v, return_lse=True, **kw)


# ---- strided inputs on the log-sum-exp path -------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_lse_reads_strided_and_transposed_inputs(backend):
    q = torch.randn(2, 3, 8, 16)[..., ::2]  # strided last dim
    k = torch.randn(2, 3, 16, 10).transpose(-1, -2)[..., :8]  # transposed view
    v = torch.randn(2, 10, 3, 16).transpose(1, 2)[..., ::2]  # (B, H, N, D) view of (B, N, H, D), strided
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    for kw in ({}, {"is_causal": True}, {"attn_mask": torch.rand(8, 10) > 0.3}):
        out, lse = qkv.attention(q, k, v, return_lse=True, backend=backend, **kw)
        ro, rl = _ref(q, k, v, **kw)
        assert max_err(out, ro) < 1e-5 and max_err(lse, rl) < 1e-5, kw


# ---- attn_mask together with is_causal ------------------------------------------------------


def _mask_and_causal_cases():
    x3 = torch.randn(2, 6, 8)
    x5 = torch.randn(2, 2, 3, 6, 8)
    x4 = torch.randn(2, 6, 3, 8).transpose(1, 2)  # strided 4-D
    yield "3-D", (x3, x3, x3), torch.rand(6, 6) > 0.3
    yield "2-D", (x3[0], x3[0], x3[0]), torch.rand(6, 6) > 0.3
    yield "5-D", (x5, x5, x5), torch.randn(6, 6)
    yield "strided 4-D", (x4, x4, x4), torch.rand(2, 1, 6, 6) > 0.3
    yield "all-True 3-D", (x3, x3, x3), torch.ones(6, 6, dtype=torch.bool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attn_mask_with_is_causal_applies_both_on_every_rank_and_layout(backend):
    for name, (q, k, v), mask in _mask_and_causal_cases():
        out = qkv.attention(q, k, v, attn_mask=mask, is_causal=True, backend=backend)
        assert max_err(out, attention_ref(q, k, v, attn_mask=mask, is_causal=True)) < 1e-5, name


def test_attn_mask_with_is_causal_under_torch_math_kernel_and_dropout():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8)
    mask = torch.rand(6, 6) > 0.3
    with sdpa_kernel(SDPBackend.MATH):
        out = qkv.attention(q, k, v, attn_mask=mask, is_causal=True)
    assert max_err(out, attention_ref(q, k, v, attn_mask=mask, is_causal=True)) < 1e-5
    drop = qkv.attention(q, k, v, attn_mask=mask, is_causal=True, dropout_p=0.5)  # runs; weights dropped
    assert drop.shape == out.shape and torch.isfinite(drop).all()


# ---- empty sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_lse_with_no_queries_or_no_keys(backend):
    for nq, nk in ((0, 5), (5, 0), (0, 0)):
        q, k, v = make_qkv(2, 2, 2, nq, nk, 8)
        out, lse = qkv.attention(q, k, v, return_lse=True, backend=backend)
        assert out.shape == (2, 2, nq, 8) and lse.shape == (2, 2, nq)
        assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sizes_with_masks_and_zero_heads(backend):
    b, h, d = 2, 2, 8
    for nq, nk in ((0, 5), (5, 0), (0, 0)):
        q, k, v = make_qkv(b, h, h, nq, nk, d, requires_grad=True)
        for kw in (
            {"attn_mask": torch.ones(b, 1, nq, nk, dtype=torch.bool)},
            {"attn_mask": torch.zeros(b, h, nq, nk)},
            {"key_padding_mask": torch.ones(b, nk, dtype=torch.bool)},
            {"is_causal": "bottom_right", "window": (2, 0)},
        ):
            out, lse = qkv.attention(q, k, v, return_lse=True, backend=backend, **kw) if backend != "sdpa" else (qkv.attention(q, k, v, backend=backend, **kw), None)
            assert out.shape == (b, h, nq, d) and (out == 0).all(), kw
            out.sum().backward()
            assert q.grad is None or (q.grad == 0).all()
    for shapes in (((2, 0, 4, 8),) * 3, ((0, 4, 8),) * 3, ((0, 2, 4, 8),) * 3):
        q, k, v = (torch.randn(*s) for s in shapes)
        out = qkv.attention(q, k, v, backend=backend)
        assert out.shape == torch.nn.functional.scaled_dot_product_attention(q, k, v).shape


def test_varlen_with_empty_sequences_returns_lse():
    q, k, v = torch.randn(6, 2, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu_q, cu_k = torch.tensor([0, 0, 6], dtype=torch.int32), torch.tensor([0, 3, 9], dtype=torch.int32)
    for backend in ("auto", "sdpa", "chunked", "math"):
        out, lse = qkv.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend=backend)
        ro, rl = _ref(q.transpose(0, 1), k[3:].transpose(0, 1), v[3:].transpose(0, 1))
        assert max_err(out.transpose(0, 1), ro) < 1e-5 and max_err(lse, rl) < 1e-5
    none = torch.tensor([0, 0, 0], dtype=torch.int32)
    out, lse = qkv.attention_varlen(q[:0], k[:0], v[:0], none, none, return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


# ---- scale ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [-0.5, 0.0, -3.0])
def test_nonpositive_scale_is_exact_and_finite(backend, scale):
    q, k, v = make_qkv(2, 2, 2, 9, 9, 8, dtype=torch.float64)
    for kw in ({"is_causal": True}, {}, {"attn_mask": torch.rand(9, 9) > 0.4, "is_causal": True}, {"window": (2, 1)}):
        out = qkv.attention(q, k, v, scale=scale, backend=backend, **kw)
        assert torch.isfinite(out).all() and max_err(out, attention_ref(q, k, v, scale=scale, **kw)) < 1e-10, kw


# ---- gradients on fully masked rows ------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "math", "chunked"])
def test_fully_minus_inf_float_row_has_zero_gradient_not_nan(backend):
    q, k, v = make_qkv(1, 2, 2, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, 5, dtype=torch.float64)
    bias[1] = float("-inf")
    bias = bias.requires_grad_(backend == "math")  # a mask gradient forces math; auto must cope
    out, lse = qkv.attention(q, k, v, attn_mask=bias, return_lse=True, backend=backend)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for t in (q, k, v) + ((bias,) if bias.requires_grad else ()):
        assert not torch.isnan(t.grad).any()
    assert (q.grad[:, :, 1] == 0).all() and torch.isneginf(lse[:, :, 1]).all()


# ---- mask precision ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float32_mask_is_not_rounded_to_16_bits(backend, dtype):
    q, k, v = (t.to(dtype) for t in make_qkv(1, 2, 2, 12, 12, 16))
    bias = torch.randn(12, 12) * 3  # float32: would lose ~3 digits in 16 bits
    kw = {"attn_mask": bias}
    want_out, want_lse = _ref(q, k, v, **kw)
    res = qkv.attention(q, k, v, attn_mask=bias, return_lse=backend != "sdpa", backend=backend)
    if backend != "sdpa":
        out, lse = res
        # the lse never passes through 16 bits
        assert_lse_of_16_bit_inputs(lse, want_lse)
    else:
        out = res
    rounded = qkv.attention(q, k, v, attn_mask=bias.to(dtype), backend="math")
    assert_within_rule(out, rounded, want_out, dtype, what=f"{backend} out")


# ---- large logits --------------------------------------------------------------------------


def _grads(q, k, v, backend, kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = qkv.attention(q, k, v, backend=backend, return_lse=True, **kw)
    g = torch.Generator().manual_seed(3)
    loss = (out.double() * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum()
    loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * torch.randn(lse.shape, generator=g, dtype=torch.float64)).sum()
    loss.backward()
    return out, lse, q.grad, k.grad, v.grad


def _large_logit_cases(n=160, d=32):
    i = torch.arange(n)
    x = torch.randn(1, 2, n, d, dtype=torch.float64)
    yield "scores near -300 (ALiBi-sized bias)", (x, torch.randn_like(x), torch.randn_like(x)), {"attn_mask": -(i[:, None] - i[None, :]).abs().double() - 300.0}
    yield "scores in the hundreds", (x * 12, torch.randn_like(x) * 12, torch.randn_like(x)), {}
    yield "one key takes every weight (q = k)", (x * 4, x * 4, torch.randn_like(x)), {"is_causal": True}
    yield "q = k = v, std 2", (x * 2, x * 2, x * 2), {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_large_logit_gradients_within_rule(dtype):
    """The chunked backward recomputes weights from the forward's row maximum and sum (not from
    a rounded lse) and recomputes the dominant weight's dS from ``v_j - O_i``: its float32
    gradients stay within the rule where scores are in the hundreds or one key takes all."""
    for name, (q, k, v), kw in _large_logit_cases():
        q, k, v = (t.to(dtype).double() for t in (q, k, v))  # the oracle sees the rounded inputs
        kw_t = {n: t.to(dtype) for n, t in kw.items() if isinstance(t, torch.Tensor)} | {n: t for n, t in kw.items() if not isinstance(t, torch.Tensor)}
        ref = _grads(q, k, v, "math", kw)
        base = _grads(q.to(dtype), k.to(dtype), v.to(dtype), "math", kw_t)
        got = _grads(q.to(dtype), k.to(dtype), v.to(dtype), "chunked", kw_t)
        for what, c, b, r, f in zip(["out", "lse", "dq", "dk", "dv"], got, base, ref, [2, 2, 3, 3, 3]):
            assert_within_rule(c, b, r, dtype, factor=f, what=f"{name}: {what}")


def test_auto_float32_gradients_within_rule_when_queries_match_keys():
    """torch's CPU backward recomputes weights from a float32 lse; where a query matches its own
    key (one key takes the row) that rounding put dV at 30× the rule. auto must not use it."""
    x = torch.randn(1, 2, 160, 32, dtype=torch.float64)
    q, k, v = (x * 4).float(), (x * 4).float(), torch.randn_like(x).float()
    dout = torch.randn(1, 2, 160, 32, dtype=torch.float64)

    def grads(q, k, v, backend):
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out = qkv.attention(q, k, v, is_causal=True, backend=backend)
        return (out, *torch.autograd.grad(out, (q, k, v), dout.to(out.dtype)))

    ref = grads(q.double(), k.double(), v.double(), "math")
    base = grads(q, k, v, "math")
    got = grads(q, k, v, "auto")
    for what, c, b, r, f in zip(["out", "dq", "dk", "dv"], got, base, ref, [2, 3, 3, 3]):
        assert_within_rule(c, b, r, torch.float32, factor=f, what=what)


# ---- torch's CausalBias ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_bias_objects_mean_causal_alignments(backend):
    q, k, v = make_qkv(2, 2, 2, 5, 9, 8, requires_grad=True)
    for bias, alignment in ((causal_upper_left(5, 9), "top_left"), (causal_lower_right(5, 9), "bottom_right")):
        out = qkv.attention(q, k, v, attn_mask=bias, backend=backend)
        assert max_err(out, attention_ref(q, k, v, is_causal=alignment)) < 1e-5
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        assert max_err(out, want) < 1e-5
        out.sum().backward()
        with pytest.raises(ValueError, match="already causal"):
            qkv.attention(q, k, v, attn_mask=bias, is_causal=True, backend=backend)
    with pytest.raises(ValueError, match=r"causal_upper_left\(5, 9\)"):
        qkv.attention(q, k, v, attn_mask=causal_upper_left(4, 9), backend=backend)


# ---- torch.func ------------------------------------------------------------------------------


def test_chunked_works_under_torch_func_transforms():
    q, k, v = make_qkv(1, 2, 1, 5, 7, 4, dtype=torch.float64, requires_grad=True)
    f = lambda q, k, v: qkv.attention(q, k, v, is_causal="bottom_right", enable_gqa=True, backend="chunked")  # noqa: E731
    g = lambda q, k, v: qkv.attention(q, k, v, is_causal="bottom_right", enable_gqa=True, backend="math")  # noqa: E731
    for got, want in zip(torch.func.jacrev(f, argnums=(0, 1, 2))(q, k, v), torch.func.jacrev(g, argnums=(0, 1, 2))(q, k, v)):
        assert max_err(got, want) < 1e-12
    batched = torch.func.vmap(f, in_dims=(0, None, None))(q.expand(3, *q.shape).contiguous(), k, v)
    assert max_err(batched, g(q, k, v).expand(3, *q.shape)) < 1e-12
    grad_q = torch.func.grad(lambda q: f(q, k, v).sum())(q)
    assert max_err(grad_q, torch.autograd.grad(g(q, k, v).sum(), q)[0]) < 1e-12
    assert torch.autograd.gradcheck(f, (q, k, v), check_batched_grad=True)


# ---- windows with their own alignment --------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_alignment_is_independent_of_causality(backend):
    q, k, v = make_qkv(1, 2, 2, 7, 19, 8, dtype=torch.float64)
    for kw in (
        {"window": (3, 2), "window_alignment": "bottom_right"},
        {"window": (3, 2), "window_alignment": "top_left", "is_causal": "bottom_right"},
        {"window": (4, -1), "window_alignment": "bottom_right", "is_causal": True},
        {"window": (-1, 0), "window_alignment": "bottom_right"},
    ):
        out = qkv.attention(q, k, v, backend=backend, **kw)
        assert max_err(out, attention_ref(q, k, v, **kw)) < 1e-10, kw
    # bottom-right window on Nq < Nk: the last query sits at the last key
    allowed = qkv.reference.positional_mask(2, 5, False, (1, 0), "bottom_right")
    assert allowed.astype(int).tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


def test_varlen_follows_flash_attention_alignment():
    """flash_attn_varlen_func aligns causal masks and windows bottom-right in each sequence."""
    q, k, v = torch.randn(3, 1, 8, dtype=torch.float64), torch.randn(5, 1, 8, dtype=torch.float64), torch.randn(5, 1, 8, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
    for kw, want in (
        ({"is_causal": True}, {"is_causal": "bottom_right"}),
        ({"is_causal": "top_left"}, {"is_causal": True}),
        ({"window": (1, 1)}, {"window": (1, 1), "window_alignment": "bottom_right"}),
        ({"window": (1, -1), "is_causal": True}, {"window": (1, None), "window_alignment": "bottom_right", "is_causal": "bottom_right"}),
    ):
        out = qkv.attention_varlen(q, k, v, cu_q, cu_k, **kw)
        assert max_err(out.transpose(0, 1), attention_ref(qh, kh, vh, **want)) < 1e-12, kw


# ---- the fast path checks what torch does not ------------------------------------------------


def test_fast_path_refuses_what_torch_would_accept_wrongly():
    q, k, v = make_qkv(1, 2, 2, 5, 5, 8)
    with pytest.raises(ValueError, match="attn_mask is on meta"):
        qkv.attention(q, k, v, attn_mask=torch.ones(5, 5, device="meta"))
    with pytest.raises(ValueError, match="value has 1 heads but key has 2"):
        qkv.attention(q, k, v[:, :1])


# ---- non-finite inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_inputs_give_nan_rows_by_one_rule(backend, where, bad):
    q, k, v = make_qkv(2, 4, 2, 6, 7, 8)
    t = {"query": q, "key": k, "value": v}[where]
    t[1, 1, 2, 3] = bad  # batch 1; query head 1, or key/value head 1 (query heads 2 and 3)
    for kw in ({}, {"is_causal": True}, {"attn_mask": torch.rand(6, 7) > 0.5}):
        out, lse = (
            qkv.attention(q, k, v, enable_gqa=True, return_lse=True, backend=backend, **kw)
            if backend != "sdpa"
            else (qkv.attention(q, k, v, enable_gqa=True, backend=backend, **kw), None)
        )
        want = np.zeros(out.shape[:-1], dtype=bool)
        if where == "query":
            want[1, 1, 2] = True
        else:
            want[1, 2:] = True
        assert np.array_equal(torch.isnan(out).any(-1).numpy(), want), (kw, torch.isnan(out).any(-1))
        assert torch.isnan(out[torch.from_numpy(want)]).all()
        if lse is not None:
            assert np.array_equal(torch.isnan(lse).numpy(), want)
        good = ~torch.from_numpy(want)
        ref = attention_ref(q, k, v, enable_gqa=True, **kw)
        assert max_err(out[good], torch.from_numpy(ref)[good]) < 1e-5
        assert torch.isnan(torch.from_numpy(ref)[torch.from_numpy(want)]).all(), "the oracle states the same rule"

