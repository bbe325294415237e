"""The tile walk: how exact kernels visit the score matrix ``(Nq, Nk)`` tile by tile.

Shared by the torch formulation (:mod:`.chunked`), its C loops (:mod:`.chunked_native`), the
Triton kernels and the statistics pass (:mod:`qkv.inspect.stats`), so that they skip the same
tiles, group the same heads and keep scores in the same base-2 units.

Legend: q ``(B, Hk, G, Nq, D)`` (G query heads share one key/value head), k ``(B, Hk, Nk, D)``.

- :func:`plan_tiles` — ``(block_q, block_k, heads per group)`` for a call;
- :func:`head_groups` — slices over ``(B, Hk)`` of at most that many key/value heads;
- :func:`key_blocks` — the key tiles one row block may see, structurally empty ones skipped;
- :func:`layout_rows` — a block-sparse layout's row blocks, each with the keys of its blocks
  and the small mask (if any) that its tile of gathered keys needs;
- :func:`augment` — ``[x, column]``: folds a per-row or per-key term into a matmul;
- :data:`LOG2E`, :data:`LN2` — base-2 units: ``exp(x) = 2 ** (x · LOG2E)``, ``log(x) = log2(x) · LN2``.
"""

from __future__ import annotations

import itertools
import math
import numbers

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from ..call import AttentionCall
from ..masks.tiles import MaskTiles

__all__ = [
    "BLOCK_K", "BLOCK_Q", "LN2", "LOG2E", "TILE_BUDGET",
    "SparseRows", "augment", "band_rows", "check_tile_size", "gather_buffer", "head_groups", "key_blocks",
    "layout_groups", "layout_rows", "pick", "pick_index", "plan_tiles",
]  # fmt: skip

# Scores are kept in base 2 so that the exponentials are exp2 (cheaper than exp on every target).
LOG2E = 1 / math.log(2)  # 1.4426950408889634, log2 e to double precision
LN2 = math.log(2)  # 0.6931471805599453

# Tile shape and cache budget, measured on a 2-core x86 CPU (bench/attention_cpu.py): the two
# matmuls stay efficient at 256 × 256 while one elementwise pass over the tile (2 MiB of
# float32 across the heads processed together) stays in cache.
BLOCK_Q = 256
BLOCK_K = 256
TILE_BUDGET = 1 << 19  # scores in one tile, summed over the heads processed together


def band_rows(span: int) -> int:
    """Query rows per tile for a call whose rows see at most ``span`` consecutive keys (a causal
    or sliding-window band): a power of two near ``span / 8``, between 32 and 128.

    A block of ``r`` rows scores ``span + r`` keys per row where each row needs ``span``, so
    narrow bands want short blocks. Measured on the C loops, 1 thread, forward + backward at
    N = 4096: window 128 takes 103 ms in 32-row blocks vs 244 ms in 256-row ones; window 512,
    303 vs 390 ms in 64-row blocks; causal, 994 vs 1028 ms in 128-row blocks. Short blocks make
    small gemms, so rows without a band keep 256 (118 vs 126–136 ms in shorter ones, N = 1024).
    The torch formulation (the fallback) measured neutral on windows, and on causal calls from
    0.87× (N = 256) to 1.15× (N = 512) its time in 256-row blocks."""
    rows = 1 << max(0, (span // 8).bit_length() - 1)
    return max(32, min(128, rows))


def check_tile_size(name: str, value: Optional[int]) -> Optional[int]:
    """A tile size a user passed: None (the default) or a positive integer, else ValueError
    naming the argument. (Sizes larger than the call are fine: they are clamped to it.)"""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r}: a tile size must be a positive integer (query rows or keys per tile); "
                         "leave it None for the default")  # fmt: skip
    return int(value)


