"""Flash-decoding in Triton: a few query rows against a long key/value cache, at memory speed,
with the non-finite rule (:mod:`qkv.nonfinite`) folded into the loads.

Every generated token makes this call: ``Nq`` = 1 (or a few, for speculative decoding) query
rows per head against the whole cache, so its time is the time to read K and V once. The layout
mirrors the CPU kernel (``qkv/csrc/decode.c``, :mod:`qkv.backends.decode_cpu`):

- ``decode_kernel``: grid ``(parts, B·Hk)``. One program takes one part of the keys of one
  key/value head for all ``R = G·Nq`` query rows that read it (row ``r`` is query head
  ``g = r // Nq`` at position ``i = r % Nq``), so each K and V tile is loaded once for the whole
  grouped-query group, as one ``(R, BLOCK_N)`` score tile (``R`` padded to ``BLOCK_M`` ≥ 16 for
  ``tl.dot``; padding rows repeat row ``R - 1`` and are never stored). It writes the part's
  unnormalised ``O_s``, base-2 ``m_s`` and ``l_s`` (fp32) for the ``R`` real rows.
- ``decode_merge_kernel``: grid ``(B·Hk,)``. The parts' exact merge, in natural units so that a
  sink of any finite size takes part: ``M = max(sink, m_s·ln 2)``, ``L = e^(sink − M) + Σ l_s
  e^(m_s·ln 2 − M)``, ``O = Σ O_s e^(m_s·ln 2 − M) / L``, ``lse = M + ln L``; a row with no key
  gives 0 and ``-inf``.
- The parts (:func:`.backend.decode_parts`) are whole tiles, enough of them for several programs
  per SM (``DECODE_PROGRAMS_PER_SM``), so the last wave leaves few SMs idle; a part's rows in
  the float32 workspace are the ``R`` real ones.

Keys each program scores: its part of the band the rows can see, in three runs as the forward
kernel's (boundary tiles masked; interior tiles, inside every row's band and the cache, loaded
with no bounds check). Masks: causal/window bands (bottom-right for ``Nq < Nk``), key padding,
a dense bool or float ``attn_mask``; built-in score functions (softcap, a relative bias such as
ALiBi or T5's) and sinks, as :mod:`.kernels` documents them.

**The non-finite rule** (``CHECK``). The rule makes a row bad when its query holds a NaN or
±inf, when any key or value of its (batch, key/value head) does — masked or not — or when its
head's bias does at any offset of the call. So with ``CHECK`` the parts cover the whole cache,
not only the band: tiles no row can see are loaded and checked without being scored, and the
bias is read at every in-bounds key, masked ones included (the union over parts and rows is
every offset ``j - i``). The check is a max over each tile's raw bits with the sign cleared: a
NaN or ±inf is an all-ones exponent, at or above the bits of +inf (``INF_BITS``: 0x7F80 for
bfloat16, 0x7C00 for float16, 0x7F800000 for float32; the bias is float32). Each part writes
one int32 of flags per row (1: its query, 2: the head's keys or values, 4: the bias it read);
the merge ORs them over the parts and the rows of each query head, writes NaN into the output
and lse of every bad row, and NaN into the lse of any row whose output came out NaN (a float
mask's NaN or +inf). The result follows the rule with no other pass over the inputs, no
tensor of their size and no host sync (:class:`qkv.nonfinite.Checked`). Without ``CHECK`` (a
call with gradients, where :func:`qkv.nonfinite.guard` applies the rule) only the band is read.

Numerics as in :mod:`.kernels`: fp32 scores and statistics in base 2, ``P`` rounded to the
input dtype before ``P @ V``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import key_range, tanh


@triton.jit
def _worst(x):
    """Per row of the tile ``x``: the largest magnitude as raw bits (sign cleared), int32; the row
    holds a NaN or ±inf exactly when this is at least the bits of +inf."""
    if x.dtype.primitive_bitwidth == 16:
        bits = x.to(tl.int16, bitcast=True) & 0x7FFF
    else:
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(bits, 1).to(tl.int32)


@triton.jit
def _tiles(
    acc, l_i, m_i, kv_worst, rel_worst, q, k_base, v_base, start, end, i, row_ok, offs_n0, offs_d, offs_dv,
    stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
    kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
    BOUNDARY: tl.constexpr, SCORE: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_KP: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REL: tl.constexpr, CHECK: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The key tiles ``[start, end)`` (a multiple of ``BLOCK_N`` apart). With ``SCORE``: online
    softmax into the running ``(acc, l, m)`` of base-2 scores ``(f(q·kᵀ·scale) + bias)·log2 e``,
    -inf where masked, as the forward kernel's; without, the tiles are only read for the rule.
    ``BOUNDARY``: loads bounded by the cache and scores by the band; else (an interior tile) every
    key is in bounds and in every row's band. With ``CHECK`` every K and V tile read joins
    ``kv_worst`` (per tile row) and the bias, read at every in-bounds key before the masks apply,
    ``rel_worst`` (per row).
    Kept whole: the interpreter pays for every nested call, once per tile here (the tests run it)."""
    for n0 in tl.range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        kv_ptrs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        vv_ptrs = offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        if BOUNDARY:
            k = tl.load(k_base + kv_ptrs, mask=(offs_n[:, None] < nk) & (offs_d[None, :] < D), other=0.0)
            v = tl.load(v_base + vv_ptrs, mask=(offs_n[:, None] < nk) & (offs_dv[None, :] < DV), other=0.0)
        else:
            if EVEN_D:
                k = tl.load(k_base + kv_ptrs)
            else:
                k = tl.load(k_base + kv_ptrs, mask=offs_d[None, :] < D, other=0.0)
            if EVEN_DV:
                v = tl.load(v_base + vv_ptrs)
            else:
                v = tl.load(v_base + vv_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
        if CHECK:  # magnitudes as raw bits (module docstring)
            if k.dtype.primitive_bitwidth == 16:
                k_bits = tl.max(k.to(tl.int16, bitcast=True) & 0x7FFF, 1).to(tl.int32)
                v_bits = tl.max(v.to(tl.int16, bitcast=True) & 0x7FFF, 1).to(tl.int32)
            else:
                k_bits = tl.max(k.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1)
                v_bits = tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1)
            kv_worst = tl.maximum(kv_worst, tl.maximum(k_bits, v_bits))
        if HAS_REL and (CHECK or SCORE):
            if BOUNDARY:
                rv = tl.load(rel_rows[:, None] + offs_n[None, :], mask=(offs_n < nk)[None, :], other=0.0)
            else:
                rv = tl.load(rel_rows[:, None] + offs_n[None, :])
            if CHECK:
                rel_worst = tl.maximum(rel_worst, tl.max(rv.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1))
        if SCORE:
            if UPCAST:  # (see kernels.dot)
                qk = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k), input_precision=FP32_DOT)
            if SOFTCAP:
                s = (tanh((qk * qk_scale) * cap_in) * cap_log2) * 2.0
            else:
                s = qk * qk_scale
            if HAS_REL:
                s += rv * 1.44269504  # 1/ln 2: the bias is in natural-log units
            if BOUNDARY:
                ok = row_ok[:, None] & (offs_n[None, :] < nk)
                rel = offs_n[None, :] - (i[:, None] + offset)  # key position relative to the query's
                if HAS_LO:
                    ok = ok & (rel >= lo)
                if HAS_HI:
                    ok = ok & (rel <= hi)
                if HAS_KP:
                    ok = ok & (tl.load(kp_row + offs_n * stride_kpn, mask=offs_n < nk, other=0) != 0)[None, :]
                if HAS_MASK:
                    mv = tl.load(m_rows[:, None] + offs_n[None, :] * stride_mn, mask=ok, other=0)
                    if MASK_BOOL:
                        ok = ok & (mv != 0)
                    else:
                        s += mv.to(tl.float32) * 1.44269504  # 1/ln 2
                s = tl.where(ok, s, float("-inf"))
            else:
                if HAS_MASK:
                    mv = tl.load(m_rows[:, None] + offs_n[None, :] * stride_mn)
                    if MASK_BOOL:
                        s = tl.where(mv != 0, s, float("-inf"))
                    else:
                        s += mv.to(tl.float32) * 1.44269504  # 1/ln 2
                if HAS_KP:
                    s = tl.where((tl.load(kp_row + offs_n * stride_kpn) != 0)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if BOUNDARY or HAS_KP or HAS_MASK:  # a row may have no key yet: exp2(-inf - 0) = 0
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:  # every row has a score above -inf in an interior tile
                m_safe = m_new
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if UPCAST:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=FP32_DOT)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    return acc, l_i, m_i, kv_worst, rel_worst


