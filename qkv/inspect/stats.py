"""Streaming statistics of attention weights: one pass over score tiles, never ``Nq × Nk``.

Shape legend::

    ...  batch dims (B when flattened)   Hq, Hk  query / key-value heads   G = Hq // Hk
    Nq   query length   Nk  key length   k  topk   P  len(key_positions)   R  len(relative_positions)

Once the log-sum-exp of each row is known (from a fused forward pass), a tile of weights is
``P = 2^(S·log2e - lse·log2e)``; ``-lse·log2e`` rides along as an extra matmul column, as in
the chunked backend, so a tile costs one matmul and one ``exp2``. Every statistic is a running
reduction over the key tiles of a row block, so memory is ``O(Nq · k)`` per head plus one tile:

* entropy ``-Σ p ln p = -ln2 · Σ p · log2 p`` (``log2 p`` is the tile itself: no cancellation
  against a large ``lse``),
* the largest weight and the top-k weights/keys (running top-k merged per tile),
* the mean distance ``Σ p · |pos(i) - j|``, where query row ``i`` sits at key position
  ``i + offset`` (offset ``Nk - Nq`` for ``is_causal="bottom_right"``, else 0 — the causal rule's
  alignment). Tiles wholly on one side of every query reduce to Σp and a matrix-vector product
  ``P · (j - k0)``; only tiles straddling the diagonal need the elementwise form,
* the weight on chosen key positions (``key_positions``, e.g. 0: the attention sink) and on keys
  at chosen offsets from the query (``relative_positions``: -1 the previous token, 0 itself).

Without an lse the same pass finds it online, rescaling every sum as a row's maximum grows.
On a CPU each tile's statistics (float32 and float64) are one pass of a C kernel,
``qkv/csrc/stats_tile.c`` (:mod:`qkv.backends.native`), that computes these same sums; the
torch formulation below serves other devices and machines without a C compiler, and is tested
against it. The C kernel that scores tiles itself (``qkv_attention_stats_*``) does not apply
score functions: with one, the tiles are scored in torch and the per-tile C kernel (or the
torch formulation) takes them from there. :func:`attention_with_stats` also accumulates ``P·V``
from the same tiles.

A score function (``score_mod``) is applied to each tile's scores in natural units before the
masks, as the chunked backend applies it; the tile then goes on in log2 units. With ``sinks``
every statistic describes the weights the model uses, ``p' = p · (1 - σ)`` where
``σ = exp(sink - lse')`` is the row's **sink share** (``lse' = logaddexp(lse, sink)``): sums of
weights scale by ``1 - σ``, and the entropy is that of the whole distribution, the sink one more
outcome (``H' = (1 - σ)·H + h(σ)``, ``h`` the binary entropy). An lse given for such a call
includes its sink (as ``qkv.attention(..., sinks=..., return_lse=True)`` returns it), so each
tile already holds ``log2 p'`` and only ``-σ ln σ`` joins the entropy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from ..functional import overflowed_float32
from ..backends import stats_native
from ..backends.base import follow_rule, half_to_float
from ..backends.native import clamp_positions
from ..backends.tiles import LN2, LOG2E, augment, check_tile_size, head_groups, key_blocks, plan_tiles
from ..masks.tiles import MaskTiles
from ..nonfinite import surely_finite
from ..call import BackendName, validate, validate_qk
from ..sinks import grouped_sinks
from .maps import Window, check_row_sums, grouped_lse, sink_share

__all__ = ["AttentionStats", "attention_stats", "attention_with_stats"]

_NEG_INF = float("-inf")
# Key tiles twice the forward pass's: the statistics do many small per-row updates per tile, and
# fewer, wider tiles amortise them (N = 8192, 4 heads, 2 threads: 1.32x the forward with 512,
# 1.56x with 256, 1.46x with 1024).
STATS_BLOCK_K = 512
# Scores per tile, summed over the heads processed together, for the native kernel: it visits a
# tile row by row, so the tile need not stay in cache, and fewer, larger tiles mean fewer matmul
# calls and less per-tile work in Python (one layer of the bundled model, 512 tokens, 12 heads,
# 2 threads: 9-11 ms against 12-15 ms with the forward pass's 1 << 19; the whole recorded model
# showed no difference beyond this machine's noise).
NATIVE_TILE_BUDGET = 1 << 21
# Query rows per tile of the fused native pass (qkv.backends.stats_native.fused_pass): 128 rows × 512 keys of float32 is
# 256 KiB, which stays in a core's L2 cache between the score gemm, the statistics and P·V, and
# gives the gemms rows enough (attention_with_stats at N = 8192, 4 heads, 2 threads, one noisy run:
# 429 ms with 128 rows, 439 with 64, 484 with 32, 426 with 256, whose tile no longer fits L2).
FUSED_BLOCK_Q = 128
# Keys per chunk in the running top-k's search (see _merge_tile): 16 float32 = one cache line.
TOPK_CHUNK = 16


@dataclass
class AttentionStats:
    """Per (batch, head, query row) summaries of one attention call's weights.

    Arrays (``...`` = the call's batch dims)::

        entropy           (..., Hq, Nq)     nats; 0 for an empty row
        max_weight        (..., Hq, Nq)     0 for an empty row
        topk_indices      (..., Hq, Nq, k)  key index, -1 where the row has fewer keys
        topk_weights      (..., Hq, Nq, k)  descending; 0 where the index is -1
        mean_distance     (..., Hq, Nq)     Σ p·|pos(i) − j|
        key_weights       (..., Hq, Nq, P)  weight on key ``key_positions[p]``
        relative_weights  (..., Hq, Nq, R)  weight on key ``pos(i) + relative_positions[r]``
        n_keys            (..., Hq, Nq)     how many keys the row may attend (mask-allowed)
        lse               (..., Hq, Nq)     log-sum-exp of the scores (-inf for an empty row), or None
                                            when the caller gave it; with sinks it includes them
        sink_share        (..., Hq, Nq)     the share of the row's attention its sink takes (calls
                                            with ``sinks``, else None); the weights above sum to
                                            ``1 - sink_share``

    With sinks the entropy is that of the keys and the sink together (the sink one more outcome).
    """

    entropy: torch.Tensor
    max_weight: torch.Tensor
    topk_indices: torch.Tensor
    topk_weights: torch.Tensor
    mean_distance: torch.Tensor
    key_weights: torch.Tensor
    relative_weights: torch.Tensor
    n_keys: torch.Tensor
    lse: Optional[torch.Tensor] = None  # (..., Hq, Nq) natural log-sum-exp, when the pass computed it (no lse given)
    sink_share: Optional[torch.Tensor] = None  # (..., Hq, Nq) exp(sink - lse'), for calls with sinks
    key_positions: tuple[int, ...] = ()
    relative_positions: tuple[int, ...] = ()
    query_offset: int = 0  # key position of query row 0
    meta: dict[str, Any] = field(default_factory=dict)

    ARRAYS = ("entropy", "max_weight", "topk_indices", "topk_weights", "mean_distance", "key_weights", "relative_weights", "n_keys")

    @property
    def normalized_entropy(self) -> torch.Tensor:
        """Entropy / log(n) in [0, 1] with n the row's outcomes, ``n_keys`` (and the sink, with
        sinks): 1 = uniform over them; 0 for rows with < 2 outcomes."""
        n = self.n_keys.to(self.entropy.dtype) + (0 if self.sink_share is None else 1)
        return torch.where(n > 1, self.entropy / torch.log(n.clamp(min=2)), torch.zeros_like(self.entropy))

    @property
    def shape(self) -> tuple[int, ...]:
        """``(..., Hq, Nq)``."""
        return tuple(self.entropy.shape)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested lists, for JSON."""
        out: dict[str, Any] = {name: getattr(self, name).tolist() for name in self.ARRAYS}
        for name in ("lse", "sink_share"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).tolist()
        out.update(key_positions=list(self.key_positions), relative_positions=list(self.relative_positions), query_offset=self.query_offset)
        return out

    def to_string(self) -> str:
        """Per-head means (averaged over batch and non-empty rows), one line per head."""
        ent = self.entropy.reshape(-1, *self.shape[-2:]) if self.entropy.dim() >= 2 else self.entropy.reshape(1, 1, -1)
        valid = (self.n_keys.reshape(ent.shape) > 0).to(ent.dtype)
        denom = valid.sum((0, 2)).clamp(min=1)

        def mean(x: torch.Tensor) -> torch.Tensor:
            return (x.reshape(ent.shape) * valid).sum((0, 2)) / denom

        # with sinks, every row counts for the sink share (a row without keys gives the sink all)
        sink = None if self.sink_share is None else self.sink_share.reshape(ent.shape).mean((0, 2))
        lines = [repr(self), "head  entropy  max_w  distance" + ("" if sink is None else "   sink")]
        for h, (e, m, d) in enumerate(zip(mean(self.entropy), mean(self.max_weight), mean(self.mean_distance))):
            lines.append(f"{h:>4}  {float(e):7.3f}  {float(m):5.3f}  {float(d):8.1f}" + ("" if sink is None else f"  {float(sink[h]):5.3f}"))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return "<pre>" + self.to_string().replace("&", "&amp;").replace("<", "&lt;") + "</pre>"

    def __repr__(self) -> str:
        return (
            f"AttentionStats(shape={self.shape}, topk={self.topk_indices.shape[-1]}, "
            f"key_positions={self.key_positions}, relative_positions={self.relative_positions}"
            + ("" if self.sink_share is None else ", sinks") + ")"
        )


