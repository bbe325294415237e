"""The chunked loop (gradient calls) skips work that a mask rules out: trailing key padding of
ragged sequences and tiles in which a bool attn_mask allows nothing. Results and gradients
must equal the math path's; the skipped tiles are counted."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.backends import online_softmax
from qkv.backends import chunked_native

from ..helpers import max_err


def _grads(q, k, v, backend, kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = qkv.attention(q, k, v, backend=backend, return_lse=True, **kw)
    g = torch.Generator().manual_seed(5)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * torch.randn(lse.shape, generator=g, dtype=lse.dtype)).sum()
    return (out, lse, *torch.autograd.grad(loss, (q, k, v)))


def _count_tiles(monkeypatch) -> list:
    """[number of tiles visited, list of (key_limit, k1) per tile] of the torch formulation (the
    C loops, which skip the same tiles, are tested against it in test_chunked_native.py)"""
    monkeypatch.setattr(chunked_native, "forward", lambda *a: None)
    monkeypatch.setattr(chunked_native, "backward", lambda *a: None)
    seen: list = [0, []]
    original = online_softmax.key_blocks  # the tile loops' walk over key blocks

    def counting(tiles, *a, **kw):
        for k0, k1 in original(tiles, *a, **kw):
            seen[0] += 1
            seen[1].append((tiles.key_limit, k1))
            yield k0, k1

    monkeypatch.setattr(online_softmax, "key_blocks", counting)
    return seen


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_ragged_padding_trimmed_with_exact_gradients(causal, monkeypatch):
    b, h, nq, nk = 3, 2, 300, 700
    q, k, v = (torch.randn(b, h, n, 16, dtype=torch.float64) for n in (nq, nk, nk))
    lengths = torch.tensor([nk, 250, 0])  # a full sequence, a short one, one with no key at all
    kw = {"is_causal": causal, "key_padding_mask": torch.arange(nk)[None] < lengths[:, None]}
    seen = _count_tiles(monkeypatch)
    got = _grads(q, k, v, "chunked", kw)
    want = _grads(q, k, v, "math", kw)
    for a, e in zip(got, want):
        assert max_err(a.nan_to_num(neginf=0.0), e.nan_to_num(neginf=0.0)) < 1e-12
    assert torch.isneginf(got[1][2]).all() and (got[0][2] == 0).all()  # no keys: output 0, lse -inf
    limits = {limit for limit, _ in seen[1]}
    assert limits == {700, 250}  # each entry alone; the empty one visits no tile
    assert all(k1 <= limit for limit, k1 in seen[1])  # padded keys are never computed
    seen[1].clear()
    scattered = kw["key_padding_mask"].clone()
    scattered[0, 5] = False  # not a prefix any more: the batch runs whole, with every key tile
    _grads(q, k, v, "chunked", {**kw, "key_padding_mask": scattered})
    assert {limit for limit, _ in seen[1]} == {None}


def test_block_sparse_bool_mask_skips_empty_tiles_with_exact_gradients(monkeypatch):
    n, cell = 2048, 256  # the mask in blocks of the chunked tile size (256)
    keep = torch.rand(n // cell, n // cell) < 0.1
    keep |= torch.eye(n // cell, dtype=torch.bool)
    mask = keep.repeat_interleave(cell, 0).repeat_interleave(cell, 1)
    q, k, v = (torch.randn(1, 1, n, 8, dtype=torch.float64) for _ in range(3))
    count = _count_tiles(monkeypatch)
    got = _grads(q, k, v, "chunked", {"attn_mask": mask})
    sparse_tiles = count[0]
    want = _grads(q, k, v, "math", {"attn_mask": mask})
    for a, e in zip(got, want):
        assert max_err(a, e) < 1e-12
    count[0] = 0
    _grads(q, k, v, "chunked", {"attn_mask": torch.ones(n, n, dtype=torch.bool)})
    assert sparse_tiles <= 0.5 * count[0], (sparse_tiles, count[0])
