"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each rank holds its queries and its K/V block ``(B, H, N/W, D)``. In W steps the K/V blocks
travel once around the ring (rank r sends to r+1, receives from r−1, with asynchronous
point-to-point ops posted *before* the local block is computed so the transfer hides behind
the compute). Each step yields a partial ``(out_i, lse_i)`` from
``qkv.attention(..., return_lse=True)``; partials merge in float32 (float64 for float64 inputs)
through their log-sum-exp::

    lse = logaddexp(lse_a, lse_b)        out = exp(lse_a − lse)·out_a + exp(lse_b − lse)·out_b

Backward (custom autograd): the K/V blocks go around the ring again, each with a dK/dV
accumulator that travels with it and arrives home after W sends. Every block is recomputed
with autograd through qkv's differentiable lse (the ``math``/``chunked`` backends), seeded
with the gradient of the merged output with respect to that block's partial result::

    w_i = exp(lse_i − lse)   ∂L/∂out_i = w_i·dO   ∂L/∂lse_i = w_i·(rowsum(dO∘out_i) − rowsum(dO∘O))

which is the flash-attention backward ``dS = P∘(dO·Vᵀ − δ)`` with ``P`` taken against the
global lse, without materialising more than the backend itself does.

Failure: every wait is bounded by the process group's ``timeout=`` (gloo honours it). A peer
that raised or died surfaces here as a RuntimeError naming the step and the peer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..call import BackendName, accumulate_dtype
from ..functional import attention
from ..masks.rules import IsCausal
from .layout import check_layout, check_length, chunk_slices

_TAG_KV, _TAG_DKV = 17, 18


def _merge(out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor, rows: slice) -> None:
    """Fold a partial result for query rows ``rows`` into (out, lse) in place (float accumulators)."""
    a_out, a_lse = out[..., rows, :], lse[..., rows]  # (B, H, n, Dv), (B, H, n)
    new = torch.logaddexp(a_lse, lse_i.to(a_lse.dtype))
    m = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows with nothing yet: weights 0, not NaN
    wa, wb = torch.exp(a_lse - m).unsqueeze(-1), torch.exp(lse_i.to(m.dtype) - m).unsqueeze(-1)
    out[..., rows, :] = wa * a_out + wb * out_i.to(out.dtype)
    lse[..., rows] = new


def _ring_peers(group) -> tuple[int, int, int, int]:
    rank, w = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = (rank + 1) % w, (rank - 1) % w
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    return rank, w, nxt, prv


def _post(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group, tag: int):
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return dist.batch_isend_irecv(ops)


def _wait(reqs, what: str, step: int, rank: int, prv: int) -> None:
    try:
        for r in reqs:
            r.wait()
    except RuntimeError as e:
        raise RuntimeError(
            f"ring_attention: rank {rank} failed at step {step} while exchanging {what} with its ring "
            f"neighbours (receiving from global rank {prv}); another rank probably raised, died or "
            f"stopped calling ring_attention. The wait is bounded by the process group's timeout= "
            f"(init_process_group(..., timeout=...)). Cause: {e}"
        ) from e


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, k_like: torch.Tensor, v_like: torch.Tensor):
    nk = k_like.numel()
    return buf[:nk].view_as(k_like), buf[nk:].view_as(v_like)


