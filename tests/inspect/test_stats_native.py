"""The C statistics kernel (qkv/csrc/stats_tile.c) against the torch formulation it replaces,
its float32 exponential against float64, and the fallback when it cannot be built."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import qkv
from qkv.backends import native
from qkv.inspect import attention_stats
from qkv.info import report
from qkv.backends import stats_native

from ..helpers import make_qkv
from .test_maps import mask_cases, ref_scores_weights
from .test_stats import offset_of, ref_stats

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels {native.status()}")

FIELDS = attention_stats.__globals__["AttentionStats"].ARRAYS


def _both(monkeypatch, **kw):
    """(native, torch formulation) results of the same call."""
    fast = attention_stats(**kw)
    with monkeypatch.context() as m:
        m.setattr(stats_native, "tile_kernel", lambda q: None)
        slow = attention_stats(**kw)
    return fast, slow


def _assert_same(a, b, atol):
    for f in FIELDS + ("lse",):
        x, y = getattr(a, f), getattr(b, f)
        if x is None:
            assert y is None, f
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, f
        if f == "topk_indices":
            # ties may order differently only where weights are equal; compare the weights instead
            continue
        assert torch.allclose(x.double(), y.double(), atol=atol, rtol=atol, equal_nan=True), (f, (x.double() - y.double()).abs().max())


@pytest.mark.parametrize("given_lse", [False, True], ids=["one_pass", "given_lse"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 70, 130), (2, 2, 2, 33, 33), (1, 3, 1, 40, 90)], ids=str)
def test_native_equals_torch_formulation_every_mask(monkeypatch, shape, given_lse):
    b, hq, hk, nq, nk = shape
    q, k, v = make_qkv(b, hq, hk, nq, nk, 16, dtype=torch.float64)
    q = q * 2.0
    for name, kw in mask_cases(b, hq, nq, nk):
        lse = None
        if given_lse:
            _, lse = qkv.attention(q, k, v, enable_gqa=hq != hk, return_lse=True, backend="math", **kw)
        fast, slow = _both(monkeypatch, query=q, key=k, lse=lse, enable_gqa=hq != hk, topk=4, key_positions=(0, 5, -1),
                           relative_positions=(-3, -1, 0, 2), block_q=16, block_k=32, **kw)  # fmt: skip
        _assert_same(fast, slow, 1e-12)
        s, w, _ = ref_scores_weights(q, k, **kw)
        want = ref_stats(w, s, nq, nk, offset_of(kw, nq, nk), 4, (0, 5, nk - 1), (-3, -1, 0, 2))
        assert np.array_equal(fast.topk_indices.numpy(), want["topk_indices"]), name  # ties: earlier key first


@pytest.mark.skipif(native.gemm(torch.float64) is None, reason="torch exports no BLAS dgemm_")
@pytest.mark.parametrize("given_lse", [False, True], ids=["one_pass", "given_lse"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 70, 130), (1, 3, 1, 40, 23), (2, 2, 2, 65, 65)], ids=str)
def test_fused_pass_equals_tile_pass(monkeypatch, shape, given_lse):
    """The one-call fused pass (own gemms, band and padding applied in C) against the tile-by-tile
    native pass it replaces, for every mask kind it takes; attn_mask calls keep the tile pass."""
    b, hq, hk, nq, nk = shape
    q, k, v = make_qkv(b, hq, hk, nq, nk, 16, dtype=torch.float64)
    taken = []
    real = stats_native.fused_pass
    monkeypatch.setattr(stats_native, "fused_pass", lambda *a, **kw: taken.append(real(*a, **kw)) or taken[-1])
    for name, kw in mask_cases(b, hq, nq, nk):
        lse = None
        if given_lse:
            _, lse = qkv.attention(q, k, v, enable_gqa=hq != hk, return_lse=True, backend="math", **kw)
        args = dict(query=q, key=k, lse=lse, enable_gqa=hq != hk, topk=4, key_positions=(0, 5, -1),
                    relative_positions=(-3, -1, 0, 2), block_q=16, block_k=32, **kw)  # fmt: skip
        taken.clear()
        fused = attention_stats(**args)
        assert taken == ["attn_mask" not in kw], name
        with monkeypatch.context() as m:
            m.setattr(native, "gemm", lambda dtype: None)
            tiled = attention_stats(**args)
        _assert_same(fused, tiled, 1e-12)
        assert torch.equal(fused.topk_indices, tiled.topk_indices), name
        if not given_lse:
            gqa = {"enable_gqa": hq != hk}
            out, st = qkv.inspect.attention_with_stats(q, k, v, topk=2, block_q=16, block_k=32, **gqa, **kw)
            want, lse_want = qkv.attention(q, k, v, return_lse=True, backend="math", **gqa, **kw)
            assert (out - want).abs().max() < 1e-12 and torch.allclose(st.lse, lse_want, atol=1e-12), name


@pytest.mark.parametrize("given_lse", [False, True], ids=["one_pass", "given_lse"])
def test_native_float32_against_float64(given_lse):
    q, k, v = make_qkv(1, 4, 4, 300, 300, 64)
    lse = qkv.attention(q, k, v, is_causal=True, return_lse=True)[1] if given_lse else None
    got = attention_stats(q, k, lse=lse, is_causal=True, topk=5, block_k=128)
    s, w, _ = ref_scores_weights(q.double(), k.double(), is_causal=True)
    want = ref_stats(w, s, 300, 300, 0, 5, (0,), (-1, 0))
    for f in ("entropy", "max_weight", "mean_distance", "key_weights", "relative_weights", "topk_weights"):
        err = np.abs(getattr(got, f).double().numpy() - want[f]).max()
        print(f, err)
        assert err < 2e-5 * max(1.0, np.abs(want[f]).max()), f
    assert np.array_equal(got.n_keys.numpy(), want["n_keys"])


def test_threads_do_not_change_the_result():
    q, k, _ = make_qkv(2, 4, 2, 257, 300, 32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention_stats(q, k, enable_gqa=True, window=(40, 3), topk=3)
        torch.set_num_threads(2)
        two = attention_stats(q, k, enable_gqa=True, window=(40, 3), topk=3)
    finally:
        torch.set_num_threads(before)
    for f in FIELDS + ("lse",):
        assert torch.equal(getattr(one, f), getattr(two, f)), f


def test_nan_rows_and_empty_rows_match_the_torch_formulation(monkeypatch):
    q, k, _ = make_qkv(1, 2, 2, 20, 50, 8)
    q[0, 1, 7, 3] = float("nan")  # one row of head 1 is NaN
    k[0, 0, 30, 0] = float("nan")  # key 30 of head 0: every row that sees it
    pad = torch.ones(1, 50, dtype=torch.bool)
    pad[0, 10:] = False
    for kw in ({}, {"is_causal": True}, {"key_padding_mask": pad, "window": (2, 0)}):
        fast, slow = _both(monkeypatch, query=q, key=k, topk=3, block_k=16, **kw)
        _assert_same(fast, slow, 1e-6)
        assert torch.equal(fast.topk_indices, slow.topk_indices)
        bad = fast.entropy.isnan()
        assert bad[0, 1, 7] and bad.sum() == (1 if kw else 21), kw  # row 7 of head 1, and head 0 where key 30 is seen
        assert fast.lse[bad].isnan().all() and fast.topk_weights[bad].isnan().all() and (fast.topk_indices[bad] == -1).all()
        assert not fast.entropy[~bad].isnan().any()


def test_exp2_within_a_rounding_of_float64():
    """The kernels' exponential (made for softmax weights, 2^x with x <= 0) over its whole range."""
    # Every float32 in [-2, -1) (its fractions relative to the nearest integer cover [-0.5, 0.5]
    # at 2^-23 spacing: the worst case, 1.337 · 2^-24 near ±0.5002, is among them), a grid over
    # the whole range and random points.
    binade = torch.arange(2**23, dtype=torch.int32).add_(torch.tensor(1.0).view(torch.int32)).view(torch.float32).neg_()
    x = torch.cat([binade, torch.linspace(-126, 127, 200_001), torch.rand(100_000) * 2 - 1, (torch.randn(10_003) * 30).clamp(-126, 127)])
    got, want = native.exp2(x).double(), torch.exp2(x.double())
    rel = ((got - want).abs() / want).max().item()
    print("max relative error", rel / 2.0**-24, "· 2^-24")
    assert rel <= 1.34 * 2.0**-24
    special = torch.tensor([float("-inf"), -127.0, -1000.0, float("nan"), 0.0, 1.0, -1.0, -0.5, 127.0, 1000.0, float("inf")])
    out = native.exp2(special)
    assert out[:3].eq(0).all() and out[3].isnan() and out[4:7].tolist() == [1.0, 2.0, 0.5]
    assert abs(out[7].item() - 2**-0.5) <= 2**-24 and out[8:].eq(2.0**127).all()  # clamped at 2^127


def test_fallback_without_a_compiler(monkeypatch, tmp_path, caplog):
    q, k, _ = make_qkv(1, 2, 2, 30, 30, 8)
    want = attention_stats(q, k, is_causal=True)
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))  # nothing cached: a build is needed
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="qkv"):
            assert native.library() is None
        assert "build failed" in native.status() and "native CPU kernels are not used" in caplog.text
        got = attention_stats(q, k, is_causal=True)  # the torch formulation
        for f in FIELDS:
            assert torch.allclose(getattr(got, f).double(), getattr(want, f).double(), atol=1e-6), f
        monkeypatch.setenv("QKV_NATIVE", "0")
        native.library.cache_clear()
        assert native.library() is None and native.status() == "not used: disabled by QKV_NATIVE=0"
        assert "disabled by QKV_NATIVE=0" in report()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.library() is not None and "built" in native.status()
