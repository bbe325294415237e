"""T5's bucketed relative position bias: ``s + table[bucket(j - p), h]``.

Offsets up to ``max_exact`` apart get a bucket each; longer ones share buckets spaced
logarithmically up to ``max_distance`` (beyond it, the last bucket). ``bidirectional`` (encoders)
gives keys before and after the query separate halves of the buckets; causal use (decoders)
keeps only the past. The table is trainable: gradients flow into it.

>>> table = torch.nn.Parameter(torch.zeros(32, heads))
>>> qkv.attention(q, k, v, score_mod=RelativeBias(table, bidirectional=True))
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional

import torch
from torch import Tensor

from .base import ScoreMod, alignment_arg, check_fits


def relative_buckets(rel: Tensor, num_buckets: int, max_distance: int, bidirectional: bool) -> Tensor:
    """The bucket ``[0, num_buckets)`` of each key-minus-query offset ``rel`` (T5's scheme)."""
    n = num_buckets
    bucket = torch.zeros_like(rel)
    if bidirectional:
        n //= 2
        bucket = bucket + (rel > 0).long() * n  # keys after the query: the upper half
        dist = rel.abs()
    else:
        dist = (-rel).clamp(min=0)  # only the past is told apart
    exact = n // 2
    far = exact + (
        torch.log(dist.double().clamp(min=1) / exact) / math.log(max_distance / exact) * (n - exact)
    ).long()
    far = far.clamp(max=n - 1)
    return bucket + torch.where(dist < exact, dist, far)


def _check_max_distance(max_distance: Any, exact: int) -> int:
    """``max_distance`` as an int above the ``exact`` range and at most float64's largest number:
    :func:`relative_buckets` takes ``log(max_distance / exact)`` in float64 (a larger int raised
    OverflowError at the first call)."""
    try:
        md = int(max_distance)
    except (TypeError, ValueError, OverflowError):  # None, NaN, ±inf
        md = None
    if md is None or not exact < md <= sys.float_info.max:
        shown = repr(max_distance) if len(repr(max_distance)) <= 24 else f"(an int of {len(str(md))} digits)"
        raise ValueError(
            f"RelativeBias max_distance={shown} must be an int that exceeds the exact range ({exact} offsets) "
            f"and is at most {sys.float_info.max:.3g} (its logarithm is a float64), e.g. 128"
        )
    return md


class RelativeBias(ScoreMod):
    """T5-style relative position bias. ``table``: ``(num_buckets, H)`` (an ``nn.Embedding``'s
    weight), one column per query head."""

    def __init__(self, table: Tensor, *, bidirectional: bool = True, max_distance: int = 128, alignment: Optional[str] = None) -> None:
        if not isinstance(table, Tensor) or table.dim() != 2 or not table.is_floating_point():
            got = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, Tensor) else type(table).__name__
            raise ValueError(f"RelativeBias table must be a float tensor (num_buckets, heads), got {got}")
        nb = table.shape[0]
        if nb < (4 if bidirectional else 2):
            raise ValueError(f"RelativeBias needs at least {4 if bidirectional else 2} buckets, got {nb}")
        half = nb // 2 if bidirectional else nb
        self.table = table
        self.bidirectional = bool(bidirectional)
        self.max_distance = _check_max_distance(max_distance, half // 2)
        self.alignment = alignment_arg(alignment)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.table,)

    def check_heads(self, heads: int) -> None:
        if self.table.shape[1] != heads:
            raise ValueError(f"RelativeBias table has {self.table.shape[1]} heads (columns) but the call has {heads} query heads")

    def check_dtype(self, dtype: torch.dtype) -> None:
        check_fits("RelativeBias table", self.table, dtype)

    def bias(self, rel: Tensor, head: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
        b = relative_buckets(rel.to(self.table.device), self.table.shape[0], self.max_distance, self.bidirectional)
        return self.table.to(dtype)[b, head.to(self.table.device)]

    def describe(self) -> str:
        kind = "bidirectional" if self.bidirectional else "causal"
        return f"relative bias s + table[bucket(j − i), h] ({self.table.shape[0]} buckets, {kind}, max distance {self.max_distance})"
