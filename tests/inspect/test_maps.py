"""attention_map / attention_scores against the float64 oracle, for every mask kind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv.inspect import attention_map, attention_scores
from qkv.reference.attention import combined_mask, repeat_kv_heads, softmax_rows
from ..helpers import make_qkv

f64 = torch.float64


def ref_scores_weights(q, k, *, attn_mask=None, is_causal=False, window=None, key_padding_mask=None, scale=None):
    """Full float64 scores (masked to -inf) and weights (..., Hq, Nq, Nk) in NumPy."""
    qn, kn = q.double().numpy(), k.double().numpy()
    kn = repeat_kv_heads(kn, qn.shape[-3])
    s = qn @ np.swapaxes(kn, -1, -2) * (scale if scale is not None else 1.0 / np.sqrt(qn.shape[-1]))
    allowed, bias = combined_mask(
        qn.shape[-2], kn.shape[-2], attn_mask=attn_mask, is_causal=is_causal, window=window, key_padding_mask=key_padding_mask
    )
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    s = np.broadcast_to(s, np.broadcast_shapes(s.shape, qn.shape[:-1] + (kn.shape[-2],)))
    w, lse = softmax_rows(s)
    return s, w, lse


def mask_cases(b, h, nq, nk):
    """(name, kwargs) for every mask kind, including fully masked rows and batch entries."""
    kp = torch.rand(b, nk) > 0.3
    kp[-1] = False  # a batch entry with no real key: every row empty
    bm = torch.rand(b, h, nq, nk) > 0.4
    bm[0, 0, 1] = False  # one fully masked row
    fm = torch.randn(nq, nk, dtype=f64)
    fm[2, :] = float("-inf")  # a float mask can empty a row too
    return [
        ("none", {}),
        ("causal", {"is_causal": True}),
        ("bottom_right", {"is_causal": "bottom_right"}),
        ("window", {"window": (3, 2)}),
        ("causal_window", {"is_causal": True, "window": (4, 0)}),
        ("padding", {"key_padding_mask": kp}),
        ("bool_mask", {"attn_mask": bm}),
        ("float_mask", {"attn_mask": fm}),
        ("padding_causal_float", {"key_padding_mask": kp, "is_causal": "bottom_right", "attn_mask": fm[None, None]}),
    ]


SHAPES = [(2, 4, 4, 37, 37), (2, 6, 2, 19, 45), (1, 2, 1, 40, 23)]  # b, hq, hk, nq, nk: GQA, MQA, Nq != Nk


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_map_matches_reference_every_mask(shape):
    b, hq, hk, nq, nk = shape
    q, k, _ = make_qkv(b, hq, hk, nq, nk, 8, dtype=f64)
    for name, kw in mask_cases(b, hq, nq, nk):
        s_ref, w_ref, _ = ref_scores_weights(q, k, **kw)
        gqa = {"enable_gqa": hq != hk}
        heads, rows = [hq - 1, 0], [nq - 1, 0, 5, 6, 7, 2]
        w = attention_map(q, k, heads=heads, rows=rows, block=8, **gqa, **kw)
        want = w_ref[:, heads][:, :, rows]
        err = np.abs(w.numpy() - want).max()
        print(name, "max err", err)
        assert w.shape == want.shape and err <= 1e-12, name
        full = attention_map(q, k, block=16, **gqa, **kw)  # all heads and rows, default lse
        assert np.abs(full.numpy() - w_ref).max() <= 1e-12, name
        s = attention_scores(q, k, heads=heads, rows=rows, block=8, **gqa, **kw)
        s_want = s_ref[:, heads][:, :, rows]
        both_inf = np.isneginf(s.numpy()) & np.isneginf(s_want)
        assert (np.isneginf(s.numpy()) == np.isneginf(s_want)).all(), name
        with np.errstate(invalid="ignore"):
            assert np.abs(np.where(both_inf, 0, s.numpy() - s_want)).max() <= 1e-12, name


def test_map_uses_the_given_lse():
    q, k, v = make_qkv(1, 2, 2, 30, 30, 8, dtype=f64)
    _, lse = qkv.attention(q, k, v, is_causal=True, return_lse=True)
    w = attention_map(q, k, lse=lse, is_causal=True, rows=slice(10, 20))
    assert torch.allclose(w.sum(-1), torch.ones(1, 2, 10, dtype=f64), atol=1e-12)
    # the lse really is what normalises (a shift within the consistency check's tolerance)
    shifted = attention_map(q, k, lse=lse + 0.01, is_causal=True, rows=slice(10, 20))
    assert torch.allclose(shifted, w * np.exp(-0.01), atol=1e-14)


def test_map_float32_close_to_reference_and_rows_sum_to_one():
    q, k, _ = make_qkv(2, 4, 2, 300, 300, 32)
    w = attention_map(q, k, heads=[1, 3], rows=range(0, 300, 7), is_causal=True, enable_gqa=True)
    _, w_ref, _ = ref_scores_weights(q, k, is_causal=True)
    err = np.abs(w.double().numpy() - w_ref[:, [1, 3]][:, :, list(range(0, 300, 7))]).max()
    print("float32 max err", err)
    assert w.dtype == torch.float32 and err < 1e-5
    assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-5)


def test_map_matches_attention_weights_and_2d_inputs():
    q, k, _ = make_qkv(1, 1, 1, 12, 17, 8, dtype=f64)
    w = attention_map(q[0, 0], k[0, 0], is_causal="bottom_right")
    assert w.shape == (12, 17)
    assert torch.allclose(w, qkv.attention_weights(q[0, 0], k[0, 0], is_causal="bottom_right"), atol=1e-12)


def test_map_bad_arguments_explain_themselves():
    q, k, _ = make_qkv(1, 2, 2, 8, 8, 4)
    with pytest.raises(IndexError, match="heads"):
        attention_map(q, k, heads=[2])
    with pytest.raises(ValueError, match="lse"):
        attention_map(q, k, lse=torch.zeros(3, 8))


# -- a caller's lse that does not belong to the call is refused, never turned into weights ----------

LSE_WRONG = "lse does not belong to this query/key/mask.*return_lse=True"


def _lse_case():
    q, k, v = make_qkv(2, 4, 2, 40, 40, 16)
    kp = torch.ones(2, 40, dtype=torch.bool)
    kp[1] = False  # batch entry 1: every row empty, lse -inf
    masks = dict(enable_gqa=True, is_causal=True, key_padding_mask=kp)
    _, lse = qkv.attention(q, k, v, return_lse=True, **masks)
    return q, k, masks, lse


@pytest.mark.parametrize("fn", ["map", "stats"])
def test_lse_of_another_call_is_refused(fn):
    from qkv.inspect import attention_stats

    q, k, masks, lse = _lse_case()
    run = (lambda l, **kw: attention_map(q, k, lse=l, rows=[0, 7, -1], **kw)) if fn == "map" else (
        lambda l, **kw: attention_stats(q, k, lse=l, **kw))
    run(lse, **masks)  # the right one passes
    run(lse.to(torch.bfloat16), **masks)  # a lower-precision copy too: within its rounding
    no_causal = {**masks, "is_causal": False}
    _, other_q = qkv.attention(q * 2, k, k, return_lse=True, **masks)
    live_neg_inf = lse.clone()
    live_neg_inf[0, 1, 7] = float("-inf")  # a row with keys claimed empty
    for bad, kw in ((lse - 2.0, masks), (lse + 3.0, masks), (lse, no_causal), (other_q, masks), (live_neg_inf, masks)):
        with pytest.raises(ValueError, match=LSE_WRONG):
            run(bad, **kw)


@pytest.mark.parametrize("fn", ["map", "stats"])
def test_lse_dtype_device_nan_and_inf_are_refused(fn):
    from qkv.inspect import attention_stats

    q, k, masks, lse = _lse_case()
    run = (lambda l: attention_map(q, k, lse=l, **masks)) if fn == "map" else (lambda l: attention_stats(q, k, lse=l, **masks))
    with pytest.raises(TypeError, match="lse has dtype torch.int64 but a log-sum-exp is floating point"):
        run(lse.nan_to_num(neginf=0).long())
    with pytest.raises(TypeError, match="lse must be a torch.Tensor"):
        run(lse.tolist())
    with pytest.raises(ValueError, match=r"lse is on meta but query is on cpu.*lse.to\(query.device\)"):
        run(lse.to("meta"))
    for value, what in ((float("nan"), "NaN"), (float("inf"), r"\+inf")):
        bad = lse.clone()
        bad[0, 2, 5] = value
        with pytest.raises(ValueError, match=f"lse holds {what} in 1 of its 320 values"):
            run(bad)
    with pytest.raises(ValueError, match=r"lse has shape \(2, 4, 41\) but this call needs"):
        run(torch.zeros(2, 4, 41))


def test_nan_inputs_give_nan_maps_not_an_lse_error():
    from qkv.inspect import attention_stats

    q, k, masks, lse = _lse_case()
    q[0, 1, 3] = float("nan")
    assert attention_map(q, k, rows=[3], **masks)[0, 1, 0, :4].isnan().all()  # its own lse: not checked
    assert attention_stats(q, k, **masks).entropy[0, 1, 3].isnan()
    shifted = lse + 1.0
    w = attention_map(q, k, lse=shifted, rows=[4], check_lse=False, **masks)  # opted out: used as given
    assert torch.allclose(w.sum(-1)[0], torch.full((4, 1), np.exp(-1.0)), atol=1e-5)


def test_lse_check_stays_off_the_nq_by_nk_matrix():
    from ..helpers import LargestAllocation

    q, k, _ = make_qkv(1, 2, 2, 2048, 2048, 16)
    _, lse = qkv.attention(q, k, k, return_lse=True)
    with LargestAllocation() as big:
        attention_map(q, k, lse=lse, rows=[0, 1000, 2047], block=256)
    assert big.biggest < 2048 * 2048 // 8, big.biggest  # an r × Nk result and tiles; never Nq × Nk
