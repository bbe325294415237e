"""The triton backend on the test device, against the float64 oracle and ``math``.

On a CPU machine the kernels run through Triton's interpreter (``tests/device.py``), which
picks 16×16 tiles, so the tiny shapes here (17/33/70-long sequences) still span several
tiles; with a CUDA device they run on the GPU with its real tile sizes. The oracle and the
same-dtype baselines always run on the CPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ..helpers import (
    DEVICE, FLOOR, SUBPROCESS_TIMEOUT, assert_within_rule, interpreted_subset, make_qkv, mask_kwargs, max_err, on_cpu, on_device,
)  # fmt: skip

pytest.importorskip("triton")

import qkv  # noqa: E402
from qkv.backends import BACKENDS, BackendError, auto_order, dispatch, select  # noqa: E402
from qkv.call import AttentionCall, validate  # noqa: E402
from qkv.reference import attention_ref  # noqa: E402

from ..rounding_baseline import rounded_attention  # noqa: E402

TRITON = BACKENDS["triton"]
# Triton 3.6's interpreter indexes with 1-element arrays, which NumPy 2 deprecates (harmless)
pytestmark = [pytest.mark.device, pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")]


def _ref(q, k, v, **kw):
    kw = {key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val) for key, val in kw.items()}
    return attention_ref(q, k, v, return_lse=True, **kw)


def _leaves(*tensors, grad=False):
    """Copies of CPU tensors as leaves on the test device."""
    return tuple(t.detach().clone().to(DEVICE).requires_grad_(grad) for t in tensors)


def _run(q, k, v, backend, kw, grad=True):
    """out, lse and (with ``grad``) dq, dk, dv of a loss that reaches both out and lse, on the CPU.

    ``backend`` names a qkv backend, or is a function like :func:`rounded_attention`; triton
    runs on the test device, everything else on the CPU."""
    if backend == "triton":
        q, k, v = _leaves(q, k, v, grad=grad)
        kw = on_device(kw)
    else:
        q, k, v = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    if callable(backend):
        out, lse = backend(q, k, v, enable_gqa=True, **kw)
    else:
        out, lse = qkv.attention(q, k, v, enable_gqa=True, backend=backend, return_lse=True, **kw)
    if not grad:
        return on_cpu((out, lse))
    g = torch.Generator().manual_seed(1)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    out_c, lse_c = out.cpu(), lse.cpu()  # differentiable: the gradient flows back to the device
    loss = (out_c.double() * w_out).sum() + (torch.where(torch.isfinite(lse_c), lse_c, 0).double() * w_lse).sum()
    loss.backward()
    return on_cpu((out.detach(), lse.detach(), q.grad, k.grad, v.grad))


def _kw(kind: str, b: int, hq: int, nq: int, nk: int, dtype) -> dict:
    kw = mask_kwargs(kind, b, hq, nq, nk, dtype)
    if kind == "bool_mask_causal":
        kw["window"] = (None, 3)  # the kernels also combine a dense mask with a window
    return kw


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (kind, B, Hq, Hk, Nq, Nk, D, Dv, dtype): each row mixes a mask with awkward sizes and heads
CASES = [
    ("none", 1, 2, 2, 17, 33, 16, 16, F32),
    ("none", 1, 2, 1, 1, 70, 59, 59, BF16),  # MQA, one query row, head dim 59 → 64-wide tiles
    ("causal", 2, 4, 2, 33, 17, 80, 80, BF16),
    ("bottom_right", 1, 2, 1, 17, 70, 96, 96, F16),
    ("bottom_right", 1, 2, 2, 70, 17, 16, 16, F32),  # Nq > Nk: early rows see nothing
    ("window", 1, 2, 2, 70, 70, 16, 32, F16),
    ("causal_window", 1, 3, 1, 33, 70, 16, 16, F32),
    ("padding", 2, 2, 1, 17, 33, 59, 59, BF16),
    ("bool_mask", 1, 4, 2, 17, 33, 16, 16, F32),
    ("float_mask", 2, 2, 2, 33, 17, 16, 16, F16),
    ("bool_mask_causal", 1, 2, 1, 33, 33, 16, 16, BF16),
    ("none", 1, 1, 1, 1, 1, 16, 16, F16),
    ("causal", 1, 3, 1, 33, 45, 24, 8, F16),  # 16-bit, head dim 24, value dim 8: wrong on an H100 with 16-wide value tiles
]


@pytest.mark.parametrize("case", interpreted_subset(CASES), ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}/{c[3]}-{c[4]}x{c[5]}-d{c[6]}-{str(c[8])[6:]}")
def test_forward_backward_within_rule(case):
    kind, b, hq, hk, nq, nk, d, dv, dtype = case
    q64, k64, v64 = make_qkv(b, hq, hk, nq, nk, d, dv, dtype=torch.float64)
    kw = _kw(kind, b, hq, nq, nk, dtype)
    kw64 = {key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val) for key, val in kw.items()}
    ref_out, ref_lse = _ref(q64, k64, v64, enable_gqa=True, **kw)
    ref_grads = _run(q64, k64, v64, "math", kw64)[2:]
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    base = _run(q, k, v, rounded_attention if dtype != torch.float32 else "math", kw)
    got = _run(q, k, v, "triton", kw)
    out, lse = got[:2]
    assert out.dtype == dtype and out.shape == (b, hq, nq, dv) and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_within_rule(out, base[0], ref_out, dtype, what=f"out {case}")
    assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(ref_lse)), "empty rows must have lse = -inf"
    assert max_err(lse, ref_lse) <= 1e-5 * max(1, np.abs(ref_lse[np.isfinite(ref_lse)]).max(initial=1)) + FLOOR[dtype] * 10
    for name, c, bse, r in zip("qkv", got[2:], base[2:], ref_grads):
        assert c.dtype == dtype and c.shape == r.shape and not torch.isnan(c).any()
        assert_within_rule(c, bse, r, dtype, factor=3.0, what=f"d{name} {case}")


@pytest.mark.parametrize("d", [16, 80, 96, 256])
def test_head_dims_forward(d):
    q, k, v = make_qkv(1, 1, 1, 17, 20, d, dtype=torch.float32)
    out, lse = on_cpu(qkv.attention(*_leaves(q, k, v), is_causal="bottom_right", return_lse=True, backend="triton"))
    ref_out, ref_lse = attention_ref(q, k, v, is_causal="bottom_right", return_lse=True)
    assert max_err(out, ref_out) < 1e-5 and max_err(lse, ref_lse) < 1e-5


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = _leaves(*make_qkv(2, 2, 1, 17, 33, 16, dtype=torch.float16), grad=True)
    mask = torch.rand(2, 2, 17, 33, device=DEVICE) > 0.5
    mask[:, :, 3] = False  # row 3 sees nothing
    kp = torch.ones(2, 33, dtype=torch.bool, device=DEVICE)
    kp[1] = False  # sequence 1 is all padding
    out, lse = qkv.attention(q, k, v, attn_mask=mask, key_padding_mask=kp, enable_gqa=True, return_lse=True, backend="triton")
    assert not torch.isnan(out).any()
    assert (out[:, :, 3] == 0).all() and (out[1] == 0).all()
    assert torch.isneginf(lse[:, :, 3]).all() and torch.isneginf(lse[1]).all() and torch.isfinite(lse[0, :, :3]).all()
    (out.float().sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 3] == 0).all() and (q.grad[1] == 0).all() and (k.grad[1] == 0).all() and (v.grad[1] == 0).all()


def test_no_keys_at_all():
    q, k, v = _leaves(*make_qkv(1, 2, 2, 5, 0, 16), grad=True)
    out, lse = qkv.attention(q, k, v, return_lse=True, backend="triton")
    assert (out == 0).all() and torch.isneginf(lse).all()
    out.sum().backward()
    assert (q.grad == 0).all()


class _PoisonedTorch:
    """``torch`` for the launch code, with ``empty``/``empty_like`` returning NaN-filled buffers."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty(self, *a, **kw):
        return self._poison(torch.empty(*a, **kw))

    def empty_like(self, *a, **kw):
        return self._poison(torch.empty_like(*a, **kw))


