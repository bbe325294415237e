"""The built-in score functions (softcap, ALiBi, T5 relative bias) on the chunked backend's C
tile loops (qkv/csrc/flash_impl.h), forward and backward, against the float64 oracle under the
project's rule (docs/guarantees.md): err(C loops) ≤ 2× (outputs) or 3× (gradients) err(math, same
dtype) + floor. Every case asserts that the C loops ran; a Python callable keeps the torch
formulation, which the C loops must agree with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv.backends import tiles
from qkv.backends import chunked_native, native
from qkv.score_mods import ALiBi, RelativeBias, ScoreMod, Softcap, alibi_slopes

from ..helpers import assert_within_rule, make_qkv, mask_kwargs, max_err, param_grid

pytestmark = pytest.mark.skipif(
    native.library() is None or native.gemm(torch.float64) is None, reason=f"native kernels {native.status()} / no BLAS"
)

HQ = 4


class _SoftcapALiBi(ScoreMod):
    """Both parts of a kernel form at once: a softcap, then ALiBi's bias."""

    def __init__(self, cap: float, alibi: ALiBi) -> None:
        self.softcap, self.alibi, self.alignment = cap, alibi, alibi.alignment

    def bias(self, rel, head, dtype):
        return self.alibi.bias(rel, head, dtype)

    def tensors(self):
        return self.alibi.tensors()


def _slopes() -> torch.Tensor:
    return alibi_slopes(HQ).double() * 4  # steep enough that a wrong offset or head shows


def _table(buckets: int) -> torch.Tensor:
    return torch.randn(buckets, HQ, dtype=torch.float64, generator=torch.Generator().manual_seed(buckets))


# name → (values of the learnable tensors in float64, a builder of the function from them)
MODS = {
    "softcap": (lambda: [], lambda: Softcap(3.0)),
    "alibi": (lambda: [_slopes()], lambda s: ALiBi(s)),  # query rows placed by is_causal
    "alibi_top_left": (lambda: [_slopes()], lambda s: ALiBi(s, alignment="top_left")),
    "alibi_bottom_right": (lambda: [_slopes()], lambda s: ALiBi(s, alignment="bottom_right")),
    "alibi_symmetric": (lambda: [_slopes()], lambda s: ALiBi(s, symmetric=True)),
    "softcap_alibi": (lambda: [_slopes()], lambda s: _SoftcapALiBi(4.0, ALiBi(s))),
    "t5_bidirectional": (lambda: [_table(16)], lambda t: RelativeBias(t, bidirectional=True, max_distance=40)),
    "t5_causal": (lambda: [_table(12)], lambda t: RelativeBias(t, bidirectional=False, max_distance=40)),
}


