"""``triton``: the fused kernels of :mod:`.kernels` behind torch custom ops, with autograd.

The forward and backward are registered as ``qkv::triton_attention_fwd`` /
``qkv::triton_attention_bwd`` (``torch.library.custom_op`` with fake implementations), joined
by an autograd function, so ``torch.compile`` traces through a call instead of breaking the
graph and ``torch.func`` transforms work. Both ops take the grouped layout of :meth:`AttentionCall.grouped_qkv`, and, for
packed variable-length batches, ``cu_seqlens`` tensors (see :mod:`qkv.varlen`).

This module imports triton; :mod:`qkv.backends.triton` imports it lazily.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor

from ...call import AttentionCall
from ...nonfinite import Checked
from ...score_mods.softcap import check_cap
from ..base import follow_rule
from ..tiles import LN2, LOG2E
from . import MAX_DECODE_GROUP, MAX_DECODE_ROWS, configs, decode_fits
from . import decode as D
from . import kernels as K
from .configs import Config

# fp32 inputs: tl.dot precision on a GPU. By default it follows torch's own float32 matmul
# setting, as SDPA's math path does: full fp32 products ("ieee") under the default
# torch.set_float32_matmul_precision("highest"), tensor-core "tf32" (10-bit mantissa products,
# fp32 sums) under "high" or "medium". QKV_TRITON_FP32_DOT=ieee|tf32 overrides it. The
# interpreter always computes in fp32.
FP32_DOT_CHOICES = ("ieee", "tf32")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # (triton.cdiv is a jit function: slower to call from Python on every launch)


def _pow2(n: int) -> int:
    """The next power of two of ``n >= 1``."""
    return 1 << (n - 1).bit_length()


def interpreting() -> bool:
    """Is Triton running kernels through its CPU interpreter (``TRITON_INTERPRET=1``)?"""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def head_tile(n: int, itemsize: int, interp: Optional[bool] = None) -> int:
    """Tile width for a head dim of ``n``: the next power of two, at least 16 (``tl.dot``'s
    minimum), and at least 32 for 16-bit tiles on a GPU — measured on an H100 with Triton 3.6,
    fp16 with head dim 24 and value dim 8 (tiles 32 and 16) came out wrong by ~1 while 32-wide
    value tiles, and fp32, were exact (bench/results/gpu_check_nvidia-h100-80gb-hbm3.md)."""
    floor = 16 if (interpreting() if interp is None else interp) or itemsize >= 4 else 32
    return max(floor, _pow2(n))


_OVERRIDE: dict[str, Config] = {}  # kind -> config, set by :func:`override` (the autotune's candidates)


@functools.lru_cache(maxsize=None)
def device_arch(index: int) -> str:
    """``"sm90"`` for an H100/H200 and so on: the architecture key of :data:`configs.CONFIGS`
    (cached: asked on every launch)."""
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


@functools.lru_cache(maxsize=None)
def device_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (cached)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_config(kind: str, d: int, dv: int, itemsize: int = 2, mask: str = "any", device: Optional[torch.device] = None) -> Config:
    """The tiles, warps and stages of one kernel launch, from :data:`configs.CONFIGS` for this
    GPU's architecture (``kind`` in :data:`configs.KINDS`; ``mask`` a :func:`configs.mask_kind`).
    16×16 tiles in the interpreter (each tile is NumPy work, so small tiles keep tests fast);
    :func:`override` replaces a kind's entry (the autotune's candidates)."""
    if kind in _OVERRIDE:
        return _OVERRIDE[kind]
    if interpreting():
        return configs.INTERPRETER
    arch = "default"
    if device is not None and device.type == "cuda":
        arch = device_arch(device.index if device.index is not None else torch.cuda.current_device())
    return configs.lookup(arch, d, dv, itemsize, kind, mask)


@contextlib.contextmanager
def override(kind: str, config: Config):
    """Launch ``kind`` with ``config`` inside the block (the GPU check's autotune)."""
    before = _OVERRIDE.get(kind)
    _OVERRIDE[kind] = config
    try:
        yield
    finally:
        if before is None:
            _OVERRIDE.pop(kind, None)
        else:
            _OVERRIDE[kind] = before


def fp32_dot() -> str:
    """The ``tl.dot`` precision for fp32 inputs on this call (see ``FP32_DOT_CHOICES``)."""
    if interpreting():
        return "ieee"
    chosen = os.environ.get("QKV_TRITON_FP32_DOT", "").strip().lower()
    if chosen:
        if chosen not in FP32_DOT_CHOICES:
            raise ValueError(f"QKV_TRITON_FP32_DOT={chosen!r}: choose one of {', '.join(FP32_DOT_CHOICES)} (or unset it to follow torch)")
        return chosen
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _mask_args(mask: Optional[torch.Tensor], dummy: torch.Tensor):
    """(tensor, 5 strides, HAS_MASK, MASK_BOOL); size-1 dims get stride 0 (broadcast)."""
    if mask is None:
        return dummy, (0, 0, 0, 0, 0), False, False
    is_bool = mask.dtype == torch.bool
    if is_bool:
        mask = mask.view(torch.uint8)  # same bytes; Triton loads bytes more portably than i1
    strides = tuple(0 if s == 1 else st for s, st in zip(mask.shape, mask.stride()))
    return mask, strides, True, is_bool


def _kp_args(kp: Optional[torch.Tensor], dummy: torch.Tensor):
    if kp is None:
        return dummy, (0, 0), False
    kp = kp.view(torch.uint8)
    return kp, (0 if kp.shape[0] == 1 else kp.stride(0), kp.stride(1)), True


def _common(q, k, mask, kp, cu_q, cu_k, max_q, max_k, lo, hi, bottom_right):
    b, hk, g, nq, d = q.shape
    nk = k.shape[3]
    varlen = cu_q is not None
    if varlen:
        b = cu_q.shape[0] - 1
        nq_grid, nk_grid = max_q, max_k
    else:
        nq_grid, nk_grid = nq, nk
    m, m_strides, has_mask, mask_bool = _mask_args(mask, q)
    kpt, kp_strides, has_kp = _kp_args(kp, q)
    meta = dict(
        BOTTOM_RIGHT=bool(bottom_right), HAS_LO=lo is not None, HAS_HI=hi is not None,
        HAS_KP=has_kp, HAS_MASK=has_mask, MASK_BOOL=mask_bool, VARLEN=varlen, FP32_DOT=fp32_dot(),
        UPCAST=interpreting() and q.dtype == torch.bfloat16,  # see kernels._dot
    )
    cuq = cu_q if varlen else q
    cuk = cu_k if varlen else q
    return b, hk, g, nq, nk, nq_grid, nk_grid, m, m_strides, kpt, kp_strides, cuq, cuk, meta


def _batch_stride(t: torch.Tensor, varlen: bool) -> int:
    return 0 if varlen else t.stride(0)


def _score_args(q, softcap, rel, rel_base, rel_shift):
    """A built-in score function as kernel arguments: ``(Rel, stride_rh, scalars, flags)``.

    ``rel (Hq, L)``: the bias of query head h, row i and key j is ``rel[h, j - i + c0]`` with
    ``c0 = rel_base`` less, when ``rel_shift``, each sequence's ``Nk - Nq`` (a packed batch's
    bottom-right alignment). The scalars are ``rel_base``, ``ln 2/cap`` and ``cap·log2e/2`` (see
    :func:`kernels._tile_scores`); ``softcap`` must lie in float32's normal range
    (:func:`run_attention` checks)."""
    has_rel = rel is not None
    rel_t = rel.float().contiguous() if has_rel else q
    cap_in = LN2 / softcap if softcap is not None else 0.0
    cap_log2 = softcap * LOG2E / 2 if softcap is not None else 0.0  # halved: fits float32 for every cap that does
    flags = dict(SOFTCAP=softcap is not None, HAS_REL=has_rel, REL_SHIFT=has_rel and bool(rel_shift))
    return rel_t, (rel_t.stride(0) if has_rel else 0), (int(rel_base), float(cap_in), float(cap_log2)), flags


def _mask_kind(meta: dict) -> str:
    return configs.mask_kind(meta["HAS_LO"] or meta["HAS_HI"], meta["HAS_KP"] or meta["HAS_MASK"])


def _tiles(d: int, dv: int, itemsize: int) -> dict:
    """Head-dim tile widths, and whether each fills its tile (then its loads need no column mask)."""
    interp = interpreting()
    bd, bdv = head_tile(d, itemsize, interp), head_tile(dv, itemsize, interp)
    return dict(BLOCK_D=bd, BLOCK_DV=bdv, EVEN_D=bd == d, EVEN_DV=bdv == dv)


MIN_DECODE_PART = 256  # keys per part on a GPU: a shorter part costs more to merge than it saves
# Programs per SM the decoding grid aims at: several, so that the last wave of equal-sized
# programs leaves few SMs idle (a memory-bound kernel needs every SM pulling its share of the
# bandwidth to the end); the parts stay at least MIN_DECODE_PART keys long
DECODE_PROGRAMS_PER_SM = 8
# The bits of +inf in each input dtype: a NaN or ±inf, sign cleared, is at or above them (.decode)
_INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}


