"""attention_stats against NumPy on the full float64 weights, for every mask kind; and its memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv.inspect import attention_stats
from qkv.masks.rules import parse_causal

from ..helpers import LargestAllocation, make_qkv
from .test_maps import SHAPES, mask_cases, ref_scores_weights

f64 = torch.float64


def ref_stats(w, s, nq, nk, offset, topk, key_positions, relative_positions):
    """Every statistic from the full weights ``w`` and masked scores ``s`` (..., Nq, Nk) in NumPy."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(w > 0, w * np.log(w), 0.0).sum(-1)
    pos = np.arange(nq)[:, None] + offset
    j = np.arange(nk)[None, :]
    allowed = np.isfinite(s)
    order = np.argsort(-np.where(allowed, s, -np.inf), axis=-1, kind="stable")[..., :topk]
    top_w = np.take_along_axis(w, order, -1)
    top_i = np.where(np.take_along_axis(allowed, order, -1), order, -1)
    rel = np.stack([np.where(j == pos + r, w, 0.0).sum(-1) for r in relative_positions], -1)
    return {
        "entropy": ent,
        "max_weight": w.max(-1),
        "topk_weights": np.where(top_i >= 0, top_w, 0.0),
        "topk_indices": top_i,
        "mean_distance": (w * np.abs(pos - j)).sum(-1),
        "key_weights": w[..., list(key_positions)],
        "relative_weights": rel,
        "n_keys": allowed.sum(-1),
    }


def offset_of(kw, nq, nk):
    _, alignment = parse_causal(kw.get("is_causal", False))
    return nk - nq if alignment == "bottom_right" else 0


def check(st, ref, name, tol=1e-10):
    for field, want in ref.items():
        got = getattr(st, field).numpy()
        assert got.shape == want.shape, (name, field, got.shape, want.shape)
        err = np.abs(got.astype(np.float64) - want).max() if want.size else 0.0
        print(f"{name:>22} {field:>17} max err {err:.2e}")
        assert err <= tol, (name, field, err)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_stats_match_reference_every_mask(shape):
    b, hq, hk, nq, nk = shape
    q, k, _ = make_qkv(b, hq, hk, nq, nk, 8, dtype=f64)
    q = q * 2.0  # sharper weights: the top-k and the maximum mean something
    kpos, rel = (0, 3, -1), (-2, -1, 0, 1)
    for name, kw in mask_cases(b, hq, nq, nk):
        s, w, _ = ref_scores_weights(q, k, **kw)
        st = attention_stats(
            q, k, enable_gqa=hq != hk, topk=4, key_positions=kpos, relative_positions=rel, block_q=8, block_k=8, **kw
        )
        want = ref_stats(w, s, nq, nk, offset_of(kw, nq, nk), 4, (0, 3, nk - 1), rel)
        check(st, want, name)
        empty = want["n_keys"] == 0
        assert (st.entropy.numpy()[empty] == 0).all() and (st.topk_indices.numpy()[empty] == -1).all()


@pytest.mark.parametrize("topk,block_k", [(3, 64), (4, 64), (5, 64), (4, 160), (7, 128)])
def test_topk_through_the_chunk_search_on_wide_tiles(topk, block_k):
    # tiles of 64+ keys search chunk maxima first (TOPK_CHUNK keys per chunk, strided); narrow
    # tiles, and chunks fewer than k, fall back to every entry: both must give the exact top-k
    b, hq, hk, nq, nk = 1, 4, 2, 150, 333
    q, k, _ = make_qkv(b, hq, hk, nq, nk, 8, dtype=f64)
    q = q * 2.0
    for name, kw in mask_cases(b, hq, nq, nk):
        s, w, _ = ref_scores_weights(q, k, **kw)
        for lse in (None, qkv.attention(q, k, k, enable_gqa=True, return_lse=True, **kw)[1]):
            st = attention_stats(q, k, lse=lse, enable_gqa=True, topk=topk, block_q=32, block_k=block_k, **kw)
            want = ref_stats(w, s, nq, nk, offset_of(kw, nq, nk), topk, (0,), (-1,))
            check(st, {f: want[f] for f in ("topk_weights", "topk_indices", "max_weight", "n_keys")}, name)


def test_topk_with_tied_scores_takes_k_distinct_keys():
    q = torch.zeros(1, 2, 40, 8, dtype=f64)  # every score 0: all keys tie
    k = torch.randn(1, 2, 300, 8, dtype=f64)
    st = attention_stats(q, k, topk=6, block_k=128)
    assert torch.allclose(st.topk_weights, torch.full_like(st.topk_weights, 1 / 300), atol=1e-15)
    idx = st.topk_indices.sort(-1).values
    assert (idx >= 0).all() and (idx[..., 1:] > idx[..., :-1]).all()  # distinct keys


def test_stats_with_given_lse_and_single_tile():
    q, k, v = make_qkv(2, 3, 3, 50, 70, 16, dtype=f64)
    _, lse = qkv.attention(q, k, v, window=(5, 5), return_lse=True)
    a = attention_stats(q, k, lse=lse, window=(5, 5), topk=3)  # default blocks: one tile
    b = attention_stats(q, k, window=(5, 5), topk=3, block_q=7, block_k=9)
    for field in a.ARRAYS:
        assert torch.allclose(getattr(a, field).double(), getattr(b, field).double(), atol=1e-12), field
    assert (a.n_keys <= 11).all() and a.normalized_entropy.max() <= 1 + 1e-12


