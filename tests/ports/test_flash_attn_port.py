"""FlashAttention's test suite, ported onto qkv and run on the CPU.

Ported from Dao-AILab/flash-attention, ``tests/test_flash_attn.py`` (commit 0251105a), under its
BSD 3-Clause License: Copyright (c) 2022, the respective contributors, as shown by the AUTHORS
file of that project. All rights reserved. Their reference implementation lives, ported, in
``tests/flash_ref.py`` (which lists where it deliberately differs).

Their API, mapped onto qkv (FlashAttention's layout is ``(B, N, H, D)``, qkv's ``(B, H, N, D)``)::

    flash_attn_func(q, k, v, causal=c, window_size=(l, r), alibi_slopes=s)
      → qkv.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                      attn_mask=ALiBi bias from s (float32), is_causal="bottom_right" if c else False,
                      window=(l, r), window_alignment="bottom_right", enable_gqa=Hq != Hk).transpose(1, 2)
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=c, window_size=w)
      → qkv.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=c, window=w, enable_gqa=...)
    flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=..., cache_leftpad=...)
      → caches filled from the left (``cache_leftpad``, ending at the buffer's end): qkv.nn.KVCache
        appends k_new / v_new, then qkv.attention with its key_padding_mask, bottom-right;
        caches filled from the right (``cache_seqlens``): qkv.attention_varlen over the prefixes.
    *_kvpacked_func / *_qkvpacked_func → the same calls on views of one packed tensor.

FlashAttention aligns causal and local masks bottom-right (query i sits at key i + Nk - Nq); a
window side of -1 is unbounded. Each test runs on qkv's ``auto``, ``chunked`` and ``math``
backends in float16, bfloat16 and float32, the backward pass included wherever theirs has one;
with a CUDA device (tests/device.py) every test but the KV-cache one also runs qkv's ``triton``
kernels there, the tensors copied to the GPU inside :func:`flash_attn_func` (differentiably, so
the CPU-side references and gradients are unchanged).
ALiBi has no varlen form here (``attention_varlen`` takes no ``attn_mask``).

Ported tests (ours ↔ theirs):

- ``test_flash_attn_output`` ↔ ``test_flash_attn_output``, ``test_flash_attn_qkvpacked``
  (``packing``); ALiBi through ``attn_mask``.
- ``test_flash_attn_varlen_output`` ↔ ``test_flash_attn_varlen_output``,
  ``test_flash_attn_varlen_qkvpacked``; padding modes add sequences of length 0.
- ``test_flash_attn_causal`` ↔ ``test_flash_attn_causal`` (the window alignment left to follow
  ``is_causal="bottom_right"``, the spec's default).
- ``test_flash_attn_varlen_causal`` ↔ ``test_flash_attn_varlen_causal`` (no paged KV).
- ``test_flash_attn_splitkv`` ↔ ``test_flash_attn_splitkv`` (long key sequences and their swaps,
  chunked with its default tiles; the log-sum-exp is checked too).
- ``test_flash_attn_kvcache`` ↔ ``test_flash_attn_kvcache`` (no paging, rotary, batch index).
- ``test_flash_attn_race_condition``, ``test_flash_attn_deterministic``,
  ``test_flash_attn_varlen_deterministic``: bit-identical outputs, lse and gradients across runs.
- ``test_flash_attn_bwd_overflow``, ``test_flash_attn_bwd_transpose``,
  ``test_flash_attn_bwd_varlen_overflow`` ↔ theirs (the last also checks values, not only NaN).
- ``test_ported_reference_matches_qkv_oracle``: the port agrees with ``qkv.reference``.

Not ported (qkv has no such feature): dropout with returned softmax, softcap, separate
``alibi_slopes``, paged KV caches, rotary embedding inside the kernel, ``cache_batch_idx``,
``num_splits``, the generator-argument check.

Tolerance rule (theirs, and ../shared/ENGINEERING.md): ``err(qkv) <= 2 · err(pt) + floor`` for
outputs and ``<= 2..3 · err(pt) + floor`` for gradients (each test keeps its own factor), where
``pt`` is their same-dtype PyTorch reference (``upcast=False, reorder_ops=True``) and errors are
measured against the float64 reference on the rounded inputs; ``floor`` is conftest's per-dtype
floor. Max and mean errors are printed before asserting.

Sizes are shrunk to run on a CPU (batch, heads and long sequences about 4× smaller). Their grids
are full cartesian products; here the switches that change semantics (backend, dtype, causal,
local, MQA/GQA) form a full product and every other axis (sequence lengths, head dim, packing,
ALiBi, ...) walks all of its values along that list in a fixed shuffled order (:func:`_grid`).
The chunked backend runs with small tiles (:func:`small_tiles`) so these sizes still cross
tile boundaries; the split-KV test keeps the default tiles. Inputs are fresh every run (conftest
prints the seed); the window sizes, padding lengths and cache lengths drawn are printed too.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

import qkv
from qkv.backends import BACKENDS
from qkv.backends.chunked import ChunkedBackend
from qkv.nn import KVCache

from ..helpers import DEVICE, FLOOR, max_err, on_cpu, on_device, param_grid
from .flash_ref import (
    attention_ref,
    attn_bias_from_alibi_slopes,
    generate_qkv,
    generate_random_padding_mask,
)

BACKEND_NAMES = ["auto", "chunked", "math"]
# + the fused kernels where they run at GPU speed (the interpreter is far too slow for these grids)
KERNEL_BACKENDS = BACKEND_NAMES + (["triton"] if DEVICE == "cuda" else [])
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
MHA_TYPES = ["mha", "mqa", "gqa"]
# FlashAttention's local=True draws window_size = randint(0, seqlen_k, (2,)); we add one side -1
LOCAL = ["global", "local", "local_left_inf", "local_right_inf"]
D_ALL = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]


# ---------------------------------------------------------------------------------------------
# Grids, fixtures and the mapping of FlashAttention's API onto qkv
# ---------------------------------------------------------------------------------------------


def _id(name: str, value) -> str:
    if isinstance(value, bool):
        return name if value else f"no_{name}"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    if name == "d":
        return f"d{value}"
    return f"{name}={value}" if isinstance(value, int) else str(value)


# On a GPU the triton cases compile kernels for each new shape (~13 worker-seconds a case on an
# H200): the GPU check runs every DEVICE_SUBSET-th of each test's triton cases first, a
# representative subset (the walk axes vary along the list, and 7 shares no factor with the
# full axes' sizes, so the subset mixes their values: 46 of 282 cases), and the rest, marked
# heavy, on the time left.
DEVICE_SUBSET = 7
# On the CPU the quick tier runs every CPU_SUBSET-th of each test's other cases (the same walk
# mixes their values); the rest are marked slow, for CI's slow tier.
CPU_SUBSET = 3


def _grid(full: dict, walk: dict, fix=None):
    names, params = param_grid(full, walk, _id, fix)
    triton = [i for i, p in enumerate(params) if "triton" in p.values]
    heavy = {i for n, i in enumerate(triton) if n % DEVICE_SUBSET}
    others = [i for i, p in enumerate(params) if "triton" not in p.values]
    slow = {i for n, i in enumerate(others) if n % CPU_SUBSET}
    marks = {i: pytest.mark.heavy for i in heavy} | {i: pytest.mark.slow for i in slow}
    return names, [pytest.param(*p.values, id=p.id, marks=marks[i]) if i in marks else p for i, p in enumerate(params)]


@pytest.fixture
def small_tiles(monkeypatch):
    """Chunked (also when ``auto`` picks it) with tiles small enough that CPU-sized inputs span
    several of them, and not aligned with the sequence lengths."""
    monkeypatch.setitem(BACKENDS, "chunked", ChunkedBackend(block_q=32, block_k=48))


def draw_window(local: str, seqlen_k: int) -> tuple[int, int]:
    """FlashAttention's ``window_size``: ``(-1, -1)``, or ``randint(0, seqlen_k)`` per side."""
    if local == "global":
        return (-1, -1)
    left, right = (int(w) for w in torch.randint(0, max(1, seqlen_k), (2,)))
    if local == "local_left_inf":
        left = -1
    elif local == "local_right_inf":
        right = -1
    return (left, right)


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), attn_bias=None, backend="auto",
                    return_lse=False, window_alignment="bottom_right"):  # fmt: skip
    """FlashAttention's ``flash_attn_func`` on qkv: q ``(B, Nq, H, D)``, k/v ``(B, Nk, Hk, D)``.

    ``window_alignment=None`` leaves the window to follow ``is_causal`` (bottom-right when causal).
    """
    kw = {"window": tuple(int(w) for w in window_size)}
    if window_alignment is not None and any(w >= 0 for w in kw["window"]):
        kw["window_alignment"] = window_alignment
    if backend == "triton":
        q, k, v, attn_bias = on_device((q, k, v, attn_bias))
    res = qkv.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (B, H, N, D)
        attn_mask=attn_bias, is_causal="bottom_right" if causal else False,
        enable_gqa=q.shape[2] != k.shape[2], return_lse=return_lse, backend=backend, **kw,
    )  # fmt: skip
    res = on_cpu(res)
    if return_lse:
        return res[0].transpose(1, 2), res[1]  # (B, Nq, H, Dv), lse (B, H, Nq)
    return res.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=False, window_size=(-1, -1), backend="auto"):  # fmt: skip
    """FlashAttention's ``flash_attn_varlen_func`` on qkv: q ``(Tq, H, D)``, k/v ``(Tk, Hk, D)``."""
    if backend == "triton":
        q, k, v, cu_seqlens_q, cu_seqlens_k = on_device((q, k, v, cu_seqlens_q, cu_seqlens_k))
    return on_cpu(qkv.attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        is_causal=causal, window=tuple(int(w) for w in window_size),
        enable_gqa=q.shape[1] != k.shape[1], backend=backend,
    ))  # fmt: skip