def decode_parts(first: int, last: int, jobs: int, block_n: int, sms: int, min_part: int) -> tuple[int, int]:
    """How to split keys ``[first, last)`` (``first`` a multiple of ``block_n``) over parts for
    ``jobs`` = B·Hk programs: ``(parts, keys per part)``, enough parts to give every SM
    :data:`DECODE_PROGRAMS_PER_SM` programs, none shorter than ``min_part`` keys, each a whole
    number of tiles."""
    tiles = max(1, _cdiv(last - first, block_n))
    want = max(1, _cdiv(DECODE_PROGRAMS_PER_SM * sms, max(jobs, 1)))
    most = max(1, _cdiv(last - first, min_part))
    per = _cdiv(tiles, min(want, most, tiles)) * block_n
    return max(1, _cdiv(last - first, per)), per


def use_decode(nq: int, nk: int, g: int, varlen: bool) -> bool:
    """Does a forward take :func:`triton_decode` (:func:`qkv.backends.triton.decode_fits`), not
    packed? Its ``(out, lse)`` are the forward's, so the backward is the same either way.
    ``QKV_TRITON_DECODE=0`` turns it off (the benchmark's comparison), ``=1`` forces it where it
    fits (also for ``Nq >= Nk``)."""
    chosen = os.environ.get("QKV_TRITON_DECODE", "")
    if chosen in ("0", "1"):
        return chosen == "1" and not varlen and 0 < nq <= MAX_DECODE_ROWS and g * nq <= MAX_DECODE_GROUP and nk > 0
    return not varlen and decode_fits(nq, nk, g)


