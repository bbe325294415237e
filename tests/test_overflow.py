"""Finite inputs whose scores leave float32's range (qkv.overflow): ``auto`` answers exactly (in
float64, rounded back), a named backend refuses by name, and the non-finite rule's NaN rows stay
NaN. Each case is checked against the float64 oracle on the rounded inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv.inspect import attention_with_stats
from qkv.reference import attention_ref
from qkv.score_mods import ALiBi, RelativeBias

from .helpers import DEVICE, FLOOR

F32_MAX = float(torch.finfo(torch.float32).max)


def _inputs(dtype, nq=5, nk=7, d=8, hq=2, hk=2, sigma=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, d, generator=g, dtype=torch.float64) for h, n in ((hq, nq), (hk, nk), (hk, nk)))
    return (q * sigma).to(dtype), (k * sigma).to(dtype), v.to(dtype)


def _ref(q, k, v, **kw):
    kw = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
    out, lse = attention_ref(q.double(), k.double(), v.double(), return_lse=True, **kw)
    return np.asarray(out), np.asarray(lse)


def _check(out, lse, ref_out, ref_lse, dtype):
    """Output within rounding of the oracle; lse equal where float32 holds it, ±inf beyond."""
    got = out.double().numpy()
    assert np.isfinite(got).all(), "NaN or inf where the exact answer is finite"
    assert np.abs(got - ref_out).max() <= 2 * FLOOR[dtype] * max(1.0, np.abs(ref_out).max())
    beyond = np.abs(ref_lse) > F32_MAX
    assert np.array_equal(np.isposinf(lse.numpy()), beyond & (ref_lse > 0))
    inside = ~beyond
    assert np.allclose(lse.double().numpy()[inside], ref_lse[inside], rtol=1e-6, atol=0)


CASES = {
    "scale 3e38": dict(kw={"scale": 3e38}),
    "scale -3e38, causal": dict(kw={"scale": -3e38, "is_causal": True}),
    "values of 1e20": dict(sigma=1e20),
    "a decoding call (1 row, 600 keys)": dict(kw={"scale": 3e38}, nq=1, nk=600, hq=4, hk=2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_auto_answers_exactly_where_float32_scores_overflow(case, dtype):
    c = CASES[case]
    if dtype == torch.float16 and "sigma" in c:
        pytest.skip("float16 holds no value of 1e20")
    q, k, v = _inputs(dtype, **{n: c[n] for n in ("nq", "nk", "hq", "hk", "sigma") if n in c})
    kw = {**c.get("kw", {}), "enable_gqa": True}
    ref_out, ref_lse = _ref(q, k, v, **kw)
    assert np.isfinite(ref_out).all()
    out, lse = qkv.attention(q, k, v, return_lse=True, **kw)
    _check(out, lse, ref_out, ref_lse, dtype)
    plain = qkv.attention(q, k, v, **kw)  # the fast path of a plain call, too
    assert torch.equal(plain, out)


@pytest.mark.parametrize("backend", ["math", "sdpa", "chunked"])
def test_a_named_backend_refuses_by_name(backend):
    q, k, v = _inputs(torch.float32)
    with pytest.raises(qkv.BackendError, match=r"leave float32's range.*backend='auto' answers such calls in float64"):
        qkv.attention(q, k, v, scale=3e38, backend=backend)
    q, k, v = _inputs(torch.float32, nq=1, nk=600)  # the decoding kernel
    if backend != "sdpa":
        with pytest.raises(qkv.BackendError, match="leave float32's range"):
            qkv.attention(q, k, v, scale=3e38, backend=backend)


def test_gradients_flow_through_the_float64_answer():
    q, k, v = (t.requires_grad_(True) for t in _inputs(torch.float32))
    ref = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    w = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(1))
    (qkv.attention(q, k, v, scale=1e37) * w).sum().backward()
    (qkv.attention(*ref, scale=1e37, backend="math") * w.double()).sum().backward()
    for t, r in zip((q, k, v), ref):
        assert t.grad is not None and t.grad.dtype == torch.float32
        # a gradient beyond float32's range is ±inf; every other entry equals float64's, rounded
        big = r.grad.abs() > F32_MAX
        assert torch.equal(torch.isinf(t.grad), big)
        assert torch.allclose(t.grad[~big].double(), r.grad[~big], rtol=1e-6, atol=1e-30)


def test_under_torch_func_grad():
    q, k, v = _inputs(torch.float32)
    g = torch.func.grad(lambda q: qkv.attention(q, k, v, scale=3e38).sum())(q)
    assert torch.isfinite(g).all()


def test_nan_rows_of_the_rule_stay_nan_and_the_others_are_exact():
    q, k, v = _inputs(torch.float32)
    q[0, 1, 2, 3] = float("nan")  # row (head 1, query 2) is NaN by the non-finite rule
    out, lse = qkv.attention(q, k, v, scale=3e38, return_lse=True)
    assert torch.isnan(out[0, 1, 2]).all() and torch.isnan(lse[0, 1, 2])
    keep = torch.ones(5, dtype=torch.bool)
    keep[2] = False
    ref_out, _ = _ref(q, k, v, scale=3e38)
    assert np.isfinite(out[0, 0].numpy()).all() and np.isfinite(out[0, 1, keep].numpy()).all()
    assert np.abs(out[0, 0].double().numpy() - ref_out[0, 0]).max() < 1e-6


def test_a_nan_that_float64_gives_too_is_the_answer_not_a_refusal():
    q, k, v = _inputs(torch.float32)
    mask = torch.zeros(5, 7)
    mask[1, 3] = float("nan")  # a float mask is part of the scores: row 1 is NaN by the formula
    for backend in ("auto", "math", "chunked"):
        out = qkv.attention(q, k, v, attn_mask=mask, backend=backend)
        assert torch.isnan(out[0, :, 1]).all() and torch.isfinite(out[0, :, [0, 2, 3, 4]]).all()


def test_alibi_slopes_whose_bias_overflows():
    q, k, v = _inputs(torch.float32, nq=9, nk=9)
    slopes = torch.tensor([1e36, 3e37])  # finite in float32; slope × offset is not
    for symmetric_sign in (1.0, -1.0):
        mod = ALiBi(slopes * symmetric_sign)
        ref_out, ref_lse = _ref(q, k, v, score_mod=ALiBi(slopes.double() * symmetric_sign))
        out, lse = qkv.attention(q, k, v, score_mod=mod, return_lse=True)
        _check(out, lse, ref_out, ref_lse, torch.float32)


def test_statistics_of_a_call_whose_scores_overflow():
    q, k, v = _inputs(torch.float32)
    out, stats = attention_with_stats(q, k, v, scale=3e38)
    ref_out, ref_lse = _ref(q, k, v, scale=3e38)
    _check(out, stats.lse, ref_out, ref_lse, torch.float32)
    assert stats.entropy.dtype == torch.float32 and torch.isfinite(stats.entropy).all()
    assert torch.allclose(stats.max_weight, torch.ones_like(stats.max_weight))  # one key takes each row


def test_a_backward_that_would_overflow_is_answered_in_float64_before_it_runs():
    """A softcap bounds the scores its forward returns, not the raw ones its derivative reads:
    the forward is finite, the float32 backward would not be. With gradients the call is
    checked before it runs (qkv.overflow.scores_may_overflow)."""
    from qkv.score_mods import Softcap

    q, k, v = _inputs(torch.float32)
    for kw in ({"scale": -3e38, "score_mod": Softcap(0.5)}, {"scale": 1e30}):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = [t.double().requires_grad_(True) for t in (q, k, v)]
        qkv.attention(*leaves, **kw).sum().backward()
        ref_kw = {**kw, "score_mod": Softcap(0.5)} if "score_mod" in kw else kw
        qkv.attention(*ref, backend="math", **ref_kw).sum().backward()
        for t, r in zip(leaves, ref):
            big = r.grad.abs() > F32_MAX
            assert torch.equal(torch.isinf(t.grad), big) and not torch.isnan(t.grad).any()
            assert torch.allclose(t.grad[~big].double(), r.grad[~big], rtol=1e-6, atol=1e-30)
        if "score_mod" in kw:  # (a scale of 1e30 on these values stays inside the bound: no float64 needed)
            for backend in ("chunked", "math"):
                with pytest.raises(qkv.BackendError, match="or its backward's products"):
                    qkv.attention(*(t.clone().requires_grad_(True) for t in (q, k, v)), backend=backend, **kw)
    plain = [t.clone().requires_grad_(True) for t in (q, k, v)]  # an ordinary call is not touched
    assert not qkv.overflow.scores_may_overflow(plain[0], plain[1], 0.35)


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 1e10), (torch.float32, 1e30), (torch.float64, 1e20)])
def test_sdpa_refuses_gradients_whose_recomputed_weights_drift(dtype, scale):
    """torch's CPU backward recomputes exp(score - lse) from scores rounded in another order than
    its forward's: far below float32's range it already gives NaN gradients from finite inputs
    (a fuzz case: seed 960800960, case 1055). The named ``sdpa`` backend refuses such calls;
    ``auto`` and ``chunked`` answer them, here with the oracle's gradient."""
    q, k, v = _inputs(dtype, nq=32, nk=32, d=16)
    k = k + 2.0  # one key wins every row by a wide margin
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, scale=scale)
    out.sum().backward()
    assert any(torch.isnan(t.grad).any() for t in leaves)  # what torch gives, and qkv must not
    with pytest.raises(qkv.BackendError, match="recomputes each weight"):
        qkv.attention(*(t.clone().requires_grad_(True) for t in (q, k, v)), scale=scale, backend="sdpa")
    ref = [t.to(torch.float64, copy=True).requires_grad_(True) for t in (q, k, v)]
    qkv.attention(*ref, scale=scale, backend="math").sum().backward()
    for backend in ("auto", "chunked"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        qkv.attention(*leaves, scale=scale, backend=backend).sum().backward()
        for t, r in zip(leaves, ref):
            assert torch.isfinite(t.grad).all()
            assert torch.allclose(t.grad.double(), r.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # without gradients the forward alone runs, and is exact
        qkv.attention(q, k, v, scale=scale, backend="sdpa")


# ---- a row is empty because its masks leave it no key, never because its scores overflowed ----

ROUNDS_TO_MINUS_INF = dict(  # every float32 score of the row is below -3.4e38: the oracle gives [1, 0]
    q=[[[[1e20, 0.0]]]], k=[[[[-1e20, 0.0], [-2e20, 0.0]]]], v=[[[[1.0, 0.0], [0.0, 1.0]]]]
)


def _rounding_row(dtype=torch.float32, grad=False):
    return [torch.tensor(ROUNDS_TO_MINUS_INF[n], dtype=dtype).requires_grad_(grad) for n in "qkv"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_whose_every_score_rounds_to_minus_inf_is_answered_not_emptied(dtype):
    q, k, v = _rounding_row(dtype)
    ref_out, ref_lse = _ref(q, k, v)
    assert np.array_equal(ref_out.ravel(), [1.0, 0.0]) and ref_lse.ravel()[0] < -F32_MAX
    assert torch.equal(qkv.attention(q, k, v).float(), torch.tensor([[[[1.0, 0.0]]]]))  # the fast path (torch SDPA gave 0)
    out, lse = qkv.attention(q, k, v, return_lse=True)  # the lse lies beyond float32's range: -inf, as any overflow
    assert torch.equal(out.float(), torch.tensor([[[[1.0, 0.0]]]])) and torch.isneginf(lse).all()
    kp = torch.tensor([[True, True], [False, True], [False, False]])  # the last batch entry is empty by its mask
    out = qkv.attention(q.expand(3, 1, 1, 2), k.expand(3, 1, 2, 2), v.expand(3, 1, 2, 2), key_padding_mask=kp)
    assert torch.equal(out[:, 0, 0].float(), torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    qs, ks, vs = (t * s for t, s in zip(_rounding_row(dtype), (0.1, 0.1, 1.0)))  # scores of -7e37 and -1.4e38 ...
    qs = qs.expand(1, 1, 2, 2)
    mask = torch.tensor([[-3e38, -3e38], [-3e38, float("-inf")]])  # ... that a float mask's -3e38 carries past float32
    assert np.array_equal(_ref(qs, ks, vs, attn_mask=mask)[0].ravel(), [1.0, 0.0, 1.0, 0.0])
    assert torch.equal(qkv.attention(qs, ks, vs, attn_mask=mask).float(), torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]]))
    with pytest.raises(qkv.BackendError, match="rounds to -inf"):
        qkv.attention(qs, ks, vs, attn_mask=mask, backend="math")
    g = torch.Generator().manual_seed(0)  # a decoding call: one row against 600 keys (the CPU decoding kernel)
    q = torch.zeros(1, 1, 1, 8).index_fill(-1, torch.tensor([0]), 1e20).to(dtype)
    k = torch.zeros(1, 1, 600, 8)
    k[..., 0] = -1e20 * (1 + torch.rand(1, 1, 600, generator=g))  # every score between -2e40 and -1e40
    k, v = k.to(dtype), torch.randn(1, 1, 600, 8, generator=g).to(dtype)
    ref_out, _ = _ref(q, k, v)
    for backend in ("auto", "chunked"):
        if backend == "auto":
            assert torch.equal(qkv.attention(q, k, v).double(), torch.from_numpy(ref_out).to(dtype).double())
        else:
            with pytest.raises(qkv.BackendError, match="rounds to -inf"):
                qkv.attention(q, k, v, backend=backend)


def test_gradients_of_a_row_whose_scores_round_to_minus_inf():
    """With gradients the bound is checked before the call runs (also at a small scale, where the
    products q·k, which the C tiles compute before the scale, overflow and the scores do not)."""
    for scale in (None, 1e-10):
        q, k, v = _rounding_row(grad=True)
        out = qkv.attention(q, k, v, scale=scale)
        assert torch.equal(out.detach(), torch.tensor([[[[1.0, 0.0]]]]))
        (out * torch.tensor([2.0, 3.0])).sum().backward()
        assert torch.equal(v.grad, torch.tensor([[[[2.0, 3.0], [0.0, 0.0]]]])), scale  # all the weight on the first key
        assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k))  # one-hot weights


