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


def _augment(x: torch.Tensor, column: torch.Tensor | float) -> torch.Tensor:
    """Append one column to the last dim: ``[x, column]`` (``column`` broadcasts over rows)."""
    col = torch.as_tensor(column, dtype=x.dtype, device=x.device).expand(*x.shape[:-1], 1)
    return torch.cat([x, col], dim=-1)


def _masked(s: torch.Tensor, tiles: MaskTiles, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """Apply the tile's bias and mask to scores ``s`` in place."""
    allowed, bias = tiles.tile(q0, q1, k0, k1)
    if bias is not None:
        s += bias
    if allowed is not None:
        s.masked_fill_(~allowed, _NEG_INF)
    return s


def chunked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, scale: float, block_q: int, block_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(B, Hk, G, Nq, D)``, k/v ``(B, Hk, 1, Nk, ·)`` in the compute dtype → out, lse.

    Each row keeps a shift ``c`` (its running maximum) folded into the score matmul as an
    extra column, ``[q·scale, -c] · [k, 1]ᵀ = q·kᵀ·scale - c``, and a ones column on V makes
    the same matmul that sums ``P·V`` also sum the row's weights. A tile then costs two
    matmuls and one ``exp``. The shift is only recomputed (the classic online-softmax
    rescaling) on a row block's first tile, while some row has seen no key yet, or when a
    tile's scores exceed the shift enough to overflow — detected, then redone exactly.
    """
    b, hk, g, nq, d = q.shape
    dv = v.shape[-1]
    out = q.new_zeros(b, hk, g, nq, dv)
    lse = q.new_full((b, hk, g, nq), _NEG_INF)
    k_aug = _augment(k, 1.0).transpose(-1, -2)  # (B, Hk, 1, D+1, Nk)
    v_aug = _augment(v, 1.0)  # (B, Hk, 1, Nk, Dv+1): the last column sums the weights
    for q0 in range(0, nq, block_q):
        q1 = min(nq, q0 + block_q)
        q_aug = _augment(q[:, :, :, q0:q1] * scale, 0.0)  # (B, Hk, G, bq, D+1); last column = -shift
        shift = q_aug[..., d]  # a view: writing -c here moves the shift into the matmul
        acc = q.new_zeros(b, hk, g, q1 - q0, dv + 1)  # [Σ P·V | Σ P] relative to exp(c)
        exact = True
        for k0, k1 in _key_blocks(tiles, q0, q1, block_k):
            s = _masked(q_aug @ k_aug[..., k0:k1], tiles, q0, q1, k0, k1)  # (B, Hk, G, bq, bk) = S - c
            vb = v_aug[:, :, :, k0:k1]
            if not exact:
                trial = acc + torch.exp(s) @ vb
                if bool(torch.isfinite(trial).all()):
                    acc = trial
                    continue
            # Exact online-softmax step: raise each row's shift to this tile's maximum where
            # that is higher, or where the row has no weight yet, and rescale what it holds.
            t = s.amax(-1)  # relative to the current shift; -inf where the tile masks the row
            empty = acc[..., dv] == 0
            inc = torch.where(torch.isfinite(t) & ((t > 0) | empty), t, torch.zeros_like(t))
            alpha = torch.exp(-inc).masked_fill_(empty, 0.0)  # empty rows hold 0; exp(-inc) may be inf there
            acc = acc * alpha.unsqueeze(-1) + s.sub_(inc.unsqueeze(-1)).exp_() @ vb
            shift.sub_(inc)
            exact = bool((acc[..., dv] == 0).any())
        l = acc[..., dv]
        has = l > 0
        safe_l = torch.where(has, l, torch.ones_like(l))
        out[:, :, :, q0:q1] = acc[..., :dv] / safe_l.unsqueeze(-1)
        lse[:, :, :, q0:q1] = torch.where(has, torch.log(safe_l) - shift, _NEG_INF)
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
    """Gradients for q ``(B, Hk, G, Nq, D)`` and k/v ``(B, Hk, 1, Nk, ·)`` by tile recomputation.

    As in the forward pass, per-row constants ride along as extra matmul columns:
    ``[q·scale, -lse]·[k, 1]ᵀ = S - lse`` and ``[dO, -δ]·[v, 1]ᵀ = dP - δ``.
    """
    g, nq, d = q.shape[2], q.shape[3], q.shape[4]
    delta = (dout * out).sum(-1)  # (B, Hk, G, Nq): rowsum(dO ∘ O) = Σ_j P_ij dP_ij
    if dlse is not None:
        delta = delta - dlse
    lse_safe = lse.masked_fill(lse == _NEG_INF, 0.0)  # empty rows: every score is -inf, so P = 0
    q_aug = torch.cat([q * scale, -lse_safe.unsqueeze(-1)], dim=-1)  # (B, Hk, G, Nq, D+1)
    do_aug = torch.cat([dout, -delta.unsqueeze(-1)], dim=-1)  # (B, Hk, G, Nq, Dv+1)
    k_aug = _augment(k, 1.0)  # (B, Hk, 1, Nk, D+1)
    v_aug = _augment(v, 1.0)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for q0 in range(0, nq, block_q):
        q1 = min(nq, q0 + block_q)
        qa, doa = q_aug[:, :, :, q0:q1], do_aug[:, :, :, q0:q1]
        for k0, k1 in _key_blocks(tiles, q0, q1, block_k):
            ka = k_aug[:, :, :, k0:k1]
            p = _masked(qa @ ka.transpose(-1, -2), tiles, q0, q1, k0, k1).exp_()  # (B, Hk, G, bq, bk)
            ds = (doa @ v_aug[:, :, :, k0:k1].transpose(-1, -2)).mul_(p)  # P ∘ (dP - δ)
            dv_t = p.transpose(-1, -2) @ doa[..., :-1]  # (B, Hk, G, bk, Dv)
            dq[:, :, :, q0:q1] += ds @ ka[..., :d]
            dk_t = ds.transpose(-1, -2) @ qa[..., :d]
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