def test_every_output_element_is_written(monkeypatch):
    """NaN-filled buffers before launch: any element a kernel skips (or garbage it reads) shows."""
    import qkv.backends.triton.backend as launch

    monkeypatch.setattr(launch, "torch", _PoisonedTorch())
    q, k, v = make_qkv(2, 4, 2, 33, 37, 24, 40, dtype=torch.float32)
    kw = {"is_causal": "bottom_right", "window": (9, None), "key_padding_mask": torch.rand(2, 37) > 0.2}
    got = _run(q, k, v, "triton", kw)
    monkeypatch.undo()
    want = _run(q, k, v, "math", kw)
    for g, w in zip(got, want):
        assert not torch.isnan(g).any()
        assert max_err(g, w) < 1e-5


def test_backward_is_deterministic():
    q, k, v = make_qkv(1, 4, 1, 33, 40, 16, dtype=torch.bfloat16)
    kw = {"is_causal": True, "window": (11, 0)}
    first = _run(q, k, v, "triton", kw)
    second = _run(q, k, v, "triton", kw)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_non_contiguous_and_broadcast_inputs():
    """Views reach the kernels as they are (a copy would make them contiguous): the bases are
    leaves on the test device, the views are taken there."""
    b, h, n, d = 2, 2, 19, 16
    bases = _leaves(torch.randn(b, n, h, d), torch.randn(1, h, d, 23), torch.randn(b, h, 23, 2 * d), grad=True)

    def views(qb, kb, vb):
        q = qb.transpose(1, 2)  # (B, H, N, D) view of a (B, N, H, D) buffer
        k = kb.transpose(-1, -2).expand(b, h, 23, d)  # batch stride 0
        v = vb[..., ::2]  # strided last dim
        return q, k, v

    mask = (torch.rand(1, 1, n, 23) > 0.3).expand(b, h, n, 23)
    q, k, v = views(*bases)
    assert not q.is_contiguous() and k.stride(0) == 0 and v.stride(-1) == 2
    out = qkv.attention(q, k, v, attn_mask=mask.to(DEVICE), is_causal="bottom_right", backend="triton")
    (out.cpu().double() * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)).sum().backward()
    cpu_bases = tuple(t.detach().cpu().requires_grad_(True) for t in bases)
    want = qkv.attention(*views(*cpu_bases), attn_mask=mask, is_causal="bottom_right", backend="math")
    (want.double() * torch.linspace(-1, 1, want.numel(), dtype=torch.float64).view(want.shape)).sum().backward()
    assert max_err(out, want) < 1e-5
    for got, ref in zip(bases, cpu_bases):
        assert max_err(got.grad, ref.grad) < 1e-5