def _heads_k(nheads: int, mha_type: str, gqa: int) -> int:
    return nheads if mha_type == "mha" else (1 if mha_type == "mqa" else gqa)


def _randn(*shape, dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _packed_inputs(packing: str, b: int, sq: int, sk: int, h: int, hk: int, d: int, dtype) -> list[torch.Tensor]:
    """Fresh inputs as FlashAttention's packed calls take them: ``[q, k, v]``, ``[q, kv]`` or ``[qkv]``."""
    if packing == "qkv":
        return [_randn(b, sq, 3, h, d, dtype=dtype)]  # (B, N, 3, H, D)
    if packing == "kv":
        return [_randn(b, sq, h, d, dtype=dtype), _randn(b, sk, 2, hk, d, dtype=dtype)]  # q, (B, Nk, 2, Hk, D)
    return [_randn(b, sq, h, d, dtype=dtype), _randn(b, sk, hk, d, dtype=dtype), _randn(b, sk, hk, d, dtype=dtype)]


def _unpack(ts, dim: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[q, k, v]`` / ``[q, kv]`` / ``[qkv]`` → ``(q, k, v)`` (views into the packed tensor)."""
    if len(ts) == 1:
        return tuple(ts[0].unbind(dim))  # type: ignore[return-value]
    if len(ts) == 2:
        return (ts[0], *ts[1].unbind(dim))  # type: ignore[return-value]
    return tuple(ts)  # type: ignore[return-value]


def _leaves(ts, dtype=None) -> list[torch.Tensor]:
    return [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in ts]


def _errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max and mean ``|x - ref|`` in float64; equal infinities (an empty row's lse) count as 0."""
    x, ref = x.detach().double(), ref.detach().double()
    assert x.shape == ref.shape, (x.shape, ref.shape)
    if x.numel() == 0:
        return 0.0, 0.0
    d = (x - ref).abs()
    if not torch.isfinite(ref).all():
        d = torch.where(x == ref, 0.0, d)
    return float(d.max()), float(d.mean())


def _rule(what: str, cand, pt, ref, dtype, factor: float, floor: float = 0.0):
    """FlashAttention's check in the house form: None if ``err(cand) <= factor · err(pt) + floor``,
    the floor being the larger of theirs and conftest's per-dtype floor (relative to max |ref|)."""
    (ec, mc), (eb, mb) = _errors(cand, ref), _errors(pt, ref)
    finite = ref.detach()[torch.isfinite(ref.detach())]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    floor = max(floor, FLOOR[dtype] * max(1.0, scale))
    print(f"{what} max diff: {ec:.3e}, mean diff: {mc:.3e}")
    print(f"{what} Pytorch max diff: {eb:.3e}, mean diff: {mb:.3e}")
    if not np.isfinite(ec):
        return f"{what}: non-finite values (NaN or inf where the reference is finite)"
    if ec > factor * eb + floor:
        return f"{what}: error {ec:.3e} > {factor} × {eb:.3e} (PyTorch same-dtype error) + floor {floor:.1e}"
    return None


def _assert_rules(failures) -> None:
    failures = [f for f in failures if f]
    assert not failures, "; ".join(failures)


def _float32_floors(leaves, out, g, p, attn_bias, floors: tuple[float, float]) -> dict[str, float]:
    """Floors for float32 results (ours, beyond FlashAttention's suite, which has no float32):
    rounding a score of size s costs its weight a relative eps·(s + 1), and a kernel that
    recomputes the weights from a stored lse pays it again in the backward; so, as in the fuzz
    judge, each result may be off by ``(2·eps·(max|s| + 1) + eps)`` times its natural scale —
    the root-sum-square of the terms it sums (a gradient that cancels to 0 still has rounding
    noise the size of its terms). ``leaves``: float64 q, k, v ``(B, N, H, D)``; ``p``: the
    reference weights ``(B, H, Nq, Nk)``; ``g``: the output gradient."""
    eps = torch.finfo(torch.float32).eps
    t = lambda x: x.detach().double().abs().transpose(1, 2)  # noqa: E731  (B, H, N, D)
    q, k, v, o, do = t(leaves[0]), t(leaves[1]), t(leaves[2]), t(out), t(g)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = q.shape[-1] ** -0.5
    top = lambda x: float(x.max()) if x.numel() else 0.0  # noqa: E731
    s_max = top(q @ k.transpose(-1, -2)) * scale + (float(attn_bias.abs().max()) if attn_bias is not None else 0.0)
    per_unit = 2 * eps * (s_max + 1) + eps
    p = p.detach().double()
    ds2 = (p * (do @ v.transpose(-1, -2) + (do * o).sum(-1, keepdim=True))) ** 2
    fold = lambda x: x.unflatten(1, (-1, rep)).sum(2)  # noqa: E731  query heads -> key/value heads
    natural = {
        "Output": top(v),
        "dQ": scale * top((ds2 @ k**2).sqrt()),
        "dK": scale * top(fold(ds2.transpose(-1, -2) @ q**2).sqrt()),
        "dV": top(fold((p**2).transpose(-1, -2) @ do**2).sqrt()),
    }
    return {name: max(floors[name != "Output"], per_unit * n) for name, n in natural.items()}


def _check_dense(base, dtype, *, causal, window_size, backend, attn_bias=None, grad_factor=3.0,
                 out_factor=2.0, window_alignment="bottom_right", grad_out=None, floors=(0.0, 0.0)):  # fmt: skip
    """Run qkv (through :func:`flash_attn_func`), the float64 reference and the same-dtype
    PyTorch reference on the same inputs and gradient; compare out, dq, dk, dv by the rule."""
    leaves = _leaves(base)
    out = flash_attn_func(*_unpack(leaves), causal=causal, window_size=window_size, attn_bias=attn_bias,
                          backend=backend, window_alignment=window_alignment)  # fmt: skip
    ref_leaves = _leaves(_unpack(base), torch.float64)
    pt_leaves = _leaves(_unpack(base))
    kw = dict(attn_bias=attn_bias, causal=causal, window_size=window_size)
    out_ref, p_ref = attention_ref(*ref_leaves, **kw)
    out_pt, _ = attention_ref(*pt_leaves, **kw, upcast=False, reorder_ops=True)
    g = torch.randn(out.shape, dtype=torch.float64).to(dtype) if grad_out is None else grad_out
    grads = _unpack(torch.autograd.grad(out, leaves, g))
    grads_ref = torch.autograd.grad(out_ref, ref_leaves, g.double())
    grads_pt = torch.autograd.grad(out_pt, pt_leaves, g)
    floor = dict(zip(("Output", "dQ", "dK", "dV"), (floors[0], *floors[1:] * 3)))
    if dtype == torch.float32:
        floor = _float32_floors(ref_leaves, out_ref, g, p_ref, attn_bias, floors)
    failures = [_rule("Output", out, out_pt, out_ref, dtype, out_factor, floor["Output"])]
    for name, a, b, r in zip(("dQ", "dK", "dV"), grads, grads_pt, grads_ref):
        failures.append(_rule(name, a, b, r, dtype, grad_factor, floor[name]))
    _assert_rules(failures)


def _check_varlen(q, k, v, query_padding_mask, key_padding_mask, dtype, *, causal, window_size, backend,
                  packing="none", grad_factor=3.0, floors=(0.0, 0.0)):  # fmt: skip
    """The varlen form of :func:`_check_dense`: q/k/v padded ``(B, N, H, D)`` with right padding."""
    inp = generate_qkv(q, k, v, query_padding_mask, key_padding_mask)
    unpadded = [inp.q_unpad, inp.k_unpad, inp.v_unpad]
    if packing == "kv":
        unpadded = [inp.q_unpad, torch.stack(unpadded[1:], 1)]  # (Tk, 2, Hk, D)
    elif packing == "qkv":
        unpadded = [torch.stack(unpadded, 1)]  # (T, 3, H, D)
    leaves = _leaves(unpadded)
    print(f"cu_seqlens_q={inp.cu_seqlens_q.tolist()} cu_seqlens_k={inp.cu_seqlens_k.tolist()} window={window_size}")
    out_unpad = flash_attn_varlen_func(
        *_unpack(leaves, dim=1), inp.cu_seqlens_q, inp.cu_seqlens_k, inp.max_seqlen_q, inp.max_seqlen_k,
        causal=causal, window_size=window_size, backend=backend,
    )  # fmt: skip
    out = inp.pad_q(out_unpad)
    ref_leaves = _leaves([inp.q, inp.k, inp.v], torch.float64)
    pt_leaves = _leaves([inp.q, inp.k, inp.v])
    kw = dict(query_padding_mask=query_padding_mask, key_padding_mask=key_padding_mask, causal=causal, window_size=window_size)
    out_ref, p_ref = attention_ref(*ref_leaves, **kw)
    out_pt, _ = attention_ref(*pt_leaves, **kw, upcast=False, reorder_ops=True)
    g = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    dq_u, dk_u, dv_u = _unpack(torch.autograd.grad(out, leaves, g), dim=1)
    grads = (inp.pad_q(dq_u), inp.pad_k(dk_u), inp.pad_k(dv_u))
    grads_ref = torch.autograd.grad(out_ref, ref_leaves, g.double())
    grads_pt = torch.autograd.grad(out_pt, pt_leaves, g)
    floor = dict(zip(("Output", "dQ", "dK", "dV"), (floors[0], *floors[1:] * 3)))
    if dtype == torch.float32:
        floor = _float32_floors(ref_leaves, out_ref, g, p_ref, None, floors)
    failures = [_rule("Output", out, out_pt, out_ref, dtype, 2.0, floor["Output"])]
    for name, a, b, r in zip(("dQ", "dK", "dV"), grads, grads_pt, grads_ref):
        failures.append(_rule(name, a, b, r, dtype, grad_factor, floor[name]))
    _assert_rules(failures)


# ---------------------------------------------------------------------------------------------
# test_flash_attn_output / test_flash_attn_qkvpacked
# ---------------------------------------------------------------------------------------------

# theirs: (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
# (1023, 1024), (1024, 1023), (2048, 2048); a quarter (the last four an eighth, the largest less)
OUTPUT_SEQLENS = [(29, 51), (32, 54), (29, 53), (27, 64), (64, 128), (128, 64), (128, 128), (127, 128), (128, 127), (192, 192)]
OUTPUT_D = [32, 59, 64, 80, 96, 128]


def _fix_packing(row):
    """qkvpacked needs as many key heads as query heads (else kvpacked) and one sequence length
    (the query length is used for both), as in their qkvpacked tests."""
    if row["packing"] == "qkv":
        if row["mha_type"] != "mha":
            row["packing"] = "kv"
        else:
            row["seqlens"] = (row["seqlens"][0], row["seqlens"][0])
    return row


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    *_grid(
        {"backend": KERNEL_BACKENDS, "dtype": DTYPES, "causal": [False, True], "local": LOCAL, "mha_type": MHA_TYPES},
        {"seqlens": OUTPUT_SEQLENS, "d": OUTPUT_D, "packing": ["none", "kv", "qkv"], "alibi": [False, True]},
        fix=_fix_packing,
    )
)
def test_flash_attn_output(backend, dtype, causal, local, mha_type, seqlens, d, packing, alibi):
    seqlen_q, seqlen_k = seqlens
    batch_size, nheads = 2, 6  # theirs: 4, 6
    nheads_k = _heads_k(nheads, mha_type, 2)
    window_size = draw_window(local, seqlen_k)
    print(f"window_size={window_size}")
    base = _packed_inputs(packing, batch_size, seqlen_q, seqlen_k, nheads, nheads_k, d, dtype)
    attn_bias = None
    if alibi:
        slopes = torch.rand(batch_size, nheads) * 0.3
        attn_bias = attn_bias_from_alibi_slopes(slopes, seqlen_q, seqlen_k, causal=causal)
    _check_dense(base, dtype, causal=causal, window_size=window_size, backend=backend, attn_bias=attn_bias)


# ---------------------------------------------------------------------------------------------
# test_flash_attn_varlen_output / test_flash_attn_varlen_qkvpacked
# ---------------------------------------------------------------------------------------------

VARLEN_SEQLENS = [(1, 37), *OUTPUT_SEQLENS]  # theirs add (1, 147)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    *_grid(
        {"backend": KERNEL_BACKENDS, "dtype": DTYPES, "causal": [False, True], "local": LOCAL, "mha_type": MHA_TYPES},
        {"seqlens": VARLEN_SEQLENS, "d": OUTPUT_D, "packing": ["none", "kv", "qkv"],
         "padding": ["random", "third", "empty_q", "empty_k", "full"]},  # fmt: skip
        fix=_fix_packing,
    )
)
def test_flash_attn_varlen_output(backend, dtype, causal, local, mha_type, seqlens, d, packing, padding):
    seqlen_q, seqlen_k = seqlens
    batch_size, nheads = 3, 6  # theirs: 4, 6
    nheads_k = _heads_k(nheads, mha_type, 2)
    window_size = draw_window(local, seqlen_k)
    q, k, v = _packed_inputs("none", batch_size, seqlen_q, seqlen_k, nheads, nheads_k, d, dtype)
    mode_q = {"empty_q": "empty", "third": "third", "full": "full"}.get(padding, "random")
    mode_k = {"empty_k": "empty", "third": "third", "full": "full"}.get(padding, "random")
    query_padding_mask = generate_random_padding_mask(seqlen_q, batch_size, mode_q)
    key_padding_mask = query_padding_mask if packing == "qkv" else generate_random_padding_mask(seqlen_k, batch_size, mode_k)
    _check_varlen(q, k, v, query_padding_mask, key_padding_mask, dtype, causal=causal, window_size=window_size,
                  backend=backend, packing=packing)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# test_flash_attn_causal / test_flash_attn_varlen_causal
