"""``chunked``: exact attention by online softmax over key blocks, in plain torch ops.

The score matrix is visited tile by tile (``block_q`` query rows × ``block_k`` keys), so the
extra memory is ``O(block_q · block_k)`` per head on top of the ``O(N · D)`` inputs and
outputs — never ``Nq × Nk``. Tiles that the causal/window rules mask completely are skipped,
so the cost of sliding-window attention falls with the window.

Forward (per query block, running over key blocks)::

    m  = max(m, rowmax(S))                 running maximum
    P  = exp(S - m)                        unnormalised weights of this tile
    l  = l · exp(m_old - m) + rowsum(P)    running denominator
    O  = O · exp(m_old - m) + P · V        running numerator
    out = O / l,  lse = m + log(l)         (out = 0, lse = -inf for an empty row)

Backward recomputes each tile from the saved log-sum-exp instead of storing weights::

    P  = exp(S - lse);  dV += Pᵀ dO;  dP = dO Vᵀ
    dS = P ∘ (dP - rowsum(dO ∘ O) + dlse);  dQ += dS K · scale;  dK += dSᵀ Q · scale

16-bit inputs are computed in float32 and rounded once. Differences from ``math``: no
dropout, and no gradient to a float ``attn_mask``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..call import AttentionCall
from ..masks import MaskTiles
from .base import Backend, half_to_float

# Tile sizes, measured on a 2-core x86 CPU (bench/attention_cpu.py): a 64K-score tile per head
# keeps each elementwise pass in cache while the two matmuls stay large enough to be efficient.
BLOCK_Q = 256
BLOCK_K = 512
_TILE_BUDGET = 1 << 21  # scores per tile summed over all heads (8 MiB in float32)

_NEG_INF = float("-inf")


def block_sizes(heads: int, nq: int, nk: int) -> tuple[int, int]:
    """Tile shape for ``heads`` = B·Hk·G heads processed together."""
    bk = min(BLOCK_K, max(nk, 1))
    bq = max(16, min(BLOCK_Q, _TILE_BUDGET // max(1, heads * bk)))
    return min(bq, max(nq, 1)), bk


def _key_blocks(tiles: MaskTiles, q0: int, q1: int, bk: int):
    """Key tiles ``(k0, k1)`` that rows ``[q0, q1)`` may see, skipping structurally empty ones."""
    k_lo, k_hi = tiles.positional.key_range(q0, q1)
    for k0 in range(k_lo, k_hi, bk):
        k1 = min(k_hi, k0 + bk)
        if tiles.status(q0, q1, k0, k1) != "empty":
            yield k0, k1


def _masked_scores(qs: torch.Tensor, k: torch.Tensor, tiles: MaskTiles, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """Scaled, masked scores of one tile ``(B, Hk, G, bq, bk)``; a fresh tensor safe to edit in place."""
    s = qs @ k[:, :, :, k0:k1].transpose(-1, -2)
    allowed, bias = tiles.tile(q0, q1, k0, k1)
    if bias is not None:
        s += bias
    if allowed is not None:
        s.masked_fill_(~allowed, _NEG_INF)
    return s


def chunked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, scale: float, block_q: int, block_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(B, Hk, G, Nq, D)``, k/v ``(B, Hk, 1, Nk, ·)`` in the compute dtype → out, lse."""
    b, hk, g, nq, _ = q.shape
    dv = v.shape[-1]
    out = q.new_zeros(b, hk, g, nq, dv)
    lse = q.new_full((b, hk, g, nq), _NEG_INF)
    qs = q * scale
    for q0 in range(0, nq, block_q):
        q1 = min(nq, q0 + block_q)
        qb = qs[:, :, :, q0:q1]
        m = l = acc = None
        for k0, k1 in _key_blocks(tiles, q0, q1, block_k):
            s = _masked_scores(qb, k, tiles, q0, q1, k0, k1)  # (B, Hk, G, bq, bk)
            vb = v[:, :, :, k0:k1]
            if m is None:
                m = s.amax(-1)
                m_safe = m.masked_fill(m == _NEG_INF, 0.0)  # rows with nothing yet: avoid -inf - -inf
                p = s.sub_(m_safe.unsqueeze(-1)).exp_()
                l = p.sum(-1)
                acc = p @ vb
            else:
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)
                alpha = torch.exp(m - m_safe)  # rescales what earlier tiles accumulated
                p = s.sub_(m_safe.unsqueeze(-1)).exp_()
                l = l * alpha + p.sum(-1)
                acc = acc.mul_(alpha.unsqueeze(-1)).add_(p @ vb)
                m = m_new
        if m is None:  # every key of this block is masked out by the positional rules
            continue
        has = l > 0
        out[:, :, :, q0:q1] = acc / torch.where(has, l, torch.ones_like(l)).unsqueeze(-1)
        lse[:, :, :, q0:q1] = torch.where(has, m_safe + torch.log(torch.where(has, l, torch.ones_like(l))), _NEG_INF)
    return out, lse


