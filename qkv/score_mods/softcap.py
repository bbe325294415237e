"""Softcapping: ``s → cap · tanh(s / cap)`` bounds every score to ``(-cap, cap)`` (Gemma 2, Grok).

>>> qkv.attention(q, k, v, is_causal=True, score_mod=Softcap(50.0))
"""

from __future__ import annotations

import math

from .base import ScoreMod


class Softcap(ScoreMod):
    """Scores squashed smoothly into ``(-cap, cap)``; close to the identity for ``|s| ≪ cap``."""

    def __init__(self, cap: float) -> None:
        cap = float(cap)
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"Softcap(cap={cap}): the cap must be a finite positive number, e.g. 30.0 or 50.0")
        self.softcap = cap

    def describe(self) -> str:
        c = f"{self.softcap:g}"
        return f"softcap {c}·tanh(s/{c})"
