"""One rule for non-finite inputs (qkv.nonfinite), forward and backward, on every path.

A grid of fixed-seed calls plants a NaN or ±inf in q, k, v, an ALiBi slope or a relative-bias
table entry, under key padding (a fully padded sequence included), causal masks, windows,
block-sparse layouts, grouped-query heads, sinks and decoding shapes. For each call the exact
NaN pattern of out, lse and every gradient (q, k, v, the score function's tensor, the sinks)
is computed on every path that takes it:

- ``math``; ``sdpa`` where it accepts the call; ``auto``;
- ``chunked`` with its C kernels (tile loops, the decoding kernel for few query rows against
  more than 512 keys, the block-sparse layout walk) and with the torch formulation (the C
  library switched off, as tests/backends/test_native_safety.py does);
- ``triton`` through its interpreter (a few small calls: it is slow);

each without gradients (where chunked takes torch's fused kernel or the decoding kernel) and
with them, and compared with the pattern the rule's text gives, computed here from the inputs
alone (:func:`_expected`) — so the paths agree with each other and with the documentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch

import qkv
from qkv import sparse
from qkv import nonfinite_device
from qkv.backends import BackendError, native
from qkv.score_mods import ALiBi, RelativeBias
from qkv.score_mods.relative_bias import relative_buckets

from ..helpers import DEVICE

NAN, INF = float("nan"), float("inf")
NUM_BUCKETS, MAX_DISTANCE = 8, 16  # the relative-bias tables here: (8, Hq), bidirectional


@dataclass
class Case:
    """One call: shapes, where the bad entry goes, and the call's other arguments."""

    name: str
    b: int = 2
    hq: int = 2
    hk: int = 2
    nq: int = 9
    nk: int = 9
    d: int = 8
    dtype: torch.dtype = torch.float32
    plant: tuple = ()  # (tensor name, index, value): "q", "k", "v", "score" (slopes or table)
    kw: dict = field(default_factory=dict)  # is_causal, window, key_padding_mask, attn_mask, ...
    score: Optional[str] = None  # "alibi" or "table"
    sinks: bool = False
    lse: bool = True
    good_rows_loss: bool = False  # the loss reads only good rows: the rule holds whatever dO is
    negative_keys: tuple = ()  # (b, kv head, dim): every key negative there, so q = +inf there meets only -inf
    float_mask: bool = False  # a float attn_mask (Nq, Nk), which may hold the bad entry ("mask")
    seed: int = 0


def _padding(b: int, nk: int, kind: str) -> torch.Tensor:
    kp = torch.ones(b, nk, dtype=torch.bool)
    if kind == "ragged":
        kp[0, nk - 3 :] = False  # the last keys of batch 0 are padding (past its last real key)
    elif kind == "holes":
        kp[0, 1::3] = False
    elif kind == "full":
        kp[0] = False  # batch 0: every key is padding
    return kp


