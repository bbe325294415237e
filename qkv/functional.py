"""``qkv.attention``: a drop-in superset of ``torch.nn.functional.scaled_dot_product_attention``."""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .backends import BACKENDS, select
from .backends.sdpa import empty_rows_are_zero
from .call import validate, validate_qk

_sdpa = F.scaled_dot_product_attention
_CPU_EMPTY_ROWS_ZERO = empty_rows_are_zero("cpu")  # decided once: may the fast path trust torch?


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    backend: str = "auto",
    generator: Optional[torch.Generator] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact scaled dot-product attention: ``softmax(query · keyᵀ · scale + mask) · value``.

    Shapes (``...`` = batch dims, broadcast between the three inputs)::

        query (..., Hq, Nq, D)   key (..., Hk, Nk, D)   value (..., Hk, Nk, Dv)
        out   (..., Hq, Nq, Dv)  lse (..., Hq, Nq) float32, with return_lse=True

    Every call that torch SDPA accepts gives SDPA's answer (same positional arguments).
    Beyond SDPA:

    - ``attn_mask``: bool (True = may attend) or float (added to the scaled scores),
      broadcastable to ``(..., Hq, Nq, Nk)``; may be combined with ``is_causal``.
    - ``is_causal``: ``True``/``"top_left"`` — query i sees keys ``0..i`` (SDPA's alignment);
      ``"bottom_right"`` — query i sees keys ``0..i + Nk - Nq``, so the last query sees the
      last key (incremental decoding with a KV cache).
    - ``window=(left, right)``: query at position p sees keys ``p-left .. p+right`` (positions
      aligned as for ``is_causal``; ``None`` leaves a side unbounded).
    - ``key_padding_mask``: bool ``(..., Nk)``, True for real keys, False for padding.
    - ``enable_gqa``: Hq a multiple of Hk; query head h reads key/value head ``h // (Hq // Hk)``
      without copying K and V.
    - ``return_lse``: also return the natural-log log-sum-exp of each query row's scores.
    - A query row with nothing to attend to gets output 0, lse ``-inf`` and zero gradient.
    - ``backend``: ``"auto"`` (fastest that supports the call), ``"sdpa"``, ``"chunked"``
      (never materialises ``Nq × Nk``), ``"triton"`` (fused GPU kernels) or ``"math"``; a
      named backend never falls back.
    - ``generator``: makes dropout reproducible (math backend).
    """
    # Fast path: a plain SDPA call goes straight to torch's kernel with no Python validation,
    # so small shapes pay no overhead. Anything torch rejects is re-checked below, which either
    # explains the mistake or routes the call to a backend that handles it.
    if (
        backend == "auto"
        and window is None
        and key_padding_mask is None
        and not return_lse
        and generator is None
        and is_causal.__class__ is bool
    ):
        try:
            # torch does not check that values pair with keys or that scale is finite; qkv must
            if _CPU_EMPTY_ROWS_ZERO and query.is_cpu and value.shape[-2] == key.shape[-2]:
                if scale is None and not enable_gqa:
                    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal)
                if scale is None or math.isfinite(scale):
                    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        except Exception:
            pass
    call = validate(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        window=window,
        key_padding_mask=key_padding_mask,
        return_lse=return_lse,
        generator=generator,
    )
    out, lse = select(call, backend).forward(call)
    return (out, lse) if return_lse else out


def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The softmax weights ``(..., Hq, Nq, Nk)`` that :func:`attention` applies (0 on masked rows).

    Materialises the full matrix; for long inputs use the inspection tools instead.
    """
    call = validate_qk(query, key, attn_mask, is_causal, scale, enable_gqa, window, key_padding_mask)
    return BACKENDS["math"].weights(call)  # type: ignore[attr-defined]


__all__ = ["attention", "attention_weights"]