def _block(q, k, v, qs, ks, causal, scale, gqa, backend):
    return attention(
        q[..., qs, :], k[..., ks, :], v[..., ks, :], is_causal=causal, scale=scale, enable_gqa=gqa,
        return_lse=True, backend=backend,
    )


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, gqa, backend, layout):
        rank, w, nxt, prv = _ring_peers(group)
        n = q.shape[-2]
        acc = accumulate_dtype(q.dtype)
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc)  # (B, Hq, Nl, Dv)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=acc)  # (B, Hq, Nl)
        buf = _pack(k, v)
        for step in range(w):
            src = (rank - step) % w  # owner of the K/V block held now
            reqs = None
            if step < w - 1:
                nbuf = torch.empty_like(buf)
                reqs = _post(buf, nbuf, nxt, prv, group, _TAG_KV)  # in flight while we compute
            kb, vb = _unpack(buf, k, v)
            for qs, ks, c in chunk_slices(rank, src, n, layout, causal):
                o_i, l_i = _block(q, kb, vb, qs, ks, c, scale, gqa, backend)
                _merge(out, lse, o_i, l_i, qs)
            if reqs is not None:
                _wait(reqs, "K/V", step, rank, prv)
                buf = nbuf
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (group, causal, scale, gqa, backend, layout)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, gqa, backend, layout = ctx.cfg
        bwd_backend = backend if backend in ("math", "chunked") else "chunked"  # needs a differentiable lse
        rank, w, nxt, prv = _ring_peers(group)
        n = q.shape[-2]
        acc = accumulate_dtype(q.dtype)
        dout = dout.contiguous()
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, Hq, Nl): rowsum(dO ∘ O)
        m = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        dq = torch.zeros_like(q, dtype=acc)
        buf = _pack(k, v)
        dbuf = torch.zeros_like(buf, dtype=acc)  # dK/dV of the block held now; travels with it
        k_acc, v_acc = k.to(acc), v.to(acc)
        for step in range(w):
            src = (rank - step) % w
            reqs = None
            if step < w - 1:
                nbuf = torch.empty_like(buf)
                reqs = _post(buf, nbuf, nxt, prv, group, _TAG_KV)
            kb, vb = _unpack(buf, k, v)
            dkb, dvb = _unpack(dbuf, k_acc, v_acc)
            for qs, ks, c in chunk_slices(rank, src, n, layout, causal):
                with torch.enable_grad():
                    qi = q[..., qs, :].detach().requires_grad_()
                    ki = kb[..., ks, :].detach().requires_grad_()
                    vi = vb[..., ks, :].detach().requires_grad_()
                    o_i, l_i = attention(
                        qi, ki, vi, is_causal=c, scale=scale, enable_gqa=gqa, return_lse=True, backend=bwd_backend
                    )
                    wi = torch.exp(l_i.to(acc) - m[..., qs])  # (B, Hq, n): this block's share of each row
                    do = dout[..., qs, :].to(acc)
                    g_out = (wi.unsqueeze(-1) * do).to(o_i.dtype)
                    g_lse = (wi * ((do * o_i.detach().to(acc)).sum(-1) - delta[..., qs])).to(l_i.dtype)
                    gq, gk, gv = torch.autograd.grad((o_i, l_i), (qi, ki, vi), (g_out, g_lse))
                dq[..., qs, :] += gq.to(acc)
                dkb[..., ks, :] += gk.to(acc)
                dvb[..., ks, :] += gv.to(acc)
            if reqs is not None:
                _wait(reqs, "K/V", step, rank, prv)
                buf = nbuf
            if w > 1:  # the accumulator follows its block; after W sends it is home
                ndbuf = torch.empty_like(dbuf)
                _wait(_post(dbuf, ndbuf, nxt, prv, group, _TAG_DKV), "dK/dV", step, rank, prv)
                dbuf = ndbuf
        dk, dv = _unpack(dbuf, k_acc, v_acc)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def _normalise_causal(is_causal: bool | str) -> bool:
    if is_causal in (False, None):
        return False
    if is_causal is True or is_causal == "top_left":
        return True
    if is_causal == "bottom_right":
        return True  # equal local query and key lengths: both alignments coincide
    raise ValueError(f"is_causal must be a bool, 'top_left' or 'bottom_right', got {is_causal!r}")


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    is_causal: IsCausal = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: BackendName = "auto",
    layout: str = "contiguous",
) -> torch.Tensor:
    """Exact attention over a sequence sharded across ``group`` (context parallelism).

    Shapes (this rank's shard of a sequence of length N = W·N_local)::

        q (B, Hq, N_local, D)   k (B, Hk, N_local, D)   v (B, Hk, N_local, Dv)   →   (B, Hq, N_local, Dv)

    The shard is the one :func:`qkv.distributed.shard` gives for the same ``layout``
    (``"contiguous"`` or ``"zigzag"``; zigzag balances causal work). ``is_causal`` masks by
    global position. ``enable_gqa``: only the Hk K/V heads travel. ``backend`` is passed to
    :func:`qkv.attention` for each block (the backward recomputes blocks on ``math`` or
    ``chunked``). Without an initialised process group this is plain attention.
    Every rank of ``group`` must call it with the same shapes and arguments.
    """
    check_layout(layout)
    causal = _normalise_causal(is_causal)
    if q.shape[-2] != k.shape[-2] or k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"ring_attention needs the same local length for q, k and v (self-attention over one "
            f"sharded sequence); got {q.shape[-2]}, {k.shape[-2]}, {v.shape[-2]}"
        )
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=enable_gqa, backend=backend)
    if layout == "zigzag" and q.shape[-2] % 2:
        w = dist.get_world_size(group)
        check_length(q.shape[-2] * w, w, layout)
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), group, causal, scale, enable_gqa, backend, layout)


__all__ = ["ring_attention"]
