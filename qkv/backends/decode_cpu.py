"""Decoding on the CPU at memory speed: a few query rows against a long key/value cache.

Every generated token makes this call: ``Nq`` = 1 (or a few, for speculative decoding) query
rows per head against the whole cache. The work per cached key is a few dot products, so the
time is the time to read K and V once. ``qkv/csrc/decode.c`` does exactly that:

- one job per key/value head (and per part of its keys, see below) reads each K and V row once,
  in cache order, for all ``R = G·Nq`` query rows that use it (the G query heads of a
  grouped-query group share every load);
- the cache is read in place: a view into a preallocated cache (:class:`qkv.nn.KVCache`,
  transformers' static cache), a head dim broadcast by stride 0, any row stride;
- a bfloat16 or float16 cache is converted to float32 where its entries are used, never as a
  full-size copy; a bfloat16 cache's scores use the processor's bfloat16 dot product where it
  has one (AVX-512 BF16: exact products, float32 sums);
- with several query rows per key/value row the next tile's rows are prefetched into L2, so
  the arithmetic and the reads overlap;
- when there are fewer heads than threads' worth of work, each head's keys are split into
  parts that run on different threads, and the parts' (m, l, O) are merged exactly afterwards
  (flash-decoding).

Masks: the causal/window band (bottom-right for ``Nq < Nk``, as decoding needs), key padding
(ragged batches and preallocated caches stop at each entry's last real key), and sinks. The
kernel sees every entry for the non-finite rule (:mod:`qkv.nonfinite`): those it weighs through
their scores and outputs, those a band or padding skips by one scan, so the rule needs no
second pass over the cache. Calls with gradients, a
score function, an ``attn_mask``, dropout or float64 take the other kernels.

Shapes: q ``(B, Hk, G, Nq, D)``, k ``(B, Hk, 1, Nk, D)``, v ``(B, Hk, 1, Nk, Dv)``;
J = B·Hk jobs of R = G·Nq rows.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any, Optional

import torch

from ..call import AttentionCall
from ..nonfinite import Checked
from . import native
from .tiles import LOG2E

MAX_QUERY_ROWS = 8  # Nq per head: decoding and speculative decoding; longer calls take the tiled kernels
MIN_KEYS_PER_PART = 512  # a part shorter than this costs more to merge than it saves
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_i64, _int, _ptr, _f = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
# qkv_decode_fwd (csrc/decode.c)
ARGS = [_ptr, _ptr, _ptr, _int, *[_i64] * 13, *[_i64, _i64, _int, _int], _ptr, _i64, _ptr, _f, _ptr, _i64, _ptr, _ptr,
        _ptr, _int]  # fmt: skip


def decode_shape(nq: int, nk: int, dtype: torch.dtype) -> bool:
    """The shapes and dtypes the kernel takes (the rest of :func:`can_decode` needs a validated
    call); cheap enough for ``qkv.attention``'s fast path to ask first."""
    return 0 < nq <= MAX_QUERY_ROWS and nk > nq and dtype in _KINDS and _function() is not None


def can_decode(call: AttentionCall) -> bool:
    """Is this a decoding call the kernel runs: CPU, no gradient, Nq ≤ 8 against more keys,
    float32/bfloat16/float16, no ``attn_mask``, score function or dropout, non-empty sizes, and
    the native kernels built?"""
    return (
        call.device.type == "cpu"
        and decode_shape(call.nq, call.nk, call.dtype)
        and call.key.dtype == call.dtype
        and not call.has_attn_mask
        and call.score_mod is None
        and call.dropout_p == 0.0
        and call.batch_size * call.hq * call.d * call.dv > 0
        and not call.requires_grad
    )


@functools.lru_cache(maxsize=None)
def _function() -> Optional[Any]:
    lib = native.library()
    fn = getattr(lib, "qkv_decode_fwd", None) if lib is not None else None
    if fn is not None and fn.argtypes is None:
        fn.argtypes, fn.restype = ARGS, _int
    return fn


