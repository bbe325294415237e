"""The baseline for kernels that round P and dS to 16 bits, as a differentiable function.

FlashAttention's rule (ENGINEERING.md): a kernel that rounds the weights P before ``P·V`` and
``Pᵀ·dO``, and dS before ``dS·K`` and ``dSᵀ·Q``, is judged against a same-dtype baseline that
rounds them too — not against qkv's ``math`` path, which keeps them in float32. Scores,
softmax and sums here are float32, exactly as in the triton kernels.
"""

from __future__ import annotations

import torch

from qkv.backends.math import grouped_scores, softmax_with_lse
from qkv.call import validate


class _RoundedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kw):
        dt = q.dtype
        call = validate(q, k, v, return_lse=True, **kw)
        qg, kg, vg = (t.float() for t in call.grouped_qkv())  # (B, Hk, G, N, ·)
        p, lse = softmax_with_lse(grouped_scores(call, qg, kg))
        out = p.to(dt).float() @ vg
        ctx.save_for_backward(qg, kg, vg, p, out, lse)
        ctx.call, ctx.shapes = call, (q.shape, k.shape, v.shape)
        return call.ungroup(out.to(dt)), call.ungroup(lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        qg, kg, vg, p, out, lse = ctx.saved_tensors
        call, dt = ctx.call, ctx.call.dtype
        rnd = lambda t: t.to(dt).float()  # noqa: E731
        do = dout.to(dt).float().reshape(out.shape)  # the gradient reaching out, in out's dtype
        dl = torch.zeros_like(lse) if dlse is None else torch.where(torch.isfinite(lse), dlse.float().reshape(lse.shape), 0.0)
        dv = (rnd(p).transpose(-1, -2) @ do).sum(2, keepdim=True)
        ds = p * (do @ vg.transpose(-1, -2) - ((do * out).sum(-1) - dl).unsqueeze(-1))
        dq = (rnd(ds) @ kg) * call.scale
        dk = ((rnd(ds).transpose(-1, -2) @ qg) * call.scale).sum(2, keepdim=True)
        return (*(g.reshape(s).to(dt) for g, s in zip((dq, dk, dv), ctx.shapes)), None)


def rounded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`qkv.attention` (same mask keywords), rounded as the kernels round."""
    return _RoundedAttention.apply(q, k, v, kw)
