"""FlexAttention's whole contract through ``qkv.attention``: score functions written per element,
``mask_mod`` predicates and Flex's ``BlockMask``, on every backend that runs them, against Flex
itself (its eager path maps the functions per element with ``torch.vmap``) and the float64 oracle.

The functions are the kinds FlexAttention's documentation and attention-gym show — causal,
sliding window, document (packed sequences), prefix LM, per-head and per-batch rules, a bias read
per element from a captured tensor — written here for these tests.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import qkv
from qkv.sparse import from_block_mask, from_mask_mod, longformer

from ..helpers import LargestAllocation, assert_within_rule, make_qkv, max_err

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, N, D = 2, 4, 72, 16
BACKENDS = ["auto", "math", "chunked", "sdpa"]


def _flex(q, k, v, **kw):
    """Flex's own eager answer (float64 inputs: exact enough to be the reference for Flex's meaning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "called without torch.compile": expected here
        return flex.flex_attention(q, k, v, **kw)


def _docs(n: int = N, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (B, n), generator=g).sort(-1).values  # packed documents per batch entry


def _mask_mods() -> dict:
    docs = _docs()
    prefix = torch.tensor([10, 30])  # per batch entry: the prefix every token sees

    return {
        "causal": lambda b, h, i, j: i >= j,
        "sliding_window": lambda b, h, i, j: (i >= j) & (i - j <= 8),
        "document": lambda b, h, i, j: (docs[b, i] == docs[b, j]) & (i >= j),
        "document_per_element": lambda b, h, i, j: docs[b][i] == docs[b][j],  # indexing written per element
        "prefix_lm": lambda b, h, i, j: (j <= prefix[b]) | (i >= j),
        "per_head": lambda b, h, i, j: (i - j).abs() <= 4 * (h + 1),
        "nothing_for_some_rows": lambda b, h, i, j: (i % 5 != 0) & (j <= i),  # every fifth row is empty
    }


def _score_mods() -> dict:
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(B, N, generator=g, dtype=torch.float64)
    table = torch.randn(H, N, N, generator=g, dtype=torch.float64) * 0.3
    slopes = torch.rand(H, generator=g, dtype=torch.float64)
    return {
        "bias_per_batch_row": lambda s, b, h, i, j: s + bias[b][i],  # an IndexError if run on tiles
        "table_per_element": lambda s, b, h, i, j: s + table[h][i][j],
        "reduction": lambda s, b, h, i, j: s + 0.01 * table[h].sum(),  # sums one head's table per element
        "alibi": lambda s, b, h, i, j: s - slopes[h] * (i - j).abs(),
        "causal_as_score": lambda s, b, h, i, j: torch.where(i >= j, s, -float("inf")),
        "softcap": lambda s, b, h, i, j: 5.0 * torch.tanh(s / 5.0),
    }


def _inputs(dtype=torch.float64, requires_grad=False, hk=H, n=N):
    return make_qkv(B, H, hk, n, n, D, dtype=dtype, requires_grad=requires_grad, seed=3)


# ---- score functions written per element ----------------------------------------------------


@pytest.mark.parametrize("name", list(_score_mods()))
@pytest.mark.parametrize("backend", ["auto", "math", "chunked"])
def test_score_functions_written_per_element_mean_what_flex_computes(name, backend):
    fn = _score_mods()[name]
    q, k, v = _inputs(n=40)  # a function mapped per element costs a gather per score: a small call
    want = _flex(q, k, v, score_mod=fn)
    got = qkv.attention(q, k, v, score_mod=fn, backend=backend)
    assert max_err(got, want) < 1e-12, name
    assert max_err(torch.as_tensor(qkv.attention_ref(q, k, v, score_mod=fn)), want) < 1e-12


