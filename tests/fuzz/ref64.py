"""An independent float64 attention in torch, differentiable: the fuzz judge's gradient oracle.

Written from the spec (``SPEC_issue9``), not from ``qkv.reference``: the masks are built
entry by entry from their definitions (no band arithmetic), GQA repeats K/V heads, and the
softmax treats ``-inf`` as "masked" so that a row with nothing to attend to gives output 0,
lse ``-inf`` and exactly zero gradient. Its forward is checked against the NumPy oracle on
every case that uses it, so the two references watch each other.

Shapes::

    q (..., Hq, Nq, D)  k (..., Hk, Nk, D)  v (..., Hk, Nk, Dv)  (or (N, D) without heads)
    out (..., Hq, Nq, Dv)  lse (..., Hq, Nq)
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..rounding_baseline import rounder

_NEG_INF = float("-inf")


def _causal_bias(attn_mask: Any) -> Optional[str]:
    """'top_left' / 'bottom_right' for a torch CausalBias, else None."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    if not isinstance(attn_mask, CausalBias):
        return None
    return "bottom_right" if attn_mask.variant == CausalVariant.LOWER_RIGHT else "top_left"


def allowed_positions(
    nq: int, nk: int, is_causal: Any, window: Any, window_alignment: Optional[str]
) -> torch.Tensor:
    """Bool ``(Nq, Nk)``: may query row i see key j under the causal and window rules?"""
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    ok = torch.ones(nq, nk, dtype=torch.bool)
    causal_alignment = "bottom_right" if is_causal == "bottom_right" else "top_left"
    if is_causal is not False:
        p = i + (nk - nq if causal_alignment == "bottom_right" else 0)
        ok &= j <= p
    if window is not None:
        reach = nq + nk  # a side this long already spans every key: longer ones (2**63 - 1) change nothing
        left, right = (None if w is None or w == -1 else min(int(w), reach) for w in window)
        alignment = window_alignment or causal_alignment
        p = i + (nk - nq if alignment == "bottom_right" else 0)
        if left is not None:
            ok &= j >= p - left
        if right is not None:
            ok &= j <= p + right
    return ok


