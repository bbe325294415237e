"""The statistics pass's C kernels (``csrc/stats_tile.c``, ``csrc/stats_tile_impl.h``) behind
ctypes, beside qkv's other native bindings (:mod:`.chunked_native`, :mod:`.decode_cpu`):

- :func:`tile_kernel`: the per-tile kernel for a dtype, which :mod:`qkv.inspect.stats` calls on
  each tile it scores (:func:`tile_pass`);
- :func:`fused_pass`: the whole tiled pass as one C call, where the call has no ``attn_mask`` or
  score function (the kernel applies the causal/window band and key padding itself).

Shapes: q ``(B, Hk, G, Nq, D)``, k ``(B, Hk, 1, Nk, D)``, v ``(B, Hk, 1, Nk, Dv)``; the result
arrays of :mod:`qkv.inspect.stats` are filled in place.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..masks.tiles import MaskTiles
from . import chunked_native, native
from .tiles import LOG2E

__all__ = ["fused_pass", "tile_kernel", "tile_pass"]


def tile_kernel(q: torch.Tensor) -> Any:
    """The C tile kernel for q's dtype (:mod:`.native`), or None: then the tile work runs as
    torch operations."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
        return None
    lib = native.library()
    return None if lib is None else getattr(lib, "qkv_stats_tile_float" if q.dtype == torch.float32 else "qkv_stats_tile_double")


def fused_pass(
    q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor], lse_g: Optional[torch.Tensor], tiles: MaskTiles,
    scale: float, kpos: tuple[int, ...], rel: tuple[int, ...], res: dict[str, torch.Tensor],
    out_g: Optional[torch.Tensor], block_q: int, block_k: int,
) -> bool:  # fmt: skip
    """The whole tiled pass as one C call (``qkv_attention_stats_*``), when the native kernels and
    torch's BLAS are at hand and neither an ``attn_mask`` nor a score function is given; False
    otherwise. ``res`` and ``out_g`` (the output's numerator ``Σ p̃·v``, for the caller to
    normalise) are filled in place. Each thread scores a ``block_q × block_k`` tile with one gemm
    into a buffer that stays in its cache, where the tiled torch path writes tiles of every head
    to memory and reads them back."""
    if tiles.attn is not None or tiles.score is not None or tile_kernel(q) is None:
        return False
    gemm = native.gemm(q.dtype)
    if gemm is None:
        return False
    kernel = getattr(native.library(), "qkv_attention_stats_float" if q.dtype == torch.float32 else "qkv_attention_stats_double")
    b, hk, g, nq, d = q.shape
    nk, dv = k.shape[3], (0 if v is None else v.shape[-1])
    if not native.gemm_fits(d, dv):
        return False
    block_q, block_k = native.tile_sizes(block_q, block_k, nq, nk)
    qa = (q * (scale * LOG2E)).contiguous()  # (B, Hk, G, Nq, D): qa·kᵀ = s·log2e
    kc, vc, offsets, _keep_kv = chunked_native.key_values(k, v)
    mask, _keep = chunked_native.mask_args(tiles, hk, nq, nk)
    lse2 = None if lse_g is None else (lse_g.to(q.dtype) * LOG2E).contiguous()
    kp = torch.tensor(kpos, dtype=torch.long)
    rp = torch.tensor(native.clamp_positions(rel, nq + abs(tiles.positional.offset), nk), dtype=torch.long)
    ptr = native.ptr
    rc = kernel(
        ptr(qa), ptr(kc), ptr(vc), *offsets, b * hk, g, nq, nk, d, dv, tiles.positional.offset, *mask, ptr(lse2),
        ptr(res["max_weight"]), ptr(res["total"]), ptr(res["entropy"]), ptr(res["mean_distance"]),
        ptr(res["n_keys"]), ptr(res["key_weights"]), ptr(kp), len(kpos), ptr(res["relative_weights"]), ptr(rp), len(rel),
        ptr(res["topk_weights"]), ptr(res["topk_indices"]), res["topk_indices"].shape[-1], ptr(out_g),
        block_q, block_k, gemm, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"qkv: could not allocate a {block_q} x {block_k} score tile per thread")
    return True


def tile_pass(
    kernel: Any, t: torch.Tensor, q0: int, k0: int, k1: int, off: int, online: bool, masked: bool,
    lse2: Optional[torch.Tensor], acc: list[torch.Tensor], kp: torch.Tensor, rp: torch.Tensor,
    topv: torch.Tensor, topi: torch.Tensor, num: Optional[torch.Tensor],
) -> None:  # fmt: skip
    """One scored tile ``t (b, h, G, n, w)`` (log2 units) through the per-tile kernel: its rows'
    sums in ``acc`` (mx, cnt, tot, ent, dist, kw, rw, contiguous), the running top-k ``topv``/
    ``topi``, and with ``num`` the rescaling of ``Σ p̃·v`` (``t`` then holds ``p̃``)."""
    ptr = native.ptr
    mx, cnt, tot, ent, dist, kw, rw = acc
    n = t.shape[-2]
    dv = 0 if num is None else num.shape[-1]
    kernel(
        ptr(t), mx.numel(), k1 - k0, n, q0 + off, k0, int(online), int(masked),
        ptr(lse2), ptr(mx), ptr(tot), ptr(ent), ptr(dist), ptr(cnt), ptr(kw), ptr(kp), kp.numel(), ptr(rw), ptr(rp), rp.numel(),
        ptr(topv), ptr(topi), topv.shape[-1], ptr(num), dv, torch.get_num_threads(),
    )  # fmt: skip