# ---------------------------------------------------------------------------------------------

# theirs: (1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217), (113, 211),
# (108, 256), (256, 512), (1023, 1024); the long ones a quarter
CAUSAL_SEQLENS = [(1, 239), (3, 799), (31, 128), (31, 129), (29, 51), (32, 54), (29, 53), (27, 64), (64, 128), (191, 192)]


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    *_grid(
        {"backend": KERNEL_BACKENDS, "dtype": DTYPES, "local": LOCAL, "swap_sq_sk": [False, True]},
        {"seqlens": CAUSAL_SEQLENS, "d": D_ALL},
    )
)
def test_flash_attn_causal(backend, dtype, local, swap_sq_sk, seqlens, d):
    seqlen_q, seqlen_k = seqlens[::-1] if swap_sq_sk else seqlens
    batch_size, nheads = 2, 3  # theirs: 8, 9
    window_size = draw_window(local, seqlen_k)
    print(f"window_size={window_size}")
    base = _packed_inputs("none", batch_size, seqlen_q, seqlen_k, nheads, nheads, d, dtype)
    # the window is left to follow is_causal="bottom_right" (window_alignment=None)
    _check_dense(base, dtype, causal=True, window_size=window_size, backend=backend, grad_factor=2.0,
                 window_alignment=None, floors=(1e-5, 1e-5))  # fmt: skip


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    *_grid(
        {"backend": KERNEL_BACKENDS, "dtype": DTYPES, "local": LOCAL, "swap_sq_sk": [False, True]},
        {"seqlens": CAUSAL_SEQLENS, "d": D_ALL},
    )
)
def test_flash_attn_varlen_causal(backend, dtype, local, swap_sq_sk, seqlens, d):
    seqlen_q, seqlen_k = seqlens[::-1] if swap_sq_sk else seqlens
    batch_size, nheads = 3, 3  # theirs: 8, 9
    window_size = draw_window(local, seqlen_k)
    q, k, v = _packed_inputs("none", batch_size, seqlen_q, seqlen_k, nheads, nheads, d, dtype)
    query_padding_mask = generate_random_padding_mask(seqlen_q, batch_size, "random")
    key_padding_mask = generate_random_padding_mask(seqlen_k, batch_size, "random")
    _check_varlen(q, k, v, query_padding_mask, key_padding_mask, dtype, causal=True, window_size=window_size,
                  backend=backend, grad_factor=2.0, floors=(1e-5, 1e-5))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# test_flash_attn_splitkv: decoding shapes with long key sequences (and their swaps)
