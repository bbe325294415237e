"""The ``chunked`` backend's tile loops in C (``qkv/csrc/flash.c``), for CPU calls with gradients.

Same tiles, same units and the same precision measures as the torch formulation in
:mod:`.chunked` (the shift ``m`` is the largest raw product ``q·kᵀ`` a row saw, kept apart from
its sum ``l``; the dominant key's ``dS`` recomputed from ``v_j - O_i``), but each thread scores
a ``block_q × block_k`` tile with one call to torch's own BLAS gemm into a buffer that stays
in its cache, runs the exponentials and ``dS`` over it in C, and multiplies on with gemms again:
no tile of every head written to memory and read back, and no Python per tile.

Used for float32/float64 on CPUs when the native kernels are built and torch's BLAS is MKL
(:func:`qkv.backends.native.gemm`), for the causal/window band, key padding and the built-in
score functions (:mod:`qkv.score_mods`, run as their :class:`~qkv.score_mods.base.KernelForm`:
tiles in natural units, ``m`` too); a call with an ``attn_mask`` or a score function given as a
Python callable keeps the torch formulation. Each function returns None where it does not apply.
The forward and the backward make the same choice for the same call, so the backward recomputes
exactly the products whose maximum the forward kept.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..masks.tiles import MaskTiles
from . import native
from .tiles import LOG2E

# Both tile loops keep scores in base 2 (the exponentials are exp2): LOG2E from the tile walk.


@torch.compiler.assume_constant_result  # fixed for the process: a traced graph need not look again
def available(dtype: torch.dtype) -> bool:
    """Do the C loops run CPU calls of this dtype (float32 or float64, the kernels built)?"""
    return dtype in (torch.float32, torch.float64) and native.library() is not None and native.gemm(dtype) is not None


def _kernel(q: torch.Tensor, tiles: MaskTiles, which: str) -> Optional[tuple[Any, int]]:
    """(C function, gemm address) for this call, or None."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) or tiles.attn is not None:
        return None
    sc = tiles.score
    if sc is not None and (sc.form is None or sc.batch0 or sc.head0):  # a Python callable; or a sub-block
        return None
    lib, gemm = native.library(), native.gemm(q.dtype)
    if lib is None or gemm is None:
        return None
    return getattr(lib, f"qkv_flash_{which}_{'float' if q.dtype == torch.float32 else 'double'}"), gemm


def mask_args(tiles: MaskTiles, hk: int, nq: int, nk: int) -> tuple[list[Any], list[torch.Tensor]]:
    """The C kernels' band, key-padding and key-length arguments (see csrc/tile_impl.h), and the
    tensors they point into (keep them alive until the call returns)."""
    args: list[Any] = native.band_args(*tiles.positional.band(), nq, nk)
    pad = tiles.padding  # (B|1, 1, 1, 1, Nk) bool
    if pad is None:
        return [*args, None, 0, hk, None], []
    kp = pad.reshape(pad.shape[0], nk)
    kpad = kp.to(torch.uint8).contiguous()
    # keys past the last real one are skipped tile by tile (ragged batches)
    klen = (kp * torch.arange(1, nk + 1)).amax(-1).contiguous()  # (B|1,)
    rows = 0 if pad.shape[0] == 1 else pad.shape[0]
    return [*args, native.ptr(kpad), rows, hk, native.ptr(klen)], [kpad, klen]


def score_args(tiles: MaskTiles, q: torch.Tensor, scale: float) -> tuple[float, list[Any], Optional[torch.Tensor]]:
    """The factor c that turns score differences into log2 units, the C kernels' score-function
    arguments ``scored, scale, cap, rel, hq`` (csrc/flash_impl.h) and the ``rel`` they point
    into (keep it alive until the call returns). Without a score function the tiles hold raw
    products (c = scale·log2 e); with one, natural scores (c = log2 e)."""
    sc = tiles.score
    if sc is None:
        return scale * LOG2E, [0, 0.0, 0.0, None, 1], None
    form = sc.form
    assert form is not None
    hq = q.shape[1] * q.shape[2]
    rel = None if form.rel is None else form.rel.detach().to(q.dtype).contiguous()  # (Hq, Nq + Nk - 1)
    return LOG2E, [1, scale, form.softcap or 0.0, native.ptr(rel), hq], rel


def _sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bq: int, bk: int) -> Optional[tuple[int, ...]]:
    """(J, G, Nq, Nk, D, Dv, block_q, block_k) for the C call, or None where the torch
    formulation takes the call: empty sizes, head dims of 0 (nothing to multiply) or past what
    BLAS's 32-bit integers hold."""
    b, hk, g, nq, d = q.shape
    nk, dv = k.shape[3], v.shape[-1]
    if b * hk * g * nq == 0 or nk == 0 or d == 0 or dv == 0 or not native.gemm_fits(d, dv):
        return None
    return (b * hk, g, nq, nk, d, dv, *native.tile_sizes(bq, bk, nq, nk))


