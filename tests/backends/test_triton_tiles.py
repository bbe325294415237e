"""The Triton kernels' tile structure: interior tiles without masks, boundary tiles with them,
flash-decoding's parts and merge, and the launch table.

In the interpreter tiles are 16×16, so N = 48 already has row blocks with interior tiles on the
left of the causal diagonal, windows whose far edge and diagonal are both boundary tiles, and
padded tails. The tile ranges are checked exhaustively against a brute-force model; the
attention results against ``math`` (float32) and the float64 oracle under the tolerance rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ..helpers import DEVICE, INTERPRETED, assert_within_rule, interpreted_subset, make_qkv, max_err, on_cpu

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import qkv  # noqa: E402
from qkv.backends.triton import backend as launch  # noqa: E402
from qkv.backends.triton import configs  # noqa: E402
from qkv.backends.triton import kernels as K  # noqa: E402
from qkv.reference import attention_ref  # noqa: E402
from qkv.score_mods import ALiBi, Softcap, alibi_slopes  # noqa: E402

from ..rounding_baseline import rounded_attention  # noqa: E402
from .test_triton import _leaves  # noqa: E402

pytestmark = [pytest.mark.device, pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")]


# ---- tile ranges against a brute-force model ------------------------------------------------------


@triton.jit
def _ranges_kernel(Out, Args, BLOCK: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, KEYS: tl.constexpr):
    i = tl.program_id(0)
    a = Args + i * 6
    x0, x1, n, offset, lo, hi = tl.load(a), tl.load(a + 1), tl.load(a + 2), tl.load(a + 3), tl.load(a + 4), tl.load(a + 5)
    if KEYS:  # rows x0..x1-1 over keys [0, n)
        r0, r1, r2, r3 = K._key_range(x0, x1 - 1, x0 * 0, n, offset, lo, hi, BLOCK, HAS_LO, HAS_HI)
    else:  # keys [x0, x1) over rows [0, n)
        r0, r1, r2, r3 = K._query_range(x0, x1, n, offset, lo, hi, BLOCK, HAS_LO, HAS_HI)
    tl.store(Out + i * 4, r0)
    tl.store(Out + i * 4 + 1, r1)
    tl.store(Out + i * 4 + 2, r2)
    tl.store(Out + i * 4 + 3, r3)


def _allowed(i, j, offset, lo, hi):
    return (lo is None or j - i - offset >= lo) and (hi is None or j - i - offset <= hi)


def _tile_sets(r, block):
    start, f_lo, f_hi, end = r
    left = set(range(start, min(f_lo, end), block))
    inner = set(range(f_lo, f_hi, block))
    right = set(range(max(f_hi, f_lo), end, block))
    return left, inner, right


@pytest.mark.parametrize("keys", [True, False], ids=["key_range", "query_range"])
@pytest.mark.parametrize("band", [(None, None), (None, 0), (-9, 0), (-20, 5), (3, None), (-40, -30)], ids=str)
def test_tile_ranges_cover_exactly_and_interior_needs_no_mask(keys, band):
    """Every tile holding an allowed pair is visited once; interior tiles hold only allowed
    pairs for every real row and key (no bounds, no band to check); the interior is as large as
    the band allows (no tile that could be interior is left on a boundary but the edges)."""
    lo, hi = band
    block = 16
    cases = []
    for n_self in (48, 37):  # rows (key_range) or keys (query_range) of the sequence
        for n_other in (48, 29, 70):
            for offset in (0, n_other - n_self):
                for x0 in range(0, n_self, block):
                    cases.append((x0, min(x0 + block, n_self), n_other, offset, lo or 0, hi or 0, n_self))
    args = torch.tensor([c[:6] for c in cases], dtype=torch.int32, device=DEVICE)
    out = torch.empty(len(cases), 4, dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(len(cases),)](out, args, BLOCK=block, HAS_LO=lo is not None, HAS_HI=hi is not None, KEYS=keys)
    inner_total = 0
    for (x0, x1, n, offset, _, _, _), r in zip(cases, out.cpu().tolist()):
        left, inner, right = _tile_sets(r, block)
        assert not (left & inner) and not (inner & right) and not (left & right), (x0, r)
        visited = left | inner | right
        for t in range(0, n, block):
            pairs = [(a, b) for a in range(x0, x1) for b in range(t, min(t + block, n))]
            if not keys:  # (key, row) → (row, key)
                pairs = [(b, a) for a, b in pairs]
            seen = [_allowed(i, j, offset, lo, hi) for i, j in pairs]
            if any(seen):
                assert t in visited, (x0, x1, n, offset, t, r)
            if t in inner:
                assert all(seen), f"interior tile {t} holds a masked pair ({x0}, {n}, {offset}, {r})"
                assert t + block <= n, "an interior tile runs past the end"
        inner_total += len(inner)
    if lo is None or hi is None or hi - lo >= 2 * block - 1:  # wide enough for a whole tile to fit every row
        assert inner_total > 0, "no interior tile at all: the split is not exercised"


# ---- forward and backward across the split, float32 against math ------------------------------


def _fwd_bwd(q, k, v, backend, kw):
    dev = DEVICE if backend == "triton" else "cpu"
    q, k, v = (t.detach().clone().to(dev).requires_grad_(True) for t in (q, k, v))
    kw = {key: (val.to(dev) if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}
    out, lse = qkv.attention(q, k, v, enable_gqa=True, return_lse=True, backend=backend, **kw)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    wl = torch.randn(lse.shape, generator=g)
    ((out.cpu() * w).sum() + (torch.where(torch.isfinite(lse.cpu()), lse.cpu(), 0) * wl).sum()).backward()
    return on_cpu((out.detach(), lse.detach(), q.grad, k.grad, v.grad))


# On a GPU the tiles are 64-128 wide: the lengths and windows grow with them, so the interior
# tiles exist there too (the interpreter's 16-wide tiles see them at the small sizes).
GROW = 1 if INTERPRETED else 8


def _grown(case):
    b, hq, hk, nq, nk, d, kw = case
    kw = dict(kw)
    if "window" in kw:
        kw["window"] = tuple(None if w is None else w * GROW for w in kw["window"])
    return b, hq, hk, nq * GROW if nq > 8 else nq, nk * GROW, d, kw


SPLIT_CASES = {
    "causal": (1, 2, 2, 48, 48, 16, dict(is_causal=True)),
    "causal-br-long-keys": (1, 2, 1, 37, 64, 16, dict(is_causal="bottom_right")),
    "causal-br-long-queries": (1, 2, 2, 64, 37, 16, dict(is_causal="bottom_right")),
    "window-left": (1, 2, 1, 48, 48, 16, dict(window=(20, 0))),
    "window-both": (1, 2, 2, 48, 64, 24, dict(window=(17, 9))),
    "window-br": (1, 4, 2, 33, 80, 16, dict(window=(19, 0), is_causal="bottom_right")),
    "padding": (2, 2, 1, 48, 64, 16, dict(key_padding_mask="kp")),
    "padding-window": (2, 2, 2, 48, 48, 16, dict(key_padding_mask="kp", window=(25, 3))),
    "float-mask-causal": (1, 2, 1, 48, 48, 16, dict(attn_mask="float", is_causal=True)),
    "bool-mask": (1, 2, 2, 40, 48, 16, dict(attn_mask="bool")),
    "softcap-causal": (1, 2, 1, 48, 48, 16, dict(score_mod="softcap", is_causal=True)),
    "alibi-window": (1, 4, 2, 48, 48, 16, dict(score_mod="alibi", window=(21, 0))),
    "sinks-causal": (1, 4, 2, 48, 48, 16, dict(sinks=True, is_causal=True)),
    "head-dim-40": (1, 2, 2, 48, 48, 40, dict(is_causal=True)),
}


def _materialise(kw: dict, b: int, hq: int, nq: int, nk: int, dtype) -> dict:
    g = torch.Generator().manual_seed(7)
    kw = dict(kw)
    if kw.get("key_padding_mask") == "kp":
        kp = torch.rand(b, nk, generator=g) > 0.3
        kp[-1, nk // 2 :] = False  # a padded tail
        kw["key_padding_mask"] = kp
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(nq, nk, generator=g).to(dtype)
    elif kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(b, 1, nq, nk, generator=g) > 0.2
    if kw.get("score_mod") == "softcap":
        kw["score_mod"] = Softcap(2.0)
    elif kw.get("score_mod") == "alibi":
        kw["score_mod"] = ALiBi(alibi_slopes(hq))
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(hq, generator=g)
    return kw


@pytest.mark.parametrize("name", interpreted_subset(list(SPLIT_CASES)))
def test_split_tiles_match_math(name):
    b, hq, hk, nq, nk, d, kw = _grown(SPLIT_CASES[name])
    q, k, v = make_qkv(b, hq, hk, nq, nk, d, dtype=torch.float32)
    kw = _materialise(kw, b, hq, nq, nk, torch.float32)
    got = _fwd_bwd(q, k, v, "triton", kw)
    want = _fwd_bwd(q, k, v, "math", kw)
    for what, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert not torch.isnan(g).any(), what
        scale = max(1.0, float(w[torch.isfinite(w)].abs().max())) if torch.isfinite(w).any() else 1.0
        assert max_err(g, w) <= 2e-5 * scale, (name, what, max_err(g, w))


@pytest.mark.parametrize("name", ["causal-br-long-keys", "window-both", "padding-window"])
def test_split_tiles_bf16_within_rule(name):
    b, hq, hk, nq, nk, d, kw = _grown(SPLIT_CASES[name])
    q64, k64, v64 = make_qkv(b, hq, hk, nq, nk, d, dtype=torch.float64)
    kw = _materialise(kw, b, hq, nq, nk, torch.bfloat16)
    ref_out, _ = attention_ref(q64, k64, v64, enable_gqa=True, return_lse=True, **kw)
    q, k, v = (t.to(torch.bfloat16) for t in (q64, k64, v64))
    base, _ = rounded_attention(q, k, v, enable_gqa=True, **kw)
    out = on_cpu(qkv.attention(*_leaves(q, k, v), enable_gqa=True, backend="triton",
                               **{a: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for a, t in kw.items()}))  # fmt: skip
    assert_within_rule(out, base, ref_out, torch.bfloat16, what=name)


@pytest.mark.slow  # (test_triton.py's determinism test runs in the quick tier)
def test_backward_deterministic_across_the_split():
    q, k, v = make_qkv(1, 4, 2, 48, 64, 16, dtype=torch.bfloat16)
    kw = {"window": (30, 0), "is_causal": "bottom_right"}
    first = _fwd_bwd(q, k, v, "triton", kw)
    second = _fwd_bwd(q, k, v, "triton", kw)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ---- flash-decoding -------------------------------------------------------------------------------


def test_decode_parts_rule():
    assert launch.decode_parts(0, 100, 1, 16, 4, 32) == (4, 32)  # several parts, each whole tiles
    parts, per = launch.decode_parts(0, 8192, 8, 64, 132, 256)
    assert parts * per >= 8192 and per % 64 == 0 and per >= 256 and parts > 1
    assert launch.decode_parts(0, 10, 1000, 64, 132, 256) == (1, 64)  # enough programs already: one part
    assert launch.use_decode(1, 100, 4, False) and launch.use_decode(8, 100, 8, False)
    assert not launch.use_decode(9, 100, 1, False) and not launch.use_decode(1, 100, 1, True) and not launch.use_decode(8, 100, 9, False)


DECODE_CASES = {
    "mqa-1": (1, 4, 1, 1, 100, 16, {}),
    "gqa-3-causal": (2, 8, 2, 3, 90, 24, dict(is_causal="bottom_right")),
    "window": (1, 4, 2, 2, 120, 16, dict(is_causal="bottom_right", window=(40, 0))),
    "padding-sinks": (2, 4, 2, 1, 77, 16, dict(key_padding_mask="kp", sinks=True)),
    "softcap-alibi": (1, 2, 1, 4, 64, 16, dict(score_mod="alibi", is_causal="bottom_right")),
    "softcap": (1, 2, 2, 2, 64, 32, dict(score_mod="softcap")),
    "float-mask": (1, 2, 1, 3, 50, 16, dict(attn_mask="float")),
    "bool-mask": (2, 4, 2, 2, 50, 16, dict(attn_mask="bool")),
}


@pytest.mark.parametrize("name", interpreted_subset(list(DECODE_CASES)))
def test_decode_matches_the_tiled_forward_and_the_oracle(name, monkeypatch):
    b, hq, hk, nq, nk, d, kw = _grown(DECODE_CASES[name])
    q, k, v = make_qkv(b, hq, hk, nq, nk, d, dtype=torch.float32)
    kw = _materialise(kw, b, hq, nq, nk, torch.float32)
    dev_kw = {a: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for a, t in kw.items()}
    res = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("QKV_TRITON_DECODE", mode)
        res[mode] = on_cpu(qkv.attention(*_leaves(q, k, v), enable_gqa=True, return_lse=True, backend="triton", **dev_kw))
    ref_out, ref_lse = attention_ref(q.double(), k.double(), v.double(), enable_gqa=True, return_lse=True,
                                     **{a: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for a, t in kw.items()})  # fmt: skip
    (out, lse), (tiled, tiled_lse) = res["1"], res["0"]
    assert max_err(out, tiled) < 1e-5 and max_err(lse, tiled_lse) < 1e-5
    assert max_err(out, ref_out) < 1e-5 and max_err(lse, ref_lse) < 1e-5
    assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(ref_lse))


@pytest.mark.slow  # 8 s interpreted; a GPU check runs it, and CI's slow tier
def test_decode_bf16_within_rule_and_gradients(monkeypatch):
    """bf16 against the oracle under the rule; a call that needs gradients may decode too (the
    backward reads only out and lse)."""
    monkeypatch.setenv("QKV_TRITON_DECODE", "1")
    q64, k64, v64 = make_qkv(1, 8, 2, 2, 96, 16, dtype=torch.float64)
    kw = dict(is_causal="bottom_right", window=(50, 0))
    ref = attention_ref(q64, k64, v64, enable_gqa=True, **kw)
    q, k, v = (t.to(torch.bfloat16) for t in (q64, k64, v64))
    base, _ = rounded_attention(q, k, v, enable_gqa=True, **kw)
    leaves = _leaves(q, k, v, grad=True)
    out = qkv.attention(*leaves, enable_gqa=True, backend="triton", **kw)
    assert_within_rule(on_cpu(out), base, ref, torch.bfloat16, what="decode bf16")
    out.float().sum().backward()
    monkeypatch.setenv("QKV_TRITON_DECODE", "0")
    again = _leaves(q, k, v, grad=True)
    qkv.attention(*again, enable_gqa=True, backend="triton", **kw).float().sum().backward()
    for a, b in zip(leaves, again):
        assert max_err(a.grad, b.grad) <= 1e-2 * max(1.0, float(b.grad.abs().max()))


def test_decode_empty_rows_and_a_huge_sink(monkeypatch):
    monkeypatch.setenv("QKV_TRITON_DECODE", "1")
    q, k, v = _leaves(*make_qkv(2, 4, 2, 2, 70, 16))
    kp = torch.ones(2, 70, dtype=torch.bool, device=DEVICE)
    kp[1] = False  # batch entry 1 has no key
    out, lse = qkv.attention(q, k, v, key_padding_mask=kp, enable_gqa=True, return_lse=True, backend="triton")
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
    sinks = torch.tensor([0.5, 1e38, float("-inf"), 2.0], device=DEVICE)
    out, lse = qkv.attention(q, k, v, key_padding_mask=kp, sinks=sinks, enable_gqa=True, return_lse=True, backend="triton")
    assert torch.equal(lse[1].cpu(), sinks.cpu()[:, None].expand(4, 2)) and (out[1] == 0).all()
    assert float(lse[0, 1, 0]) == float(sinks[1]) and (out[0, 1] == 0).all()  # the sink takes all the weight
    monkeypatch.setenv("QKV_TRITON_DECODE", "0")
    tiled, tiled_lse = qkv.attention(q, k, v, key_padding_mask=kp, sinks=sinks, enable_gqa=True, return_lse=True, backend="triton")
    assert max_err(out, tiled) < 1e-5 and max_err(lse, tiled_lse) < 1e-5


# ---- the launch table -----------------------------------------------------------------------------


def test_launch_table_has_a_default_for_every_key_and_hopper_tiles():
    for bk in configs.BUCKETS:
        for size in (2, 4):
            for kind in configs.KINDS:
                c = configs.lookup("sm123", bk, bk, size, kind, "band")  # an unknown architecture
                assert c == configs.CONFIGS[("default", bk, size, kind, "any")]
                assert c.BLOCK_N >= 16 and c.BLOCK_M >= 16
    for kind in ("bwd_dkdv", "bwd_dq", "fwd"):
        for bk in (64, 128):
            c = configs.lookup("sm90", bk, bk, 2, kind, "full")
            assert c.BLOCK_M >= 64 and c.num_warps % 4 == 0, (kind, bk, c)  # warp-group matrix instructions
    assert configs.bucket(59, 59) == 64 and configs.bucket(80, 64) == 128 and configs.bucket(256, 8) == 256


def test_rendered_table_pastes_back():
    rows = {("sm90", 128, 2, "fwd", "band"): configs.Config(128, 128, 8, 2, True)}
    text = configs.render(rows)
    ns = {"C": configs.Config}
    exec("T = {\n" + text + "\n}", ns)
    assert ns["T"] == rows
    assert configs.lookup("sm90", 128, 128, 2, "fwd", "band", table={**configs.CONFIGS, **rows}).warp_specialize


def test_override_and_interpreter_configs():
    if INTERPRETED:
        assert launch.launch_config("fwd", 64, 64, 2) == configs.INTERPRETER
    c = configs.Config(32, 16, 2, 1)
    with launch.override("bwd_dq", c):
        assert launch.launch_config("bwd_dq", 64, 64, 2) == c
        assert launch.launch_config("bwd_dkdv", 64, 64, 2) != c or not INTERPRETED
    assert launch.launch_config("bwd_dq", 64, 64, 2) != c


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETED, reason="a GPU runs its own tile sizes")
@pytest.mark.parametrize("tiles", [((128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2)), ((64, 128, 4, 3), (128, 64, 8, 2), (128, 64, 8, 2))],
                         ids=["hopper", "asymmetric"])  # fmt: skip
def test_gpu_tile_sizes_in_the_interpreter(tiles):
    """The launch table's GPU shapes (unequal BLOCK_M and BLOCK_N, a dQ tile clamped for the
    bias gradient) through the interpreter, at lengths where they have interior tiles."""
    fwd, kv, dq = (configs.Config(*t) for t in tiles)
    cases = [dict(is_causal=True), dict(window=(100, 40), is_causal="bottom_right"),
             dict(key_padding_mask=torch.rand(1, 384) > 0.3, is_causal=True), dict(score_mod=ALiBi(alibi_slopes(2)), is_causal=True)]  # fmt: skip
    q, k, v = make_qkv(1, 2, 1, 384, 384, 64, dtype=torch.float32)
    with launch.override("fwd", fwd), launch.override("bwd_dkdv", kv), launch.override("bwd_dq", dq):
        for kw in cases:
            got, want = _fwd_bwd(q, k, v, "triton", kw), _fwd_bwd(q, k, v, "math", kw)
            for what, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                assert max_err(g, w) <= 2e-5 * max(1.0, float(w[torch.isfinite(w)].abs().max())), (list(kw), what)
