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


# ---- the layout path: chunked and auto walk the blocks (no dense mask), against the oracle ------

from qkv.call import validate  # noqa: E402
from qkv.sparse import BlockSparseMask  # noqa: E402

from .helpers import LargestAllocation, assert_within_rule  # noqa: E402


def _grads(q, k, v, backend, mask, seed=3, **kw):
    """out, lse, dq, dk, dv of one call (random cotangents for out and lse; seeded)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = qkv.attention(q, k, v, attn_mask=mask, backend=backend, return_lse=True, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = (out.double() * torch.randn(out.shape, generator=g, dtype=f64)).sum()
    loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * torch.randn(lse.shape, generator=g, dtype=f64)).sum()
    loss.backward()
    return out, lse, q.grad, k.grad, v.grad


def _random_layout(shape, n, block, seed, p=0.3):
    """A layout without a rule, ``shape + (Bq, Bk)``, that differs by head / batch entry; row
    block 2 is empty everywhere (its rows see nothing)."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // block)
    lay = torch.rand(*shape, nb, nb, generator=g) < p
    lay |= torch.eye(nb, dtype=torch.bool)
    lay[..., 2, :] = False
    return BlockSparseMask(lay, (block, block), (n, n), None, "random")


def _cases():
    """(name, layout, hq, hk, extra kwargs): every shape the layout path must get right."""
    n = 300  # not a multiple of any block size below
    mask = torch.rand(2, 4, n, n, generator=torch.Generator().manual_seed(1)) > 0.93
    mask[..., 100:140, :] = False  # empty rows inside a block, and a whole empty row block with 32-blocks
    pad = torch.ones(2, n, dtype=torch.bool)
    pad[0, 250:] = False  # ragged lengths
    pad[1, ::7] = False  # and holes
    yield "bigbird", sparse.bigbird(n, 32, 3, 1, 2), 4, 4, {}
    yield "longformer (a rule inside the blocks)", sparse.longformer(n, 20, [0, 150], block_size=32), 4, 4, {}
    yield "strided causal", sparse.strided(n, 32, 3), 4, 4, {}
    yield "from_dense per batch and head", sparse.from_dense(mask, 32), 4, 4, {}
    yield "head-varying layout, empty row block", _random_layout((4,), n, 32, 2), 4, 4, {}
    yield "head-varying layout in 128-blocks", _random_layout((4,), n, 128, 6, p=0.5), 4, 4, {}
    yield "batch-varying layout (B, 1, ...)", _random_layout((2, 1), n, 64, 3), 4, 4, {}
    yield "GQA, layout per query head", _random_layout((4,), n, 32, 4), 4, 2, {"enable_gqa": True}
    yield "GQA, bigbird", sparse.bigbird(n, 64, 3, 1, 1), 4, 1, {"enable_gqa": True}
    yield "bigbird + key padding", sparse.bigbird(n, 32, 3, 1, 2), 4, 4, {"key_padding_mask": pad}
    yield "longformer + key padding", sparse.longformer(n, 20, 1, block_size=32), 4, 4, {"key_padding_mask": pad}
    yield "bigbird + causal", sparse.bigbird(n, 32, 3, 1, 2), 4, 4, {"is_causal": True}
    yield "from_dense + window", sparse.from_dense(mask[:, :1], 64), 4, 4, {"window": (40, 10)}


