"""The non-finite rule's Triton kernels (:mod:`qkv.nonfinite`), launched by :mod:`qkv.nonfinite_device`.

Three kernels, each one launch per call:

- ``scan_kernel``: reads q, k, v and a built-in score function's bias ``rel (Hq, L)`` once, as
  *segments* of rows (a tensor ``(..., C)`` viewed as up to 4 row dims with their strides, so
  strided, transposed and expanded inputs need no copy). A row holding a NaN or ±inf sets a bit
  in an int32 flag word, ``row // DIV`` of its segment's flags (``DIV`` 1 for query rows and bias
  heads, ``Nk`` for key/value heads), and bit 1 of word 0, the call's "anything bad".
- ``poison_kernel``: grid over the output's rows. Each program first reads word 0 and does nothing
  more when it is clear (and the output need not be read: ``READ_OUT``, only for calls whose
  formula can make a row NaN). Otherwise it writes NaN into the bad rows of ``out`` and ``lse``
  in place, and with ``GRAD`` sets the gradient flags: per query row (bit 1: its ``dq`` is NaN;
  bit 2: a bad row that has nothing to attend to, whose ``dq`` is the formula's 0), per key/value
  head, per query head (bias, sinks), per float-mask row, and bit 2 of word 0.
- ``grads_kernel``: grid over the rows of the gradients the engine produced (dq, dk, dv, dsinks,
  dmask). Each program reads word 0 and returns at once when bit 2 is clear; else it writes NaN
  (or the formula's 0) into the flagged rows in place.

A NaN or ±inf is an all-ones exponent: the raw bits with the sign cleared are at least those of
+inf (:func:`_nonfinite`), exact for every float dtype, with no arithmetic that a compiler could
fold. Flags only ever gain bits (atomic OR into words zeroed at allocation), so any order of
programs gives the same words; a program only issues an atomic for a row it found bad.

This module imports triton; :mod:`qkv.nonfinite_device` imports it only when a kernel launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

# row counts and offsets change with every shape: not specialised, so one compiled kernel serves
# them all (strides and the row length stay specialised: their divisibility by 16 lets the loads
# of a row vectorise, masked or not)
_SEG = ("R{s}", "N1{s}", "N2{s}", "N3{s}", "OFF{s}", "DIV{s}")


def _sizes(segments: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [name.format(s=s) for s in range(segments) for name in _SEG] + [f"P{s}" for s in range(1, segments)] + list(extra)


@triton.jit
def _nonfinite(x):
    """True where ``x`` holds a NaN or ±inf (its magnitude's bits at least +inf's)."""
    if x.dtype.primitive_bitwidth == 16:
        bits = x.to(tl.int16, bitcast=True) & 0x7FFF
        if x.dtype.is_bf16():
            bad = bits >= 0x7F80
        else:
            bad = bits >= 0x7C00
    elif x.dtype.primitive_bitwidth == 32:
        bad = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >= 0x7F800000
    else:
        bad = (x.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF) >= 0x7FF0000000000000
    return bad


@triton.jit
def _row_ptrs(A, r, N1, N2, N3, S0, S1, S2, S3):
    """Pointers to rows ``r`` (row-major over up to 4 row dims of sizes ``(·, N1, N2, N3)``)."""
    r = r.to(tl.int64)
    i3 = r % N3
    t = r // N3
    i2 = t % N2
    t = t // N2
    i1 = t % N1
    i0 = t // N1
    return A + i0 * S0 + i1 * S1 + i2 * S2 + i3 * S3


@triton.jit
def _scan_rows(W, A, blk, R, N1, N2, N3, S0, S1, S2, S3, C, SC, OFF, DIV, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Flag the bad rows of one block of a segment (module docstring)."""
    r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < R
    rows = _row_ptrs(A, r, N1, N2, N3, S0, S1, S2, S3)
    seen = tl.zeros([BLOCK_R], tl.int32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(rows[:, None] + c[None, :] * SC, mask=ok[:, None] & (c[None, :] < C), other=0.0)
        seen = tl.maximum(seen, tl.max(_nonfinite(x).to(tl.int32), 1))
    tl.atomic_or(W + OFF + r // DIV, seen, mask=ok & (seen > 0))
    tl.atomic_or(W, 1, mask=tl.max(seen, 0) > 0)


@triton.jit(do_not_specialize=_sizes(4))
def scan_kernel(
    W, A0, A1, A2, A3,
    R0, N10, N20, N30, S00, S10, S20, S30, C0, SC0, OFF0, DIV0,
    R1, N11, N21, N31, S01, S11, S21, S31, C1, SC1, OFF1, DIV1,
    R2, N12, N22, N32, S02, S12, S22, S32, C2, SC2, OFF2, DIV2,
    R3, N13, N23, N33, S03, S13, S23, S33, C3, SC3, OFF3, DIV3,
    P1, P2, P3,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Segments 0-3 (q, k, v, bias; an absent one has no rows): programs ``[0, P1)`` scan segment
    0, ``[P1, P2)`` segment 1, and so on."""
    pid = tl.program_id(0)
    if pid < P1:
        _scan_rows(W, A0, pid, R0, N10, N20, N30, S00, S10, S20, S30, C0, SC0, OFF0, DIV0, BLOCK_R, BLOCK_C)
    elif pid < P2:
        _scan_rows(W, A1, pid - P1, R1, N11, N21, N31, S01, S11, S21, S31, C1, SC1, OFF1, DIV1, BLOCK_R, BLOCK_C)
    elif pid < P3:
        _scan_rows(W, A2, pid - P2, R2, N12, N22, N32, S02, S12, S22, S32, C2, SC2, OFF2, DIV2, BLOCK_R, BLOCK_C)
    else:
        _scan_rows(W, A3, pid - P3, R3, N13, N23, N33, S03, S13, S23, S33, C3, SC3, OFF3, DIV3, BLOCK_R, BLOCK_C)


@triton.jit
def _fix_rows(W, A, blk, R, N1, N2, N3, S0, S1, S2, S3, C, SC, OFF, DIV, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """NaN into the rows of one block of a gradient whose flag has bit 1, 0 into those with bit 2 only."""
    r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < R
    f = tl.load(W + OFF + r // DIV, mask=ok, other=0)
    if tl.max(f, 0) > 0:
        rows = _row_ptrs(A, r, N1, N2, N3, S0, S1, S2, S3)
        nan_rows = (f & 1) != 0
        zero_rows = ((f & 2) != 0) & ~nan_rows
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            ptrs = rows[:, None] + c[None, :] * SC
            cm = c[None, :] < C
            tl.store(ptrs, tl.full([BLOCK_R, BLOCK_C], float("nan"), tl.float32).to(A.dtype.element_ty), mask=nan_rows[:, None] & cm)
            tl.store(ptrs, tl.zeros([BLOCK_R, BLOCK_C], tl.float32).to(A.dtype.element_ty), mask=zero_rows[:, None] & cm)


@triton.jit(do_not_specialize=_sizes(5))
def grads_kernel(
    W, A0, A1, A2, A3, A4,
    R0, N10, N20, N30, S00, S10, S20, S30, C0, SC0, OFF0, DIV0,
    R1, N11, N21, N31, S01, S11, S21, S31, C1, SC1, OFF1, DIV1,
    R2, N12, N22, N32, S02, S12, S22, S32, C2, SC2, OFF2, DIV2,
    R3, N13, N23, N33, S03, S13, S23, S33, C3, SC3, OFF3, DIV3,
    R4, N14, N24, N34, S04, S14, S24, S34, C4, SC4, OFF4, DIV4,
    P1, P2, P3, P4,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Segments 0-4 (dq, dk, dv, dsinks, dmask), laid out as :func:`scan_kernel`'s; every program
    returns at once unless word 0 has bit 2 (some row passed NaN on)."""
    if (tl.load(W) & 2) != 0:
        pid = tl.program_id(0)
        if pid < P1:
            _fix_rows(W, A0, pid, R0, N10, N20, N30, S00, S10, S20, S30, C0, SC0, OFF0, DIV0, BLOCK_R, BLOCK_C)
        elif pid < P2:
            _fix_rows(W, A1, pid - P1, R1, N11, N21, N31, S01, S11, S21, S31, C1, SC1, OFF1, DIV1, BLOCK_R, BLOCK_C)
        elif pid < P3:
            _fix_rows(W, A2, pid - P2, R2, N12, N22, N32, S02, S12, S22, S32, C2, SC2, OFF2, DIV2, BLOCK_R, BLOCK_C)
        elif pid < P4:
            _fix_rows(W, A3, pid - P3, R3, N13, N23, N33, S03, S13, S23, S33, C3, SC3, OFF3, DIV3, BLOCK_R, BLOCK_C)
        else:
            _fix_rows(W, A4, pid - P4, R4, N14, N24, N34, S04, S14, S24, S34, C4, SC4, OFF4, DIV4, BLOCK_R, BLOCK_C)


@triton.jit
def _nothing_to_attend(q_rows, cand, k_base, k_n, k_d, q_d, NK, D,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """:func:`qkv.nonfinite.nothing_to_attend` for the ``cand`` rows: no NaN, an infinite entry,
    and each infinite entry meeting keys all of the opposite sign (each key dim's extremes, read
    once here: only a program holding such a row gets this far)."""
    meets = tl.full([BLOCK_M], 1, tl.int32)
    has_inf = tl.zeros([BLOCK_M], tl.int32)
    has_nan = tl.zeros([BLOCK_M], tl.int32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        if k_base.dtype.element_ty.primitive_bitwidth == 64:  # float64 keeps its own (a tiny key's sign survives)
            kmax = tl.full([BLOCK_D], float("-inf"), tl.float64)
            kmin = tl.full([BLOCK_D], float("inf"), tl.float64)
        else:  # 16- and 32-bit keys compare exactly in float32
            kmax = tl.full([BLOCK_D], float("-inf"), tl.float32)
            kmin = tl.full([BLOCK_D], float("inf"), tl.float32)
        for n0 in range(0, NK, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            km = (n[:, None] < NK) & dm[None, :]
            kt = tl.load(k_base + n[:, None].to(tl.int64) * k_n + d[None, :] * k_d, mask=km, other=0.0)
            kt = kt.to(kmax.dtype)
            kmax = tl.maximum(kmax, tl.max(tl.where(km, kt, float("-inf")), 0))
            kmin = tl.minimum(kmin, tl.min(tl.where(km, kt, float("inf")), 0))
        qt = tl.load(q_rows[:, None] + d[None, :] * q_d, mask=cand[:, None] & dm[None, :], other=0.0)
        pos = qt == float("inf")
        neg = qt == float("-inf")
        fail = (pos & ~(kmax < 0)[None, :]) | (neg & ~(kmin > 0)[None, :])
        meets = meets & (tl.max(fail.to(tl.int32), 1) == 0)
        has_inf = tl.maximum(has_inf, tl.max((pos | neg).to(tl.int32), 1))
        has_nan = tl.maximum(has_nan, tl.max((qt != qt).to(tl.int32), 1))
    return (meets != 0) & (has_inf != 0) & (has_nan == 0)


@triton.jit(do_not_specialize=["HQ", "NQ", "NK", "G", "NB1", "NMB",
                               "OFF_QF", "OFF_KF", "OFF_VF", "OFF_BF", "OFF_GQ", "OFF_GK", "OFF_GV", "OFF_GH", "OFF_GM"])
def poison_kernel(
    W, Out, Lse, Q, K,
    HQ, NQ, NK, G, D, DV, NB1, NMB,
    OFF_QF, OFF_KF, OFF_VF, OFF_BF, OFF_GQ, OFF_GK, OFF_GV, OFF_GH, OFF_GM,
    qf_b0, qf_b1, qf_h, qf_i, kf_b0, kf_b1, kf_h, vf_b0, vf_b1, vf_h, bf_h,
    o_b0, o_b1, o_h, o_i, o_d, l_b0, l_b1, l_h, l_i,
    q_b0, q_b1, q_h, q_i, q_d, k_b0, k_b1, k_h, k_n, k_d,
    gq_b0, gq_b1, gq_h, gq_i, gk_b0, gk_b1, gk_h, gv_b0, gv_b1, gv_h, gm_b0, gm_b1, gm_h, gm_i,
    READ_OUT: tl.constexpr, HAS_LSE: tl.constexpr, HAS_BIAS: tl.constexpr, GRAD: tl.constexpr, HAS_GMASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The rule on one block of ``BLOCK_M`` rows of one (batch, query head) of the output (module
    docstring). Batch dims are two (``b0``, ``b1`` of size ``NB1``; strides per tensor, 0 where
    it broadcasts); a key/value head is ``h // G``.
    Kept whole: one program's rows, read and written once; its parts share every index."""
    if READ_OUT or (tl.load(W) & 1) != 0:
        pid = tl.program_id(0)
        m = pid % NMB
        bh = pid // NMB
        h = bh % HQ
        b = bh // HQ
        b1 = (b % NB1).to(tl.int64)
        b0 = (b // NB1).to(tl.int64)
        hk = h // G
        h64 = h.to(tl.int64)  # (element offsets of a head can pass 2**31; flag indices cannot)
        hk64 = hk.to(tl.int64)
        i = m * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = i < NQ
        own = (tl.load(W + OFF_QF + b0 * qf_b0 + b1 * qf_b1 + h * qf_h + i * qf_i, mask=ok, other=0) & 1) != 0
        head_bits = tl.load(W + OFF_KF + b0 * kf_b0 + b1 * kf_b1 + hk * kf_h) | tl.load(W + OFF_VF + b0 * vf_b0 + b1 * vf_b1 + hk * vf_h)
        if HAS_BIAS:
            head_bits |= tl.load(W + OFF_BF + h * bf_h)
        heads = (head_bits & 1) != 0
        bad = (own | heads) & ok
        o_rows = Out + b0 * o_b0 + b1 * o_b1 + h64 * o_h + i.to(tl.int64) * o_i
        made = tl.zeros([BLOCK_M], tl.int32) != 0
        if READ_OUT:  # before the writes: rows the formula made NaN (a float mask, a Python score function)
            for c0 in range(0, DV, BLOCK_DV):
                c = c0 + tl.arange(0, BLOCK_DV)
                o = tl.load(o_rows[:, None] + c[None, :] * o_d, mask=ok[:, None] & (c[None, :] < DV), other=0.0)
                made = made | (tl.max((o != o).to(tl.int32), 1) > 0)
        if tl.max(bad.to(tl.int32), 0) > 0:
            for c0 in range(0, DV, BLOCK_DV):
                c = c0 + tl.arange(0, BLOCK_DV)
                nan = tl.full([BLOCK_M, BLOCK_DV], float("nan"), tl.float32).to(Out.dtype.element_ty)
                tl.store(o_rows[:, None] + c[None, :] * o_d, nan, mask=bad[:, None] & (c[None, :] < DV))
        if HAS_LSE:
            l_rows = Lse + b0 * l_b0 + b1 * l_b1 + h64 * l_h + i.to(tl.int64) * l_i
            tl.store(l_rows, tl.full([BLOCK_M], float("nan"), tl.float32).to(Lse.dtype.element_ty), mask=bad | (made & ok))
        if GRAD:
            passes = bad | (made & ok)  # rows that pass NaN on
            cand = own & ~heads & ~made & ok  # bad through their own query alone: dq NaN unless nothing to attend to
            nta = cand & (NK == 0)  # no key: nothing to attend to, whatever the row holds
            if (NK > 0) & (tl.max(cand.to(tl.int32), 0) > 0):
                q_rows = Q + b0 * q_b0 + b1 * q_b1 + h64 * q_h + i.to(tl.int64) * q_i
                k_base = K + b0 * k_b0 + b1 * k_b1 + hk64 * k_h
                nta = cand & _nothing_to_attend(q_rows, cand, k_base, k_n, k_d, q_d, NK, D, BLOCK_M, BLOCK_N, BLOCK_D)
            dq_nan = passes & ~nta
            bits = dq_nan.to(tl.int32) | (nta.to(tl.int32) * 2)
            tl.atomic_or(W + OFF_GQ + b0 * gq_b0 + b1 * gq_b1 + h * gq_h + i * gq_i, bits, mask=bits != 0)
            if HAS_GMASK:
                tl.atomic_or(W + OFF_GM + b0 * gm_b0 + b1 * gm_b1 + h * gm_h + i * gm_i, passes.to(tl.int32), mask=passes)
            any_row = tl.max(passes.to(tl.int32), 0) > 0
            tl.atomic_or(W + OFF_GK + b0 * gk_b0 + b1 * gk_b1 + hk * gk_h, 1, mask=any_row)
            tl.atomic_or(W + OFF_GV + b0 * gv_b0 + b1 * gv_b1 + hk * gv_h, 1, mask=any_row)
            tl.atomic_or(W + OFF_GH + h, 1, mask=any_row)
            tl.atomic_or(W, 2, mask=any_row | (tl.max(nta.to(tl.int32), 0) > 0))
