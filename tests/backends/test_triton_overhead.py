"""The triton backend's own wrapper code costs no host sync and no extra kernel.

On a GPU a per-call cost outside the kernels shows as a causal call costing what a full one
does. Here the wrapper (:func:`run_attention`, its autograd function and the backward's
launch code, and :meth:`TritonBackendImpl.forward` before the non-finite rule) runs with
the Triton launches stubbed out, under a dispatch mode that records every aten op: none may
read a value back to the host (``item``, ``_local_scalar_dense``, ``nonzero``, ``is_nonzero``,
``equal``), and the plain forward may only allocate its outputs (on a GPU each other op is a
kernel launch).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..helpers import INTERPRETED, make_qkv

pytest.importorskip("triton")

import qkv  # noqa: E402
from qkv.backends.triton import backend as launch  # noqa: E402
from qkv.call import validate  # noqa: E402
from qkv.nonfinite import Checked  # noqa: E402
from qkv.score_mods import ALiBi, Softcap, alibi_slopes  # noqa: E402

# Triton 3.6's interpreter indexes with 1-element arrays, which NumPy 2 deprecates (harmless)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose"}
# ops that launch nothing on a GPU: allocation and views
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "as_strided", "detach", "alias",
        "_reshape_alias", "expand", "t", "transpose", "select", "slice", "unsqueeze", "squeeze", "permute", "reshape",
        "_unsafe_view", "unbind", "lift_fresh", "triton_attention_fwd", "triton_attention_bwd"}  # fmt: skip


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    @property
    def syncs(self) -> list[str]:
        return [op for op in self.ops if op in SYNCS]

    @property
    def launches(self) -> list[str]:
        return [op for op in self.ops if op not in FREE]


class _Stub:
    """A Triton kernel that launches nothing: ``kernel[grid](*args, **meta)``."""

    def __init__(self):
        self.calls = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls += 1

        return run


@pytest.fixture
def stubbed(monkeypatch):
    stubs = {}
    for name in ("fwd_kernel", "decode_kernel", "decode_merge_kernel", "bwd_preprocess", "bwd_dkdv_kernel", "bwd_dq_kernel"):
        stubs[name] = _Stub()
        monkeypatch.setattr(launch.D if name.startswith("decode") else launch.K, name, stubs[name])
    monkeypatch.setattr(launch, "follow_rule", lambda call, out, lse: Checked(out, lse))  # the rule is measured apart
    return stubs


CALLS = {
    "causal": dict(is_causal=True),
    "window-padding": dict(window=(7, 0), key_padding_mask=torch.rand(2, 40) > 0.2),
    "softcap": dict(score_mod=Softcap(5.0), is_causal=True),
    "alibi-sinks": dict(score_mod=ALiBi(alibi_slopes(4)), sinks=torch.randn(4)),
    "bool-mask": dict(attn_mask=torch.rand(40, 40) > 0.5),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_wrapper_never_syncs(stubbed, name):
    q, k, v = make_qkv(2, 4, 2, 40, 40, 16, dtype=torch.bfloat16, requires_grad=True)
    call = validate(q, k, v, enable_gqa=True, return_lse=True, **CALLS[name])  # validation is not the backend's
    with _Recorder() as rec:
        out, lse = launch.TritonBackendImpl.forward(None, call)
        (out.float().sum() + lse.sum()).backward()
    assert stubbed["fwd_kernel"].calls == 1 and stubbed["bwd_dq_kernel"].calls == 1
    assert rec.syncs == [], f"host syncs in the triton wrapper: {rec.syncs}"


def test_decode_wrapper_never_syncs(stubbed, monkeypatch):
    monkeypatch.setenv("QKV_TRITON_DECODE", "1")
    q, k, v = make_qkv(2, 8, 2, 1, 300, 16, dtype=torch.bfloat16)
    call = validate(q, k, v, enable_gqa=True, is_causal="bottom_right", sinks=torch.randn(8))
    with _Recorder() as rec:
        launch.TritonBackendImpl.forward(None, call)
    assert stubbed["decode_kernel"].calls == 1 and stubbed["decode_merge_kernel"].calls == 1
    assert rec.syncs == []
    assert rec.launches == [], rec.launches  # float32 sinks: .float() is no copy


def test_plain_forward_launches_only_its_kernel(stubbed):
    """A plain call allocates out and lse and launches one kernel: no cast, copy or fill."""
    for kw in (dict(is_causal=True), dict(window=(5, 0)), dict()):
        q, k, v = make_qkv(1, 4, 1, 33, 33, 16, dtype=torch.float16)
        call = validate(q, k, v, enable_gqa=True, **kw)
        with _Recorder() as rec:
            launch.TritonBackendImpl.forward(None, call)
        assert rec.launches == [], f"{kw}: {rec.launches}"


def test_backward_launches_only_its_kernels(stubbed):
    q, k, v = make_qkv(1, 4, 2, 33, 33, 16, dtype=torch.float16, requires_grad=True)
    out, _ = launch.run_attention(*(t.reshape(1, 2, 2, 33, 16) if t is q else t.reshape(1, 2, 1, 33, 16) for t in (q, k, v)),
                                  scale=0.25, hi=0)  # fmt: skip
    dout = torch.randn_like(out)
    with _Recorder() as rec:
        out.backward(dout)
    # autograd's own sums into the leaves' .grad are the only ops besides the allocations
    assert [op for op in rec.launches if op not in ("add", "add_", "copy_", "_to_copy", "sum", "fill_", "zero_", "ones_like")] == []
    assert rec.syncs == []
    assert stubbed["bwd_preprocess"].calls == stubbed["bwd_dkdv_kernel"].calls == stubbed["bwd_dq_kernel"].calls == 1


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors through the interpreter")
def test_full_call_syncs_only_where_the_rule_reads_cpu_values(stubbed, monkeypatch):
    """The whole ``qkv.attention`` path on CPU tensors: its syncs come from the non-finite and
    overflow checks that run only on a CPU (``surely_finite``, ``may_check``), which is where
    the count is recorded; nothing is asserted beyond the triton wrapper's own zero."""
    monkeypatch.undo()  # the real rule, the real kernels (interpreter)
    q, k, v = make_qkv(1, 2, 2, 17, 17, 16)
    with _Recorder() as rec:
        qkv.attention(q, k, v, is_causal=True, backend="triton")
    print("syncs on a CPU call:", rec.syncs)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors through the interpreter")
