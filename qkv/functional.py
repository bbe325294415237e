"""``qkv.attention``: a drop-in superset of ``torch.nn.functional.scaled_dot_product_attention``."""

from __future__ import annotations

import logging
from typing import Literal, Optional, Tuple, Union, overload

import torch
import torch.nn.functional as F

from . import overflow
from .backends import BACKENDS, BackendError, debug_logged, plain_sdpa_call, run
from .backends.base import gate_call
from .backends.sdpa import empty_rows_are_zero
from .call import AttentionCall, BackendName, validate, validate_qk
from .nonfinite import Checked, guard
from .masks.rules import Alignment, IsCausal
from .score_mods.base import ScoreFn, ScoreMod
from .sparse import MaskMod

_log = logging.getLogger("qkv")
_sdpa = F.scaled_dot_product_attention
_CPU_EMPTY_ROWS_ZERO = empty_rows_are_zero("cpu")  # decided once: may the fast path trust torch?


def _fast_path(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float,
    is_causal: IsCausal, scale: Optional[float], enable_gqa: bool, generator: Optional[torch.Generator],
    score_mod: Optional[Union[ScoreMod, ScoreFn]], sinks: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:  # fmt: skip
    """torch SDPA's output for a plain call that ``auto`` would run on SDPA as given
    (:func:`qkv.backends.plain_sdpa_call` decides, from auto's own rules), else None. Where torch
    still rejects the call (RuntimeError, ValueError, TypeError or IndexError) it is None too:
    validation then explains the mistake or routes the call to a backend that handles it."""
    if not (
        generator is None
        and score_mod is None
        and sinks is None
        and is_causal.__class__ is bool
        and _CPU_EMPTY_ROWS_ZERO
        and plain_sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale)
    ):
        return None
    try:
        out = _sdpa(query, key, value, attn_mask, dropout_p, bool(is_causal), scale=scale, enable_gqa=enable_gqa)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None
    return out