# ---------------------------------------------------------------------------------------------

# theirs: (3, 1024), (1, 339), (64, 800), (3, 799), (64, 2048), (16, 20000), (16, 100000),
# (128, 128), (256, 256)
SPLITKV_SEQLENS = [(3, 1024), (1, 339), (64, 800), (3, 799), (64, 2048), (16, 2000), (16, 4000), (128, 128), (256, 256)]


@pytest.mark.parametrize(
    *_grid(
        {"backend": KERNEL_BACKENDS, "dtype": DTYPES, "causal": [False, True], "local": ["global", "local"], "swap_sq_sk": [False, True]},
        {"seqlens": SPLITKV_SEQLENS, "d": D_ALL, "alibi": [False, True]},
    )
)
def test_flash_attn_splitkv(backend, dtype, causal, local, swap_sq_sk, seqlens, d, alibi):
    """Chunked with its default tiles: long keys are many key blocks, merged by the online softmax."""
    seqlen_q, seqlen_k = seqlens[::-1] if swap_sq_sk else seqlens
    batch_size, nheads = 1, 2  # theirs: 1, 12
    window_size = draw_window(local, seqlen_k)
    print(f"window_size={window_size}")
    q, k, v = (t.requires_grad_() for t in _packed_inputs("none", batch_size, seqlen_q, seqlen_k, nheads, nheads, d, dtype))
    attn_bias = None
    if alibi:
        attn_bias = attn_bias_from_alibi_slopes(torch.rand(batch_size, nheads) * 0.3, seqlen_q, seqlen_k, causal=causal)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window_size, attn_bias=attn_bias, backend=backend, return_lse=True)
    ref_leaves, pt_leaves = _leaves([q, k, v], torch.float64), _leaves([q, k, v])
    kw = dict(attn_bias=attn_bias, causal=causal, window_size=window_size, return_lse=True)
    out_ref, _, lse_ref = attention_ref(*ref_leaves, **kw)
    out_pt, _, lse_pt = attention_ref(*pt_leaves, **kw, upcast=False, reorder_ops=True)
    assert lse.shape == (batch_size, nheads, seqlen_q) and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), "lse must be -inf exactly on the empty rows"
    g = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_ref = torch.autograd.grad(out_ref, ref_leaves, g.double())
    grads_pt = torch.autograd.grad(out_pt, pt_leaves, g)
    mult = 2 if not alibi else 8
    failures = [_rule("Output", out, out_pt, out_ref, dtype, 2.0, 1e-5), _rule("LSE", lse, lse_pt, lse_ref, torch.float32, 2.0)]
    for name, a, b, r in zip(("dQ", "dK", "dV"), grads, grads_pt, grads_ref):
        failures.append(_rule(name, a, b, r, dtype, mult, 2e-4))
    _assert_rules(failures)