def _positions(values: Sequence[int], n: int, what: str) -> tuple[int, ...]:
    out = []
    for v in values:
        v = int(v)
        if not -n <= v < n:
            raise IndexError(f"{what} contains {v}, out of range for {n} keys (valid {-n}..{n - 1})")
        out.append(v + n if v < 0 else v)
    return tuple(out)


def attention_stats(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    lse: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Window = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    topk: int = 5,
    key_positions: Sequence[int] = (0,),
    relative_positions: Sequence[int] = (-1, 0),
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    check_lse: bool = True,
    backend: BackendName = "auto",
    score_mod: Any = None,
    sinks: Optional[torch.Tensor] = None,
) -> AttentionStats:
    """Entropy, top-k, mean distance and chosen-key weights of every query row, in one tiled pass.

    Shapes::

        query (..., Hq, Nq, D)   key (..., Hk, Nk, D)   lse (..., Hq, Nq) (optional)
        →     AttentionStats with (..., Hq, Nq[, ·]) arrays (see its docstring)

    Mask arguments mean what they mean in :func:`qkv.attention`. ``lse`` is the log-sum-exp
    from ``qkv.attention(..., return_lse=True)`` on the same call; without it the same single
    pass finds it (online, like the forward pass) and returns it as ``stats.lse``. Memory: the inputs, ``O(Nq · (topk + P + R))`` results
    and one tile of ``block_q × block_k`` scores per head group — never ``Nq × Nk``.
    ``key_positions`` may be negative (``-1`` = the last key). A given ``lse`` is checked as in
    :func:`~qkv.inspect.attention_map` (dtype, device, shape, NaN/+inf, rows summing to 1;
    ``check_lse=False``: the first four only). ``score_mod`` and ``sinks`` mean what they mean
    in :func:`qkv.attention`; the statistics are those of the weights it uses (see the module
    docstring for sinks: ``stats.sink_share``, and a given lse must include the sinks).

    ``backend``: ``"torch"`` (the tiled pass in torch operations), ``"triton"`` (a fused one-pass
    kernel, :func:`qkv.backends.triton.kernels.stats_kernel`; CUDA, or Triton's CPU interpreter),
    or ``"auto"`` (triton on CUDA when it is installed, else torch). The triton kernel always
    finds the lse itself and keeps its sums in float32; it applies no score function (auto then
    takes torch).
    """
    if topk < 0:
        raise ValueError(f"topk={topk} must be >= 0")
    block_q, block_k = check_tile_size("block_q", block_q), check_tile_size("block_k", block_k)
    call = validate_qk(query, key, attn_mask, is_causal, scale, enable_gqa, window, key_padding_mask,
                       score_mod=score_mod, sinks=sinks)  # fmt: skip
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend={backend!r} is not a statistics backend; use 'auto', 'torch' or 'triton'")
    if backend == "triton" or (backend == "auto" and call.device.type == "cuda" and _triton_ok(call) is None):
        why = _triton_ok(call)
        if why is not None:
            raise ValueError(f"backend='triton' cannot compute these statistics: {why}; use backend='torch'")
        return _triton_stats(call, topk, key_positions, relative_positions)
    return _tiled_stats(call, lse, check_lse, topk, key_positions, relative_positions, block_q, block_k)[1]


