"""Softcapping: ``s → cap · tanh(s / cap)`` bounds every score to ``(-cap, cap)`` (Gemma 2, Grok).

>>> qkv.attention(q, k, v, is_causal=True, score_mod=Softcap(50.0))
"""

from __future__ import annotations

import math

import torch

from .base import ScoreMod

_F32 = torch.finfo(torch.float32)


def check_cap(cap: float, dtype: torch.dtype) -> None:
    """Raise ValueError unless the kernels can hold ``cap`` for scores computed in ``dtype``.

    float32 (the compute dtype of float32, float16 and bfloat16 inputs) needs a cap in its normal
    range ``[1.2e-38, 3.4e38]``: below it the cap, or its reciprocal, which the kernels multiply
    by, rounds to 0 or inf (the C loops read a cap of 0 as "no cap"), above it the cap is inf.
    float64 takes any positive finite cap."""
    if dtype == torch.float64 or _F32.tiny <= cap <= _F32.max:
        return
    raise ValueError(
        f"Softcap(cap={cap:g}) is outside float32's normal range [{_F32.tiny:.2g}, {_F32.max:.2g}], where the "
        "scores of float32, float16 and bfloat16 inputs are computed (the cap or its reciprocal would become 0 or "
        "inf); choose a cap in that range, or pass float64 inputs, which take any positive cap"
    )


class Softcap(ScoreMod):
    """Scores squashed smoothly into ``(-cap, cap)``; close to the identity for ``|s| ≪ cap``.

    Any finite positive cap for float64 inputs; for float32, float16 and bfloat16 inputs one in
    float32's normal range (:func:`check_cap`, when a call is validated)."""

    def __init__(self, cap: float) -> None:
        try:
            cap = float(cap)
        except OverflowError:  # an int past float64's range
            cap = math.inf
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"Softcap(cap={cap}): the cap must be a finite positive number, e.g. 30.0 or 50.0")
        self.softcap = cap

    def check_dtype(self, dtype: torch.dtype) -> None:
        check_cap(self.softcap, dtype)

    def describe(self) -> str:
        c = f"{self.softcap:g}"
        return f"softcap {c}·tanh(s/{c})"
