"""qkv.varlen.attention_varlen: packed sequences against one qkv.attention call per sequence."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

import qkv
from qkv.reference import attention_ref
from qkv.varlen import attention_varlen

from .helpers import DEVICE, FLOOR, assert_within_rule, interpreted_subset, max_err, on_cpu, on_device
from .rounding_baseline import rounded_attention

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Triton 3.6's interpreter indexes with 1-element arrays, which NumPy 2 deprecates (harmless)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


def _packed(lens_q, lens_k, hq=4, hk=2, d=16, dv=None, dtype=torch.float32):
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lens_q), hq, d, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(lens_k), hk, d, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(lens_k), hk, dv or d, dtype=torch.float64).to(dtype)
    return q, k, v, cu(lens_q), cu(lens_k)


def _as_attention_kw(kw: dict) -> dict:
    """attention_varlen's FlashAttention-style arguments as qkv.attention's: causal and windows
    aligned bottom-right per sequence unless is_causal="top_left"."""
    out = dict(kw)
    align = "top_left" if kw.get("is_causal") == "top_left" else "bottom_right"
    if kw.get("is_causal"):
        out["is_causal"] = align
    if "window" in kw:
        out["window_alignment"] = align
    return out


def _per_sequence(q, k, v, cq, ck, backend, **kw):
    """The loop the packed call must agree with: out (Tq, Hq, Dv), lse (Hq, Tq).

    ``backend`` names a qkv backend, or is :func:`rounded_attention`."""
    kw = _as_attention_kw(kw)
    attend = backend if callable(backend) else lambda *a, **k: qkv.attention(*a, return_lse=True, backend=backend, **k)
    outs, lses = [], []
    for s in range(len(cq) - 1):
        a, b, c, e = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        o, l = attend(q[a:b].transpose(0, 1), k[c:e].transpose(0, 1), v[c:e].transpose(0, 1), enable_gqa=True, **kw)
        outs.append(o.transpose(0, 1))
        lses.append(l)
    return torch.cat(outs), torch.cat(lses, 1)


KINDS = [
    {},
    {"is_causal": True},
    {"is_causal": "top_left"},
    {"window": (3, 1)},
    {"window": (-1, 2)},
    {"is_causal": "top_left", "window": (4, None)},
    {"is_causal": True, "window": (4, -1)},
]


@pytest.mark.parametrize("kw", KINDS, ids=str)
@pytest.mark.parametrize("backend", ["auto", "math", "chunked"])
def test_fallback_matches_reference(backend, kw):
    q, k, v, cq, ck = _packed([5, 0, 17, 1], [9, 3, 17, 20], dtype=torch.float64)
    out, lse = attention_varlen(q, k, v, cq, ck, enable_gqa=True, return_lse=True, backend=backend, **kw)
    assert out.shape == (q.shape[0], 4, 16) and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    for s in range(4):
        a, b, c, e = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        ro, rl = attention_ref(
            q[a:b].transpose(0, 1), k[c:e].transpose(0, 1), v[c:e].transpose(0, 1), enable_gqa=True, return_lse=True, **_as_attention_kw(kw)
        )
        assert max_err(out[a:b].transpose(0, 1), ro) < 1e-12
        assert max_err(lse[:, a:b], rl) < 1e-5


@pytest.mark.device
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("kw,dtype", interpreted_subset(list(zip(KINDS, itertools.cycle([torch.float16, torch.bfloat16, torch.float32]))), args=2), ids=str)
def test_triton_kernel_matches_per_sequence_attention(kw, dtype):
    q64, k64, v64, cq, ck = _packed([5, 0, 17, 1, 33], [9, 3, 17, 20, 2], hq=3, hk=1, d=24, dv=8, dtype=torch.float64)
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q64, k64, v64))

    def run(fn, q, k, v, device="cpu"):
        q, k, v = (t.detach().clone().to(device).requires_grad_(True) for t in (q, k, v))
        out, lse = on_cpu(fn(q, k, v))  # differentiable: gradients flow back to the device
        g = torch.Generator().manual_seed(3)
        w = torch.randn(out.shape, generator=g, dtype=torch.float64)
        wl = torch.randn(lse.shape, generator=g, dtype=torch.float64)
        ((out.double() * w).sum() + (torch.where(torch.isfinite(lse), lse, 0).double() * wl).sum()).backward()
        return out.detach(), lse.detach(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu()

    cqd, ckd = on_device((cq, ck))
    triton = lambda q, k, v: attention_varlen(q, k, v, cqd, ckd, enable_gqa=True, return_lse=True, backend="triton", **kw)  # noqa: E731
    got = run(triton, q, k, v, DEVICE)
    # the kernels round P and dS to 16 bits: so does the baseline (FlashAttention's rule)
    baseline = rounded_attention if dtype != torch.float32 else "math"
    base = run(lambda q, k, v: _per_sequence(q, k, v, cq, ck, baseline, **kw), q, k, v)
    ref = run(lambda q, k, v: _per_sequence(q, k, v, cq, ck, "math", **kw), q64, k64, v64)
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(ref[1]))
    lse_scale = float(ref[1][torch.isfinite(ref[1])].abs().max())
    assert max_err(got[1], ref[1]) <= 2 * max_err(base[1], ref[1]) + 1e-6 * lse_scale, "lse"
    for name, c, b, r, f in zip(["out", "dq", "dk", "dv"], got[:1] + got[2:], base[:1] + base[2:], ref[:1] + ref[2:], [2, 3, 3, 3]):
        assert c.shape == r.shape and not torch.isnan(c).any()
        assert_within_rule(c, b, r, dtype, factor=f, what=f"{name} {kw}")


@pytest.mark.device
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_varlen_explicit_max_seqlen_and_no_lse():
    q, k, v, cq, ck = _packed([3, 20], [20, 3], hq=2, hk=2)
    out = attention_varlen(*on_device((q, k, v, cq, ck)), 32, 32, is_causal="bottom_right", backend="triton").cpu()
    want, _ = _per_sequence(q, k, v, cq, ck, "math", is_causal="bottom_right")
    assert max_err(out, want) < 1e-5 + FLOOR[torch.float32]


def test_auto_on_cpu_loops_over_sequences():
    q, k, v, cq, ck = _packed([4, 6], [4, 6], dtype=torch.float64)
    out = attention_varlen(q, k, v, cq, ck, enable_gqa=True, is_causal=True)
    want, _ = _per_sequence(q, k, v, cq, ck, "math", is_causal=True)
    assert max_err(out, want) < 1e-12


def test_validation_errors():
    q, k, v, cq, ck = _packed([4, 6], [5, 5])
    with pytest.raises(TypeError, match="integer offsets"):
        attention_varlen(q, k, v, cq.float(), ck, enable_gqa=True)
    with pytest.raises(ValueError, match="not increasing"):
        attention_varlen(q, k, v, torch.tensor([0, 7, 6, 10], dtype=torch.int32), torch.tensor([0, 5, 5, 10], dtype=torch.int32), enable_gqa=True)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] is 9 but q has 10 rows"):
        attention_varlen(q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32), ck, enable_gqa=True)
    with pytest.raises(ValueError, match="describes 2 sequences but cu_seqlens_k describes 3"):
        attention_varlen(q, k, v, cq, torch.tensor([0, 2, 5, 10], dtype=torch.int32), enable_gqa=True)
    with pytest.raises(ValueError, match="must start at 0"):
        attention_varlen(q, k, v, torch.tensor([1, 4, 10], dtype=torch.int32), ck, enable_gqa=True)
    with pytest.raises(ValueError, match="max_seqlen_q=3 is shorter"):
        attention_varlen(q, k, v, cq, ck, 3, enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        attention_varlen(q, k, v, cq, ck)
    with pytest.raises(ValueError, match=r"\(total_len, heads, head_dim\)"):
        attention_varlen(q[None], k, v, cq, ck, enable_gqa=True)
    with pytest.raises(ValueError, match="unknown"):
        attention_varlen(q, k, v, cq, ck, enable_gqa=True, backend="nope")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_named_triton_backend_explains_what_it_cannot_run():
    q, k, v, cq, ck = _packed([4, 6], [5, 5], dtype=torch.float64)
    with pytest.raises(qkv.BackendError, match="float64"):
        attention_varlen(q, k, v, cq, ck, enable_gqa=True, backend="triton")
