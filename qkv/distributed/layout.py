"""Sequence sharding for context parallelism: which rows of the sequence each rank holds.

Layouts (W ranks, sequence length N along ``dim``):

- ``"contiguous"``: rank r holds rows ``r·N/W .. (r+1)·N/W``.
- ``"zigzag"``: the sequence is cut into 2W chunks; rank r holds chunk r followed by chunk
  2W−1−r. Under a causal mask every rank then does the same amount of work (an early chunk
  paired with a late one), where the contiguous layout leaves rank W−1 with W times the work
  of rank 0.
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_length(n: int, world_size: int, layout: str) -> None:
    """Raise a ValueError that says how to fix a length the layout cannot split evenly."""
    check_layout(layout)
    parts = 2 * world_size if layout == "zigzag" else world_size
    if n % parts:
        padded = -(-n // parts) * parts
        how = "2·world_size" if layout == "zigzag" else "world_size"
        alt = " or use layout='contiguous'" if layout == "zigzag" and n % world_size == 0 else ""
        raise ValueError(
            f"sequence length {n} is not divisible by {how} = {parts} (layout={layout!r}); "
            f"pad the sequence to {padded} (and mask the padding keys){alt}"
        )


def _world(group) -> tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_local(x: torch.Tensor, rank: int, world_size: int, dim: int = -2, layout: str = "contiguous") -> torch.Tensor:
    """The rows of ``x`` along ``dim`` that ``rank`` of ``world_size`` holds (no communication)."""
    n = x.shape[dim]
    check_length(n, world_size, layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if layout == "contiguous":
        return x.narrow(dim, rank * (n // world_size), n // world_size)
    c = n // (2 * world_size)
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * world_size - 1 - rank) * c, c)], dim=dim)


def unshard_local(parts, dim: int = -2, layout: str = "contiguous") -> torch.Tensor:
    """Inverse of :func:`shard_local`: the full tensor from every rank's shard, in rank order."""
    check_layout(layout)
    parts = list(parts)
    if layout == "contiguous":
        return torch.cat(parts, dim=dim)
    w = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]  # rank r: (chunk r, chunk 2W-1-r)
    return torch.cat([halves[r][0] for r in range(w)] + [halves[r][1] for r in reversed(range(w))], dim=dim)


def shard(x: torch.Tensor, group=None, dim: int = -2, layout: str = "contiguous") -> torch.Tensor:
    """This rank's shard of a full tensor that every rank holds (e.g. built from the same seed).

    Shapes: ``x (..., N, ...)`` → ``(..., N/W, ...)`` along ``dim``. Returns a contiguous copy.
    """
    rank, w = _world(group)
    return shard_local(x, rank, w, dim, layout).contiguous()


def unshard(x: torch.Tensor, group=None, dim: int = -2, layout: str = "contiguous") -> torch.Tensor:
    """Gather every rank's shard and reassemble the full sequence (an all-gather; not differentiable)."""
    import torch.distributed as dist

    _, w = _world(group)
    if w == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(parts, x, group=group)
    return unshard_local(parts, dim, layout)


def chunk_slices(rank: int, src: int, n_local: int, layout: str, causal: bool):
    """The (query rows, key rows, causal) sub-blocks that rank's queries take from src's keys.

    Returns a list of ``(q_slice, kv_slice, is_causal)`` over local row indices; empty when
    the causal mask hides all of src's keys from rank's queries.
    """
    full = slice(0, n_local)
    if not causal:
        return [(full, full, False)]
    if src == rank:
        # contiguous: the diagonal block. zigzag: chunks (r, 2W-1-r) against themselves; the
        # local order is increasing in global position, so top-left causal is exact.
        return [(full, full, True)]
    if layout == "contiguous":
        return [(full, full, False)] if src < rank else []
    half = n_local // 2
    if src < rank:
        # keys: chunk s (< r, seen by both query chunks) and chunk 2W-1-s (> 2W-1-r, seen by none)
        return [(full, slice(0, half), False)]
    # src > rank: chunk s and 2W-1-s both lie between r and 2W-1-r: only the late query chunk sees them
    return [(slice(half, n_local), full, False)]


__all__ = ["LAYOUTS", "check_layout", "check_length", "chunk_slices", "shard", "shard_local", "unshard", "unshard_local"]