def triton_decode(q, k, v, m, ms, kpt, kps, meta, scale, lo, hi, score, sinks_t, has_sinks, out, lse, check=False):
    """Flash-decoding forward into ``out``/``lse`` (:mod:`.decode`): one program per (part of the
    keys, key/value head) for all G·Nq rows of the group, the parts merged exactly. ``check``:
    the non-finite rule in the kernels (every key and value read, bad rows NaN): ``(out, lse)``
    then follow it. Without, only the keys the band leaves to some row are read."""
    b, hk, g, nq, d = q.shape
    nk, dv = k.shape[3], v.shape[-1]
    rel_t, stride_rh, score_scalars, score_flags = score
    cfg = launch_config("decode", d, dv, q.element_size(), _mask_kind(meta), q.device)
    bn = cfg.BLOCK_N
    rows = g * nq
    if check:
        first, last = 0, nk  # the rule: every key and value is read
    else:
        offset = nk - nq if meta["BOTTOM_RIGHT"] else 0
        first = 0 if lo is None else min(max(0, offset + lo), nk)  # keys no row can see are not split
        last = nk if hi is None else max(0, min(nk, nq - 1 + offset + hi + 1))
        first = (first // bn) * bn
        last = max(last, first)
    if interpreting():
        sms, min_part = 1, 2 * bn  # several small parts (DECODE_PROGRAMS_PER_SM), so the tests exercise the merge
    else:
        sms, min_part = device_sms(q.device.index if q.device.index is not None else torch.cuda.current_device()), MIN_DECODE_PART
    parts, per = decode_parts(first, last, b * hk, bn, sms, min_part)
    jobs = b * hk
    tiles = _tiles(d, dv, q.element_size())
    # the workspace, one allocation (each is a per-call cost): per row of each part its O (BLOCK_DV
    # floats), m, l and the rule's flags (int32), each array starting 16 bytes aligned (an
    # unaligned one would be another specialisation of the kernel to compile)
    n = _cdiv(jobs * parts * rows, 4) * 4
    o_end = n * tiles["BLOCK_DV"]
    ws = torch.empty(o_end + 3 * n, dtype=torch.float32, device=q.device)
    part_o, part_m, part_l, part_f = ws[:o_end], ws[o_end : o_end + n], ws[o_end + n : o_end + 2 * n], ws[o_end + 2 * n :]
    part_f = part_f.view(torch.int32)
    block_m = max(16, _pow2(rows))
    D.decode_kernel[(parts, jobs)](
        q, k, v, part_o, part_m, part_l, part_f, m, kpt, rel_t,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3), q.stride(4),
        k.stride(0), k.stride(1), k.stride(3), k.stride(4),
        v.stride(0), v.stride(1), v.stride(3), v.stride(4),
        *ms, *kps, stride_rh,
        hk, g, nq, nk, d, dv, scale * LOG2E, 0 if lo is None else lo, 0 if hi is None else hi, *score_scalars, per, parts, first,
        last, BOTTOM_RIGHT=meta["BOTTOM_RIGHT"], HAS_LO=meta["HAS_LO"], HAS_HI=meta["HAS_HI"], HAS_KP=meta["HAS_KP"],
        HAS_MASK=meta["HAS_MASK"], MASK_BOOL=meta["MASK_BOOL"], SOFTCAP=score_flags["SOFTCAP"], HAS_REL=score_flags["HAS_REL"],
        CHECK=check, INF_BITS=_INF_BITS[q.dtype], FP32_DOT=meta["FP32_DOT"], UPCAST=meta["UPCAST"], BLOCK_M=block_m,
        BLOCK_N=bn, **tiles, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    D.decode_merge_kernel[(jobs,)](
        part_o, part_m, part_l, part_f, out, lse, sinks_t,
        out.stride(0), out.stride(1), out.stride(2), out.stride(3), out.stride(4),
        lse.stride(0), lse.stride(1), lse.stride(2), lse.stride(3),
        hk, g, nq, dv, parts,
        HAS_SINKS=has_sinks, CHECK=check, BLOCK_M=block_m, BLOCK_DV=tiles["BLOCK_DV"],
        num_warps=4 if not interpreting() else 1,
    )  # fmt: skip
    return out, lse


def triton_fwd(q, k, v, mask, kp, cu_q, cu_k, max_q, max_k, scale, lo, hi, bottom_right,
               softcap=None, rel=None, rel_base=0, rel_shift=False, sinks=None, prepare_only=False, check=False):  # fmt: skip
    """q ``(B, Hk, G, Nq, D)``, k/v ``(B, Hk, 1, Nk, ·)`` → out ``(B, Hk, G, Nq, Dv)``, lse float32.

    ``softcap``/``rel``: a built-in score function (:func:`_score_args`); ``sinks (Hq,)``: logits
    in every row's denominator (the lse includes them). A few query rows per head against a
    longer key sequence take :func:`triton_decode` (:func:`use_decode`), which with ``check``
    applies the non-finite rule in its kernels (the tiled forward ignores it). ``prepare_only``: return
    ``(launch, out, lse)``, ``launch`` a closure that runs the tiled kernel alone into them, its
    arguments prepared once (:func:`bare_forward`)."""
    b, hk, g, nq, nk, nq_grid, _, m, ms, kpt, kps, cuq, cuk, meta = _common(q, k, mask, kp, cu_q, cu_k, max_q, max_k, lo, hi, bottom_right)
    score = _score_args(q, softcap, rel, rel_base, rel_shift)
    rel_t, stride_rh, score_scalars, score_flags = score
    sinks_t = sinks.float().contiguous() if sinks is not None else q
    d, dv = q.shape[-1], v.shape[-1]
    out = torch.empty(*q.shape[:-1], dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    varlen = meta["VARLEN"]
    if use_decode(nq, nk, g, varlen) and b * hk * g > 0 and not prepare_only:
        return triton_decode(q, k, v, m, ms, kpt, kps, meta, scale, lo, hi, score, sinks_t, sinks is not None, out, lse, check)
    cfg = launch_config("fwd", d, dv, q.element_size(), _mask_kind(meta), q.device)
    grid = (_cdiv(max(nq_grid, 1), cfg.BLOCK_M), b * hk * g)
    args = (
        q, k, v, out, lse, m, kpt, cuq, cuk, rel_t, sinks_t,
        _batch_stride(q, varlen), q.stride(1), q.stride(2), q.stride(3), q.stride(4),
        _batch_stride(k, varlen), k.stride(1), k.stride(3), k.stride(4),
        _batch_stride(v, varlen), v.stride(1), v.stride(3), v.stride(4),
        _batch_stride(out, varlen), out.stride(1), out.stride(2), out.stride(3), out.stride(4),
        _batch_stride(lse, varlen), lse.stride(1), lse.stride(2), lse.stride(3),
        *ms, *kps, stride_rh,
        hk, g, nq, nk, d, dv, scale * LOG2E, 0 if lo is None else lo, 0 if hi is None else hi, *score_scalars,
    )  # fmt: skip
    consts = dict(**_tiles(d, dv, q.element_size()), **meta, **score_flags, HAS_SINKS=sinks is not None,
                  WARP_SPEC=cfg.warp_specialize, **cfg.launch())  # fmt: skip
    if prepare_only:
        return (lambda: K.fwd_kernel[grid](*args, **consts)), out, lse
    K.fwd_kernel[grid](*args, **consts)
    return out, lse


def bare_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = False):
    """A closure launching the forward kernel on q ``(B, H, N, D)``, k/v ``(B, H, N, ·)`` with
    every argument prepared once: the floor the benchmark sets the wrapper's per-call cost
    against (nothing validated, no rule applied, outputs overwritten in place)."""
    g = lambda t: t.unsqueeze(2)  # noqa: E731  (B, H, 1, N, D): one query head per key/value head
    return triton_fwd(g(q), g(k), g(v), None, None, None, None, 0, 0, scale, None, 0 if causal else None, False,
                      prepare_only=True)[0]  # fmt: skip


def triton_stats(q, k, mask, kp, scale, lo, hi, pos_offset: int, topk: int, key_positions, relative_positions) -> dict:
    """One-pass statistics (:func:`kernels.stats_kernel`) for q ``(B, Hk, G, Nq, D)``, k ``(B, Hk, 1, Nk, D)``;
    ``lo``/``hi`` the band of ``j - i`` (offsets resolved), ``pos_offset`` the key position of query row 0.

    Returns float32 ``lse``, ``entropy``, ``max_weight``, ``mean_distance`` ``(B, Hk, G, Nq)``,
    ``n_keys`` (int64), ``topk_weights``/``topk_indices`` ``(…, topk)`` sorted descending (-1 past
    the allowed keys), ``key_weights`` ``(…, P)`` and ``relative_weights`` ``(…, R)``.
    """
    b, hk, g, nq, nk, _, _, m, ms, kpt, kps, _, _, meta = _common(q, k, mask, kp, None, None, None, None, lo, hi, False)
    meta.pop("VARLEN")
    d = q.shape[-1]
    rows = b * hk * g * nq
    dev = q.device
    k_top = _pow2(max(1, topk))
    n_kpos = _pow2(max(1, len(key_positions)))
    n_rpos = _pow2(max(1, len(relative_positions)))
    far = 1 << 30  # padding entries: a position no key has
    kpos = torch.tensor(list(key_positions) + [-far] * (n_kpos - len(key_positions)), dtype=torch.int32, device=dev)
    rpos = torch.tensor(list(relative_positions) + [far] * (n_rpos - len(relative_positions)), dtype=torch.int32, device=dev)
    f32 = dict(dtype=torch.float32, device=dev)
    lse, ent, maxw, dist = (torch.empty(rows, **f32) for _ in range(4))
    nkeys = torch.empty(rows, dtype=torch.int32, device=dev)
    top_v = torch.empty(rows, k_top, **f32)
    top_i = torch.empty(rows, k_top, dtype=torch.int32, device=dev)
    kw, rw = torch.empty(rows, n_kpos, **f32), torch.empty(rows, n_rpos, **f32)
    if rows and nk:
        cfg = launch_config("fwd", d, d, q.element_size(), _mask_kind(meta), q.device).launch()
        grid = (_cdiv(nq, cfg["BLOCK_M"]), b * hk * g)
        K.stats_kernel[grid](
            q, k, lse, ent, maxw, dist, nkeys, top_v, top_i, kw, rw, kpos, rpos, m, kpt,
            q.stride(0), q.stride(1), q.stride(2), q.stride(3), q.stride(4),
            k.stride(0), k.stride(1), k.stride(3), k.stride(4),
            *ms, *kps,
            hk, g, nq, nk, d, scale * LOG2E, 0 if lo is None else lo, 0 if hi is None else hi, int(pos_offset),
            BLOCK_D=head_tile(d, q.element_size()), K_TOP=k_top, N_KPOS=n_kpos, N_RPOS=n_rpos, **meta, **cfg,
        )  # fmt: skip
    else:  # no key at all: every row is empty
        for t, v in ((lse, float("-inf")), (ent, 0.0), (maxw, 0.0), (dist, 0.0), (nkeys, 0), (top_v, float("-inf")),
                     (top_i, -1), (kw, 0.0), (rw, 0.0)):
            t.fill_(v)
    shape = (b, hk, g, nq)
    lse2 = (lse / 0.6931471805599453).unsqueeze(-1)
    order = torch.argsort(top_v, dim=-1, descending=True, stable=True)[:, :topk]
    tv, ti = top_v.gather(-1, order), top_i.gather(-1, order).long()
    gone = torch.isneginf(tv)
    weights = torch.where(gone, 0.0, torch.exp2(tv - lse2.masked_fill(torch.isneginf(lse2), 0.0)))
    return {
        "lse": lse.view(shape), "entropy": ent.view(shape), "max_weight": maxw.view(shape), "mean_distance": dist.view(shape),
        "n_keys": nkeys.long().view(shape), "topk_weights": weights.view(*shape, topk),
        "topk_indices": ti.masked_fill(gone, -1).view(*shape, topk),
        "key_weights": kw[:, : len(key_positions)].reshape(*shape, len(key_positions)),
        "relative_weights": rw[:, : len(relative_positions)].reshape(*shape, len(relative_positions)),
    }


def triton_bwd(dout, dlse, q, k, v, out, lse, mask, kp, cu_q, cu_k, max_q, max_k, scale, lo, hi, bottom_right,
               softcap=None, rel=None, rel_base=0, rel_shift=False, sinks=None, rel_grad=False):  # fmt: skip
    """Gradients for q, k, v (same shapes), and float32 ones for ``rel`` (when ``rel_grad``, else
    an empty tensor) and ``sinks`` (empty without sinks). ``lse`` is the forward's, sinks
    included. dq, dk, dv are deterministic (no atomics); d_rel is summed with fp32 atomics."""
    b, hk, g, nq, nk, nq_grid, nk_grid, m, ms, kpt, kps, cuq, cuk, meta = _common(
        q, k, mask, kp, cu_q, cu_k, max_q, max_k, lo, hi, bottom_right
    )
    rel_t, stride_rh, score_scalars, score_flags = _score_args(q, softcap, rel, rel_base, rel_shift)
    d, dv = q.shape[-1], v.shape[-1]
    varlen = meta["VARLEN"]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dvt = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    rel_grad = bool(rel_grad) and rel is not None
    f32 = dict(dtype=torch.float32, device=q.device)
    drel = torch.zeros(rel.shape, **f32) if rel_grad else torch.empty(0, **f32)  # atomics add into it
    dsink = torch.zeros(sinks.shape[0], **f32) if sinks is not None else torch.empty(0, **f32)
    if dq.numel() == 0 and dk.numel() == 0 and dvt.numel() == 0:
        return dq, dk, dvt, drel, dsink
    delta = torch.empty_like(lse)
    kind = _mask_kind(meta)
    cfg_kv = launch_config("bwd_dkdv", d, dv, q.element_size(), kind, q.device)
    cfg_q = launch_config("bwd_dq", d, dv, q.element_size(), kind, q.device).launch()
    if rel_grad and cfg_q["BLOCK_M"] > cfg_q["BLOCK_N"]:  # the bias's diagonal sums need BLOCK_M <= BLOCK_N
        cfg_q["BLOCK_M"] = cfg_q["BLOCK_N"]
    bm = cfg_q["BLOCK_M"]
    lse_strides = (_batch_stride(lse, varlen), lse.stride(1), lse.stride(2), lse.stride(3))
    do_strides = (_batch_stride(dout, varlen), dout.stride(1), dout.stride(2), dout.stride(3), dout.stride(4))
    has_dlse = dlse is not None
    if has_dlse:
        dlse = dlse.float().contiguous()  # shares lse's (contiguous) strides in the kernel
    tiles = _tiles(d, dv, q.element_size())
    if nq > 0:
        K.bwd_preprocess[(_cdiv(max(nq_grid, 1), bm), b * hk * g)](
            out, dout, dlse if has_dlse else lse, delta, cuq,
            _batch_stride(out, varlen), out.stride(1), out.stride(2), out.stride(3), out.stride(4),
            *do_strides, *lse_strides, hk, g, nq, dv,
            HAS_DLSE=has_dlse, VARLEN=varlen, BLOCK_M=bm, BLOCK_DV=tiles["BLOCK_DV"], num_warps=cfg_q["num_warps"],
        )  # fmt: skip
    qkv_strides = (
        _batch_stride(q, varlen), q.stride(1), q.stride(2), q.stride(3), q.stride(4),
        _batch_stride(k, varlen), k.stride(1), k.stride(3), k.stride(4),
        _batch_stride(v, varlen), v.stride(1), v.stride(3), v.stride(4),
        *do_strides, *lse_strides,
    )
    tail = (hk, g, nq, nk, d, dv, scale, scale * LOG2E, 0 if lo is None else lo, 0 if hi is None else hi, *score_scalars)
    consts = dict(**tiles, **meta, **score_flags)
    if nk > 0:
        K.bwd_dkdv_kernel[(_cdiv(max(nk_grid, 1), cfg_kv.BLOCK_N), b * hk)](
            q, k, v, dout, lse, delta, dk, dvt, m, kpt, cuq, cuk, rel_t, *qkv_strides,
            _batch_stride(dk, varlen), dk.stride(1), dk.stride(3), dk.stride(4),
            _batch_stride(dvt, varlen), dvt.stride(1), dvt.stride(3), dvt.stride(4),
            *ms, *kps, stride_rh, *tail, **consts, **cfg_kv.launch(),
        )  # fmt: skip
    if nq > 0:
        K.bwd_dq_kernel[(_cdiv(max(nq_grid, 1), bm), b * hk * g)](
            q, k, v, dout, lse, delta, dq, m, kpt, cuq, cuk, rel_t, drel if rel_grad else rel_t, dlse if has_dlse else lse,
            *qkv_strides, _batch_stride(dq, varlen), dq.stride(1), dq.stride(2), dq.stride(3), dq.stride(4),
            *ms, *kps, stride_rh, *tail, rel_t.shape[1] if rel is not None else 0, **consts, **cfg_q, REL_GRAD=rel_grad,
            HAS_DLSE=has_dlse,
        )  # fmt: skip
    if sinks is not None and nq > 0:
        # d sink_h = Σ_rows P_sink·(dlse − rowsum(dO∘O)) = −Σ_rows exp(sink_h − lse')·delta
        sk = sinks.float().reshape(1, hk, g, 1)
        w = torch.where(torch.isneginf(sk), 0.0, torch.exp(sk - lse))  # a -inf sink takes no weight (and lse' may be -inf)
        dsink = -(w * delta).sum((0, 3)).reshape(-1)
    return dq, dk, dvt, drel, dsink


# ---- torch custom ops ----------------------------------------------------------------------

Tensor = torch.Tensor


@torch.library.custom_op("qkv::triton_attention_fwd", mutates_args=())
def attention_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_padding: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
    scale: float, lo: Optional[int], hi: Optional[int], bottom_right: bool,
    softcap: Optional[float] = None, rel: Optional[Tensor] = None, rel_base: int = 0, rel_shift: bool = False,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    return triton_fwd(
        q, k, v, attn_mask, key_padding, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, lo, hi, bottom_right,
        softcap, rel, rel_base, rel_shift, sinks,
    )  # fmt: skip


@attention_fwd_op.register_fake
def _(q, k, v, attn_mask, key_padding, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, lo, hi, bottom_right,
      softcap=None, rel=None, rel_base=0, rel_shift=False, sinks=None):  # fmt: skip
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    return out, q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("qkv::triton_attention_bwd", mutates_args=())
def attention_bwd_op(
    dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    attn_mask: Optional[Tensor], key_padding: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
    scale: float, lo: Optional[int], hi: Optional[int], bottom_right: bool,
    softcap: Optional[float] = None, rel: Optional[Tensor] = None, rel_base: int = 0, rel_shift: bool = False,
    sinks: Optional[Tensor] = None, rel_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv, and float32 d_rel (empty unless ``rel_grad``) and d_sinks (empty without sinks)."""
    return triton_bwd(
        dout, dlse, q, k, v, out, lse, attn_mask, key_padding, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, scale, lo, hi, bottom_right, softcap, rel, rel_base, rel_shift, sinks, rel_grad,
    )  # fmt: skip


@attention_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, attn_mask, key_padding, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, lo, hi,
      bottom_right, softcap=None, rel=None, rel_base=0, rel_shift=False, sinks=None, rel_grad=False):  # fmt: skip
    f32 = dict(dtype=torch.float32)
    drel = q.new_empty(rel.shape if rel_grad and rel is not None else (0,), **f32)
    dsink = q.new_empty((0 if sinks is None else sinks.shape[0],), **f32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), drel, dsink


_REL, _SINKS = 14, 17  # positions of rel and sinks among _TritonAttention's inputs


def _traced(t: Tensor) -> bool:
    """Is this call traced or transformed (``torch.compile``, export, fake tensors, ``torch.func``
    wrappers)? Then the custom ops run, which graphs and transforms see through; in plain eager
    mode the launch code is called directly."""
    return (torch.compiler.is_compiling() or isinstance(t, FakeTensor) or torch._C._are_functorch_transforms_active()
            or torch._C._functorch.is_functorch_wrapped_tensor(t))  # fmt: skip


def _records_graph(*tensors: Optional[Tensor]) -> bool:
    """Must a call on these inputs go through :class:`_TritonAttention`: gradients are on and one
    of them requires grad, or the call is traced or transformed (:func:`_traced`)? Otherwise the
    forward alone runs, without the autograd function's per-call cost (its node, its 18 inputs
    unwrapped, the context)."""
    if _traced(tensors[0]):
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _TritonAttention(torch.autograd.Function):
    """Autograd over the two custom ops, in ``torch.func``'s protocol (``setup_context`` and a
    ``vmap`` rule), so ``grad``, ``jacrev`` and ``vmap`` work as well as ``torch.compile``.
    (``register_autograd`` on the op would build a Function without ``setup_context``.)

    A built-in score function's ``rel`` and the ``sinks`` are inputs like q, k, v: their
    gradients (float32 from the kernels, cast back) flow on to ALiBi slopes or a bias table.

    Per-call cost: in eager mode the launch code is called directly; the custom ops, whose
    dispatch costs tens of µs per call (torch wraps their bodies in a dynamo-disabled function
    that reads ``inspect.signature`` each time), are what a trace sees (:func:`_traced`). And
    :meth:`apply` skips ``Function.apply``'s ``inspect.signature`` binding of default arguments
    (``forward`` has none; every caller passes all 18 positionally) outside ``torch.func``."""

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*torch._functorch.utils.unwrap_dead_wrappers(args))

    @staticmethod
    def forward(q, k, v, attn_mask, key_padding, cu_q, cu_k, max_q, max_k, scale, lo, hi, bottom_right,
                softcap, rel, rel_base, rel_shift, sinks):  # fmt: skip
        fwd = attention_fwd_op if _traced(q) else triton_fwd
        return fwd(
            q, k, v, attn_mask, key_padding, cu_q, cu_k, max_q, max_k, scale, lo, hi, bottom_right,
            softcap, rel, rel_base, rel_shift, sinks,
        )  # fmt: skip

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        q, k, v, attn_mask, key_padding, cu_q, cu_k, *scalars = inputs
        out, lse = output
        rel, sinks = inputs[_REL], inputs[_SINKS]
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding, cu_q, cu_k, rel, sinks)
        ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient (a launch, and loads in the kernels)
        ctx.scalars = scalars[:6]  # max_q, max_k, scale, lo, hi, bottom_right
        ctx.score = (scalars[6], scalars[8], scalars[9])  # softcap, rel_base, rel_shift

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, attn_mask, key_padding, cu_q, cu_k, rel, sinks = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        softcap, rel_base, rel_shift = ctx.score
        rel_grad = rel is not None and ctx.needs_input_grad[_REL]
        with torch.no_grad():  # no double backward: the op needs no autograd formula of its own
            dq, dk, dv, drel, dsink = (attention_bwd_op if _traced(q) else triton_bwd)(
                dout, dlse, q, k, v, out, lse, attn_mask, key_padding, cu_q, cu_k, *ctx.scalars,
                softcap, rel, rel_base, rel_shift, sinks, rel_grad,
            )  # fmt: skip
        drel = drel.to(rel.dtype) if rel_grad else None
        dsink = dsink.to(sinks.dtype) if sinks is not None and ctx.needs_input_grad[_SINKS] else None
        return (dq, dk, dv) + (None,) * 11 + (drel, None, None, dsink)

    @staticmethod
    def vmap(info, in_dims, *args):
        outs = []
        for i in range(info.batch_size):
            outs.append(_TritonAttention.apply(*(a if d is None or a is None else a.select(d, i) for a, d in zip(args, in_dims))))
        return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])), (0, 0)


def run_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, key_padding: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: int = 0,
    max_seqlen_k: int = 0, *, scale: float, lo: Optional[int] = None, hi: Optional[int] = None, bottom_right: bool = False,
    softcap: Optional[float] = None, rel: Optional[Tensor] = None, rel_base: int = 0, rel_shift: bool = False,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The custom op on grouped tensors (see :func:`triton_fwd`); masks are never differentiated,
    ``rel`` and ``sinks`` are (when they require grad). ``softcap`` must lie in float32's normal
    range (checked here too: :mod:`qkv.varlen`'s packed calls skip :func:`qkv.attention`'s validation)."""
    if softcap is not None:
        check_cap(softcap, torch.float32)
    if attn_mask is not None:
        attn_mask = attn_mask.detach()
    if not _records_graph(q, k, v, rel, sinks):  # nothing to differentiate: the launch code itself, no autograd node
        return triton_fwd(
            q, k, v, attn_mask, key_padding, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(scale), lo, hi,
            bool(bottom_right), None if softcap is None else float(softcap), rel, int(rel_base), bool(rel_shift), sinks,
        )  # fmt: skip
    return _TritonAttention.apply(
        q, k, v, attn_mask, key_padding, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        float(scale), lo, hi, bool(bottom_right), None if softcap is None else float(softcap), rel, int(rel_base),
        bool(rel_shift), sinks,
    )  # fmt: skip