@pytest.mark.parametrize("backend", ["chunked", "auto"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradients"])
def test_layout_path_within_rule_of_the_oracle(backend, grad):
    torch.manual_seed(0)
    for name, layout, hq, hk, kw in _cases():
        n = layout.shape[0]
        q64, k64, v64 = (torch.randn(2, h, n, 16, dtype=f64) for h in (hq, hk, hk))
        dense = layout.to_dense()
        q, k, v = (t.float() for t in (q64, k64, v64))
        if not grad:
            with torch.no_grad():
                got = qkv.attention(q, k, v, attn_mask=layout, backend=backend, return_lse=True, **kw)
                base = qkv.attention(q, k, v, attn_mask=dense, backend="math", return_lse=True, **kw)
                ref = qkv.attention(q64, k64, v64, attn_mask=dense, backend="math", return_lse=True, **kw)
            whats = ["out", "lse"]
        else:
            got = _grads(q, k, v, backend, layout, **kw)
            base = _grads(q, k, v, "math", dense, **kw)
            ref = _grads(q64, k64, v64, "math", dense, **kw)
            whats = ["out", "lse", "dq", "dk", "dv"]
        assert torch.equal(torch.isneginf(got[1]), torch.isneginf(ref[1])), f"{name}: empty rows"
        for what, c, b, r in zip(whats, got, base, ref):
            if what == "lse":  # -inf where a row sees nothing, in both
                c, b, r = (torch.where(torch.isneginf(r), 0, t.double()) for t in (c, b, r))
            assert_within_rule(c, b, r, torch.float32, factor=3 if what.startswith("d") else 2, what=f"{backend} {name}: {what}")


def test_empty_row_blocks_give_zero_and_minus_inf():
    n = 200
    layout = _random_layout((), n, 32, 5)  # row block 2 (rows 64..95) sees nothing
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(3))
    for backend in ("chunked", "auto"):
        out, lse = qkv.attention(q, k, v, attn_mask=layout, backend=backend, return_lse=True)
        assert (out[:, :, 64:96] == 0).all() and torch.isneginf(lse[:, :, 64:96]).all()
        out.sum().backward()
        assert (q.grad[:, :, 64:96] == 0).all() and not torch.isnan(q.grad).any()
        q.grad = None
        with torch.no_grad():
            out, lse = qkv.attention(q, k, v, attn_mask=layout, backend=backend, return_lse=True)
        assert (out[:, :, 64:96] == 0).all() and torch.isneginf(lse[:, :, 64:96]).all()


def test_bfloat16_layout_within_rule():
    n = 256
    layout = sparse.longformer(n, 24, 2, block_size=32)
    q64, k64, v64 = (torch.randn(1, 4, n, 32, dtype=f64) for _ in range(3))
    q, k, v = (t.bfloat16() for t in (q64, k64, v64))
    ref = _grads(*(t.double() for t in (q, k, v)), "math", layout.to_dense())
    base = _grads(q, k, v, "math", layout.to_dense())
    for backend in ("chunked", "auto"):
        got = _grads(q, k, v, backend, layout)
        for what, c, b, r in zip(["out", "lse", "dq", "dk", "dv"], got, base, ref):
            assert_within_rule(c, b, r, torch.bfloat16, factor=3 if what.startswith("d") else 2, what=f"{backend}: {what}")


@pytest.mark.parametrize("backend", ["chunked", "auto"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradients"])
def test_layout_path_builds_no_dense_mask(backend, grad):
    """The layout reaches the tile loops: no tensor of Nq × Nk elements (or a quarter of it) is made."""
    n = 2048
    layout = sparse.bigbird(n, 64, 3, 1, 2)
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=grad) for _ in range(3))
    with LargestAllocation() as big:
        out = qkv.attention(q, k, v, attn_mask=layout, backend=backend)
        if grad:
            out.sum().backward()
    assert big.biggest < n * n // 16, big.biggest
    with LargestAllocation() as big:  # the same with a rule inside the blocks and key padding
        pad = torch.ones(1, n, dtype=torch.bool)
        pad[:, -100:] = False
        out = qkv.attention(q, k, v, attn_mask=sparse.longformer(n, 64, 1, block_size=64), key_padding_mask=pad, backend=backend)
        if grad:
            out.sum().backward()
    assert big.biggest < n * n // 16, big.biggest


def test_the_call_keeps_the_layout_and_densifies_only_when_asked():
    n = 96
    layout = sparse.longformer(n, 8, 1, block_size=32)
    q = torch.randn(2, 3, n, 8)
    call = validate(q, q, q, attn_mask=layout)
    assert call.block_sparse is layout and call.given_mask is None and call.has_attn_mask and call.bool_mask
    assert "block-sparse" in call.describe() and call.given_mask is None
    assert torch.equal(call.attn_mask, layout.to_dense())  # the dense mask, built on first use
    assert call.attn_mask is call.given_mask  # and once
    with pytest.raises(ValueError, match="layout \\(5, 3, 3\\)"):
        validate(q, q, q, attn_mask=BlockSparseMask(torch.ones(5, 3, 3, dtype=torch.bool), (32, 32), (n, n)))


@pytest.mark.parametrize("shape", [(0, 2, 40, 8), (1, 2, 40, 0), (1, 0, 40, 8)], ids=["batch 0", "head dim 0", "heads 0"])
def test_empty_sizes_on_the_layout_path(shape):
    layout = sparse.bigbird(40, 16, 1, 1, 1)
    for grad in (False, True):
        q = torch.randn(shape, requires_grad=grad)
        got = qkv.attention(q, q, q, attn_mask=layout, backend="chunked", return_lse=True)
        want = qkv.attention(q, q, q, attn_mask=layout.to_dense(), backend="math", return_lse=True)
        assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want))
        if grad and q.numel():
            got[0].sum().backward()
            assert q.grad.shape == q.shape


