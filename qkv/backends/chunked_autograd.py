"""The autograd of :mod:`.chunked`'s tile loops: torch custom ops (``qkv::chunked_attention_fwd``
/ ``_bwd``, with fake implementations, so ``torch.compile`` keeps a call in one graph) joined by
:class:`ChunkedAttention`, and :func:`scored_attention` for a Python score function (the tile
loops called directly, with gradients for the tensors the function reads).

The functions follow ``torch.func``'s protocol (``setup_context`` and a ``vmap`` rule), so
``jacrev``, ``vmap`` and ``grad`` work; batched cotangents from the autograd engine
(``gradcheck(check_batched_grad=True)``) take a dense formula.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch

from ..call import accumulate_dtype
from ..masks.tiles import MaskTiles
from ..masks.rules import PositionalMask
from ..score_mods.base import BoundScore, KernelForm
from ..score_mods.reads import MissedReads
from .base import half_to_float
from .online_softmax import chunked_backward, chunked_forward, lse_from

__all__ = ["ChunkedAttention", "chunked_bwd_op", "chunked_fwd_op", "scored_attention"]


def _tiles(
    q: torch.Tensor, k: torch.Tensor, attn_mask, key_padding, lo: Optional[int], hi: Optional[int],
    softcap: Optional[float] = None, rel: Optional[torch.Tensor] = None,
) -> MaskTiles:  # fmt: skip
    """The masks (and a built-in score function's kernel form) of a call, from the ops' arguments."""
    score = None
    if softcap is not None or rel is not None:
        score = BoundScore(None, KernelForm(softcap, rel), () if rel is None else (rel,), q.shape[2], q.shape[3])
    return MaskTiles(PositionalMask.from_band(q.shape[3], k.shape[3], lo, hi), attn_mask, key_padding, q.device, score=score)


@torch.library.custom_op("qkv::chunked_attention_fwd", mutates_args=())
def chunked_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor], key_padding: Optional[torch.Tensor],
    lo: Optional[int], hi: Optional[int], scale: float, block_q: int, block_k: int, per_group: int,
    softcap: Optional[float], rel: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """out, m, l of :func:`chunked_forward` in the compute dtype (16-bit inputs: float32);
    ``softcap`` and ``rel``: a built-in score function's :class:`KernelForm`."""
    tiles = _tiles(q, k, attn_mask, key_padding, lo, hi, softcap, rel)
    return chunked_forward(half_to_float(q), half_to_float(k), half_to_float(v), tiles, scale, (block_q, block_k, per_group))


@chunked_fwd_op.register_fake
def _(q, k, v, attn_mask, key_padding, lo, hi, scale, block_q, block_k, per_group, softcap, rel):
    cd = half_to_float(q.new_empty(0)).dtype
    rows = q.shape[:4]
    return q.new_empty(*rows, v.shape[-1], dtype=cd), q.new_empty(rows, dtype=cd), q.new_empty(rows, dtype=cd)


@torch.library.custom_op("qkv::chunked_attention_bwd", mutates_args=())
def chunked_bwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
    dout: torch.Tensor, dlse: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor], key_padding: Optional[torch.Tensor],
    lo: Optional[int], hi: Optional[int], scale: float, block_q: int, block_k: int, per_group: int,
    softcap: Optional[float], rel: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """dq, dk, dv (in the inputs' dtypes) by :func:`chunked_backward`, and the gradient of ``rel``
    (empty without one)."""
    tiles = _tiles(q, k, attn_mask, key_padding, lo, hi, softcap, rel)
    qc, kc, vc = half_to_float(q), half_to_float(k), half_to_float(v)
    cd = qc.dtype
    dlse = None if dlse is None else dlse.to(cd)
    drel = [torch.zeros_like(rel)] if rel is not None else []
    dq, dk, dv = chunked_backward(qc, kc, vc, out, m, l, dout.to(cd), dlse, tiles, scale, (block_q, block_k, per_group), drel)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), (drel[0] if drel else q.new_zeros(0))


@chunked_bwd_op.register_fake
def _(q, k, v, out, m, l, dout, dlse, attn_mask, key_padding, lo, hi, scale, block_q, block_k, per_group, softcap, rel):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), (q.new_zeros(0) if rel is None else rel.new_empty(rel.shape))


