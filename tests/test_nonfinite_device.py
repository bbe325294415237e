"""The non-finite rule on a GPU (qkv.nonfinite_device): what it costs, proved on the CPU, and what it gives.

**Cost.** A call routed as on CUDA runs on meta tensors (no data, any device type the routing
is told to treat as a GPU), its engine stubbed as one op forward and one backward, every Triton
launch counted instead of made, under a dispatch mode that records every aten op: around the
engine a call may issue only the rule's kernels (scan, poison, and with gradients the gradient
fix), the zero fill of their flag words, and ops that launch nothing (views, allocations) —
never a read back to the host. Before the kernels, the torch form cost 60 such ops for a plain
call with gradients (and a host sync would show here too).

**Patterns.** The kernels, run through Triton's interpreter (or on a GPU: tests/device.py), give
exactly the torch form's NaN patterns (:func:`qkv.nonfinite.bad_parts`,
:func:`~qkv.nonfinite.nothing_to_attend`, :func:`~qkv.nonfinite.gradient_rule`) over a grid of
layouts: NaN and ±inf in query rows, in one key/value head, in the bias; grouped-query heads;
broadcast, expanded and transposed batch dims; float masks and rows the formula made NaN; empty
sizes. tests/contract/test_nonfinite_rule.py runs whole calls through them on every engine.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
import qkv.functional  # noqa: F401  (imported before SDPA is stubbed: it probes torch's kernel once)
from qkv.backends.sdpa import SdpaBackend
from qkv.nonfinite import bad_parts, gradient_rule, nothing_to_attend

from .helpers import DEVICE, SUBPROCESS_TIMEOUT

try:  # (absent before the kernels: the cost test must fail there, not be skipped)
    nd: Optional[Any] = importlib.import_module("qkv.nonfinite_device")
except ImportError:
    nd = None

NAN, INF = float("nan"), float("inf")
SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose", "_to_copy_cpu"}
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "as_strided", "detach", "alias",
        "_reshape_alias", "expand", "t", "transpose", "select", "slice", "unsqueeze", "squeeze", "permute", "reshape",
        "_unsafe_view", "unbind", "lift_fresh"}  # fmt: skip
ZERO_FILL = "zeros"  # the flag words: one allocation, zeroed (on a GPU a memset of a few bytes per query row)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


# ---- cost: operations around the engine, on meta tensors ----------------------------------------


class _Recorder(TorchDispatchMode):
    """Every aten op issued while active, but those inside the stubbed engine."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_to_copy" and (kwargs or {}).get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            name = "_to_copy_cpu"  # a copy to the host waits for the device
        if not self.paused:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _engine(rec: _Recorder):
    """torch SDPA as one op forward and one backward (what a fused kernel is on a GPU)."""

    class Engine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            rec.paused = True
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            rec.paused = False
            rec.ops.append("ENGINE")
            return out

        @staticmethod
        def backward(ctx, dout):
            rec.paused = True
            grads = tuple(torch.empty_like(dout) for _ in range(3))
            rec.paused = False
            rec.ops.append("ENGINE_BWD")
            return grads

    return lambda q, k, v, *args, **kwargs: Engine.apply(q, k, v)


@pytest.fixture
def meta_gpu(monkeypatch):
    """Calls on meta tensors routed as on CUDA: the sdpa engine takes them, the rule takes its
    kernels' path, and every launch is recorded (``launches``) instead of made."""
    rec = _Recorder()
    launches: list[str] = []
    monkeypatch.setattr(SdpaBackend, "DEVICES", ("cpu", "cuda", "meta"))
    monkeypatch.setattr(SdpaBackend, "extra_reasons", lambda self, call: [])  # (its probes of torch's kernel need values)
    monkeypatch.setattr(F, "scaled_dot_product_attention", _engine(rec))
    if nd is not None:
        monkeypatch.setattr(nd, "KERNEL_DEVICES", ("cuda", "meta"))
        monkeypatch.setattr(nd, "launch", lambda name, grid, *args, **meta: launches.append(name))
    return rec, launches


