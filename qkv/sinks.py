"""Attention sinks: a per-head logit that joins every row's softmax denominator and has no value.

With sink logit ``s_h`` for query head h (natural units, not scaled), a row's weights are
``exp(x_j) / (Σ_j exp(x_j) + exp(s_h))``: they sum to less than one, so a head can attend to
"nothing" (GPT-OSS; StreamingLLM's sink token plays the same part). The log-sum-exp includes
the sink: ``lse' = log(exp(lse) + exp(s_h))``. A row that sees no key outputs 0 with
``lse' = s_h``.

Every backend's output and lse give the result exactly: ``out' = out · exp(lse - lse')``.
"""

from __future__ import annotations

import torch
from torch import Tensor

_NEG_INF = float("-inf")


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``out (..., Nq, Dv)`` and ``lse (..., Nq)`` of attention without sinks → with them.

    ``sinks`` broadcasts against ``lse`` (e.g. ``(1, Hk, G, 1)`` in the grouped layout). Works in
    ``lse``'s dtype; differentiable, and NaN-free where a row and its sink are both ``-inf``."""
    s = sinks.to(lse.dtype)
    both = torch.isneginf(lse) & torch.isneginf(s)
    lse_s, s_s = torch.where(both, 0.0, lse), torch.where(both, 0.0, s)
    total = torch.logaddexp(lse_s, s_s)
    keep = torch.where(both, 0.0, torch.exp(lse_s - total))  # the share of the row's mass on its keys
    return out * keep.unsqueeze(-1).to(out.dtype), torch.where(both, _NEG_INF, total)


def grouped_sinks(sinks: Tensor, hk: int, group: int) -> Tensor:
    """``(Hq,)`` → ``(1, Hk, G, 1)``, broadcasting against the grouped layout's ``(B, Hk, G, Nq)``."""
    return sinks.reshape(1, hk, group, 1)


__all__ = ["add_sinks", "grouped_sinks"]