# ---------------------------------------------------------------------------------------------
# test_flash_attn_kvcache (no paging, rotary or batch index)
# ---------------------------------------------------------------------------------------------

# theirs: (1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
# (1, 128 * 1024), (16, 128 * 1024), (128, 128)
KVCACHE_SEQLENS = [(1, 128), (1, 339), (3, 1024), (16, 200), (16, 64), (3, 799), (16, 512), (16, 1250), (1, 2048), (16, 2048), (32, 32)]
KVCACHE_D = [32, 59, 64, 80, 128, 256]


def _fix_kvcache(row):
    if row["seqlens"][0] > row["seqlens"][1] and row["new_kv"]:
        return None  # theirs skip it too
    if row["layout"] == "right":
        row["alibi"] = False  # attention_varlen takes no attn_mask
    return row


@pytest.mark.parametrize(
    *_grid(
        {"backend": BACKEND_NAMES, "layout": ["left", "right"], "new_kv": [False, True], "causal": [False, True],
         "local": ["global", "local"], "mha_type": MHA_TYPES},
        {"dtype": DTYPES, "seqlens": KVCACHE_SEQLENS, "d": KVCACHE_D, "alibi": [False, True],
         "seqlen_new_eq_seqlen_q": [True, False]},
        fix=_fix_kvcache,
    )  # fmt: skip
)
@pytest.mark.usefixtures("small_tiles")
def test_flash_attn_kvcache(backend, layout, new_kv, causal, local, mha_type, dtype, seqlens, d, alibi, seqlen_new_eq_seqlen_q):
    """``layout="left"``: their ``cache_leftpad`` with the cache filled to the buffer's end, so the
    last real key is the last key and qkv's key_padding_mask + bottom-right is exactly theirs;
    the new keys are appended with :class:`qkv.nn.KVCache`. ``layout="right"``: their default
    ``cache_seqlens`` (a prefix of each row), run as ``attention_varlen`` over the prefixes."""
    seqlen_q, seqlen_k = seqlens
    batch_size, nheads = 2, 6
    nheads_k = _heads_k(nheads, mha_type, 3)
    window_size = draw_window(local, seqlen_k)
    seqlen_new = seqlen_q if seqlen_new_eq_seqlen_q else int(torch.randint(1, seqlen_q + 1, (1,)))
    n_new = seqlen_new if new_kv else 0
    q = _randn(batch_size, seqlen_q, nheads, d, dtype=dtype)
    k_cache, v_cache = (_randn(batch_size, seqlen_k, nheads_k, d, dtype=dtype) for _ in range(2))
    k_new, v_new = (_randn(batch_size, n_new, nheads_k, d, dtype=dtype) for _ in range(2))
    arange = torch.arange(seqlen_k)[None]
    if layout == "left":
        n_old = seqlen_k - n_new
        cache_seqlens = torch.full((batch_size,), n_old)
        cache_leftpad = torch.randint(0, max(1, n_old), (batch_size,))
        key_padding_mask = arange >= cache_leftpad[:, None]
    else:
        cache_seqlens = torch.randint(0 if new_kv else 1, seqlen_k - n_new + 1, (batch_size,))
        cache_leftpad = None
        key_padding_mask = arange < (cache_seqlens + n_new)[:, None]
    print(f"cache_seqlens={cache_seqlens.tolist()} cache_leftpad={cache_leftpad} seqlen_new={n_new} window={window_size}")
    # the reference cache: k_new / v_new written at cache_seqlens (theirs: update_mask)
    k_cache_ref, v_cache_ref = k_cache.clone(), v_cache.clone()
    for b in range(batch_size):
        s = int(cache_seqlens[b])
        k_cache_ref[b, s : s + n_new], v_cache_ref[b, s : s + n_new] = k_new[b], v_new[b]
    attn_bias = None
    if alibi:
        slopes = torch.rand(batch_size, nheads) * 0.3
        attn_bias = attn_bias_from_alibi_slopes(slopes, seqlen_q, seqlen_k, None, key_padding_mask, causal, cache_leftpad)

    if layout == "left":
        cache = KVCache(max_len=seqlen_k)
        t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, N, Hk, D) <-> (B, Hk, N, D)
        if n_old:
            cache.update(t(k_cache[:, :n_old]), t(v_cache[:, :n_old]), key_padding_mask[:, :n_old])
        if new_kv:
            cache.update(t(k_new), t(v_new), key_padding_mask[:, n_old:])
        keys, values, kpm = cache.keys, cache.values, cache.key_padding_mask
        assert torch.equal(t(keys), k_cache_ref) and torch.equal(t(values), v_cache_ref) and torch.equal(kpm, key_padding_mask)
        kw = {"window": window_size}
        if any(w >= 0 for w in window_size):
            kw["window_alignment"] = "bottom_right"
        out = qkv.attention(
            t(q), keys, values, attn_mask=attn_bias, is_causal="bottom_right" if causal else False,
            key_padding_mask=kpm, enable_gqa=nheads != nheads_k, backend=backend, **kw,
        ).transpose(1, 2)  # fmt: skip
    else:
        lens = cache_seqlens + n_new
        k_packed = torch.cat([k_cache_ref[b, : int(lens[b])] for b in range(batch_size)])  # (Tk, Hk, D)
        v_packed = torch.cat([v_cache_ref[b, : int(lens[b])] for b in range(batch_size)])
        cu_q = torch.arange(batch_size + 1, dtype=torch.int32) * seqlen_q
        cu_k = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        out = flash_attn_varlen_func(q.flatten(0, 1), k_packed, v_packed, cu_q, cu_k, seqlen_q, int(lens.max()),
                                     causal=causal, window_size=window_size, backend=backend)  # fmt: skip
        out = out.unflatten(0, (batch_size, seqlen_q))
    kw = dict(key_padding_mask=key_padding_mask, attn_bias=attn_bias, causal=causal, window_size=window_size, key_leftpad=cache_leftpad)
    out_ref, _ = attention_ref(q, k_cache_ref, v_cache_ref, **kw)
    out_pt, _ = attention_ref(q, k_cache_ref, v_cache_ref, **kw, upcast=False, reorder_ops=True)
    mult = 3 if not alibi else 5
    _assert_rules([_rule("Output", out, out_pt, out_ref, dtype, mult, 1e-5)])