def test_a_function_that_is_wrong_on_tiles_is_mapped_per_element_from_then_on():
    """``table[h].sum()`` broadcasts on a tile but sums every head at once: the check on the
    tile's corner catches it, and the function is mapped with vmap (also for the next call)."""
    from qkv import elementwise

    table = torch.randn(H, 5, dtype=torch.float64)
    fn = lambda s, b, h, i, j: s + table[h].sum()  # noqa: E731
    s = torch.zeros(1, H, 3, 4, dtype=torch.float64)
    idx = (torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(H).view(1, H, 1, 1),
           torch.arange(3).view(1, 1, 3, 1), torch.arange(4).view(1, 1, 1, 4))  # fmt: skip
    out = elementwise.call_elementwise(fn, s.shape, s, *idx)
    assert torch.allclose(out, table.sum(-1).view(1, H, 1, 1).expand(s.shape))
    assert elementwise._verdict(fn) is False
    fine = lambda s, b, h, i, j: s + table[h, j]  # noqa: E731  broadcasts as it reads
    elementwise.call_elementwise(fine, s.shape, s, *idx)
    assert elementwise._verdict(fine) is True


def test_gradients_flow_through_a_per_element_function_into_what_it_reads():
    q, k, v = _inputs(requires_grad=True)
    bias = torch.randn(B, N, dtype=torch.float64, requires_grad=True)
    fn = lambda s, b, h, i, j: s + bias[b][i] * (j % 3)  # noqa: E731
    grads = {}
    for backend in ("math", "chunked"):
        out = qkv.attention(q, k, v, score_mod=fn, is_causal=True, backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
    # the same function written for the whole matrix, differentiated by autograd (Flex has no CPU backward)
    i, j = torch.arange(N).view(N, 1), torch.arange(N).view(1, N)
    s = q @ k.transpose(-1, -2) * D**-0.5 + bias.view(B, 1, N, 1) * (j % 3)
    dense = torch.softmax(s.masked_fill(j > i, -float("inf")), -1) @ v
    want = torch.autograd.grad(dense.square().sum(), (q, k, v, bias))
    for backend, got in grads.items():
        for g, w in zip(got, want):
            assert max_err(g, w) < 1e-10, backend


def test_gradients_into_a_16_bit_table_are_summed_in_float32():
    """A bfloat16 bias table read by a Python function: its gradient is summed in float32 and
    rounded once (Flex's way), not summed in bfloat16 as eager autograd would."""
    n = 128
    q, k, v = make_qkv(1, 2, 2, n, n, 16, dtype=torch.bfloat16, seed=4)
    table = (torch.randn(2, 2 * n - 1, generator=torch.Generator().manual_seed(5)) * 0.5).to(torch.bfloat16)
    t64 = table.double().requires_grad_()
    table.requires_grad_()
    dout = torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(6))
    fn = lambda s, b, h, i, j: s + table[h, j - i + n - 1]  # noqa: E731
    out64 = qkv.attention(q.double(), k.double(), v.double(), backend="math", score_mod=lambda s, b, h, i, j: s + t64[h, j - i + n - 1])
    (want,) = torch.autograd.grad(out64, t64, dout.double())
    errors = {}
    for backend in ("math", "chunked"):
        out = qkv.attention(q, k, v, score_mod=fn, backend=backend)
        (got,) = torch.autograd.grad(out, table, dout.to(out.dtype))
        assert got.dtype == torch.bfloat16
        errors[backend] = max_err(got, want)
    # eager autograd sums each diagonal's bfloat16 contributions in bfloat16
    s = (q.float() @ k.float().transpose(-1, -2)) * 16**-0.5
    tb = table.detach().clone().requires_grad_()
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None] + n - 1
    w = torch.softmax(s + tb[:, rel].float(), -1)
    (eager,) = torch.autograd.grad((w.to(torch.bfloat16) @ v).float(), tb, dout)
    for backend, err in errors.items():
        assert err * 4 < max_err(eager, want), (backend, err, max_err(eager, want))
        assert err <= 2 * 2**-8 * float(want.abs().max()) + 1e-6, (backend, err)


