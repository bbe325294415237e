"""Which key positions a query row may see: the single definition of causal and window rules.

Every backend (NumPy reference, torch math, chunked, SDPA adapter, triton) asks this module,
so the semantics live in one place. The rules are written with plain comparison operators so
the same code works on NumPy arrays and torch tensors.

Positions. Query row ``i`` of ``Nq`` rows sits at key position ``i + offset``:

* ``"top_left"`` (``is_causal=True``, torch SDPA's convention): ``offset = 0``.
* ``"bottom_right"`` (incremental decoding, FlashAttention's convention):
  ``offset = Nk - Nq``, so the last query row lines up with the last key.

Rules, for a query at position ``p`` and key ``j``:

* causal: ``j <= p``
* window ``(left, right)``: ``p - left <= j <= p + right`` (``None`` or ``-1``, FlashAttention's
  spelling, leaves a side open). The window has its own alignment (``window_alignment``),
  which by default follows the causal one.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Literal, Optional, Tuple, Union

Alignment = Literal["top_left", "bottom_right"]
"""Where query row ``i`` sits among the keys: ``"top_left"`` (position ``i``) or ``"bottom_right"``
(position ``i + Nk - Nq``)."""
CausalArg = Union[bool, str]
"""``is_causal`` as the rules accept it before parsing: a bool or an alignment's name."""
# is_causal as the public API types it: True is SDPA's top-left alignment, a string names one.
IsCausal = Union[bool, Alignment]
"""``is_causal`` as the public functions type it: ``True`` is SDPA's top-left alignment, a string
names an alignment."""
WindowArg = Optional[Tuple[Optional[int], Optional[int]]]
"""``window=(left, right)``: how far a query sees to each side; ``None`` or ``-1`` leaves a side open."""

ALIGNMENTS: tuple[str, ...] = ("top_left", "bottom_right")
"""The two alignments' names, as ``is_causal`` and ``window_alignment`` take them."""


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


def parse_alignment(alignment: Any, name: str = "window_alignment") -> Optional[Alignment]:
    """``None`` (follow ``is_causal``), ``"top_left"`` or ``"bottom_right"``."""
    if alignment is None or (isinstance(alignment, str) and alignment in ALIGNMENTS):
        return alignment
    raise ValueError(
        f"{name}={alignment!r} is not understood; pass 'top_left' (query i sits at key position i, "
        "as torch SDPA), 'bottom_right' (the last query sits at the last key, as FlashAttention) "
        "or None to follow is_causal"
    )


# A window side beyond this many keys sees every key of any real sequence; larger sides
# (sys.maxsize, 2**64) are taken as this, so every bound derived from them, offsets added,
# stays well inside the kernels' 64-bit integers.
WINDOW_MAX = 2**62


def parse_window(window: Any) -> WindowArg:
    """Validate ``window=(left, right)``; ``None`` or ``-1`` on one side means unbounded, and a
    side larger than :data:`WINDOW_MAX` means :data:`WINDOW_MAX`."""
    if window is None:
        return None
    if isinstance(window, int) and not isinstance(window, bool):
        window = (window, window)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"window={window!r} must be a pair (left, right) of non-negative ints or None, "
            "e.g. window=(128, 0) for causal local attention over the 128 previous keys"
        )
    out: list[Optional[int]] = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        try:
            n = None if isinstance(w, (bool, float)) else operator.index(w)  # ints and NumPy ints
        except TypeError:
            n = None
        if n is None or n < -1:
            raise ValueError(
                f"window {side} size {w!r} must be a non-negative int, or None / -1 for unbounded"
            )
        out.append(None if n == -1 else min(int(n), WINDOW_MAX))
    return (out[0], out[1])