@pytest.mark.parametrize("nq, nk", [(0, 40), (40, 0), (0, 0)])
def test_layouts_over_no_query_rows_or_no_keys(nq, nk):
    """A layout with no blocks in one direction: described, densified, and walked (no rows to walk)."""
    for layout in (sparse.from_dense(torch.ones(2, 1, nq, nk, dtype=torch.bool), 16),
                   sparse.from_mask_mod(lambda b, h, i, j: i >= j, 2, 1, nq, nk, block_size=16)):  # fmt: skip
        assert layout.to_string().startswith(f"{layout.name}: {nq}×{nk}") and layout.density == 0.0
        assert layout.to_dense().shape[-2:] == (nq, nk)
        q, k = torch.randn(2, 1, nq, 8, requires_grad=True), torch.randn(2, 1, nk, 8, requires_grad=True)
        out, lse = qkv.attention(q, k, k, attn_mask=layout, backend="chunked", return_lse=True)
        assert out.shape == (2, 1, nq, 8) and (out == 0).all() and torch.isneginf(lse).all()
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and (k.grad == 0).all()


@pytest.mark.parametrize("value", [True, False], ids=["True", "False"])
def test_a_mask_function_returning_a_constant_is_every_pair_or_none(value):
    """FlexAttention takes a mask_mod returning a Python bool (or a 0-d tensor, as its noop_mask)."""
    for fn in (lambda b, h, i, j: value, lambda b, h, i, j: b.new_full((), value, dtype=torch.bool)):
        layout = sparse.from_mask_mod(fn, 2, 3, 40, 50, block_size=16)
        assert layout.layout.shape[-2:] == (3, 4) and bool(layout.layout.all()) is value  # (batch and heads broadcast)
        assert torch.equal(layout.to_dense().expand(2, 3, 40, 50), torch.full((2, 3, 40, 50), value))
    with pytest.raises(TypeError, match="mask_mod returned float; it must return a bool tensor"):
        sparse.from_mask_mod(lambda b, h, i, j: 1.0, 2, 3, 40, 50)


def test_nonfinite_inputs_follow_the_dense_mask_rule():
    layout = sparse.bigbird(96, 16, 1, 1, 1)
    q, k, v = (torch.randn(1, 2, 96, 8, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        k[0, 1, 5, 0] = float("nan")
        q[0, 0, 70, 2] = float("inf")
    for backend in ("chunked", "auto"):
        got = _grads(q, k, v, backend, layout)
        want = _grads(q, k, v, backend, layout.to_dense())
        for what, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, want):
            if what == "dq":  # the bad query row's own dq is the formula's, entry by entry (qkv.nonfinite)
                a, b = a[0, 0, torch.arange(96) != 70], b[0, 0, torch.arange(96) != 70]
            assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isinf(a), torch.isinf(b)), (backend, what, a.isnan().sum(), b.isnan().sum(), a.isinf().sum(), b.isinf().sum())


