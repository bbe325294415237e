"""Exact attention maps for chosen heads and rows, recomputed tile by tile from the log-sum-exp.

Shape legend::

    ...  batch dims (B when flattened)     Hq, Hk  query / key-value heads      G = Hq // Hk
    Nq   query length    Nk  key length    D       head dim
    h    len(heads)      r   len(rows)

A fused forward pass (``qkv.attention(..., return_lse=True)``) yields one number per query row,
``lse = log Σ_j exp(s_j)``. Every weight then follows from its own score alone,
``p_j = exp(s_j - lse)``, so the map of a few rows or heads costs ``r × Nk`` scores and
never the ``Nq × Nk`` matrix. Mask rules are not re-derived here: positional rules come from
:class:`~qkv.masks.rules.PositionalMask`, the other masks from :class:`~qkv.masks.tiles.MaskTiles`.

A score function (``score_mod``, :mod:`qkv.score_mods`) is applied to each tile's scaled scores
before the masks, as every backend applies it, so ``s`` above is the modified score. With
``sinks`` the lse includes the sink (``lse' = log(e^lse + e^sink)``), so ``exp(s - lse')`` are
the weights the model uses: a row sums to ``1 - exp(sink - lse')``, the sink's share.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence, Tuple, Union

import torch

from ..backends.base import half_to_float
from ..call import AttentionCall, BackendName, validate_qk
from ..functional import attention
from ..masks.tiles import MaskTiles
from ..sinks import grouped_sinks

__all__ = ["attention_map", "attention_scores"]

Index = Union[None, int, slice, Sequence[int], torch.Tensor]
Window = Optional[Tuple[Optional[int], Optional[int]]]

BLOCK = 256  # rows and keys per tile: the chunked backend's measured CPU sweet spot


def fused_lse(call: AttentionCall, backend: BackendName = "auto") -> torch.Tensor:
    """Log-sum-exp ``(..., Hq, Nq)`` of every row from one fused forward pass (never ``Nq × Nk``)."""
    if backend == "auto" and call.device.type == "cpu":
        backend = "chunked"  # on a CPU, auto may build a dense mask for masked calls; chunked never does
    _, lse = attention(
        call.query,
        call.key,
        call.value,
        call.attn_mask,
        is_causal=call.alignment if call.causal else False,
        scale=call.scale,
        enable_gqa=call.enable_gqa,
        window=call.window,
        window_alignment=call.window_alignment,
        key_padding_mask=call.key_padding_mask,
        return_lse=True,
        backend=backend,
        score_mod=call.score_mod,
        sinks=call.sinks,
    )
    return lse


_LSE_HINT = "pass the lse returned by qkv.attention(..., return_lse=True) for the same call"


def grouped_lse(call: AttentionCall, lse: torch.Tensor, check: bool = True) -> torch.Tensor:
    """The caller's lse ``(..., Hq, Nq)`` → the grouped layout ``(B, Hk, G, Nq)``, after checking it.

    Checked here: type, floating dtype, device, shape and, with ``check``, no NaN and no +inf
    (one pass over ``Hq·Nq`` numbers). Whether it belongs to these scores is checked where the
    weights are computed (:func:`check_row_sums`).
    """
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor; {_LSE_HINT} (got {type(lse).__name__})")
    if not lse.is_floating_point():
        raise TypeError(f"lse has dtype {lse.dtype} but a log-sum-exp is floating point; {_LSE_HINT}")
    if lse.device != call.device:
        raise ValueError(
            f"lse is on {lse.device} but query is on {call.device}; {_LSE_HINT}, or move it with lse.to(query.device)"
        )
    want = (call.nq,) if call.query.dim() == 2 else (*call.batch_shape, call.hq, call.nq)
    try:
        full = lse.expand(*want)
    except RuntimeError:
        raise ValueError(f"lse has shape {tuple(lse.shape)} but this call needs (..., Hq, Nq) = {want}; {_LSE_HINT}") from None
    for bad, what in ((torch.isnan, "NaN"), (torch.isposinf, "+inf")) if check else ():
        n = int(bad(lse).sum())
        if n:
            raise ValueError(
                f"lse holds {what} in {n} of its {lse.numel()} values; a log-sum-exp is finite, or -inf for a row "
                f"with no key to attend to (NaN also comes from NaN in query or key); {_LSE_HINT}"
            )
    b = int(torch.Size(call.batch_shape).numel())
    return full.reshape(b, call.hk, call.group, call.nq)


def sink_share(sinks: Optional[torch.Tensor], lse: torch.Tensor) -> Optional[torch.Tensor]:
    """``exp(sink - lse')``: the share of each row's attention that its sink takes, for an lse
    that includes the sink (``sinks`` broadcasting against ``lse``); 0 for a ``-inf`` sink, and at
    most 1 (an lse below its sink belongs to another call; the row-sum check says so)."""
    if sinks is None:
        return None
    s = sinks.to(lse.dtype)
    none = torch.isneginf(s).expand_as(lse) | torch.isneginf(lse)
    return torch.where(none, torch.zeros_like(lse), torch.exp(torch.where(none, 0.0, (s - lse).clamp(max=0.0))))


def check_row_sums(
    total: torch.Tensor,
    live: torch.Tensor,
    lse: torch.Tensor,
    lse_dtype: torch.dtype,
    heads: Optional[torch.Tensor] = None,
    rows: Optional[torch.Tensor] = None,
    share: Optional[torch.Tensor] = None,
) -> None:
    """Raise when a row that may attend some key has weights ``exp(s - lse)`` summing far from 1
    (far from ``1 - share`` with sinks: ``share`` is :func:`sink_share`, ``(B, h, r)``).

    ``total``, ``live`` (the row has an allowed key) and ``lse`` are ``(B, h, r)``; ``heads`` and
    ``rows`` map positions to the caller's indices (default: the positions themselves). A wrong
    lse scales every weight of its row by ``exp(lse_true - lse)``, so ``|ln Σp|`` is the error.
    The tolerance covers an lse from another backend (TF32 products on a GPU: ~1e-3 of the
    logits) and the lse's own dtype; a NaN sum (NaN inputs) is left to show in the result.
    """
    if share is not None:
        total = total + share
    tol = 0.02 + (2e-3 + torch.finfo(lse_dtype).eps) * lse.abs()
    bad = live & ((total.log().abs() > tol) | ~torch.isfinite(lse))
    if bool(bad.any()):
        b, h, r = bad.nonzero()[0].tolist()
        head = h if heads is None else int(heads[h])
        row = r if rows is None else int(rows[r])
        raise ValueError(
            f"lse does not belong to this query/key/mask: in {int(bad.sum())} row(s) the weights exp(score - lse) "
            f"sum far from 1 (batch {b}, head {head}, row {row}: sum {float(total[b, h, r]):.4g} with lse "
            f"{float(lse[b, h, r]):.4g}); {_LSE_HINT}, with the same masks, scale, enable_gqa, score_mod and sinks"
        )


def as_index(sel: Index, n: int, what: str) -> torch.Tensor:
    """heads=/rows= argument → a long tensor of indices in ``[0, n)`` (negative ones count from the end)."""
    if sel is None:
        return torch.arange(n)
    if isinstance(sel, slice):
        return torch.arange(n)[sel]
    idx = torch.as_tensor(sel, dtype=torch.long).reshape(-1)
    if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
        raise IndexError(f"{what}={sel!r} is out of range: there are {n} {what} (valid indices {-n}..{n - 1})")
    return torch.where(idx < 0, idx + n, idx)


class _Selection:
    """Mask tiles of one call cut to chosen query heads and arbitrary (not necessarily contiguous) rows.

    Output layout ``(B|1, h|1, r, bk)``; masks are sliced per tile, never built whole.
    """

    def __init__(self, call: AttentionCall, heads: torch.Tensor) -> None:
        self.tiles = MaskTiles.from_call(call)
        self.heads = heads
        self.kv_of = heads // call.group  # key/value head of each chosen query head
        self.g_of = heads % call.group  # its index inside the group

    def score(self, s: torch.Tensor, rows: torch.Tensor, k0: int) -> torch.Tensor:
        """The call's score function on a tile ``s (B, h, r, bk)`` of chosen heads and rows (or s)."""
        bound = self.tiles.score
        if bound is None:
            return s
        dev = s.device
        b, h, r, w = s.shape
        batch = torch.arange(b, device=dev).view(b, 1, 1, 1)
        head = self.heads.to(dev).view(1, h, 1, 1)  # query head indices, as the contract has them
        qi = rows.to(dev).view(1, 1, r, 1)
        ki = torch.arange(k0, k0 + w, device=dev).view(1, 1, 1, w)
        return bound.evaluate(s, batch, head, qi, ki)

    def heads_of(self, t: torch.Tensor) -> torch.Tensor:
        """``(B|1, Hk|1, G|1, ...)`` → ``(B|1, h|1, ...)`` picking the chosen heads."""
        if t.shape[1] == 1 and t.shape[2] == 1:
            return t[:, 0]
        hi = self.kv_of if t.shape[1] > 1 else torch.zeros_like(self.kv_of)
        gi = self.g_of if t.shape[2] > 1 else torch.zeros_like(self.g_of)
        return t[:, hi, gi]

    def key_blocks(self, r_lo: int, r_hi: int, bk: int) -> Iterator[tuple[int, int]]:
        """Key tiles that rows in ``[r_lo, r_hi)`` may see (a tile empty for the span is empty for any subset)."""
        pm = self.tiles.positional
        k_lo, k_hi = pm.key_range(r_lo, r_hi)
        for k0 in range(k_lo, k_hi, bk):
            k1 = min(k_hi, k0 + bk)
            if pm.block_status(r_lo, r_hi, k0, k1) != "empty":
                yield k0, k1

    def tile(self, rows: torch.Tensor, r_lo: int, r_hi: int, k0: int, k1: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(allowed bool, additive bias), each None or broadcastable to ``(B, h, r, k1-k0)``."""
        pm, dev = self.tiles.positional, self.tiles.device
        allowed = None
        if not pm.trivial and pm.block_status(r_lo, r_hi, k0, k1) != "full":
            allowed = pm.allowed(rows.to(dev)[:, None], torch.arange(k0, k1, device=dev)[None, :])  # (r, bk)
        bias = None
        if self.tiles.padding is not None:
            kp = self.tiles.padding[:, 0, 0, :, k0:k1].unsqueeze(1)  # (B|1, 1, 1, bk)
            allowed = kp if allowed is None else allowed & kp
        if self.tiles.attn is not None:
            a = self.tiles.attn[..., k0:k1].index_select(-2, rows.to(dev))  # (B|1, Hk|1, G|1, r, bk)
            a = self.heads_of(a)  # (B|1, h|1, r, bk)
            if a.dtype == torch.bool:
                allowed = a if allowed is None else allowed & a
            else:
                bias = a
        return allowed, bias


def _walk(
    call: AttentionCall,
    heads: torch.Tensor,
    rows: torch.Tensor,
    lse: Optional[torch.Tensor],
    block: int,
    check: bool = False,
) -> torch.Tensor:
    """Scores (``lse`` None) or weights ``(B, h, r, Nk)`` in the compute dtype, tile by tile.

    ``check``: raise if the rows' weights do not sum to 1 (a caller's lse that belongs to another call).
    """
    sel = _Selection(call, heads)
    q, k, _ = call.grouped_qkv()  # (B, Hk, G, Nq, D), (B, Hk, 1, Nk, D)
    q, k = half_to_float(q), half_to_float(k)
    qh = sel.heads_of(q)  # (B, h, Nq, D): a copy of the chosen heads only
    kh = k[:, sel.kv_of, 0]  # (B, h, Nk, D)
    b, nh, nr = q.shape[0], heads.numel(), rows.numel()
    sink_h = None if call.sinks is None else grouped_sinks(call.sinks, call.hk, call.group)  # (1, Hk, G, 1)
    fill = 0.0 if lse is not None else float("-inf")  # keys no row may see: weight 0 / score -inf
    out = q.new_full((b, nh, nr, call.nk), fill)
    if lse is not None:
        lh = sel.heads_of(lse.to(q.dtype))  # (B, h, Nq)
        # empty rows (lse -inf): +inf makes every exp(s - lse) exactly 0
        lh = torch.where(torch.isneginf(lh), torch.full_like(lh, float("inf")), lh)
        rowmax = q.new_full((b, nh, nr), float("-inf"))  # largest allowed score: > -inf iff the row has a key
    bq = max(1, block)
    for r0 in range(0, nr, bq):
        r = rows[r0 : r0 + bq]
        r_lo, r_hi = int(r.min()), int(r.max()) + 1
        qr = qh[:, :, r.to(q.device)] * call.scale  # (B, h, r, D)
        for k0, k1 in sel.key_blocks(r_lo, r_hi, max(1, block)):
            s = sel.score(qr @ kh[:, :, k0:k1].transpose(-1, -2), r, k0)  # (B, h, r, bk)
            allowed, bias = sel.tile(r, r_lo, r_hi, k0, k1)
            if bias is not None:
                s = s + bias
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf"))
            if lse is not None:
                if check:
                    m = rowmax[:, :, r0 : r0 + r.numel()]
                    torch.maximum(m, s.amax(-1), out=m)
                s = torch.exp(s - lh[:, :, r.to(q.device), None])
            out[:, :, r0 : r0 + r.numel(), k0:k1] = s
    if lse is not None and check:
        lr = sel.heads_of(lse)[:, :, rows.to(q.device)]  # (B, h, r) as the caller gave it
        share = None if sink_h is None else sink_share(sel.heads_of(sink_h), lr.to(q.dtype))
        check_row_sums(out.sum(-1), rowmax > float("-inf"), lr.to(q.dtype), lse.dtype, heads, rows, share)
    return out


def _finish(call: AttentionCall, out: torch.Tensor) -> torch.Tensor:
    """``(B, h, r, Nk)`` → ``(..., h, r, Nk)`` in the caller's batch dims and dtype."""
    if call.query.dim() == 2:
        return out.reshape(out.shape[-2:]).to(call.dtype)
    return out.reshape(*call.batch_shape, *out.shape[1:]).to(call.dtype)


def attention_map(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    heads: Index = None,
    rows: Index = None,
    lse: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Window = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    block: int = BLOCK,
    check_lse: bool = True,
    score_mod: Any = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact softmax weights of chosen heads and query rows, without the ``Nq × Nk`` matrix.

    Shapes::

        query (..., Hq, Nq, D)   key (..., Hk, Nk, D)   lse (..., Hq, Nq) (optional)
        →     (..., h, r, Nk)    h = len(heads) (default all Hq), r = len(rows) (default all Nq)

    Mask arguments mean what they mean in :func:`qkv.attention`. ``lse`` is the log-sum-exp
    that ``qkv.attention(..., return_lse=True)`` returned for the same call; without it one
    fused forward pass computes it. Each weight is then ``exp(s - lse)``, computed in tiles of
    ``block`` rows × ``block`` keys, so only the requested ``r × Nk`` weights are ever stored.
    Masked keys and fully masked rows weigh 0. ``heads``/``rows`` take an int, a slice, a
    sequence or a tensor of indices (negative ones count from the end). ``score_mod`` and
    ``sinks`` mean what they mean in :func:`qkv.attention`: the weights are those it uses (with
    sinks a row sums to less than 1, and a given lse must include them, as ``qkv.attention``'s does).

    A given ``lse`` is checked: dtype, device, shape, no NaN/+inf, and — as the chosen rows are
    computed — that each row's weights sum to 1 (else ``ValueError``: the lse is another call's).
    ``check_lse=False`` keeps the first four only, for an lse computed from these very tensors
    (:func:`~qkv.inspect.record` does so: NaN from a diverged model is recorded, not raised).
    """
    call = validate_qk(query, key, attn_mask, is_causal, scale, enable_gqa, window, key_padding_mask,
                       score_mod=score_mod, sinks=sinks)  # fmt: skip
    check = lse is not None and check_lse
    lse_g = grouped_lse(call, fused_lse(call) if lse is None else lse, check=check)
    h, r = as_index(heads, call.hq, "heads"), as_index(rows, call.nq, "rows")
    return _finish(call, _walk(call, h, r, lse_g, block, check=check))


def attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    heads: Index = None,
    rows: Index = None,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Window = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    block: int = BLOCK,
    score_mod: Any = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The scaled, masked scores ``score_mod(q·kᵀ·scale) + bias`` (``-inf`` where masked) of chosen heads and rows.

    Shapes as :func:`attention_map`: ``(..., h, r, Nk)``; no log-sum-exp is needed. ``sinks`` do
    not change the scores (they are accepted, and checked, so that one call's arguments fit both).
    """
    call = validate_qk(query, key, attn_mask, is_causal, scale, enable_gqa, window, key_padding_mask,
                       score_mod=score_mod, sinks=sinks)  # fmt: skip
    h, r = as_index(heads, call.hq, "heads"), as_index(rows, call.nq, "rows")
    return _finish(call, _walk(call, h, r, None, block))
