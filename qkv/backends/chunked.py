"""``chunked``: exact attention by online softmax over key blocks, in plain torch ops.

The score matrix is visited tile by tile (``block_q`` query rows × ``block_k`` keys), so the
extra memory is ``O(block_q · block_k)`` per head on top of the ``O(N · D)`` inputs and
outputs — never ``Nq × Nk``. Tiles that the causal/window rules mask completely are skipped,
so the cost of sliding-window attention falls with the window.

Forward (per query block, running over key blocks)::

    m  = max(m, rowmax(S))                 running maximum (an actual score: see below)
    P  = exp(S - m)                        unnormalised weights of this tile
    l  = l · exp(m_old - m) + rowsum(P)    running denominator
    O  = O · exp(m_old - m) + P · V        running numerator
    out = O / l,  lse = m + log(l)         (out = 0, lse = -inf for an empty row)

Backward recomputes each tile from the saved ``m`` and ``l`` instead of storing weights::

    P̃ = exp(S - m)  (= P · l);  dV += P̃ᵀ (dO / l);  dP̃ = (dO / l) Vᵀ
    dS = P̃ ∘ (dP̃ - δ / l),  δ = rowsum(dO ∘ O) - dlse;  dQ += dS K · scale;  dK += dSᵀ Q · scale

Precision (float32 gradients as accurate as a float32 softmax's, even with logits in the
hundreds or one key taking all the weight):

- ``m`` is a score that was actually computed, and the backward computes the same tile
  products, so ``S - m`` is exact near the maximum, where the weights are large. ``m`` and ``l``
  are kept apart rather than folded into one ``lse``: an lse of 300 has an ulp of 3e-5, which
  ``exp(S - lse)`` would pass on to every weight.
- Tiles hold the raw products ``q·kᵀ`` and the scale multiplies only ``S - m``, so no rounded
  ``scale · log2 e`` stretches the large scores (exponentials are ``exp2``, about three times
  cheaper than ``exp`` on a CPU). With a float ``attn_mask`` tiles hold ``q·kᵀ·scale + bias``
  in natural units, rounded exactly as the math path rounds them.
- ``l`` is a pairwise ``sum``, not a ones column in the matmul (BLAS sums sequentially).
- Where one key holds more than half of a row's weight, its ``dS`` is recomputed from
  ``v_j - O_i`` (see :func:`_backward_heads`).

Heads are processed in groups small enough that a tile (``1 MiB`` of float32 scores across
the group) stays in cache for the elementwise pass. 16-bit inputs are computed in float32
and rounded once. A negative or zero scale moves into the query first
(:meth:`AttentionCall.positive_scale`), so the row maximum of ``q·kᵀ`` is the largest score.
Differences from ``math``: no dropout, and no gradient to a float ``attn_mask``.

Calls without gradients on a CPU (and without a float ``attn_mask``, score function or sinks)
run on torch's fused flash kernel instead, dispatched block by block under the same rules
(:mod:`.flash_cpu`): the same tiles skipped, at the speed of torch's vectorised kernel. Calls
with gradients on a CPU (no ``attn_mask``), and calls with a built-in score function or sinks
with or without them, run the forward and backward below as C loops over cache-sized tiles
with torch's own BLAS (:mod:`.chunked_native`): the same tiles, units and precision measures
(a built-in's softcap and offset bias applied to each tile in C); the torch formulation here
stays their reference, and runs a score function given as a Python callable. The loops here are torch custom ops, so
``torch.compile`` keeps a call in one graph without tracing into them.

A block-sparse layout (:class:`qkv.sparse.BlockSparseMask`) is walked by its row blocks
(:func:`.tiles.layout_rows`): each is a call of its own over the keys of its blocks, gathered
into one buffer where they are not adjacent — the C loops where the blocks need no mask or a
band (a rule inside them), the torch formulation for the tiles that need another — and the
keys' gradients are added back to their places. No ``Nq × Nk`` mask is built.

The autograd functions follow ``torch.func``'s protocol (``setup_context`` and a ``vmap``
rule), so ``jacrev``, ``vmap`` and ``grad`` work; batched cotangents from the autograd engine
(``gradcheck(check_batched_grad=True)``) take a dense formula.
"""

