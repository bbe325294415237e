"""Arguments at the edges of float32, float64 and int64: every finite value answers exactly (the
rule of docs/guarantees.md, against the float64 oracle on the rounded inputs) on every backend that
takes the call, or is refused by name with the fix.

- sinks above FLT_MAX·ln 2 ≈ 2.36e38, which in the kernels' base-2 units overflow float32: the
  decoding kernel (merging its key parts), the C tile loops, the torch formulation, triton;
- Softcap caps outside float32's normal range: refused for float32, float16 and bfloat16 inputs
  (their scores are computed in float32), any positive cap for float64; caps at both ends of the
  range answer exactly (triton took ``cap·log2 e`` and ``scale/cap`` as float32 factors: inf);
- ALiBi slopes and RelativeBias tables (float64) with entries float32 cannot hold: refused;
  a max_distance or cap past float64: refused where it is given;
- windows of 2**62, 2**63 - 1 and 2**64 keys.

The chunked backend runs as its kernels choose (decoding for a few query rows against more than
512 keys, the C tile loops otherwise, forward and backward); ``chunked-torch`` is its torch
formulation (the C kernels hidden). Triton runs on the test device (its interpreter on a CPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv.backends import native
from qkv.backends.decode_cpu import can_decode
from qkv.call import validate
from qkv.reference import attention_ref
from qkv.score_mods import ALiBi, RelativeBias, Softcap

from ..helpers import DEVICE, FLOOR, assert_within_rule, make_qkv, max_err

# Triton's interpreter computes in NumPy, which warns where these limits overflow on purpose (a far
# sink times log2 e, a score over the smallest cap: inf, and the kernels take it so)
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
FLT_MIN, FLT_MAX = torch.finfo(F32).tiny, torch.finfo(F32).max


def _ids(x) -> str:
    return str(x).replace("torch.", "")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _backend(name: str, monkeypatch):
    """The backend argument for ``name``; ``chunked-torch`` hides the C kernels from chunked's
    tile loops (decoding keeps its kernel: use it with more query rows than decoding takes)."""
    if name == "triton":
        pytest.importorskip("triton")
    if name == "chunked-torch":
        monkeypatch.setattr(native, "library", lambda: None)
        return "chunked"
    return name


def _attend(name: str, q, k, v, monkeypatch, grad: bool = False, sinks=None, **kw):
    """``(out, lse)`` of ``backend`` on the CPU, and with ``grad`` the gradients of q, k, v (and
    sinks) for a fixed loss reaching out and every finite lse."""
    backend = _backend(name, monkeypatch)
    dev = DEVICE if name == "triton" else "cpu"
    leaves = [t.detach().to(dev).requires_grad_(grad) for t in (q, k, v)]
    s = None if sinks is None else sinks.detach().to(dev).requires_grad_(grad)
    kw = {name: t.to(dev) if isinstance(t, torch.Tensor) else t for name, t in kw.items()}  # masks on the query's device
    out, lse = qkv.attention(*leaves, backend=backend, return_lse=True, sinks=s, **kw)
    out, lse = out.cpu(), lse.cpu()
    if not grad:
        return out.detach(), lse.detach()
    g = torch.Generator().manual_seed(7)
    w_out, w_lse = torch.randn(out.shape, generator=g, dtype=F64), torch.randn(lse.shape, generator=g, dtype=F64)
    ((out.double() * w_out).sum() + (torch.where(torch.isfinite(lse), lse, 0).double() * w_lse).sum()).backward()
    grads = [t.grad.cpu() for t in leaves] + ([] if s is None else [s.grad.cpu()])
    return out.detach(), lse.detach(), *grads


def _rounded(dtype: torch.dtype, *shape_args: int, seed: int):
    """q, k, v in ``dtype`` from a fixed seed, and their float64 copies (what the oracle sees)."""
    q, k, v = make_qkv(*shape_args, dtype=dtype, seed=seed)
    return (q, k, v), tuple(t.double() for t in (q, k, v))


# ---- sinks beyond float32 in base 2 ------------------------------------------------------------

SINKS = [3e38, 0.5, FLT_MAX, float("-inf")]  # per query head: two far sinks, an ordinary one, none
FAR_HEADS = [0, 2]
SHAPES = {  # (B, Hq, Hk, Nq, Nk, D): decoding splits 1100 keys into parts and merges them
    "decode": (1, 4, 1, 2, 1100, 16),
    "tiles": (2, 4, 2, 37, 70, 16),
}


def _sinks_case(shape: str, dtype: torch.dtype):
    b, hq, hk, nq, nk, d = SHAPES[shape]
    (q, k, v), (q64, k64, v64) = _rounded(dtype, b, hq, hk, nq, nk, d, seed=3)
    sinks = torch.tensor(SINKS)
    pad = torch.ones(b, nk, dtype=torch.bool)
    pad[0, ::3] = False  # padding among the keys of every part
    if b > 1:
        pad[1] = False  # a batch entry with no key: its rows give 0 and lse = their sink
    kw = dict(enable_gqa=True, key_padding_mask=pad)
    ref = attention_ref(q64, k64, v64, return_lse=True, sinks=sinks.double(), **kw)
    return (q, k, v), sinks, kw, ref


@pytest.mark.parametrize(
    "backend, shape, dtype",
    [("math", "decode", F32), ("chunked", "decode", F32), ("chunked", "decode", BF16), ("chunked", "decode", F16),
     ("triton", "decode", F32), ("math", "tiles", F32), ("chunked", "tiles", F32), ("chunked-torch", "tiles", F32),
     ("triton", "tiles", F32)],
    ids=_ids,
)  # fmt: skip
def test_a_sink_above_every_score_takes_all_of_its_rows(backend, shape, dtype, monkeypatch):
    """A sink of 3e38 or FLT_MAX (+inf as sink·log2 e in float32) outweighs every score a
    float32 kernel holds: its rows output exactly 0 with lse = the sink; the other heads are
    judged by the rule against math."""
    (q, k, v), sinks, kw, (ref_out, ref_lse) = _sinks_case(shape, dtype)
    if backend == "chunked" and shape == "decode":
        assert can_decode(validate(q, k, v, sinks=sinks, **kw)), "the decoding kernel takes this call"
    out, lse = _attend(backend, q, k, v, monkeypatch, sinks=sinks, **kw)
    base_out, base_lse = _attend("math", q, k, v, monkeypatch, sinks=sinks, **kw)
    print(f"{backend} {shape} {dtype}: out max error {max_err(out, ref_out):.3g}")
    assert torch.equal(out[:, FAR_HEADS], torch.zeros_like(out[:, FAR_HEADS])), "far-sink rows: out 0"
    want = torch.tensor([SINKS[0], SINKS[2]]).view(1, 2, 1).expand_as(lse[:, FAR_HEADS])
    assert torch.equal(lse[:, FAR_HEADS], want), "far-sink rows: lse = the sink"
    assert_within_rule(out, base_out, ref_out, dtype, what="out")
    rest = [1, 3]
    ref_rest = torch.as_tensor(ref_lse)[:, rest]
    assert_within_rule(lse[:, rest], base_lse[:, rest], ref_rest, dtype, what="lse of the other heads")


@pytest.mark.parametrize("backend", ["chunked", "chunked-torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_far_sinks_gradients(backend, monkeypatch):
    """Gradients through far sinks: their rows' weights are 0 (no gradient to q, k, v from them)
    and d lse/d sink = 1, as math in float64 has them."""
    (q, k, v), sinks, kw, _ = _sinks_case("tiles", F32)
    ref = _attend("math", q.double(), k.double(), v.double(), monkeypatch, grad=True, sinks=sinks.double(), **kw)
    base = _attend("math", q, k, v, monkeypatch, grad=True, sinks=sinks, **kw)
    got = _attend(backend, q, k, v, monkeypatch, grad=True, sinks=sinks, **kw)
    for name, c, b, r in zip(["q", "k", "v", "sinks"], got[2:], base[2:], ref[2:]):
        assert_within_rule(c, b, r, F32, factor=3.0, what=f"d{name}")


def test_a_float64_sink_beyond_float32_rounds_the_lse_as_math_does(monkeypatch):
    """A float64 sink of 1e300 with float32 inputs: out 0 on its rows and lse +inf, float32's
    rounding of 1e300, on the decoding kernel (which merges in double) as on math."""
    (q, k, v), _, kw, _ = _sinks_case("decode", F32)
    sinks = torch.tensor([1e300, 0.5, -1e300, 1.0], dtype=F64)
    out, lse = _attend("chunked", q, k, v, monkeypatch, sinks=sinks, **kw)
    base_out, base_lse = _attend("math", q, k, v, monkeypatch, sinks=sinks, **kw)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and torch.equal(lse[:, 0], torch.full_like(lse[:, 0], float("inf")))
    assert torch.equal(base_lse[:, 0], lse[:, 0])
    assert max_err(out, base_out) < 1e-5 and max_err(lse[:, 1:], base_lse[:, 1:]) < 1e-5


# ---- softcap --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [1e-50, 1e-39, 3.5e38, 1e39, 1e300])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=_ids)
def test_a_cap_outside_float32s_normal_range_is_refused(cap, dtype, monkeypatch):
    """Scores of float32, float16 and bfloat16 inputs are float32: a cap below its normal range
    became 0 in the C loops ("no cap": error 0.69), one above it inf (NaN everywhere)."""
    q, k, v = make_qkv(1, 2, 2, 5, 9, 8, dtype=dtype, seed=1)
    for backend in ["math", "chunked", "auto"] + (["triton"] if _has_triton() else []):
        with pytest.raises(ValueError, match=r"Softcap\(cap=.*float32's normal range.*float64 inputs"):
            qkv.attention(q, k, v, score_mod=Softcap(cap), backend=_backend(backend, monkeypatch))


@pytest.mark.parametrize("cap", [5e-324, 1e-50, 1e39, 1.7e308])
@pytest.mark.parametrize("backend", ["math", "chunked", "chunked-torch"])
def test_float64_takes_any_positive_cap(cap, backend, monkeypatch):
    """Down to the smallest subnormal, up to float64's max; with a zero query row (scores of
    exactly 0, 0/cap: never 0·(1/cap)). Gradients against math in float64, whose softcap applies
    its derivative 1 − tanh² directly (never the cap times the gradient, which overflows)."""
    (q, k, v), _ = _rounded(F64, 1, 2, 2, 21, 30, 8, seed=2)
    q = q.clone()
    q[0, 1, 4] = 0
    ref_out, ref_lse = attention_ref(q, k, v, return_lse=True, score_mod=Softcap(cap))
    ref = _attend("math", q, k, v, monkeypatch, grad=True, score_mod=Softcap(cap))  # float64 autograd: the gradients' oracle
    got = _attend(backend, q, k, v, monkeypatch, grad=True, score_mod=Softcap(cap))
    assert_within_rule(got[0], ref[0], ref_out, F64, what="out")
    assert_within_rule(got[1], ref[1], ref_lse, F64, what="lse")
    for name, c, r in zip("qkv", got[2:], ref[2:]):
        assert max_err(c, r) <= 100 * FLOOR[F64] * max(1.0, float(r.abs().max())), f"d{name}"


@pytest.mark.parametrize("cap", [FLT_MIN, 1e-20, 2.4e38, FLT_MAX])
@pytest.mark.parametrize("backend", ["math", "chunked", "chunked-torch", "triton"])
def test_caps_at_float32s_limits_answer_exactly(cap, backend, monkeypatch):
    """The smallest cap squashes every score to ±FLT_MIN (uniform weights), the largest leaves
    them as they are; scale 100 over the smallest cap is past float32's range, and a zero query
    row gives scores of exactly 0. Forward and backward, against the oracle by the rule."""
    (q, k, v), (q64, k64, v64) = _rounded(F32, 1, 2, 2, 21, 30, 16, seed=4)
    q, q64 = q.clone(), q64.clone()
    q[0, 0, 3], q64[0, 0, 3] = 0, 0
    kw = dict(score_mod=Softcap(cap), scale=100.0 if cap < 1 else 0.05)
    ref_out, ref_lse = attention_ref(q64, k64, v64, return_lse=True, **kw)
    ref = _attend("math", q64, k64, v64, monkeypatch, grad=True, **kw)
    base = _attend("math", q, k, v, monkeypatch, grad=True, **kw)
    got = _attend(backend, q, k, v, monkeypatch, grad=True, **kw)
    assert_within_rule(got[0], base[0], ref_out, F32, what="out")
    assert_within_rule(got[1], base[1], ref_lse, F32, what="lse")
    for name, c, b, r in zip("qkv", got[2:], base[2:], ref[2:]):
        assert_within_rule(c, b, r, F32, factor=3.0, what=f"d{name}")


# ---- ALiBi slopes and relative-bias tables --------------------------------------------------------


def _alibi(dtype):
    return ALiBi(torch.tensor([1e39, 0.5], dtype=dtype))


def _t5(dtype):
    table = torch.zeros(8, 2, dtype=dtype)
    table[1, 0] = -1e39  # bucket 1: the key just before the query (bidirectional, 8 buckets)
    return RelativeBias(table, max_distance=20)


@pytest.mark.parametrize("make, name", [(_alibi, "ALiBi slopes"), (_t5, "RelativeBias table")])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=_ids)
def test_float64_parameters_float32_cannot_hold_are_refused(make, name, dtype):
    """A float64 slope or bias entry of ±1e39 is ±inf in a float32 call's scores (a mask, or NaN
    where it meets a zero distance), not the number given: refused by name."""
    q, k, v = make_qkv(1, 2, 2, 5, 9, 8, dtype=dtype, seed=1)
    for backend in ["math", "chunked", "auto"]:
        with pytest.raises(ValueError, match=rf"{name}: 1e\+39 becomes inf in float32.*float64 inputs"):
            qkv.attention(q, k, v, score_mod=make(F64), backend=backend)


@pytest.mark.parametrize("make", [_alibi, _t5])
@pytest.mark.parametrize("backend", ["math", "chunked", "chunked-torch"])
def test_float64_inputs_take_those_parameters(make, backend, monkeypatch):
    """...and float64 inputs take them exactly (a slope of 1e39 gives each row to its last key; a
    bias of -1e39 leaves its key no weight)."""
    (q, k, v), _ = _rounded(F64, 1, 2, 2, 21, 30, 8, seed=5)
    ref_out, ref_lse = attention_ref(q, k, v, return_lse=True, score_mod=make(F64))
    base = _attend("math", q, k, v, monkeypatch, score_mod=make(F64))
    got = _attend(backend, q, k, v, monkeypatch, score_mod=make(F64))
    assert_within_rule(got[0], base[0], ref_out, F64, what="out")
    finite = np.isfinite(ref_lse)
    assert np.allclose(got[1].numpy()[finite], ref_lse[finite], rtol=1e-12)


@pytest.mark.parametrize("make", [lambda: RelativeBias(torch.zeros(8, 2), max_distance=10**309),
                                  lambda: RelativeBias(torch.zeros(8, 2), max_distance=float("inf")),
                                  lambda: Softcap(10**400)], ids=["max_distance_past_float64", "max_distance_inf", "cap_past_float64"])  # fmt: skip
def test_arguments_past_float64_are_refused_where_they_are_given(make):
    """An int beyond float64 (a bucket's log(max_distance / exact), a cap) raised OverflowError,
    the distance only at the first call: now a ValueError naming it, from the constructor."""
    with pytest.raises(ValueError, match=r"RelativeBias max_distance=.*at most 1.8e\+308|Softcap\(cap=inf\): the cap must be a finite"):
        make()


@pytest.mark.parametrize("backend", ["math", "chunked", "chunked-torch"])
def test_the_largest_max_distance_answers_exactly(backend, monkeypatch):
    (q, k, v), (q64, k64, v64) = _rounded(F32, 1, 2, 2, 21, 30, 8, seed=8)
    mod = RelativeBias(torch.randn(8, 2, generator=torch.Generator().manual_seed(9)), max_distance=10**308)
    ref_out, ref_lse = attention_ref(q64, k64, v64, return_lse=True, score_mod=mod)
    base = _attend("math", q, k, v, monkeypatch, score_mod=mod)
    got = _attend(backend, q, k, v, monkeypatch, grad=backend != "math", score_mod=mod)
    assert_within_rule(got[0], base[0], ref_out, F32, what="out")
    assert_within_rule(got[1], base[1], ref_lse, F32, what="lse")


# ---- windows at the integer limits ----------------------------------------------------------------

WINDOWS = [(2**62, 2**62), (2**63 - 1, 0), (None, 2**63 - 1), (2**64, 3)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("backend", ["math", "sdpa", "chunked", "triton"])
@pytest.mark.parametrize("shape", ["decode", "tiles"])
def test_windows_at_the_integer_limits(window, backend, shape, monkeypatch):
    """Sides past int64 (or near it) are clamped where they enter the kernels' 64-bit integers
    (qkv.masks.rules.WINDOW_MAX, native.band_args): the band means the same."""
    b, hq, hk, nq, nk, d = (1, 2, 2, 3, 600, 16) if shape == "decode" else (1, 2, 2, 21, 40, 16)
    (q, k, v), (q64, k64, v64) = _rounded(F32, b, hq, hk, nq, nk, d, seed=6)
    kw = dict(window=window, is_causal="bottom_right")
    ref_out, ref_lse = attention_ref(q64, k64, v64, return_lse=True, **kw)
    base = _attend("math", q, k, v, monkeypatch, **kw)
    got = _attend(backend, q, k, v, monkeypatch, grad=backend == "chunked" and shape == "tiles", **kw)
    assert_within_rule(got[0], base[0], ref_out, F32, what="out")
    assert_within_rule(got[1], base[1], ref_lse, F32, what="lse")