def test_auto_runs_a_large_layout_on_chunked_with_or_without_gradients():
    from qkv.backends import auto_order, order_notes, select

    n = 256
    layout = sparse.bigbird(n, 32, 3, 1, 1)
    for dtype in (torch.float32, f64):
        for grad in (False, True):
            q = torch.randn(1, 2, n, 8, dtype=dtype, requires_grad=grad)
            call = validate(q, q, q, attn_mask=layout)
            assert auto_order(call)[0].NAME == "chunked", (dtype, grad)
            assert select(call).NAME == "chunked"
            assert call.given_mask is None  # choosing built no dense mask
    assert any("block-sparse" in note for note in order_notes(call))


@pytest.mark.slow
def test_a_layout_under_torch_compile():
    layout = sparse.bigbird(256, 32, 3, 1, 1)
    q, k, v = (torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))
    f = torch.compile(lambda q, k, v: qkv.attention(q, k, v, attn_mask=layout))
    out = f(q, k, v)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    want = qkv.attention(q, k, v, attn_mask=layout.to_dense(), backend="math")
    g_want = torch.autograd.grad(want.sum(), (q, k, v))
    assert max_err(out, want) < 1e-5 and all(max_err(a, b) < 1e-5 for a, b in zip(g, g_want))
    with torch.no_grad():
        assert max_err(f(q, k, v), want) < 1e-5


# ---- mask functions built once: a loop of calls evaluates the function for the first only ------

import gc  # noqa: E402
import types  # noqa: E402
import weakref  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from .masks.evaluations import Evaluations  # noqa: E402


def _documents(n: int, count: int = 4) -> torch.Tensor:
    return torch.arange(n) * count // n  # token → document


def _same_doc_causal(doc: torch.Tensor):
    return lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j)