# ---------------------------------------------------------------------------------------------
# Determinism: test_flash_attn_race_condition, test_flash_attn_deterministic (+ varlen)
# ---------------------------------------------------------------------------------------------

# theirs: (1, 239), (239, 1), (3, 799), (799, 3), (1024, 128), (97, 97), (128, 128), (200, 200),
# (256, 256), (257, 257), (384, 384), (512, 512), (768, 768), (1024, 1024)
RACE_SEQLENS = [(1, 239), (239, 1), (3, 799), (799, 3), (256, 32), (97, 97), (128, 128), (200, 200), (64, 64), (65, 65),
                (96, 96), (127, 127), (192, 192), (255, 255)]  # fmt: skip
REPEATS = 3  # theirs: 250 (race), 50 (deterministic); qkv on a CPU has no atomics to race


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    *_grid({"backend": KERNEL_BACKENDS, "causal": [False, True], "dtype": DTYPES}, {"seqlens": RACE_SEQLENS, "d": D_ALL})
)
def test_flash_attn_race_condition(backend, causal, dtype, seqlens, d):
    seqlen_q, seqlen_k = seqlens
    batch_size, nheads = 3, 2  # theirs: 60, 4
    q, k, v = (t.requires_grad_() for t in _packed_inputs("none", batch_size, seqlen_q, seqlen_k, nheads, nheads, d, dtype))
    out0, lse0 = flash_attn_func(q, k, v, causal=causal, backend=backend, return_lse=True)
    g = torch.randn_like(out0)
    dq0, dk0, dv0 = torch.autograd.grad(out0, (q, k, v), g)
    assert not any(t.isnan().any() for t in (out0, dq0, dk0, dv0))
    for i in range(REPEATS):
        out, lse = flash_attn_func(q, k, v, causal=causal, backend=backend, return_lse=True)
        assert torch.equal(out, out0), f"iteration {i}: output differs"
        assert torch.equal(lse, lse0), f"iteration {i}: lse differs"
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
        # theirs allow dQ an atomic-add tolerance; on the CPU nothing excuses a difference
        assert torch.equal(dv, dv0) and torch.equal(dk, dk0) and torch.equal(dq, dq0), f"iteration {i}: gradients differ"


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    *_grid(
        {"backend": KERNEL_BACKENDS, "causal": [False, True], "local": ["global", "local"]},
        {"dtype": DTYPES, "swap_sq_sk": [False, True], "seqlens": CAUSAL_SEQLENS, "d": D_ALL},
    )
)
def test_flash_attn_deterministic(backend, causal, local, dtype, swap_sq_sk, seqlens, d):
    seqlen_q, seqlen_k = seqlens[::-1] if swap_sq_sk else seqlens
    batch_size, nheads = 2, 3  # theirs: 4, 9
    window_size = draw_window(local, seqlen_k)
    print(f"window_size={window_size}")
    q, k, v = (t.requires_grad_() for t in _packed_inputs("none", batch_size, seqlen_q, seqlen_k, nheads, nheads, d, dtype))
    out = flash_attn_func(q, k, v, causal=causal, window_size=window_size, backend=backend)
    g = torch.randn_like(out)
    dq0, dk0, dv0 = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    for _ in range(REPEATS):
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        assert torch.equal(dv, dv0) and torch.equal(dk, dk0) and torch.equal(dq, dq0)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    *_grid(
        {"backend": KERNEL_BACKENDS, "causal": [False, True], "local": ["global", "local"]},
        {"dtype": DTYPES, "swap_sq_sk": [False, True], "seqlens": CAUSAL_SEQLENS, "d": D_ALL},
    )
)
def test_flash_attn_varlen_deterministic(backend, causal, local, dtype, swap_sq_sk, seqlens, d):
    seqlen_q, seqlen_k = seqlens[::-1] if swap_sq_sk else seqlens
    batch_size, nheads = 2, 3  # theirs: 2, 9
    window_size = draw_window(local, seqlen_k)
    q, k, v = _packed_inputs("none", batch_size, seqlen_q, seqlen_k, nheads, nheads, d, dtype)
    inp = generate_qkv(q, k, v, generate_random_padding_mask(seqlen_q, batch_size), generate_random_padding_mask(seqlen_k, batch_size))
    print(f"cu_seqlens_q={inp.cu_seqlens_q.tolist()} cu_seqlens_k={inp.cu_seqlens_k.tolist()} window={window_size}")
    out = flash_attn_varlen_func(inp.q_unpad, inp.k_unpad, inp.v_unpad, inp.cu_seqlens_q, inp.cu_seqlens_k,
                                 inp.max_seqlen_q, inp.max_seqlen_k, causal=causal, window_size=window_size, backend=backend)  # fmt: skip
    g = torch.randn_like(out)
    leaves = (inp.q_unpad, inp.k_unpad, inp.v_unpad)
    dq0, dk0, dv0 = torch.autograd.grad(out, leaves, g, retain_graph=True)
    for _ in range(REPEATS):
        dq, dk, dv = torch.autograd.grad(out, leaves, g, retain_graph=True)
        assert torch.equal(dv, dv0) and torch.equal(dk, dk0) and torch.equal(dq, dq0)


