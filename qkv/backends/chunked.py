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

Exponentials are taken base 2 with ``log2(e)`` folded into the query scale (``exp2`` is about
three times cheaper than ``exp`` on a CPU); log-sum-exp is converted back to natural log.
Heads are processed in groups small enough that a tile (``1 MiB`` of float32 scores across
the group) stays in cache for the elementwise pass. 16-bit inputs are computed in float32
and rounded once. Differences from ``math``: no
dropout, and no gradient to a float ``attn_mask``.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from ..call import AttentionCall
from ..masks import MaskTiles
from .base import Backend, half_to_float

LOG2E = 1.4426950408889634  # exp(x) = 2 ** (x · log2 e)
LN2 = 0.6931471805599453  # log(x) = log2(x) · ln 2

# Tile shape and cache budget, measured on a 2-core x86 CPU (bench/attention_cpu.py): the two
# matmuls stay efficient at 256 × 256 while one elementwise pass over the tile (2 MiB of
# float32 across the heads processed together) stays in cache.
BLOCK_Q = 256
BLOCK_K = 256
TILE_BUDGET = 1 << 19  # scores in one tile, summed over the heads processed together

_NEG_INF = float("-inf")


def plan_tiles(b: int, hk: int, g: int, nq: int, nk: int, block_q: Optional[int] = None, block_k: Optional[int] = None) -> tuple[int, int, int]:
    """(block_q, block_k, heads per group) for q ``(B, Hk, G, Nq, D)`` and keys of length Nk."""
    bq = max(1, min(block_q or BLOCK_Q, nq))
    bk = max(1, min(block_k or BLOCK_K, nk))
    return bq, bk, max(1, TILE_BUDGET // (g * bq * bk))


def _head_groups(b: int, hk: int, per_group: int) -> Iterator[tuple[slice, slice]]:
    """Slices over (B, Hk) covering at most ``per_group`` key/value heads at a time."""
    ch = min(hk, per_group)
    cb = max(1, per_group // hk) if ch == hk else 1
    for b0 in range(0, b, cb):
        for h0 in range(0, hk, ch):
            yield slice(b0, min(b, b0 + cb)), slice(h0, min(hk, h0 + ch))


def _key_blocks(tiles: MaskTiles, q0: int, q1: int, bk: int) -> Iterator[tuple[int, int]]:
    """Key tiles ``(k0, k1)`` that rows ``[q0, q1)`` may see, skipping structurally empty ones.

    The keys every row sees are tiled apart from the edges that only some rows see, so only
    the thin edge tiles (about ``block_q`` wide on a causal diagonal) need a positional mask.
    """
    pm = tiles.positional
    k_lo, k_hi = pm.key_range(q0, q1)
    f_lo, f_hi = pm.full_key_range(q0, q1)
    f_lo, f_hi = min(max(f_lo, k_lo), k_hi), max(min(f_hi, k_hi), k_lo)
    segments = ((k_lo, f_lo), (f_lo, f_hi), (f_hi, k_hi)) if f_lo < f_hi else ((k_lo, k_hi),)
    for a, b in segments:
        for k0 in range(a, b, bk):
            k1 = min(b, k0 + bk)
            if pm.block_status(q0, q1, k0, k1) != "empty":
                yield k0, k1


def _augment(x: torch.Tensor, column: torch.Tensor | float) -> torch.Tensor:
    """Append one column to the last dim: ``[x, column]`` (``column`` broadcasts over rows)."""
    col = torch.as_tensor(column, dtype=x.dtype, device=x.device).expand(*x.shape[:-1], 1)
    return torch.cat([x, col], dim=-1)


def _masked(s: torch.Tensor, tiles: MaskTiles, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """Apply the tile's bias (converted to log2 units) and mask to scores ``s`` in place."""
    allowed, bias = tiles.tile(q0, q1, k0, k1)
    if bias is not None:
        s.add_(bias, alpha=LOG2E)
    if allowed is not None:
        s.masked_fill_(~allowed, _NEG_INF)
    return s


def _forward_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, scale: float, bq: int, bk: int, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """One group of heads: q ``(b, h, G, Nq, D)``, k/v ``(b, h, 1, Nk, ·)``; writes out/lse views.

    Each row keeps a shift ``c`` (its running maximum, base 2) folded into the score matmul as
    an extra column, ``[q·scale·log2e, -c] · [k, 1]ᵀ = S·log2e - c``, and a ones column on V
    makes the matmul that sums ``P·V`` also sum the row's weights, so a tile costs two matmuls
    and one ``exp2``. The shift comes from an exact online-softmax step on a row block's first
    tile (and on later tiles while some row has seen no key yet); after that tiles are added
    without rescaling. Should a later tile's scores exceed the shift enough to overflow, the
    sums become non-finite — checked once per row block, which is then redone exactly.
    """
    dv = v.shape[-1]
    k_aug = _augment(k, 1.0).transpose(-1, -2)  # (b, h, 1, D+1, Nk)
    v_aug = _augment(v, 1.0)  # (b, h, 1, Nk, Dv+1): the last column sums the weights
    for q0 in range(0, q.shape[3], bq):
        q1 = min(q.shape[3], q0 + bq)
        qb = q[:, :, :, q0:q1] * (scale * LOG2E)
        acc, shift = _row_block(qb, k_aug, v_aug, tiles, q0, q1, bk, lazy=True)
        if not bool(torch.isfinite(acc).all()):
            acc, shift = _row_block(qb, k_aug, v_aug, tiles, q0, q1, bk, lazy=False)
        l = acc[..., dv]
        has = l > 0
        safe_l = torch.where(has, l, torch.ones_like(l))
        out[:, :, :, q0:q1] = acc[..., :dv] / safe_l.unsqueeze(-1)
        lse[:, :, :, q0:q1] = torch.where(has, (torch.log2(safe_l) + shift) * LN2, _NEG_INF)


def _row_block(
    qb: torch.Tensor, k_aug: torch.Tensor, v_aug: torch.Tensor, tiles: MaskTiles, q0: int, q1: int, bk: int, lazy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate ``[Σ 2^(s-c)·V | Σ 2^(s-c)]`` and the shift ``c`` for query rows ``[q0, q1)``."""
    b, h, g, n, d = qb.shape
    dv1 = v_aug.shape[-1]
    q_aug = _augment(qb, 0.0)  # (b, h, G, bq, D+1)
    neg_shift = q_aug[..., d]  # a view: writing -c here moves the shift into the matmul
    acc = qb.new_zeros(b, h, g, n, dv1)
    exact = True
    for k0, k1 in _key_blocks(tiles, q0, q1, bk):
        s = _masked(q_aug @ k_aug[..., k0:k1], tiles, q0, q1, k0, k1)  # (b, h, G, bq, bk) = S·log2e - c
        vb = v_aug[:, :, :, k0:k1]
        if exact or not lazy:
            # Online-softmax step: raise each row's shift to this tile's maximum where that is
            # higher, or where the row holds no weight yet, and rescale what it holds.
            t = s.amax(-1)  # relative to the current shift; -inf where the tile masks the row
            empty = acc[..., -1] == 0
            inc = torch.where(torch.isfinite(t) & ((t > 0) | empty), t, torch.zeros_like(t))
            alpha = torch.exp2(-inc).masked_fill_(empty, 0.0)  # empty rows hold 0; 2^-inc may be inf there
            acc = acc * alpha.unsqueeze(-1) + s.sub_(inc.unsqueeze(-1)).exp2_() @ vb
            neg_shift.sub_(inc)
            exact = bool((acc[..., -1] == 0).any())
        elif g == 1:
            acc.view(-1, n, dv1).baddbmm_(s.exp2_().view(-1, n, k1 - k0), vb.flatten(0, 2))
        else:
            acc += s.exp2_() @ vb
    return acc, -neg_shift


def chunked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, scale: float, plan: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(B, Hk, G, Nq, D)``, k/v ``(B, Hk, 1, Nk, ·)`` in the compute dtype → out, lse (natural log)."""
    b, hk, g, nq, _ = q.shape
    bq, bk, per_group = plan
    out = q.new_zeros(b, hk, g, nq, v.shape[-1])
    lse = q.new_full((b, hk, g, nq), _NEG_INF)
    for bs, hs in _head_groups(b, hk, per_group):
        _forward_heads(q[bs, hs], k[bs, hs], v[bs, hs], tiles.narrow(bs, hs), scale, bq, bk, out[bs, hs], lse[bs, hs])
    return out, lse


def _backward_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
    tiles: MaskTiles,
    scale: float,
    bq: int,
    bk: int,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """One group of heads; accumulates into the dq/dk/dv views.

    Per-row constants ride along as extra matmul columns, as in the forward pass:
    ``[q·scale·log2e, -lse·log2e]·[k, 1]ᵀ`` gives ``P = 2^(…)`` and ``[dO, -δ]·[v, 1]ᵀ = dP - δ``.
    """
    g, nq, d = q.shape[2], q.shape[3], q.shape[4]
    lse_safe = lse.masked_fill(lse == _NEG_INF, 0.0)  # empty rows: every score is -inf, so P = 0
    q_aug = torch.cat([q * (scale * LOG2E), (-LOG2E * lse_safe).unsqueeze(-1)], dim=-1)  # (b, h, G, Nq, D+1)
    do_aug = torch.cat([dout, -delta.unsqueeze(-1)], dim=-1)  # (b, h, G, Nq, Dv+1)
    k_aug = _augment(k, 1.0)  # (b, h, 1, Nk, D+1)
    v_aug = _augment(v, 1.0)
    for q0 in range(0, nq, bq):
        q1 = min(nq, q0 + bq)
        qa, doa = q_aug[:, :, :, q0:q1], do_aug[:, :, :, q0:q1]
        for k0, k1 in _key_blocks(tiles, q0, q1, bk):
            ka = k_aug[:, :, :, k0:k1]
            p = _masked(qa @ ka.transpose(-1, -2), tiles, q0, q1, k0, k1).exp2_()  # (b, h, G, bq, bk)
            ds = (doa @ v_aug[:, :, :, k0:k1].transpose(-1, -2)).mul_(p)  # P ∘ (dP - δ)
            dv_t = p.transpose(-1, -2) @ doa[..., :-1]  # (b, h, G, bk, Dv)
            dq[:, :, :, q0:q1] += ds @ ka[..., :d]
            dk_t = ds.transpose(-1, -2) @ qa[..., :d]  # in units of q·scale·log2e; fixed below
            if g > 1:  # a key/value head serves G query heads: sum their contributions
                dv_t, dk_t = dv_t.sum(2, keepdim=True), dk_t.sum(2, keepdim=True)
            dv[:, :, :, k0:k1] += dv_t
            dk[:, :, :, k0:k1] += dk_t


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
    plan: tuple[int, int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for q ``(B, Hk, G, Nq, D)`` and k/v ``(B, Hk, 1, Nk, ·)`` by tile recomputation."""
    b, hk = q.shape[:2]
    bq, bk, per_group = plan
    delta = (dout * out).sum(-1)  # (B, Hk, G, Nq): rowsum(dO ∘ O) = Σ_j P_ij dP_ij
    if dlse is not None:
        delta = delta - dlse
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for bs, hs in _head_groups(b, hk, per_group):
        _backward_heads(
            q[bs, hs], k[bs, hs], v[bs, hs], lse[bs, hs], dout[bs, hs], delta[bs, hs],
            tiles.narrow(bs, hs), scale, bq, bk, dq[bs, hs], dk[bs, hs], dv[bs, hs],
        )  # fmt: skip
    return dq.mul_(scale), dk.mul_(LN2), dv


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, scale: float, plan: tuple[int, int, int]):
        qc, kc, vc = half_to_float(q), half_to_float(k), half_to_float(v)
        out, lse = chunked_forward(qc, kc, vc, tiles, scale, plan)
        ctx.save_for_backward(qc, kc, vc, out, lse)
        ctx.tiles, ctx.scale, ctx.plan, ctx.dtype = tiles, scale, plan, q.dtype
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: Optional[torch.Tensor]):
        qc, kc, vc, out, lse = ctx.saved_tensors
        dq, dk, dv = chunked_backward(
            qc, kc, vc, out, lse, dout.to(out.dtype), None if dlse is None else dlse.to(lse.dtype), ctx.tiles, ctx.scale, ctx.plan
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
        plan = plan_tiles(*q.shape[:3], call.nq, call.nk, self.block_q, self.block_k)
        out, lse = _ChunkedAttention.apply(q, k, v, MaskTiles.from_call(call), call.scale, plan)
        return call.ungroup(out), (call.ungroup(lse.to(call.lse_dtype)) if call.return_lse else None)