class _Ops(TorchDispatchMode):
    """The tensor operations issued inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_loop_of_mask_mod_calls_evaluates_the_function_once():
    """The layout (every pair) is found on the first call; later calls with the same function —
    or one made anew over the same, unchanged tensor — issue no tensor operation for it, and the
    chunked walk asks the function only about the pairs inside its computed blocks (its mask
    inside them, as Flex's kernel applies mask_mod in partial blocks)."""
    n = 512
    doc = _documents(n)
    q, k, v = (torch.randn(2, 2, n, 16) for _ in range(3))
    first = _same_doc_causal(doc)
    want = qkv.attention(q, k, v, attn_mask=sparse.from_mask_mod(first, 2, 2, n, cache=False).to_dense(), backend="math")
    with Evaluations(first) as ev:
        call = validate(q, k, v, mask_mod=first)
    assert ev.pairs >= n * n  # the layout: every pair once
    density = call.block_sparse.density
    for step in range(4):
        fn = _same_doc_causal(doc)  # made anew each step, as in a training loop
        with Evaluations(fn) as ev:
            validate(q, k, v, mask_mod=fn)
        assert ev.calls == 0, step
        with _Ops() as with_mask:
            validate(q, k, v, mask_mod=fn)
        with _Ops() as without:
            validate(q, k, v)
        assert with_mask.ops == without.ops  # the mask function costs no tensor operation
        with Evaluations(fn) as ev:
            out = qkv.attention(q, k, v, mask_mod=fn, backend="chunked")
        assert 0 < ev.pairs <= density * n * n, (ev.pairs, density * n * n)  # inside the computed blocks only
        assert max_err(out, want) < 1e-5


def test_a_changed_tensor_value_or_shape_builds_the_layout_anew():
    n = 256
    doc = _documents(n)
    fn = _same_doc_causal(doc)

    def check(fn, *args, **kw):
        got = sparse.from_mask_mod(fn, *args, **kw)
        fresh = sparse.from_mask_mod(fn, *args, cache=False, **kw)
        assert torch.equal(got.layout, fresh.layout) and torch.equal(got.to_dense(), fresh.to_dense())
        return got

    a = check(fn, 1, 2, n)
    assert sparse.from_mask_mod(fn, 1, 2, n).layout is a.layout  # kept
    doc[: n // 2] = 0  # edited in place: two documents become one
    b = check(fn, 1, 2, n)
    assert b.layout is not a.layout and not torch.equal(b.layout, a.layout)
    other = _documents(n, 8)
    assert not torch.equal(check(_same_doc_causal(other), 1, 2, n).layout, b.layout)  # the same code over another tensor
    for args, kw in [((2, 2, n), {}), ((1, 4, n), {}), ((1, 2, n - 64, n), {}), ((1, 2, n), {"block_size": 32})]:
        found = check(fn, *args, **kw)
        assert found.layout is not b.layout
    windows = [check(lambda b, h, i, j, w=w: (i - j).abs() <= w, None, None, n) for w in (10, 100)]
    assert not torch.equal(windows[0].layout, windows[1].layout)  # a default value is part of the key
    b.layout[0, 0] = ~b.layout[0, 0]  # the returned layout edited in place: built anew next time
    assert sparse.from_mask_mod(fn, 1, 2, n).layout is not b.layout


def test_a_function_reading_tensors_its_key_cannot_name_is_evaluated_every_call():
    """A tensor reached where the key does not look (an attribute looked up by a name made at
    run time) is seen read while the layout is built: that layout is not kept."""
    n = 128
    holder = types.ModuleType("holder")
    holder.doc = _documents(n)
    name = "".join(["d", "oc"])
    fn = lambda b, h, i, j: getattr(holder, name)[i] == getattr(holder, name)[j]  # noqa: E731
    first = sparse.from_mask_mod(fn, None, None, n, block_size=32)
    assert first.key is None
    holder.doc = torch.zeros(n, dtype=torch.long)  # replaced where the key could not see
    with Evaluations(fn) as ev:
        again = sparse.from_mask_mod(fn, None, None, n, block_size=32)
    assert ev.calls > 0 and bool(again.layout.all()) and not bool(first.layout.all())


def _twice(dense: torch.Tensor) -> tuple[sparse.BlockSparseMask, sparse.BlockSparseMask]:
    fn = lambda b, h, i, j: dense[i, j]  # noqa: E731
    return sparse.from_mask_mod(fn, None, None, dense.shape[0]), sparse.from_mask_mod(fn, None, None, dense.shape[0])


def test_the_kept_layouts_hold_no_tensor_of_the_function():
    n = 256
    big = torch.zeros(n, n, dtype=torch.bool)  # a dense mask read by the function: not kept alive by the cache
    big.fill_diagonal_(True)
    alive = weakref.ref(big)
    first, again = _twice(big)
    assert first.key is not None and again.layout is first.layout
    del big, first, again
    gc.collect()
    assert alive() is None


def test_a_flex_block_mask_is_read_once():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    n = 256
    doc = _documents(n)
    block_mask = fa.create_block_mask(_same_doc_causal(doc), None, None, n, n, device="cpu", BLOCK_SIZE=64)
    q = torch.randn(1, 2, n, 16)
    layouts = [validate(q, q, q, attn_mask=block_mask).block_sparse for _ in range(3)]
    assert layouts[0].layout is layouts[1].layout is layouts[2].layout
    assert layouts[0].block_mask is block_mask
    block_mask.kv_num_blocks.zero_()  # edited in place: read again
    assert not bool(validate(q, q, q, attn_mask=block_mask).block_sparse.layout.any())