def test_custom_scale_and_no_mask_gradient():
    q, k, v = make_qkv(1, 2, 2, 17, 17, 16)
    out = qkv.attention(*_leaves(q, k, v), scale=0.9, backend="triton")
    assert max_err(out, attention_ref(q, k, v, scale=0.9)) < 1e-5
    q, k, v = _leaves(q, k, v)
    bias = torch.randn(17, 17, device=DEVICE, requires_grad=True)
    with pytest.raises(BackendError, match="float attn_mask"):
        qkv.attention(q, k, v, attn_mask=bias, backend="triton")
    with torch.no_grad():
        qkv.attention(q, k, v, attn_mask=bias, backend="triton")  # no gradient wanted: runs


# ---- capabilities and selection ----------------------------------------------------------------


def test_reasons(monkeypatch):
    q, k, v = make_qkv(1, 2, 2, 4, 4, 8)
    assert TRITON.not_supported_reasons(validate(*_leaves(q, k, v))) == []
    reasons = TRITON.not_supported_reasons(validate(q.double(), k.double(), v.double(), dropout_p=0.1))
    assert any("float64" in r for r in reasons) and any("dropout" in r for r in reasons)
    big = torch.randn(1, 1, 2, 300)
    assert any("head dim 300" in r for r in TRITON.not_supported_reasons(validate(big, big, big)))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert TRITON.not_supported_reasons(validate(q, k, v)) == [
        "needs a CUDA device (or TRITON_INTERPRET=1 for the slow CPU interpreter)"
    ]


def _cuda_order(call: AttentionCall) -> list[str]:
    """auto's order for ``call`` as if its tensors were on a GPU (the table reads the tensors'
    device, so a call cannot pose as a CUDA one)."""
    return dispatch.order_names(call, dispatch.Shape.of(call)._replace(device="cuda"))[0]


