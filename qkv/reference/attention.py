"""The float64 oracle: scaled dot-product attention written out step by step in NumPy.

Shapes (``...`` = any batch dims)::

    q    (..., Hq, Nq, D)     k    (..., Hk, Nk, D)     v   (..., Hk, Nk, Dv)
    out  (..., Hq, Nq, Dv)    lse  (..., Hq, Nq)

Semantics are identical to :func:`qkv.attention` (see that docstring): boolean masks are
True where a query may attend; float masks are added to the scaled scores; a query row with
nothing to attend to yields output 0 and log-sum-exp ``-inf``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np

from .masks import CausalArg, PositionalMask, WindowArg, parse_causal, parse_window


def as_float64(x: Any, name: str = "array") -> np.ndarray:
    """Any array-like (NumPy, nested lists, torch tensors on any device) → float64 ndarray."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
        x = x.detach().cpu()
        if hasattr(x, "double"):
            x = x.double()
        x = x.numpy()
    arr = np.asarray(x)
    if arr.dtype == object:
        raise TypeError(f"{name} must be numeric, got an object array")
    return arr.astype(np.float64, copy=False)


def _as_bool(x: Any) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=bool)


def positional_mask(nq: int, nk: int, is_causal: CausalArg = False, window: Any = None) -> Optional[np.ndarray]:
    """Boolean ``(Nq, Nk)`` matrix of allowed pairs, or None when nothing is masked."""
    causal, alignment = parse_causal(is_causal)
    pm = PositionalMask(nq, nk, causal, parse_window(window), alignment)
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
    key_padding_mask: Any = None,
) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """Fold every mask argument into (allowed bool mask, additive float bias); either may be None.

    Both broadcast against scores of shape ``(..., H, Nq, Nk)``.
    """
    allowed = positional_mask(nq, nk, is_causal, window)
    bias = None
    if key_padding_mask is not None:
        kp = _as_bool(key_padding_mask)[..., None, None, :]  # (..., 1, 1, Nk)
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

    A row whose every entry is ``-inf`` gets all-zero weights and ``lse = -inf``.
    """
    row_max = scores.max(axis=-1, keepdims=True)
    empty = ~np.isfinite(row_max)  # the whole row is -inf
    shifted = scores - np.where(empty, 0.0, row_max)
    e = np.exp(shifted)
    total = e.sum(axis=-1, keepdims=True)
    weights = np.where(empty, 0.0, e / np.where(empty, 1.0, total))
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, np.log(np.where(empty, 1.0, total)) + np.where(empty, 0.0, row_max))
    return weights, lse[..., 0]


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
    key_padding_mask: Any = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """Exact attention in float64: ``softmax(q kᵀ · scale + mask) v``.

    Accepts NumPy arrays or torch tensors and returns float64 NumPy arrays:
    ``out (..., Hq, Nq, Dv)`` and, with ``return_lse=True``, ``lse (..., Hq, Nq)``.
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
        scale = 1.0 / np.sqrt(d)

    scores = q @ np.swapaxes(k, -1, -2) * scale  # (..., H, Nq, Nk)
    allowed, bias = combined_mask(
        nq, nk, attn_mask=attn_mask, is_causal=is_causal, window=window, key_padding_mask=key_padding_mask
    )
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    weights, lse = softmax_rows(scores)
    out = weights @ v  # (..., H, Nq, Dv)
    return (out, lse) if return_lse else out