def chunked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: Optional[torch.Tensor],
    tiles: MaskTiles,
    scale: float,
    block_q: int,
    block_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for q ``(B, Hk, G, Nq, D)`` and k/v ``(B, Hk, 1, Nk, ·)`` by tile recomputation."""
    g = q.shape[2]
    nq = q.shape[3]
    delta = (dout * out).sum(-1)  # (B, Hk, G, Nq): rowsum(dO ∘ O) = Σ_j P_ij dP_ij
    if dlse is not None:
        delta = delta - dlse
    lse_safe = lse.masked_fill(lse == _NEG_INF, 0.0)  # empty rows: every score is -inf, so P = 0
    qs = q * scale
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for q0 in range(0, nq, block_q):
        q1 = min(nq, q0 + block_q)
        qb, dob = qs[:, :, :, q0:q1], dout[:, :, :, q0:q1]
        for k0, k1 in _key_blocks(tiles, q0, q1, block_k):
            p = _masked_scores(qb, k, tiles, q0, q1, k0, k1)
            p = p.sub_(lse_safe[:, :, :, q0:q1].unsqueeze(-1)).exp_()  # (B, Hk, G, bq, bk)
            kb, vb = k[:, :, :, k0:k1], v[:, :, :, k0:k1]
            dv_t = p.transpose(-1, -2) @ dob  # (B, Hk, G, bk, Dv)
            ds = (dob @ vb.transpose(-1, -2)).sub_(delta[:, :, :, q0:q1].unsqueeze(-1)).mul_(p)
            dq[:, :, :, q0:q1] += ds @ kb
            dk_t = ds.transpose(-1, -2) @ qb
            if g > 1:  # a key/value head serves G query heads: sum their contributions
                dv_t, dk_t = dv_t.sum(2, keepdim=True), dk_t.sum(2, keepdim=True)
            dv[:, :, :, k0:k1] += dv_t
            dk[:, :, :, k0:k1] += dk_t
    return dq.mul_(scale), dk, dv


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, scale: float, blocks: tuple[int, int]):
        qc, kc, vc = half_to_float(q), half_to_float(k), half_to_float(v)
        out, lse = chunked_forward(qc, kc, vc, tiles, scale, *blocks)
        ctx.save_for_backward(qc, kc, vc, out, lse)
        ctx.tiles, ctx.scale, ctx.blocks, ctx.dtype = tiles, scale, blocks, q.dtype
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: Optional[torch.Tensor]):
        qc, kc, vc, out, lse = ctx.saved_tensors
        dq, dk, dv = chunked_backward(
            qc, kc, vc, out, lse, dout.to(out.dtype), None if dlse is None else dlse.to(lse.dtype), ctx.tiles, ctx.scale, *ctx.blocks
        )
        t = ctx.dtype
        return dq.to(t), dk.to(t), dv.to(t), None, None, None


class ChunkedBackend(Backend):
    NAME = "chunked"
    DESCRIPTION = "online softmax over key blocks in torch; O(N·block) extra memory; recomputing backward"
    SUPPORTS_DROPOUT = False
    SUPPORTS_GENERATOR = False
    SUPPORTS_MASK_GRAD = False

    def __init__(self, block_q: Optional[int] = None, block_k: Optional[int] = None) -> None:
        self.block_q, self.block_k = block_q, block_k

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        q, k, v = call.grouped_qkv()
        b, hk, g = q.shape[:3]
        bq, bk = block_sizes(b * hk * g, call.nq, call.nk)
        blocks = (self.block_q or bq, self.block_k or bk)
        out, lse = _ChunkedAttention.apply(q, k, v, MaskTiles.from_call(call), call.scale, blocks)
        return call.ungroup(out), (call.ungroup(lse.to(call.lse_dtype)) if call.return_lse else None)