# ---- the backend ---------------------------------------------------------------------------

class TritonBackendImpl:
    """Mixin holding the forward; :class:`qkv.backends.triton.TritonBackend` owns the flags."""

    def forward(self, call: AttentionCall) -> tuple[Tensor, Optional[Tensor]]:
        q, k, v = call.grouped_qkv()
        kp = call.grouped_key_padding()
        lo, hi = call.positional.band()  # both rules as one band of j - i (offsets resolved)
        bound = call.bound_score()
        form = bound.form if bound is not None else None  # a built-in: the backend refuses other functions
        if decodes_checked(call, q):
            return decode_checked(call, q, k, v, kp, lo, hi, form)
        out, lse = run_attention(
            q, k, v, call.grouped_attn_mask(), None if kp is None else kp[:, 0, 0, 0, :],
            scale=call.scale, lo=lo, hi=hi, bottom_right=False,
            softcap=form.softcap if form is not None else None, rel=form.rel if form is not None else None,
            rel_base=call.nq - 1, sinks=call.sinks,
        )  # fmt: skip
        return follow_rule(call, call.ungroup(out), call.ungroup(lse) if call.return_lse else None)


def decodes_checked(call: AttentionCall, q: Tensor) -> bool:
    """Does ``call`` take :func:`decode_checked`: a decoding call (:func:`use_decode`) with no
    gradient, in eager mode (a traced call goes through the custom ops, and the rule after them)?"""
    return (not call.requires_grad and use_decode(call.nq, call.nk, call.group, False) and q.numel() > 0
            and call.batch_size * call.hk > 0 and not _traced(q))  # fmt: skip


def decode_checked(call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, kp: Optional[Tensor], lo, hi, form) -> Checked:
    """A decoding call without gradients, the non-finite rule applied inside the decoding kernels
    (:mod:`.decode`: every key and value read once, bad rows NaN, no host sync): its ``(out, lse)``
    as :class:`~qkv.nonfinite.Checked`, so no pass over the inputs follows."""
    rel = form.rel if form is not None else None
    softcap = form.softcap if form is not None else None
    if softcap is not None:
        check_cap(softcap, torch.float32)
    mask = call.grouped_attn_mask()
    out, lse = triton_fwd(
        q, k, v, None if mask is None else mask.detach(), None if kp is None else kp[:, 0, 0, 0, :], None, None, 0, 0,
        call.scale, lo, hi, False, softcap, None if rel is None else rel.detach(), call.nq - 1, False,
        None if call.sinks is None else call.sinks.detach(), check=True,
    )  # fmt: skip
    return Checked(call.ungroup(out), call.ungroup(lse) if call.return_lse else None)
