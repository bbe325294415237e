"""``math``: the textbook formula in torch, materialising the ``Nq × Nk`` scores.

Supports every feature (all masks, dropout with a generator, GQA, return_lse, gradients to
a float mask) and is the torch-side reference for the faster backends. 16-bit inputs are
computed in float32 (scores, softmax, weighted sum) and rounded once at the end.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..allocation import check_fits
from ..call import AttentionCall
from ..masks.tiles import MaskTiles, apply_tile
from ..sinks import add_sinks, grouped_sinks
from .base import Backend, dropout_weights, follow_rule, half_to_float

_NEG_INF = float("-inf")


def grouped_scores(call: AttentionCall, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scaled scores with the score function applied and the masks: ``(B, Hk, G, Nq, Nk)`` in
    the compute dtype (``-inf`` = masked).

    ``q``/``k`` are ``call.grouped_qkv()``'s first two tensors.
    """
    s = half_to_float(q) @ half_to_float(k).transpose(-1, -2) * call.scale
    score = call.bound_score()
    if score is not None:  # a Python function reads its 16-bit tensors upcast: their gradients sum in float32
        s = score.with_tensors(score.tensors).apply(s, 0, 0)
    allowed, bias = MaskTiles.from_call(call).tile(0, call.nq, 0, call.nk)
    return apply_tile(s, allowed, bias)


def grouped_softmax(call: AttentionCall, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``(B, Hk, G, Nq, Nk)`` and lse ``(B, Hk, G, Nq)`` of the call, sinks included."""
    w, lse = softmax_with_lse(grouped_scores(call, q, k))
    if call.sinks is not None:
        w, lse = add_sinks(w, lse, grouped_sinks(call.sinks, call.hk, call.group))
    return w, lse


def softmax_with_lse(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax of scores that may hold ``-inf``: weights (0 for empty rows) and lse (``-inf``).

    Written out rather than ``torch.logsumexp`` so that no NaN enters the graph for a row of
    all ``-inf``: its shift is 0, its sum 0, and both the weights and the lse are selected by
    ``where``, so the gradient of such a row is exactly 0. A row whose sum is NaN (a NaN or
    ``+inf`` score) keeps NaN in its lse as in its weights (:mod:`qkv.nonfinite`), not ``-inf``.
    The shift is detached: the lse does not depend on it (the terms cancel), and the max has no
    useful gradient.
    """
    m = s.detach().amax(-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:-1], 1), _NEG_INF)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # empty rows: shift by 0, exp(-inf) = 0
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    has = total != 0  # True for NaN
    w = e / torch.where(has, total, torch.ones_like(total))
    lse = torch.where(has, torch.log(torch.where(has, total, torch.ones_like(total))) + m, _NEG_INF)
    return w, lse.squeeze(-1)


def check_scores_fit(call: AttentionCall, what: str, instead: str) -> None:
    """Refuse, before allocating, a score matrix ``(B·Hq, Nq, Nk)`` that cannot fit (scores and
    weights are alive together)."""
    compute = torch.float32 if call.dtype in (torch.float16, torch.bfloat16) else call.dtype
    check_fits(what, (call.batch_size * call.hq, call.nq, call.nk), compute, call.device, instead, copies=2)


class MathBackend(Backend):
    NAME = "math"
    DESCRIPTION = "materialises the Nq×Nk scores; supports every feature; the torch-side reference"
    MATERIALIZES_SCORES = True
    SCORE_MODS = "any"
    SUPPORTS_SINKS = True

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return follow_rule(call, *self.attend(call))

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(out, lse or None)`` before the non-finite rule (:func:`follow_rule`)."""
        check_scores_fit(call, "The score matrix backend='math' holds (one score per query and key)",
                         "backend='chunked' (or 'auto') never holds them.")
        q, k, v = call.grouped_qkv(upcast=call.requires_grad)  # (gradients of broadcast inputs summed in float32)
        w, lse = grouped_softmax(call, q, k)
        if call.dropout_p > 0:
            w = dropout_weights(w, call.dropout_p, call.generator)
        out = (w @ half_to_float(v)).to(call.dtype)  # (B, Hk, G, Nq, Dv)
        return call.ungroup(out), (call.ungroup(lse.to(call.lse_dtype)) if call.return_lse else None)

    def weights(self, call: AttentionCall) -> torch.Tensor:
        """Softmax weights in the caller's layout ``(..., Hq, Nq, Nk)``, dtype of the inputs."""
        check_scores_fit(call, "The weight matrix qkv.attention_weights returns (one weight per query and key)",
                         "For long inputs take chosen rows and heads with qkv.inspect.attention_map(query, key, "
                         "rows=..., heads=...), or per-row statistics with qkv.inspect.attention_stats.")
        q, k, _ = call.grouped_qkv()
        w, _ = grouped_softmax(call, q, k)
        return call.ungroup(w).to(call.dtype)
