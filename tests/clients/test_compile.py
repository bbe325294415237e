"""``torch.compile(fullgraph=True)`` over ``qkv.attention`` and ``qkv.nn`` modules: one graph,
no breaks, the same values and gradients as eager.

``torch._dynamo.explain`` counts graphs; the compiled runs use the ``aot_eager`` backend, which
traces forward and backward exactly as inductor receives them without spending minutes on
C++ code generation (one inductor run checks the last step)."""

from __future__ import annotations

import pytest
import torch

import qkv

from ..helpers import max_err

CALLS = {
    "causal": {"is_causal": True},
    "window_padding_lse": {"is_causal": True, "window": (9, 0), "key_padding_mask": "padding", "return_lse": True},
    "gqa_bottom_right": {"is_causal": "bottom_right", "enable_gqa": True},
    "float_mask": {"attn_mask": "float"},
}
BACKEND_CALLS = [
    (backend, name)
    for backend in ("auto", "sdpa", "chunked", "math")
    for name in CALLS
    # sdpa refuses lse gradients and shared-head gradients below float64 (documented reasons)
    if not (backend == "sdpa" and name in ("window_padding_lse", "gqa_bottom_right"))
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(name: str, grad: bool):
    g = torch.Generator().manual_seed(0)
    hk = 1 if name == "gqa_bottom_right" else 2
    nq = 24 if name == "gqa_bottom_right" else 40
    q = torch.randn(2, 2, nq, 16, generator=g)
    k, v = torch.randn(2, hk, 40, 16, generator=g), torch.randn(2, hk, 40, 16, generator=g)
    kw = dict(CALLS[name])
    if kw.get("key_padding_mask") == "padding":
        kw["key_padding_mask"] = torch.arange(40)[None] < torch.tensor([[40], [25]])
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(2, 1, nq, 40, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)], kw


def _loss(res):
    out, lse = res if isinstance(res, tuple) else (res, None)
    return out.square().sum() + (0.0 if lse is None else torch.where(torch.isfinite(lse), lse, 0.0).sum())


# auto (what users call) in the quick tier, forward and, for two kinds, backward; the others in
# the slow one
QUICK = {(False, "auto", name) for name in CALLS} | {(True, "auto", "causal"), (True, "auto", "float_mask")}
CASES = [
    pytest.param(backend, name, grad, id=f"{'backward' if grad else 'forward'}-{backend}-{name}",
                 marks=() if (grad, backend, name) in QUICK else pytest.mark.slow)
    for grad in (False, True) for backend, name in BACKEND_CALLS
]  # fmt: skip


@pytest.mark.parametrize("backend,name,grad", CASES)
def test_one_graph_and_eager_results(backend, name, grad):
    (q, k, v), kw = _inputs(name, grad)

    def fn(q, k, v):
        return qkv.attention(q, k, v, backend=backend, **kw)

    context = torch.enable_grad() if grad else torch.no_grad()
    with context:
        explained = torch._dynamo.explain(fn)(q, k, v)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
        want = fn(q, k, v)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert max_err(a, b) < 1e-5
    if grad:
        g_got = torch.autograd.grad(_loss(got), (q, k, v))
        g_want = torch.autograd.grad(_loss(want), (q, k, v))
        for a, b in zip(g_got, g_want):
            assert max_err(a, b) < 1e-4


@pytest.mark.parametrize("module", ["mha", pytest.param("transformer", marks=pytest.mark.slow)])
def test_modules_compile_to_one_graph(module):
    torch.manual_seed(0)
    x = torch.randn(2, 20, 32, requires_grad=True)
    padding = torch.arange(20)[None] < torch.tensor([[20], [13]])
    if module == "mha":
        mha = qkv.nn.MultiHeadAttention(32, 4)
        fn = lambda x: mha(x, is_causal=True, window=(6, 0))[0]  # noqa: E731
    else:
        model = qkv.nn.Transformer(32, 4, num_encoder_layers=2, num_decoder_layers=2, dropout=0.0).eval()
        fn = lambda x: model(x, x[:, :11], src_key_padding_mask=padding, tgt_is_causal=True)  # noqa: E731
    explained = torch._dynamo.explain(fn)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    want = fn(x)
    assert max_err(got, want) < 1e-5
    (g_got,), (g_want,) = torch.autograd.grad(got.square().sum(), x), torch.autograd.grad(want.square().sum(), x)
    assert max_err(g_got, g_want) < 1e-4


@pytest.mark.slow
def test_chunked_under_inductor_matches_eager():
    (q, k, v), kw = _inputs("window_padding_lse", True)

    def fn(q, k, v):
        return qkv.attention(q, k, v, backend="chunked", **kw)

    got, want = torch.compile(fn, fullgraph=True)(q, k, v), fn(q, k, v)
    assert max_err(got[0], want[0]) < 1e-5
    for a, b in zip(torch.autograd.grad(_loss(got), (q, k, v)), torch.autograd.grad(_loss(want), (q, k, v))):
        assert max_err(a, b) < 1e-4
