"""The chunked backend's C tile loops (qkv/csrc/flash.c, used for CPU calls with gradients)
against the torch formulation they replace, which stays the reference: same tiles, same units."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.backends import tiles
from qkv.backends.chunked import ChunkedBackend
from qkv.backends import chunked_native, native

from ..helpers import make_qkv, max_err

pytestmark = pytest.mark.skipif(
    native.library() is None or native.gemm(torch.float64) is None, reason=f"native kernels {native.status()} / no BLAS"
)


def _cases(b: int, nk: int) -> list[tuple[str, dict]]:
    kp = torch.rand(b, nk) > 0.3
    kp[-1] = False  # a batch entry with no real key
    ragged = torch.arange(nk)[None] < torch.tensor([nk, nk // 3])[:b, None]
    return [
        ("none", {}),
        ("causal", {"is_causal": True}),
        ("bottom_right", {"is_causal": "bottom_right"}),
        ("window", {"window": (3, 2)}),
        ("causal_window", {"is_causal": True, "window": (9, 0)}),
        ("padding", {"key_padding_mask": kp}),
        ("ragged_causal", {"key_padding_mask": ragged, "is_causal": "bottom_right"}),
    ]


def _run(q, k, v, kw, *, native_on: bool, monkeypatch, taken: list):
    """out, lse and the gradients of a loss touching both, by the chunked backend."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with monkeypatch.context() as m:
        if not native_on:
            m.setattr(chunked_native, "forward", lambda *a: None)
            m.setattr(chunked_native, "backward", lambda *a: None)
        else:
            real_f, real_b = chunked_native.forward, chunked_native.backward
            m.setattr(chunked_native, "forward", lambda *a: taken.append("fwd") or real_f(*a))
            m.setattr(chunked_native, "backward", lambda *a: taken.append("bwd") or real_b(*a))
        out, lse = qkv.attention(q, k, v, backend="chunked", return_lse=True, enable_gqa=q.shape[1] != k.shape[1], **kw)
        g = torch.Generator().manual_seed(3)
        loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * torch.randn(lse.shape, generator=g, dtype=lse.dtype)).sum()
        return (out, lse, *torch.autograd.grad(loss, (q, k, v)))


@pytest.mark.parametrize("shape", [(2, 4, 2, 70, 130), (2, 3, 1, 40, 23), (2, 2, 2, 65, 65)], ids=str)
def test_native_equals_torch_formulation(monkeypatch, shape):
    b, hq, hk, nq, nk = shape
    q, k, v = make_qkv(b, hq, hk, nq, nk, 16, dv=12, dtype=torch.float64)
    monkeypatch.setattr(tiles, "BLOCK_Q", 16)  # several row and key tiles, partial edges
    monkeypatch.setattr(tiles, "BLOCK_K", 32)
    for name, kw in _cases(b, nk):
        taken: list = []
        fast = _run(q, k, v, kw, native_on=True, monkeypatch=monkeypatch, taken=taken)
        slow = _run(q, k, v, kw, native_on=False, monkeypatch=monkeypatch, taken=[])
        assert taken == ["fwd", "bwd"], name
        for what, a, e in zip(("out", "lse", "dq", "dk", "dv"), fast, slow):
            assert max_err(a, e) < 1e-12, (name, what, max_err(a, e))


def test_attn_mask_keeps_the_torch_formulation(monkeypatch):
    q, k, v = make_qkv(1, 2, 2, 20, 30, 8, dtype=torch.float64)
    taken: list = []
    _run(q, k, v, {"attn_mask": torch.rand(20, 30) > 0.5}, native_on=True, monkeypatch=monkeypatch, taken=taken)
    assert taken == ["fwd", "bwd"]  # asked, and declined: the results come from chunked.py
    from qkv.masks.tiles import MaskTiles

    assert chunked_native._kernel(q, MaskTiles.from_call(_call(q, k, v, attn_mask=torch.ones(20, 30, dtype=torch.bool))), "fwd") is None


def _call(q, k, v, **kw):
    from qkv.call import validate

    return validate(q, k, v, **kw)