def _cases() -> list[Case]:
    """The grid: each plant under each masking scenario (fixed seeds, one per case)."""
    plants = {
        "q-nan": ("q", (1, 1, 2, 3), NAN),
        "q-inf": ("q", (0, 1, 4, 0), INF),
        "q-neginf": ("q", (1, 0, 0, 5), -INF),
        "k-nan-last": ("k", (0, 1, -1, 2), NAN),  # the last key: causal rows never reach it but one
        "k-inf": ("k", (1, 0, 3, 1), INF),
        "v-neginf-last": ("v", (0, 0, -1, 4), -INF),
        "v-nan": ("v", (1, 1, 2, 0), NAN),
        "alibi-nan": ("score", (1,), NAN),
        "alibi-inf": ("score", (0,), INF),
        "table-nan": ("score", (2, 1), NAN),  # bucket 2: offset -2 (bidirectional, 4 per side)
        "table-inf-far": ("score", (NUM_BUCKETS - 1, 0), INF),  # the last bucket: far keys after the query
    }
    masks: dict[str, dict[str, Any]] = {
        "none": {},
        "causal": {"is_causal": True},
        "bottom-right": {"is_causal": "bottom_right"},
        "window": {"window": (2, 0)},
        "pad-ragged": {"key_padding_mask": "ragged"},
        "pad-holes": {"key_padding_mask": "holes", "is_causal": True},
        "pad-full": {"key_padding_mask": "full"},
    }
    cases = []
    for i, (pname, plant) in enumerate(plants.items()):
        score = "alibi" if pname.startswith("alibi") else "table" if pname.startswith("table") else None
        for j, (mname, kw) in enumerate(masks.items()):
            gqa = (i + j) % 3 == 0
            cases.append(Case(
                f"{pname}/{mname}" + ("/gqa" if gqa else ""), hq=4 if gqa else 2, nq=9, nk=11 if mname == "bottom-right" else 9,
                dtype=torch.float64 if gqa else torch.float32, plant=plant, kw=dict(kw), score=score,
                sinks=(i + j) % 4 == 1, lse=(i + j) % 5 != 2, good_rows_loss=(i + j) % 7 == 3, seed=100 * i + j,
            ))  # fmt: skip
    # a query row with nothing to attend to: +inf meets only negative keys, every product -inf
    for j, (mname, kw) in enumerate(masks.items()):
        cases.append(Case(f"q-inf-meets-negative/{mname}", nk=11 if mname == "bottom-right" else 9, plant=("q", (1, 1, 2, 3), INF),
                          kw=dict(kw), negative_keys=(1, 1, 3), sinks=j % 2 == 0, seed=500 + j))  # fmt: skip
    # a float attn_mask holding NaN or +inf: its row is NaN where the other masks let it see that key
    for i, (pname, plant) in enumerate([("mask-nan-seen", ("mask", (4, 2), NAN)), ("mask-inf-after", ("mask", (2, 6), INF))]):
        for j, mname in enumerate(("none", "causal", "window", "pad-holes", "pad-full")):
            gqa = (i + j) % 2 == 1
            cases.append(Case(f"{pname}/{mname}" + ("/gqa" if gqa else ""), hq=4 if gqa else 2, dtype=torch.float64 if gqa else torch.float32,
                              plant=plant, kw=dict(masks[mname]), float_mask=True, lse=j % 2 == 0, seed=700 + 10 * i + j))  # fmt: skip
    # block-sparse layouts: a bad entry in a key block some row blocks skip
    for i, (pname, plant) in enumerate([
        ("v-inf-skipped", ("v", (0, 1, 56, 0), INF)),  # key block 3: row block 1 skips it
        ("k-nan-skipped", ("k", (1, 0, 20, 3), NAN)),  # key block 1: row blocks 2 and 3 skip it
        ("q-nan", ("q", (0, 0, 50, 1), NAN)),
    ]):  # fmt: skip
        for j, layout in enumerate(("bigbird", "longformer")):
            gqa = (i + j) % 2 == 1
            cases.append(Case(f"layout-{layout}/{pname}" + ("/gqa" if gqa else ""), hq=4 if gqa else 2, nq=64, nk=64,
                              plant=plant, kw={"attn_mask": layout}, lse=j == 0, seed=1000 + 2 * i + j))  # fmt: skip
    # decoding shapes: few query rows against > 512 keys (chunked's decoding kernel without gradients)
    for i, (pname, plant) in enumerate([
        ("q-nan", ("q", (1, 2, 1, 0), NAN)),
        ("k-inf-padded", ("k", (0, 1, 599, 0), INF)),
        ("v-nan-padded", ("v", (0, 0, 598, 2), NAN)),
        ("v-inf", ("v", (1, 1, 10, 2), INF)),
        ("alibi-nan", ("score", (3,), NAN)),
    ]):  # fmt: skip
        for kw in ({"is_causal": "bottom_right"}, {"key_padding_mask": "ragged", "is_causal": "bottom_right"}, {"key_padding_mask": "full"}):
            cases.append(Case(f"decode/{pname}/{'+'.join(kw)}", hq=4, hk=2, nq=2, nk=600, plant=plant, kw=dict(kw),
                              score="alibi" if pname.startswith("alibi") else None, sinks=i % 2 == 1, seed=2000 + i))  # fmt: skip
    return cases


CASES = _cases()


