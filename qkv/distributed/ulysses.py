"""Ulysses (DeepSpeed-style) sequence parallelism: trade sequence sharding for head sharding.

Each rank holds ``(B, H, N/W, D)``. One all-to-all per tensor turns that into
``(B, H/W, N, D)`` — all of the sequence for H/W of the heads — then ordinary attention runs
locally and a last all-to-all turns the output back. Four all-to-alls per forward (q, k, v,
out); each moves (W−1)/W of a rank's tensor. Needs H (and Hk with GQA) divisible by W.

Failure: every all-to-all waits for every rank, bounded by the process group's ``timeout=``
(gloo honours it). A peer that raised or died surfaces here as a RuntimeError naming the
all-to-all (q/k/v or the output, forward or backward), this rank and the world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..call import BackendName, validate
from ..functional import attention
from ..masks.rules import IsCausal


def _a2a(xs, group, what: str):
    """One equal-split all-to-all over dim 0 of several (W, ...) tensors packed into one buffer.

    ``what`` names the exchange ("q/k/v (forward)") in the error a failed peer causes.
    """
    w = xs[0].shape[0]
    flat = torch.cat([x.reshape(w, -1) for x in xs], dim=1)  # (W, Σ numel/W)
    out = torch.empty_like(flat)
    try:
        dist.all_to_all_single(out, flat, group=group)
    except RuntimeError as e:  # gloo's DistBackendError and the timeout are RuntimeErrors
        raise RuntimeError(
            f"ulysses_attention: rank {dist.get_rank(group)} of {w} failed in the all-to-all of {what}, "
            f"which every rank of the group joins; another rank probably raised, died or stopped calling "
            f"ulysses_attention (or called it with other shapes). The wait is bounded by the process "
            f"group's timeout= (init_process_group(..., timeout=...)). Cause: {e}"
        ) from e
    sizes = [x.numel() // w for x in xs]
    return tuple(o.reshape(x.shape) for o, x in zip(out.split(sizes, dim=1), xs))


class _AllToAll(torch.autograd.Function):
    """Chunk j of dim 0 goes to rank j; the op is its own adjoint.

    q, k and v travel in one call so that the backward is one collective too: separate
    autograd nodes could run in a different order on different ranks and pair the wrong
    tensors. ``what`` names the tensors for error messages.
    """

    @staticmethod
    def forward(ctx, group, what, *xs):
        ctx.group, ctx.what = group, what
        return _a2a([x.contiguous() for x in xs], group, f"{what} (forward)")

    @staticmethod
    def backward(ctx, *gs):
        return (None, None) + _a2a([g.contiguous() for g in gs], ctx.group, f"the gradients of {ctx.what} (backward)")


def _seq_to_heads(xs, w: int, group):
    parts = []
    for x in xs:
        b, h, n, d = x.shape
        parts.append(x.reshape(b, w, h // w, n, d).permute(1, 0, 2, 3, 4))  # (W, B, H/W, Nl, D): head group j → rank j
    ys = _AllToAll.apply(group, "q/k/v", *parts)  # (W, B, H/W, Nl, D): sequence chunk j from rank j
    return [y.permute(1, 2, 0, 3, 4).reshape(y.shape[1], y.shape[2], w * y.shape[3], y.shape[4]) for y in ys]  # (B, H/W, N, D)


def _heads_to_seq(x: torch.Tensor, w: int, group) -> torch.Tensor:
    b, hw, n, d = x.shape
    x = x.reshape(b, hw, w, n // w, d).permute(2, 0, 1, 3, 4)  # (W, B, H/W, Nl, D): sequence chunk j → rank j
    (y,) = _AllToAll.apply(group, "the output", x)  # (W, B, H/W, Nl, D): head group j from rank j
    return y.permute(1, 0, 2, 3, 4).reshape(b, w * hw, n // w, d)  # (B, H, Nl, D)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    is_causal: IsCausal = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: BackendName = "auto",
) -> torch.Tensor:
    """Exact attention over a contiguously sharded sequence via head-parallel all-to-all.

    Shapes (this rank's contiguous shard, N = W·N_local)::

        q (B, Hq, N_local, D)   k (B, Hk, N_local, D)   v (B, Hk, N_local, Dv)   →   (B, Hq, N_local, Dv)

    Hq (and Hk) must be divisible by the world size W; Hq ≠ Hk needs ``enable_gqa=True``, as in
    :func:`qkv.attention`, whose checks run on every rank's shards before any exchange and raise
    its errors. Differentiable (the all-to-all is its own adjoint). ``is_causal`` masks by
    global position; the local call is :func:`qkv.attention` with ``backend``. Without an
    initialised process group this is plain attention.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, backend=backend)
    # qkv.attention's own checks on this rank's shards, which carry the caller's head counts: its
    # errors, with the caller's numbers, on every rank and before any exchange. After the
    # all-to-all a rank holds Hq/W and Hk/W heads, and with Hk = W that one key/value head would
    # broadcast to every query head — grouped-query attention without enable_gqa=True.
    validate(q, k, v, None, 0.0, is_causal, scale, enable_gqa)
    w = dist.get_world_size(group)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ulysses_attention expects (B, H, N_local, D) tensors; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for name, h in (("query", q.shape[1]), ("key/value", k.shape[1])):
        if h % w:
            raise ValueError(
                f"ulysses_attention: {name} has {h} heads, not divisible by the world size {w}; "
                f"Ulysses shards heads across ranks — use a world size that divides {h}, or ring_attention"
            )
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"ulysses_attention needs the same local length for q and k; got {q.shape[-2]} and {k.shape[-2]}")
    qh, kh, vh = _seq_to_heads((q, k, v), w, group)  # (B, H/W, N, D)
    out = attention(qh, kh, vh, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, backend=backend)
    return _heads_to_seq(out, w, group)  # (B, Hq, N_local, Dv)


__all__ = ["ulysses_attention"]