# ---------------------------------------------------------------------------------------------
# Backward regressions: test_flash_attn_bwd_overflow, _bwd_transpose, _bwd_varlen_overflow
# ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    *_grid({"backend": KERNEL_BACKENDS, "causal": [False, True], "d": [16, 32, 64], "seqlen": [1, 2, 5, 17, 128]}, {"dtype": DTYPES})
)
def test_flash_attn_bwd_overflow(backend, causal, d, seqlen, dtype):
    """Large scores (q·5, k·3) and lengths off the tile size must not put NaN in dQ."""
    batch_size, nheads = 2, 5
    q = _randn(batch_size, seqlen, nheads, d, dtype=dtype) * 5
    k, v = (_randn(batch_size, seqlen, nheads, d, dtype=dtype) * 3 for _ in range(2))
    # Ours: float32 too. Scores reach the hundreds here, where which products round which way
    # decides a weight to eps·|s| in any float32 implementation, so the output floor holds that
    # (the fuzz judge's large-logit allowance); 16-bit keeps theirs (0: P rounds far coarser).
    out_floor = 0.0
    if dtype == torch.float32:
        s_max = float((q.double().transpose(1, 2) @ k.double().permute(0, 2, 3, 1)).abs().max()) / d**0.5
        out_floor = 2 * torch.finfo(dtype).eps * (s_max + 1) * float(v.abs().max())
    _check_dense([q, k, v], dtype, causal=causal, window_size=(-1, -1), backend=backend, grad_factor=5.0, floors=(out_floor, 1e-3))


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    *_grid({"backend": KERNEL_BACKENDS, "causal": [False, True], "d": [64, 128], "seqlen": [97, 128, 200, 256]}, {"dtype": DTYPES})
)
def test_flash_attn_bwd_transpose(backend, causal, d, seqlen, dtype):
    """A non-contiguous output gradient (theirs: the wrong strides of dout were read once)."""
    batch_size, nheads = 2, 2  # theirs: 5, 2
    base = _packed_inputs("none", batch_size, seqlen, seqlen, nheads, nheads, d, dtype)
    # (B, N, H, D) viewed from a (N, 2B, H, D) buffer: every other batch row, sequence-major
    g = _randn(seqlen, 2 * batch_size, nheads, d, dtype=dtype)[:, ::2].transpose(0, 1)
    assert not g.is_contiguous()
    _check_dense(base, dtype, causal=causal, window_size=(-1, -1), backend=backend, grad_factor=2.0, grad_out=g)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(*_grid({"backend": KERNEL_BACKENDS, "causal": [False, True], "d": [16, 32, 64]}, {"dtype": DTYPES}))