def _inputs(case: Case) -> dict[str, Any]:
    """q, k, v, the score function's tensor and the sinks of a case, the bad entry planted."""
    g = torch.Generator().manual_seed(case.seed)
    t = {
        "q": torch.randn(case.b, case.hq, case.nq, case.d, generator=g, dtype=case.dtype),
        "k": torch.randn(case.b, case.hk, case.nk, case.d, generator=g, dtype=case.dtype),
        "v": torch.randn(case.b, case.hk, case.nk, case.d, generator=g, dtype=case.dtype),
        "score": None,
        "sinks": torch.randn(case.hq, generator=g, dtype=case.dtype) if case.sinks else None,
        "mask": None,
    }
    if case.float_mask:
        t["mask"] = torch.randn(case.nq, case.nk, generator=g, dtype=case.dtype)
    if case.score == "alibi":
        t["score"] = torch.rand(case.hq, generator=g, dtype=torch.float32) * 0.5
    elif case.score == "table":
        t["score"] = torch.randn(NUM_BUCKETS, case.hq, generator=g, dtype=torch.float32)
    if case.negative_keys:
        b, kv, dim = case.negative_keys
        t["k"][b, kv, :, dim] = -t["k"][b, kv, :, dim].abs() - 0.1
    name, index, value = case.plant
    t[name][index] = value
    return t


def _score_mod(case: Case, tensor: Optional[torch.Tensor]):
    if case.score == "alibi":
        return ALiBi(tensor)
    if case.score == "table":
        return RelativeBias(tensor, bidirectional=True, max_distance=MAX_DISTANCE)
    return None


def _masks(case: Case) -> dict[str, Any]:
    kw = dict(case.kw)
    if isinstance(kw.get("key_padding_mask"), str):
        kw["key_padding_mask"] = _padding(case.b, case.nk, kw["key_padding_mask"])
    if kw.get("attn_mask") == "bigbird":  # 4 × 4 blocks of 16, row block 1 skips key block 3, 2 and 3 skip 1
        kw["attn_mask"] = sparse.bigbird(case.nq, 16, 1, 1, 1)
    elif kw.get("attn_mask") == "longformer":  # a window of 4 keys inside the blocks, key 0 global
        kw["attn_mask"] = sparse.longformer(case.nq, 4, [0], block_size=16)
    return kw


# ---- the rule as written, from the inputs alone -------------------------------------------


def _offsets(case: Case) -> torch.Tensor:
    """Every key-minus-query position offset of the call (the score function's alignment
    follows is_causal: bottom-right puts the last query at the last key)."""
    shift = case.nk - case.nq if case.kw.get("is_causal") == "bottom_right" else 0
    i = torch.arange(case.nq)[:, None]
    j = torch.arange(case.nk)[None, :]
    return (j - i - shift).flatten().unique()


