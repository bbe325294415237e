"""The chunked backend's no-gradient path: torch's fused CPU kernel dispatched block by block.

Every positional rule, padding pattern and head layout is compared with the float64 math path
(the kernel's own rounding in float64 is ~1e-15); 16-bit inputs follow the accuracy rule."""

from __future__ import annotations

import itertools

import pytest
import torch

import qkv
from qkv.backends import auto_order
from qkv.backends.flash_cpu import can_fuse, empty_rows
from qkv.call import validate

from ..helpers import assert_within_rule, make_qkv, max_err

CAUSAL = [False, True, "bottom_right"]
WINDOWS = [None, (40, 0), (30, 50), (None, 20), (-1, 0), (0, 0)]


def _padding(kind: str, b: int, nk: int):
    if kind == "none":
        return None
    if kind == "prefix":  # ragged lengths: trimmed per batch entry
        return torch.arange(nk)[None] < torch.tensor([[nk], [nk // 3]])[:b]
    if kind == "empty":  # a sequence with no real key
        return torch.arange(nk)[None] < torch.tensor([[0], [nk // 2]])[:b]
    return torch.rand(b, nk) > 0.5  # scattered: a broadcast mask


@pytest.mark.parametrize("nq,nk", [(1, 97), (97, 97), (300, 613), (613, 300), (130, 130)])
@pytest.mark.parametrize("padding", ["none", "prefix", "empty", "scattered"])
def test_every_rule_matches_math_in_float64(nq, nk, padding):
    q, k, v = make_qkv(2, 3, 3, nq, nk, 16, dtype=torch.float64)
    kp = _padding(padding, 2, nk)
    for causal, window in itertools.product(CAUSAL, WINDOWS):
        kw = dict(is_causal=causal, window=window, key_padding_mask=kp, return_lse=True)
        assert can_fuse(validate(q, k, v, **kw))
        out, lse = qkv.attention(q, k, v, backend="chunked", **kw)
        ref, ref_lse = qkv.attention(q, k, v, backend="math", **kw)
        assert max_err(out, ref) < 1e-12, kw
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), kw  # empty rows: -inf, as math
        assert max_err(lse.nan_to_num(neginf=0.0), ref_lse.nan_to_num(neginf=0.0)) < 1e-12, kw


@pytest.mark.parametrize("layout", ["gqa", "mqa", "strided", "expanded", "2d", "5d", "negative_scale"])
def test_head_layouts_views_and_scales(layout):
    b, hq, hk, n, d = 2, 6, 6, 200, 32
    kw: dict = {"is_causal": True, "window": (64, 0), "key_padding_mask": torch.arange(n)[None] < torch.tensor([[n], [150]])}
    if layout in ("gqa", "mqa"):
        hk = 2 if layout == "gqa" else 1
        kw["enable_gqa"] = True
    q, k, v = make_qkv(b, hq, hk, n, n, d, dtype=torch.float64)
    if layout == "strided":  # last dim of stride 2: the kernel needs stride 1 there
        q, k, v = (torch.cat([t, t], -1)[..., ::2] for t in (q, k, v))
    elif layout == "expanded":
        k, v = k[:1].expand(b, -1, -1, -1), v[:1].expand(b, -1, -1, -1)
    elif layout == "2d":
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
        kw["key_padding_mask"] = kw["key_padding_mask"][1]
    elif layout == "5d":
        q, k, v = (t.unsqueeze(0).expand(3, -1, -1, -1, -1) for t in (q, k, v))
    elif layout == "negative_scale":
        kw["scale"] = -0.3
    out, lse = qkv.attention(q, k, v, backend="chunked", return_lse=True, **kw)
    ref, ref_lse = qkv.attention(q, k, v, backend="math", return_lse=True, **kw)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert max_err(out, ref) < 1e-12
    assert max_err(lse, ref_lse) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["window_padding", "bottom_right_merged"])
def test_low_precision_within_rule(dtype, case):
    if case == "window_padding":
        q, k, v = make_qkv(2, 4, 2, 333, 333, 64, dtype=dtype)
        kw = {"is_causal": "bottom_right", "window": (100, 0), "enable_gqa": True, "key_padding_mask": torch.rand(2, 333) > 0.2}
    else:  # Nq < Nk: two unmasked kernel calls whose halves merge through their lse
        q, k, v = make_qkv(2, 4, 2, 150, 333, 64, dtype=dtype)
        kw = {"is_causal": "bottom_right", "enable_gqa": True}
    ref = qkv.attention(*(t.double() for t in (q, k, v)), backend="math", **kw)
    base = qkv.attention(q, k, v, backend="math", **kw)
    out = qkv.attention(q, k, v, backend="chunked", **kw)
    assert out.dtype == dtype
    assert_within_rule(out, base, ref, dtype, what=f"{dtype} out")


def test_gradient_calls_take_the_chunked_loop_and_agree():
    q, k, v = make_qkv(1, 2, 2, 300, 300, 16, dtype=torch.float64, requires_grad=True)
    kw = {"is_causal": True, "window": (50, 0)}
    assert not can_fuse(validate(q, k, v, **kw))
    with torch.no_grad():
        fused = qkv.attention(q, k, v, backend="chunked", **kw)
    looped = qkv.attention(q, k, v, backend="chunked", **kw)
    assert max_err(fused, looped) < 1e-12
    assert looped.requires_grad


def test_empty_rows_found_without_the_full_matrix():
    for nq, nk, causal, window in [(50, 30, "bottom_right", None), (30, 50, True, (5, 5)), (20, 20, False, (0, 0)), (40, 10, "bottom_right", (3, 0))]:
        kp = torch.rand(3, nk) > 0.7
        call = validate(torch.zeros(3, 1, nq, 4), torch.zeros(3, 1, nk, 4), torch.zeros(3, 1, nk, 4),
                        is_causal=causal, window=window, key_padding_mask=kp)  # fmt: skip
        w = qkv.attention_weights(torch.zeros(3, 1, nq, 4), torch.zeros(3, 1, nk, 4), is_causal=causal, window=window, key_padding_mask=kp)
        assert torch.equal(empty_rows(call.positional, nq, kp, kp.device), (w.sum(-1) == 0)[:, 0])


@pytest.mark.parametrize(
    "nq, nk, causal, window",
    [(50, 30, "bottom_right", None), (30, 50, "bottom_right", None), (30, 50, True, None), (50, 30, True, None),
     (20, 20, False, (0, None)), (20, 20, False, (None, 0)), (20, 10, False, (12, None)), (40, 10, False, (5, None)),
     (60, 20, "bottom_right", (None, 0)), (30, 50, True, (5, 5)), (20, 20, False, None)],
)  # fmt: skip
def test_empty_rows_without_padding(nq, nk, causal, window):
    """Without padding, one-sided bands are decided without building row vectors (None: no row
    is empty); every answer agrees with the weights."""
    call = validate(torch.zeros(1, 1, nq, 4), torch.zeros(1, 1, nk, 4), torch.zeros(1, 1, nk, 4), is_causal=causal, window=window)
    w = qkv.attention_weights(torch.zeros(1, 1, nq, 4), torch.zeros(1, 1, nk, 4), is_causal=causal, window=window)
    want = (w.sum(-1) == 0)[:, 0]  # (1, Nq)
    got = empty_rows(call.positional, nq, None, torch.device("cpu"))
    assert torch.equal(got, want) if got is not None else not want.any()


def test_auto_prefers_the_fused_path_for_rules_sdpa_lacks():
    q, k, v = make_qkv(2, 2, 2, 256, 256, 8)
    mask = torch.rand(128, 256) > 0.5
    for kw in ({"window": (8, 0)}, {"key_padding_mask": torch.rand(2, 256) > 0.2}, {"is_causal": "bottom_right"}, {"attn_mask": mask}):
        assert auto_order(validate(q[:, :, :128], k, v, **kw))[0].NAME == "chunked", kw
        with torch.no_grad():  # the plain-call shortcut must not send a large bool mask to SDPA
            assert max_err(qkv.attention(q[:, :, :128], k, v, **kw), qkv.attention(q[:, :, :128], k, v, backend="chunked", **kw)) == 0
    small = validate(q[:, :, :16], k[:, :, :16], v[:, :, :16], window=(8, 0))
    assert auto_order(small)[0].NAME == "sdpa"  # below MATH_MAX_SCORES a dense mask is cheap
    grad = validate(q[:, :, :128].requires_grad_(), k, v, window=(8, 0))
    assert auto_order(grad)[0].NAME == "chunked" and auto_order(grad)[-1].NAME == "sdpa"


@pytest.mark.parametrize("mask_kind", ["block_sparse", "random", "per_head", "per_batch", "gqa_per_head", "empty_rows"])
def test_bool_mask_block_sparse_dispatch_matches_math(mask_kind):
    b, hq, hk, nq, nk = 2, 4, 4, 300, 420
    g = torch.Generator().manual_seed(1)
    if mask_kind == "block_sparse":  # 128-blocks at ~30%: gathered, non-adjacent key blocks
        keep = torch.rand(3, 4, generator=g) < 0.3
        keep[:, 0] = True
        mask = keep.repeat_interleave(128, 0).repeat_interleave(128, 1)[:nq, :nk]
    elif mask_kind == "random":
        mask = torch.rand(nq, nk, generator=g) > 0.5
    elif mask_kind == "per_head":
        mask = torch.rand(1, hq, nq, nk, generator=g) > 0.9
    elif mask_kind == "per_batch":
        mask = torch.rand(b, 1, nq, nk, generator=g) > 0.7
    elif mask_kind == "gqa_per_head":
        hk = 2
        mask = torch.rand(b, hq, nq, nk, generator=g) > 0.8
    else:
        mask = torch.rand(nq, nk, generator=g) > 0.5
        mask[:150] = False  # a whole row block with nothing to attend to, and empty rows in another
        mask[200:210] = False
    q, k, v = make_qkv(b, hq, hk, nq, nk, 16, dtype=torch.float64)
    for causal, window, padding in [(False, None, None), (True, None, None), ("bottom_right", (60, 10), torch.rand(b, nk) > 0.3)]:
        kw = dict(attn_mask=mask, is_causal=causal, window=window, key_padding_mask=padding, enable_gqa=hq != hk, return_lse=True)
        assert can_fuse(validate(q, k, v, **kw)), kw
        out, lse = qkv.attention(q, k, v, backend="chunked", **kw)
        ref, ref_lse = qkv.attention(q, k, v, backend="math", **kw)
        assert max_err(out, ref) < 1e-12, kw
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        assert max_err(lse.nan_to_num(neginf=0.0), ref_lse.nan_to_num(neginf=0.0)) < 1e-12


def test_whole_blocks_need_no_mask(monkeypatch):
    # a block-sparse layout leaves each row block whole key blocks: the kernel gets no mask
    import qkv.backends.flash_cpu as fc

    built = []
    real = fc.additive_mask
    monkeypatch.setattr(fc, "additive_mask", lambda allowed, dtype: built.append(1) or real(allowed, dtype))
    keep = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = keep.repeat_interleave(128, 0).repeat_interleave(128, 1)
    q, k, v = make_qkv(1, 2, 2, 384, 512, 16, dtype=torch.float64)
    out, lse = qkv.attention(q, k, v, attn_mask=mask, backend="chunked", return_lse=True)
    ref, ref_lse = qkv.attention(q, k, v, attn_mask=mask, backend="math", return_lse=True)
    assert built == [] and max_err(out, ref) < 1e-12 and max_err(lse, ref_lse) < 1e-12
    mask[5, 0] = False  # one entry less: that row block needs its mask again
    out = qkv.attention(q, k, v, attn_mask=mask, backend="chunked")
    assert len(built) == 1 and max_err(out, qkv.attention(q, k, v, attn_mask=mask, backend="math")) < 1e-12
