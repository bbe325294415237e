"""Built-in score functions and sinks in the triton kernels, against the float64 oracle and ``math``.

Softcap, ALiBi (both alignments, symmetric too), T5's relative bias and sinks, alone and
together, forward and backward: out, lse and the gradients of q, k, v, of the function's
tensors (slopes, bias table) and of the sinks, judged by the tolerance rule as in
``test_triton.py`` (16-bit baselines round P and dS as the kernels do). Shapes stay small: on a
CPU the kernels run in Triton's interpreter with 16×16 tiles.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ..helpers import (
    DEVICE, FLOOR, INTERPRETED, SUBPROCESS_TIMEOUT, assert_within_rule, interpreted_subset, make_qkv, mask_kwargs, max_err, on_cpu, on_device,
)  # fmt: skip

pytest.importorskip("triton")

import qkv  # noqa: E402
from qkv.backends import BACKENDS, BackendError  # noqa: E402
from qkv.backends.math import softmax_with_lse  # noqa: E402
from qkv.call import validate  # noqa: E402
from qkv.masks.tiles import MaskTiles, apply_tile  # noqa: E402
from qkv.reference import attention_ref  # noqa: E402
from qkv.score_mods import ALiBi, RelativeBias, Softcap, alibi_slopes  # noqa: E402
from qkv.sinks import add_sinks, grouped_sinks  # noqa: E402

from .test_triton import _leaves  # noqa: E402

TRITON = BACKENDS["triton"]
pytestmark = [pytest.mark.device, pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")]

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# ---- score functions built from leaf tensors, so each run gets its own gradients ----------------


def _params(spec, hq: int) -> dict:
    """The learnable tensors of a case (float32, CPU): ``slopes``/``table`` and ``sinks``."""
    mod, with_sinks = spec
    p = {}
    if mod is not None and mod[0] == "alibi":
        p["slopes"] = alibi_slopes(hq) * (1 + torch.rand(hq))  # not all powers of two
    if mod is not None and mod[0] == "t5":
        p["table"] = torch.randn(8, hq)
    if with_sinks:
        p["sinks"] = torch.randn(hq)
        p["sinks"][0] = 1.5  # a sink that takes a good share of its rows
    return p


def _score_mod(mod, p: dict):
    if mod is None:
        return None
    if mod[0] == "softcap":
        return Softcap(mod[1])
    if mod[0] == "alibi":
        return ALiBi(p["slopes"], alignment=mod[1], symmetric=mod[2])
    return RelativeBias(p["table"], bidirectional=mod[1], max_distance=20)


class _RoundGrad(torch.autograd.Function):
    """Identity whose gradient is rounded to ``dtype``: the kernels' dS before dS·K and dSᵀ·Q."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).to(g.dtype), None


class _RoundValue(torch.autograd.Function):
    """``x`` rounded to ``dtype``, gradient passed through: the kernels' P before P·V and Pᵀ·dO."""

    @staticmethod
    def forward(ctx, x, dtype):
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _rounded(q, k, v, *, score_mod=None, sinks=None, **kw):
    """``(out, lse)`` computed as the kernels round (float32, P and dS rounded to the input
    dtype), differentiable in q, k, v and the function's tensors and sinks by autograd."""
    dt = q.dtype
    call = validate(q, k, v, return_lse=True, enable_gqa=True, score_mod=score_mod, sinks=sinks, **kw)
    qg, kg, vg = (t.float() for t in call.grouped_qkv())
    s = _RoundGrad.apply((qg @ kg.transpose(-1, -2)) * call.scale, dt)
    bound = call.bound_score()
    if bound is not None:
        s = bound.apply(s, 0, 0)
    s = apply_tile(s, *MaskTiles.from_call(call).tile(0, call.nq, 0, call.nk))
    p, lse = softmax_with_lse(s)
    if sinks is not None:
        p, lse = add_sinks(p, lse, grouped_sinks(sinks, call.hk, call.group))
    out = _RoundValue.apply(p, dt) @ vg
    return call.ungroup(out.to(dt)), call.ungroup(lse)


