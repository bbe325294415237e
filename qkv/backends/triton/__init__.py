"""``triton``: fused FlashAttention-style forward, flash-decoding and deterministic backward kernels.

Importing this package never imports triton; :meth:`TritonBackend.available` does, and says
why the backend cannot run when triton is missing. The kernels live in :mod:`.kernels` (the
decoding ones, with the non-finite rule inside, in :mod:`.decode`), the launch code, autograd
and torch custom ops in :mod:`.backend`, the launch configurations per GPU architecture in
:mod:`.configs` (tuned on a device by :mod:`.autotune`), and :mod:`.lowering` compiles every
kernel for a GPU without one.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ...call import AttentionCall
from ..base import Backend

_DEVICE_REASON = "needs a CUDA device (or TRITON_INTERPRET=1 for the slow CPU interpreter)"
MAX_HEAD_DIM = 256
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis, which runs over batch × heads
MAX_DECODE_ROWS = 8  # Nq per head that takes the split-over-keys decoding kernels (.decode)
MAX_DECODE_GROUP = 64  # G·Nq rows in one decoding program's tile


def decode_fits(nq: int, nk: int, group: int) -> bool:
    """Do the decoding kernels (:mod:`.decode`) take a call of ``nq`` query rows per head against
    ``nk`` keys, ``group`` query heads per key/value head: a few rows (``Nq <= 8``) against more
    keys, all ``G·Nq`` rows of a group in one tile? (Asked without importing triton.)"""
    return 0 < nq <= MAX_DECODE_ROWS and group * nq <= MAX_DECODE_GROUP and nk > nq


def _slice_extent(t: torch.Tensor) -> int:
    """Largest element offset inside one matrix (last two dims) of ``t``."""
    return sum((s - 1) * abs(st) for s, st in zip(t.shape[-2:], t.stride()[-2:]) if s > 0)

_IMPORT_ERROR: list[Optional[str]] = []  # cached result of the first import attempt


def _import_error() -> Optional[str]:
    if not _IMPORT_ERROR:
        try:
            from . import backend  # noqa: F401  (imports triton and registers the custom ops)

            _IMPORT_ERROR.append(None)
        except ImportError as e:  # triton (or a piece of it) is missing
            _IMPORT_ERROR.append(f"triton is not importable ({e}); install it with `pip install triton`")
        except Exception as e:  # an installed triton that fails to load: report it, don't crash `qkv info`
            _IMPORT_ERROR.append(f"triton failed to load: {type(e).__name__}: {e}")
    return _IMPORT_ERROR[0]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonBackend(Backend):
    """Fused kernels; runs on CUDA, or on a CPU through ``TRITON_INTERPRET=1`` (slow; for tests).

    The backward of q, k and v is always deterministic (no atomics: dK/dV and dQ come from
    separate kernels whose programs each own the rows they write), so repeated runs give
    bit-identical gradients; only a relative bias's gradient (ALiBi slopes, a T5 table) is
    summed with atomics. Built-in score functions and sinks run inside the kernels.
    """

    NAME = "triton"
    DESCRIPTION = ("fused Triton kernels (online softmax forward with unmasked interior tiles, flash-decoding for Nq <= 8, "
                   "deterministic FlashAttention-2 backward; softcap, ALiBi/T5 biases, sinks); CUDA")
    DTYPES = (torch.float16, torch.bfloat16, torch.float32)
    SUPPORTS_DROPOUT = False
    SUPPORTS_GENERATOR = False
    SUPPORTS_MASK_GRAD = False
    SCORE_MODS = "builtin"  # softcap and relative biases (ALiBi, T5) inside the kernels
    SUPPORTS_SINKS = True

    @property
    def DEVICES(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("cuda", "cpu") if _interpreting() else ("cuda",)

    def available(self) -> Optional[str]:
        return _import_error()

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        return [_DEVICE_REASON if r.startswith(f"device {call.device.type} ") else r for r in reasons]

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        reasons = []
        if call.d == 0:
            reasons.append("head dim 0: the kernels need a head dim of at least 1")
        if max(call.d, call.dv) > MAX_HEAD_DIM:
            reasons.append(f"head dim {max(call.d, call.dv)} > {MAX_HEAD_DIM}: a row of Q/K/V must fit in one tile")
        if call.device.type == "cuda" and math.prod(call.batch_shape) * call.hq > _MAX_GRID_Y:
            reasons.append(f"batch × query heads = {math.prod(call.batch_shape) * call.hq} exceeds CUDA's grid limit of {_MAX_GRID_Y}")
        for name, t in (("query", call.query), ("key", call.key), ("value", call.value), ("attn_mask", call.attn_mask)):
            if t is not None and _slice_extent(t) >= 2**31:
                reasons.append(f"{name}: one (batch, head) slice spans >= 2**31 elements; the kernels index within it in int32")
        return reasons

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        from .backend import TritonBackendImpl

        return TritonBackendImpl.forward(self, call)


__all__ = ["MAX_DECODE_GROUP", "MAX_DECODE_ROWS", "TritonBackend", "decode_fits"]
