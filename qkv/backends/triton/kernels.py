"""Fused attention kernels in Triton: forward, flash-decoding, and a deterministic FlashAttention-2 backward.

What they support
-----------------
- Layout: the grouped view of :meth:`qkv.call.AttentionCall.grouped_qkv` — q ``(B, Hk, G, Nq, D)``,
  k/v ``(B, Hk, 1, Nk, D|Dv)`` — read through their real strides (non-contiguous and
  zero-stride broadcast inputs work, nothing is copied). GQA/MQA: a program for query head
  ``(hk, g)`` reads key/value head ``hk`` in place.
- Packed variable-length batches (``VARLEN``): sequence ``b`` occupies rows
  ``cu_seqlens[b] .. cu_seqlens[b+1]`` of a ``(total, H, D)`` tensor; the batch stride is 0 and
  each program reads its own offsets, so no padding is ever computed.
- Positional rules as scalars: key ``j`` is allowed for query row ``i`` iff
  ``p + lo <= j <= p + hi`` with ``p = i + offset`` (``offset = Nk - Nq`` for bottom-right
  alignment, else 0); ``HAS_LO``/``HAS_HI`` switch the open sides off.
- A key padding mask ``(B|1, Nk)`` and a dense bool or float ``attn_mask`` broadcastable to
  ``(B, Hk, G, Nq, Nk)`` (broadcast dims passed with stride 0), both read tile by tile.
- Head dims up to 256 (any size: ``BLOCK_D`` is the next power of two, at least 16 for
  ``tl.dot``; ``EVEN_D``/``EVEN_DV`` drop the column masks when the head dim fills the tile);
  fp16, bf16, fp32.
- The built-in score functions (:class:`qkv.score_mods.KernelForm`), applied to the scaled
  score before the masks: ``SOFTCAP`` (``cap·tanh(x/cap)``, tanh from exp2 to a few ulps; the
  backward multiplies dS by ``1 - tanh²``) and ``HAS_REL``, a bias ``rel[h, j - i + c0]`` read
  along the tile's diagonals (``REL_SHIFT``: ``c0`` less each packed sequence's ``Nk - Nq``).
  ``REL_GRAD``: the dQ kernel also sums dS along the diagonals into the bias's gradient.
- Sinks (``HAS_SINKS``): a per-head logit in every row's denominator; it starts each row's
  running maximum and sum, so the output is rounded once and the lse includes it (a sink
  above FLT_MAX·ln 2 ≈ 2.36e38, +inf in base 2, joins after the loop in natural units). The
  backward needs nothing new: its weights come from that lse.

How the work is laid out (what makes it fast on a GPU)
-------------------------------------------------------
- Each program computes the exact tile range its rows can see (:func:`_key_range`,
  :func:`_query_range`) and splits it in three consecutive runs: boundary tiles on the left
  (a window's far edge), **interior** tiles that every row of the block sees whole, and boundary
  tiles on the right (the causal diagonal, the padded tail, a varlen sequence's end). Interior
  tiles (``BOUNDARY=False`` in :func:`_scores`) load K/V/Q with no bounds checks and apply no
  positional mask; only what is per element by nature — key padding, a dense mask, a relative
  bias — is still read there, through clamped in-bounds indices instead of masked loads.
- Scores live in base 2: ``qk_scale = scale · log2 e`` is applied once to ``q·kᵀ`` and every
  exponential is ``exp2``; biases in natural units are multiplied by ``1.44269504`` (1/ln 2).
- Backward: ``bwd_dkdv_kernel`` (one key block per program, looping over the G query heads of
  its key/value head and the query blocks that see it) and ``bwd_dq_kernel`` (one query block
  per program), each owning the rows it writes: no atomics, bit-identical reruns.
- Decoding (``Nq <= 8`` rows per head against a longer cache) has kernels of its own,
  :mod:`.decode` (flash-decoding, with the non-finite rule in its loads); they share
  :func:`dot`, :func:`tanh` and :func:`key_range` with these.
- Not used: Hopper's tensor-memory (TMA) descriptors. Triton 3.6 has them
  (``tl.make_tensor_descriptor``) and its interpreter runs them, but a descriptor needs a unit
  last stride, strides that are multiples of 16 bytes and a 16-byte-aligned base, and one made
  in the kernel needs a global scratch allocator registered with ``triton.set_allocator``;
  these kernels read inputs through any strides in place (zero-stride broadcasts, strided
  head dims, packed varlen rows, head dims like 59). TMA would be a second copy of every load
  path, taken only for aligned inputs, whose gain needs a GPU to show. Warp specialization is a launch-table flag (``WARP_SPEC``:
  ``tl.range(..., warp_specialize=True)`` on the forward's interior loop), off by default and
  tried by the GPU check's autotune where Triton compiles it: Triton 3.6's
  ``NVGPUWarpSpecialization`` pass fails on this loop (an H200, bf16, d128), so not there; the
  interpreter ignores it.

What differs from the float64 reference
---------------------------------------
- Scores, softmax statistics and accumulators are fp32; ``P`` is rounded to the input dtype
  before ``P @ V`` (as in FlashAttention). fp32 inputs use the ``FP32_DOT`` precision on a
  GPU: full fp32 ("ieee") under torch's default float32 matmul precision, "tf32" (~10-bit
  mantissa products, fp32 accumulation) when torch allows it (see ``backend.fp32_dot``); the
  interpreter computes in full fp32, and widens bf16 tiles to fp32 before ``tl.dot``
  (``UPCAST``: its bf16 dot is wrong in Triton 3.6).
- No gradient for a float ``attn_mask``; no dropout.
- Offsets inside one (batch, head) matrix are int32 (the backend declines larger slices);
  batch, head and sequence-start offsets are int64.
- Inside ``@triton.jit`` code the constants are literals (globals would have to be
  ``tl.constexpr``): ``1.44269504`` = 1/ln 2, ``0.6931471805599453`` = ln 2.
- The backward is deterministic by construction (see above); the one exception is a relative
  bias's own gradient, summed with fp32 atomics (see the dQ kernel).

A query row with nothing to attend to gets output 0, lse ``-inf`` (its sink's logit with
sinks) and zero gradients for q, k, v.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` with fp32 accumulation. ``UPCAST`` (interpreter + bf16 only): Triton 3.6's
    interpreter multiplies bf16 tiles as raw integers, so they are widened first; bf16
    products are exact in fp32, so only the summation order differs from the GPU."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=FP32_DOT)


@triton.jit
def _seq_bounds(cu_ptr, b, N, VARLEN: tl.constexpr):
    """(first row, length) of sequence ``b``: from cu_seqlens when packed, else (0, N)."""
    if VARLEN:
        start = tl.load(cu_ptr + b).to(tl.int32)
        n = tl.load(cu_ptr + b + 1).to(tl.int32) - start
    else:
        start = tl.program_id(0) * 0  # a tensor (not the literal 0), so .to() works on it
        n = N + start
    return start, n


@triton.jit
def _load_rows(base, rows, stride_r, cols, stride_c, n_rows, n_cols, CHECK_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    """A ``(len(rows), len(cols))`` tile; masked only where it can run out of bounds:
    rows past ``n_rows`` when ``CHECK_ROWS``, columns past ``n_cols`` unless ``EVEN_COLS``."""
    ptrs = base + rows[:, None] * stride_r + cols[None, :] * stride_c
    if CHECK_ROWS:
        if EVEN_COLS:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    else:
        if EVEN_COLS:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    return x


@triton.jit
def _key_range(first, last, p0, p1, offset, lo, hi, BLOCK_N: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """Key tiles of ``[p0, p1)`` (``p0`` a multiple of ``BLOCK_N``, ``p1 <= Nk``) that query rows at
    positions ``first..last`` can see: ``(start, interior start, interior end, end)``.

    Tiles ``[start, f_lo)`` and ``[max(f_lo, f_hi), end)`` are boundary tiles; every tile in
    ``[f_lo, f_hi)`` lies inside ``[p0, p1)`` and inside every row's band (``j >= last + offset + lo``
    and ``j <= first + offset + hi`` for all its keys), so it needs no mask. Values are kept
    non-negative before ``//`` (C and NumPy round negative quotients differently)."""
    k_lo = p0
    k_hi = p1
    f_lo = p0
    f_hi = (p1 // BLOCK_N) * BLOCK_N
    if HAS_LO:
        k_lo = tl.maximum(k_lo, first + offset + lo)
        f_lo = tl.maximum(f_lo, tl.cdiv(tl.maximum(last + offset + lo, 0), BLOCK_N) * BLOCK_N)
    if HAS_HI:
        k_hi = tl.minimum(k_hi, last + offset + hi + 1)
        f_hi = tl.minimum(f_hi, (tl.maximum(first + offset + hi + 1, 0) // BLOCK_N) * BLOCK_N)
    k_lo = (k_lo // BLOCK_N) * BLOCK_N
    f_lo = tl.maximum(f_lo, k_lo)
    f_hi = tl.maximum(f_hi, f_lo)
    return k_lo, f_lo, f_hi, k_hi


@triton.jit
def _query_range(n0, n1, nq, offset, lo, hi, BLOCK_M: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """Query tiles that see a key in ``[n0, n1)``: ``(start, interior start, interior end, end)``,
    interior tiles holding only rows below ``nq`` that see every key of the block."""
    m_lo = n0 * 0
    m_hi = nq
    f_lo = n0 * 0
    f_hi = (nq // BLOCK_M) * BLOCK_M
    if HAS_HI:
        m_lo = tl.maximum(0, n0 - hi - offset)
        f_lo = tl.cdiv(tl.maximum(n1 - 1 - offset - hi, 0), BLOCK_M) * BLOCK_M
    if HAS_LO:
        m_hi = tl.minimum(nq, n1 - lo - offset)
        f_hi = tl.minimum(f_hi, (tl.maximum(n0 - offset - lo + 1, 0) // BLOCK_M) * BLOCK_M)
    m_lo = (m_lo // BLOCK_M) * BLOCK_M
    f_lo = tl.maximum(f_lo, m_lo)
    f_hi = tl.maximum(f_hi, f_lo)
    return m_lo, f_lo, f_hi, m_hi


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp2 (portable: no libdevice). Below |x| = 1/4, where ``1 - e^-2|x|``
    would cancel, an odd Taylor polynomial (the next term is < 1e-8 relative there); above it
    ``(1 - e) / (1 + e)`` with ``e = e^-2|x|``. 1.6 ulps at worst in the interpreter; a GPU's
    approximate exp2 and division add up to ~2 ulps each."""
    a = tl.abs(x)
    x2 = x * x
    poly = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397 + x2 * 0.021869488536155203))))
    e = tl.exp2(a * -2.8853900817779268)  # -2/ln 2
    big = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.25, poly, tl.where(x < 0, -big, big))


@triton.jit
def _scores(
    q, k, qk_scale, pos_m, row_ok, offs_n, nk, offset, lo, hi, kp_row, stride_kpn, m_rows, stride_mn, rel_rows,
    cap_in, cap_log2,
    BOUNDARY: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_KP: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REL: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    """Scores of one ``(BLOCK_M, BLOCK_N)`` tile in base 2, -inf where masked:
    ``(f(q·kᵀ·scale) + bias)·log2e`` with the built-in score function f (softcap ``cap·tanh(x/cap)``,
    then ``+ rel[h, j - i + c0]``) and a float mask's bias.

    Rows: ``pos_m`` their query positions, ``row_ok`` which are real; ``m_rows`` / ``rel_rows`` one
    pointer per row into the dense mask / the bias (``rel_rows[m] + j``), taken at rows clamped
    into bounds. ``BOUNDARY``: apply bounds and the band, and mask every per-element load by
    them; else (an interior tile: every real row sees every key) only key padding and a bool
    mask mask, and per-element loads use key indices clamped below ``nk`` (real rows never
    need the clamp; padding rows' values are never stored).

    Returns ``(s, t)``: ``t = tanh(x/cap)`` for the softcap's derivative (``1 - t²``) when
    ``SOFTCAP``, else unused. The tanh takes the base-2 score times ``cap_in = ln 2/cap`` and the
    cap returns in base 2 as ``cap_log2 = cap·log2e/2`` (halved: doubled after, exactly), so the
    natural-units score is never rounded on its own, and neither factor overflows or vanishes
    for a cap in float32's normal range."""
    qk = _dot(q, tl.trans(k), FP32_DOT, UPCAST)
    if SOFTCAP:
        t = _tanh((qk * qk_scale) * cap_in)
        s = (t * cap_log2) * 2.0
    else:
        t = qk
        s = qk * qk_scale
    if BOUNDARY:
        ok = row_ok[:, None] & (offs_n[None, :] < nk)
        rel = offs_n[None, :] - (pos_m[:, None] + offset)  # key position relative to the query's
        if HAS_LO:
            ok = ok & (rel >= lo)
        if HAS_HI:
            ok = ok & (rel <= hi)
        if HAS_KP:
            kp = tl.load(kp_row + offs_n * stride_kpn, mask=offs_n < nk, other=0)
            ok = ok & (kp != 0)[None, :]
        if HAS_MASK:
            mv = tl.load(m_rows[:, None] + offs_n[None, :] * stride_mn, mask=ok, other=0)
            if MASK_BOOL:
                ok = ok & (mv != 0)
            else:
                s += mv.to(tl.float32) * 1.44269504  # 1/ln 2: the bias is in natural-log units
        if HAS_REL:
            s += tl.load(rel_rows[:, None] + offs_n[None, :], mask=ok, other=0.0) * 1.44269504  # 1/ln 2
        s = tl.where(ok, s, float("-inf"))
    else:
        cols = tl.minimum(offs_n, nk - 1)
        if HAS_MASK:
            mv = tl.load(m_rows[:, None] + cols[None, :] * stride_mn)
            if MASK_BOOL:
                s = tl.where(mv != 0, s, float("-inf"))
            else:
                s += mv.to(tl.float32) * 1.44269504  # 1/ln 2
        if HAS_REL:
            s += tl.load(rel_rows[:, None] + cols[None, :]) * 1.44269504  # 1/ln 2
        if HAS_KP:
            kp = tl.load(kp_row + cols * stride_kpn)
            s = tl.where((kp != 0)[None, :], s, float("-inf"))
    return s, t


@triton.jit
def _diagonal_sums(x, gidx, wrap):
    """Sums of a (BLOCK_M, BLOCK_N) tile along its diagonals ``n - m``, BLOCK_M <= BLOCK_N:
    ``(lower, upper)``, entry c holding diagonal ``c - BLOCK_N`` and ``c``. Row m is rotated left
    by m (``gidx = (c + m) mod BLOCK_N``), so each diagonal lands in one column, the part that
    wrapped around (``wrap``) in the lower one."""
    sk = tl.gather(x, gidx, 1)
    return tl.sum(tl.where(wrap, sk, 0.0), 0), tl.sum(tl.where(wrap, 0.0, sk), 0)


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, k_base, v_base, start, end, pos_m, row_ok, offs_n0, offs_d, offs_dv,
    stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
    kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
    BOUNDARY: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_KP: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REL: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Online softmax over the key tiles ``[start, end)`` (a multiple of ``BLOCK_N`` apart), all
    boundary or all interior: the running ``(acc, l, m)`` of rows ``pos_m``, scores in base 2."""
    for n0 in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPEC):
        offs_n = n0 + offs_n0
        k = _load_rows(k_base, offs_n, stride_kn, offs_d, stride_kd, nk, D, BOUNDARY, EVEN_D)
        s, _t = _scores(q, k, qk_scale, pos_m, row_ok, offs_n, nk, offset, lo, hi, kp_row, stride_kpn, m_rows, stride_mn,
                        rel_rows, cap_in, cap_log2, BOUNDARY, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL,
                        FP32_DOT, UPCAST)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if BOUNDARY or HAS_KP or HAS_MASK:  # a row may have no key yet: exp2(-inf - 0) = 0
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:  # every real row has a finite score in an interior tile
            m_new_safe = m_new
        alpha = tl.exp2(m_i - m_new_safe)
        p = tl.exp2(s - m_new_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_base, offs_n, stride_vn, offs_dv, stride_vd, nk, DV, BOUNDARY, EVEN_DV)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOT, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fwd_kernel(
    Q, K, V, Out, Lse, Mask, KP, CuQ, CuK, Rel, Sinks,
    stride_qb, stride_qh, stride_qg, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_og, stride_on, stride_od,
    stride_lb, stride_lh, stride_lg, stride_ln,
    stride_mb, stride_mh, stride_mg, stride_mm, stride_mn,
    stride_kpb, stride_kpn, stride_rh,
    HK, G, NQ, NK, D, DV, qk_scale, lo, hi, rel_base, cap_in, cap_log2,
    BOTTOM_RIGHT: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    HAS_KP: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, VARLEN: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_REL: tl.constexpr, REL_SHIFT: tl.constexpr, HAS_SINKS: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Output and lse for one query block of one query head, by online softmax over the key
    tiles it can see: left boundary, interior, right boundary (scores in base 2,
    ``qk_scale`` = scale · LOG2E).
    Kept whole: one fused kernel body; splitting it would move the running state through memory."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)  # b * HK * G + hk * G + g
    g = pid_bh % G
    hk = (pid_bh // G) % HK
    b = pid_bh // (G * HK)
    q_start, nq = _seq_bounds(CuQ, b, NQ, VARLEN)
    k_start, nk = _seq_bounds(CuK, b, NK, VARLEN)
    q0 = pid_m * BLOCK_M
    if q0 >= nq:
        return
    offset = (nk - nq) if BOTTOM_RIGHT else 0

    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    q_base = Q + b64 * stride_qb + hk * stride_qh + g * stride_qg + q_start.to(tl.int64) * stride_qn
    k_base = K + b64 * stride_kb + hk * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + hk * stride_vh + k_start.to(tl.int64) * stride_vn
    row_ok = offs_m < nq
    rows_c = tl.minimum(offs_m, nq - 1)  # in-bounds rows for per-element loads
    m_rows = Mask + b64 * stride_mb + hk * stride_mh + g * stride_mg + rows_c * stride_mm
    kp_row = KP + b64 * stride_kpb
    rel_rows = Rel + (hk * G + g) * stride_rh + (rel_base - ((nk - nq) if REL_SHIFT else 0) - rows_c)

    q = _load_rows(q_base, offs_m, stride_qn, offs_d, stride_qd, nq, D, True, EVEN_D)
    q1 = tl.minimum(q0 + BLOCK_M, nq)
    k_lo, f_lo, f_hi, k_hi = _key_range(q0, q1 - 1, k_start * 0, nk, offset, lo, hi, BLOCK_N, HAS_LO, HAS_HI)

    if HAS_SINKS:  # the sink is a score every row has, with no value: it starts the running max and sum
        sink = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(Sinks + hk * G + g)
        # ...unless it is above FLT_MAX·ln 2 ≈ 2.36e38, where base 2 overflows float32: it then exceeds
        # every score the kernel holds, and joins after the loop, in natural units
        far = sink * 1.44269504 == float("inf")  # 1/ln 2
        m_i = tl.where(far, float("-inf"), sink * 1.44269504)
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)  # a -inf sink: no sink
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # left boundary, interior (no masks), right boundary: consecutive tiles, in key order
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, k_lo, tl.minimum(f_lo, k_hi), offs_m, row_ok, offs_n0, offs_d, offs_dv,
        stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
        kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
        True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N, False,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, f_lo, f_hi, offs_m, row_ok, offs_n0, offs_d, offs_dv,
        stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
        kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
        False, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N, WARP_SPEC,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, f_hi, k_hi, offs_m, row_ok, offs_n0, offs_d, offs_dv,
        stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
        kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
        True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N, False,
    )  # fmt: skip

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # ln 2: back to natural log
    if HAS_SINKS:  # a far sink: lse' = log(e^lse + e^sink), out·e^(lse - lse') (0 unless the row holds NaN)
        s_far = tl.where(far, sink, 0.0)  # (other rows compute a value they do not use, without inf - inf)
        joined = tl.maximum(lse, s_far) + tl.log(1.0 + tl.exp(-tl.abs(lse - s_far)))  # NaN stays NaN
        out = tl.where(far[:, None], out * tl.exp(lse - joined)[:, None], out)
        lse = tl.where(far, joined, lse)
    o_base = Out + b64 * stride_ob + hk * stride_oh + g * stride_og + q_start.to(tl.int64) * stride_on
    tl.store(o_base + offs_m[:, None] * stride_on + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < nq) & (offs_dv[None, :] < DV))
    l_base = Lse + b64 * stride_lb + hk * stride_lh + g * stride_lg + q_start.to(tl.int64) * stride_ln
    tl.store(l_base + offs_m * stride_ln, lse, mask=row_ok)


@triton.jit
def bwd_preprocess(
    Out, DOut, DLse, Delta, CuQ,
    stride_ob, stride_oh, stride_og, stride_on, stride_od,
    stride_db, stride_dh, stride_dg, stride_dn, stride_dd,
    stride_lb, stride_lh, stride_lg, stride_ln,
    HK, G, NQ, DV,
    HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """delta = rowsum(dO ∘ O) − dlse (dlse: the gradient reaching a returned log-sum-exp).

    Delta and dlse share the lse layout (strides ``stride_l*``)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    g = pid_bh % G
    hk = (pid_bh // G) % HK
    b = pid_bh // (G * HK)
    q_start, nq = _seq_bounds(CuQ, b, NQ, VARLEN)
    q0 = pid_m * BLOCK_M
    if q0 >= nq:
        return
    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    rows = q_start.to(tl.int64) + offs_m
    msk = (offs_m[:, None] < nq) & (offs_dv[None, :] < DV)
    o = tl.load(Out + b64 * stride_ob + hk * stride_oh + g * stride_og + rows[:, None] * stride_on
                + offs_dv[None, :] * stride_od, mask=msk, other=0.0).to(tl.float32)
    do = tl.load(DOut + b64 * stride_db + hk * stride_dh + g * stride_dg + rows[:, None] * stride_dn
                 + offs_dv[None, :] * stride_dd, mask=msk, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    l_off = b64 * stride_lb + hk * stride_lh + g * stride_lg + rows * stride_ln
    if HAS_DLSE:
        delta -= tl.load(DLse + l_off, mask=offs_m < nq, other=0.0)
    tl.store(Delta + l_off, delta, mask=offs_m < nq)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, q_base, do_base, l_ptr, delta_ptr, start, end, offs_m0, offs_n, offs_d, offs_dv,
    stride_qn, stride_qd, stride_dn, stride_dd, stride_ln, nq, nk, D, DV, offset, lo, hi, qk_scale,
    kp_row, stride_kpn, m_row, stride_mm, stride_mn, rel_row, cap_in, cap_log2,
    BOUNDARY: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_KP: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REL: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """dK, dV of one key block summed over the query tiles ``[start, end)`` of one query head,
    all boundary or all interior (interior: every row below ``nq``, no row checks)."""
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + offs_m0
        q = _load_rows(q_base, offs_m, stride_qn, offs_d, stride_qd, nq, D, BOUNDARY, EVEN_D)
        do = _load_rows(do_base, offs_m, stride_dn, offs_dv, stride_dd, nq, DV, BOUNDARY, EVEN_DV)
        if BOUNDARY:
            lse = tl.load(l_ptr + offs_m * stride_ln, mask=offs_m < nq, other=0.0)
            delta = tl.load(delta_ptr + offs_m * stride_ln, mask=offs_m < nq, other=0.0)
        else:
            lse = tl.load(l_ptr + offs_m * stride_ln)
            delta = tl.load(delta_ptr + offs_m * stride_ln)
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.44269504)  # 1/ln 2; empty rows: every score is -inf
        rows_c = tl.minimum(offs_m, nq - 1)
        s, t = _scores(q, k, qk_scale, offs_m, offs_m < nq, offs_n, nk, offset, lo, hi, kp_row, stride_kpn,
                       m_row + rows_c * stride_mm, stride_mn, rel_row - rows_c, cap_in, cap_log2,
                       BOUNDARY, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, FP32_DOT, UPCAST)
        p = tl.exp2(s - lse2[:, None])  # (BLOCK_M, BLOCK_N) softmax weights
        dv += _dot(tl.trans(p.to(do.dtype)), do, FP32_DOT, UPCAST)
        dp = _dot(do, tl.trans(v), FP32_DOT, UPCAST)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)  # d(cap·tanh(x/cap))/dx
        dk += _dot(tl.trans(ds.to(q.dtype)), q, FP32_DOT, UPCAST)
    return dk, dv


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV_, Mask, KP, CuQ, CuK, Rel,
    stride_qb, stride_qh, stride_qg, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_db, stride_dh, stride_dg, stride_dn, stride_dd,
    stride_lb, stride_lh, stride_lg, stride_ln,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_mb, stride_mh, stride_mg, stride_mm, stride_mn,
    stride_kpb, stride_kpn, stride_rh,
    HK, G, NQ, NK, D, DV, sm_scale, qk_scale, lo, hi, rel_base, cap_in, cap_log2,
    BOTTOM_RIGHT: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    HAS_KP: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, VARLEN: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_REL: tl.constexpr, REL_SHIFT: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
):
    """dK, dV for one key block of one key/value head, looping over its G query heads and, for
    each, the query tiles that can see the block: boundary, interior, boundary (transposed
    tiles: rows are keys)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)  # b * HK + hk
    hk = pid_bh % HK
    b = pid_bh // HK
    q_start, nq = _seq_bounds(CuQ, b, NQ, VARLEN)
    k_start, nk = _seq_bounds(CuK, b, NK, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= nk:
        return
    offset = (nk - nq) if BOTTOM_RIGHT else 0

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    k = _load_rows(K + b64 * stride_kb + hk * stride_kh + k_start.to(tl.int64) * stride_kn, offs_n, stride_kn, offs_d, stride_kd,
                   nk, D, True, EVEN_D)
    v = _load_rows(V + b64 * stride_vb + hk * stride_vh + k_start.to(tl.int64) * stride_vn, offs_n, stride_vn, offs_dv,
                   stride_vd, nk, DV, True, EVEN_DV)
    kp_row = KP + b64 * stride_kpb
    rel_c0 = rel_base - ((nk - nq) if REL_SHIFT else 0)
    n1 = tl.minimum(n0 + BLOCK_N, nk)
    m_lo, f_lo, f_hi, m_hi = _query_range(n0, n1, nq, offset, lo, hi, BLOCK_M, HAS_LO, HAS_HI)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        q_base = Q + b64 * stride_qb + hk * stride_qh + g * stride_qg + q_start.to(tl.int64) * stride_qn
        do_base = DOut + b64 * stride_db + hk * stride_dh + g * stride_dg + q_start.to(tl.int64) * stride_dn
        l_off = b64 * stride_lb + hk * stride_lh + g * stride_lg + q_start.to(tl.int64) * stride_ln
        m_row = Mask + b64 * stride_mb + hk * stride_mh + g * stride_mg
        rel_row = Rel + (hk * G + g) * stride_rh + rel_c0
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, Lse + l_off, Delta + l_off, m_lo, tl.minimum(f_lo, m_hi), offs_m0, offs_n, offs_d,
            offs_dv, stride_qn, stride_qd, stride_dn, stride_dd, stride_ln, nq, nk, D, DV, offset, lo, hi, qk_scale,
            kp_row, stride_kpn, m_row, stride_mm, stride_mn, rel_row, cap_in, cap_log2,
            True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_M,
        )  # fmt: skip
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, Lse + l_off, Delta + l_off, f_lo, f_hi, offs_m0, offs_n, offs_d,
            offs_dv, stride_qn, stride_qd, stride_dn, stride_dd, stride_ln, nq, nk, D, DV, offset, lo, hi, qk_scale,
            kp_row, stride_kpn, m_row, stride_mm, stride_mn, rel_row, cap_in, cap_log2,
            False, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_M,
        )  # fmt: skip
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, Lse + l_off, Delta + l_off, f_hi, m_hi, offs_m0, offs_n, offs_d,
            offs_dv, stride_qn, stride_qd, stride_dn, stride_dd, stride_ln, nq, nk, D, DV, offset, lo, hi, qk_scale,
            kp_row, stride_kpn, m_row, stride_mm, stride_mn, rel_row, cap_in, cap_log2,
            True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_M,
        )  # fmt: skip
    dk = dk * sm_scale
    tl.store(DK + b64 * stride_dkb + hk * stride_dkh + (k_start.to(tl.int64) + offs_n[:, None]) * stride_dkn
             + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=(offs_n[:, None] < nk) & (offs_d[None, :] < D))
    tl.store(DV_ + b64 * stride_dvb + hk * stride_dvh + (k_start.to(tl.int64) + offs_n[:, None]) * stride_dvn
             + offs_dv[None, :] * stride_dvd, dv.to(DV_.dtype.element_ty), mask=(offs_n[:, None] < nk) & (offs_dv[None, :] < DV))


@triton.jit
def _delta_tiles(
    delta, q, do, lse2, k_base, v_base, start, end, offs_m, row_ok, offs_n0, offs_d, offs_dv,
    stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
    kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
    BOUNDARY: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_KP: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REL: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``Σ_j p_ij·dp_ij`` over the key tiles ``[start, end)``, from the program's own fp32 weights."""
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        k = _load_rows(k_base, offs_n, stride_kn, offs_d, stride_kd, nk, D, BOUNDARY, EVEN_D)
        v = _load_rows(v_base, offs_n, stride_vn, offs_dv, stride_vd, nk, DV, BOUNDARY, EVEN_DV)
        s, _t = _scores(q, k, qk_scale, offs_m, row_ok, offs_n, nk, offset, lo, hi, kp_row, stride_kpn, m_rows, stride_mn,
                        rel_rows, cap_in, cap_log2, BOUNDARY, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL,
                        FP32_DOT, UPCAST)
        delta += tl.sum(tl.exp2(s - lse2[:, None]) * _dot(do, tl.trans(v), FP32_DOT, UPCAST), 1)
    return delta


@triton.jit
def _dq_tiles(
    dq, carry, c_at, q, do, lse2, delta, k_base, v_base, start, end, offs_m, row_ok, offs_n0, offs_d, offs_dv,
    stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
    kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2, drel_row, rel_len, gidx, wrap,
    BOUNDARY: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_KP: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_REL: tl.constexpr, REL_GRAD: tl.constexpr, FP32_DOT: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ over the key tiles ``[start, end)``; with ``REL_GRAD`` also the bias's diagonal sums
    (``carry``: the previous tile's upper half; ``c_at``: the DRel index of diagonal 0)."""
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        k = _load_rows(k_base, offs_n, stride_kn, offs_d, stride_kd, nk, D, BOUNDARY, EVEN_D)
        v = _load_rows(v_base, offs_n, stride_vn, offs_dv, stride_vd, nk, DV, BOUNDARY, EVEN_DV)
        s, t = _scores(q, k, qk_scale, offs_m, row_ok, offs_n, nk, offset, lo, hi, kp_row, stride_kpn, m_rows, stride_mn,
                       rel_rows, cap_in, cap_log2, BOUNDARY, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL,
                       FP32_DOT, UPCAST)
        p = tl.exp2(s - lse2[:, None])
        dp = _dot(do, tl.trans(v), FP32_DOT, UPCAST)
        ds = p * (dp - delta[:, None])  # w.r.t. the modified score: 0 outside the allowed pairs
        if REL_GRAD:
            lower, upper = _diagonal_sums(ds, gidx, wrap)
            at = c_at - BLOCK_N + offs_n0
            tl.atomic_add(drel_row + at, lower + carry, mask=(at >= 0) & (at < rel_len), sem="relaxed")
            carry = upper
            c_at += BLOCK_N
        if SOFTCAP:
            ds = ds * (1.0 - t * t)  # d(cap·tanh(x/cap))/dx
        dq += _dot(ds.to(k.dtype), k, FP32_DOT, UPCAST)
    return dq, carry, c_at


@triton.jit
def bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, Mask, KP, CuQ, CuK, Rel, DRel, DLse,
    stride_qb, stride_qh, stride_qg, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_db, stride_dh, stride_dg, stride_dn, stride_dd,
    stride_lb, stride_lh, stride_lg, stride_ln,
    stride_dqb, stride_dqh, stride_dqg, stride_dqn, stride_dqd,
    stride_mb, stride_mh, stride_mg, stride_mm, stride_mn,
    stride_kpb, stride_kpn, stride_rh,
    HK, G, NQ, NK, D, DV, sm_scale, qk_scale, lo, hi, rel_base, cap_in, cap_log2, rel_len,
    BOTTOM_RIGHT: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    HAS_KP: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, VARLEN: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_REL: tl.constexpr, REL_SHIFT: tl.constexpr, REL_GRAD: tl.constexpr, HAS_DLSE: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
):
    """dQ for one query block of one query head, over the key tiles it can see: boundary,
    interior, boundary.
    Kept whole: one fused kernel body; splitting it would move the running state through memory.

    ``REL_GRAD``: also the gradient of the relative bias, ``DRel[h, j - i + c0] += dS`` (fp32,
    zeroed by the caller). Each tile's diagonal sums cover diagonals ``[n0 - q0 - BLOCK_N,
    n0 - q0 + BLOCK_N)``; the upper half is the next tile's lower half (the three runs of tiles
    are consecutive), so it is carried over and each program adds every diagonal once, with one
    vector atomic per tile: the only atomics of the backward, so dQ/dK/dV stay bit-identical
    from run to run and DRel differs only in the order of its fp32 sums. Padding rows get an
    infinite lse, so their weights, and dS, are exactly 0 in every tile.

    dS sums to zero along a row, but ``delta = rowsum(dO∘O)`` from the output rounded to 16 bits
    misses that by ~2^-9·|dO|·|O|, an error every weight of the row repeats and the bias's
    gradient sums along the diagonals (an ALiBi slope's weighs it by the distance: 1% off in
    bf16 at 40 keys). So with ``REL_GRAD`` a first pass takes delta from the program's own fp32
    weights, ``Σ_j p_ij·dp_ij − dlse_i``, and dQ uses it too (two more dots per tile)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    g = pid_bh % G
    hk = (pid_bh // G) % HK
    b = pid_bh // (G * HK)
    q_start, nq = _seq_bounds(CuQ, b, NQ, VARLEN)
    k_start, nk = _seq_bounds(CuK, b, NK, VARLEN)
    q0 = pid_m * BLOCK_M
    if q0 >= nq:
        return
    offset = (nk - nq) if BOTTOM_RIGHT else 0

    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    row_ok = offs_m < nq
    rows_c = tl.minimum(offs_m, nq - 1)
    rows = q_start.to(tl.int64) + offs_m
    q = _load_rows(Q + b64 * stride_qb + hk * stride_qh + g * stride_qg + q_start.to(tl.int64) * stride_qn, offs_m, stride_qn,
                   offs_d, stride_qd, nq, D, True, EVEN_D)
    do = _load_rows(DOut + b64 * stride_db + hk * stride_dh + g * stride_dg + q_start.to(tl.int64) * stride_dn, offs_m,
                    stride_dn, offs_dv, stride_dd, nq, DV, True, EVEN_DV)
    l_off = b64 * stride_lb + hk * stride_lh + g * stride_lg + rows * stride_ln
    lse = tl.load(Lse + l_off, mask=row_ok, other=0.0)
    delta = tl.load(Delta + l_off, mask=row_ok, other=0.0)
    # 1/ln 2; an empty row: every score is -inf; a padding row: +inf, so its weights are 0 in interior tiles too
    lse2 = tl.where(row_ok, tl.where(lse == float("-inf"), 0.0, lse * 1.44269504), float("inf"))
    k_base = K + b64 * stride_kb + hk * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + hk * stride_vh + k_start.to(tl.int64) * stride_vn
    m_rows = Mask + b64 * stride_mb + hk * stride_mh + g * stride_mg + rows_c * stride_mm
    kp_row = KP + b64 * stride_kpb
    rel_c0 = rel_base - ((nk - nq) if REL_SHIFT else 0)
    rel_rows = Rel + (hk * G + g) * stride_rh + (rel_c0 - rows_c)

    q1 = tl.minimum(q0 + BLOCK_M, nq)
    k_lo, f_lo, f_hi, k_hi = _key_range(q0, q1 - 1, k_start * 0, nk, offset, lo, hi, BLOCK_N, HAS_LO, HAS_HI)

    skew = tl.arange(0, BLOCK_M)[:, None] + offs_n0[None, :]
    gidx = skew % BLOCK_N
    wrap = skew >= BLOCK_N
    drel_row = DRel + (hk * G + g) * stride_rh
    carry = tl.zeros([BLOCK_N], tl.float32)
    c_at = k_lo - q0 + rel_c0  # DRel index of the current tile's diagonal n - m = 0
    if REL_GRAD:
        tl.static_assert(BLOCK_M <= BLOCK_N)
        delta = tl.zeros([BLOCK_M], tl.float32)
        delta = _delta_tiles(
            delta, q, do, lse2, k_base, v_base, k_lo, tl.minimum(f_lo, k_hi), offs_m, row_ok, offs_n0, offs_d, offs_dv,
            stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
            kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
            True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N,
        )  # fmt: skip
        delta = _delta_tiles(
            delta, q, do, lse2, k_base, v_base, f_lo, f_hi, offs_m, row_ok, offs_n0, offs_d, offs_dv,
            stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
            kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
            False, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N,
        )  # fmt: skip
        delta = _delta_tiles(
            delta, q, do, lse2, k_base, v_base, f_hi, k_hi, offs_m, row_ok, offs_n0, offs_d, offs_dv,
            stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
            kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2,
            True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N,
        )  # fmt: skip
        if HAS_DLSE:
            delta -= tl.load(DLse + l_off, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq, carry, c_at = _dq_tiles(
        dq, carry, c_at, q, do, lse2, delta, k_base, v_base, k_lo, tl.minimum(f_lo, k_hi), offs_m, row_ok, offs_n0, offs_d,
        offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
        kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2, drel_row, rel_len, gidx, wrap,
        True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, REL_GRAD, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N,
    )  # fmt: skip
    dq, carry, c_at = _dq_tiles(
        dq, carry, c_at, q, do, lse2, delta, k_base, v_base, f_lo, f_hi, offs_m, row_ok, offs_n0, offs_d,
        offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
        kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2, drel_row, rel_len, gidx, wrap,
        False, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, REL_GRAD, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N,
    )  # fmt: skip
    dq, carry, c_at = _dq_tiles(
        dq, carry, c_at, q, do, lse2, delta, k_base, v_base, f_hi, k_hi, offs_m, row_ok, offs_n0, offs_d,
        offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, nk, D, DV, offset, lo, hi, qk_scale,
        kp_row, stride_kpn, m_rows, stride_mn, rel_rows, cap_in, cap_log2, drel_row, rel_len, gidx, wrap,
        True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, SOFTCAP, HAS_REL, REL_GRAD, FP32_DOT, UPCAST, EVEN_D, EVEN_DV, BLOCK_N,
    )  # fmt: skip
    if REL_GRAD:
        at = c_at - BLOCK_N + offs_n0
        tl.atomic_add(drel_row + at, carry, mask=(at >= 0) & (at < rel_len), sem="relaxed")
    dq = dq * sm_scale
    tl.store(DQ + b64 * stride_dqb + hk * stride_dqh + g * stride_dqg + rows[:, None] * stride_dqn
             + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def stats_kernel(
    Q, K, Lse, Ent, MaxW, Dist, NKeys, TopV, TopI, KW, RW, KPos, RPos, Mask, KP,
    stride_qb, stride_qh, stride_qg, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_mb, stride_mh, stride_mg, stride_mm, stride_mn,
    stride_kpb, stride_kpn,
    HK, G, NQ, NK, D, qk_scale, lo, hi, pos_offset,
    BOTTOM_RIGHT: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    HAS_KP: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    K_TOP: tl.constexpr, N_KPOS: tl.constexpr, N_RPOS: tl.constexpr,
):
    """Per-row attention statistics in one pass (the forward kernel's loop without V).
    Kept whole: one fused kernel body; splitting it would move the running state through memory.

    Kept per row, in base 2, rescaled like the output when the running maximum m grows:
    l = Σ 2^(s-m), e = Σ 2^(s-m)·(s-m) (entropy), the distance sum Σ 2^(s-m)·|pos-j|, the
    weights on ``N_KPOS`` chosen keys and ``N_RPOS`` offsets, the count of allowed keys, and the
    ``K_TOP`` best scores with their keys (each tile offers its ``K_TOP`` best, each replacing the
    running minimum it beats; the caller sorts). Query row i sits at key position
    ``i + pos_offset``. Outputs are contiguous ``(rows, ·)`` with row ``(b·HK + hk)·G + g`` times
    ``NQ`` plus the query index.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)  # b * HK * G + hk * G + g
    g = pid_bh % G
    hk = (pid_bh // G) % HK
    b = pid_bh // (G * HK)
    nq = NQ
    nk = NK
    q0 = pid_m * BLOCK_M
    offset = (nk - nq) if BOTTOM_RIGHT else 0
    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    cols_top = tl.arange(0, K_TOP)
    b64 = b.to(tl.int64)
    q_base = Q + b64 * stride_qb + hk * stride_qh + g * stride_qg
    k_base = K + b64 * stride_kb + hk * stride_kh
    m_row = Mask + b64 * stride_mb + hk * stride_mh + g * stride_mg
    kp_row = KP + b64 * stride_kpb
    q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < nq) & (offs_d[None, :] < D), other=0.0)
    row_ok = offs_m < nq
    m_rows = m_row + tl.minimum(offs_m, nq - 1) * stride_mm
    pos = offs_m + pos_offset  # key position of each query row (distance and relative keys)

    q1 = tl.minimum(q0 + BLOCK_M, nq)
    k_lo = 0
    k_hi = nk
    if HAS_LO:
        k_lo = tl.maximum(0, q0 + offset + lo)
    if HAS_HI:
        k_hi = tl.minimum(nk, q1 - 1 + offset + hi + 1)
    k_lo = (k_lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    e_i = tl.zeros([BLOCK_M], tl.float32)
    d_i = tl.zeros([BLOCK_M], tl.float32)
    cnt = tl.zeros([BLOCK_M], tl.int32)
    kw = tl.zeros([BLOCK_M, N_KPOS], tl.float32)
    rw = tl.zeros([BLOCK_M, N_RPOS], tl.float32)
    top_v = tl.full([BLOCK_M, K_TOP], float("-inf"), tl.float32)
    top_i = tl.full([BLOCK_M, K_TOP], -1, tl.int32)
    kcols = tl.arange(0, N_KPOS)
    rcols = tl.arange(0, N_RPOS)
    for n0 in range(k_lo, k_hi, BLOCK_N):
        offs_n = n0 + offs_n0
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=(offs_n[:, None] < nk) & (offs_d[None, :] < D), other=0.0)
        s, _t = _scores(q, k, qk_scale, offs_m, row_ok, offs_n, nk, offset, lo, hi, kp_row, stride_kpn, m_rows, stride_mn,
                        m_rows, 0.0, 0.0, True, HAS_LO, HAS_HI, HAS_KP, HAS_MASK, MASK_BOOL, False, False, FP32_DOT, UPCAST)
        live = s != float("-inf")  # a float -inf bias masks like a bool mask
        cnt += tl.sum(live.to(tl.int32), 1)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        delta = tl.where(m_i == float("-inf"), 0.0, m_i - m_safe)  # <= 0: how far the maximum moved
        alpha = tl.exp2(delta)
        e_i = alpha * (e_i + delta * l_i)  # Σ p̃ (s - m), re-centred on the new maximum
        l_i = alpha * l_i
        d_i = alpha * d_i
        kw = kw * alpha[:, None]
        rw = rw * alpha[:, None]
        ts = tl.where(live, s - m_safe[:, None], 0.0)
        p = tl.where(live, tl.exp2(ts), 0.0)
        l_i += tl.sum(p, 1)
        e_i += tl.sum(p * ts, 1)
        d_i += tl.sum(p * tl.abs(offs_n[None, :] - pos[:, None]).to(tl.float32), 1)
        for c in tl.static_range(N_KPOS):
            j = tl.load(KPos + c)
            hit = tl.sum(tl.where(offs_n[None, :] == j, p, 0.0), 1)
            kw = tl.where(kcols[None, :] == c, kw + hit[:, None], kw)
        for c in tl.static_range(N_RPOS):
            r = tl.load(RPos + c)
            hit = tl.sum(tl.where(offs_n[None, :] == (pos + r)[:, None], p, 0.0), 1)
            rw = tl.where(rcols[None, :] == c, rw + hit[:, None], rw)
        m_i = m_new
        ss = s
        for _ in tl.static_range(K_TOP):
            x = tl.max(ss, 1)
            jx = tl.argmax(ss, 1)
            low = tl.min(top_v, 1)
            slot = tl.argmin(top_v, 1)
            take = (x > low)[:, None] & (cols_top[None, :] == slot[:, None])
            top_v = tl.where(take, x[:, None], top_v)
            top_i = tl.where(take, (n0 + jx)[:, None], top_i)
            ss = tl.where(offs_n0[None, :] == jx[:, None], float("-inf"), ss)

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    lse2 = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
    ent = tl.where(has, (tl.log2(l_safe) - e_i / l_safe) * 0.6931471805599453, 0.0)  # ln 2
    row = pid_bh.to(tl.int64) * nq + offs_m
    rmask = offs_m < nq
    tl.store(Lse + row, lse2 * 0.6931471805599453, mask=rmask)
    tl.store(Ent + row, tl.maximum(ent, 0.0), mask=rmask)
    tl.store(MaxW + row, tl.where(has, 1.0 / l_safe, 0.0), mask=rmask)
    tl.store(Dist + row, d_i / l_safe, mask=rmask)
    tl.store(NKeys + row, cnt, mask=rmask)
    tl.store(TopV + row[:, None] * K_TOP + cols_top[None, :], top_v, mask=rmask[:, None])  # base-2 scores
    tl.store(TopI + row[:, None] * K_TOP + cols_top[None, :], top_i, mask=rmask[:, None])
    tl.store(KW + row[:, None] * N_KPOS + kcols[None, :], kw / l_safe[:, None], mask=rmask[:, None])
    tl.store(RW + row[:, None] * N_RPOS + rcols[None, :], rw / l_safe[:, None], mask=rmask[:, None])


# shared with the decoding kernels (:mod:`.decode`)
dot, tanh, key_range = _dot, _tanh, _key_range