def test_flash_attn_bwd_varlen_overflow(backend, causal, d, dtype):
    """Key sequences of one row against long query sequences: no NaN, and the right values."""
    nheads = 5
    cu_q = torch.tensor([0, 76, 110, 256], dtype=torch.int32)
    cu_k = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    q = (_randn(256, nheads, d, dtype=dtype) * 3).requires_grad_()
    k, v = ((_randn(3, nheads, d, dtype=dtype) * 3).requires_grad_() for _ in range(2))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 256, 3, causal=causal, backend=backend)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    assert not any(t.isnan().any() for t in (out, dq, dk, dv))
    # beyond theirs: per sequence, the query rows 0..Nq-2 see nothing when causal (bottom-right)
    for s in range(3):
        rows = slice(int(cu_q[s]), int(cu_q[s + 1]))
        qs, ks, vs = (x.detach().double()[None] for x in (q[rows], k[s : s + 1], v[s : s + 1]))  # (1, N, H, D)
        want, _ = attention_ref(qs, ks, vs, causal=causal)
        assert max_err(out[rows], want[0]) <= FLOOR[dtype] * 10 * max(1.0, float(want.abs().max())), f"sequence {s}"


# ---------------------------------------------------------------------------------------------
# The port itself: FlashAttention's reference agrees with qkv's float64 oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seqlens", [(5, 9), (9, 5), (1, 7), (7, 1), (8, 8)])
@pytest.mark.parametrize("local", LOCAL)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("leftpad", [False, True])
def test_ported_reference_matches_qkv_oracle(causal, local, seqlens, leftpad):
    """Bottom-right causal and windows (``window_alignment="bottom_right"``), ALiBi as a float
    mask, GQA, and a left-padded key_padding_mask mean the same thing in both references."""
    seqlen_q, seqlen_k = seqlens
    batch_size, nheads, nheads_k, d = 2, 4, 2, 8
    q, k, v = _packed_inputs("none", batch_size, seqlen_q, seqlen_k, nheads, nheads_k, d, torch.float64)
    window_size = draw_window(local, seqlen_k)
    key_leftpad = torch.randint(0, seqlen_k, (batch_size,)) if leftpad else None
    kpm = torch.arange(seqlen_k)[None] >= key_leftpad[:, None] if leftpad else None
    bias = attn_bias_from_alibi_slopes(torch.rand(batch_size, nheads) * 0.3, seqlen_q, seqlen_k, None, kpm, causal, key_leftpad)
    out, _, lse = attention_ref(q, k, v, key_padding_mask=kpm, attn_bias=bias, causal=causal, window_size=window_size,
                                key_leftpad=key_leftpad, return_lse=True)  # fmt: skip
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    want, want_lse = qkv.reference.attention_ref(
        t(q), t(k), t(v), attn_mask=bias.double(), is_causal="bottom_right" if causal else False, window=window_size,
        window_alignment="bottom_right", key_padding_mask=kpm, enable_gqa=True, return_lse=True,
    )  # fmt: skip
    assert max_err(t(out), want) < 1e-12
    assert max_err(lse, want_lse) < 1e-12