def attention_with_stats(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Window = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    topk: int = 5,
    key_positions: Sequence[int] = (0,),
    relative_positions: Sequence[int] = (-1, 0),
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    score_mod: Any = None,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, AttentionStats]:
    """The attention output and the statistics of its weights, from one tiled pass.

    Shapes::

        query (..., Hq, Nq, D)   key (..., Hk, Nk, D)   value (..., Hk, Nk, Dv)
        →     out (..., Hq, Nq, Dv),  AttentionStats with (..., Hq, Nq[, ·]) arrays and its lse

    The pass of :func:`attention_stats` without an lse, with ``P·V`` accumulated from the same
    tiles: one score matmul, one exponential pass and one ``P·V`` matmul per tile, so the
    statistics cost little more than the forward pass alone, where computing them after it
    (``attention_stats(q, k, lse=lse)``) repeats the score matmul. Arguments mean what they
    mean in :func:`qkv.attention` and :func:`attention_stats`; no dropout, no gradient.
    ``out`` is as exact as ``qkv.attention``'s (the accuracy rule of the tests), in the query's
    dtype (16-bit inputs are computed in float32).
    """
    if topk < 0:
        raise ValueError(f"topk={topk} must be >= 0")
    block_q, block_k = check_tile_size("block_q", block_q), check_tile_size("block_k", block_k)
    call = validate(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, window=window,
                    key_padding_mask=key_padding_mask, score_mod=score_mod, sinks=sinks)  # fmt: skip
    out, stats = _tiled_stats(call, None, False, topk, key_positions, relative_positions, block_q, block_k, with_output=True)
    assert out is not None and stats.lse is not None
    if overflowed_float32(call, out):
        # scores beyond float32's range (qkv.overflow): the same pass in float64, rounded back
        exact, stats = _tiled_stats(call.in_float64(), None, False, topk, key_positions, relative_positions, block_q, block_k, with_output=True)
        assert exact is not None
        out, stats = exact.to(out.dtype), _float_arrays_in(stats, torch.float32)  # (float32 statistics, as the pass keeps them)
    # qkv.attention's rule for non-finite inputs (qkv.nonfinite), for the statistics too
    out, lse = follow_rule(call, out, stats.lse)
    assert lse is not None
    bad = torch.isnan(lse) & ~torch.isnan(stats.lse)
    if bool(bad.any()):
        names = AttentionStats.ARRAYS + (() if stats.sink_share is None else ("sink_share",))
        _nan_rows({name: getattr(stats, name) for name in names}, bad)
    stats.lse = lse
    return out, stats


def _float_arrays_in(stats: AttentionStats, dtype: torch.dtype) -> AttentionStats:
    """``stats`` with its float arrays (and lse, sink share) in ``dtype``; indices and counts kept."""
    cast = {name: getattr(stats, name) for name in (*AttentionStats.ARRAYS, "lse", "sink_share")}
    return dataclasses.replace(stats, **{n: t.to(dtype) for n, t in cast.items() if t is not None and t.is_floating_point()})


