"""Attention backends: each declares what it supports and explains what it does not.

``select(call, "auto")`` walks a priority list and returns the first backend with no
reasons against the call; a named backend either runs or raises :class:`BackendError`
listing every reason — it never falls back silently.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..call import AttentionCall
from .base import Backend
from .chunked import ChunkedBackend, causal_prefill, causal_prefill_shape
from .decode_cpu import can_decode, decode_shape
from .flash_cpu import can_fuse, lse_misses_rule
from .math import MathBackend
from .sdpa import DENSE_MASK_LIMIT, SdpaBackend, needs_dense_mask
from .triton import TritonBackend

_log = logging.getLogger("qkv")

# Below this many scores per head the one-shot math path beats chunked's loop on a CPU.
MATH_MAX_SCORES = 1 << 14

BACKENDS: dict[str, Backend] = {b.NAME: b for b in (SdpaBackend(), ChunkedBackend(), MathBackend(), TritonBackend())}


class BackendError(RuntimeError):
    """A backend was named (or ``auto`` searched) and nothing can run the call."""


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend={name!r} is unknown; choose 'auto' or one of {sorted(BACKENDS)}") from None


def torch_backward_misses_rule(call: AttentionCall) -> bool:
    """Calls whose gradients from torch's CPU kernels miss qkv's accuracy rule: every one.
    Measured against the float64 oracle (err / bound of the rule, worst of 6 seeds): float32 dV
    30× where queries match their own keys (q = k, std 4: one key takes a row's weight, as in
    real models' self-matching and sink heads) and 1.3× on plain std-3 inputs, because torch
    recomputes the weights from a float32 lse whose rounding (an ulp of 90 is 8e-6) scales every
    weight of the row; 16-bit inputs (a forward lse off by up to ~5e-5, each head's gradient
    rounded to 16 bits; the sdpa backend refuses them); shared key/value heads (gradients summed
    in the input dtype: dV 7× in bfloat16); float masks (dV 6×); float64 with logits of 1e31
    (NaN gradients from finite inputs, a fuzz case). qkv's chunked backward keeps each row's
    maximum and sum apart (≤ 0.5×), as fast in float64 (8 heads × 1024 × 64, one thread:
    315 ms against torch's 355; 28 against 25 ms at 256)."""
    return call.device.type == "cpu" and call.requires_grad


def blocks_beat_dense(nq: int, nk: int) -> bool:
    """Whether a bool mask over ``Nq × Nk`` scores is large enough that chunked's block-sparse
    dispatch (empty blocks skipped, :mod:`.flash_cpu`) beats one dense kernel call."""
    return nq * nk > MATH_MAX_SCORES


# Values of another head dim than the keys' (Dv ≠ D) on the CPU: torch's kernel falls back to its
# math formulation (the Nq × Nk matrix, q and k each scaled by √scale and rounded), which
# chunked's tile loops beat from 256 × 256 scores on (float32, one thread, no gradient: 0.64×
# its time at 256², 0.33× at 1024², 0.31× at 2048², 1.21× at 128²) while staying closer to the
# oracle at large logits (torch's fallback at 0.45–0.85 of the strict rule, chunked ≤ 0.53;
# bench/results/large_logits_cpu.md).
VALUE_DIM_MIN_SCORES = 1 << 16


def value_dim_fallback(nq: int, nk: int, d: int, dv: int, dtype: torch.dtype) -> bool:
    """Would torch's CPU kernel run this float32 call on its slower, less exact math fallback
    (Dv ≠ D) at a size where chunked's tile loops are faster (:data:`VALUE_DIM_MIN_SCORES`)?"""
    return dtype == torch.float32 and dv != d and nq * nk >= VALUE_DIM_MIN_SCORES


def plain_sdpa_call(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
    dropout_p: float, is_causal: object, scale: Optional[float],
) -> bool:  # fmt: skip
    """Whether ``auto`` would run this call on torch SDPA as given, decided without validating it.

    True only for a plain 4-D CPU call: values pairing with keys, no empty size (torch's shapes
    ignore broadcasting there), ``scale > 0``, dropout in [0, 1), a mask on the query's device in
    its dtype (or bool) not combined with ``is_causal``, and none of what :func:`auto_order` sends
    elsewhere: gradients (:func:`torch_backward_misses_rule`), a large bool mask
    (:func:`blocks_beat_dense`), decoding shapes (:func:`.decode_cpu.decode_shape`), causal
    self-attention that chunked's tile loops run faster (:func:`.chunked.causal_prefill_shape`),
    values whose head dim differs from the keys' (:func:`value_dim_fallback`). The caller checks
    the keyword-only features (window, padding, lse, score_mod, sinks). Inputs not of the plain
    kind (a non-tensor, an odd scale) answer False, and the call is validated, which explains
    them."""
    try:
        return bool(
            query.is_cpu
            and query.dim() == 4
            and key.dim() == 4
            and value.dim() == 4
            and value.shape[1] == key.shape[1]
            and value.shape[2] == key.shape[2]
            and query.numel()
            and key.numel()
            and not decode_shape(query.shape[-2], key.shape[-2], query.dtype)
            and not value_dim_fallback(query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1], query.dtype)
            and not (attn_mask is None and causal_prefill_shape(query.shape[-2], key.shape[-2], query.dtype, is_causal))
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
            and (scale is None or 0.0 < scale < math.inf)
            and (dropout_p == 0.0 or 0.0 < dropout_p < 1.0)
            and (
                attn_mask is None
                or (
                    (attn_mask.dtype is not torch.bool or not blocks_beat_dense(query.shape[-2], key.shape[-2]))
                    and not is_causal
                    and attn_mask.__class__ is torch.Tensor
                    and attn_mask.device == query.device
                    and (attn_mask.dtype is torch.bool or attn_mask.dtype is query.dtype)
                )
            )
        )
    except (AttributeError, TypeError, RuntimeError):  # not tensors, or a scale/probability that does not compare
        return False


@dataclass(frozen=True)
class Route:
    """One row of ``auto``'s choice: the calls it applies to (validated), the backends in the
    order ``auto`` tries them, and why, in the words ``qkv info`` and the debug log print."""

    applies: Callable[[AttentionCall], bool]
    order: tuple[str, ...]
    why: str


_CHUNKED_FIRST = ("chunked", "sdpa", "math")

# The first row that applies decides; a call no row takes gets SDPA first (below). Each row's
# measurement is with the rule it reads (can_decode, causal_prefill, lse_misses_rule, ...).
ROUTES: tuple[Route, ...] = (
    Route(
        can_decode,
        _CHUNKED_FIRST,  # SDPA reads each K/V row once per query head
        "chunked first: a decoding call (few query rows, long cache) runs its kernel that reads each key/value row "
        "once for all the query rows of its group",
    ),
    Route(
        causal_prefill,
        _CHUNKED_FIRST,  # torch's kernel computes 512-key blocks past the diagonal
        "chunked first: causal self-attention without gradients runs faster on its tile loops, whose key range "
        "stops at each row block's diagonal",
    ),
    Route(
        lambda call: call.device.type == "cpu" and lse_misses_rule(call),
        _CHUNKED_FIRST,  # torch's kernel: 1.8e-5, the tile loops on upcast inputs: 6e-7
        "chunked first: its tile loops compute the lse of 16-bit inputs in float32, where torch's fused kernel "
        "misses the accuracy rule on it",
    ),
    Route(
        lambda call: call.device.type == "cpu" and value_dim_fallback(call.nq, call.nk, call.d, call.dv, call.dtype),
        _CHUNKED_FIRST,  # VALUE_DIM_MIN_SCORES
        "chunked first: with values of another head dim than the keys', torch's CPU kernel falls back to its math "
        "formulation, slower and less exact than the tile loops at this size",
    ),
    Route(
        lambda call: call.block_sparse is not None and call.device.type == "cpu" and blocks_beat_dense(call.nq, call.nk),
        _CHUNKED_FIRST,
        "chunked first: it walks the block-sparse layout's blocks, forward and backward, where SDPA would get the "
        "dense Nq × Nk mask",
    ),
    Route(
        lambda call: (needs_dense_mask(call) or call.bool_mask) and can_fuse(call) and blocks_beat_dense(call.nq, call.nk),
        _CHUNKED_FIRST,
        "chunked first: without gradients it runs the call on torch's fused CPU kernel block by block, skipping what "
        "the window, padding or a bool mask's empty blocks rule out, where SDPA would get a dense mask",
    ),
    Route(
        lambda call: needs_dense_mask(call) and call.nq * call.nk * call.hq > DENSE_MASK_LIMIT,
        _CHUNKED_FIRST,
        "chunked first: SDPA would need an Nq × Nk mask built for it",
    ),
)

_SDPA_LAST = "sdpa last: torch's CPU backward misses the accuracy rule for gradients"


def route(call: AttentionCall) -> Optional[Route]:
    """The first row of :data:`ROUTES` that applies to ``call``, or None."""
    return next((r for r in ROUTES if r.applies(call)), None)


def _order_names(call: AttentionCall, chosen: Optional[Route]) -> list[str]:
    if chosen is not None:
        names = list(chosen.order)
    else:  # below MATH_MAX_SCORES the one-shot math path beats chunked's loop
        names = ["sdpa", "math", "chunked"] if call.nq * call.nk <= MATH_MAX_SCORES else ["sdpa", "chunked", "math"]
    if torch_backward_misses_rule(call):
        names.remove("sdpa")
        names.append("sdpa")
    if call.device.type == "cuda":  # never on CPU, where triton would run in its slow interpreter
        # SDPA has no native form for these (it would need a dense mask, or has no lse gradient)
        sdpa_lacks = needs_dense_mask(call) or (call.return_lse and call.requires_grad)
        names.insert(0 if sdpa_lacks else names.index("sdpa") + 1, "triton")
    return names


def auto_order(call: AttentionCall) -> list[Backend]:
    """Backends in the order ``auto`` tries them for this call (fastest first)."""
    return [BACKENDS[n] for n in _order_names(call, route(call))]


def order_notes(call: AttentionCall) -> list[str]:
    """Why :func:`auto_order` put the backends in their order for this call (for logs and ``qkv info``)."""
    chosen = route(call)
    names = _order_names(call, chosen)
    notes = [chosen.why] if chosen is not None and names[0] == chosen.order[0] else []
    if torch_backward_misses_rule(call):
        notes.append(_SDPA_LAST)
    return notes


def reasons_by_backend(call: AttentionCall) -> dict[str, list[str]]:
    """Every backend's reasons against ``call`` (an empty list means it can run it)."""
    return {name: b.not_supported_reasons(call) for name, b in BACKENDS.items()}


def select(call: AttentionCall, backend: str = "auto") -> Backend:
    """The backend that will run ``call``; raises :class:`BackendError` with reasons if none can."""
    if backend != "auto":
        chosen = get_backend(backend)
        reasons = chosen.not_supported_reasons(call)
        if reasons:
            raise BackendError(
                f"backend {backend!r} cannot run this call ({call.describe()}):\n  - "
                + "\n  - ".join(reasons)
                + "\nUse backend='auto' to let qkv choose, or see `qkv info`."
            )
        return chosen
    order = auto_order(call)
    for i, candidate in enumerate(order):
        if not candidate.not_supported_reasons(call):
            if not torch.compiler.is_compiling() and _log.isEnabledFor(logging.DEBUG):  # no logging in a traced graph
                passed = "; ".join(f"{b.NAME}: {', '.join(b.not_supported_reasons(call))}" for b in order[:i])
                _log.debug(
                    "qkv.attention(%s): auto runs %s (order %s)%s%s",
                    call.describe(), candidate.NAME, " → ".join(b.NAME for b in order),
                    f"; cannot run it: {passed}" if passed else "", "".join(f"; {n}" for n in order_notes(call)),
                )  # fmt: skip
            return candidate
    lines = [f"  {n}: {'; '.join(r)}" for n, r in reasons_by_backend(call).items()]
    raise BackendError(f"no backend can run this call ({call.describe()}):\n" + "\n".join(lines))


__all__ = [
    "Backend", "BackendError", "BACKENDS", "ROUTES", "Route", "auto_order", "blocks_beat_dense", "get_backend",
    "order_notes", "plain_sdpa_call", "reasons_by_backend", "route", "select", "value_dim_fallback",
    "VALUE_DIM_MIN_SCORES",
]  # fmt: skip