# The result's type follows return_lse: a Tensor, or (out, lse) with return_lse=True.
@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: IsCausal = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    window_alignment: Optional[Alignment] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    return_lse: Literal[False] = False,
    backend: BackendName = "auto",
    generator: Optional[torch.Generator] = None,
    score_mod: Optional[Union[ScoreMod, ScoreFn]] = None,
    sinks: Optional[torch.Tensor] = None,
    mask_mod: Optional[MaskMod] = None,
) -> torch.Tensor: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: IsCausal = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    window_alignment: Optional[Alignment] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    return_lse: Literal[True],
    backend: BackendName = "auto",
    generator: Optional[torch.Generator] = None,
    score_mod: Optional[Union[ScoreMod, ScoreFn]] = None,
    sinks: Optional[torch.Tensor] = None,
    mask_mod: Optional[MaskMod] = None,
) -> Tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: IsCausal = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    window_alignment: Optional[Alignment] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    backend: BackendName = "auto",
    generator: Optional[torch.Generator] = None,
    score_mod: Optional[Union[ScoreMod, ScoreFn]] = None,
    sinks: Optional[torch.Tensor] = None,
    mask_mod: Optional[MaskMod] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]: ...


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: IsCausal = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    window_alignment: Optional[Alignment] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    backend: BackendName = "auto",
    generator: Optional[torch.Generator] = None,
    score_mod: Optional[Union[ScoreMod, ScoreFn]] = None,
    sinks: Optional[torch.Tensor] = None,
    mask_mod: Optional[MaskMod] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact scaled dot-product attention: ``softmax(query · keyᵀ · scale + mask) · value``.

    Shapes (``...`` = batch dims, broadcast between the three inputs)::

        query (..., Hq, Nq, D)   key (..., Hk, Nk, D)   value (..., Hk, Nk, Dv)
        out   (..., Hq, Nq, Dv)  lse (..., Hq, Nq) float32 (float64 for float64 inputs), with return_lse=True

    Every call that torch SDPA accepts gives SDPA's answer (same positional arguments).
    Beyond SDPA:

    - ``attn_mask``: bool (True = may attend) or float (added to the scaled scores),
      broadcastable to ``(..., Hq, Nq, Nk)``; may be combined with ``is_causal``. torch's
      ``causal_upper_left`` / ``causal_lower_right`` biases are understood as causal masks.
    - ``is_causal``: ``True``/``"top_left"`` — query i sees keys ``0..i`` (SDPA's alignment);
      ``"bottom_right"`` — query i sees keys ``0..i + Nk - Nq``, so the last query sees the
      last key (incremental decoding with a KV cache).
    - ``window=(left, right)``: query at position p sees keys ``p-left .. p+right`` (``None``
      or ``-1`` leaves a side unbounded). ``window_alignment`` places the query positions for
      the window: ``"top_left"`` (p = i), ``"bottom_right"`` (p = i + Nk - Nq, FlashAttention's
      convention) or None to follow ``is_causal``.
    - ``key_padding_mask``: bool ``(..., Nk)``, True for real keys, False for padding.
    - ``enable_gqa``: Hq a multiple of Hk; query head h reads key/value head ``h // (Hq // Hk)``
      without copying K and V.
    - ``return_lse``: also return the natural-log log-sum-exp of each query row's scores.
    - ``scale``: any finite number, zero and negative included (default ``1/√D``).
    - A query row with nothing to attend to gets output 0, lse ``-inf`` and zero gradient.
    - Non-finite inputs are never hidden: a row whose query holds NaN/±inf, or whose
      (batch, key/value head) has a NaN/±inf key or value, or whose head's built-in score
      function bias does, is NaN, and so is every gradient it reaches (see :mod:`qkv.nonfinite`).
    - Finite inputs whose scores leave float32's range (``scale=3e38``, values of 1e20) are
      answered in float64 by ``auto`` on the CPU, and refused by a named backend (see
      :mod:`qkv.overflow`).
    - ``backend``: ``"auto"`` (fastest that supports the call), ``"sdpa"``, ``"chunked"``
      (never materialises ``Nq × Nk``), ``"triton"`` (fused GPU kernels), ``"flex"``
      (compiled FlexAttention; ``QKV_COMPILE=0`` turns it off) or ``"math"``; a named backend
      never falls back.
    - ``generator``: makes dropout reproducible (math backend).
    - ``score_mod``: changes each scaled score before the masks, FlexAttention's contract
      ``fn(score, batch, head, q_idx, kv_idx) -> score``; built-ins in :mod:`qkv.score_mods`
      (softcapping, ALiBi, T5 relative bias) run in the fused kernels. Order: scaled score →
      score_mod → + float attn_mask → causal/window/padding/bool masks → softmax. Gradients
      flow through it and into the tensors it reads (slopes, a bias table).
    - ``sinks``: ``(Hq,)`` logits, one per query head, that join each row's softmax
      denominator without a value (GPT-OSS); the lse includes them (see :mod:`qkv.sinks`).
    - ``mask_mod``: FlexAttention's mask function ``fn(batch, head, q_idx, kv_idx) -> bool``
      (True = may attend), joined to every other mask as blocks (:func:`qkv.sparse.from_mask_mod`;
      a Flex ``BlockMask`` may be the ``attn_mask``). Score and mask functions mean what they
      compute per element, as in Flex (:mod:`qkv.elementwise`).

    Kept whole: the public signature, whose docstring is the reference of every argument.
    """
    # Fast path: a plain SDPA call that auto would send to SDPA goes straight to torch's kernel
    # with almost no Python, so small shapes pay little.
    if backend == "auto" and window is None and key_padding_mask is None and not return_lse and mask_mod is None:
        out = _fast_path(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, generator, score_mod, sinks)
        if out is not None:
            mask = attn_mask if isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point() else None
            out = guard(query, key, value, out, mask=mask)[0]
            # (a default scale is at most 1, which the bound takes as 1)
            suspect = overflow.suspect(out, query, key, value, scale=1.0 if scale is None else scale, mask=mask)
            if debug_logged():  # said once it answered
                _log.debug(
                    "qkv.attention(query %s): auto ran sdpa directly (a plain SDPA call)%s", tuple(query.shape),
                    "; its float32 scores may have overflowed: the call goes the whole way" if suspect else "",
                    extra={"qkv_engine": "sdpa"},
                )  # fmt: skip
            if not suspect:
                return out  # (else the call goes the whole way below, which answers an overflow exactly)
    call = validate(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window=window, window_alignment=window_alignment,
        key_padding_mask=key_padding_mask, return_lse=return_lse, generator=generator, score_mod=score_mod, sinks=sinks,
        mask_mod=mask_mod,
    )  # fmt: skip
    out, lse = _run(call, backend)
    return (out, lse) if return_lse else out


def _run(call: AttentionCall, backend: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(out, lse or None)`` of a validated call on ``backend``, after the non-finite rule, and in
    float64 where float32 scores would overflow (:mod:`qkv.overflow`)."""
    # (may_check first: off the CPU the bias bound would cost a host sync, and nothing is checked)
    if call.requires_grad and overflow.may_check(call.query) and overflow.scores_may_overflow(
        call.query, call.key, call.scale, overflow.largest_finite(_bias64(call))
    ):
        return _in_float64(call, backend)  # a backward may overflow where the forward does not
    call = gate_call(call)  # on a GPU with gradients: the rule fixes the engine's gradients in place (qkv.nonfinite)
    result = run(call, backend)
    out, lse = result if isinstance(result, Checked) else guard(call.query, call.key, call.value, *result)
    return _exact_beyond_float32(call, out, lse, backend)


def _in_float64(call: AttentionCall, backend: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The call answered in float64 and rounded back, for ``auto``; a named backend refuses
    (:mod:`qkv.overflow`)."""
    if backend != "auto":
        raise BackendError(f"backend {backend!r} cannot run this call ({call.describe()}):\n  - {overflow.explain(backend, call.dtype)}")
    call64 = call.in_float64()
    if debug_logged():
        _log.debug("qkv.attention(%s): float32 scores may overflow: the call runs in float64", call.describe())
    result = run(call64, "auto")
    out64, lse64 = result if isinstance(result, Checked) else guard(call64.query, call64.key, call64.value, *result)
    return out64.to(call.dtype), (None if lse64 is None else lse64.to(call.lse_dtype))


def _exact_beyond_float32(
    call: AttentionCall, out: torch.Tensor, lse: Optional[torch.Tensor], backend: str
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(out, lse)``, or the float64 answer where float32 scores overflowed (:mod:`qkv.overflow`:
    ``auto`` returns it, a named backend raises BackendError)."""
    if not overflowed_float32(call, out):
        return out, lse
    exact, exact_lse = _in_float64(call, "auto")
    if backend != "auto":
        if overflow.overflowed(exact, out):
            _in_float64(call, backend)  # raises: a named backend refuses
        return out, lse
    return exact, exact_lse


def overflowed_float32(call: AttentionCall, out: torch.Tensor) -> bool:
    """Should ``call``, whose output ``out`` a backend computed, be answered in float64 instead
    (:mod:`qkv.overflow`): a non-finite value outside the non-finite rule's rows, or a row of
    zeros where scores may have rounded to ``-inf``? One reduction over ``out`` in the common
    case; False off the CPU, under ``torch.compile`` and ``vmap``, and for float64 calls."""
    seen = overflow.symptoms(out) if call.dtype != torch.float64 and overflow.may_check(out) else None
    if not seen:  # the common case: one reduction over the output
        return False
    mask = call.given_mask if call.given_mask is not None and call.given_mask.is_floating_point() else None
    others = () if call.builtin_score else call.score_tensors()
    return overflow.suspect(out, call.query, call.key, call.value, others, bias=_bias64(call), scale=call.scale, mask=mask, seen=seen)


def _bias64(call: AttentionCall) -> Optional[torch.Tensor]:
    """A built-in score function's bias ``rel (Hq, L)`` computed in float64 (where finite slopes
    or tables stay finite, and a non-finite one marks its head for the non-finite rule), else None."""
    if not isinstance(call.score_mod, ScoreMod):
        return None
    rel = call.score_mod.kernel_form(call.hq, call.nq, call.nk, call.alignment, torch.float64).rel
    return None if rel is None else rel.detach()


def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: IsCausal = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    window_alignment: Optional[Alignment] = None,
    score_mod: Optional[Union[ScoreMod, ScoreFn]] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The softmax weights ``(..., Hq, Nq, Nk)`` that :func:`attention` applies (0 on masked rows;
    with ``sinks`` a row sums to less than one).

    Materialises the full matrix; for long inputs use the inspection tools instead.
    """
    call = validate_qk(
        query, key, attn_mask, is_causal, scale, enable_gqa, window, key_padding_mask, window_alignment,
        score_mod=score_mod, sinks=sinks,
    )  # fmt: skip
    return BACKENDS["math"].weights(call)  # type: ignore[attr-defined]


__all__ = ["attention", "attention_weights", "overflowed_float32"]
