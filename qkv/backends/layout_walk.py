"""The walk of a block-sparse layout for :mod:`.chunked`: each row block of the layout
(:func:`.tiles.layout_rows`) is a call of its own over the keys of its blocks, gathered into one
buffer where they are not adjacent — the C loops where the blocks need no mask or a band (a rule
inside them), the torch formulation for the tiles that need another — and the keys' gradients
are added back to their places. No ``Nq × Nk`` mask is built.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..call import AttentionCall
from ..masks.tiles import MaskTiles
from ..masks.rules import PositionalMask
from .base import half_to_float
from .online_softmax import chunked_backward, chunked_forward, lse_from
from .tiles import LOG2E, SparseRows, gather_buffer, layout_groups, layout_rows, pick, pick_index, plan_tiles

__all__ = ["layout_attention", "walks_layout"]

_NEG_INF = float("-inf")


def _row_tiles(r: SparseRows, padding: Optional[torch.Tensor], device: torch.device) -> MaskTiles:
    """The masks of one layout row block's sub-call: rows ``[q0, q1)`` against its gathered keys.

    A mask the same for every head that is a band on one key range (a causal or window rule on
    a diagonal block) and/or a choice of keys (global tokens) becomes the sub-call's band and
    key padding, which the C loops run; other masks keep the torch formulation."""
    pad = None if padding is None else r.take(padding, 4)
    pm, mask = PositionalMask(r.q1 - r.q0, r.width), r.mask
    if mask is not None:
        mask = mask.expand(*mask.shape[:-2], r.q1 - r.q0, r.width)  # MaskTiles wants the tile's last two dims
    if mask is not None and all(n == 1 for n in mask.shape[:3]):
        found = _band_and_keys(mask[0, 0, 0].expand(r.q1 - r.q0, r.width), len(r.runs) == 1)
        if found is not None:
            pm, keys_ok, mask = found[0], found[1], None
            if keys_ok is not None:
                pad = keys_ok if pad is None else pad & keys_ok
    return MaskTiles(pm, mask, pad, device)


def _band_and_keys(m: torch.Tensor, contiguous: bool) -> Optional[tuple[PositionalMask, Optional[torch.Tensor]]]:
    """``m (R, C)`` as ``band(lo ≤ j − i ≤ hi) & keys_ok[j]`` (the band only over ``contiguous``
    keys, where ``j − i`` means a distance): (the band's mask, keys_ok ``(1, 1, 1, 1, C)`` or
    None for all), or None where it is neither."""
    r, c = m.shape
    keys_ok = m.any(0)
    d = torch.arange(c, device=m.device)[None, :] - torch.arange(r, device=m.device)[:, None]  # j - i
    seen = d[m]
    if seen.numel() == 0 or not contiguous:
        lo = hi = None
    else:
        lo, hi = int(seen.min()), int(seen.max())
    pm = PositionalMask.from_band(r, c, lo, hi)
    want = keys_ok[None, :] if lo is None else keys_ok[None, :] & (d >= lo) & (d <= hi)
    if not bool(torch.equal(m, want.expand(r, c))):
        return None
    return pm, None if bool(keys_ok.all()) else keys_ok.reshape(1, 1, 1, 1, c)


def _layout_forward(q, k, v, parts: list[tuple[SparseRows, MaskTiles]], scale: float, block: tuple[Optional[int], Optional[int]]):
    """out, m, l of :func:`chunked_forward` for a block-sparse layout, in the compute dtype: each
    row block is a call of its own over the keys of its blocks (the C loops where it needs no
    mask; a short one where it does), so no empty block is visited and no ``Nq × Nk`` mask built."""
    b, hk, g, nq, _ = q.shape
    out = q.new_zeros(b, hk, g, nq, v.shape[-1])  # rows no block reaches: 0, m = -inf, l = 0
    m = q.new_full((b, hk, g, nq), _NEG_INF)
    l = q.new_zeros((b, hk, g, nq))
    rows = [r for r, _ in parts]
    kbuf, vbuf = gather_buffer(rows, k, 3), gather_buffer(rows, v, 3)
    for r, t in parts:
        plan = plan_tiles(b, hk, g, r.q1 - r.q0, t.positional.nk, *block)
        o, mr, lr = chunked_forward(q[:, :, :, r.q0 : r.q1], r.take(k, 3, kbuf), r.take(v, 3, vbuf), t, scale, plan)
        rs = slice(r.q0, r.q1)
        if r.joins:  # the rows' other keys were the entry before: merge the two softmaxes
            o, mr, lr = _merge(out[:, :, :, rs], m[:, :, :, rs], l[:, :, :, rs], o, mr, lr, scale * LOG2E)
        out[:, :, :, rs], m[:, :, :, rs], l[:, :, :, rs] = o, mr, lr
    return out, m, l


def _merge(o1, m1, l1, o2, m2, l2, c: float):
    """One row's softmax over two key sets from each set's ``(out, m, l)`` (shifts in units where
    ``exp(x) = 2 ** (x · c)``). The shift stays a score that was computed (the larger one)."""
    m = torch.maximum(m1, m2)
    safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = l1 * ((m1 - safe) * c).exp2(), l2 * ((m2 - safe) * c).exp2()  # 0 for a set with no key
    l = w1 + w2
    inv = torch.where(l > 0, 1.0 / torch.where(l > 0, l, torch.ones_like(l)), torch.zeros_like(l))
    return (o1 * (w1 * inv).unsqueeze(-1) + o2 * (w2 * inv).unsqueeze(-1)), m, l


def _layout_backward(q, k, v, out, m, l, dout, dlse, parts: list[tuple[SparseRows, MaskTiles]], scale: float, block):
    """dq, dk, dv of :func:`chunked_backward` for a block-sparse layout: each row block's
    recomputation over its keys, given the whole row's ``m`` and ``l``; the keys' gradients are
    added back to their positions."""
    b, hk, g = q.shape[:3]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rows = [r for r, _ in parts]
    kbuf, vbuf = gather_buffer(rows, k, 3), gather_buffer(rows, v, 3)
    for r, t in parts:
        rs = slice(r.q0, r.q1)
        plan = plan_tiles(b, hk, g, r.q1 - r.q0, t.positional.nk, *block)
        dq_r, dk_r, dv_r = chunked_backward(
            q[:, :, :, rs], r.take(k, 3, kbuf), r.take(v, 3, vbuf), out[:, :, :, rs], m[:, :, :, rs], l[:, :, :, rs],
            dout[:, :, :, rs], None if dlse is None else dlse[:, :, :, rs], t, scale, plan,
        )  # fmt: skip
        dq[:, :, :, rs] += dq_r  # a row block split in two (``joins``) adds both halves
        r.add_to(dk, dk_r, 3)
        r.add_to(dv, dv_r, 3)
    return dq, dk, dv


class _LayoutAttention(torch.autograd.Function):
    """:class:`_ChunkedAttention` for a block-sparse layout (:func:`.tiles.layout_rows`): the tile
    loops run per row block over the keys of its blocks. No ``vmap`` rule and no double backward
    (under ``torch.func`` transforms the call takes the dense mask's path)."""

    @staticmethod
    def forward(q, k, v, parts: list[tuple[SparseRows, MaskTiles]], scale: float, block):
        qc, kc, vc = half_to_float(q), half_to_float(k), half_to_float(v)
        out, m, l = _layout_forward(qc, kc, vc, parts, scale, block)
        return out, lse_from(m, l, MaskTiles(PositionalMask(q.shape[3], k.shape[3]), None, None, q.device), scale), m, l

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, parts, scale, block = inputs
        out, _, m, l = output
        ctx.save_for_backward(q, k, v, out, m, l)
        ctx.parts, ctx.scale, ctx.block = parts, scale, block
        ctx.mark_non_differentiable(m, l)

    @staticmethod
    def backward(ctx: Any, dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor], _dm: Any, _dl: Any):
        q, k, v, out, m, l = ctx.saved_tensors
        qc, kc, vc = half_to_float(q), half_to_float(k), half_to_float(v)
        cd = qc.dtype
        dout = torch.zeros_like(out) if dout is None else dout.to(cd)
        dlse = None if dlse is None else dlse.to(cd)
        with torch.no_grad():
            dq, dk, dv = _layout_backward(qc, kc, vc, out, m, l, dout, dlse, ctx.parts, ctx.scale, ctx.block)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