def test_auto_order():
    q, k, v = make_qkv(1, 2, 2, 16, 24, 8)
    plain, win = validate(q, k, v, is_causal=True), validate(q, k, v, window=(4, 0))
    br = validate(q, k, v, is_causal="bottom_right")
    kp = validate(q, k, v, key_padding_mask=torch.rand(1, 24) > 0.5)
    for call in (plain, win, br, kp):  # on a CPU (the interpreter) auto never picks triton
        assert select(call).NAME != "triton"
        assert TRITON not in auto_order(call)
    assert _cuda_order(plain)[:2] == ["sdpa", "triton"]
    for call in (win, br, kp):  # compiled FlexAttention first (faster on the H100), triton where it declines
        assert _cuda_order(call)[:2] == ["flex", "triton"]
    assert _cuda_order(validate(q, k, v, sinks=torch.zeros(2)))[0] == "triton"  # only qkv's kernels have sinks
    q.requires_grad_(True)
    assert _cuda_order(validate(q, k, v, is_causal=True, return_lse=True))[0] == "triton"


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_auto_order_on_a_real_gpu():
    q, k, v = _leaves(*make_qkv(1, 2, 2, 16, 24, 8, dtype=torch.bfloat16))
    assert [b.NAME for b in auto_order(validate(q, k, v, is_causal=True))][:2] == ["sdpa", "triton"]
    assert select(validate(q, k, v, window=(4, 0))).NAME == "flex"
    assert select(validate(q, k, v, window=(4, 0), sinks=torch.zeros(2, device=q.device))) is TRITON
    out = qkv.attention(q, k, v, window=(4, 0))
    want = qkv.attention(q.cpu(), k.cpu(), v.cpu(), window=(4, 0), backend="math")
    assert out.device.type == "cuda" and max_err(out, want) < 2e-2


def test_head_tiles(monkeypatch):
    from qkv.backends.triton.backend import head_tile

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert [head_tile(n, 2) for n in (1, 8, 16, 24, 33, 64, 100, 256)] == [32, 32, 32, 32, 64, 64, 128, 256]
    assert [head_tile(n, 4) for n in (1, 8, 16, 24)] == [16, 16, 16, 32]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert head_tile(8, 2) == 16  # the interpreter's small tiles keep the tests fast


def test_fp32_dot_follows_torch_matmul_precision(monkeypatch):
    from qkv.backends.triton.backend import fp32_dot

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("QKV_TRITON_FP32_DOT", raising=False)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert fp32_dot() == "ieee"
        torch.set_float32_matmul_precision("high")
        assert fp32_dot() == "tf32"
        monkeypatch.setenv("QKV_TRITON_FP32_DOT", "ieee")
        assert fp32_dot() == "ieee"
        monkeypatch.setenv("QKV_TRITON_FP32_DOT", "fast")
        with pytest.raises(ValueError, match="QKV_TRITON_FP32_DOT='fast'"):
            fp32_dot()
    finally:
        torch.set_float32_matmul_precision(before)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fp32_dot() == "ieee"  # the interpreter always computes in fp32


@pytest.mark.skipif(DEVICE != "cuda", reason="TF32 exists only on a GPU")
def test_tf32_within_rule_of_torch_tf32():
    """Under torch's "high" precision both triton and torch's own matmuls use TF32: the
    same-precision baseline is ``math`` on the GPU with that setting."""
    q64, k64, v64 = make_qkv(2, 4, 2, 70, 97, 64, dtype=torch.float64)
    ref = attention_ref(q64, k64, v64, is_causal=True, enable_gqa=True)
    q, k, v = _leaves(q64, k64, v64)
    q, k, v = q.float(), k.float(), v.float()
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        got = qkv.attention(q, k, v, is_causal=True, enable_gqa=True, backend="triton")
        base = qkv.attention(q, k, v, is_causal=True, enable_gqa=True, backend="math")
    finally:
        torch.set_float32_matmul_precision(before)
    assert max_err(base, ref) > 1e-5, "the baseline should show TF32 rounding"
    # Both round their operands to TF32 (10 mantissa bits), but triton also rounds P on chip
    # and sums in another order, so their worst errors differ by more than the usual factor
    # (a first H100 run passed at 2x, the next failed): 3x plus one TF32 ulp of the output.
    ulp = 2.0**-10 * float(np.abs(ref).max())
    print(f"tf32: triton err {max_err(got, ref):.3e}, torch math err {max_err(base, ref):.3e}, ulp {ulp:.1e}")
    assert max_err(got, ref) <= 3 * max_err(base, ref) + ulp


# ---- torch custom ops ----------------------------------------------------------------------------


