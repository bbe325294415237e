"""The online softmax of :mod:`.chunked`, in torch ops: the forward and recomputing backward
over tiles of ``block_q`` rows × ``block_k`` keys, in the grouped layout ``(B, Hk, G, N, D)``.

These loops are the reference of the C loops (:mod:`.chunked_native`), which run the same tiles,
units and precision measures where they have the dtype and device; the forward and backward
here call them first. The math, and why it is exact enough, is in :mod:`.chunked`'s docstring.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..masks.tiles import MaskTiles
from . import chunked_native
from .tiles import LOG2E, augment, head_groups, key_blocks

__all__ = ["LAZY_LIMIT", "chunked_backward", "chunked_forward", "lse_from"]

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
            if g == 1 and dv:  # (view cannot infer -1 for Dv = 0, where there is nothing to add)
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