# ---- mask functions ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(_mask_mods()))
@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_functions_give_flexs_answer(name, backend):
    fn = _mask_mods()[name]
    q, k, v = _inputs()
    block_mask = flex.create_block_mask(fn, B, H, N, N, device="cpu", BLOCK_SIZE=16)
    want = _flex(q, k, v, block_mask=block_mask)
    if backend == "sdpa":  # torch's lse is not asked here (it refuses some of these calls' lse)
        out, lse = qkv.attention(q, k, v, mask_mod=fn, backend=backend), None
    else:
        out, lse = qkv.attention(q, k, v, mask_mod=fn, backend=backend, return_lse=True)
    assert max_err(out, want) < 1e-12, name
    assert max_err(qkv.attention(q, k, v, attn_mask=block_mask, backend=backend), want) < 1e-12  # Flex's BlockMask as given
    ref_out, ref_lse = qkv.attention_ref(q, k, v, mask_mod=fn, return_lse=True)
    assert max_err(out, torch.as_tensor(ref_out)) < 1e-12
    if lse is not None:  # empty rows: 0 and lse -inf, as qkv's contract says
        ref_lse = torch.as_tensor(ref_lse)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        finite = torch.isfinite(ref_lse)
        assert max_err(lse[finite], ref_lse[finite]) < 1e-12


@pytest.mark.parametrize("backend", ["math", "chunked"])
def test_mask_functions_combine_with_every_other_argument(backend):
    """mask_mod with causal alignment, a window, key padding, a bool and a float mask, a block-sparse
    layout, GQA and a score function — against the oracle, forward and backward."""
    fn = _mask_mods()["document"]
    q, k, v = make_qkv(B, H, 2, N - 8, N, D, dtype=torch.float64, requires_grad=True, seed=7)
    kp = torch.rand(B, N, generator=torch.Generator().manual_seed(8)) > 0.2
    bool_mask = torch.rand(1, H, N - 8, N, generator=torch.Generator().manual_seed(9)) > 0.3
    float_mask = torch.randn(B, 1, N - 8, N, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    score = lambda s, b, h, i, j: s + 0.1 * (h - b)  # noqa: E731
    cases = [
        dict(is_causal="bottom_right"),
        dict(window=(6, 2)),
        dict(key_padding_mask=kp, is_causal=True),
        dict(attn_mask=bool_mask),
        dict(attn_mask=float_mask, score_mod=score),
    ]
    for kw in cases:
        out = qkv.attention(q, k, v, enable_gqa=True, mask_mod=fn, backend=backend, **kw)
        ref_kw = dict(kw)
        want = qkv.attention_ref(q, k, v, enable_gqa=True, mask_mod=fn, **ref_kw)
        assert max_err(out, torch.as_tensor(want)) < 1e-12, kw
        g = torch.autograd.grad(out.sum(), (q, k, v))
        g_ref = torch.autograd.grad(qkv.attention(q, k, v, enable_gqa=True, mask_mod=fn, backend="math", **kw).sum(), (q, k, v))
        for a, b in zip(g, g_ref):
            assert max_err(a, b) < 1e-10, kw
    lay = longformer(N, window=12, global_tokens=1, block_size=8)  # a layout of qkv's own, ANDed with the function
    q2, k2, v2 = _inputs()
    out = qkv.attention(q2, k2, v2, attn_mask=lay, mask_mod=fn, backend=backend)
    want = qkv.attention_ref(q2, k2, v2, attn_mask=lay.to_dense(), mask_mod=fn)
    assert max_err(out, torch.as_tensor(want)) < 1e-12


def test_float32_mask_functions_are_within_the_rule():
    fn = _mask_mods()["sliding_window"]
    q, k, v = _inputs(dtype=torch.float32)
    ref = torch.as_tensor(qkv.attention_ref(q, k, v, mask_mod=fn))
    base = qkv.attention(q, k, v, mask_mod=fn, backend="math")
    for backend in ("auto", "chunked", "sdpa", "triton"):  # triton: on a CPU, Triton's interpreter
        assert_within_rule(qkv.attention(q, k, v, mask_mod=fn, backend=backend), base, ref, torch.float32, what=backend)


def test_a_mask_function_builds_no_nq_by_nk_mask_on_the_cpu():
    """The function becomes blocks (evaluated a few million pairs at a time) that the tile walk
    follows: neither the layout nor the call holds an Nq × Nk mask, forward or backward."""
    n = 2048
    q, k, v = make_qkv(1, 1, 1, n, n, 16, dtype=torch.float32, requires_grad=True, seed=11)
    window = lambda b, h, i, j: (i >= j) & (i - j < 128)  # noqa: E731
    with LargestAllocation() as big:
        out = qkv.attention(q, k, v, mask_mod=window)
        out.sum().backward()
    assert big.biggest < n * n // 4, big.biggest
    ref = qkv.attention(q.detach().double(), k.detach().double(), v.detach().double(), window=(127, 0), is_causal=True)
    assert max_err(out, ref) < 1e-5


def test_a_layout_built_once_is_reused_like_flexs_block_mask():
    fn = _mask_mods()["prefix_lm"]
    built = from_mask_mod(fn, B, None, N, N, block_size=16)
    assert built.layout.shape == (B, 1, 5, 5)  # the function reads the batch, not the head
    q, k, v = _inputs()
    want = _flex(q, k, v, block_mask=flex.create_block_mask(fn, B, None, N, N, device="cpu", BLOCK_SIZE=16))
    for _ in range(2):
        assert max_err(qkv.attention(q, k, v, attn_mask=built), want) < 1e-12
    converted = from_block_mask(flex.create_block_mask(fn, B, None, N, N, device="cpu", BLOCK_SIZE=16))
    assert torch.equal(converted.to_dense(), built.to_dense())


def test_bad_mask_functions_are_refused_with_the_argument_named():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 8)
    with pytest.raises(TypeError, match="mask_mod must be callable"):
        qkv.attention(q, k, v, mask_mod=3)
    with pytest.raises(TypeError, match="four positional arguments"):
        qkv.attention(q, k, v, mask_mod=lambda b, h, i: i >= 0)
    with pytest.raises(TypeError, match="mask_mod returned torch.float32 values; it must return bool"):
        qkv.attention(q, k, v, mask_mod=lambda b, h, i, j: (i - j).float())
    with pytest.raises(ValueError, match="cannot combine a BlockSparseMask"):
        from_mask_mod(lambda b, h, i, j: i >= j, None, None, 8) & from_mask_mod(lambda b, h, i, j: i >= j, None, None, 8, block_size=4)