def test_float32_large_logits_and_a_dominant_key_within_rule(monkeypatch):
    """Logits in the hundreds and rows where one key holds nearly all the weight: the native
    gradients are as accurate as the torch formulation's (both against float64)."""
    q, k, v = make_qkv(2, 4, 4, 96, 96, 32, dtype=torch.float64, seed=11)
    q = q * 12.0  # scores up to a few hundred
    k[:, :, 7] = q[:, :, 7] * 3.0  # key 7 dominates row 7
    q32, k32, v32 = (t.float() for t in (q, k, v))
    # the oracle sees the rounded inputs
    want = _run(q32.double(), k32.double(), v32.double(), {"is_causal": True}, native_on=False, monkeypatch=monkeypatch, taken=[])
    fast = _run(q32, k32, v32, {"is_causal": True}, native_on=True, monkeypatch=monkeypatch, taken=[])
    slow = _run(q32, k32, v32, {"is_causal": True}, native_on=False, monkeypatch=monkeypatch, taken=[])
    for what, a, s, e in zip(("out", "lse", "dq", "dk", "dv"), fast, slow, want):
        ea, es = max_err(a, e), max_err(s, e)
        print(what, "native", ea, "torch formulation", es)
        assert ea <= 2 * es + 1e-6 * max(1.0, float(e.detach().abs().max())), what


def test_threads_do_not_change_the_result(monkeypatch):
    q, k, v = make_qkv(2, 4, 2, 150, 170, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(q, k, v, {"window": (40, 3)}, native_on=True, monkeypatch=monkeypatch, taken=[])
        torch.set_num_threads(2)
        two = _run(q, k, v, {"window": (40, 3)}, native_on=True, monkeypatch=monkeypatch, taken=[])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_nan_input_matches_the_torch_formulation(monkeypatch):
    """A NaN key: the same NaN pattern in the output, lse and gradients, the same numbers elsewhere."""
    q, k, v = make_qkv(1, 2, 2, 20, 50, 8, dtype=torch.float64)
    k[0, 0, 30, 0] = float("nan")
    for kw in ({}, {"is_causal": True}):
        fast = _run(q, k, v, kw, native_on=True, monkeypatch=monkeypatch, taken=[])
        slow = _run(q, k, v, kw, native_on=False, monkeypatch=monkeypatch, taken=[])
        for a, b in zip(fast, slow):
            assert torch.equal(a.isnan(), b.isnan())
            assert max_err(a.nan_to_num(), b.nan_to_num()) < 1e-12


def test_band_calls_plan_short_row_tiles(monkeypatch):
    """Rows that see a narrow band of keys get short row tiles (less of each tile masked);
    rows without a band keep 256; an explicit ``block_q`` wins. Results stay exact either way."""
    from qkv.backends import BACKENDS

    assert [tiles.band_rows(s) for s in (1, 129, 513, 600, 1024, 16384)] == [32, 32, 64, 64, 128, 128]
    planned: list = []
    real = chunked_native.forward
    monkeypatch.setattr(chunked_native, "forward", lambda *a: planned.append(a[5]) or real(*a))
    q, k, v = make_qkv(1, 2, 2, 600, 600, 16, dtype=torch.float64)
    cases = [({"is_causal": True, "window": (128, 0)}, 32), ({"is_causal": True}, 64), ({"window": (100, 200)}, 32), ({}, 256)]
    for kw, rows in cases:
        planned.clear()
        got = _run(q, k, v, kw, native_on=True, monkeypatch=monkeypatch, taken=[])
        want = _run(q, k, v, kw, native_on=False, monkeypatch=monkeypatch, taken=[])
        assert planned == [rows], kw
        for a, e in zip(got, want):
            assert max_err(a, e) < 1e-12, kw
    monkeypatch.setitem(BACKENDS, "chunked", ChunkedBackend(block_q=100))
    planned.clear()
    _run(q, k, v, {"is_causal": True, "window": (128, 0)}, native_on=True, monkeypatch=monkeypatch, taken=[])
    assert planned == [100]