def _bias_bad(case: Case, score: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(Hq,) heads whose bias holds a NaN or ±inf at some offset of the call; and for a table,
    the (buckets, Hq) entries the call's offsets reach."""
    if score is None:
        return torch.zeros(case.hq, dtype=torch.bool), None
    off = _offsets(case)
    if case.score == "alibi":
        bias = score[None, :] * off[:, None].float()  # (offsets, Hq)
        return ~torch.isfinite(bias).all(0), None
    buckets = relative_buckets(off, NUM_BUCKETS, MAX_DISTANCE, True).unique()
    reached = torch.zeros(NUM_BUCKETS, case.hq, dtype=torch.bool)
    reached[buckets] = True
    return ~torch.isfinite(score[buckets]).all(0), reached


def _visible(case: Case, b: int) -> torch.Tensor:
    """Bool ``(Nq, Nk)``: the keys batch entry b's rows may see by the causal, window and padding
    rules (from their definitions; the cases with a float mask use no layout)."""
    i = torch.arange(case.nq)[:, None]
    j = torch.arange(case.nk)[None, :]
    p = i + (case.nk - case.nq if case.kw.get("is_causal") == "bottom_right" else 0)  # the row's key position
    see = torch.ones(case.nq, case.nk, dtype=torch.bool)
    if case.kw.get("is_causal"):
        see &= j <= p
    if "window" in case.kw:
        left, right = case.kw["window"]
        see &= (j >= p - left) & (j <= p + right)
    if "key_padding_mask" in case.kw:
        see &= _padding(case.b, case.nk, case.kw["key_padding_mask"])[b][None, :]
    return see


def _made_nan(case: Case, t: dict[str, Any]) -> torch.Tensor:
    """Bool ``(B, Hq, Nq)``: rows a float mask makes NaN by the formula (a NaN or +inf it sees)."""
    made = torch.zeros(case.b, case.hq, case.nq, dtype=torch.bool)
    if t.get("mask") is not None:
        m = t["mask"]
        for b in range(case.b):
            made[b] = ((torch.isnan(m) | (m == INF)) & _visible(case, b)).any(-1)
    return made


def _expected(case: Case, t: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The NaN patterns the rule's text gives (qkv.nonfinite's docstring), written out."""
    group = case.hq // case.hk
    head_bias_bad, reached = _bias_bad(case, t["score"])
    rows = torch.zeros(case.b, case.hq, case.nq, dtype=torch.bool)
    dq = torch.zeros(case.b, case.hq, case.nq, dtype=torch.bool)
    for b in range(case.b):
        for h in range(case.hq):
            kv = h // group
            head_bad = bool(not torch.isfinite(t["k"][b, kv]).all() or not torch.isfinite(t["v"][b, kv]).all() or head_bias_bad[h])
            own = ~torch.isfinite(t["q"][b, h]).all(-1)  # (Nq,): rows bad through their own query
            rows[b, h] = own | head_bad
            if head_bad:
                dq[b, h] = True
            elif own.any():  # NaN, but 0 (nothing to attend to) where every product q·k is -inf, whatever the masks
                products = t["q"][b, h].double() @ t["k"][b, kv].double().T  # (Nq, Nk)
                dq[b, h] = own & ~(products == -INF).all(-1)
    made = _made_nan(case, t)  # rows the formula makes NaN pass NaN on as bad rows do
    rows, dq = rows | made, dq | made
    heads = rows.any(-1)  # (B, Hq): heads with a bad row
    kv_heads = heads.reshape(case.b, case.hk, group).any(-1)  # (B, Hk)
    want = {
        "out": rows[..., None].expand(case.b, case.hq, case.nq, case.d),
        "lse": rows,
        "dq": dq[..., None].expand(case.b, case.hq, case.nq, case.d),
        "dk": kv_heads[..., None, None].expand(case.b, case.hk, case.nk, case.d),
        "dv": kv_heads[..., None, None].expand(case.b, case.hk, case.nk, case.d),
    }
    any_head = heads.any(0)  # (Hq,): over the batch, as the score tensors and sinks are shared
    if case.score == "alibi":
        want["dscore"] = any_head
    elif case.score == "table":
        want["dscore"] = reached & any_head[None, :]
    if case.sinks:
        want["dsinks"] = any_head
    if case.float_mask:
        want["dmask"] = rows.any(0).any(0)[:, None].expand(case.nq, case.nk)  # the mask is shared by batch and heads
    return want


# ---- running the paths ----------------------------------------------------------------------

PATHS = ("math", "sdpa", "auto", "chunked-c", "chunked-torch")


def _run(
    case: Case, t: dict[str, Any], path: str, grad: bool, monkeypatch, device: Optional[str] = None
) -> Optional[dict[str, torch.Tensor]]:
    """NaN patterns of out (, lse) and, with ``grad``, of every gradient on one path (on the CPU
    but for triton, unless ``device`` says); None where the path refuses the call (sdpa)."""
    backend = {"chunked-c": "chunked", "chunked-torch": "chunked"}.get(path, path)
    device = device or (DEVICE if path == "triton" else "cpu")
    want_lse = case.lse and not (path == "sdpa" and (grad or case.hq != case.hk))
    mask_grad = grad and path in ("math", "sdpa", "auto")  # chunked and triton take no gradient to a mask
    leaves = {
        n: (None if x is None else x.detach().clone().to(device).requires_grad_(grad if n != "mask" else mask_grad))
        for n, x in t.items()
    }  # fmt: skip
    kw = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in _masks(case).items()}
    if leaves.get("mask") is not None:
        kw["attn_mask"] = leaves["mask"]
    with monkeypatch.context() as m:
        if path == "chunked-torch":
            m.setattr(native, "library", lambda: None)
        try:
            res = qkv.attention(
                leaves["q"], leaves["k"], leaves["v"], enable_gqa=case.hq != case.hk, return_lse=want_lse, backend=backend,
                score_mod=_score_mod(case, leaves["score"]), sinks=leaves["sinks"], **kw,
            )  # fmt: skip
        except BackendError:
            if path == "sdpa":
                return None
            raise
        out, lse = res if want_lse else (res, None)
        got = {"out": out, "lse": lse}
        if grad:
            _backward(case, out, lse, t)
            got.update(dq=leaves["q"].grad, dk=leaves["k"].grad, dv=leaves["v"].grad)
            if leaves["score"] is not None:
                got["dscore"] = leaves["score"].grad
            if leaves["sinks"] is not None:
                got["dsinks"] = leaves["sinks"].grad
            if leaves.get("mask") is not None and mask_grad:
                got["dmask"] = leaves["mask"].grad
    return {n: torch.isnan(x.detach()).cpu() for n, x in got.items() if x is not None}


def _backward(case: Case, out: torch.Tensor, lse: Optional[torch.Tensor], t: dict[str, Any]) -> None:
    """A loss reaching out and lse with fixed random weights (or only the good rows)."""
    g = torch.Generator().manual_seed(case.seed + 7)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
    if case.good_rows_loss:
        w = w * ~_expected(case, t)["out"].to(out.device)
    loss = (out.nan_to_num() * w).sum() if case.good_rows_loss else (out * w).sum()
    if lse is not None:
        wl = torch.randn(lse.shape, generator=g, dtype=lse.dtype).to(lse.device)
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * wl).sum()
    loss.backward()


def _compare(case: Case, want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], path: str, grad: bool) -> list[str]:
    """Mismatches between a path's patterns and the rule's, one line each."""
    bad = []
    for name, pattern in got.items():
        w = want[name]
        if not torch.equal(pattern, w):
            bad.append(
                f"{case.name} {path} {'backward' if grad else 'forward'} {name}: {int(pattern.sum())} NaN, the rule "
                f"says {int(w.sum())} ({int((pattern & ~w).sum())} extra, {int((w & ~pattern).sum())} missing)"
            )
    return bad


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_path_gives_the_rules_nan_pattern(case, monkeypatch):
    t = _inputs(case)
    want = _expected(case, t)
    # every case plants an entry that makes some row bad, but a float mask's NaN or +inf that
    # every row masks out, which the formula hides (qkv.nonfinite: the formula decides)
    assert want["out"].any() or case.float_mask, "the planted entry makes no row bad"
    problems, ran = [], []
    for grad in (False, True):
        for path in PATHS:
            got = _run(case, t, path, grad, monkeypatch)
            if got is None:
                continue
            ran.append(path)
            problems += _compare(case, want, got, path, grad)
    print(f"{case.name}: ran {sorted(set(ran))}")
    assert not problems, "\n".join(problems)


def test_the_grid_reaches_every_path_and_kernel():
    """sdpa takes part of the grid; chunked's decoding kernel and layout walk are among the
    kernels it runs (without gradients: the decoding kernel; with a layout: the walk); some bad
    query rows have nothing to attend to, so the rule's one exception is exercised."""
    from qkv.backends import BACKENDS
    from qkv.call import validate

    chunked = BACKENDS["chunked"]
    kernels, sdpa_ok = set(), 0
    for case in CASES:
        t = _inputs(case)
        call = validate(t["q"], t["k"], t["v"], enable_gqa=case.hq != case.hk, score_mod=_score_mod(case, t["score"]),
                        sinks=t["sinks"], **_masks(case))  # fmt: skip
        kernels.add(chunked.kernel(call))
        sdpa_ok += not BACKENDS["sdpa"].not_supported_reasons(call)
    print(f"chunked kernels {sorted(kernels)}; sdpa takes {sdpa_ok} of {len(CASES)} calls")
    kept = [c.name for c in CASES if (_expected(c, _inputs(c))["out"][..., 0] & ~_expected(c, _inputs(c))["dq"][..., 0]).any()]
    assert len(kept) >= 5, f"bad query rows with nothing to attend to (their dq the formula's 0): only {kept}"
    assert {"decode", "flash_cpu", "tiles"} <= kernels and sdpa_ok >= len(CASES) // 3
    assert any(c.kw.get("attn_mask") in ("bigbird", "longformer") for c in CASES) and any(c.kw.get("key_padding_mask") == "full" for c in CASES)


# ---- triton (interpreter on a CPU): a few small calls ------------------------------------------

TRITON_CASES = [
    Case("triton/q-nan/causal", b=1, nq=16, nk=16, d=16, plant=("q", (0, 1, 3, 2), NAN), kw={"is_causal": True}, seed=3000),
    Case("triton/k-inf/pad-ragged/gqa", b=2, hq=4, hk=2, nq=16, nk=16, d=16, plant=("k", (0, 1, 15, 0), INF),
         kw={"key_padding_mask": "ragged"}, seed=3001),
    Case("triton/v-nan/pad-full/sinks", b=2, nq=16, nk=16, d=16, plant=("v", (0, 0, 2, 1), NAN),
         kw={"key_padding_mask": "full"}, sinks=True, seed=3002),
    Case("triton/alibi-nan/window", b=1, nq=16, nk=16, d=16, plant=("score", (1,), NAN), kw={"window": (2, 0)},
         score="alibi", seed=3003),
    Case("triton/q-inf-meets-negative/pad-holes", b=2, nq=16, nk=16, d=16, plant=("q", (1, 0, 5, 2), INF),
         kw={"key_padding_mask": "holes", "is_causal": True}, negative_keys=(1, 0, 2), seed=3005),
    Case("triton/mask-inf-seen/causal", b=1, nq=16, nk=16, d=16, plant=("mask", (5, 2), INF), kw={"is_causal": True},
         float_mask=True, seed=3006),
    Case("triton/table-inf/causal", b=1, nq=16, nk=16, d=16, plant=("score", (NUM_BUCKETS - 1, 0), INF),
         kw={"is_causal": True}, score="table", seed=3004),
]  # fmt: skip


@pytest.mark.device
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c.name)
def test_triton_gives_the_rules_nan_pattern(case, monkeypatch):
    pytest.importorskip("triton")
    t = _inputs(case)
    want = _expected(case, t)
    problems = []
    for grad in (False, True):
        for path in ("triton", "math"):
            problems += _compare(case, want, _run(case, t, path, grad, monkeypatch), path, grad)
    assert not problems, "\n".join(problems)