def plan_tiles(
    b: int, hk: int, g: int, nq: int, nk: int, block_q: Optional[int] = None, block_k: Optional[int] = None,
    span: Optional[int] = None,
) -> tuple[int, int, int]:  # fmt: skip
    """(block_q, block_k, heads per group) for q ``(B, Hk, G, Nq, D)`` and keys of length Nk;
    ``span``: how many consecutive keys a row can see at most when a band limits them
    (:func:`band_rows`), used where ``block_q`` is not given."""
    if block_q is None and span is not None:
        block_q = band_rows(span)
    bq = max(1, min(block_q or BLOCK_Q, nq))
    bk = max(1, min(block_k or BLOCK_K, nk))
    return bq, bk, max(1, TILE_BUDGET // (g * bq * bk))


def head_groups(b: int, hk: int, per_group: int) -> Iterator[tuple[slice, slice]]:
    """Slices over (B, Hk) covering at most ``per_group`` key/value heads at a time."""
    if b == 0 or hk == 0:
        return
    if per_group >= b * hk:  # one group: a plain ``slice(None)`` index returns the tensor itself
        yield slice(None), slice(None)
        return
    ch = min(hk, per_group)
    cb = max(1, per_group // hk) if ch == hk else 1
    for b0 in range(0, b, cb):
        for h0 in range(0, hk, ch):
            yield slice(b0, min(b, b0 + cb)), slice(h0, min(hk, h0 + ch))


def key_blocks(tiles: MaskTiles, q0: int, q1: int, bk: int) -> Iterator[tuple[int, int]]:
    """Key tiles ``(k0, k1)`` that rows ``[q0, q1)`` may see, skipping structurally empty ones.

    The keys every row sees are tiled apart from the edges that only some rows see, so only
    the thin edge tiles (about ``block_q`` wide on a causal diagonal) need a positional mask.
    Trailing padding trimmed by :meth:`MaskTiles.ragged` and tiles in which a bool attn_mask
    allows nothing are skipped too.
    """
    pm = tiles.positional
    k_lo, k_hi = pm.key_range(q0, q1)
    if tiles.key_limit is not None:
        k_hi = max(k_lo, min(k_hi, tiles.key_limit))
    f_lo, f_hi = pm.full_key_range(q0, q1)
    f_lo, f_hi = min(max(f_lo, k_lo), k_hi), max(min(f_hi, k_hi), k_lo)
    segments = ((k_lo, f_lo), (f_lo, f_hi), (f_hi, k_hi)) if f_lo < f_hi else ((k_lo, k_hi),)
    for a, b in segments:
        for k0 in range(a, b, bk):
            k1 = min(b, k0 + bk)
            if pm.block_status(q0, q1, k0, k1) != "empty" and not tiles.tile_is_empty(q0, q1, k0, k1):
                yield k0, k1


def augment(x: torch.Tensor, column: torch.Tensor | float) -> torch.Tensor:
    """Append one column to the last dim: ``[x, column]`` (``column`` broadcasts over rows)."""
    col = torch.as_tensor(column, dtype=x.dtype, device=x.device).expand(*x.shape[:-1], 1)
    return torch.cat([x, col], dim=-1)


# ---- block-sparse layouts: the walk over the layout's blocks, no Nq × Nk mask ------------------


@dataclass
class SparseRows:
    """Rows ``[q0, q1)`` of a block-sparse call and the keys their layout blocks hold.

    ``runs``: those keys as ascending ranges ``(k0, k1)``, adjacent blocks joined; one range is
    read as a view, several are gathered (``C`` keys in all). ``mask``: bool
    ``(B|1, Hk|1, G|1, R|1, C)``, the pairs allowed inside that ``(R, C)`` tile where not all are
    (a rule inside the blocks, layouts that differ by head or batch entry, the causal/window
    band); None = every pair of the tile. Key padding is left to the kernels. ``joins``: these
    rows' other keys came in the entry before (see :func:`layout_rows`'s ``split``), and the
    two results are merged.
    """

    q0: int
    q1: int
    runs: list[tuple[int, int]]
    mask: Optional[torch.Tensor]
    joins: bool = False

    @property
    def width(self) -> int:
        """C, the number of keys."""
        return sum(b - a for a, b in self.runs)

    def take(self, t: torch.Tensor, dim: int, buffer: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``t``'s entries at this row block's keys along ``dim`` (a view for one range).

        Ranges are joined by ``cat`` (about twice as fast as ``index_select`` on K and V), into
        ``buffer`` where given (a flat tensor of ``t``'s dtype, from :func:`gather_buffer`): one
        allocation reused by every row block instead of fresh pages for each."""
        parts = [t.narrow(dim, a, b - a) for a, b in self.runs]
        if len(parts) == 1:
            return parts[0]
        if buffer is None:
            return torch.cat(parts, dim)
        shape = (*t.shape[:dim], self.width, *t.shape[dim + 1 :])
        return torch.cat(parts, dim, out=buffer[: math.prod(shape)].view(shape))

    def add_to(self, dst: torch.Tensor, src: torch.Tensor, dim: int) -> None:
        """``dst[keys] += src`` along ``dim`` (the gradients of gathered keys back in place)."""
        at = 0
        for a, b in self.runs:
            dst.narrow(dim, a, b - a).add_(src.narrow(dim, at, b - a))
            at += b - a


def gather_buffer(rows: list[SparseRows], t: torch.Tensor, dim: int) -> Optional[torch.Tensor]:
    """A flat buffer for :meth:`SparseRows.take` of ``t`` along ``dim`` by any of ``rows``
    (None when no row block gathers)."""
    widest = max((r.width for r in rows if len(r.runs) > 1), default=0)
    return t.new_empty(t.numel() // max(1, t.shape[dim]) * widest) if widest else None


def _runs(cols: list[int], bk: int, nk: int) -> list[tuple[int, int]]:
    """The key ranges of key blocks ``cols`` (ascending), adjacent blocks joined."""
    runs: list[tuple[int, int]] = []
    for j in cols:
        a, b = j * bk, min(nk, (j + 1) * bk)
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
    return runs


def _row_mask(call: AttentionCall, lay: torch.Tensor, sel: Selection, i: int, cols: list[int], q0: int, q1: int,
              runs: list[tuple[int, int]], partial: bool) -> Optional[torch.Tensor]:  # fmt: skip
    """The :attr:`SparseRows.mask` of row block ``i`` over key blocks ``cols`` (``runs`` their key
    ranges); ``partial``: the positional band cuts some of those blocks."""
    bs = call.block_sparse
    assert bs is not None
    mask = None
    per_block = lay[..., i, cols]  # (B|1, Hk|1, G|1, len(cols)): which heads need each block
    if per_block[..., 0].numel() > 1 and not bool(per_block.all()):  # layouts differ by head or batch entry
        width = torch.tensor([min(call.nk, (j + 1) * bs.block_size[1]) - j * bs.block_size[1] for j in cols], device=lay.device)
        mask = per_block.repeat_interleave(width, -1).unsqueeze(-2)  # (B|1, Hk|1, G|1, 1, C)
    if bs.rule is None and not partial:
        return mask
    rows = torch.arange(q0, q1, device=call.device)[:, None]
    keys = torch.cat([torch.arange(a, b, device=call.device) for a, b in runs])
    if bs.rule is not None:
        ruled = pick(call.grouped_mask(bs.rule(rows, keys[None, :])), sel)  # (B|1, Hk|1, G|1, R, C)
        if not bool(ruled.all()):
            mask = ruled if mask is None else mask & ruled
    if partial:
        band = call.positional.allowed(rows, keys[None, :])  # (R, C)
        mask = band if mask is None else mask & band
    return None if mask is None else mask.reshape((1,) * (5 - mask.dim()) + tuple(mask.shape))


def _split(call: AttentionCall, q0: int, q1: int, cols: list[int], mask: torch.Tensor) -> list[SparseRows]:
    """Row block ``[q0, q1)`` as its key blocks that ``mask`` leaves whole (no mask), then each
    range of the others with its part of the mask (``joins``): for kernels that run unmasked
    tiles (and bands) much faster than masked ones."""
    bk, nk = call.block_sparse.block_size[1], call.nk  # type: ignore[union-attr]
    whole = mask.reshape(-1, mask.shape[-1]).all(0)  # (C,): keys every row and head may see
    widths = [min(nk, (j + 1) * bk) - j * bk for j in cols]
    starts = [sum(widths[:i]) for i in range(len(cols))]
    ok = torch.stack([whole[a : a + w].all() for a, w in zip(starts, widths)]).tolist()  # one host sync
    if all(ok):
        return [SparseRows(q0, q1, _runs(cols, bk, nk), None)]
    clean = [j for j, o in zip(cols, ok) if o]
    if not clean:
        return [SparseRows(q0, q1, _runs(cols, bk, nk), mask)]
    out = [SparseRows(q0, q1, _runs(clean, bk, nk), None)]
    for a, b in _runs([j for j, o in zip(cols, ok) if not o], bk, nk):  # each masked range apart: a band, say
        at = sum(w for j, w in zip(cols, widths) if j * bk < a)  # where the range starts in the tile
        out.append(SparseRows(q0, q1, [(a, b)], mask.narrow(-1, at, b - a), joins=True))
    return out


# One (batch entry, key/value head, query head in its group) of a layout; None in a dim the layout broadcasts.
Selection = Optional[tuple[Optional[int], Optional[int], Optional[int]]]


def layout_groups(call: AttentionCall) -> list[Selection]:
    """The walks a block-sparse call takes: ``[None]`` (one walk) when its layout is the same for
    every batch entry and head, else one per ``(b, h, g)`` index of the grouped layout, each
    walking only its own blocks. Measured (N = 4096, 8 heads each with its own BigBird layout of
    density 0.21, their union 0.54; 1 thread): one walk over the union of the heads' blocks,
    masked per head, costs 0.79 (no gradient) and 1.0 (with) of full attention; a walk per head
    0.31 and 0.31."""
    lay = call.grouped_layout()
    assert lay is not None
    if math.prod(lay.shape[:3]) == 1 or lay.numel() == 0 or bool((lay == lay[:1, :1, :1]).all()):  # (no block: Nq or Nk 0)
        return [None]
    return list(itertools.product(*(range(n) if n > 1 else (None,) for n in lay.shape[:3])))


def pick_index(t: torch.Tensor, sel: Selection) -> tuple[slice, ...]:
    """The index of selection ``sel`` in a tensor ``(B|1, Hk|1, G|1, ...)`` (broadcast dims whole)."""
    if sel is None:
        return (slice(None),)
    return tuple(slice(None) if i is None or t.shape[d] == 1 else slice(i, i + 1) for d, i in enumerate(sel))


def pick(t: Optional[torch.Tensor], sel: Selection) -> Optional[torch.Tensor]:
    """``t (B|1, Hk|1, G|1, ...)`` at selection ``sel`` (a view; None stays None)."""
    return t if t is None or sel is None else t[pick_index(t, sel)]


def layout_rows(call: AttentionCall, split: bool = False, sel: Selection = None) -> list[SparseRows]:
    """The row blocks of ``call.block_sparse`` that see some key, each with its key blocks: those
    the layout computes for some head or batch entry and that the causal/window band does not
    rule out. Consecutive row blocks with the same keys and no mask are one entry (one kernel
    call). Reads the small layout once (one host sync); builds no ``Nq × Nk`` tensor.

    ``split``: a masked row block whose mask leaves some key blocks whole comes as several
    entries: those blocks unmasked, then each range of the others masked (``joins``). ``sel``:
    walk one selection of :func:`layout_groups` (masks then cover that selection only)."""
    bs = call.block_sparse
    assert bs is not None
    lay = pick(call.grouped_layout(), sel)  # (B|1, Hk|1, G|1, Bq, Bk)
    assert lay is not None
    bq, bk = bs.block_size
    nq, nk, pm = call.nq, call.nk, call.positional
    any_head = lay.flatten(0, -3).any(0).tolist()  # (Bq, Bk): one host sync (flatten: sizes may be 0)
    out: list[SparseRows] = []
    for i, row in enumerate(any_head):
        q0, q1 = i * bq, min(nq, (i + 1) * bq)
        status = {j: pm.block_status(q0, q1, j * bk, min(nk, (j + 1) * bk)) for j, on in enumerate(row) if on}
        cols = [j for j, st in status.items() if st != "empty"]
        if not cols:
            continue
        runs = _runs(cols, bk, nk)
        partial = any(status[j] == "partial" for j in cols)
        mask = _row_mask(call, lay, sel, i, cols, q0, q1, runs, partial)
        if mask is not None and split and len(cols) > 1:
            out.extend(_split(call, q0, q1, cols, mask))
            continue
        last = out[-1] if out else None
        if mask is None and last is not None and last.mask is None and last.q1 == q0 and last.runs == runs:
            last.q1 = q1  # the same keys unmasked: one kernel call for both
            continue
        out.append(SparseRows(q0, q1, runs, mask))
    return out