@triton.jit
def decode_kernel(
    Q, K, V, PartO, PartM, PartL, PartF, Mask, KP, Rel,
    stride_qb, stride_qh, stride_qg, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mg, stride_mm, stride_mn,
    stride_kpb, stride_kpn, stride_rh,
    HK, G, NQ, NK, D, DV, qk_scale, lo, hi, rel_base, cap_in, cap_log2, part_len, n_parts, p_base, p_end,
    BOTTOM_RIGHT: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    HAS_KP: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_REL: tl.constexpr, CHECK: tl.constexpr, INF_BITS: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
):
    """One part ``[p_base + s·part_len, ...)`` (clipped to ``p_end``) of one key/value head's keys
    for its ``R = G·Nq`` rows: left boundary, interior and right boundary tiles of the band, and
    with ``CHECK`` the part's other tiles, read for the rule only. Writes the part's ``O_s``,
    ``m_s``, ``l_s`` (and flags with ``CHECK``) at rows ``((b·Hk + hk)·n_parts + s)·R + r``.
    Kept whole: one fused kernel body; splitting it would move the running state through memory."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)  # b * HK + hk
    hk = pid_bh % HK
    b = pid_bh // HK
    nq = NQ
    nk = NK
    offset = (nk - nq) if BOTTOM_RIGHT else 0
    rows = G * nq
    r = tl.arange(0, BLOCK_M)
    row_ok = r < rows
    rc = tl.minimum(r, rows - 1)  # padding rows repeat the last row: every load in bounds
    g = rc // nq
    i = rc % nq
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    q_rows = Q + b64 * stride_qb + hk * stride_qh + g * stride_qg + i * stride_qn  # (BLOCK_M,) row pointers
    if EVEN_D:
        q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_qd)
    else:
        q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_qd, mask=offs_d[None, :] < D, other=0.0)
    k_base = K + b64 * stride_kb + hk * stride_kh
    v_base = V + b64 * stride_vb + hk * stride_vh
    m_rows = Mask + b64 * stride_mb + hk * stride_mh + g * stride_mg + i * stride_mm
    kp_row = KP + b64 * stride_kpb
    rel_rows = Rel + (hk * G + g) * stride_rh + (rel_base - i)

    p0 = p_base + pid_s * part_len
    p1 = tl.minimum(p0 + part_len, p_end)
    k_lo, f_lo, f_hi, k_hi = key_range(nq * 0, nq - 1, p0, p1, offset, lo, hi, BLOCK_N, HAS_LO, HAS_HI)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    kv_worst = tl.zeros([BLOCK_N], tl.int32)
    rel_worst = tl.zeros([BLOCK_M], tl.int32)
    # left boundary, interior (no masks), right boundary: consecutive tiles, in key order
    acc, l_i, m_i, kv_worst, rel_worst = _tiles(
        acc, l_i, m_i, kv_worst, rel_worst, q, k_base, v_base, k_lo, tl.minimum(f_lo, k_hi), i, row_ok, offs_n0, offs_d, offs_dv,
        stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
        kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
        True, True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, CHECK, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i, kv_worst, rel_worst = _tiles(
        acc, l_i, m_i, kv_worst, rel_worst, q, k_base, v_base, f_lo, f_hi, i, row_ok, offs_n0, offs_d, offs_dv,
        stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
        kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
        False, True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, CHECK, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i, kv_worst, rel_worst = _tiles(
        acc, l_i, m_i, kv_worst, rel_worst, q, k_base, v_base, f_hi, k_hi, i, row_ok, offs_n0, offs_d, offs_dv,
        stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
        kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
        True, True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, CHECK, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N,
    )  # fmt: skip
    if CHECK:  # the part's tiles outside the band: read for the rule, not scored
        scored_end = tl.cdiv(tl.maximum(k_hi, 0), BLOCK_N) * BLOCK_N  # the scored tiles are [k_lo, scored_end)
        none = scored_end <= k_lo
        left_end = tl.where(none, p1, tl.minimum(k_lo, p1))
        right_start = tl.where(none, p1, tl.maximum(scored_end, p0))
        acc, l_i, m_i, kv_worst, rel_worst = _tiles(
            acc, l_i, m_i, kv_worst, rel_worst, q, k_base, v_base, p0, left_end, i, row_ok, offs_n0, offs_d, offs_dv,
            stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
            kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
            True, False, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, CHECK, FP32_DOT, UPCAST, EVEN_D, EVEN_DV,
            BLOCK_N,
        )  # fmt: skip
        acc, l_i, m_i, kv_worst, rel_worst = _tiles(
            acc, l_i, m_i, kv_worst, rel_worst, q, k_base, v_base, right_start, p1, i, row_ok, offs_n0, offs_d, offs_dv,
            stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
            kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
            True, False, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, CHECK, FP32_DOT, UPCAST, EVEN_D, EVEN_DV,
            BLOCK_N,
        )  # fmt: skip
    part = (pid_bh * n_parts + pid_s).to(tl.int64) * rows + r  # workspace rows: the R real rows of each part
    tl.store(PartO + part[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=row_ok[:, None])
    tl.store(PartM + part, m_i, mask=row_ok)
    tl.store(PartL + part, l_i, mask=row_ok)
    if CHECK:
        flags = (_worst(q) >= INF_BITS).to(tl.int32)
        flags |= tl.where(tl.max(kv_worst, 0) >= INF_BITS, 2, 0)
        flags |= tl.where(rel_worst >= 0x7F800000, 4, 0)  # the bias is float32: +inf's bits
        tl.store(PartF + part, flags, mask=row_ok)


@triton.jit
def decode_merge_kernel(
    PartO, PartM, PartL, PartF, Out, Lse, Sinks,
    stride_ob, stride_oh, stride_og, stride_on, stride_od,
    stride_lb, stride_lh, stride_lg, stride_ln,
    HK, G, NQ, DV, n_parts,
    HAS_SINKS: tl.constexpr, CHECK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The exact merge of :func:`decode_kernel`'s parts for one key/value head's ``G·Nq`` rows (see
    the module docstring); with ``CHECK``, the rule: NaN in the output and lse of a bad row, and
    in the lse of a row whose output is NaN."""
    pid_bh = tl.program_id(0)
    hk = pid_bh % HK
    b = pid_bh // HK
    rows = G * NQ
    r = tl.arange(0, BLOCK_M)
    row_ok = r < rows
    rc = tl.minimum(r, rows - 1)
    g = rc // NQ
    i = rc % NQ
    offs_dv = tl.arange(0, BLOCK_DV)
    first = (pid_bh * n_parts).to(tl.int64) * rows + r
    if HAS_SINKS:
        sink = tl.load(Sinks + hk * G + g)
        top = sink
    else:
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, n_parts):
        top = tl.maximum(top, tl.load(PartM + first + s * rows, mask=row_ok, other=float("-inf")) * 0.6931471805599453)  # ln 2
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    if HAS_SINKS:
        total = tl.exp(sink - top_safe)
    else:
        total = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    flags = tl.zeros([BLOCK_M], tl.int32)
    for s in range(0, n_parts):
        at = first + s * rows
        w = tl.exp(tl.load(PartM + at, mask=row_ok, other=float("-inf")) * 0.6931471805599453 - top_safe)  # empty part: e^-inf = 0
        total += tl.load(PartL + at, mask=row_ok, other=0.0) * w
        o += tl.load(PartO + at[:, None] * BLOCK_DV + offs_dv[None, :], mask=row_ok[:, None], other=0.0) * w[:, None]
        if CHECK:
            flags |= tl.load(PartF + at, mask=row_ok, other=0)
    has = total > 0.0
    t_safe = tl.where(has, total, 1.0)
    out = o / t_safe[:, None]
    lse = tl.where(has, top_safe + tl.log(t_safe), float("-inf"))
    if CHECK:
        # a bias entry is bad for its query head: OR the bias flags over the rows of each head
        same_head = (g[:, None] == g[None, :]) & (((flags & 4) != 0)[None, :])
        bad = ((flags & 3) != 0) | (tl.max(same_head.to(tl.int32), 1) > 0)
        out = tl.where(bad[:, None], float("nan"), out)
        lse = tl.where(bad | (tl.max((out != out).to(tl.int32), 1) > 0), float("nan"), lse)
    b64 = b.to(tl.int64)
    o_rows = Out + b64 * stride_ob + hk * stride_oh + g * stride_og + i * stride_on
    tl.store(o_rows[:, None] + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(Lse + b64 * stride_lb + hk * stride_lh + g * stride_lg + i * stride_ln, lse, mask=row_ok)