# ---- the rule's GPU kernels (qkv.nonfinite_device) under every engine: a slice of the grid -------------

_KERNEL_QUICK = ("q-nan/causal", "k-inf/pad-holes/gqa", "alibi-nan/bottom-right/gqa", "q-inf-meets-negative/pad-ragged",
                 "mask-nan-seen/causal/gqa")
_KERNEL_SLOW = ("v-neginf-last/pad-full", "table-inf-far/window", "mask-inf-after/pad-full/gqa", "layout-bigbird/k-nan-skipped/gqa",
                "decode/alibi-nan/is_causal")
KERNEL_CASES = [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in _KERNEL_SLOW else []) for c in CASES
                if c.name in _KERNEL_QUICK + _KERNEL_SLOW]  # fmt: skip


@pytest.mark.device
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_the_rules_kernels_give_its_nan_pattern(case, monkeypatch):
    """The calls as on a GPU: one scan, the poison written into the engine's output in place,
    the gradients fixed in place behind the gate (qkv.nonfinite_device), on the test device
    (Triton's interpreter on a CPU), under engines whose backward reads the output they saved."""
    pytest.importorskip("triton")
    monkeypatch.setattr(nonfinite_device, "KERNEL_DEVICES", ("cuda", DEVICE))
    launches: list[str] = []
    launch = nonfinite_device.launch
    monkeypatch.setattr(nonfinite_device, "launch", lambda name, *a, **k: (launches.append(name), launch(name, *a, **k))[1])
    t = _inputs(case)
    want = _expected(case, t)
    problems = []
    for grad in (False, True):
        for path in ("math", "sdpa", "auto", "chunked-torch"):
            got = _run(case, t, path, grad, monkeypatch, device=DEVICE)
            if got is not None:
                problems += _compare(case, want, got, path, grad)
    assert "poison_kernel" in launches and "grads_kernel" in launches
    assert not problems, "\n".join(problems)