@dataclass(frozen=True)
class PositionalMask:
    """Causal and sliding-window structure for an ``Nq × Nk`` score matrix.

    Both rules bound the diagonal distance ``j - i`` of a pair, so together they form a band
    ``lo <= j - i <= hi`` (see :meth:`band`); the rest of this class reads that band.

    >>> m = PositionalMask(nq=3, nk=3, causal=True)
    >>> m.allowed(*__import__("numpy").ogrid[0:3, 0:3]).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """

    nq: int
    nk: int
    causal: bool = False
    window: WindowArg = None
    alignment: Alignment = "top_left"
    window_alignment: Optional[Alignment] = None  # None: the window follows ``alignment``

    def _offset(self, alignment: Alignment) -> int:
        return self.nk - self.nq if alignment == "bottom_right" else 0

    @property
    def offset(self) -> int:
        """Key position of query row 0 under the causal alignment (``Nk - Nq`` or 0)."""
        return self._offset(self.alignment)

    @property
    def window_offset(self) -> int:
        """Key position of query row 0 for the window (its own alignment, else the causal one)."""
        return self._offset(self.window_alignment or self.alignment)

    @classmethod
    def from_band(cls, nq: int, nk: int, lo: Optional[int], hi: Optional[int]) -> "PositionalMask":
        """The mask whose :meth:`band` is ``(lo, hi)`` (for kernels that receive only the band)."""
        if lo is None and hi is None:
            return cls(nq, nk)
        return cls(nq, nk, window=(None if lo is None else -lo, hi))

    @property
    def trivial(self) -> bool:
        """True when every (query, key) pair is allowed."""
        return not self.causal and (self.window is None or self.window == (None, None))

    def band(self) -> tuple[Optional[int], Optional[int]]:
        """(lo, hi) so that key j is allowed for row i iff ``lo <= j - i <= hi``; None = open."""
        lo: Optional[int] = None
        hi: Optional[int] = None
        if self.window is not None:
            left, right = self.window
            lo = None if left is None else self.window_offset - left
            hi = None if right is None else self.window_offset + right
        if self.causal:
            hi = self.offset if hi is None else min(hi, self.offset)
        return lo, hi

    def bounds(self) -> tuple[Optional[int], Optional[int]]:
        """The band relative to the causal alignment: key j is allowed iff ``p + lo <= j <= p + hi``
        with ``p = i + offset``."""
        lo, hi = self.band()
        off = self.offset
        return (None if lo is None else lo - off), (None if hi is None else hi - off)

    def allowed(self, qi: Any, kj: Any) -> Any:
        """Boolean array: may query row ``qi`` see key ``kj``? Broadcasts like ``qi - kj``.

        ``qi``/``kj`` are integer arrays (NumPy or torch) of row and column indices.
        """
        rel = kj - qi  # diagonal distance of each pair
        lo, hi = self.band()
        ok = rel == rel  # all-True of the broadcast shape, in the caller's array library
        if lo is not None:
            ok = ok & (rel >= lo)
        if hi is not None:
            ok = ok & (rel <= hi)
        return ok

    def block_status(self, q0: int, q1: int, k0: int, k1: int) -> Literal["empty", "full", "partial"]:
        """Classify the tile rows ``[q0, q1)`` × keys ``[k0, k1)`` without building it."""
        if q0 >= q1 or k0 >= k1:
            return "empty"
        lo, hi = self.band()
        rmin, rmax = k0 - (q1 - 1), (k1 - 1) - q0  # range of j - i within the tile
        if (hi is not None and rmin > hi) or (lo is not None and rmax < lo):
            return "empty"
        if (hi is None or rmax <= hi) and (lo is None or rmin >= lo):
            return "full"
        return "partial"

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys ``[k_lo, k_hi)`` that any query row in ``[q0, q1)`` can possibly see."""
        lo, hi = self.band()
        k_lo = 0 if lo is None else min(self.nk, max(0, q0 + lo))
        k_hi = self.nk if hi is None else min(self.nk, q1 - 1 + hi + 1)
        return k_lo, max(k_lo, k_hi)

    def full_key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys ``[a, b)`` that *every* query row in ``[q0, q1)`` may see (``a == b``: none)."""
        lo, hi = self.band()
        a = 0 if lo is None else min(self.nk, max(0, q1 - 1 + lo))
        b = self.nk if hi is None else min(self.nk, q0 + hi + 1)
        return a, max(a, b)