def test_bare_launch_computes_the_same_forward():
    """The benchmark's floor (:func:`bare_forward`) is the real kernel on prepared arguments."""
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16)
    launch_fn, out, lse = launch.triton_fwd(*(t.unsqueeze(2) for t in (q, k, v)), None, None, None, None, 0, 0, 0.25, None, 0, False,
                                            prepare_only=True)  # fmt: skip
    launch_fn()
    want = qkv.attention(q, k, v, is_causal=True, scale=0.25, backend="math")
    assert (out.squeeze(2) - want).abs().max() < 1e-5
    launch.bare_forward(q, k, v, 0.25, causal=True)()  # runs


def test_eager_calls_skip_the_custom_op_dispatch(stubbed, monkeypatch):
    """Eager calls run the launch code directly (the op's dispatch costs tens of µs a call);
    traces and ``torch.func`` transforms still see the ops (test_triton.py checks both)."""

    def no(*a, **kw):
        raise AssertionError("the custom op ran in eager mode")

    monkeypatch.setattr(launch, "attention_fwd_op", no)
    monkeypatch.setattr(launch, "attention_bwd_op", no)
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, requires_grad=True)
    out, lse = launch.TritonBackendImpl.forward(None, validate(q, k, v, is_causal=True, return_lse=True))
    (out.sum() + lse.sum()).backward()
    assert stubbed["fwd_kernel"].calls == 1 and stubbed["bwd_dkdv_kernel"].calls == 1