def _run(q, k, v, backend, kw, case_mod, params, grad=True):
    """out, lse and (with ``grad``) the gradients of q, k, v and of each tensor in ``params``
    (in its order) for a loss reaching out and lse; on the CPU. ``backend``: a qkv backend name
    (triton runs on the test device) or :func:`_rounded`."""
    if backend == "triton":
        q, k, v = _leaves(q, k, v, grad=grad)
        ps = dict(zip(params, _leaves(*params.values(), grad=grad)))
        kw = on_device(kw)
    else:
        q, k, v = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
        ps = {n: t.detach().clone().requires_grad_(grad) for n, t in params.items()}
    extra = dict(score_mod=_score_mod(case_mod, ps), sinks=ps.get("sinks"))
    if callable(backend):
        out, lse = backend(q, k, v, **extra, **kw)
    else:
        out, lse = qkv.attention(q, k, v, enable_gqa=True, backend=backend, return_lse=True, **extra, **kw)
    if not grad:
        return on_cpu((out, lse))
    g = torch.Generator().manual_seed(1)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    out_c, lse_c = out.cpu(), lse.cpu()
    loss = (out_c.double() * w_out).sum() + (torch.where(torch.isfinite(lse_c), lse_c, 0).double() * w_lse).sum()
    loss.backward()
    grads = [q.grad, k.grad, v.grad] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in ps.values()]
    return on_cpu((out.detach(), lse.detach(), *grads))


# (mask kind, score function, sinks, B, Hq, Hk, Nq, Nk, D, dtype, query scale)
CASES = [
    ("causal", ("softcap", 2.0), False, 1, 4, 2, 33, 17, 16, F32, 3.0),  # GQA, Nq > Nk, saturated scores
    ("none", ("softcap", 30.0), False, 1, 2, 1, 17, 33, 24, BF16, 1.0),  # the polynomial side of tanh
    ("none", ("alibi", "top_left", False), False, 1, 2, 2, 17, 40, 16, BF16, 1.0),
    ("bottom_right", ("alibi", None, False), False, 1, 4, 1, 17, 40, 32, F16, 1.0),  # follows is_causal
    ("window", ("alibi", "bottom_right", True), True, 1, 2, 2, 40, 33, 16, F32, 1.0),  # symmetric, sinks
    ("window", ("t5", True), False, 1, 2, 1, 33, 33, 16, BF16, 1.0),
    ("causal", ("t5", False), True, 2, 2, 2, 17, 24, 16, F32, 1.0),
    ("padding", None, True, 2, 2, 1, 17, 33, 16, F16, 1.0),  # sinks; batch 0 all padding: empty rows
    ("bottom_right", ("softcap", 1.5), True, 1, 2, 2, 40, 17, 16, F32, 2.0),  # sinks + softcap, empty rows
    ("bool_mask", ("softcap", 5.0), True, 1, 2, 1, 17, 20, 16, BF16, 2.0),
]


def _case_id(c) -> str:
    mod = "plain" if c[1] is None else "-".join(str(x) for x in c[1])
    return f"{c[0]}-{mod}{'-sinks' if c[2] else ''}-{c[3]}x{c[4]}/{c[5]}-{c[6]}x{c[7]}-{str(c[9])[6:]}"


@pytest.mark.parametrize("case", interpreted_subset(CASES), ids=_case_id)
def test_forward_backward_within_rule(case):
    kind, mod, with_sinks, b, hq, hk, nq, nk, d, dtype, qscale = case
    q64, k64, v64 = make_qkv(b, hq, hk, nq, nk, d, dtype=torch.float64)
    q64 = q64 * qscale
    kw = mask_kwargs(kind, b, hq, nq, nk, dtype)
    kw64 = {key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val) for key, val in kw.items()}
    params = _params((mod, with_sinks), hq)
    p64 = {n: t.double() for n, t in params.items()}
    ref_out, ref_lse = attention_ref(q64, k64, v64, enable_gqa=True, return_lse=True, score_mod=_score_mod(mod, p64),
                                     sinks=p64.get("sinks"), **kw64)  # fmt: skip
    ref_grads = _run(q64, k64, v64, "math", kw64, mod, p64)[2:]
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    base = _run(q, k, v, _rounded if dtype != torch.float32 else "math", kw, mod, params)
    got = _run(q, k, v, "triton", kw, mod, params)
    out, lse = got[:2]
    assert out.dtype == dtype and out.shape == (b, hq, nq, d) and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_within_rule(out, base[0], ref_out, dtype, what=f"out {case}")
    assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(ref_lse)), "lse = -inf exactly where the oracle's is"
    assert max_err(lse, ref_lse) <= 1e-5 * max(1, np.abs(ref_lse[np.isfinite(ref_lse)]).max(initial=1)) + FLOOR[dtype] * 10
    names = ["q", "k", "v", *params]
    for name, c, bse, r in zip(names, got[2:], base[2:], ref_grads):
        assert c.shape == r.shape and torch.isfinite(c).all(), name
        assert_within_rule(c, bse, r, dtype, factor=3.0, what=f"d{name} {case}")


