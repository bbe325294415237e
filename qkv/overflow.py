"""Finite inputs never come back NaN, nor as an empty row: a call whose scores leave float32's range is answered in float64.

The kernels (torch's, qkv's C loops and decoding kernel, triton) compute the scores of float32,
float16 and bfloat16 inputs in float32, whose largest number is 3.4e38. Finite arguments can
carry the scores past it — ``scale=3e38``, values of 1e20, ALiBi slopes of 1e36, a relative
bias of 3e38 added to a score of 3e38 — and then ``inf - inf`` makes NaN inside any float32
kernel, where the exact answer (the float64 oracle on the same rounded inputs) is finite:
softmax of scores that far apart is one-hot. Where every score of a row rounds to ``-inf``
(``q = [1e20, 0]`` against keys ``[-1e20, 0]`` and ``[-2e20, 0]``), a float32 kernel takes the
row for one its masks left empty and returns 0, where the exact answer is a real softmax: a row
is empty because its masks leave it no key, never because its scores overflowed.

qkv notices on the way out, on the CPU (:func:`suspect`): an output holding a non-finite value
outside the rows that the non-finite rule makes NaN (:mod:`qkv.nonfinite`, a built-in score
function's bad head included), or a row of zeros while the call's scores may pass float32's
range (:func:`scores_may_overflow`), is recomputed in float64 (the same call on float64 copies
of its tensors, on the backend ``auto`` picks for them) and rounded back to the inputs' dtype.
That answer is exact; an lse beyond float32's range rounds to ±inf, as any float32 overflow
does; gradients flow through the float64 computation. ``backend="auto"`` returns it; a named
backend never falls back, so it raises :class:`qkv.BackendError` saying why, when the float64
answer differs where the backend's was non-finite or an empty row (:func:`overflowed`; a NaN
that float64 gives too — a float mask holding NaN, a score function returning NaN — and a row
the masks empty are the answer, and are returned as they are).

A backward can overflow where its forward did not (a softcap bounds the scores it returns, not
the raw ones its derivative reads; dQ multiplies by the scale again). So a call that needs
gradients is checked before it runs, from a bound on its scores (:func:`scores_may_overflow`:
``max(1, |scale|) · max|q| · max|k| · D`` plus the largest bias, against float32's largest
number with a margin for the kernels' intermediates), and answered in float64 or refused alike.

The check costs one reduction over the output (its row sums, small beside attention's work:
a finite total with no zero row answers at once), and nothing more unless the output holds a
non-finite value or a zero row; then two reductions over q and k bound the scores. With
gradients, those two come first. On CUDA, under ``torch.compile`` and under ``torch.func.vmap``
qkv reads nothing back from a device, a traced graph or a batch of values, so there such a
call gives the rows as the kernels computed them.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from .nonfinite import nonfinite_rows, surely_finite


def may_check(out: torch.Tensor) -> bool:
    """Can the result be read without a device sync or a graph break (an eager CPU call)?"""
    return out.is_cpu and not torch.compiler.is_compiling()


class Symptoms(NamedTuple):
    """What one pass over an output shows (:func:`symptoms`)."""

    nonfinite: bool  # a NaN or ±inf somewhere
    zero_rows: bool  # a row of exact zeros: one its masks left empty, or one whose every score rounded to -inf

    def __bool__(self) -> bool:
        return self.nonfinite or self.zero_rows


def symptoms(out: torch.Tensor) -> Symptoms:
    """Does ``out (..., Nq, Dv)`` hold a NaN or ±inf, and a row of zeros? One reduction, the row
    sums ``r`` (a NaN or inf carries into its row's sum, and a zero row sums to 0), and then
    ``Σ r·(1/r)`` over them, finite exactly when no sum is NaN, infinite or 0 (or subnormal): the
    common case answers there; an exact look only where it is not. Nothing where the values cannot
    be read (under ``torch.func.vmap``) or there are none."""
    if not out.is_floating_point() or out.numel() == 0:
        return Symptoms(False, False)
    out = out.detach()
    try:
        rows = out.sum(-1, dtype=torch.float64 if out.dtype == torch.float64 else torch.float32).flatten()  # (R,)
        probe = float(torch.dot(rows, rows.reciprocal()))  # R up to rounding; inf·0 and 0·inf are NaN
    except RuntimeError:  # vmap has no values to read
        return Symptoms(False, False)
    if math.isfinite(probe):
        return Symptoms(False, False)
    return Symptoms(not bool(torch.isfinite(out).all()), bool((out == 0).all(-1).any()))


def suspect(
    out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, others: Sequence[torch.Tensor] = (),
    *, bias: Optional[torch.Tensor] = None, scale: Optional[float] = None, mask: Optional[torch.Tensor] = None,
    seen: Optional[Symptoms] = None,
) -> bool:  # fmt: skip
    """Should the call be answered in float64? True when ``out (..., Hq, Nq, Dv)`` (float32 or
    16-bit, on the CPU)

    - holds a non-finite value outside the rows the non-finite rule makes NaN. ``bias``: a
      built-in score function's ``rel (Hq, L)`` bound in float64, whose non-finite entries make
      their heads NaN by the rule (its finite slopes or table can overflow only float32);
      without it, a non-finite tensor among ``others`` (a score function's) gives up: nothing
      is suspected;
    - or, with the call's ``scale`` given, has a row of zeros while its scores may pass float32's
      range (:func:`scores_may_overflow`, with the largest finite entry of ``bias`` and of a
      float ``mask`` added): that row may have seen only scores rounded to ``-inf``.

    ``seen``: :func:`symptoms` of ``out`` where the caller has them. One reduction over ``out``
    in the common case."""
    if out.dtype == torch.float64 or not may_check(out):
        return False
    seen = symptoms(out) if seen is None else seen
    if seen.nonfinite and _nonfinite_outside_rule(out, query, key, value, others, bias):
        return True
    return seen.zero_rows and scale is not None and scores_may_overflow(query, key, scale, largest_finite(bias), mask)


def _nonfinite_outside_rule(
    out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, others: Sequence[torch.Tensor],
    bias: Optional[torch.Tensor],
) -> bool:  # fmt: skip
    """Does ``out`` hold a non-finite value in a row the non-finite rule leaves finite?"""
    if bias is None and not surely_finite(*others) and not all(bool(torch.isfinite(t.detach()).all()) for t in others):
        return False
    if surely_finite(query, key, value, *([] if bias is None else [bias])):
        return True
    bad = nonfinite_rows(query, key, value, bias)  # (..., Hq, Nq)
    return bool((~torch.isfinite(out.detach()) & ~bad.unsqueeze(-1)).any())


def largest_finite(t: Optional[torch.Tensor]) -> float:
    """The largest magnitude among ``t``'s finite entries (0 for none, and for None): what a bias
    adds at most to a score it does not mask (``-inf``) or make NaN (the non-finite rule's)."""
    if t is None or t.numel() == 0:
        return 0.0
    t = t.detach()
    return float(torch.where(torch.isfinite(t), t, 0).abs().amax())


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
        q, k = _max_abs(query), _max_abs(key)
    except RuntimeError:  # vmap has no values to read
        return None
    if not (q < float("inf") and k < float("inf")):
        return None
    return abs(scale) * q * k * query.shape[-1]


def _max_abs(t: torch.Tensor) -> float:
    """``max |t|`` (NaN where ``t`` holds one), from ``aminmax``: one pass, no temporary (ten
    times faster than ``vector_norm(t, inf)`` on a CPU: 3.5 against 40 ms for 8M float32)."""
    lo, hi = (float(x) for x in torch.aminmax(t.detach()))
    return max(-lo, hi) if lo == lo and hi == hi else float("nan")  # (max() would drop a NaN)


def scores_may_overflow(
    query: torch.Tensor, key: torch.Tensor, scale: float, bias: float = 0.0, mask: Optional[torch.Tensor] = None
) -> bool:
    """Might this call's float32 scores, or its backward's products, leave float32's range?
    :func:`score_bound` at a scale of at least 1 (kernels that scale the products ``q·k`` after
    computing them can overflow in those, even where a small scale brings the scores back; a zero
    scale makes every score 0) plus ``bias`` (the largest magnitude a score function adds) and
    the largest finite entry of a float ``mask`` beyond :data:`SCORE_LIMIT`. Float64 inputs, and
    calls whose values cannot be read, answer False."""
    if query.dtype == torch.float64 or not bias < float("inf"):
        return False
    bound = 0.0 if scale == 0 else score_bound(query, key, max(abs(scale), 1.0))
    if bound is None or not may_check(query):
        return False
    room = SCORE_LIMIT - bound - bias
    if room < 0 or mask is None or mask.numel() == 0:
        return room < 0
    lo, hi = (float(x) for x in torch.aminmax(mask.detach()))  # one pass, no temporary
    if math.isfinite(lo) and math.isfinite(hi):
        return max(-lo, hi) > room
    return largest_finite(mask) > room  # (-inf entries mask keys: only the finite ones add to a score)


def overflowed(exact: torch.Tensor, got: torch.Tensor) -> bool:
    """Did ``got`` overflow where the float64 answer ``exact`` (same shape and dtype) did not: is
    it non-finite where ``exact`` is finite, or a row of zeros (an empty row) where ``exact`` is not?"""
    empty = (got == 0).all(-1, keepdim=True) & (exact != 0).any(-1, keepdim=True) & torch.isfinite(exact)
    return bool((torch.isfinite(exact) & ~torch.isfinite(got)).any() or empty.any())


def explain(backend: str, dtype: torch.dtype) -> str:
    """The reason a named backend gives for refusing such a call."""
    name = str(dtype).replace("torch.", "")
    return (
        f"the scores of this call, or its backward's products, leave float32's range (beyond ±3.4e38: a huge scale, "
        f"huge values, slopes or bias), where backend {backend!r} computes NaN, or an empty row of zeros where every "
        f"score rounds to -inf, for these {name} inputs while the exact answer is finite and not empty; "
        "backend='auto' answers such calls in float64 (or pass float64 inputs)"
    )


__all__ = [
    "SCORE_LIMIT", "Symptoms", "explain", "largest_finite", "may_check", "overflowed", "score_bound", "scores_may_overflow",
    "suspect", "symptoms",
]  # fmt: skip
