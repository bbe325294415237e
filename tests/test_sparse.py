"""qkv.sparse: layouts built independently (the published rules written out token by token), and
every backend given a BlockSparseMask equals the float64 oracle with its dense bool mask."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import sparse
from qkv.reference import attention_ref

from .helpers import max_err

f64 = torch.float64


def test_longformer_is_the_token_rule():
    n, w, g = 300, 20, [0, 150]
    m = sparse.longformer(n, w, g, block_size=32)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    glob = torch.zeros(n, dtype=torch.bool)
    glob[g] = True
    want = ((i - j).abs() <= w) | glob[i] | glob[j]
    assert torch.equal(m.to_dense(), want)
    # every allowed pair lies in a computed block, and the layout computes no empty block
    blocks = torch.nn.functional.pad(want, (0, 20, 0, 20)).view(10, 32, 10, 32).any(3).any(1)
    assert torch.equal(m.layout, blocks)
    assert abs(m.density - 0.0) > 0 and m.density < 1
    assert sparse.longformer(8, 1, 2).to_dense()[:2].all()  # a count means the first tokens


def test_bigbird_blocks():
    m = sparse.bigbird(1000, 100, num_window_blocks=3, num_global_blocks=1, num_random_blocks=2, seed=3)
    lay = m.layout
    assert lay.shape == (10, 10)
    assert lay[0].all() and lay[:, 0].all()  # global
    for i in range(10):
        for j in range(max(0, i - 1), min(10, i + 2)):
            assert lay[i, j]  # window
    extra = lay.clone()
    b = torch.arange(10)
    extra[(b[:, None] - b[None, :]).abs() <= 1] = False
    extra[0], extra[:, 0] = False, False
    assert (extra[1:].sum(1) == 2).all()  # two random blocks per non-global row
    assert torch.equal(m.layout, sparse.bigbird(1000, 100, 3, 1, 2, seed=3).layout)  # seeded
    assert not torch.equal(m.layout, sparse.bigbird(1000, 100, 3, 1, 2, seed=4).layout)
    assert torch.equal(m.to_dense(), m.layout.repeat_interleave(100, 0).repeat_interleave(100, 1))
    assert abs(m.density - lay.double().mean().item()) < 1e-12


def test_strided_is_causal_local_plus_strided():
    m = sparse.strided(256, 16, 4)
    i, j = torch.arange(256)[:, None], torch.arange(256)[None, :]
    bi, bj = i // 16, j // 16
    want = (j <= i) & (((bi - bj) < 4) | ((bi - bj) % 4 == 0))
    assert torch.equal(m.to_dense(), want)
    both = sparse.strided(256, 16, 4, causal=False).to_dense()
    assert torch.equal(both, both.T)


def test_from_dense_round_trips_batched_masks():
    mask = torch.rand(2, 3, 70, 90) > 0.97
    m = sparse.from_dense(mask, (16, 32))
    assert m.layout.shape == (2, 3, 5, 3)
    assert torch.equal(m.to_dense(), mask)


@pytest.mark.parametrize("backend", ["math", "chunked", "sdpa", "auto"])
@pytest.mark.parametrize("grad", [False, True])
def test_every_backend_gives_the_dense_mask_answer(backend, grad):
    n = 257
    masks = [sparse.longformer(n, 16, [0, 5], block_size=32), sparse.bigbird(n, 32, 3, 1, 1), sparse.strided(n, 32, 3)]
    q, k, v = (torch.randn(2, 3, n, 16, dtype=f64, requires_grad=grad) for _ in range(3))
    for m in masks:
        out = qkv.attention(q, k, v, attn_mask=m, backend=backend)
        want = attention_ref(q, k, v, attn_mask=m.to_dense())
        assert max_err(out, want) < 1e-12, m.name
        if grad:
            g = torch.autograd.grad(out.sum(), (q, k, v))
            g2 = torch.autograd.grad(qkv.attention(q, k, v, attn_mask=m.to_dense(), backend="math").sum(), (q, k, v))
            assert all(max_err(a, b) < 1e-12 for a, b in zip(g, g2))


def test_per_head_layouts_broadcast_and_modules_accept_them():
    n = 96
    mask = torch.rand(4, n, n) > 0.9
    mask |= torch.eye(n, dtype=torch.bool)
    m = sparse.from_dense(mask[None], 32)  # (1, H, N, N)
    q, k, v = (torch.randn(2, 4, n, 8, dtype=f64) for _ in range(3))
    assert max_err(qkv.attention(q, k, v, attn_mask=m), attention_ref(q, k, v, attn_mask=mask[None])) < 1e-12
    mha = qkv.nn.MultiHeadAttention(32, 4, dtype=f64)
    x = torch.randn(2, n, 32, dtype=f64)
    lf = sparse.longformer(n, 8, 1)
    got, _ = mha(x, attn_mask=lf)
    want, _ = mha(x, attn_mask=lf.to_dense())
    assert torch.equal(got, want)


def test_pictures_and_facts():
    m = sparse.strided(128, 32, 2)
    s = m.to_string()
    assert s.splitlines()[1:] == ["█···", "██··", "███·", "·███"]
    assert "density" in repr(m) and str(m) == s
    big = sparse.bigbird(64 * 200, 64, 3, 1, 1)
    assert len(big.to_string(max_blocks=50).splitlines()) <= 51 and "one character" in big.to_string(max_blocks=50)


def test_bad_arguments():
    with pytest.raises(ValueError, match="window=-1"):
        sparse.longformer(10, -1)
    with pytest.raises(ValueError, match="outside 0..9"):
        sparse.longformer(10, 2, [12])
    with pytest.raises(ValueError, match="must be odd"):
        sparse.bigbird(100, 10, num_window_blocks=2)
    with pytest.raises(TypeError, match="bool tensor"):
        sparse.from_dense(torch.ones(4, 4), 2)
    q = torch.randn(1, 1, 10, 4)
    with pytest.raises(ValueError, match="BlockSparseMask for \\(12, 12\\)"):
        qkv.attention(q, q, q, attn_mask=sparse.longformer(12, 2))
