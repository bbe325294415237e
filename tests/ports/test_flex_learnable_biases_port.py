"""FlexAttention's learnable-bias tests, ported onto qkv and run on the CPU.

Ported from pytorch/pytorch, ``test/inductor/test_flex_attention.py``, class
``TestLearnableBiases``, under PyTorch's BSD 3-Clause License (Copyright (c) 2016- Facebook,
Inc. and the PyTorch contributors; see that project's LICENSE file).

Each test writes a score function that reads a learnable tensor (``requires_grad=True``) from
its closure, as FlexAttention's tests do, and checks the output and the gradients of the query,
the key, the value and every bias. Their API, mapped onto qkv::

    flex_attention(q, k, v, score_mod=fn)  →  qkv.attention(q, k, v, score_mod=fn, backend=b)

Their three results, and ours:

- ``out_gold``: their eager call on float64 copies of q, k, v (the bias left in its dtype) →
  qkv's ``math`` backend on the same float64 copies;
- ``out_eager``: their eager call in the test's dtype → qkv's ``math`` backend in that dtype;
- ``out_compiled``: their compiled kernel → qkv's ``chunked`` and ``auto`` backends (FlexAttention
  itself has no backward on the CPU, so the ``flex`` engine is not asked for gradients here).

Their rule (``_gold_check``), kept: ``rmse(candidate, gold) <= fudge · rmse(eager, gold)`` with
``fudge = 1.35``, and ten times that in float32, for the output and each gradient; a small
per-dtype floor (tests/helpers.py ``FLOOR``) is added for a baseline that is exact. The
gradients are taken with one shared random cotangent, as theirs. Their parameters: batch 2,
4 heads, head dim 16, sequence lengths 37, 256 and 277, float32, bfloat16 and float16 (theirs
run float16 on CUDA only; both 16-bit types run here). Not ported: the ``max-autotune`` mode
(a compiler setting), ``test_inspect_bug`` and the dynamic-shape and compile-count tests, which
test torch's compiler.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import qkv

from ..helpers import FLOOR

BACKENDS = ["chunked", "auto"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SEQ_LENGTHS = [37, 256, 277]
FUDGE = 1.35


@dataclass(frozen=True)
class Params:
    batch_size: int
    num_heads: int
    seq_length: int
    head_dim: int
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"B{self.batch_size}_H{self.num_heads}_S{self.seq_length}_D{self.head_dim}_{str(self.dtype)[6:]}"


PARAMS = [Params(2, 4, s, 16, d) for d in DTYPES for s in SEQ_LENGTHS]


def _rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.sqrt(torch.mean(torch.square(x.detach().double() - ref.detach().double()))))


def _tensors(p: Params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    make = functools.partial(torch.randn, (p.batch_size, p.num_heads, p.seq_length, p.head_dim), dtype=p.dtype)
    return make().requires_grad_(), make().requires_grad_(), make().requires_grad_()


def _gold_check(eager: torch.Tensor, candidate: torch.Tensor, gold: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    fudge = FUDGE * (10.0 if dtype == torch.float32 else 1.0)
    ref_error, error = _rmse(eager, gold), _rmse(candidate, gold)
    scale = max(1.0, float(gold.detach().abs().max())) if gold.numel() else 1.0
    bound = fudge * ref_error + FLOOR[dtype] * scale
    print(f"{name}: rmse {error:.3e}, eager {ref_error:.3e}, bound {bound:.3e}")
    assert torch.isfinite(candidate).all(), f"{name}: non-finite values"
    assert error <= bound, f"{name}: error {error:.3e} exceeds {fudge} × eager's {ref_error:.3e} (+ floor)"


def _check(
    backend: str, p: Params, fn: Callable, tensors: tuple[torch.Tensor, ...], names: list[str], **kw
) -> None:  # fmt: skip
    """Out and the gradients of ``tensors`` (q, k, v and the biases) on ``backend``, against the
    float64 gold and the same-dtype eager (math) call, with one shared cotangent."""
    q, k, v = tensors[:3]
    gold_qkv = [t.to(torch.float64) for t in (q, k, v)]  # differentiable: gradients flow back to q, k, v
    out_gold = qkv.attention(*gold_qkv, score_mod=fn, backend="math", **kw)
    out_eager = qkv.attention(q, k, v, score_mod=fn, backend="math", **kw)
    out = qkv.attention(q, k, v, score_mod=fn, backend=backend, **kw)
    assert out.grad_fn is not None, "the output is not connected to the graph"
    cotangent = torch.randn(out.shape, dtype=torch.float32).to(out.dtype)
    grads_gold = torch.autograd.grad(out_gold, tensors, cotangent.double())
    grads_eager = torch.autograd.grad(out_eager, tensors, cotangent)
    grads = torch.autograd.grad(out, tensors, cotangent)
    for name, e, c, g in zip(["out", *names], (out_eager, *grads_eager), (out, *grads), (out_gold, *grads_gold), strict=True):
        if name.startswith("grad_bias"):  # a bias's gradient is never silently zero where gold's is not
            assert float(c.abs().max()) > 0 or float(g.abs().max()) == 0, f"{name}: zero gradient"
        _gold_check(e, c, g, name, p.dtype)


NAMES = ["grad_query", "grad_key", "grad_value", "grad_bias"]


def _grid(turn: int) -> pytest.MarkDecorator:
    """Every backend × dtype × length; the quick tier takes one length per backend and dtype,
    in turn (``turn``: each test starts the rotation elsewhere), the slow tier the others."""
    cases = []
    for n, (backend, p) in enumerate((b, p) for b in BACKENDS for p in PARAMS):
        quick = SEQ_LENGTHS.index(p.seq_length) == (n // len(SEQ_LENGTHS) + turn) % len(SEQ_LENGTHS)
        cases.append(pytest.param(backend, p, id=f"{p}-{backend}", marks=() if quick else pytest.mark.slow))
    return pytest.mark.parametrize("backend,params", cases)


@_grid(0)
def test_relative_1d_bias(backend, params):
    q, k, v = _tensors(params)
    bias = torch.randn(2 * params.seq_length, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[torch.abs(q_idx - kv_idx)]

    _check(backend, params, bias_func, (q, k, v, bias), NAMES)


@_grid(1)
def test_absolute_2d_bias(backend, params):
    q, k, v = _tensors(params)
    bias = torch.randn(params.seq_length, params.seq_length, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx, kv_idx]

    _check(backend, params, bias_func, (q, k, v, bias), NAMES)


@_grid(2)
def test_head_specific_bias(backend, params):
    q, k, v = _tensors(params)
    s = params.seq_length
    bias = torch.randn(params.num_heads, s, s, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    _check(backend, params, bias_func, (q, k, v, bias), NAMES)


@_grid(3)
def test_batch_head_bias(backend, params):
    q, k, v = _tensors(params)
    s = params.seq_length
    bias = torch.randn(params.batch_size, params.num_heads, s, s, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx]

    _check(backend, params, bias_func, (q, k, v, bias), NAMES)


@_grid(4)
def test_multiplicative_bias(backend, params):
    q, k, v = _tensors(params)
    bias = torch.randn(params.seq_length, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score * bias[q_idx]

    _check(backend, params, bias_func, (q, k, v, bias), NAMES)


@_grid(5)
def test_local_window_bias(backend, params):
    q, k, v = _tensors(params)
    window = 8
    bias = torch.randn(2 * window + 1, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        offset = torch.clamp(q_idx - kv_idx + window, 0, 2 * window)
        return score + bias[offset]

    _check(backend, params, bias_func, (q, k, v, bias), NAMES)


@_grid(6)
def test_global_tokens_bias(backend, params):
    q, k, v = _tensors(params)
    bias = torch.randn(params.seq_length, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    _check(backend, params, bias_func, (q, k, v, bias), NAMES)


@_grid(7)
def test_symmetric_bias(backend, params):
    q, k, v = _tensors(params)
    bias = torch.randn(params.seq_length, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx] + bias[kv_idx]

    _check(backend, params, bias_func, (q, k, v, bias), NAMES)


@_grid(8)
def test_flipped_indexed_bias(backend, params):
    q, k, v = _tensors(params)
    bias = torch.randn(params.seq_length, params.seq_length, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx, q_idx]

    _check(backend, params, bias_func, (q, k, v, bias), NAMES)


@_grid(9)
def test_head_specific_gate(backend, params):
    q, k, v = _tensors(params)
    gate_score = torch.randn(params.num_heads, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score * torch.sigmoid(gate_score[h].to(torch.float32))

    _check(backend, params, bias_func, (q, k, v, gate_score), NAMES)


@_grid(10)
def test_distinct_biases(backend, params):
    q, k, v = _tensors(params)
    bias1 = torch.randn(params.seq_length, dtype=params.dtype, requires_grad=True)
    bias2 = torch.randn(params.seq_length, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias1[q_idx] + bias2[kv_idx]

    _check(backend, params, bias_func, (q, k, v, bias1, bias2), ["grad_query", "grad_key", "grad_value", "grad_bias1", "grad_bias2"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", [p for p in PARAMS if p.dtype == torch.float32], ids=str)
def test_relative_1d_bias_only_grad(backend, params):
    """Only the bias needs a gradient (q, k and v are plain tensors): the output must still be
    in the graph."""
    q, k, v = (t.detach() for t in _tensors(params))
    bias = torch.randn(2 * params.seq_length, dtype=params.dtype, requires_grad=True)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[torch.abs(q_idx - kv_idx)]

    out_gold = qkv.attention(q.double(), k.double(), v.double(), score_mod=bias_func, backend="math")
    out_eager = qkv.attention(q, k, v, score_mod=bias_func, backend="math")
    out = qkv.attention(q, k, v, score_mod=bias_func, backend=backend)
    assert out.grad_fn is not None
    cotangent = torch.randn_like(out)
    (g_gold,) = torch.autograd.grad(out_gold, bias, cotangent.double())
    (g_eager,) = torch.autograd.grad(out_eager, bias, cotangent)
    (g,) = torch.autograd.grad(out, bias, cotangent)
    _gold_check(out_eager, out, out_gold, "out", params.dtype)
    _gold_check(g_eager, g, g_gold, "grad_bias", params.dtype)
