"""Finite inputs never come back NaN: a call whose scores leave float32's range is answered in float64.

The kernels (torch's, qkv's C loops and decoding kernel, triton) compute the scores of float32,
float16 and bfloat16 inputs in float32, whose largest number is 3.4e38. Finite arguments can
carry the scores past it — ``scale=3e38``, values of 1e20, ALiBi slopes of 1e36, a relative
bias of 3e38 added to a score of 3e38 — and then ``inf - inf`` makes NaN inside any float32
kernel, where the exact answer (the float64 oracle on the same rounded inputs) is finite:
softmax of scores that far apart is one-hot.

qkv notices on the way out, on the CPU: an output holding a non-finite value outside the rows
that the non-finite rule makes NaN (:mod:`qkv.nonfinite`) is recomputed in float64 (the same
call on float64 copies of its tensors, on the backend ``auto`` picks for them) and rounded back
to the inputs' dtype. That answer is exact; an lse beyond float32's range rounds to ±inf, as
any float32 overflow does; gradients flow through the float64 computation. ``backend="auto"``
returns it; a named backend never falls back, so it raises :class:`qkv.BackendError` saying
why, when the float64 answer is finite where the backend's was not (a NaN that float64 gives
too — a float mask holding NaN, a score function returning NaN — is the answer, and is
returned as it is).

A backward can overflow where its forward did not (a softcap bounds the scores it returns, not
the raw ones its derivative reads; dQ multiplies by the scale again). So a call that needs
gradients is checked before it runs, from a bound on its scores (:func:`scores_may_overflow`:
``|scale| · max|q| · max|k| · D`` plus the largest bias, against float32's largest number with
a margin for the kernels' intermediates), and answered in float64 or refused alike.

The check costs one reduction over the output (small beside attention's work), and nothing
more unless the output is non-finite; with gradients, two more over q and k. On CUDA, under ``torch.compile`` and under
``torch.func.vmap`` qkv reads nothing back from a device, a traced graph or a batch of
values, so there such a call gives NaN rows as the kernels computed them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .nonfinite import nonfinite_rows, surely_finite


def may_check(out: torch.Tensor) -> bool:
    """Can the result be read without a device sync or a graph break (an eager CPU call)?"""
    return out.is_cpu and not torch.compiler.is_compiling()


def nonfinite_result(out: torch.Tensor) -> bool:
    """Does ``out`` hold a NaN or ±inf? One sum in the common case (a finite sum answers at once).
    False where the values cannot be read (under ``torch.func.vmap``)."""
    if not out.is_floating_point() or out.numel() == 0:
        return False
    try:
        total = float(out.detach().sum())
    except RuntimeError:  # vmap has no values to read
        return False
    if total == total and abs(total) != float("inf"):
        return False
    return not bool(torch.isfinite(out.detach()).all())


def suspect(
    out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, others: Sequence[torch.Tensor] = ()
) -> bool:
    """Should the call be answered in float64? True when ``out (..., Hq, Nq, Dv)`` (float32 or
    16-bit, on the CPU) holds a non-finite value outside the rows the non-finite rule makes NaN.
    ``others``: the score function's tensors (slopes, tables): one that is not finite makes whole
    heads NaN by the rule, so nothing is suspected then. One sum over ``out`` when it is finite."""
    if out.dtype == torch.float64 or not may_check(out) or not nonfinite_result(out):
        return False
    if surely_finite(query, key, value, *others):
        return True
    if not all(bool(torch.isfinite(t.detach()).all()) for t in others):
        return False
    bad = nonfinite_rows(query, key, value)  # (..., Hq, Nq)
    return bool((~torch.isfinite(out.detach()) & ~bad.unsqueeze(-1)).any())


# The bound's margin below float32's largest number: the kernels scale scores by log2 e, add
# biases, and their backward multiplies dS by the scale and K again.
SCORE_LIMIT = float(torch.finfo(torch.float32).max) / 2**10


def score_bound(query: torch.Tensor, key: torch.Tensor, scale: float) -> Optional[float]:
    """``|scale| · max|q| · max|k| · D``: no score of the call is larger in magnitude. None where
    the values cannot be read (off the CPU, under ``torch.compile`` or ``vmap``) or are not
    finite (the non-finite rule's NaN), 0 for empty inputs."""
    if not may_check(query):
        return None
    if query.numel() == 0 or key.numel() == 0:
        return 0.0
    try:
        q = float(torch.linalg.vector_norm(query.detach(), float("inf")))
        k = float(torch.linalg.vector_norm(key.detach(), float("inf")))
    except RuntimeError:  # vmap has no values to read
        return None
    if not (q < float("inf") and k < float("inf")):
        return None
    return abs(scale) * q * k * query.shape[-1]


def scores_may_overflow(query: torch.Tensor, key: torch.Tensor, scale: float, bias: float = 0.0) -> bool:
    """Might this call's float32 scores, or its backward's products, leave float32's range?
    :func:`score_bound` plus ``bias`` (the largest magnitude a score function adds) beyond
    :data:`SCORE_LIMIT`. Float64 inputs, and calls whose values cannot be read, answer False."""
    if query.dtype == torch.float64 or not bias < float("inf"):
        return False
    bound = score_bound(query, key, scale)
    return bound is not None and bound + bias > SCORE_LIMIT


def overflowed(exact: torch.Tensor, got: torch.Tensor) -> bool:
    """Is ``got`` non-finite somewhere the float64 answer ``exact`` (same shape) is finite?"""
    return bool((torch.isfinite(exact) & ~torch.isfinite(got)).any())


def explain(backend: str, dtype: torch.dtype) -> str:
    """The reason a named backend gives for refusing such a call."""
    name = str(dtype).replace("torch.", "")
    return (
        f"the scores of this call, or its backward's products, leave float32's range (beyond ±3.4e38: a huge scale, "
        f"huge values, slopes or bias), where backend {backend!r} computes NaN for these {name} inputs while the exact "
        "answer is finite; backend='auto' answers such calls in float64 (or pass float64 inputs)"
    )


__all__ = [
    "SCORE_LIMIT", "explain", "may_check", "nonfinite_result", "overflowed", "score_bound", "scores_may_overflow", "suspect",
]  # fmt: skip
