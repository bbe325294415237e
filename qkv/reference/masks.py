"""Which key positions a query row may see: the single definition of causal and window rules.

Every backend (NumPy reference, torch math, chunked, SDPA adapter) asks this module, so the
semantics live in one place. The rules are written with plain comparison operators so the
same code works on NumPy arrays and torch tensors.

Positions. Query row ``i`` of ``Nq`` rows sits at key position ``i + offset``:

* ``"top_left"`` (``is_causal=True``, torch SDPA's convention): ``offset = 0``.
* ``"bottom_right"`` (incremental decoding, FlashAttention's convention):
  ``offset = Nk - Nq``, so the last query row lines up with the last key.

Rules, for a query at position ``p`` and key ``j``:

* causal: ``j <= p``
* window ``(left, right)``: ``p - left <= j <= p + right`` (``None`` leaves a side open)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Tuple, Union

Alignment = Literal["top_left", "bottom_right"]
CausalArg = Union[bool, str]
WindowArg = Optional[Tuple[Optional[int], Optional[int]]]

ALIGNMENTS: tuple[str, ...] = ("top_left", "bottom_right")


def parse_causal(is_causal: CausalArg) -> tuple[bool, Alignment]:
    """``is_causal`` → (causal?, alignment). ``True`` means SDPA's top-left alignment."""
    if isinstance(is_causal, bool) or is_causal is None:
        return bool(is_causal), "top_left"
    if isinstance(is_causal, str) and is_causal in ALIGNMENTS:
        return True, is_causal  # type: ignore[return-value]
    raise ValueError(
        f"is_causal={is_causal!r} is not understood; pass True/False, 'top_left' "
        "(query i sees keys 0..i, as torch SDPA) or 'bottom_right' (the last query sees "
        "the last key, as in incremental decoding)"
    )


def parse_window(window: Any) -> WindowArg:
    """Validate ``window=(left, right)``; ``None`` on one side means unbounded."""
    if window is None:
        return None
    if isinstance(window, int) and not isinstance(window, bool):
        window = (window, window)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"window={window!r} must be a pair (left, right) of non-negative ints or None, "
            "e.g. window=(128, 0) for causal local attention over the 128 previous keys"
        )
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(
                f"window {side} size {w!r} must be a non-negative int (or None for unbounded)"
            )
        out.append(int(w))
    return (out[0], out[1])


@dataclass(frozen=True)
class PositionalMask:
    """Causal and sliding-window structure for an ``Nq × Nk`` score matrix.

    >>> m = PositionalMask(nq=3, nk=3, causal=True)
    >>> m.allowed(*__import__("numpy").ogrid[0:3, 0:3]).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """

    nq: int
    nk: int
    causal: bool = False
    window: WindowArg = None
    alignment: Alignment = "top_left"

    @property
    def offset(self) -> int:
        return self.nk - self.nq if self.alignment == "bottom_right" else 0

    @property
    def trivial(self) -> bool:
        """True when every (query, key) pair is allowed."""
        return not self.causal and self.window is None

    def bounds(self) -> tuple[Optional[int], Optional[int]]:
        """(lo, hi) so that key j is allowed iff ``p + lo <= j <= p + hi``; None = open."""
        lo: Optional[int] = None
        hi: Optional[int] = None
        if self.window is not None:
            left, right = self.window
            lo = None if left is None else -left
            hi = right
        if self.causal:
            hi = 0 if hi is None else min(hi, 0)
        return lo, hi

    def allowed(self, qi: Any, kj: Any) -> Any:
        """Boolean array: may query row ``qi`` see key ``kj``? Broadcasts like ``qi - kj``.

        ``qi``/``kj`` are integer arrays (NumPy or torch) of row and column indices.
        """
        rel = kj - (qi + self.offset)  # key position relative to the query's position
        lo, hi = self.bounds()
        ok = rel == rel  # all-True of the broadcast shape, in the caller's array library
        if lo is not None:
            ok = ok & (rel >= lo)
        if hi is not None:
            ok = ok & (rel <= hi)
        return ok

    def block_status(self, q0: int, q1: int, k0: int, k1: int) -> Literal["empty", "full", "partial"]:
        """Classify the tile rows ``[q0, q1)`` × keys ``[k0, k1)`` without building it."""
        lo, hi = self.bounds()
        p0, p1 = q0 + self.offset, q1 - 1 + self.offset  # first/last query positions
        # rel = j - p ranges over [k0 - p1, k1 - 1 - p0] within the tile.
        rmin, rmax = k0 - p1, k1 - 1 - p0
        if (hi is not None and rmin > hi) or (lo is not None and rmax < lo):
            return "empty"
        if (hi is None or rmax <= hi) and (lo is None or rmin >= lo):
            return "full"
        return "partial"

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys ``[k_lo, k_hi)`` that any query row in ``[q0, q1)`` can possibly see."""
        lo, hi = self.bounds()
        k_lo = 0 if lo is None else max(0, q0 + self.offset + lo)
        k_hi = self.nk if hi is None else min(self.nk, q1 - 1 + self.offset + hi + 1)
        return k_lo, max(k_lo, k_hi)

    def full_key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys ``[a, b)`` that *every* query row in ``[q0, q1)`` may see (``a == b``: none)."""
        lo, hi = self.bounds()
        a = 0 if lo is None else max(0, q1 - 1 + self.offset + lo)
        b = self.nk if hi is None else min(self.nk, q0 + self.offset + hi + 1)
        return a, max(a, b)
