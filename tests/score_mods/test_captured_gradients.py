"""Every tensor a Python score function reads gets its gradient, however the function reaches it.

A closure, a default argument, a global, a list, tuple or dict (in either), an attribute of a
plain object, a ``functools.partial``'s argument, a bound method, an ``nn.Module``, a callable
object, a tensor computed from a leaf outside, one the function reaches only on whole tiles:
each backend that runs Python score functions (``math``, ``chunked``, ``auto``, and
``attention_varlen``) must give the gradient ``math`` gives in float64 — never a silent zero
and never an output cut from the graph.
"""

from __future__ import annotations

import functools

import pytest
import torch

import qkv

from ..helpers import max_err

S = 40  # more than one of chunked's tiles with the tile sizes below
TABLE = torch.randn(2 * S, dtype=torch.float64)  # read as a module global (a copy per test, see _global_table)


class _Holder:
    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def score(self, s, b, h, i, j):
        return s + self.table[(i - j).abs()]

    def __call__(self, s, b, h, i, j):
        return s + self.table[(i - j).abs()]


class _Bias(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(2 * S, dtype=torch.float64))

    def forward(self, s, b, h, i, j):
        return s + self.table[(i - j).abs()]


def _global_read(s, b, h, i, j):
    return s + TABLE[(i - j).abs()]


def _partial_target(tables, s, b, h, i, j):
    return s + tables["t"][0][(i - j).abs()]


def _ways(p: torch.Tensor) -> dict:
    """name → (score function reading ``p`` that way, the leaf whose gradient is owed)."""
    d = {"table": p}
    lst, tup = [p], (p,)
    holder = _Holder(p)
    half = p * 0.5  # a tensor computed from the leaf outside the function: the gradient flows on
    ways = {
        "closure": lambda s, b, h, i, j: s + p[(i - j).abs()],
        "list": lambda s, b, h, i, j: s + lst[0][(i - j).abs()],
        "tuple": lambda s, b, h, i, j: s + tup[0][(i - j).abs()],
        "dict": lambda s, b, h, i, j: s + d["table"][(i - j).abs()],
        "nested": lambda s, b, h, i, j: s + {"a": [(None, p)]}["a"][0][1][(i - j).abs()],
        "default": lambda s, b, h, i, j, t=p: s + t[(i - j).abs()],
        "default_list": lambda s, b, h, i, j, t=[p]: s + t[0][(i - j).abs()],  # noqa: B006
        "object_attribute": lambda s, b, h, i, j: s + holder.table[(i - j).abs()],
        "bound_method": holder.score,
        "callable_object": holder,
        "partial": functools.partial(_partial_target, {"t": [p]}),
        "computed_outside": lambda s, b, h, i, j: s + 2.0 * half[(i - j).abs()],
        # reads nothing on its first call (the probe's): the tensor is found while the forward
        # runs, and the call is made again knowing it
        "from_the_second_call": _from_the_second_call(p),
    }
    return ways


def _from_the_second_call(p: torch.Tensor):
    calls = []

    def fn(s, b, h, i, j):
        calls.append(1)
        return s if len(calls) == 1 else s + p[(i - j).abs()]

    return fn


