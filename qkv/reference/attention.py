"""The float64 oracle: scaled dot-product attention written out step by step in NumPy.

Shapes (``...`` = any batch dims)::

    q    (..., Hq, Nq, D)     k    (..., Hk, Nk, D)     v   (..., Hk, Nk, Dv)
    out  (..., Hq, Nq, Dv)    lse  (..., Hq, Nq)

Semantics are identical to :func:`qkv.attention` (see that docstring): boolean masks are
True where a query may attend; float masks are added to the scaled scores; a query row with
nothing to attend to yields output 0 and log-sum-exp ``-inf``. Non-finite inputs are never
hidden: a row is NaN (output and lse) when its query holds a NaN or an infinity, or when any
key or value of its (batch, key/value head) does.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np

from ..masks.rules import CausalArg, PositionalMask, WindowArg, parse_alignment, parse_causal, parse_window


def as_float64(x: Any, name: str = "array") -> np.ndarray:
    """Any array-like (NumPy, nested lists, torch tensors on any device) → float64 ndarray."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
        x = x.detach().cpu()
        if hasattr(x, "double"):
            x = x.double()
        x = x.numpy()
    try:
        arr = np.asarray(x)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"{name} must be a rectangular array of numbers: {e}") from None
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        kind = "text" if arr.dtype.kind in "US" else f"{arr.dtype} values"
        raise TypeError(f"{name} must hold numbers, got {kind} (e.g. {arr.flat[0]!r}); pass a float array, "
                        "(row labels go in qkv.trace's tokens=)")
    return arr.astype(np.float64, copy=False)


def _as_bool(x: Any) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=bool)


def causal_bias_alignment(attn_mask: Any) -> Optional[str]:
    """The alignment of a ``torch.nn.attention.bias.CausalBias`` mask, or None for anything else.

    Duck-typed so that this module never imports torch.
    """
    variant = getattr(attn_mask, "variant", None)
    if variant is None or not hasattr(attn_mask, "seq_len_kv"):
        return None
    name = str(getattr(variant, "name", variant)).lower()  # CausalVariant.UPPER_LEFT / LOWER_RIGHT
    return "bottom_right" if "lower_right" in name else "top_left"


def positional_mask(
    nq: int, nk: int, is_causal: CausalArg = False, window: Any = None, window_alignment: Optional[str] = None
) -> Optional[np.ndarray]:
    """Boolean ``(Nq, Nk)`` matrix of allowed pairs, or None when nothing is masked."""
    causal, alignment = parse_causal(is_causal)
    pm = PositionalMask(nq, nk, causal, parse_window(window), alignment, parse_alignment(window_alignment))
    if pm.trivial:
        return None
    return pm.allowed(np.arange(nq)[:, None], np.arange(nk)[None, :])


def combined_mask(
    nq: int,
    nk: int,
    *,
    attn_mask: Any = None,
    is_causal: CausalArg = False,
    window: WindowArg = None,
    window_alignment: Optional[str] = None,
    key_padding_mask: Any = None,
    has_heads: bool = True,
) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """Fold every mask argument into (allowed bool mask, additive float bias); either may be None.

    Both broadcast against scores of shape ``(..., H, Nq, Nk)`` (``(Nq, Nk)`` with
    ``has_heads=False``: 2-D inputs). A torch ``CausalBias`` as ``attn_mask`` means causal with
    its alignment.
    """
    bias_alignment = causal_bias_alignment(attn_mask)
    if bias_alignment is not None:
        if is_causal:
            raise ValueError("attn_mask is a CausalBias, which is already causal; pass is_causal=False")
        attn_mask, is_causal = None, bias_alignment
    allowed = positional_mask(nq, nk, is_causal, window, window_alignment)
    bias = None
    if key_padding_mask is not None:
        kp = _as_bool(key_padding_mask)
        kp = kp[..., None, None, :] if has_heads else kp[..., None, :]  # (..., 1, 1, Nk) or (1, Nk)
        allowed = kp if allowed is None else allowed & kp
    if attn_mask is not None:
        is_bool = str(getattr(attn_mask, "dtype", "")).endswith("bool")
        if is_bool:
            am = _as_bool(attn_mask)
            allowed = am if allowed is None else allowed & am
        else:
            bias = as_float64(attn_mask, "attn_mask")
    return allowed, bias