def _masks(kind: str, b: int, nq: int, nk: int) -> dict:
    """The shared scenarios of tests/conftest.py, wider windows for these sizes, and two key
    paddings the C loops treat apart (a trimmed prefix, scattered holes)."""
    if kind == "window":
        return {"window": (23, 9)}
    if kind == "causal_window":
        return {"is_causal": "bottom_right", "window": (40, 0)}
    if kind in ("none", "causal", "bottom_right"):
        return mask_kwargs(kind, b, 1, nq, nk)
    if kind == "ragged":  # real keys form a prefix of each entry (trimmed tile by tile); one entry has none
        lengths = torch.tensor([nk, max(1, nk // 3), 0])[:b]
        return {"key_padding_mask": torch.arange(nk)[None] < lengths[:, None]}
    if kind == "padding":  # holes anywhere, not a prefix
        kp = torch.rand(b, nk, generator=torch.Generator().manual_seed(nk)) > 0.35
        kp[:, 0] = True
        return {"key_padding_mask": kp}
    raise ValueError(kind)


SIZES = [(97, 130), (130, 97), (1, 97), (130, 1), (97, 97), (1, 1), (130, 130)]


def _ident(name: str, value) -> str:
    if name == "dtype":
        return str(value).replace("torch.", "")
    if name in ("sizes", "heads"):
        return "x".join(map(str, value))
    return str(value)


def _fix(row: dict) -> dict:
    if row["masks"] in ("ragged", "padding"):
        row["b"] = max(row["b"], 2)  # batch entries with different keys
    return row


GRID = param_grid(
    {"mod": list(MODS), "masks": ["none", "causal", "bottom_right", "window", "causal_window", "ragged", "padding"],
     "dtype": [torch.float32, torch.float64]},
    {"heads": [(HQ, HQ), (HQ, 2), (HQ, 1)], "sizes": SIZES, "b": [1, 2, 3]},
    _ident,
    _fix,
)  # fmt: skip


class _Taken:
    """Counts the C loops' calls that returned a result (not None: the torch formulation)."""

    def __init__(self, monkeypatch) -> None:
        self.fwd = self.bwd = 0
        real_f, real_b = chunked_native.forward, chunked_native.backward

        def fwd(*a):
            r = real_f(*a)
            self.fwd += r is not None
            return r

        def bwd(*a, **kw):
            r = real_b(*a, **kw)
            self.bwd += r is not None
            return r

        monkeypatch.setattr(chunked_native, "forward", fwd)
        monkeypatch.setattr(chunked_native, "backward", bwd)


def _run(q, k, v, name: str, values: list[torch.Tensor], backend: str, **kw):
    """out, lse and the gradients of q, k, v and of the function's tensors (made from ``values`` in
    the inputs' dtype) for one loss touching out and lse."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    params = [x.to(q.dtype).requires_grad_() for x in values]
    mod = MODS[name][1](*params)
    out, lse = qkv.attention(*leaves, score_mod=mod, backend=backend, return_lse=True, enable_gqa=True, **kw)
    g = torch.Generator().manual_seed(7)
    wo = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    wl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    loss = (out * wo).sum() + (torch.where(torch.isneginf(lse), 0.0, lse) * wl).sum()
    grads = torch.autograd.grad(loss, leaves + params)
    return out.detach(), lse.detach(), list(grads)


def _finite_lse(*lses: torch.Tensor) -> list[torch.Tensor]:
    """Empty rows (lse -inf) must agree; the rule is judged on the others."""
    ref = lses[-1]
    for x in lses[:-1]:
        assert torch.equal(torch.isneginf(torch.as_tensor(x)), torch.isneginf(torch.as_tensor(ref))), "empty rows differ"
    return [torch.where(torch.isneginf(torch.as_tensor(x)), 0.0, torch.as_tensor(x).double()) for x in lses]


@pytest.fixture
def small_tiles(monkeypatch):
    """Several row and key tiles with partial edges (bands plan their own row tiles)."""
    monkeypatch.setattr(tiles, "BLOCK_Q", 32)
    monkeypatch.setattr(tiles, "BLOCK_K", 48)


@pytest.mark.parametrize(*GRID)
def test_builtins_on_the_c_loops_within_the_rule(monkeypatch, small_tiles, mod, masks, dtype, heads, sizes, b):
    hq, hk = heads
    nq, nk = sizes
    q, k, v = make_qkv(b, hq, hk, nq, nk, 16, dv=12, dtype=torch.float64)
    q, k = q * 1.5, k * 1.5  # peaked weights, and scores past a softcap of 3
    qc, kc, vc = (t.to(dtype) for t in (q, k, v))
    q64, k64, v64 = (t.double() for t in (qc, kc, vc))  # the oracle sees the rounded inputs
    values = [x.to(dtype).double() for x in MODS[mod][0]()]
    kw = _masks(masks, b, nq, nk)

    ref_out, ref_lse = qkv.attention_ref(q64, k64, v64, score_mod=MODS[mod][1](*values), enable_gqa=True, return_lse=True, **kw)
    ref_grads = _run(q64, k64, v64, mod, values, "math", **kw)[2]  # gradients: math in float64
    base = _run(qc, kc, vc, mod, values, "math", **kw)
    taken = _Taken(monkeypatch)
    cand = _run(qc, kc, vc, mod, values, "chunked", **kw)
    assert (taken.fwd, taken.bwd) == (1, 1), "the C loops did not run"

    what = f"{mod} {masks} {dtype}"
    ref_out_t = torch.from_numpy(np.ascontiguousarray(ref_out))
    assert_within_rule(cand[0], base[0], ref_out_t, dtype, what=f"{what} out")
    c_lse, b_lse, r_lse = _finite_lse(cand[1], base[1], torch.from_numpy(np.ascontiguousarray(ref_lse)))
    assert_within_rule(c_lse, b_lse, r_lse, dtype, what=f"{what} lse")
    names = ["dq", "dk", "dv", *(["d(slopes)" if "alibi" in mod else "d(table)"] * len(values))]
    for n, gc, gb, gr in zip(names, cand[2], base[2], ref_grads):
        assert_within_rule(gc, gb, gr, dtype, factor=3.0, what=f"{what} {n}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mod", ["softcap", "alibi_bottom_right", "softcap_alibi", "t5_causal"])
def test_c_loops_agree_with_the_torch_formulation(monkeypatch, small_tiles, mod, dtype):
    """The torch formulation in chunked.py stays the reference of what the C loops compute: the
    same numbers up to rounding in sums taken in other orders."""
    q, k, v = make_qkv(2, HQ, 2, 70, 110, 16, dtype=dtype, seed=5)
    values = [x.to(dtype).double() for x in MODS[mod][0]()]
    kp = torch.rand(2, 110, generator=torch.Generator().manual_seed(1)) > 0.2
    for kw in ({}, {"is_causal": "bottom_right", "window": (30, 0), "key_padding_mask": kp}):
        taken = _Taken(monkeypatch)
        fast = _run(q, k, v, mod, values, "chunked", **kw)
        assert (taken.fwd, taken.bwd) == (1, 1)
        monkeypatch.setattr(chunked_native, "forward", lambda *a: None)
        monkeypatch.setattr(chunked_native, "backward", lambda *a, **k_: None)
        slow = _run(q, k, v, mod, values, "chunked", **kw)
        monkeypatch.undo()
        monkeypatch.setattr(tiles, "BLOCK_Q", 32)
        monkeypatch.setattr(tiles, "BLOCK_K", 48)
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        for what, a, e in zip(["out", "lse", "dq", "dk", "dv", "dparam"], [fast[0], fast[1], *fast[2]], [slow[0], slow[1], *slow[2]]):
            scale = max(1.0, float(e[torch.isfinite(e)].abs().max())) if torch.isfinite(e).any() else 1.0
            assert max_err(a, e) <= tol * scale, (mod, kw.keys(), what, max_err(a, e))


def test_a_python_callable_keeps_the_torch_formulation(monkeypatch):
    q, k, v = make_qkv(1, 2, 2, 20, 30, 8, dtype=torch.float64)
    taken = _Taken(monkeypatch)
    out = qkv.attention(q, k, v, backend="chunked", score_mod=lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0))
    assert (taken.fwd, taken.bwd) == (0, 0)
    ref = qkv.attention(q, k, v, backend="chunked", score_mod=Softcap(2.0))
    assert (taken.fwd, taken.bwd) == (1, 0)  # the built-in, without gradients: the C forward
    assert max_err(out, ref) < 1e-12
    from qkv.call import validate
    from qkv.masks.tiles import MaskTiles

    tiles = MaskTiles.from_call(validate(q, k, v, score_mod=lambda s, b, h, i, j: s))
    assert tiles.score is not None and tiles.score.form is None
    assert chunked_native._kernel(q.unsqueeze(2), tiles, "fwd") is None


def test_threads_do_not_change_the_gradients(monkeypatch):
    """d rel is summed per job (one query head of one batch entry), so no two threads write it."""
    q, k, v = make_qkv(2, HQ, 1, 150, 170, 16, seed=3)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_run(q, k, v, "softcap_alibi", MODS["softcap_alibi"][0](), "chunked", is_causal=True))
    finally:
        torch.set_num_threads(before)
    (o1, l1, g1), (o2, l2, g2) = results
    for a, b in zip([o1, l1, *g1], [o2, l2, *g2]):
        assert torch.equal(a, b)


@pytest.mark.slow  # a sweep of 10 s; CI's slow tier runs it
def test_the_kernels_tanh_is_accurate():
    """The 8-lane tanh behind softcapping (csrc/vec.h): relative error ≤ 2.6·2^-24 on every
    float32 in [1/4, 8) (where its two formulas meet) and on a sample below, exact limits."""
    lo, hi = np.float32(0.25).view(np.int32), np.float32(8.0).view(np.int32)
    dense = torch.from_numpy(np.arange(lo, hi, dtype=np.int32).view(np.float32))
    small = torch.from_numpy(np.arange(np.float32(1e-30).view(np.int32), lo, 97, dtype=np.int32).view(np.float32))
    x = torch.cat([dense, -dense, small, -small])
    got, want = native.tanh(x).double(), torch.tanh(x.double())
    rel = ((got - want).abs() / want.abs()).max().item()
    assert rel <= 2.6 * 2.0**-24, rel
    special = torch.tensor([0.0, float("inf"), -float("inf"), 30.0, -1e30, float("nan")])
    got = native.tanh(special)
    assert got[:5].tolist() == [0.0, 1.0, -1.0, 1.0, -1.0] and got[5].isnan()