def _grad_of(fn, leaf: torch.Tensor, q, k, v, backend: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    leaf.grad = None
    out = qkv.attention(q, k, v, score_mod=fn, backend=backend, **kw)
    assert out.grad_fn is not None, "the output is cut from the graph"
    out.backward(torch.ones_like(out))
    assert leaf.grad is not None, "no gradient reached the tensor"
    return out.detach(), leaf.grad.clone()


@pytest.fixture
def small_tiles(monkeypatch):
    from qkv.backends import BACKENDS
    from qkv.backends.chunked import ChunkedBackend

    monkeypatch.setitem(BACKENDS, "chunked", ChunkedBackend(block_q=16, block_k=24))


@pytest.mark.parametrize("backend", ["chunked", "auto", "math"])
@pytest.mark.parametrize("way", list(_ways(torch.zeros(1))))
def test_each_way_of_reaching_a_tensor_gets_its_gradient(way, backend, small_tiles):
    q, k, v = (torch.randn(2, 3, S, 8, dtype=torch.float64) for _ in range(3))
    p = torch.randn(2 * S, dtype=torch.float64, requires_grad=True)
    out_ref, g_ref = _grad_of(_ways(p)[way], p, q, k, v, "math", is_causal=True)  # (each call its own graph)
    assert float(g_ref.abs().max()) > 0
    out, g = _grad_of(_ways(p)[way], p, q, k, v, backend, is_causal=True)
    print(f"{way} {backend}: out err {max_err(out, out_ref):.2e}, grad err {max_err(g, g_ref):.2e}")
    assert max_err(out, out_ref) < 1e-12 and max_err(g, g_ref) < 1e-10


@pytest.mark.parametrize("backend", ["chunked", "auto"])
def test_a_global_and_a_module_parameter(backend, monkeypatch):
    q, k, v = (torch.randn(1, 2, S, 8, dtype=torch.float64) for _ in range(3))
    table = torch.randn(2 * S, dtype=torch.float64, requires_grad=True)
    monkeypatch.setitem(globals(), "TABLE", table)
    _, g_ref = _grad_of(_global_read, table, q, k, v, "math")
    _, g = _grad_of(_global_read, table, q, k, v, backend)
    assert max_err(g, g_ref) < 1e-10
    module = _Bias()
    _, g_ref = _grad_of(module, module.table, q, k, v, "math")
    _, g = _grad_of(module, module.table, q, k, v, backend)
    assert max_err(g, g_ref) < 1e-10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_table_in_a_list_sums_its_gradient_in_float32(dtype):
    """A 16-bit table reached through a container is read as its float32 upcast, so its gradient
    is summed over every tile in float32 and rounded once, as directly captured tables are."""
    q, k, v = (torch.randn(2, 4, 200, 16) for _ in range(3))
    p = torch.randn(400, dtype=dtype, requires_grad=True)
    box = [p]
    fn = lambda s, b, h, i, j: s + box[0][(i - j).abs()]  # noqa: E731
    direct = lambda s, b, h, i, j: s + p[(i - j).abs()]  # noqa: E731
    w = torch.randn(2, 4, 200, 16)
    grads = {}
    for name, f, backend in [("list", fn, "chunked"), ("direct", direct, "chunked"), ("gold", fn, "math64")]:
        p.grad = None
        if backend == "math64":
            out = qkv.attention(q.double(), k.double(), v.double(), score_mod=f, backend="math")
        else:
            out = qkv.attention(q, k, v, score_mod=f, backend=backend)
        (out * w.to(out.dtype)).sum().backward()
        grads[name] = p.grad.clone()
    assert torch.equal(grads["list"], grads["direct"])
    err = max_err(grads["list"], grads["gold"])
    print(f"{dtype}: bias gradient error {err:.3e}")
    assert err <= 2 * float(grads["gold"].abs().max()) * torch.finfo(dtype).eps


def test_varlen_passes_each_sequence_its_reads():
    q = torch.randn(50, 2, 8, dtype=torch.float64)
    k, v = torch.randn(50, 2, 8, dtype=torch.float64), torch.randn(50, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 20, 50])
    p = torch.randn(60, dtype=torch.float64, requires_grad=True)
    box = {"p": [p]}
    fn = lambda s, b, h, i, j: s + box["p"][0][(i - j).abs() + 10 * b]  # noqa: E731
    grads = []
    for backend in ("math", "chunked"):
        p.grad = None
        out = qkv.attention_varlen(q, k, v, cu, cu, 30, 30, is_causal=True, score_mod=fn, backend=backend)
        out.sum().backward()
        grads.append(p.grad.clone())
    assert float(grads[0].abs().max()) > 0 and max_err(grads[1], grads[0]) < 1e-10


def test_under_torch_func_the_read_tensor_is_differentiated_on_a_path_that_sees_it():
    """``torch.func.grad`` over a table the function captures: ``auto`` leaves the tile loops
    (which cannot pass a transform's tensors tile by tile) for ``math``; ``chunked`` refuses by name."""
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    p0 = torch.randn(24, dtype=torch.float64)

    def loss(p, backend):
        box = [p]
        return qkv.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + box[0][(i - j).abs()], backend=backend).sum()

    p = p0.clone().requires_grad_()
    loss(p, "math").backward()
    g = torch.func.grad(loss)(p0, "auto")
    assert max_err(g, p.grad) < 1e-10
    with pytest.raises(qkv.BackendError, match="torch.func"):
        torch.func.grad(loss)(p0, "chunked")


def test_a_function_reading_nothing_that_needs_gradients_costs_no_watching():
    """Without gradients, or with no learnable tensor read, the call takes the plain path: the
    output of a call whose inputs need no gradient has none."""
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    fixed = [torch.randn(24)]
    out = qkv.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + fixed[0][(i - j).abs()], backend="chunked")
    assert out.grad_fn is None