def softmax_rows(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row softmax that treats ``-inf`` as "masked": returns (weights, lse).

    A row whose every entry is ``-inf`` gets all-zero weights and ``lse = -inf``; a row holding
    a NaN or ``+inf`` gets NaN (IEEE arithmetic, nothing hidden).
    """
    empty = np.all(np.isneginf(scores), axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        row_max = np.where(empty, 0.0, scores.max(axis=-1, keepdims=True, initial=-np.inf))
        e = np.exp(scores - row_max)
        total = e.sum(axis=-1, keepdims=True)
        weights = np.where(empty, 0.0, e / np.where(empty, 1.0, total))
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(empty, -np.inf, np.log(np.where(empty, 1.0, total)) + row_max)
    return weights, lse[..., 0]


def nonfinite_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Rows ``(..., Hq, Nq)`` that qkv defines as NaN: a non-finite query, or any non-finite key or
    value in the row's (batch, key/value head). ``k``/``v`` already have one head per query head."""
    bad_q = ~np.isfinite(q).all(axis=-1)
    bad_kv = ~(np.isfinite(k).all(axis=(-2, -1)) & np.isfinite(v).all(axis=(-2, -1)))  # (..., H)
    return bad_q | bad_kv[..., None]


def repeat_kv_heads(x: np.ndarray, num_query_heads: int) -> np.ndarray:
    """Grouped-query attention: query head h uses key/value head ``h // (Hq // Hk)``."""
    hk = x.shape[-3]
    if hk == num_query_heads:
        return x
    return np.repeat(x, num_query_heads // hk, axis=-3)


def attention_ref(
    q: Any,
    k: Any,
    v: Any,
    *,
    attn_mask: Any = None,
    is_causal: CausalArg = False,
    scale: Optional[float] = None,
    window: Any = None,
    window_alignment: Optional[str] = None,
    key_padding_mask: Any = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    score_mod: Any = None,
    sinks: Any = None,
    mask_mod: Any = None,
) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """Exact attention in float64: ``softmax(score_mod(q kᵀ · scale) + mask) v``.

    Accepts NumPy arrays or torch tensors and returns float64 NumPy arrays:
    ``out (..., Hq, Nq, Dv)`` and, with ``return_lse=True``, ``lse (..., Hq, Nq)``.
    ``score_mod`` (a torch callable, see :mod:`qkv.score_mods`) is evaluated in float64 on the
    whole score matrix; ``sinks`` ``(Hq,)`` join each row's denominator (:mod:`qkv.sinks`);
    ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (FlexAttention's) is evaluated on every pair
    and joins the other masks.
    """
    q, k, v = as_float64(q, "q"), as_float64(k, "k"), as_float64(v, "v")
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"q, k, v must have the same rank >= 2, got {q.shape}, {k.shape}, {v.shape}")
    nq, d = q.shape[-2:]
    nk = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q and k head dims differ: {d} vs {k.shape[-1]}")
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        if not enable_gqa or q.shape[-3] % k.shape[-3]:
            raise ValueError(
                f"key has {k.shape[-3]} heads but query has {q.shape[-3]}; pass enable_gqa=True "
                "when query heads are a multiple of key heads"
            )
        k = repeat_kv_heads(k, q.shape[-3])
        v = repeat_kv_heads(v, q.shape[-3])
    if scale is None:
        scale = 1.0 / np.sqrt(d) if d else 1.0  # head dim 0: every score is 0 whatever the scale

    allowed, bias = combined_mask(
        nq,
        nk,
        attn_mask=attn_mask,
        is_causal=is_causal,
        window=window,
        window_alignment=window_alignment,
        key_padding_mask=key_padding_mask,
        has_heads=q.ndim > 2,
    )
    bad = nonfinite_rows(q, k, v)
    if bad.any():  # compute on zeros in their place, then mark the rows: masked keys stay masked
        q, k, v = (np.where(np.isfinite(t), t, 0.0) for t in (q, k, v))
    with np.errstate(invalid="ignore", over="ignore"):
        scores = q @ np.swapaxes(k, -1, -2) * scale  # (..., H, Nq, Nk)
        if score_mod is not None:
            scores = score_mod64(score_mod, scores, causal_bias_alignment(attn_mask) or parse_causal(is_causal)[1])
        if bias is not None:
            scores = scores + bias
    if mask_mod is not None:
        more = mask_mod64(mask_mod, scores.shape)
        allowed = more if allowed is None else allowed & more
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    weights, lse = softmax_rows(scores)
    if sinks is not None:
        weights, lse = with_sinks(weights, lse, as_float64(sinks, "sinks"))
    out = weights @ v  # (..., H, Nq, Dv)
    if bad.any():
        bad = np.broadcast_to(bad, lse.shape)
        out = np.where(bad[..., None], np.nan, out)
        lse = np.where(bad, np.nan, lse)
    return (out, lse) if return_lse else out


def score_mod64(score_mod: Any, scores: np.ndarray, alignment: str) -> np.ndarray:
    """``score_mod`` on float64 scores ``(..., H, Nq, Nk)``: batch = the flattened batch index,
    head, query row (a built-in sees it at its aligned position) and key; a function meaning what
    it computes per element, as FlexAttention calls it (:func:`qkv.elementwise.call_elementwise`)."""
    import torch

    from ..elementwise import call_elementwise
    from ..score_mods.base import ScoreMod

    nq, nk = scores.shape[-2:]
    shape = scores.shape if scores.ndim >= 3 else (1, *scores.shape)
    b = int(np.prod(shape[:-3]))
    s = torch.from_numpy(np.ascontiguousarray(scores)).reshape(b, shape[-3], nq, nk)
    batch = torch.arange(b).view(b, 1, 1, 1)
    head = torch.arange(shape[-3]).view(1, -1, 1, 1)
    qi, kj = torch.arange(nq).view(1, 1, nq, 1), torch.arange(nk).view(1, 1, 1, nk)
    if isinstance(score_mod, ScoreMod):
        qi = qi + (nk - nq if (score_mod.alignment or alignment) == "bottom_right" else 0)
    with torch.no_grad():
        found = score_mod(s, batch, head, qi, kj) if isinstance(score_mod, ScoreMod) else call_elementwise(score_mod, s.shape, s, batch, head, qi, kj)
        out = torch.as_tensor(found).to(torch.float64).expand(s.shape)
    return out.reshape(scores.shape).numpy()


def mask_mod64(mask_mod: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``mask_mod`` on every pair of scores ``(..., H, Nq, Nk)`` (batch = the flattened batch index)."""
    import torch

    from ..sparse import check_mask_mod, from_mask_mod

    *batch, h, nq, nk = (1, *shape) if len(shape) == 2 else shape
    dense = from_mask_mod(check_mask_mod(mask_mod), tuple(batch), h, nq, nk).to_dense()
    return np.broadcast_to(dense.numpy(), shape)


def with_sinks(weights: np.ndarray, lse: np.ndarray, sinks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Softmax weights and lse with one extra logit per head in each row's denominator."""
    sink = sinks[:, None] if lse.ndim >= 2 else sinks.reshape(())  # (H, 1) against (..., H, Nq)
    with np.errstate(invalid="ignore"):
        total = np.logaddexp(lse, sink)
        keep = np.where(np.isneginf(total), 0.0, np.exp(lse - np.where(np.isneginf(total), 0.0, total)))
    return weights * keep[..., None], total