@torch.no_grad()  # statistics are not differentiable: no graph through the tiles, sinks or score tensors
def _tiled_stats(
    call: Any, lse: Optional[torch.Tensor], check_lse: bool, topk: int, key_positions: Sequence[int],
    relative_positions: Sequence[int], block_q: Optional[int], block_k: Optional[int], with_output: bool = False,
) -> tuple[Optional[torch.Tensor], AttentionStats]:  # fmt: skip
    """The tiled pass of :func:`attention_stats` (and, ``with_output``, of :func:`attention_with_stats`)."""
    check = lse is not None and check_lse
    online = lse is None  # one pass: the lse is found on the way, with every sum rescaled as the row maximum grows
    lse_g = None if online else grouped_lse(call, lse, check=check)
    kpos = _positions(key_positions, call.nk, "key_positions") if call.nk else ()
    rel = tuple(int(r) for r in relative_positions)
    q, k, v = call.grouped_qkv()  # (B, Hk, G, Nq, D), (B, Hk, 1, Nk, D), (B, Hk, 1, Nk, Dv)
    q, k, v = half_to_float(q), half_to_float(k), half_to_float(v)
    b, hk, g, nq, _ = q.shape
    out_g = torch.zeros(b, hk, g, nq, call.dv, dtype=q.dtype, device=q.device) if with_output else None
    sinks_g = None if call.sinks is None else grouped_sinks(call.sinks, hk, g).to(q.dtype)  # (1, Hk, G, 1)
    kk = min(topk, call.nk)
    new = lambda *tail, fill=0.0, dtype=q.dtype: torch.full((b, hk, g, nq, *tail), fill, dtype=dtype, device=q.device)  # noqa: E731
    res = {
        "entropy": new(),
        "max_weight": new(fill=_NEG_INF),  # log2 of the largest weight until the end
        "topk_weights": new(kk, fill=_NEG_INF),  # log2 weights until the end
        "topk_indices": new(kk, fill=-1, dtype=torch.long),
        "mean_distance": new(),
        "key_weights": new(len(kpos)),
        "relative_weights": new(len(rel)),
        "n_keys": new(fill=0, dtype=torch.long),
        "total": new(),  # Σp per row: 1 when the lse belongs to these scores
    }
    tiles = MaskTiles.from_call(call)
    fused = call.nk and nq and stats_native.fused_pass(
        q, k, v if with_output else None, lse_g, tiles, call.scale, kpos, rel, res, out_g,
        block_q or FUSED_BLOCK_Q, block_k or STATS_BLOCK_K,
    )  # fmt: skip
    if fused:
        _normalise(out_g, res["total"], out_g, 0, nq)
    if call.nk and nq and not fused:
        bq, bk, per_group = plan_tiles(b, hk, g, nq, call.nk, block_q, block_k or STATS_BLOCK_K)
        if stats_native.tile_kernel(q) is not None:
            per_group = max(1, NATIVE_TILE_BUDGET // (g * bq * bk))
        for bs, hs in head_groups(b, hk, per_group):
            _stats_heads(
                q[bs, hs], k[bs, hs], None if online else lse_g[bs, hs].to(q.dtype), tiles.narrow(bs, hs), call.scale,
                bq, bk, kpos, rel, {name: t[bs, hs] for name, t in res.items()},
                None if out_g is None else v[bs, hs], None if out_g is None else out_g[bs, hs],
            )  # fmt: skip
    if check:
        flat = lambda t: t.reshape(b, hk * g, nq)  # noqa: E731  (B, Hq, Nq): head hk·G + g
        share = sink_share(sinks_g, lse_g.to(q.dtype))  # the rows' weights sum to 1 - share
        check_row_sums(flat(res["total"]), flat(res["n_keys"] > 0), flat(lse_g.to(q.dtype)), lse_g.dtype,
                       share=None if share is None else flat(share))  # fmt: skip
    ent, max_w, top_w, lse_out, nan = _finish_online(res) if online else _finish_given(res)
    out = _final_arrays(res, ent, max_w, top_w)
    if lse_out is not None:
        out["lse"] = lse_out
    if sinks_g is not None:
        _with_sinks(out, sinks_g, lse_g, out_g)
    _nan_rows(out, nan)  # a NaN score makes the row's maximum NaN
    if not surely_finite(q, k):  # qkv.nonfinite: a bad row's n_keys is what its masks allow
        bad = ~torch.isfinite(q).all(-1) | ~torch.isfinite(k).flatten(2).all(-1)[:, :, None, None]  # (B, Hk, G, Nq)
        out["n_keys"] = torch.where(bad, _mask_counts(tiles, bad.shape), out["n_keys"])
    out = {name: call.ungroup(t) for name, t in out.items()}  # (..., Hq, Nq[, ·])
    stats = AttentionStats(
        **out,
        key_positions=kpos,
        relative_positions=rel,
        query_offset=call.positional.offset,
        meta={"nq": call.nq, "nk": call.nk, "hq": call.hq, "hk": call.hk, "causal": call.causal, "window": call.window},
    )
    return (None if out_g is None else call.ungroup(out_g.to(call.dtype))), stats


def _finish_online(res: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(entropy, max weight, top-k weights, lse, NaN rows) from one pass's sums, which hold
    ``2^(s - m)`` with ``m`` the row maximum (log2 units): normalised by ``l = Σ 2^(s - m)``.
    Rescales the other weighted sums in ``res`` in place."""
    l, m = res["total"], res["max_weight"]
    has = l > 0
    inv = torch.where(has, 1.0 / torch.where(has, l, torch.ones_like(l)), torch.zeros_like(l))
    log2_l = torch.where(has, torch.log2(torch.where(has, l, torch.ones_like(l))), torch.zeros_like(l))
    lse2 = torch.where(has, m + log2_l, torch.full_like(m, _NEG_INF))  # log2-sum-exp2 of the row
    ent = (log2_l - res["entropy"] * inv).mul_(LN2)  # H = ln2 · (log2 l - Σ p̃ (s - m) / l)
    ent = torch.where(has, ent, torch.zeros_like(ent))
    max_w = torch.where(has, inv, torch.zeros_like(inv))  # the largest p̃ is 2^0 = 1
    top_w = torch.exp2(res["topk_weights"] - lse2.unsqueeze(-1).masked_fill(~has.unsqueeze(-1), 0.0))
    res["mean_distance"].mul_(inv)
    res["key_weights"].mul_(inv.unsqueeze(-1))
    res["relative_weights"].mul_(inv.unsqueeze(-1))
    return ent, max_w, top_w, lse2 * LN2, torch.isnan(m)


def _finish_given(res: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """(entropy, max weight, top-k weights, None, NaN rows) from sums of ``log2 p`` under a given lse."""
    ent = res["entropy"].mul_(-LN2)
    max_w, top_w = torch.exp2(res["max_weight"]), torch.exp2(res["topk_weights"])
    return ent, max_w, top_w, None, torch.isnan(res["max_weight"])


def _final_arrays(res: dict[str, torch.Tensor], ent: torch.Tensor, max_w: torch.Tensor, top_w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The statistics' arrays, grouped ``(B, Hk, G, Nq[, ·])``; ``ent`` clamped at 0 in place."""
    ent.masked_fill_(ent < 0, 0.0)  # -0.0 and rounding below 0 on one-key rows
    return dict(
        entropy=ent,
        max_weight=max_w,
        topk_weights=top_w,
        topk_indices=res["topk_indices"].masked_fill_(torch.isneginf(res["topk_weights"]), -1),
        mean_distance=res["mean_distance"],
        key_weights=res["key_weights"],
        relative_weights=res["relative_weights"],
        n_keys=res["n_keys"],
    )


def _stats_heads(
    q: torch.Tensor, k: torch.Tensor, lse: Optional[torch.Tensor], tiles: MaskTiles, scale: float, bq: int, bk: int,
    kpos: tuple[int, ...], rel: tuple[int, ...], res: dict[str, torch.Tensor],
    v: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
) -> None:  # fmt: skip
    """One head group: q ``(b, h, G, Nq, D)``, k ``(b, h, 1, Nk, D)``, lse ``(b, h, G, Nq)``; fills ``res`` views.

    With ``v`` ``(b, h, 1, Nk, Dv)`` (one pass only) the tiles' weights also accumulate ``P·V``,
    rescaled with the sums, and ``out`` ``(b, h, G, Nq, Dv)`` receives the attention output.

    With ``lse`` every tile is ``log2 p`` directly. Without it (one pass) a tile holds
    ``log2 p̃ = s·log2e - m`` for the row's running maximum ``m`` (``res["max_weight"]``), and
    when ``m`` grows by ``δ`` every sum is rescaled by ``2^-δ`` — the entropy sum
    ``Σ p̃ (s - m)`` also gains ``-δ·l`` — exactly as the online softmax rescales its output.
    """
    b, h, g, nq, _ = q.shape
    dev, dt = q.device, q.dtype
    off = tiles.positional.offset
    online = lse is None
    fused = stats_native.tile_kernel(q)
    scored = tiles.score is not None
    q_aug, k_aug, lse2 = _operands(q, k, lse, scale, scored, fused is not None)
    # j - k0 within a tile; a matrix-vector product, not a 2-column matmul (BLAS is 4x slower on those)
    cols = torch.arange(bk, dtype=dt, device=dev)  # (bk,)
    kk = res["topk_indices"].shape[-1]
    for q0 in range(0, nq, bq):
        q1 = min(nq, q0 + bq)
        n = q1 - q0
        qa = q_aug[:, :, :, q0:q1]
        pos = torch.arange(q0 + off, q1 + off, device=dev)  # (n,) key position of each query row
        ent, dist = res["entropy"][..., q0:q1], res["mean_distance"][..., q0:q1]  # views: accumulate in place
        mx, cnt, tot = res["max_weight"][..., q0:q1], res["n_keys"][..., q0:q1], res["total"][..., q0:q1]
        # contiguous top-k buffers for this row block, so rows can be updated through flat views
        topv = torch.full((b, h, g, n, kk), _NEG_INF, dtype=dt, device=dev)
        topi = torch.full((b, h, g, n, kk), -1, dtype=torch.long, device=dev)
        flat_v, flat_i = topv.view(b * h * g * n, kk), topi.view(b * h * g * n, kk)
        kw, rw = res["key_weights"][..., q0:q1, :], res["relative_weights"][..., q0:q1, :]
        num = None if v is None else torch.zeros(b, h, g, n, v.shape[-1], dtype=dt, device=dev)  # Σ p̃·v
        if fused is not None:
            _native_row_block(fused, qa, k_aug, None if lse2 is None else lse2[..., q0:q1], tiles, q0, q1, bk, off, online,
                              kpos, rel, (mx, cnt, tot, ent, dist, kw, rw), topv, topi, v, num)  # fmt: skip
            res["topk_weights"][..., q0:q1, :] = topv
            res["topk_indices"][..., q0:q1, :] = topi
            _normalise(num, res["total"][..., q0:q1], out, q0, q1)
            continue
        first_k = None
        for k0, k1 in key_blocks(tiles, q0, q1, bk):
            first_k = k0 if first_k is None else first_k
            w = k1 - k0
            sub = lse2[..., q0:q1] if scored and not online else None
            t, masked = _tile_scores(qa, k_aug, tiles, q0, q1, k0, k1, sub)  # (b, h, G, n, w) = log2 p
            if masked:
                cnt += (t != _NEG_INF).sum(-1)  # float -inf biases mask as bool masks do
            else:
                cnt += w
            c, cmax, tmax = _tile_maxima(t, kk)
            if kk:
                # (Online, the values are s·log2e: shifted to weights at the end.)
                thr = topv[..., -1].reshape(-1)
                first = k0 == first_k or bool(torch.isneginf(thr).any())
                _merge_tile(flat_v, flat_i, t.view(-1, w), cmax.reshape(-1, w // c), thr, k0, first)
            if online:
                t.sub_(_rescale_online(mx, tmax, (tot, dist, kw, rw, num), ent).unsqueeze(-1))
            else:
                mx.copy_(torch.maximum(mx, tmax))
            p = torch.exp2(t)
            if num is not None:
                num += p @ v[..., k0:k1, :]
            pt = p * t
            if masked:
                pt.nan_to_num_(nan=0.0)  # masked keys: 0 · -inf (NaN inputs: restored after the pass)
            ent += pt.sum(-1)
            _position_sums(p, pos, cols, q0, q1, k0, k1, off, kpos, rel, (dist, tot, kw, rw))
        res["topk_weights"][..., q0:q1, :] = topv
        res["topk_indices"][..., q0:q1, :] = topi
        _normalise(num, res["total"][..., q0:q1], out, q0, q1)


def _operands(
    q: torch.Tensor, k: torch.Tensor, lse: Optional[torch.Tensor], scale: float, scored: bool, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:  # fmt: skip
    """(q_aug, k_aug, lse2) of one head group: the operands whose product is a tile in log2 units,
    and the lse in log2 units where it is subtracted from a tile rather than folded into it."""
    online = lse is None
    lse2 = None
    if scored:
        # the score function's contract is natural units: tiles are q·scale·kᵀ, taken to log2 units
        # after it (_tile_scores), and a given lse is subtracted there
        q_aug, k_aug = q * scale, k.transpose(-1, -2)
        if not online:
            lse2 = lse * LOG2E if fused else (lse * LOG2E).masked_fill(torch.isneginf(lse), 0.0)
    elif online or fused:
        q_aug = q * (scale * LOG2E)  # (b, h, G, Nq, D): q_aug·kᵀ = s·log2e
        k_aug = k.transpose(-1, -2)  # (b, h, 1, D, Nk)
        if not online:
            lse2 = lse * LOG2E  # the kernel subtracts it: log2 p = s·log2e - lse·log2e
    else:
        lse2 = (lse * LOG2E).masked_fill(torch.isneginf(lse), 0.0)  # empty rows: every score is -inf anyway
        q_aug = torch.cat([q * (scale * LOG2E), -lse2.unsqueeze(-1)], dim=-1)  # (b, h, G, Nq, D+1)
        k_aug = augment(k, 1.0).transpose(-1, -2)  # (b, h, 1, D+1, Nk): [k, 1]ᵀ so q_aug·k_aug = log2 p
    return q_aug, k_aug, lse2


def _rescale_online(
    mx: torch.Tensor, tmax: torch.Tensor, sums: tuple[Optional[torch.Tensor], ...], ent: torch.Tensor
) -> torch.Tensor:  # fmt: skip
    """Raise the rows' running maxima ``mx`` ``(b, h, G, n)`` to cover a tile's ``tmax``, rescaling
    every running sum (``ent``, the entropy sum ``Σ p̃ (s - m)``, also re-centred) by ``2^-δ``
    where a maximum moved by ``δ``; returns the shift to subtract from the tile."""
    tot = sums[0]
    new = torch.maximum(mx, tmax)
    shift = new.masked_fill(torch.isneginf(new), 0.0)  # rows with no key yet: nothing to shift
    delta = (mx - shift).masked_fill_(torch.isneginf(mx), 0.0)  # ≤ 0: how far the maximum moved
    if bool((delta < 0).any()):
        alpha = torch.exp2(delta)
        ent.add_(delta * tot).mul_(alpha)  # Σ p̃ (s - m) re-centred on the new maximum
        for t in sums:
            if t is not None:
                t.mul_(alpha if t.dim() == alpha.dim() else alpha.unsqueeze(-1))
    mx.copy_(new)
    return shift


def _tile_maxima(t: torch.Tensor, kk: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(c, the maxima of the tile's c key chunks ``(b, h, G, n, w/c)``, the row maxima ``(b, h, G, n)``)
    for a tile ``t`` ``(b, h, G, n, w)``; c = 1 (no chunks) unless the top-k merge gains from them."""
    b, h, g, n, w = t.shape
    c = TOPK_CHUNK if kk and w % TOPK_CHUNK == 0 and w // TOPK_CHUNK >= kk else 1
    if c > 1:
        # chunk r holds keys r, r + w/c, r + 2w/c, …: the reduction runs across rows of the
        # (c, w/c) view, vectorised along its contiguous last dimension
        cmax = t.view(b, h, g, n, c, w // c).amax(-2)  # (b, h, G, n, w/c): the maxima of key chunks
        return c, cmax, cmax.amax(-1)
    return c, t, t.amax(-1)


def _position_sums(
    p: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor, q0: int, q1: int, k0: int, k1: int, off: int,
    kpos: tuple[int, ...], rel: tuple[int, ...], sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:  # fmt: skip
    """Add one tile's weights ``p`` ``(b, h, G, n, w)`` to the rows' distance sum, total, weights at
    the given key positions and at the given offsets from each query (``sums``, in place)."""
    dist, tot, kw, rw = sums
    b, h, g, n, w = p.shape
    dev, dt = p.device, p.dtype
    if k1 - 1 <= q0 + off or k0 >= q1 - 1 + off:
        # every key of the tile on one side of every query: |pos - j| is linear in j
        sp, spj = p.sum(-1), p @ cols[:w]  # (b, h, G, n): Σp, Σp·(j - k0)
        lin = (pos - k0).to(dt) * sp - spj
        dist += lin if k1 - 1 <= q0 + off else -lin
        tot += sp
    else:
        d = (pos[:, None] - torch.arange(k0, k1, device=dev)[None, :]).abs().to(dt)  # (n, w)
        dist += (p * d).sum(-1)
        tot += p.sum(-1)
    for i, j in enumerate(kpos):
        if k0 <= j < k1:
            kw[..., i] = p[..., j - k0]
    for i, r in enumerate(rel):
        j = pos + r  # (n,) the key at offset r from each query
        inside = (j >= k0) & (j < k1)
        if bool(inside.any()):
            idx = (j - k0).clamp(0, w - 1).view(1, 1, 1, n, 1).expand(b, h, g, n, 1)
            rw[..., i] += p.gather(-1, idx)[..., 0] * inside.to(dt)


def _tile_scores(
    qa: torch.Tensor, k_aug: torch.Tensor, tiles: MaskTiles, q0: int, q1: int, k0: int, k1: int,
    lse2: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, bool]:
    """One tile ``qa · k_augᵀ`` (contiguous ``(b, h, G, n, w)``, log2 units) with the tile's
    float bias added and its disallowed keys at ``-inf``; and whether any key may be ``-inf``.

    With a score function ``qa · k_augᵀ`` is ``s = q·kᵀ·scale`` (natural units): the tile is then
    ``(score_mod(s) + bias)·log2e``, less ``lse2`` ``(b, h, G, n)`` when given."""
    allowed, bias = tiles.tile(q0, q1, k0, k1)
    t = qa @ k_aug[..., k0:k1]
    if tiles.score is not None:
        t = tiles.score.apply(t, q0, k0)  # out of place: the function may return a view or its input
        if bias is not None:
            t = t + bias
        t = t * LOG2E if lse2 is None else t * LOG2E - lse2.unsqueeze(-1)
    elif bias is not None:
        t.add_(bias, alpha=LOG2E)  # the bias in log2 units
    if allowed is not None:
        t.masked_fill_(~allowed, _NEG_INF)
    # a score function may itself send a key to -inf
    return t, allowed is not None or bias is not None or tiles.score is not None


def _with_sinks(out: dict[str, torch.Tensor], sinks: torch.Tensor, lse: Optional[torch.Tensor],
                output: Optional[torch.Tensor] = None) -> None:
    """Statistics ``out`` (grouped or not; ``sinks`` broadcasts against the rows) made those of
    the weights with the sinks, in place, and ``out["sink_share"]`` added.

    ``lse`` is the caller's, sinks included: the tiles held ``log2 p'`` and only the sink's own
    ``-σ ln σ`` joins the entropy. Without it ``out`` describes the keys alone, with ``out["lse"]``
    theirs: with ``x = sink - lse``, ``σ = sigmoid(x)``, the weights scale by ``1 - σ = sigmoid(-x)``,
    ``H' = (1 - σ)·(H + softplus(x)) + σ·softplus(-x)`` and ``lse' = lse + softplus(x)``; ``output``
    ``(…, Nq, Dv)`` (the attention output) scales by ``1 - σ`` too."""
    if lse is not None:
        share = sink_share(sinks, lse.to(out["entropy"].dtype))
        assert share is not None
        out["entropy"] = out["entropy"] - torch.special.xlogy(share, share)
        out["sink_share"] = share
        return
    keys_lse = out["lse"]
    s = sinks.to(keys_lse.dtype)
    x = torch.where(torch.isneginf(s).expand_as(keys_lse), _NEG_INF, s - keys_lse)  # +inf: a row without keys
    share, keep = torch.sigmoid(x), torch.sigmoid(-x)
    zero = torch.zeros_like(x)

    def softplus(t: torch.Tensor) -> torch.Tensor:  # exact: F.softplus returns t itself past t = 20
        return torch.logaddexp(t, zero)

    ent = keep * out["entropy"]
    ent = ent + torch.where(keep > 0, keep * softplus(x), zero)
    ent = ent + torch.where(share > 0, share * softplus(-x), zero)
    out["entropy"] = ent
    for name in ("max_weight", "mean_distance"):
        out[name] = out[name] * keep
    for name in ("topk_weights", "key_weights", "relative_weights"):
        out[name] = out[name] * keep.unsqueeze(-1)
    if output is not None:
        output.mul_(keep.unsqueeze(-1))
    out["lse"] = torch.where(torch.isposinf(x), s.expand_as(keys_lse), keys_lse + softplus(x))
    out["sink_share"] = share


def _mask_counts(tiles: MaskTiles, shape: torch.Size, rows_per_block: int = 256) -> torch.Tensor:
    """How many keys the masks allow each row (int64 ``shape`` = (B, Hk, G, Nq)), whatever the
    scores; a float ``attn_mask`` entry of ``-inf`` masks like ``False``."""
    nq, nk = tiles.positional.nq, tiles.positional.nk
    counts = torch.full(shape, nk, dtype=torch.long, device=tiles.device)
    for q0 in range(0, nq, rows_per_block):
        q1 = min(nq, q0 + rows_per_block)
        allowed, bias = tiles.tile(q0, q1, 0, nk)
        if bias is not None:
            fin = ~torch.isneginf(bias)
            allowed = fin if allowed is None else allowed & fin
        if allowed is not None:
            counts[..., q0:q1] = allowed.expand(*shape[:3], q1 - q0, nk).sum(-1)
    return counts


def _nan_rows(arrays: dict[str, torch.Tensor], rows: torch.Tensor) -> None:
    """Every statistic of the ``rows`` (bool, the arrays' leading shape) NaN, in place; their
    top-k has no keys (-1); ``n_keys`` stays."""
    for name, t in arrays.items():
        if name != "n_keys":
            t.masked_fill_(rows if t.dim() == rows.dim() else rows.unsqueeze(-1), -1 if name == "topk_indices" else float("nan"))


def _normalise(num: Optional[torch.Tensor], total: torch.Tensor, out: Optional[torch.Tensor], q0: int, q1: int) -> None:
    """out rows ``[q0, q1)`` = Σ p̃·v / Σ p̃ (0 for an empty row, NaN for a NaN row)."""
    if num is not None:
        out[..., q0:q1, :] = num / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)


def _native_row_block(
    kernel: Any, qa: torch.Tensor, k_aug: torch.Tensor, lse2: Optional[torch.Tensor], tiles: MaskTiles, q0: int, q1: int,
    bk: int, off: int, online: bool,
    kpos: tuple[int, ...], rel: tuple[int, ...], views: tuple[torch.Tensor, ...], topv: torch.Tensor, topi: torch.Tensor,
    v: Optional[torch.Tensor] = None, num: Optional[torch.Tensor] = None,
) -> None:  # fmt: skip
    """One row block of :func:`_stats_heads` with each tile's statistics in one C pass
    (:func:`qkv.backends.stats_native.tile_pass`, the same sums as the torch formulation below it).

    ``qa @ k_aug`` is ``s·log2e``; ``lse2`` ``(b, h, G, n)`` the rows' ``lse·log2e`` when given.
    ``views`` are the row block's (mx, cnt, tot, ent, dist, kw, rw) views into the results; the
    kernel works on contiguous copies, written back at the end. With ``v``, the kernel rescales
    ``num`` (contiguous ``(b, h, G, n, Dv)``) with the sums and leaves each tile's ``p̃`` in the
    tile, and ``num += p̃·v`` follows."""
    lse2 = None if lse2 is None else lse2.contiguous()
    acc = [a.contiguous() for a in views]
    n = q1 - q0
    kp = torch.tensor(kpos, dtype=torch.long)
    rp = torch.tensor(clamp_positions(rel, q1 + abs(off), k_aug.shape[-1]), dtype=torch.long)
    dv = 0 if num is None else num.shape[-1]
    for k0, k1 in key_blocks(tiles, q0, q1, bk):
        t, masked = _tile_scores(qa, k_aug, tiles, q0, q1, k0, k1)  # (b, h, G, n, w) in log2 units
        stats_native.tile_pass(kernel, t, q0, k0, k1, off, online, masked, lse2, acc, kp, rp, topv, topi, num)
        if num is not None and dv > 0:  # t now holds p̃ (no value columns: nothing to add)
            vb = v[..., k0:k1, :]  # (b, h, 1, w, Dv)
            if t.shape[2] == 1:
                num.view(-1, n, num.shape[-1]).baddbmm_(t.view(-1, n, k1 - k0), vb.flatten(0, 2))
            else:
                num += t @ vb
    for view, a in zip(views, acc):
        if a.data_ptr() != view.data_ptr():
            view.copy_(a)


def _merge_tile(flat_v: torch.Tensor, flat_i: torch.Tensor, t: torch.Tensor, cmax: torch.Tensor, thr: torch.Tensor,
                k0: int, first: bool) -> None:
    """Merge a tile's entries into the running top-k of every row, in place.

    flat_v/flat_i ``(rows, k)`` descending; t ``(rows, w)`` the tile (keys ``k0…``); cmax
    ``(rows, w/c)`` the maxima of its chunks of ``c`` keys, chunk r holding keys ``r + i·w/c``
    (``cmax is t`` when ``c = 1``); thr
    ``(rows,)`` each row's k-th best so far. Only entries above ``thr`` can enter, and only chunks
    whose maximum beats ``thr`` can hold one, so the search narrows to those chunks before looking
    at single entries: ``torch.topk`` over whole tile rows costs about ten ``exp2`` passes on a
    CPU, a comparison over the chunk maxima a sixteenth of one. On a row block's first tiles ``thr``
    is ``-inf``; there the k-th largest chunk maximum bounds the row's k-th best from below (the k
    largest chunk maxima are k of the tile's entries), and entries under it cannot enter.
    """
    kk = flat_v.shape[1]
    c = t.shape[1] // cmax.shape[1]
    if first and cmax.shape[1] >= kk:  # (a tile narrower than k bounds nothing)
        bound = cmax.topk(kk, dim=-1).values[:, -1]  # (rows,)
        # entries ≥ bound may enter: compare with the float just below it
        thr = torch.maximum(thr, torch.nextafter(bound, torch.full_like(bound, _NEG_INF)))
    rows, chunks = (cmax > thr.unsqueeze(1)).nonzero(as_tuple=True)  # row-major: rows ascending
    if not rows.numel():
        return
    if c > 1:
        stride = cmax.shape[1]
        vals = t.view(t.shape[0], c, stride)[rows, :, chunks]  # (hits, c): keys chunk + stride·i
        hit, within = (vals > thr.index_select(0, rows).unsqueeze(1)).nonzero(as_tuple=True)
        rows, cols, vals = rows.index_select(0, hit), chunks.index_select(0, hit) + within * stride, vals[hit, within]
    else:
        cols, vals = chunks, t[rows, chunks]
    _merge_entries(flat_v, flat_i, rows, cols + k0, vals)


def _merge_entries(flat_v: torch.Tensor, flat_i: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                   vals: torch.Tensor) -> None:
    """Merge entries ``(rows, cols, vals)`` (rows ascending) into the running top-k, in place,
    through one padded ``topk`` over each touched row's old best and its new entries."""
    kk = flat_v.shape[1]
    urows, counts = torch.unique_consecutive(rows, return_counts=True)
    slot = torch.arange(rows.numel(), device=rows.device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    which = torch.repeat_interleave(torch.arange(urows.numel(), device=rows.device), counts)
    width = int(counts.max())
    pad_v = torch.full((urows.numel(), width), _NEG_INF, dtype=vals.dtype, device=vals.device)
    pad_i = torch.full((urows.numel(), width), -1, dtype=flat_i.dtype, device=vals.device)
    pad_v[which, slot] = vals
    pad_i[which, slot] = cols
    best, where = torch.cat([flat_v[urows], pad_v], -1).topk(kk, dim=-1)
    flat_v[urows] = best
    flat_i[urows] = torch.cat([flat_i[urows], pad_i], -1).gather(-1, where)


def _triton_ok(call: Any) -> Optional[str]:
    """Why the triton statistics kernel cannot run this call, or None (sinks are applied after it)."""
    from ..backends import BACKENDS

    if call.score_mod is not None:
        return "its statistics kernel applies no score function"

    tb = BACKENDS["triton"]
    why = tb.available()
    if why is not None:
        return why
    reasons = [r for r in tb.not_supported_reasons(call) if "dropout" not in r and "value" not in r]
    return "; ".join(reasons) or None


@torch.no_grad()
def _triton_stats(call: Any, topk: int, key_positions: Sequence[int], relative_positions: Sequence[int]) -> AttentionStats:
    from ..backends.triton.backend import triton_stats

    kpos = _positions(key_positions, call.nk, "key_positions") if call.nk else ()
    rel = tuple(int(r) for r in relative_positions)
    q, k, _ = call.grouped_qkv()
    kp = call.grouped_key_padding()
    lo, hi = call.positional.band()
    res = triton_stats(q, k, call.grouped_attn_mask(), None if kp is None else kp[:, 0, 0, 0, :], call.scale, lo, hi,
                       call.positional.offset, min(topk, call.nk), kpos, rel)
    if call.sinks is not None:
        _with_sinks(res, grouped_sinks(call.sinks, call.hk, call.group).to(res["entropy"].dtype), None)
    res = {name: call.ungroup(t) for name, t in res.items()}
    return AttentionStats(
        **res, key_positions=kpos, relative_positions=rel, query_offset=call.positional.offset,
        meta={"nq": call.nq, "nk": call.nk, "hq": call.hq, "hk": call.hk, "causal": call.causal, "window": call.window,
              "backend": "triton"},
    )