@pytest.mark.parametrize("backend", ["math", "chunked", "sdpa", "triton"])
def test_a_named_backend_refuses_a_row_whose_scores_round_to_minus_inf(backend):
    q, k, v = (t.to(DEVICE) if backend == "triton" else t for t in _rounding_row())
    if backend == "triton" and DEVICE != "cpu":
        pytest.skip("on a GPU nothing is read back: the kernels' rows are returned as computed")
    for grad in (False, True):
        with pytest.raises(qkv.BackendError, match=r"an empty row of zeros where every score rounds to -inf.*backend='auto'"):
            qkv.attention(*(t.clone().requires_grad_(grad) for t in (q, k, v)), backend=backend)


def test_rows_empty_by_their_masks_stay_empty_beside_huge_scores():
    """Huge scores and a masked row: float64 agrees the row is empty, so a named backend answers."""
    q, k, v = _inputs(torch.float32, sigma=1e18)  # scores up to ~1e37: past the bound, not past float32
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2] = False
    ref_out, _ = _ref(q, k, v, attn_mask=mask)
    for backend in ("auto", "math", "chunked", "sdpa"):
        out = qkv.attention(q, k, v, attn_mask=mask, backend=backend)
        assert (out[:, :, 2] == 0).all() and np.abs(out.double().numpy() - ref_out).max() < 1e-6, backend