def test_fully_masked_rows():
    """With sinks an empty row outputs 0 with lse = its sink; without, lse = -inf; every
    gradient stays finite, and an empty row's dlse reaches its sink."""
    q, k, v = _leaves(*make_qkv(2, 2, 1, 17, 20, 16, dtype=torch.float16), grad=True)
    mask = torch.rand(2, 2, 17, 20, device=DEVICE) > 0.5
    mask[:, :, 3] = False  # row 3 sees nothing
    kp = torch.ones(2, 20, dtype=torch.bool, device=DEVICE)
    kp[1] = False  # sequence 1 is all padding
    slopes, sinks = _leaves(alibi_slopes(2), torch.tensor([0.5, -1.0]), grad=True)
    out, lse = qkv.attention(q, k, v, attn_mask=mask, key_padding_mask=kp, enable_gqa=True, return_lse=True, backend="triton",
                             score_mod=ALiBi(slopes), sinks=sinks)  # fmt: skip
    assert not torch.isnan(out).any() and (out[:, :, 3] == 0).all() and (out[1] == 0).all()
    want = sinks.detach().view(2, 1).expand(2, 17)
    assert torch.equal(lse[1], want) and torch.equal(lse[0, :, 3], want[:, 0])
    (out.float().sum() + lse.sum()).backward()
    for t in (q, k, v, slopes, sinks):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 3] == 0).all() and (k.grad[1] == 0).all() and (v.grad[1] == 0).all()
    # each of batch 1's 17 empty rows gives its sink dlse = 1 (weight 1 on the sink, no output)
    q2, k2, v2, sl2, sk2 = (t.detach().cpu().requires_grad_(True) for t in (q, k, v, slopes, sinks))
    o2, l2 = qkv.attention(q2, k2, v2, attn_mask=mask.cpu(), key_padding_mask=kp.cpu(), enable_gqa=True, return_lse=True,
                           backend="math", score_mod=ALiBi(sl2), sinks=sk2)  # fmt: skip
    (o2.float().sum() + l2.sum()).backward()
    assert max_err(sinks.grad, sk2.grad) < 1e-3 and max_err(slopes.grad, sl2.grad) < 1e-2 * max(1.0, sl2.grad.abs().max().item())

    # no sinks: empty rows have lse = -inf, and the softcap's backward stays finite
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = qkv.attention(q, k, v, attn_mask=mask, key_padding_mask=kp, enable_gqa=True, return_lse=True, backend="triton",
                             score_mod=Softcap(1.0))  # fmt: skip
    assert torch.isneginf(lse[:, :, 3]).all() and torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    (out.float().sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v)) and (q.grad[1] == 0).all()


def test_sink_of_minus_inf_is_no_sink():
    q, k, v = _leaves(*make_qkv(1, 2, 2, 17, 17, 16))
    sinks = torch.tensor([float("-inf"), 0.0], device=DEVICE, requires_grad=True)
    out, lse = qkv.attention(q, k, v, is_causal=True, return_lse=True, backend="triton", sinks=sinks)
    plain, plain_lse = qkv.attention(q, k, v, is_causal=True, return_lse=True, backend="triton")
    assert torch.equal(out[:, 0], plain[:, 0]) and torch.equal(lse[:, 0], plain_lse[:, 0])
    (out.sum() + lse.sum()).backward()
    assert sinks.grad[0] == 0 and torch.isfinite(sinks.grad).all()


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from qkv.backends.triton.kernels import _tanh  # noqa: E402


@triton.jit
def _tanh_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, _tanh(tl.load(X + i)))


def test_tanh_accuracy():
    """The kernels' tanh against float64 over both of its branches: within 4 fp32 ulps (8 on a
    GPU, whose exp2 and division are approximate to ~2 ulps each)."""
    x = torch.cat([torch.linspace(-12, 12, 4096 - 1024), torch.linspace(-0.3, 0.3, 1023), torch.tensor([0.0])]).float()
    y = torch.empty_like(x, device=DEVICE)
    _tanh_kernel[(1,)](x.to(DEVICE), y, N=x.numel())
    want = torch.tanh(x.double())
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp(min=torch.finfo(torch.float32).tiny)
    err = ((y.cpu().double() - want).abs() / ulp).max().item()
    print(f"tanh: {err:.2f} ulps")
    assert err <= (4 if INTERPRETED else 8)


# ---- packed sequences ----------------------------------------------------------------------------


