"""Mask semantics on the torch side: every mask argument becomes one tile source.

The rules themselves (causal alignment, sliding windows) live in :mod:`qkv.masks.rules`;
this module turns them, plus ``key_padding_mask`` and ``attn_mask``, into tiles of the score
matrix so that a backend can work block by block without ever building an ``Nq × Nk`` mask.

Conventions, shared by every backend: a boolean mask is True where a query *may* attend;
a float mask is added to the scaled scores; a row with nothing to attend to outputs 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..allocation import check_fits
from ..call import AttentionCall
from .rules import PositionalMask
from ..score_mods.base import BoundScore

def positional_tile(pm: PositionalMask, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> Optional[torch.Tensor]:
    """Allowed pairs ``(q1-q0, k1-k0)`` from causal/window rules; None when all are allowed."""
    if pm.trivial or pm.block_status(q0, q1, k0, k1) == "full":
        return None
    qi = torch.arange(q0, q1, device=device)[:, None]
    kj = torch.arange(k0, k1, device=device)[None, :]
    return pm.allowed(qi, kj)


# Granularity at which a bool attn_mask's empty regions are found (see MaskTiles.with_occupancy).
CELL = 64


@dataclass
class MaskTiles:
    """Every mask of one call, sliced tile by tile in the grouped layout ``(B, Hk, G, Nq, Nk)``."""

    positional: PositionalMask
    attn: Optional[torch.Tensor]  # broadcastable to (B, Hk, G, Nq, Nk), last two dims full size
    padding: Optional[torch.Tensor]  # (B|1, 1, 1, 1, Nk) bool
    device: torch.device
    key_limit: Optional[int] = None  # keys from here on are padding for every row (trimmed away)
    occupancy: Optional[list[list[int]]] = None  # 2-D prefix sums of a bool attn_mask's non-empty cells
    score: Optional[BoundScore] = None  # the score function, applied before the masks

    @classmethod
    def from_call(cls, call: AttentionCall) -> "MaskTiles":
        return cls(call.positional, call.grouped_attn_mask(), call.grouped_key_padding(), call.device, score=call.bound_score())

    def narrow(self, batch: slice, heads: slice) -> "MaskTiles":
        """The masks of a sub-block of batch entries and key/value heads (grouped dims 0 and 1)."""

        def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            if t.shape[0] > 1:
                t = t[batch]
            return t[:, heads] if t.shape[1] > 1 else t

        score = None if self.score is None else self.score.narrow(batch, heads)
        return MaskTiles(self.positional, cut(self.attn), cut(self.padding), self.device, self.key_limit, self.occupancy, score)

    # ---- skipping work that a mask rules out (host-side decisions; eager code only) ----------

    def ragged(self) -> Optional[list[tuple[slice, "MaskTiles"]]]:
        """Per batch entry, its masks with trailing padding trimmed (``key_limit``), when every
        entry's real keys form a prefix (ragged lengths); None otherwise."""
        kp = self.padding
        if kp is None or kp.shape[0] == 1 or kp.numel() == 0:
            return None
        lengths = prefix_lengths(kp[:, 0, 0, 0, :])
        if lengths is None:
            return None
        return [
            (slice(i, i + 1), MaskTiles(self.positional, self.attn if self.attn is None or self.attn.shape[0] == 1 else self.attn[i : i + 1],
                                        None, self.device, n, self.occupancy,
                                        None if self.score is None else self.score.narrow(slice(i, i + 1), slice(None))))
            for i, n in enumerate(lengths)
        ]  # fmt: skip

    def with_occupancy(self) -> "MaskTiles":
        """A copy that knows which ``CELL × CELL`` cells of a bool ``attn_mask`` (over every batch
        entry and head) allow some pair, so that tiles with nothing allowed are skipped."""
        if self.attn is None or self.attn.dtype != torch.bool or self.attn.numel() == 0:
            return self
        nq, nk = self.attn.shape[-2:]
        a = self.attn.reshape(-1, nq, nk)
        keep = a.any(0) if a.shape[0] > 1 else a[0]
        nr, nc = -(-nq // CELL), -(-nk // CELL)
        cells = torch.nn.functional.pad(keep, (0, nc * CELL - nk, 0, nr * CELL - nq)).view(nr, CELL, nc, CELL).any(3).any(1)
        sums = torch.nn.functional.pad(cells.long().cumsum(0).cumsum(1), (1, 0, 1, 0))  # (nr+1, nc+1)
        return replace(self, occupancy=sums.tolist())

    def tile_is_empty(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Does the bool attn_mask (per :meth:`with_occupancy`) allow nothing in this tile?"""
        s = self.occupancy
        if s is None:
            return False
        r0, r1, c0, c1 = q0 // CELL, -(-q1 // CELL), k0 // CELL, -(-k1 // CELL)
        return s[r1][c1] - s[r0][c1] - s[r1][c0] + s[r0][c0] == 0

    def tile(self, q0: int, q1: int, k0: int, k1: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(allowed bool, additive bias) for rows ``[q0, q1)`` × keys ``[k0, k1)``; None = nothing."""
        allowed = positional_tile(self.positional, q0, q1, k0, k1, self.device)
        bias = None
        if self.padding is not None:
            kp = self.padding[..., k0:k1]
            allowed = kp if allowed is None else allowed & kp
        if self.attn is not None:
            a = self.attn[..., q0:q1, k0:k1]
            if a.dtype == torch.bool:
                allowed = a if allowed is None else allowed & a
            else:
                bias = a
        return allowed, bias


def prefix_lengths(padding: torch.Tensor) -> Optional[list[int]]:
    """Each row's number of real keys when every row of ``padding`` (B, Nk) is True then False
    (ragged lengths); None for any other pattern. A host sync: None under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return None
    lengths = padding.sum(-1)
    if not bool((padding == (torch.arange(padding.shape[-1], device=padding.device) < lengths[:, None])).all()):
        return None
    return [int(n) for n in lengths.tolist()]


def apply_tile(scores: torch.Tensor, allowed: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Add the bias and set disallowed scores to ``-inf`` (out of place, autograd-safe)."""
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = may attend) as the additive one kernels take: 0 where allowed,
    ``-inf`` elsewhere, in ``dtype`` and ``allowed``'s shape."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def dense_bool_mask(call: AttentionCall) -> Optional[torch.Tensor]:
    """Causal/window/padding/bool attn_mask folded into one bool mask in the caller's layout.

    Broadcastable to ``(..., Hq, Nq, Nk)``; float ``attn_mask`` is *not* folded in (see
    :func:`dense_sdpa_mask`). Materialises ``Nq × Nk``: only for backends that need it.
    """
    if not call.positional.trivial:  # the tile is built from an (Nq, Nk) int64 position difference
        check_fits("The dense mask that carries is_causal/window to this backend", (call.nq, call.nk), torch.int64,
                   call.device, "backend='chunked' (or 'auto') applies those rules tile by tile without it.")
    allowed = positional_tile(call.positional, 0, call.nq, 0, call.nk, call.device)
    if call.key_padding_mask is not None:
        kp = call.key_padding_mask[..., None, None, :]  # (..., 1, 1, Nk)
        if call.query.dim() == 2:
            kp = kp[..., 0, :, :]
        allowed = kp if allowed is None else allowed & kp
    if call.attn_mask is not None and call.attn_mask.dtype == torch.bool:
        allowed = call.attn_mask if allowed is None else allowed & call.attn_mask
    return allowed


def dense_sdpa_mask(call: AttentionCall) -> Optional[torch.Tensor]:
    """One ``attn_mask`` for torch SDPA that carries every mask argument of the call."""
    allowed = dense_bool_mask(call)
    if call.attn_mask is None or call.attn_mask.dtype == torch.bool:
        return allowed
    if allowed is None:
        return call.attn_mask
    return call.attn_mask.masked_fill(~allowed, float("-inf"))