@pytest.mark.parametrize("shape", [(0, 2, 8, 8), (1, 0, 8, 8), (1, 2, 0, 8), (1, 2, 8, 0)], ids=str)
def test_empty_sizes_with_per_element_functions(shape):
    """Nothing to call a function on (vmap needs an element): empty results, rows with no key 0."""
    b, h, nq, nk = shape
    q, k, v = torch.randn(b, h, nq, 4), torch.randn(b, h, nk, 4), torch.randn(b, h, nk, 4)
    table = torch.randn(h, max(nq + nk - 1, 1))
    fn = lambda s, bb, hh, i, j: s + table[hh][j - i + nq - 1]  # noqa: E731  per element only
    mask = lambda bb, hh, i, j: (i + j) % 3 != 1  # noqa: E731
    for backend in ("math", "chunked", "auto"):
        out = qkv.attention(q, k, v, score_mod=fn, mask_mod=mask, backend=backend)
        assert out.shape == (b, h, nq, 4) and not out.abs().sum()
        # an empty output of a differentiable call is still in the graph (found by the long fuzz:
        # seed 1875211854, case 18962, where the math path's empty scores lost it)
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = qkv.attention(qg, kg, v, score_mod=fn, is_causal=True, backend=backend)
        assert out.requires_grad, backend
        out.sum().backward()
        assert qg.grad.shape == qg.shape and not qg.grad.abs().sum()


def test_per_element_functions_under_torch_func_transforms():
    """torch.vmap cannot run inside the tile loops' autograd.Function under a transform: chunked
    says so by name, and auto takes math, which gives the same gradient as loss.backward()."""
    q, k, v = _inputs(n=24)
    bias = torch.randn(B, 24, dtype=torch.float64)
    fn = lambda s, b, h, i, j: s + bias[b][i]  # noqa: E731
    loss = lambda q_, backend: qkv.attention(q_, k, v, score_mod=fn, backend=backend).square().sum()  # noqa: E731
    with pytest.raises(qkv.BackendError, match="written per element"):
        torch.func.grad(lambda q_: loss(q_, "chunked"))(q)
    got = torch.func.grad(lambda q_: loss(q_, "auto"))(q)
    leaf = q.clone().requires_grad_()
    loss(leaf, "chunked").backward()
    assert max_err(got, leaf.grad) < 1e-10