from __future__ import annotations


from dataclasses import replace
from typing import Any, Optional

import torch

from ..call import AttentionCall, accumulate_dtype, compute_dtype
from ..masks import MaskTiles
from ..reference.masks import PositionalMask
from ..elementwise import runs_on_tiles
from ..score_mods.base import BoundScore, KernelForm, captured_tensors
from ..sinks import add_sinks, grouped_sinks
from . import chunked_native
from .base import Backend, follow_rule, half_to_float
from .decode_cpu import decode_attention
from .dispatch import chunked_kernel
from .flash_cpu import fused_attention
from .tiles import (
    LOG2E, SparseRows, augment, check_tile_size, gather_buffer, head_groups, key_blocks, layout_groups, layout_rows, pick,
    pick_index, plan_tiles,
)  # fmt: skip
# Re-exported: the tile shape's old home (:mod:`.tiles` is the walk's own module).
from .tiles import BLOCK_K, BLOCK_Q, TILE_BUDGET, band_rows  # noqa: F401

# The lazy forward leaves a row's shift at its first tile's maximum; it is redone exactly once a
# row's weights sum past this (a later score ≥ 24 octaves above the shift), which bounds the
# rounding of S - m by 24 · 2^-24 relative: below a float32 softmax's own.
LAZY_LIMIT = float(2**24)

_NEG_INF = float("-inf")