def _prepare(q, k, v, attn_mask, is_causal, scale, window, window_alignment, key_padding_mask, dtype):
    """Broadcast q/k/v (GQA heads repeated), the bool ``allowed`` mask and the float bias.

    Returns ``(q, k, v, allowed, bias, scale, two_d)``; tensors in ``dtype``."""
    bias_alignment = _causal_bias(attn_mask)
    if bias_alignment is not None:
        attn_mask, is_causal = None, bias_alignment
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    two_d = q.dim() == 2
    if two_d:  # (N, D): one head, no batch
        q, k, v = q[None], k[None], v[None]
    rank = max(q.dim(), k.dim(), v.dim())
    q, k, v = (t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) for t in (q, k, v))
    hq, hk = q.shape[-3], k.shape[-3]
    if hk != hq:  # GQA (or one key/value head for all): query head h reads head h // (Hq // Hk)
        k = k.repeat_interleave(hq // hk, dim=-3)
        v = v.repeat_interleave(hq // hk, dim=-3)
    nq, d = q.shape[-2], q.shape[-1]
    nk = k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    allowed = allowed_positions(nq, nk, is_causal, window, window_alignment)
    if key_padding_mask is not None:
        kp = key_padding_mask.bool()[..., None, None, :]  # (..., 1, 1, Nk)
        if two_d:
            kp = kp[..., 0, :, :]
        allowed = allowed & kp
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            bias = attn_mask.to(dtype)
    return q, k, v, allowed, bias, scale, two_d


def attention64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: Any = None,
    is_causal: Any = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Any = None,
    window_alignment: Optional[str] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    keep: Optional[dict] = None,
    score_mod: Any = None,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` in float64 for finite inputs; autograd flows to q, k, v and a float mask.

    ``keep``: a dict that receives the (detached) broadcast q, k, v, the weights ``p``
    ``(..., Hq, Nq, Nk)`` and the scale, from which the judge sizes its gradient tolerances."""
    q, k, v, allowed, bias, scale, two_d = _prepare(
        q, k, v, attn_mask, is_causal, scale, window, window_alignment, key_padding_mask, torch.float64
    )
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (..., Hq, Nq, Nk)
    if score_mod is not None:
        s = _scored(score_mod, s, _causal_bias(attn_mask) or ("bottom_right" if is_causal == "bottom_right" else "top_left"))
    if bias is not None:
        s = s + bias
    s = torch.where(allowed, s, _NEG_INF)
    lead = s.shape[:-1]
    if s.shape[-1] == 0:  # nothing to attend to anywhere
        out = s.new_zeros(*lead, v.shape[-1]) + 0 * s.sum(-1, keepdim=True)
        lse = s.new_full(lead, _NEG_INF)
    else:
        m = s.detach().amax(-1, keepdim=True)
        m = torch.where(torch.isneginf(m), 0.0, m)  # an empty row: shift by 0, every exp is 0
        e = torch.exp(s - m)
        total = e.sum(-1, keepdim=True)
        has = total > 0
        safe = torch.where(has, total, 1.0)
        p = e / safe
        out = torch.matmul(p, v)
        if keep is not None:
            keep.update(q=q.detach(), k=k.detach(), v=v.detach(), p=p.detach(), scale=scale)
        lse = torch.where(has, torch.log(safe) + m, _NEG_INF).squeeze(-1)
    if sinks is not None:  # one more logit per head in every row's denominator
        sink = sinks.to(lse.dtype)[:, None]  # (H, 1) against (..., H, Nq)
        both = torch.isneginf(lse) & torch.isneginf(sink)
        total = torch.logaddexp(torch.where(both, 0.0, lse), torch.where(both, 0.0, sink))
        share = torch.where(both, 0.0, torch.exp(torch.where(both, 0.0, lse) - total))
        out = out * share[..., None]
        lse = torch.where(both, _NEG_INF, total)
        if keep:
            keep["p"] = keep["p"] * share.detach()[..., None]
    if two_d:
        out, lse = out[0], lse[0]
    return out, lse


class _FlashLike(torch.autograd.Function):
    """FlashAttention's arithmetic in float32 with P and dS rounded to the 16-bit input dtype.

    Forward: ``O = round(P) · V / l``, output rounded. Backward (from the rounded O)::

        δ = rowsum(dO ∘ O);  P = exp(S - lse);  dV = round(P)ᵀ dO;  dP = dO Vᵀ
        dS = P ∘ (dP - δ + dlse);  dQ = scale · round(dS) K;  dK = scale · round(dS)ᵀ Q;  dbias = dS
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, allowed, scale, dtype, truncate=False):  # type: ignore[override]
        rnd = rounder(dtype, truncate)
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias
        s = torch.where(allowed, s, _NEG_INF)
        if s.shape[-1] == 0:
            m = s.new_zeros(*s.shape[:-1], 1)
        else:
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isneginf(m), 0.0, m)
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)
        has = total > 0
        safe = torch.where(has, total, 1.0)
        out = rnd(torch.matmul(rnd(p), v) / safe)
        lse = torch.where(has, torch.log(safe) + m, _NEG_INF)
        ctx.save_for_backward(q, k, v, s, lse, out, bias if bias is not None else s.new_zeros(0))
        ctx.scale, ctx.dtype, ctx.has_bias, ctx.truncate = scale, dtype, bias is not None, truncate
        return out, lse.squeeze(-1)

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        q, k, v, s, lse, out, bias = ctx.saved_tensors
        rnd, scale = rounder(ctx.dtype, ctx.truncate), ctx.scale
        if dout is None:
            dout = torch.zeros_like(out)
        dlse = torch.zeros_like(lse) if dlse is None else dlse.unsqueeze(-1)
        empty = torch.isneginf(lse)
        p = torch.where(empty, 0.0, torch.exp(s - torch.where(empty, 0.0, lse)))
        delta = (dout * out).sum(-1, keepdim=True)
        dp = torch.matmul(dout, v.transpose(-1, -2))
        ds = p * (dp - delta + dlse)
        ds16 = rnd(ds)
        dv = torch.matmul(rnd(p).transpose(-1, -2), dout)
        dq = torch.matmul(ds16, k) * scale
        dk = torch.matmul(ds16.transpose(-1, -2), q) * scale
        return dq, dk, dv, (ds.sum_to_size(bias.shape) if ctx.has_bias else None), None, None, None, None


def flash_like(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype,
    *,
    attn_mask: Any = None,
    is_causal: Any = False,
    scale: Optional[float] = None,
    window: Any = None,
    window_alignment: Optional[str] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    truncate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` as a FlashAttention-style kernel computes them for 16-bit ``dtype`` inputs
    (float32 tensors holding the rounded values); differentiable, see :class:`_FlashLike`.

    The same-dtype baseline of ENGINEERING.md for kernels that round P or dS to 16 bits.
    ``truncate``: bfloat16 conversions round toward zero (:func:`truncate_bf16`), as the
    triton kernels' do under Triton 3.6's CPU interpreter."""
    q, k, v, allowed, bias, scale, two_d = _prepare(
        q, k, v, attn_mask, is_causal, scale, window, window_alignment, key_padding_mask, torch.float32
    )
    shape = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], allowed.shape[:-2], () if bias is None else bias.shape[:-2])
    q = q.expand(*shape, *q.shape[-2:])
    k = k.expand(*shape, *k.shape[-2:])
    v = v.expand(*shape, *v.shape[-2:])
    out, lse = _FlashLike.apply(q, k, v, bias, allowed, scale, dtype, truncate)
    if two_d:
        out, lse = out[0], lse[0]
    return out, lse


def _scored(score_mod: Any, s: torch.Tensor, alignment: str) -> torch.Tensor:
    """``score_mod`` on scores ``(..., H, Nq, Nk)`` with index tensors: batch (the flattened batch
    dims), head, query row and key; a built-in sees its rows at their positions (its own
    alignment, else the call's); a Python function is mapped per element (``torch.vmap``)."""
    from qkv.elementwise import per_element
    from qkv.score_mods import ScoreMod

    h, nq, nk = s.shape[-3:]
    b = math.prod(s.shape[:-3])
    flat = s.reshape(b, h, nq, nk)
    qi = torch.arange(nq).view(1, 1, nq, 1)
    if isinstance(score_mod, ScoreMod) and (score_mod.alignment or alignment) == "bottom_right":
        qi = qi + (nk - nq)
    idx = (torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1), qi, torch.arange(nk).view(1, 1, 1, nk))
    if isinstance(score_mod, ScoreMod):
        out = score_mod(flat, *idx)
    else:  # a user's function means what it computes per element (FlexAttention's contract): map it
        out = per_element(score_mod, flat.shape, flat, *idx)
    return out.expand(flat.shape).reshape(s.shape)
