"""The baseline for kernels that round P and dS to 16 bits, as a differentiable function.

FlashAttention's rule (ENGINEERING.md): a kernel that rounds the weights P before ``P·V`` and
``Pᵀ·dO``, and dS before ``dS·K`` and ``dSᵀ·Q``, is judged against a same-dtype baseline that
rounds them too — not against qkv's ``math`` path, which keeps them in float32. Scores,
softmax and sums here are float32, exactly as in the triton kernels.

Rounding means what the test device does: to nearest on a GPU, toward zero for bfloat16 under
Triton 3.6's CPU interpreter (:func:`truncate_bf16`), so that a kernel's error is never judged
against a baseline rounded more kindly than the kernel could be.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from qkv.backends.math import grouped_scores, softmax_with_lse
from qkv.call import validate

from .device import INTERPRETED


def truncate_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 → bfloat16 by dropping the low 16 bits (round toward zero), as Triton 3.6's
    interpreter converts (a GPU rounds to nearest even); returned as float32."""
    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def rounder(dtype: torch.dtype, truncate: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """float32 → ``dtype`` → float32, to nearest, or toward zero (``truncate``, bfloat16 only)."""
    if truncate and dtype == torch.bfloat16:
        return truncate_bf16
    return lambda x: x.to(dtype).float()


def device_truncates(dtype: torch.dtype) -> bool:
    """Do the triton kernels on the test device convert float32 to ``dtype`` by truncation?"""
    return INTERPRETED and dtype == torch.bfloat16


class _RoundedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kw, truncate):
        dt = q.dtype
        rnd = rounder(dt, truncate)
        call = validate(q, k, v, return_lse=True, **kw)
        qg, kg, vg = (t.float() for t in call.grouped_qkv())  # (B, Hk, G, N, ·)
        p, lse = softmax_with_lse(grouped_scores(call, qg, kg))
        out = rnd(p) @ vg
        ctx.save_for_backward(qg, kg, vg, p, out, lse)
        ctx.call, ctx.shapes, ctx.rnd = call, (q.shape, k.shape, v.shape), rnd
        return call.ungroup(rnd(out).to(dt)), call.ungroup(lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        qg, kg, vg, p, out, lse = ctx.saved_tensors
        call, dt, rnd = ctx.call, ctx.call.dtype, ctx.rnd
        do = dout.to(dt).float().reshape(out.shape)  # the gradient reaching out, in out's dtype
        dl = torch.zeros_like(lse) if dlse is None else torch.where(torch.isfinite(lse), dlse.float().reshape(lse.shape), 0.0)
        dv = (rnd(p).transpose(-1, -2) @ do).sum(2, keepdim=True)
        ds = p * (do @ vg.transpose(-1, -2) - ((do * out).sum(-1) - dl).unsqueeze(-1))
        dq = (rnd(ds) @ kg) * call.scale
        dk = ((rnd(ds).transpose(-1, -2) @ qg) * call.scale).sum(2, keepdim=True)
        return (*(rnd(g).reshape(s).to(dt) for g, s in zip((dq, dk, dv), ctx.shapes)), None, None)


def rounded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, truncate: Optional[bool] = None, **kw
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`qkv.attention` (same mask keywords), rounded as the kernels round:
    ``truncate`` (default: as the test device's triton kernels, :func:`device_truncates`)."""
    return _RoundedAttention.apply(q, k, v, kw, device_truncates(q.dtype) if truncate is None else truncate)