def _packed(lens_q, lens_k, hq, hk, d, dtype=torch.float32):
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lens_q), hq, d).to(dtype)
    k = torch.randn(sum(lens_k), hk, d).to(dtype)
    v = torch.randn(sum(lens_k), hk, d).to(dtype)
    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize(
    "mod, kw",
    interpreted_subset([
        (("alibi", None, False), {"is_causal": True}),  # bottom-right per sequence, as FlashAttention's ALiBi
        (("t5", True), {"is_causal": "top_left"}),
        (("softcap", 1.5), {"window": (3, 1)}),
    ], args=2),
    ids=["alibi-causal", "t5-top_left", "softcap-window"],
)
def test_varlen_kernel_matches_per_sequence_loop(mod, kw):
    """The packed kernel (relative positions placed per sequence) against the per-sequence loop
    of ``math``, with sinks: out, lse and every gradient, float32."""
    hq = 4
    q, k, v, cq, ck = _packed([5, 0, 19, 9], [7, 3, 17, 21], hq, 2, 16)
    params = _params((mod, True), hq)
    res = {}
    for backend in ("math", "triton"):
        dev = DEVICE if backend == "triton" else "cpu"
        leaves = [t.detach().clone().to(dev).requires_grad_(True) for t in (q, k, v, *params.values())]
        ps = dict(zip(params, leaves[3:]))
        out, lse = qkv.attention_varlen(*leaves[:3], cq.to(dev), ck.to(dev), enable_gqa=True, return_lse=True, backend=backend,
                                        score_mod=_score_mod(mod, ps), sinks=ps["sinks"], **kw)  # fmt: skip
        g = torch.Generator().manual_seed(2)
        w = torch.randn(out.shape, generator=g)
        (out.cpu() * w).sum().backward(retain_graph=True)
        torch.where(torch.isfinite(lse), lse, 0).sum().backward()
        res[backend] = [out, lse] + [t.grad for t in leaves]
    for name, a, b in zip(["out", "lse", "q", "k", "v", *params], res["math"], res["triton"]):
        assert max_err(b, a) <= 2e-5 * max(1.0, a.abs().max().item()), name


def test_varlen_python_score_mod_gets_the_sequence_index():
    q, k, v, cq, ck = _packed([3, 5, 4], [6, 2, 5], 2, 2, 16)
    table = torch.randn(3, requires_grad=True)
    seen = set()

    def by_sequence(score, batch, head, q_idx, kv_idx):
        seen.update(batch.flatten().tolist())
        return score + table[batch]

    out = qkv.attention_varlen(q, k, v, cq, ck, backend="math", score_mod=by_sequence)
    out.sum().backward()
    assert seen == {0, 1, 2} and table.grad is not None
    for s, (a, b, c, e) in enumerate(zip(cq[:-1], cq[1:], ck[:-1], ck[1:])):
        want = qkv.attention(q[a:b].transpose(0, 1), k[c:e].transpose(0, 1), v[c:e].transpose(0, 1), backend="math",
                             score_mod=lambda sc, *_: sc + table[s].detach())  # fmt: skip
        assert max_err(out[a:b].transpose(0, 1), want) < 1e-6
    chunked = qkv.attention_varlen(q, k, v, cq, ck, backend="chunked", score_mod=by_sequence)  # tensors found through the wrapper
    table.grad = None
    chunked.sum().backward()
    assert table.grad is not None and max_err(chunked, out) < 1e-5
    with pytest.raises(BackendError, match="Python score_mod"):
        qkv.attention_varlen(*on_device((q, k, v, cq, ck)), backend="triton", score_mod=by_sequence)


# ---- capabilities and GPU lowering -----------------------------------------------------------------


def test_reasons():
    q, k, v = _leaves(*make_qkv(1, 2, 2, 4, 4, 8))
    for mod in (Softcap(20.0), ALiBi(alibi_slopes(2)), RelativeBias(torch.zeros(8, 2))):
        assert TRITON.not_supported_reasons(validate(q, k, v, score_mod=mod, sinks=torch.zeros(2, device=DEVICE))) == []
    reasons = TRITON.not_supported_reasons(validate(q, k, v, score_mod=lambda s, b, h, i, j: s * 2))
    assert len(reasons) == 1 and "Python score_mod" in reasons[0]


_COMPILE_SCRIPT = r"""
from qkv.backends.triton.lowering import compile_all

flags = dict(BOTTOM_RIGHT=True, HAS_LO=True, HAS_HI=False, HAS_KP=False, HAS_MASK=False, MASK_BOOL=False,
             SOFTCAP=True, HAS_REL=True, HAS_SINKS=True, REL_GRAD=True, HAS_DLSE=True)
compile_all("bf16", 128, dict(flags, VARLEN=True, REL_SHIFT=True))
compile_all("bf16", 64, dict(flags, VARLEN=False, HAS_KP=True))
print("ok")
"""


@pytest.mark.slow
def test_score_kernels_compile_for_h100():
    """The kernels with every score-function and sink flag on (tanh, the bias gather, the
    diagonal sums and their atomics) lower to sm_90 with the GPU tile sizes."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