@torch.compiler.disable  # the layout's walk syncs with the host: torch.compile breaks the graph here
def layout_attention(call: AttentionCall, q, k, v, scale: float, block) -> tuple[torch.Tensor, torch.Tensor]:
    padding = call.grouped_key_padding()
    groups = layout_groups(call)
    out = lse = None
    for sel in groups:  # one walk per distinct layout
        pad = pick(padding, sel)
        # split: masked tiles run in torch ops, so the others keep the C loops; masks found once for both passes
        parts = [(r, _row_tiles(r, pad, q.device)) for r in layout_rows(call, split=True, sel=sel)]
        o, s, _, _ = _LayoutAttention.apply(pick(q, sel), pick(k, sel), pick(v, sel), parts, scale, block)
        if sel is None:
            return o, s
        if out is None:
            out, lse = o.new_zeros(*q.shape[:4], o.shape[-1]), s.new_zeros(q.shape[:4])
        out[pick_index(out, sel)], lse[pick_index(lse, sel)] = o, s
    return out, lse


def walks_layout(call: AttentionCall) -> bool:
    """Does the tile walk follow the call's block-sparse layout? Yes, unless a score function
    (it reads positions the gathered keys lose) or ``torch.func`` transforms (no vmap rule) are there."""
    return call.block_sparse is not None and call.score_mod is None and torch._C._functorch.peek_interpreter_stack() is None