@pytest.mark.parametrize("grad", [True, False], ids=["with-gradients", "inference"])
def test_a_plain_call_costs_its_engine_and_the_rules_kernels(meta_gpu, grad):
    """Causal, B 2, H 8, N 256, D 64, bf16, as auto runs it on CUDA (sdpa): the engine's op and
    the rule's kernels, no other kernel, no host sync."""
    rec, launches = meta_gpu
    q, k, v = (torch.empty(2, 8, 256, 64, device="meta", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    dout = torch.empty(2, 8, 256, 64, device="meta", dtype=torch.bfloat16)
    with rec:
        out = qkv.attention(q, k, v, is_causal=True, backend="sdpa")
        if grad:
            torch.autograd.backward(out, dout)
    kernels = [op for op in rec.ops if op not in FREE and op not in ("ENGINE", "ENGINE_BWD")]
    print(f"ops {rec.ops}; launches {launches}")
    assert [op for op in rec.ops if op in SYNCS] == []
    assert rec.ops.count("ENGINE") == 1 and rec.ops.count("ENGINE_BWD") == int(grad)
    assert kernels == [ZERO_FILL], f"tensor ops beside the engine: {kernels}"
    assert launches == ["scan_kernel", "poison_kernel"] + (["grads_kernel"] if grad else [])


def test_kernels_launch_by_structure_not_data(meta_gpu):
    """A float mask with gradients and an lse: the poison reads the output (the formula can make
    a row NaN there), still one launch of each kernel, and nothing else but the rule's fill."""
    rec, launches = meta_gpu
    q, k, v = (torch.empty(2, 4, 64, 32, device="meta", requires_grad=True) for _ in range(3))
    mask = torch.empty(64, 64, device="meta", requires_grad=True)
    with rec:
        out = qkv.attention(q, k, v, attn_mask=mask, backend="sdpa")
        torch.autograd.backward(out, torch.empty_like(out))
    assert [op for op in rec.ops if op in SYNCS] == []
    assert launches == ["scan_kernel", "poison_kernel", "grads_kernel"]


# ---- patterns: the kernels against the torch form ------------------------------------------------


def _t(shape, gen, dtype, layout: str = "plain") -> torch.Tensor:
    """A random tensor of ``shape`` in a layout: plain, transposed (heads and rows swapped in
    memory, as (B, N, H, D) projections give) or expanded (batch dim 0 read through stride 0)."""
    if layout == "transposed" and len(shape) >= 4:
        base = torch.randn(*shape[:-3], shape[-2], shape[-3], shape[-1], generator=gen, dtype=dtype)
        return base.transpose(-3, -2)
    if layout == "expanded" and len(shape) >= 4:
        return torch.randn(1, *shape[1:], generator=gen, dtype=dtype).expand(*shape)
    return torch.randn(*shape, generator=gen, dtype=dtype)


# name: q shape, k shape, Dv, dtype, layouts (q, k, v), plants [(tensor, index, value)], bias Hq or 0, float mask shape,
# NaN rows planted in the output (the formula's), negative keys (b, kv head, dim) so a +inf query meets only -inf
GRID: list[tuple] = [
    ("q-nan", (2, 2, 9, 8), (2, 2, 9, 8), 8, torch.float32, "plain", [("q", (1, 1, 2, 3), NAN)], 0, None, [], None),
    ("k-inf/gqa", (2, 4, 9, 8), (2, 2, 11, 8), 8, torch.float32, "plain", [("k", (0, 1, 10, 2), INF)], 0, None, [], None),
    ("v-neginf/mqa/bf16", (2, 4, 7, 16), (2, 1, 40, 16), 16, torch.bfloat16, "plain", [("v", (1, 0, 3, 0), -INF)], 0, None, [], None),
    ("bias-nan", (1, 3, 5, 8), (1, 3, 5, 8), 8, torch.float32, "plain", [("bias", (2, 4), NAN)], 3, None, [], None),
    ("q-inf-meets-negative", (2, 2, 9, 8), (2, 2, 9, 8), 8, torch.float32, "plain", [("q", (1, 1, 2, 3), INF)], 0, None, [],
     (1, 1, 3)),
    ("q-inf-nothing-to-attend/fp64", (1, 2, 4, 8), (1, 2, 6, 8), 8, torch.float64, "plain",
     [("q", (0, 0, 1, 2), -INF), ("q", (0, 0, 3, 2), INF)], 0, None, [], (0, 0, 2)),
    ("transposed/gqa", (2, 4, 9, 8), (2, 2, 9, 8), 8, torch.float16, "transposed", [("q", (0, 3, 8, 7), NAN), ("v", (1, 0, 0, 0), INF)],
     0, None, [], None),
    ("k-broadcast-batch", (3, 2, 5, 8), (1, 2, 6, 8), 4, torch.float32, "plain", [("k", (0, 1, 5, 0), NAN)], 0, None, [], None),
    ("k-expanded", (3, 2, 5, 8), (3, 2, 6, 8), 8, torch.float32, "expanded", [("q", (2, 0, 4, 1), INF)], 0, None, [], None),
    ("two-batch-dims", (2, 3, 2, 5, 8), (1, 3, 2, 6, 8), 8, torch.float32, "plain", [("k", (0, 2, 0, 1, 1), NAN)], 0, None, [], None),
    ("float-mask-made-nan", (2, 2, 6, 8), (2, 2, 6, 8), 8, torch.float32, "plain", [("q", (0, 1, 2, 0), NAN)], 0, (6, 6),
     [(1, 0, 4)], None),
    ("float-mask-per-head", (2, 4, 6, 8), (2, 2, 6, 8), 8, torch.float32, "plain", [("v", (1, 1, 0, 0), NAN)], 0, (2, 4, 6, 6),
     [(0, 2, 1)], None),
    ("two-d", (7, 8), (9, 8), 8, torch.float32, "plain", [("q", (3, 1), NAN)], 0, None, [], None),
    ("finite", (2, 2, 9, 8), (2, 2, 9, 8), 8, torch.float32, "plain", [], 2, (9, 9), [], None),
    ("empty-nq", (2, 2, 0, 8), (2, 2, 5, 8), 8, torch.float32, "plain", [("k", (0, 0, 1, 1), NAN)], 0, None, [], None),
    ("empty-nk", (2, 2, 5, 8), (2, 2, 0, 8), 8, torch.float32, "plain", [("q", (1, 0, 2, 2), INF), ("q", (0, 1, 1, 1), NAN)], 0,
     None, [], None),
    ("empty-batch", (0, 2, 5, 8), (0, 2, 5, 8), 8, torch.float32, "plain", [], 0, None, [], None),
    ("empty-d", (2, 2, 5, 0), (2, 2, 5, 0), 3, torch.float32, "plain", [("v", (1, 1, 2, 2), NAN)], 0, None, [], None),
]  # fmt: skip


def _case(spec):
    name, qs, ks, dv, dtype, layout, plants, bias_h, mask_shape, made_rows, negative = spec
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    vs = (*ks[:-1], dv)
    t = {
        "q": _t(qs, gen, dtype, layout if layout != "expanded" else "plain"),
        "k": _t(ks, gen, dtype, layout),
        "v": _t(vs, gen, dtype, layout),
        "bias": torch.randn(bias_h, qs[-2] + ks[-2] - 1, generator=gen) if bias_h else None,
        "mask": torch.randn(*mask_shape, generator=gen, dtype=dtype) if mask_shape else None,
    }
    if negative is not None:
        b, h, d = negative
        t["k"] = t["k"].clone()
        t["k"][b, h, :, d] = -t["k"][b, h, :, d].abs() - 0.1
    for which, index, value in plants:
        if t[which].stride().count(0):
            t[which] = t[which].clone()
        t[which][index] = value
    return t, made_rows


def _torch_form(q, k, v, bias, out, read_out):
    """rows, dq rows and the rows the formula made NaN, as qkv.nonfinite.guard computes them."""
    own, heads = bad_parts(q, k, v, bias)
    rows = own | heads.unsqueeze(-1)
    made = torch.isnan(out).any(-1) if read_out else torch.zeros_like(rows)
    rows = rows | made
    dq_rows = rows & (heads.unsqueeze(-1) | ~own | ~nothing_to_attend(q, k))
    # a row the formula made NaN passes NaN to its dq as the rule says, whatever the engine gave there
    return rows, dq_rows | made, made


@pytest.fixture
def kernels_here(monkeypatch):
    """The kernels' path on the test device (the interpreter on a CPU)."""
    assert nd is not None
    pytest.importorskip("triton")
    monkeypatch.setattr(nd, "KERNEL_DEVICES", ("cuda", DEVICE))


@pytest.mark.device
@pytest.mark.parametrize("spec", GRID, ids=[s[0] for s in GRID])
def test_kernels_give_the_torch_forms_patterns(kernels_here, spec):
    t, made_rows = _case(spec)
    q, k, v, bias, mask = t["q"], t["k"], t["v"], t["bias"], t["mask"]
    hq = q.shape[-3] if q.dim() >= 3 else 1
    ob = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]) if q.dim() >= 3 else ()
    gen = torch.Generator().manual_seed(5)
    out = torch.randn(*ob, *q.shape[-3:-1], v.shape[-1], generator=gen, dtype=q.dtype)
    lse = torch.randn(out.shape[:-1], generator=gen, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    for row in made_rows:
        out[row] = NAN
    read_out = mask is not None
    rows, dq_rows, made = _torch_form(q, k, v, bias, out, read_out)
    sinks = torch.randn(hq, generator=gen, dtype=q.dtype)
    roles = {"query": q, "key": k, "value": v, "sinks": sinks, **({} if mask is None else {"mask": mask})}
    dev = {n: x.to(DEVICE) for n, x in roles.items()}
    rule = nd.Rule(dev["query"], dev["key"], dev["value"], dev)
    got_out, got_lse = rule.finish(out.clone().to(DEVICE), lse.clone().to(DEVICE), bias=None if bias is None else bias.to(DEVICE),
                                   read_out=read_out)  # fmt: skip
    assert torch.equal(torch.isnan(got_out).cpu(), (rows & ~made).unsqueeze(-1).expand(out.shape) | torch.isnan(out))
    assert torch.equal(torch.isnan(got_lse).cpu(), rows)
    keep = ~rows.unsqueeze(-1).expand(out.shape)
    assert torch.equal(got_out.cpu()[keep], out[keep]) and torch.equal(got_lse.cpu()[~rows], lse[~rows])

    grads = {n: torch.randn(x.shape, generator=gen, dtype=x.dtype) for n, x in roles.items()}
    fixed = {n: g.cpu() for n, g in rule.fix_gradients({n: g.clone().to(DEVICE) for n, g in grads.items()}).items()}
    want = gradient_rule(rows, dq_rows, {n: x.shape for n, x in roles.items()} | {"bias": (hq, 1)})
    for n, g in fixed.items():
        assert torch.equal(torch.isnan(g), want[n]), f"d{n}: {int(torch.isnan(g).sum())} NaN, the rule says {int(want[n].sum())}"
    zero = (rows & ~dq_rows).unsqueeze(-1).expand(q.shape)  # bad rows with nothing to attend to: the formula's dq, 0
    assert bool((fixed["query"][zero] == 0).all()) and torch.equal(fixed["query"][~zero & ~want["query"]], grads["query"][~zero & ~want["query"]])
    heads = rule.heads_passing_nan().cpu()
    assert torch.equal(heads, want["bias"][:, 0]), "the heads whose bias and sink get NaN"
    if not spec[6]:  # nothing planted
        assert not bool(rule.words.cpu().any()), "finite inputs leave every flag clear"


@pytest.mark.device
def test_clear_flags_leave_every_tensor_as_it_was(kernels_here):
    """Finite inputs: the poison and gradient kernels return at once, writing nothing."""
    q, k, v = (torch.randn(2, 2, 9, 8, generator=torch.Generator().manual_seed(i)).to(DEVICE) for i in range(3))
    rule = nd.Rule(q, k, v, {"query": q, "key": k, "value": v})
    out, lse = torch.randn(2, 2, 9, 8).to(DEVICE), torch.randn(2, 2, 9).to(DEVICE)
    o2, l2 = rule.finish(out.clone(), lse.clone(), bias=None, read_out=False)
    grads = {"query": torch.full_like(q, NAN), "key": torch.randn_like(k)}  # a NaN the engine made stays: nothing is cleared
    fixed = rule.fix_gradients({n: g.clone() for n, g in grads.items()})
    assert torch.equal(o2, out) and torch.equal(l2, lse) and not bool(rule.words.any())
    assert torch.isnan(fixed["query"]).all() and torch.equal(fixed["key"], grads["key"])


@pytest.mark.device
def test_rule_under_torch_func_keeps_the_torch_form(kernels_here):
    """Under ``torch.func`` transforms the rule takes the torch form (it batches and traces),
    and gives the same NaN patterns as the kernels."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64).to(DEVICE) for _ in range(3))
    k[1, 0, 2, 1] = NAN

    def loss(qi, ki, vi):
        return qkv.attention(qi, ki, vi, backend="math").nansum()

    grads = torch.func.vmap(torch.func.grad(loss))(q, k, v)  # per batch entry: (H, N, D) calls
    leaf = q.clone().requires_grad_()
    loss(leaf, k, v).backward()
    assert torch.equal(torch.isnan(grads), torch.isnan(leaf.grad))
    assert bool(torch.isnan(grads[1, 0]).all()) and not bool(torch.isnan(grads[0]).any())


# ---- lowering to a GPU binary -----------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from qkv import nonfinite_kernels as K

def compile_one(fn, sig, consts):
    sig = {n: ("constexpr" if n in consts else sig.get(n, "i32")) for n in fn.arg_names}
    triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4, num_stages=1))

for dt in ("bf16", "fp16", "fp32", "fp64"):
    rows = dict(BLOCK_R=64, BLOCK_C=128)
    compile_one(K.scan_kernel, {"W": "*i32", "A0": "*" + dt, "A1": "*" + dt, "A2": "*" + dt, "A3": "*fp32"}, rows)
    compile_one(K.grads_kernel, {"W": "*i32", **{f"A{i}": "*" + dt for i in range(5)}}, rows)
    for grad in (False, True):
        compile_one(K.poison_kernel, {"W": "*i32", "Out": "*" + dt, "Lse": "*fp32", "Q": "*" + dt, "K": "*" + dt},
                    dict(READ_OUT=grad, HAS_LSE=True, HAS_BIAS=grad, GRAD=grad, HAS_GMASK=grad, BLOCK_M=128, BLOCK_DV=128,
                         BLOCK_N=32, BLOCK_D=64))
print("ok")
"""


@pytest.mark.slow
def test_kernels_compile_for_h100():
    """Lower the three kernels to sm_90 binaries (Triton ships ptxas): code only the interpreter
    accepts fails here on a machine without a GPU."""
    pytest.importorskip("triton.backends.nvidia")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