def key_values(
    k: torch.Tensor, v: Optional[torch.Tensor]
) -> tuple[torch.Tensor, Optional[torch.Tensor], list[Optional[int]], list[torch.Tensor]]:
    """k and v (or None) for the C kernels (shared matrices read in place, :func:`native.matrices`),
    their ``koff, voff`` pointer arguments, and the tensors to keep alive until the call returns."""
    kc, koff = native.matrices(k)
    vc, voff = (None, None) if v is None else native.matrices(v)
    keep = [t for t in (koff, voff) if t is not None]
    return kc, vc, [native.ptr(koff), native.ptr(voff)], keep


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, scale: float, bq: int, bk: int
) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """out ``(B, Hk, G, Nq, Dv)``, m and l ``(B, Hk, G, Nq)`` as :func:`.chunked.chunked_forward`
    gives them, for q ``(B, Hk, G, Nq, D)`` and k/v ``(B, Hk, 1, Nk, ·)``; or None."""
    found, sizes = _kernel(q, tiles, "fwd"), _sizes(q, k, v, bq, bk)
    if found is None or sizes is None:
        return None
    fn, gemm = found
    j, g, nq, nk, d, dv, bq, bk = sizes
    qc = q.contiguous()
    kc, vc, offsets, _keep_kv = key_values(k, v)
    out = q.new_empty(*q.shape[:4], dv)
    m, l = q.new_empty(q.shape[:4]), q.new_empty(q.shape[:4])
    mask, _keep = mask_args(tiles, q.shape[1], nq, nk)
    c, score, _rel = score_args(tiles, q, scale)
    ptr = native.ptr
    rc = fn(ptr(qc), ptr(kc), ptr(vc), *offsets, j, g, nq, nk, d, dv, *mask, c, *score, ptr(out), ptr(m), ptr(l), bq, bk,
            gemm, torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise MemoryError(f"qkv: could not allocate a {bq} x {bk} score tile per thread")
    return out, m, l


def backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, rows: dict[str, torch.Tensor],
    tiles: MaskTiles, scale: float, bq: int, bk: int, dparams: Optional[list[torch.Tensor]] = None,
) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """dq, dk, dv as :func:`.chunked.chunked_backward` returns them; ``rows`` as there (m, dout,
    delta, dlse, half_l); or None. ``dparams``: accumulators for the gradients of the score
    function's tensors (``tiles.score.tensors``: a built-in's ``rel``, ``(Hq, Nq + Nk - 1)``),
    added into here."""
    found, sizes = _kernel(q, tiles, "bwd"), _sizes(q, k, v, bq, bk)
    if found is None or sizes is None:
        return None
    fn, gemm = found
    j, g, nq, nk, d, dv, bq, bk = sizes
    c = {n: t.contiguous() for n, t in rows.items()}
    qc, oc = q.contiguous(), out.contiguous()
    kc, vc, offsets, _keep_kv = key_values(k, v)
    b, hk = q.shape[:2]
    dq = torch.empty_like(qc)  # the C jobs zero their own rows
    dk = q.new_empty(b, hk, g, nk, d)  # one slice per query head: summed over G below
    dvv = q.new_empty(b, hk, g, nk, dv)
    mask, _keep = mask_args(tiles, hk, nq, nk)
    factor, (scored, _, cap, rel_ptr, hq), _rel = score_args(tiles, q, scale)
    # the gradient of rel per (batch entry, query head): one row per C job, summed over the batch below
    wants = tiles.score is not None and bool(tiles.score.tensors) and dparams
    drel = q.new_empty(b, hk * g, nq + nk - 1) if wants else None
    ptr = native.ptr
    rc = fn(
        ptr(qc), ptr(kc), ptr(vc), *offsets, ptr(oc), ptr(c["dout"]), ptr(c["delta"]), ptr(c["dlse"]), ptr(c["half_l"]),
        ptr(c["m"]), j, g, nq, nk, d, dv, *mask, factor, scored, cap, rel_ptr, hq, ptr(drel), scale, ptr(dq), ptr(dk),
        ptr(dvv), bq, bk, gemm, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"qkv: could not allocate the {bq} x {bk} tiles of a thread")
    if g > 1:
        dk, dvv = dk.sum(2, keepdim=True), dvv.sum(2, keepdim=True)
    if drel is not None:
        dparams[0] += drel.sum(0).to(dparams[0].dtype)  # type: ignore[index]
    return dq, dk, dvv
