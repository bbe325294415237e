"""Legal calls at the edges of their arguments — no query rows, no keys, no value columns, a mask
function that returns a constant, one padding flag for every key — answer as the float64 oracle
does, gradients included (an empty output's gradient is an empty or zero tensor), on every
backend that takes them; a backend that does not take one says so by name (BackendError). None
ends in an internal error (an IndexError, a reshape's RuntimeError, an AttributeError).

Triton runs on the test device (its interpreter on a CPU); flex compiles each new kind of call
(seconds on a CPU), so its cases are in the slow tier.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

import qkv
from qkv.reference import attention_ref
from qkv.sparse import BlockSparseMask, from_dense

from ..helpers import DEVICE, on_device

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")  # triton's interpreter

BACKENDS = ["auto", "chunked", "math", "sdpa", "triton", pytest.param("flex", marks=pytest.mark.slow)]
ANSWER = ("auto", "chunked", "math")  # these take every call here: a refusal from them is a failure


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _noop(b, h, q_idx, kv_idx):  # FlexAttention's own noop_mask: a 0-d tensor
    return b.new_ones(size=(), dtype=torch.bool)


# name: (Nq, Nk, Dv, the call's other arguments, made fresh for each call)
CASES: dict[str, tuple[int, int, int, Callable[[], dict[str, Any]]]] = {
    "mask_mod, no query rows": (0, 7, 8, lambda: {"mask_mod": _causal}),
    "mask_mod, no keys": (5, 0, 8, lambda: {"mask_mod": _causal}),
    "BlockSparseMask over no keys": (5, 0, 8, lambda: {"attn_mask": BlockSparseMask(torch.zeros(2, 0, dtype=torch.bool), (4, 4), (5, 0))}),
    "BlockSparseMask over no query rows": (0, 7, 8, lambda: {"attn_mask": from_dense(torch.ones(0, 7, dtype=torch.bool), 4)}),
    "no value columns, causal": (5, 7, 0, lambda: {"is_causal": True}),
    "no value columns, window": (5, 7, 0, lambda: {"window": (2, 0)}),
    "no value columns, bottom-right causal, 70 keys": (9, 70, 0, lambda: {"is_causal": "bottom_right"}),
    "mask_mod returning True": (5, 7, 8, lambda: {"mask_mod": lambda b, h, q_idx, kv_idx: True}),
    "mask_mod returning False": (5, 7, 8, lambda: {"mask_mod": lambda b, h, q_idx, kv_idx: False}),
    "mask_mod returning a 0-d tensor": (5, 7, 8, lambda: {"mask_mod": _noop}),
    "key_padding_mask, no keys": (5, 0, 8, lambda: {"key_padding_mask": torch.ones(1, dtype=torch.bool)}),
    "key_padding_mask, one flag for every key": (5, 7, 8, lambda: {"key_padding_mask": torch.tensor([True])}),
    "key_padding_mask, one flag per batch entry": (5, 7, 8, lambda: {"key_padding_mask": torch.tensor([[True], [False]])}),
}


def _inputs(nq: int, nk: int, dv: int) -> tuple[torch.Tensor, ...]:
    return torch.randn(2, 2, nq, 8), torch.randn(2, 2, nk, 8), torch.randn(2, 2, nk, dv)


def _oracle(q, k, v, kw) -> tuple[np.ndarray, list[torch.Tensor]]:
    """The float64 output, and the float64 math path's gradients of ``out · w`` (w fixed)."""
    kw64 = {n: (t.to_dense() if isinstance(t, BlockSparseMask) else t) for n, t in kw.items()}
    ref = np.asarray(attention_ref(q.double(), k.double(), v.double(), **kw64))
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    out = qkv.attention(*leaves, backend="math", **kw)
    (out * _weights(out.shape, torch.float64)).sum().backward()
    return ref, [t.grad for t in leaves]


def _weights(shape, dtype) -> torch.Tensor:
    return torch.linspace(-1, 1, max(1, int(np.prod(shape))), dtype=dtype)[: int(np.prod(shape))].reshape(shape)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_an_edge_call_answers_or_is_refused_by_name(case, backend):
    nq, nk, dv, kwargs = CASES[case]
    q, k, v = _inputs(nq, nk, dv)
    ref, ref_grads = _oracle(q, k, v, kwargs())
    dev = DEVICE if backend == "triton" else "cpu"
    for grad in (False, True):
        leaves = [t.to(dev).requires_grad_(grad) for t in (q, k, v)]
        kw = on_device(kwargs()) if dev != "cpu" else kwargs()
        try:
            out = qkv.attention(*leaves, backend=backend, **kw)
        except qkv.BackendError as e:
            assert backend not in ANSWER, f"{backend} refused: {e}"
            assert f"backend {backend!r} cannot run this call" in str(e)
            continue
        assert out.shape == ref.shape
        err = float(np.abs(out.detach().double().cpu().numpy() - ref).max()) if ref.size else 0.0
        print(f"{case} on {backend}, gradients {grad}: max error {err:.2e}")
        assert err <= 1e-5 * max(1.0, float(np.abs(ref).max())) if ref.size else True
        if grad:
            assert out.requires_grad, "an empty output of a differentiable call keeps its graph"
            (out * _weights(out.shape, out.dtype).to(dev)).sum().backward()
            for name, t, r in zip("qkv", leaves, ref_grads):
                assert t.grad is not None and t.grad.shape == t.shape, name
                if r.numel():  # float32 rounding of gradients of size ~1-10: relative to their scale
                    assert float((t.grad.double().cpu() - r).abs().max()) <= 1e-5 * max(1.0, float(r.abs().max())), name