@pytest.mark.slow  # opcheck runs each op under every mode (10 s interpreted); CI's slow tier runs it
def test_custom_op_opcheck_and_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qkv.backends.triton.backend import attention_bwd_op, attention_fwd_op

    q, k, v = _leaves(torch.randn(1, 2, 2, 17, 16), torch.randn(1, 2, 1, 20, 16), torch.randn(1, 2, 1, 20, 24))
    kp = torch.rand(1, 20, device=DEVICE) > 0.2
    torch.library.opcheck(attention_fwd_op, (q, k, v, None, kp, None, None, 0, 0, 0.25, None, 0, True))
    out, lse = attention_fwd_op(q, k, v, None, kp, None, None, 0, 0, 0.25, None, 0, True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.library.opcheck(attention_bwd_op, (dout, dlse, q, k, v, out, lse, None, kp, None, None, 0, 0, 0.25, None, 0, True))
    with FakeTensorMode():
        fq, fk, fv = torch.empty(2, 3, 2, 5, 80), torch.empty(2, 3, 1, 7, 80), torch.empty(2, 3, 1, 7, 48)
        out, lse = attention_fwd_op(fq, fk, fv, None, None, None, None, 0, 0, 0.1, None, None, False)
        assert out.shape == (2, 3, 2, 5, 48) and lse.shape == (2, 3, 2, 5) and lse.dtype == torch.float32


@pytest.mark.slow
def test_torch_func_transforms():
    q, k, v = _leaves(*make_qkv(1, 2, 1, 5, 7, 16, dtype=torch.float32))
    f = lambda q, k, v: qkv.attention(q, k, v, is_causal="bottom_right", enable_gqa=True, backend="triton")  # noqa: E731
    g = lambda q, k, v: qkv.attention(q, k, v, is_causal="bottom_right", enable_gqa=True, backend="math")  # noqa: E731
    for got, want in zip(torch.func.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(q, k, v), torch.func.grad(lambda *a: g(*a).sum(), argnums=(0, 1, 2))(q, k, v)):
        assert max_err(got, want) < 1e-5
    batched = torch.func.vmap(f, in_dims=(0, None, None))(torch.stack([q, 2 * q]), k, v)
    assert max_err(batched, torch.stack([g(q, k, v), g(2 * q, k, v)])) < 1e-5
    jac = torch.func.jacrev(lambda q: f(q, k, v))(q)
    assert max_err(jac, torch.func.jacrev(lambda q: g(q, k, v))(q)) < 1e-5


def test_torch_compile_keeps_one_graph():
    q, k, v = _leaves(*make_qkv(1, 2, 2, 17, 17, 16), grad=True)
    fn = torch.compile(lambda q, k, v: qkv.attention(q, k, v, window=(3, 0), backend="triton"), fullgraph=True, backend="aot_eager")
    out = fn(q, k, v)
    out.sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    want = qkv.attention(q2, k2, v2, window=(3, 0), backend="math")
    want.sum().backward()
    assert max_err(out, want) < 1e-5
    for a, b in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert max_err(a, b) < 1e-5


# ---- GPU lowering without a GPU ------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
from qkv.backends.triton.lowering import compile_all

# score functions and sinks off (tests/backends/test_triton_score_mods.py compiles them on)
for dt, d, varlen, mask_bool in (("fp16", 128, False, False), ("bf16", 80, True, True), ("fp32", 64, False, True), ("bf16", 64, False, False)):
    flags = dict(BOTTOM_RIGHT=True, HAS_LO=True, HAS_HI=True, HAS_KP=not varlen, HAS_MASK=not varlen,
                 MASK_BOOL=mask_bool, VARLEN=varlen, FP32_DOT="tf32")
    compile_all(dt, d, flags, "u8" if mask_bool else dt)
compile_all("bf16", 128, dict(BOTTOM_RIGHT=False, HAS_LO=False, HAS_HI=False, HAS_KP=False, HAS_MASK=False, MASK_BOOL=False,
                              VARLEN=False, WARP_SPEC=True), "u8", arch="default")
print("ok")
"""


@pytest.mark.slow
def test_kernels_compile_for_h100():
    """Lower every kernel to an sm_90 cubin with the GPU tile sizes (Triton ships ptxas), so
    code that only the interpreter accepts fails here even on a machine without a GPU."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