def _is_batched(t: torch.Tensor) -> bool:
    """A vmap-batched tensor (``torch.func``), or the autograd engine's batched gradients."""
    # the engine's key ("Batched") has no Python enum member, so it is found by name
    return bool(torch._C._functorch.is_batchedtensor(t)) or "Batched" in str(torch._C._dispatch_keys(t)).replace("FuncTorchBatched", "")


def _dense_backward(q, k, v, dout, dlse, tiles: MaskTiles, scale: float):
    """Gradients by the textbook formula (``Nq × Nk``) in plain tensor ops, for batched cotangents."""
    from ..masks.tiles import apply_tile
    from .math import softmax_with_lse

    qc, kc, vc = half_to_float(q), half_to_float(k), half_to_float(v)
    s = apply_tile(qc @ kc.transpose(-1, -2) * scale, *tiles.tile(0, q.shape[3], 0, k.shape[3]))
    p, lse = softmax_with_lse(s)  # (b, h, G, Nq, Nk)
    do = torch.zeros_like(p @ vc) if dout is None else dout.to(qc.dtype)
    dp = do @ vc.transpose(-1, -2)
    delta = (p * dp).sum(-1)
    if dlse is not None:
        delta = delta - torch.where(torch.isneginf(lse), 0.0, dlse.to(qc.dtype))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = ds @ kc * scale
    dk = (ds.transpose(-1, -2) @ qc).sum(2, keepdim=True) * scale
    dv = (p.transpose(-1, -2) @ do).sum(2, keepdim=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _vmap_loop(info: Any, in_dims: tuple, fn: Any, *args: Any) -> tuple[Any, Any]:
    """A ``vmap`` rule that runs ``fn`` once per batch entry (the tile loops need plain tensors)."""
    outs = []
    for i in range(info.batch_size):
        outs.append(fn(*(a if d is None or a is None else a.select(d, i) for a, d in zip(args, in_dims))))
    res = tuple(torch.stack([o[j] for o in outs]) for j in range(len(outs[0])))
    return res, (0,) * len(res)


def _softcap(tiles: MaskTiles) -> Optional[float]:
    return None if tiles.score is None or tiles.score.form is None else tiles.score.form.softcap


class ChunkedAttention(torch.autograd.Function):
    """q, k, v (grouped, any float dtype) → out, lse, and the saved m, l, all in the compute dtype
    (16-bit inputs: float32; the caller rounds ``out``, and the backward keeps the unrounded one).
    ``rel``: a built-in score function's bias by offset (``tiles.score.form.rel``), or None."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, scale: float, plan: tuple[int, int, int], rel=None):
        band = tiles.positional.band()
        out, m, l = chunked_fwd_op(q, k, v, tiles.attn, tiles.padding, *band, scale, *plan, _softcap(tiles), rel)
        return out, lse_from(m, l, tiles, scale), m, l

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, tiles, scale, plan, rel = inputs
        out, _, m, l = output
        ctx.save_for_backward(q, k, v, out, m, l, rel)
        ctx.tiles, ctx.scale, ctx.plan = tiles, scale, plan
        ctx.mark_non_differentiable(m, l)

    @staticmethod
    def backward(ctx: Any, dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor], _dm: Any, _dl: Any):
        q, k, v, out, m, l, rel = ctx.saved_tensors
        if any(t is not None and _is_batched(t) for t in (dout, dlse)):
            # batched gradients from the autograd engine itself (gradcheck's check_batched_grad,
            # autograd.grad(is_grads_batched=True)) bypass the vmap rule: use plain tensor ops
            if ctx.tiles.score is not None:
                raise NotImplementedError("batched gradients (is_grads_batched, check_batched_grad) with a score function: use backend='math'")
            return (*_dense_backward(q, k, v, dout, dlse, ctx.tiles, ctx.scale), None, None, None, None)
        dq, dk, dv, drel = _ChunkedBackward.apply(q, k, v, out, m, l, dout, dlse, ctx.tiles, ctx.scale, ctx.plan, rel)
        return dq, dk, dv, None, None, None, (drel if rel is not None else None)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, q, k, v, tiles, scale, plan, rel=None):
        fn = lambda q_, k_, v_: ChunkedAttention.apply(q_, k_, v_, tiles, scale, plan, rel)  # noqa: E731
        return _vmap_loop(info, in_dims[:3], fn, q, k, v)


class _ChunkedBackward(torch.autograd.Function):
    """The backward pass as its own function, so that ``torch.func`` can batch it (``jacrev``)."""

    @staticmethod
    def forward(q, k, v, out, m, l, dout, dlse, tiles, scale, plan, rel=None):
        dout = torch.zeros_like(out) if dout is None else dout
        band = tiles.positional.band()
        return chunked_bwd_op(q, k, v, out, m, l, dout, dlse, tiles.attn, tiles.padding, *band, scale, *plan, _softcap(tiles), rel)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        raise RuntimeError("the chunked backend does not support double backward; use backend='math'")

    @staticmethod
    def vmap(info: Any, in_dims: tuple, q, k, v, out, m, l, dout, dlse, tiles, scale, plan, rel=None):
        fn = lambda *a: _ChunkedBackward.apply(*a, tiles, scale, plan, rel)  # noqa: E731
        return _vmap_loop(info, in_dims[:8], fn, q, k, v, out, m, l, dout, dlse)


class _ScoredAttention(torch.autograd.Function):
    """:class:`ChunkedAttention` for calls with a score function: the tile loops called directly
    (a Python callable cannot cross a custom op's schema), and gradients for the tensors the
    function reads (``params``) as well. No ``vmap`` rule and no double backward."""

    @staticmethod
    def forward(q, k, v, tiles: MaskTiles, scale: float, plan: tuple[int, int, int], *params: torch.Tensor):
        tiles = replace(tiles, score=tiles.score.with_tensors(params))  # type: ignore[union-attr]
        qc, kc, vc = half_to_float(q), half_to_float(k), half_to_float(v)
        out, m, l = chunked_forward(qc, kc, vc, tiles, scale, plan)
        return out, lse_from(m, l, tiles, scale), m, l

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, tiles, scale, plan, *params = inputs
        out, _, m, l = output
        ctx.save_for_backward(q, k, v, out, m, l, *params)
        ctx.tiles, ctx.scale, ctx.plan = tiles, scale, plan
        ctx.mark_non_differentiable(m, l)

    @staticmethod
    def backward(ctx: Any, dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor], _dm: Any, _dl: Any):
        # detached: under torch.func, buffers made from tracked inputs would be tracked leaves
        q, k, v, out, m, l, *params = (t.detach() for t in ctx.saved_tensors)
        params = [p.requires_grad_() for p in params]  # what a Python function's gradients are taken against
        tiles = replace(ctx.tiles, score=ctx.tiles.score.with_tensors(params))
        qc, kc, vc = half_to_float(q), half_to_float(k), half_to_float(v)
        cd = qc.dtype
        dout = torch.zeros_like(out) if dout is None else dout.detach().to(cd)
        dlse = None if dlse is None else dlse.detach().to(cd)
        # the tensors' gradients summed over tiles in float32 (16-bit tables included), rounded once
        dparams = [torch.zeros_like(p, dtype=accumulate_dtype(p.dtype)) for p in params]
        with torch.no_grad():
            dq, dk, dv = chunked_backward(qc, kc, vc, out, m, l, dout, dlse, tiles, ctx.scale, ctx.plan, dparams)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, *(d.to(p.dtype) for d, p in zip(dparams, params))


@torch.compiler.disable  # a Python callable runs in eager mode: torch.compile breaks the graph here
def scored_attention(q, k, v, tiles: MaskTiles, scale: float, plan: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile loops with a Python score function. With gradients, every tile's reads are
    watched (:mod:`qkv.score_mods.reads`): a tensor requiring grad that the call was not bound
    with stops the forward, and the call runs again knowing it, so each receives its gradient."""
    score = tiles.score
    assert score is not None
    if not torch.is_grad_enabled():
        out, lse, _, _ = _ScoredAttention.apply(q, k, v, tiles, scale, plan)
        return out, lse
    known = score.tensors
    while True:
        watched = replace(tiles, score=score.watching(known))
        try:
            out, lse, _, _ = _ScoredAttention.apply(q, k, v, watched, scale, plan, *known)
            return out, lse
        except MissedReads as missed:
            known = (*known, *missed.tensors)
