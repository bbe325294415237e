"""ALiBi (Press et al., 2022): a per-head linear penalty on distance, ``s + slope_h · (j - p)``
for query position p and key j (BLOOM, MPT). With ``symmetric=True`` the penalty is
``-slope_h · |j - p|`` (encoders).

>>> qkv.attention(q, k, v, is_causal=True, score_mod=ALiBi(alibi_slopes(8)))
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .base import ScoreMod, alignment_arg, check_fits


def alibi_slopes(heads: int) -> Tensor:
    """The paper's geometric slopes ``(heads,)`` float32: ``2^(-8/n)``, its powers, and for a head
    count that is not a power of two the odd powers of the next one (as BLOOM builds them)."""
    if heads < 1:
        raise ValueError(f"alibi_slopes(heads={heads}): need at least one head")
    n = 1 << (heads.bit_length() - 1)  # the largest power of two ≤ heads
    base = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    extra = [2.0 ** (-4.0 * (2 * i + 1) / n) for i in range(heads - n)]  # 2^(-8/2n) to odd powers
    return torch.tensor(base + extra, dtype=torch.float32)


class ALiBi(ScoreMod):
    """Linear biases by distance, one slope per query head.

    ``slopes``: ``(H,)`` tensor (may require grad) or numbers. ``alignment`` places the query
    rows (None: follow ``is_causal``; see :mod:`qkv.masks.rules`)."""

    def __init__(self, slopes: Union[Tensor, Sequence[float]], *, symmetric: bool = False, alignment: Optional[str] = None) -> None:
        t = slopes if isinstance(slopes, Tensor) else torch.as_tensor(list(slopes), dtype=torch.float32)
        if t.dim() != 1 or not t.is_floating_point():
            raise ValueError(f"ALiBi slopes must be a 1-D float tensor with one slope per query head, got {t.dtype} {tuple(t.shape)}")
        self.slopes = t
        self.symmetric = bool(symmetric)
        self.alignment = alignment_arg(alignment)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    def check_heads(self, heads: int) -> None:
        if self.slopes.shape[0] != heads:
            raise ValueError(
                f"ALiBi has {self.slopes.shape[0]} slopes but the call has {heads} query heads; "
                f"build it with ALiBi(alibi_slopes({heads}))"
            )

    def check_dtype(self, dtype: torch.dtype) -> None:
        check_fits("ALiBi slopes", self.slopes, dtype)

    def bias(self, rel: Tensor, head: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
        d = -rel.abs() if self.symmetric else rel
        return self.slopes.to(dtype)[head] * d.to(dtype)

    def describe(self) -> str:
        s = self.slopes.detach().double()
        where = "−|j − i|" if self.symmetric else "(j − i)"
        first = ", ".join(f"{x:.3g}" for x in s[:3].tolist()) + (", …" if s.numel() > 3 else "")
        return f"ALiBi s + m_h·{where}, m = [{first}]" if not math.isnan(float(s.sum())) else "ALiBi"