# ---- one bad head: the non-finite rule marks it, the others are answered exactly ----

BAD_HEAD = {
    "ALiBi slope NaN": (lambda dt: ALiBi(torch.tensor([float("nan"), 0.5, 0.25], dtype=dt)), 0),
    "ALiBi slope inf": (lambda dt: ALiBi(torch.tensor([0.5, float("inf"), 0.25], dtype=dt)), 1),
    "RelativeBias entry NaN": (lambda dt: RelativeBias(_table(dt, bad=(1, 2))), 2),  # bucket 1: offset 1, reached
    "RelativeBias entry NaN, not reached": (lambda dt: RelativeBias(_table(dt, bad=(30, 0))), None),
}


def _table(dtype, bad):
    table = torch.linspace(-1, 1, 32 * 3, dtype=torch.float64).reshape(32, 3).to(dtype)
    table[bad] = float("nan")
    return table


@pytest.mark.parametrize("case", list(BAD_HEAD), ids=list(BAD_HEAD))
def test_one_bad_head_beside_overflowing_scores_leaves_the_others_exact(case):
    make, bad = BAD_HEAD[case]
    q, k, v = _inputs(torch.float32, hq=3, hk=3)
    ref_out, _ = _ref(q, k, v, scale=3e38, score_mod=make(torch.float64))
    nan_heads = np.isnan(ref_out).any(axis=(-1, -2))[0]
    assert nan_heads.tolist() == [h == bad for h in range(3)]  # the rule's NaN: the bad head whole, no other
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    for grad in (False, True):
        out = qkv.attention(*(leaves if grad else (q, k, v)), scale=3e38, score_mod=make(torch.float32))
        got = out.detach().double().numpy()
        assert np.array_equal(np.isnan(got).any(axis=(-1, -2))[0], nan_heads)
        good = ~nan_heads
        assert np.abs(got[0, good] - ref_out[0, good]).max() < 1e-6
    (out[0, good] * torch.randn(out[0, good].shape)).sum().backward()
    for t in leaves[1:]:  # each head reads its own keys and values
        assert torch.isfinite(t.grad[0, good]).all()
    for backend in ("math", "chunked"):
        with pytest.raises(qkv.BackendError, match="leave float32's range"):
            qkv.attention(q, k, v, scale=3e38, score_mod=make(torch.float32), backend=backend)