def _masked(s: torch.Tensor, tiles: MaskTiles, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """Add the tile's bias and set disallowed scores to ``-inf``, in place (the in-place twin of
    :func:`qkv.masks.apply_tile`, for tiles no gradient flows through)."""
    allowed, bias = tiles.tile(q0, q1, k0, k1)
    if bias is not None:
        s.add_(bias)
    if allowed is not None:
        s.masked_fill_(~allowed, _NEG_INF)
    return s


class _Units:
    """How a tile's scores are kept, so that ``S - m`` is exact where the weights are large.

    Without a float bias the tile holds the raw products ``q·kᵀ`` (no rounding before the
    subtraction of the row maximum), and ``exp(scale·(S - m)) = exp2((S - m)·scale·log2 e)``:
    the scale meets only the small differences. With a float ``attn_mask`` the tile holds
    ``q·kᵀ·scale + bias`` in natural units, rounded exactly as the math path rounds it.
    """

    def __init__(self, tiles: MaskTiles, scale: float) -> None:
        self.natural = (tiles.attn is not None and tiles.attn.dtype != torch.bool) or tiles.score is not None
        self.scale = scale
        self.score = tiles.score
        self.to_nat = 1.0 if self.natural else scale  # natural-log value of one unit of S
        self._c = scale * LOG2E

    def scores(self, q: torch.Tensor, kt: torch.Tensor, tiles: MaskTiles, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """Masked scores of one tile (raw ``q·kᵀ``, or ``score_mod(q·kᵀ·scale) + bias``); ``-inf`` where masked."""
        s = q @ kt
        if self.natural:
            s.mul_(self.scale)
        if self.score is not None:
            s = tiles.score.apply(s, q0, k0)  # type: ignore[union-attr]
        return _masked(s, tiles, q0, q1, k0, k1)

    def scored(self, q: torch.Tensor, kt: torch.Tensor, tiles: MaskTiles, q0: int, q1: int, k0: int, k1: int) -> tuple[Any, torch.Tensor]:
        """For the backward with a score function: the masked modified scores of a tile, and a
        function taking their gradient ``dS'`` to ``[dS, d(each of score.tensors)]``.

        Under ``torch.func`` transforms (``grad``, ``jacrev``) autograd cannot be entered, so
        ``torch.func.vjp`` differentiates the function with its tensors passed in explicitly;
        a plain Python function reading captured tensors then cannot pass them on."""
        score = tiles.score
        assert score is not None
        raw = (q @ kt).mul_(self.scale)
        if score.form is not None:  # a built-in: its derivative written out
            mod, chain = score.vjp(raw, q0, k0)
            return chain, _masked(mod, tiles, q0, q1, k0, k1)
        if torch._C._functorch.peek_interpreter_stack() is not None:
            if score.tensors:  # ChunkedBackend.extra_reasons refuses such calls up front
                raise NotImplementedError("a Python score_mod's captured tensors under torch.func transforms")
            found = torch.func.vjp(lambda r: score.apply(r, q0, k0), raw)
            mod, vjp = found[0], found[1]
            return (lambda ds: list(vjp(ds))), _masked(mod.clone(), tiles, q0, q1, k0, k1)
        raw.requires_grad_()
        with torch.enable_grad():
            mod = score.apply(raw, q0, k0)
        inputs = [raw, *score.tensors]
        return (lambda ds: list(torch.autograd.grad(mod, inputs, ds, allow_unused=True))), _masked(mod.detach().clone(), tiles, q0, q1, k0, k1)

    def exp_(self, t: torch.Tensor) -> torch.Tensor:
        """``exp(t · to_nat)`` in place, for ``t = S - m``."""
        return t.exp_() if self.natural else t.mul_(self._c).exp2_()


def _row_block(
    qs: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, units: _Units, q0: int, q1: int, bk: int, lazy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Σ e^(S-m)·V`` ``(b, h, G, n, Dv)``, ``l = Σ e^(S-m)`` and the shift ``m`` ``(b, h, G, n)`` for rows ``[q0, q1)``.

    Exact online softmax on a row block's first tile and on later tiles while some row has
    seen no key yet. With ``lazy``, the tiles after that are added with the shift left where it
    is (one ``exp`` pass instead of three): the caller checks that no row's weights grew past
    2^24 — a later tile far above the first — and then redoes the block with ``lazy=False``.
    ``l`` is summed by ``sum`` (pairwise), not by a ones column in the matmul: BLAS sums
    sequentially, and an error in ``l`` scales every weight of the row.
    """
    b, h, g, n, _ = qs.shape
    dv = v.shape[-1]
    acc = qs.new_zeros(b, h, g, n, dv)
    l = qs.new_zeros(b, h, g, n)
    m = qs.new_full((b, h, g, n), _NEG_INF)
    exact = True
    for k0, k1 in key_blocks(tiles, q0, q1, bk):
        s = units.scores(qs, kt[..., k0:k1], tiles, q0, q1, k0, k1)  # (b, h, G, n, bk)
        vb = v[:, :, :, k0:k1]
        if exact or not lazy:
            m_new = torch.maximum(m, s.amax(-1))  # -inf only while a row has seen no key
            shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            alpha = units.exp_(m - shift)  # 0 for rows that held nothing yet
            p = units.exp_(s.sub_(shift.unsqueeze(-1)))
            acc = acc * alpha.unsqueeze(-1) + p @ vb
            l = l * alpha + p.sum(-1)
            m = m_new
            if lazy:
                exact = bool(torch.isneginf(m).any())
        else:
            p = units.exp_(s.sub_(m.unsqueeze(-1)))
            if g == 1:
                acc.view(-1, n, dv).baddbmm_(p.view(-1, n, k1 - k0), vb.flatten(0, 2))
            else:
                acc += p @ vb
            l += p.sum(-1)
    return acc, l, m


def _forward_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, scale: float, bq: int, bk: int,
    out: torch.Tensor, m_out: torch.Tensor, l_out: torch.Tensor,
) -> None:  # fmt: skip
    """One group of heads: q ``(b, h, G, Nq, D)``, k/v ``(b, h, 1, Nk, ·)``; writes out/m/l views."""
    units = _Units(tiles, scale)
    kt = k.transpose(-1, -2)  # (b, h, 1, D, Nk)
    for q0 in range(0, q.shape[3], bq):
        q1 = min(q.shape[3], q0 + bq)
        qs = q[:, :, :, q0:q1]
        acc, l, m = _row_block(qs, kt, v, tiles, units, q0, q1, bk, lazy=True)
        if not bool((l <= LAZY_LIMIT).all()):  # also catches inf and NaN
            acc, l, m = _row_block(qs, kt, v, tiles, units, q0, q1, bk, lazy=False)
        has = l > 0
        out[:, :, :, q0:q1] = acc / torch.where(has, l, torch.ones_like(l)).unsqueeze(-1)
        m_out[:, :, :, q0:q1] = m
        l_out[:, :, :, q0:q1] = l


def chunked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: MaskTiles, scale: float, plan: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``(B, Hk, G, Nq, D)``, k/v ``(B, Hk, 1, Nk, ·)`` in the compute dtype → out, and per row the
    shift ``m`` (in the units of :class:`_Units`, ``-inf`` for an empty row) and the sum
    ``l = Σ exp(S - m)`` (0 there). ``m`` stays in those units: converting it back and forth
    would round it, and the backward needs ``S - m`` exact."""
    b, hk, g, nq, _ = q.shape
    bq, bk, per_group = plan
    native = chunked_native.forward(q, k, v, tiles, scale, bq, bk)
    if native is not None:
        return native
    out = q.new_zeros(b, hk, g, nq, v.shape[-1])
    m = q.new_full((b, hk, g, nq), _NEG_INF)
    l = q.new_zeros((b, hk, g, nq))
    for e, t in _entries(tiles):  # batch entries apart when their key padding is ragged
        qe, ke, ve, oe, me, le = q[e], k[e], v[e], out[e], m[e], l[e]
        for bs, hs in head_groups(qe.shape[0], hk, per_group):
            _forward_heads(qe[bs, hs], ke[bs, hs], ve[bs, hs], t.narrow(bs, hs), scale, bq, bk, oe[bs, hs], me[bs, hs], le[bs, hs])
    return out, m, l


def _entries(tiles: MaskTiles) -> list[tuple[slice, MaskTiles]]:
    """(batch slice, masks) to run apart: one per entry with ragged key padding (its padded
    key tiles skipped), else the whole batch; with a bool attn_mask's empty tiles found."""
    tiles = tiles.with_occupancy()
    return tiles.ragged() or [(slice(None), tiles)]


def lse_from(m: torch.Tensor, l: torch.Tensor, tiles: MaskTiles, scale: float) -> torch.Tensor:
    """``lse = m + log l`` in natural log, ``-inf`` for empty rows (``l = 0``), NaN where ``l`` is
    (a NaN or ``+inf`` score: the lse of a NaN row is NaN, :mod:`qkv.nonfinite`)."""
    has = l != 0  # True for NaN
    m_nat = m * _Units(tiles, scale).to_nat
    return torch.where(has, m_nat + torch.log(torch.where(has, l, torch.ones_like(l))), _NEG_INF)


def _backward_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    rows: dict[str, torch.Tensor],
    tiles: MaskTiles,
    scale: float,
    bq: int,
    bk: int,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dparams: Optional[list[torch.Tensor]] = None,
) -> None:
    """One group of heads; accumulates into the dq/dk/dv views (and, with a score function,
    the gradients of the tensors it reads into ``dparams``).

    ``rows`` holds per-row tensors ``(b, h, G, Nq[, Dv])``: ``m``, ``dout`` (dO / l), ``delta``
    (δ / l), ``dlse`` (dlse / l) and ``half_l`` (l / 2). ``[dO/l, -δ/l]·[v, 1]ᵀ = dP̃ - δ/l``
    rides along as an extra matmul column.

    ``δ = rowsum(dO ∘ O)`` equals ``Σ_j P_ij dP_ij`` only up to rounding, and where one key
    takes nearly all of a row's weight, ``dP_ij* - δ_i`` cancels to a tiny number that this
    rounding would swamp (a float32 softmax's backward cancels it exactly). So the entry with
    ``P > 1/2`` — at most one per row — is recomputed as ``P · (dO·(v_j - O_i) + dlse)``, whose
    difference ``v_j - O_i`` is small and exact there.
    """
    units = _Units(tiles, scale)
    g, nq = q.shape[2], q.shape[3]
    m_u = rows["m"].masked_fill(torch.isneginf(rows["m"]), 0.0).unsqueeze(-1)  # empty rows: every score is -inf
    do_s, dlse_s, half_l = rows["dout"], rows["dlse"], rows["half_l"]
    do_aug = torch.cat([do_s, -rows["delta"].unsqueeze(-1)], dim=-1)  # (b, h, G, Nq, Dv+1)
    kt = k.transpose(-1, -2)
    v_aug = augment(v, 1.0)
    for q0 in range(0, nq, bq):
        q1 = min(nq, q0 + bq)
        qb = q[:, :, :, q0:q1]  # the forward's exact tile products: S - m is exact at the maximum
        doa, mb, hb = do_aug[:, :, :, q0:q1], m_u[:, :, :, q0:q1], half_l[:, :, :, q0:q1].unsqueeze(-1)
        peaked = bool((hb < 1.0).any())  # some row's weights sum to l < 2, so one key may hold > 1/2
        for k0, k1 in key_blocks(tiles, q0, q1, bk):
            if units.score is None:
                p = units.exp_(units.scores(qb, kt[..., k0:k1], tiles, q0, q1, k0, k1).sub_(mb))  # P̃ (b, h, G, bq, bk)
            else:
                chain, masked = units.scored(qb, kt[..., k0:k1], tiles, q0, q1, k0, k1)
                p = units.exp_(masked.sub_(mb))
            ds = (doa @ v_aug[:, :, :, k0:k1].transpose(-1, -2)).mul_(p)  # P̃ ∘ (dP̃ - δ/l)
            if peaked:
                hit = (p > hb).nonzero(as_tuple=True)  # P = P̃ / l > 1/2
                if hit[0].numel():
                    bi, hi, gi, ri, ci = hit
                    diff = v[bi, hi, 0, k0 + ci] - out[bi, hi, gi, q0 + ri]  # (hits, Dv)
                    ds[hit] = p[hit] * ((do_s[bi, hi, gi, q0 + ri] * diff).sum(-1) + dlse_s[bi, hi, gi, q0 + ri])
            if units.score is not None:  # dS of the modified scores → of the scaled products and the function's tensors
                grads = chain(ds)
                ds = grads[0]
                for acc, g_ in zip(dparams or (), grads[1:]):
                    if g_ is not None:
                        acc += g_
            dv_t = p.transpose(-1, -2) @ doa[..., :-1]  # (b, h, G, bk, Dv)
            dq[:, :, :, q0:q1] += ds @ k[:, :, :, k0:k1]
            dk_t = ds.transpose(-1, -2) @ qb
            if g > 1:  # a key/value head serves G query heads: sum their contributions
                dv_t, dk_t = dv_t.sum(2, keepdim=True), dk_t.sum(2, keepdim=True)
            dv[:, :, :, k0:k1] += dv_t
            dk[:, :, :, k0:k1] += dk_t


def chunked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    m: torch.Tensor,
    l: torch.Tensor,
    dout: torch.Tensor,
    dlse: Optional[torch.Tensor],
    tiles: MaskTiles,
    scale: float,
    plan: tuple[int, int, int],
    dparams: Optional[list[torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for q ``(B, Hk, G, Nq, D)`` and k/v ``(B, Hk, 1, Nk, ·)`` by tile recomputation
    (and into ``dparams`` those of the tensors a score function reads).

    All tensors in the compute dtype; ``out`` is the forward's unrounded output.
    """
    b, hk = q.shape[:2]
    bq, bk, per_group = plan
    has = l > 0
    inv_l = torch.where(has, 1.0 / torch.where(has, l, torch.ones_like(l)), torch.zeros_like(l))  # P = P̃ / l
    dlse_s = torch.zeros_like(l) if dlse is None else dlse.masked_fill(~has, 0.0) * inv_l
    rows = {
        "m": m,
        "dout": dout * inv_l.unsqueeze(-1),
        "delta": (dout * out).sum(-1) * inv_l - dlse_s,  # (rowsum(dO ∘ O) - dlse) / l
        "dlse": dlse_s,
        "half_l": torch.where(has, 0.5 * l, float("inf")),
    }
    native = chunked_native.backward(q, k, v, out, rows, tiles, scale, bq, bk, dparams)
    if native is not None:
        return native
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for e, te in _entries(tiles):
        qe, ke, ve, oe, dqe, dke, dve = q[e], k[e], v[e], out[e], dq[e], dk[e], dv[e]
        re = {n: t[e] for n, t in rows.items()}
        for bs, hs in head_groups(qe.shape[0], hk, per_group):
            _backward_heads(
                qe[bs, hs], ke[bs, hs], ve[bs, hs], oe[bs, hs], {n: t[bs, hs] for n, t in re.items()},
                te.narrow(bs, hs), scale, bq, bk, dqe[bs, hs], dke[bs, hs], dve[bs, hs], dparams,
            )  # fmt: skip
    return dq.mul_(scale), dk.mul_(scale), dv


# ---- custom ops: the tile loops as single graph nodes ------------------------------------------
# torch.compile sees each loop as one opaque operation (with a fake implementation for shapes)
# instead of unrolling thousands of tile operations, and the loops keep their host-side checks
# (the lazy shift, the dominant-weight search) without breaking the graph.


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
    from ..masks import apply_tile
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


class _ChunkedAttention(torch.autograd.Function):
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
        fn = lambda q_, k_, v_: _ChunkedAttention.apply(q_, k_, v_, tiles, scale, plan, rel)  # noqa: E731
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
    """:class:`_ChunkedAttention` for calls with a score function: the tile loops called directly
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
def _scored_attention(q, k, v, tiles: MaskTiles, scale: float, plan: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, _, _ = _ScoredAttention.apply(q, k, v, tiles, scale, plan, *tiles.score.tensors)  # type: ignore[union-attr]
    return out, lse


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
def _layout_attention(call: AttentionCall, q, k, v, scale: float, block) -> tuple[torch.Tensor, torch.Tensor]:
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


def _walks_layout(call: AttentionCall) -> bool:
    """Does the tile walk follow the call's block-sparse layout? Yes, unless a score function
    (it reads positions the gathered keys lose) or ``torch.func`` transforms (no vmap rule) are there."""
    return call.block_sparse is not None and call.score_mod is None and torch._C._functorch.peek_interpreter_stack() is None


class ChunkedBackend(Backend):
    NAME = "chunked"
    DESCRIPTION = "online softmax over key blocks in torch; O(N·block) extra memory; recomputing backward"
    SUPPORTS_DROPOUT = False
    SUPPORTS_GENERATOR = False
    SUPPORTS_MASK_GRAD = False
    SCORE_MODS = "any"
    SUPPORTS_SINKS = True

    def __init__(self, block_q: Optional[int] = None, block_k: Optional[int] = None) -> None:
        self.block_q, self.block_k = check_tile_size("block_q", block_q), check_tile_size("block_k", block_k)

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        if call.score_mod is None or call.builtin_score or torch._C._functorch.peek_interpreter_stack() is None:
            return []
        if captured_tensors(call.score_mod):
            return [
                "under torch.func transforms (grad, jacrev, vmap) the tensors a Python score_mod reads cannot receive "
                "gradients tile by tile; use loss.backward(), a built-in from qkv.score_mods, or backend='math'"
            ]
        if not runs_on_tiles(call.score_mod, (call.batch_size, call.hq, call.nq, call.nk), compute_dtype(call.dtype)):
            return [  # torch.vmap inside the tile loops' autograd.Function under a transform: torch refuses
                "under torch.func transforms a score_mod written per element (mapped with torch.vmap) cannot run inside "
                "the tile loops; write it on broadcasting index tensors, use loss.backward(), or backend='math'"
            ]
        return []

    def kernel(self, call: AttentionCall) -> str:
        """Which of chunked's kernels runs ``call`` (:data:`.dispatch.KERNELS`), all under the same
        tile rules: ``"decode"`` (:mod:`.decode_cpu`), ``"flash_cpu"`` (torch's fused kernel block
        by block, :mod:`.flash_cpu`) or ``"tiles"``: the tile loops — torch custom ops run as C
        loops (:mod:`.chunked_native`) where those have the dtype and device, else the torch
        formulation here; a score function given as a Python callable is applied tile by tile
        in torch (:func:`_scored_attention`). Tile sizes of one's own choosing always get the tiles."""
        return chunked_kernel(call, default_tiles=self.block_q is None and self.block_k is None)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        kernel = self.kernel(call)
        if kernel == "decode":
            return decode_attention(call)  # no gradient; the kernel's own check, or qkv.attention's guard
        if kernel == "flash_cpu":
            return follow_rule(call, *fused_attention(call))  # no gradient: torch's fused kernel, block by block
        # every kernel's backward (C loops, torch formulation, layout walk, dense batched formula)
        # computes what its tiles give; follow_rule then adds the rule's NaN (qkv.nonfinite)
        return follow_rule(call, *self._tiled(call))

    def _tiled(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(out, lse or None)`` from the tile loops (or the layout walk), before the rule."""
        query, scale = call.positive_scale()  # the row maximum of q·kᵀ must be the largest score
        # the tiles compute in float32 anyway; with gradients, upcast before the broadcast so that
        # a shared tensor's gradient is summed in float32 (call.grouped_qkv)
        q, k, v = call.grouped_qkv(query, upcast=call.requires_grad and call.device.type == "cpu")
        if _walks_layout(call):
            out, lse = _layout_attention(call, q, k, v, scale, (self.block_q, self.block_k))
        else:
            out, lse = self._tile_attention(call, q, k, v, scale)
        if call.sinks is not None:
            out, lse = add_sinks(out, lse, grouped_sinks(call.sinks, call.hk, call.group))
        return call.ungroup(out.to(call.dtype)), (call.ungroup(lse.to(call.lse_dtype)) if call.return_lse else None)

    def _tile_attention(self, call: AttentionCall, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) in the grouped layout from the tile loops (custom ops, or the scored loop)."""
        tiles = MaskTiles.from_call(call)
        lo, hi = tiles.positional.band()
        span = None  # how many consecutive keys a row can see at most, where a band limits them
        if q.device.type == "cpu" and (lo is not None or hi is not None):  # measured on CPUs only
            span = hi - lo + 1 if lo is not None and hi is not None else call.nk
        plan = plan_tiles(*q.shape[:3], call.nq, call.nk, self.block_q, self.block_k, span)
        if tiles.score is None or tiles.score.form is not None:  # no score function, or a built-in: the custom ops
            rel = None if tiles.score is None else tiles.score.form.rel  # type: ignore[union-attr]
            out, lse, _, _ = _ChunkedAttention.apply(q, k, v, tiles, scale, plan, rel)
            return out, lse
        return _scored_attention(q, k, v, tiles, scale, plan)
