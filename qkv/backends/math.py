"""``math``: the textbook formula in torch, materialising the ``Nq × Nk`` scores.

Supports every feature (all masks, dropout with a generator, GQA, return_lse, gradients to
a float mask) and is the torch-side reference for the faster backends. 16-bit inputs are
computed in float32 (scores, softmax, weighted sum) and rounded once at the end.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..call import AttentionCall
from ..masks import MaskTiles, apply_tile
from .base import Backend, dropout_weights, half_to_float


def grouped_scores(call: AttentionCall, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Masked, scaled scores ``(B, Hk, G, Nq, Nk)`` in the compute dtype (``-inf`` = masked).

    ``q``/``k`` are ``call.grouped_qkv()``'s first two tensors.
    """
    s = half_to_float(q) @ half_to_float(k).transpose(-1, -2) * call.scale
    allowed, bias = MaskTiles.from_call(call).tile(0, call.nq, 0, call.nk)
    return apply_tile(s, allowed, bias)


def softmax_with_lse(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax of scores that may hold ``-inf``: weights (0 for empty rows) and lse (``-inf``)."""
    lse = torch.logsumexp(s, dim=-1)
    # Empty rows: subtract 0 instead of -inf so exp(-inf - 0) = 0 with no NaN in the graph.
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(s - safe.unsqueeze(-1)), lse


class MathBackend(Backend):
    NAME = "math"
    DESCRIPTION = "materialises the Nq×Nk scores; supports every feature; the torch-side reference"
    MATERIALIZES_SCORES = True

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        q, k, v = call.grouped_qkv()
        w, lse = softmax_with_lse(grouped_scores(call, q, k))
        if call.dropout_p > 0:
            w = dropout_weights(w, call.dropout_p, call.generator)
        out = (w @ half_to_float(v)).to(call.dtype)  # (B, Hk, G, Nq, Dv)
        return call.ungroup(out), (call.ungroup(lse.to(call.lse_dtype)) if call.return_lse else None)

    def weights(self, call: AttentionCall) -> torch.Tensor:
        """Softmax weights in the caller's layout ``(..., Hq, Nq, Nk)``, dtype of the inputs."""
        q, k, _ = call.grouped_qkv()
        w, _ = softmax_with_lse(grouped_scores(call, q, k))
        return call.ungroup(w).to(call.dtype)