def test_stats_float32_and_fewer_keys_than_topk():
    q, k, _ = make_qkv(1, 2, 2, 200, 200, 32)
    st = attention_stats(q, k, is_causal=True, topk=5, block_q=64, block_k=64)
    s, w, _ = ref_scores_weights(q, k, is_causal=True)
    want = ref_stats(w, s, 200, 200, 0, 5, (0,), (-1, 0))
    for field in ("entropy", "max_weight", "mean_distance", "key_weights", "relative_weights", "topk_weights"):
        err = np.abs(getattr(st, field).double().numpy() - want[field]).max()
        print(field, err)
        assert err < 2e-4 * max(1.0, np.abs(want[field]).max()), field
    assert (st.topk_indices[0, :, 0, 1:] == -1).all() and (st.topk_indices[0, :, 0, 0] == 0).all()  # row 0 sees one key
    assert st.to_dict()["n_keys"][0][0][:3] == [1, 2, 3]
    assert "head" in st.to_string() and "AttentionStats" in repr(st)


def test_stats_never_allocate_anything_near_n_by_n():
    n = 2048
    q, k, v = make_qkv(1, 2, 1, n, n, 16)
    kp = torch.rand(1, n) > 0.1
    # the fused pass that yields the lse has its own test (tests/test_attention.py); this one is about the stats
    _, lse = qkv.attention(q, k, v, key_padding_mask=kp, is_causal=True, enable_gqa=True, return_lse=True, backend="chunked")
    with LargestAllocation() as largest:
        st = attention_stats(q, k, lse=lse, key_padding_mask=kp, is_causal=True, enable_gqa=True, topk=8)
    assert st.entropy.shape == (1, 2, n)
    assert largest.biggest <= n * n // 16, f"largest tensor {largest.biggest} vs N² = {n * n}"


def test_stats_without_topk_or_positions_and_bad_positions():
    q, k, _ = make_qkv(1, 2, 2, 20, 20, 8, dtype=f64)
    st = attention_stats(q, k, topk=0, key_positions=(), relative_positions=(), block_q=8, block_k=8)
    assert st.topk_indices.shape == (1, 2, 20, 0) and st.key_weights.shape == (1, 2, 20, 0)
    full = attention_stats(q, k, block_q=8, block_k=8)
    assert torch.allclose(st.entropy, full.entropy, atol=1e-12)
    with pytest.raises(IndexError, match="key_positions"):
        attention_stats(q, k, key_positions=(20,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs_are_computed_in_float32(dtype):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, dtype=dtype)
    st = attention_stats(q, k, is_causal=True, block_q=16, block_k=16)
    s, w, _ = ref_scores_weights(q, k, is_causal=True)  # the oracle on the same rounded inputs
    want = ref_stats(w, s, 64, 64, 0, 5, (0,), (-1, 0))
    assert st.entropy.dtype == torch.float32
    for field in ("entropy", "max_weight", "mean_distance"):
        err = np.abs(getattr(st, field).double().numpy() - want[field]).max()
        print(dtype, field, err)
        assert err < 1e-3 * max(1.0, np.abs(want[field]).max()), field


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_one_pass_returns_the_lse_and_agrees_with_the_two_pass_form(shape):
    """Without an lse the single online pass finds it; given the lse, the pass skips the
    rescaling. Both describe the same weights."""
    b, hq, hk, nq, nk = shape
    q, k, v = make_qkv(b, hq, hk, nq, nk, 8, dtype=f64)
    q = q * 3.0  # maxima that move from tile to tile: the rescaling is exercised
    for name, kw in mask_cases(b, hq, nq, nk):
        one = attention_stats(q, k, enable_gqa=hq != hk, topk=3, block_q=8, block_k=8, **kw)
        _, lse = qkv.attention(q, k, v, enable_gqa=hq != hk, return_lse=True, backend="math", **kw)
        assert one.lse is not None and one.lse.shape == lse.shape
        assert torch.equal(torch.isneginf(one.lse), torch.isneginf(lse)), name
        fin = torch.isfinite(lse)
        if fin.any():
            assert (one.lse[fin] - lse[fin]).abs().max() < 1e-12, name
        two = attention_stats(q, k, lse=lse, enable_gqa=hq != hk, topk=3, block_q=8, block_k=8, **kw)
        assert two.lse is None
        for field in AttentionStatsFields:
            a, c = getattr(one, field).double(), getattr(two, field).double()
            assert torch.allclose(a, c, atol=1e-11, equal_nan=True), (name, field)


AttentionStatsFields = ("entropy", "max_weight", "topk_indices", "topk_weights", "mean_distance", "key_weights",
                        "relative_weights", "n_keys")


def test_attention_with_stats_answers_rows_whose_float32_scores_all_overflow():
    """Finite inputs whose float32 scores of a row all round to -inf: not an empty row. The
    statistics' pass answers them in float64, as qkv.attention does (qkv.overflow)."""
    q = torch.tensor([[[[1e20, 0.0]]]])
    k = torch.tensor([[[[-1e20, 0.0], [-2e20, 0.0]]]])
    v = torch.eye(2).view(1, 1, 2, 2)
    out, stats = qkv.inspect.attention_with_stats(q, k, v)
    assert torch.equal(out, qkv.attention(q, k, v)) and torch.equal(out, torch.tensor([[[[1.0, 0.0]]]]))
    # the row took all of its weight from key 0 (its lse, -7e39, is beyond float32: -inf there)
    assert float(stats.max_weight) == 1.0 and stats.topk_indices.flatten().tolist()[0] == 0