def _in_place(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``t (B, Hk, 1, N, X)`` as the kernel reads it: the tensor (rows contiguous) and its batch,
    head and row strides in elements. Views are read where they lie (a stride-0 batch or head dim
    included); only a last dim of stride ≠ 1 is copied."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1), t.stride(3)


def parts_per_head(jobs: int, nk: int, threads: int) -> int:
    """Parts each head's keys are split into: enough jobs for every thread twice over (so the
    last job does not leave threads idle), but none shorter than MIN_KEYS_PER_PART."""
    want = -(-2 * threads // max(jobs, 1))
    return max(1, min(want, nk // MIN_KEYS_PER_PART))


def decode_attention(call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run a call :func:`can_decode` accepts; returns (out, lse or None) in the caller's layout, as a
    :class:`~qkv.nonfinite.Checked` pair when the kernel saw every key and value (the rule applied here)."""
    fn = _function()
    assert fn is not None
    query, scale = call.positive_scale()
    q, k, v = call.grouped_qkv(query)
    b, hk, g, nq, d = q.shape
    nk, dv, j, rows = call.nk, call.dv, b * hk, g * nq
    qc = q.to(torch.float32).reshape(j, rows, d).contiguous()  # row r = g·Nq + i
    kc, ksb, ksh, ks = _in_place(k)
    vc, vsb, vsh, vs = _in_place(v)
    band = native.band_args(*call.positional.band(), nq, nk)
    pad = call.grouped_key_padding()  # (B|1, 1, 1, 1, Nk)
    kpad = klen = None
    pad_rows = 0
    if pad is not None:
        kp = pad.reshape(pad.shape[0], nk)
        kpad = kp.to(torch.uint8).contiguous()
        klen = (kp * torch.arange(1, nk + 1)).amax(-1).contiguous()  # keys past an entry's last real one are skipped
        pad_rows = 0 if pad.shape[0] == 1 else pad.shape[0]
    sinks = None
    if call.sinks is not None:  # (Hq,) → (B, Hk, G, Nq), one per row, natural units in float64: the kernel
        # merges them in double, so a sink of any finite size joins exactly (as sink·log2 e in float32,
        # one above ~2.36e38 would overflow)
        sinks = call.sinks.detach().to(torch.float64).reshape(1, hk, g, 1).expand(b, hk, g, nq).contiguous()
    threads = torch.get_num_threads()
    parts = parts_per_head(j, nk, threads)
    scratch = torch.empty(j * parts * rows * (dv + 2), dtype=torch.float32)
    out = torch.empty(j, rows, dv, dtype=torch.float32)
    lse = torch.empty(j, rows, dtype=torch.float32)
    ptr = native.ptr
    rc = fn(ptr(qc), kc.data_ptr(), vc.data_ptr(), _KINDS[call.dtype], hk, ksb, ksh, vsb, vsh, ks, vs, j, rows, nq, nk,
            d, dv, *band, ptr(kpad), pad_rows, ptr(klen), scale * LOG2E, ptr(sinks), parts, ptr(scratch), ptr(out),
            ptr(lse), threads)  # fmt: skip
    if rc < 0:
        raise MemoryError("qkv: could not allocate a decoding tile per thread")
    out5 = call.ungroup(out.reshape(b, hk, g, nq, dv).to(call.dtype))
    lse5 = call.ungroup(lse.reshape(b, hk, g, nq).to(call.lse_dtype)) if call.return_lse else None  # natural units
    if rc == 0:  # the kernel read every key and value and found them, and the queries, finite
        return Checked(out5, lse5)
    return out5, lse5  # keys skipped (masks) or something non-finite: guard applies the full rule


def bytes_read(call: AttentionCall) -> int:
    """K and V bytes one call reads (each distinct row once): the numerator of its bandwidth."""
    return math.prod(call.key.shape) * call.key.element_size() + math.prod(call.value.shape) * call.value.element_size()
