"""Non-finite inputs are never hidden: the rows they reach come out NaN, on every backend.

Backends disagree on NaN and infinity (torch's CPU flash kernel turns a NaN query row into
zeros; the math path spreads a NaN value through every row that multiplies it by a zero
weight), so qkv states one rule and enforces it after any backend has run (on a GPU without a
device sync):

    row (b, h, i) of the output and of the lse is NaN when query row i holds a NaN or ±inf,
    or when any key or value of (b, key/value head of h) does.

Every other row is computed as usual: heads and rows never mix in attention, so a bad row
cannot leak into a good one.

Shape legend: ``...`` batch dims, ``Hq``/``Hk`` query and key/value heads, ``Nq`` query rows.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def nonfinite_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Bool ``(..., Hq, Nq)`` (``(Nq,)`` for 2-D inputs): the rows the rule makes NaN.

    Shapes as :func:`qkv.attention` takes them (batch dims may broadcast; Hk divides Hq).
    """
    bad_q = ~torch.isfinite(query).all(-1)  # (..., Hq, Nq)
    bad_kv = ~(torch.isfinite(key).all(-1).all(-1) & torch.isfinite(value).all(-1).all(-1))  # (..., Hk)
    if query.dim() == 2:
        return bad_q | bad_kv  # (Nq,) | ()
    hq, hk = query.shape[-3], key.shape[-3]
    if hk not in (1, hq) and hk > 0:
        bad_kv = bad_kv.repeat_interleave(hq // hk, dim=-1)  # query head h reads key/value head h // G
    return bad_q | bad_kv.unsqueeze(-1)


def poison(
    out: torch.Tensor, lse: Optional[torch.Tensor], bad: torch.Tensor
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Add NaN to the ``bad`` rows of ``out (..., Nq, Dv)`` and ``lse (..., Nq)``.

    Added rather than written, so gradients still flow (as NaN) through those rows.
    """
    nan = float("nan")
    out = out + torch.where(bad, nan, 0.0).to(out.dtype).unsqueeze(-1)
    if lse is not None:
        lse = lse + torch.where(bad, nan, 0.0).to(lse.dtype)
    return out, lse


def guard(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Apply the rule to a backend's ``out``/``lse``.

    On a CPU (outside ``torch.compile`` and ``torch.func`` transforms) three sums decide first —
    a NaN or infinity anywhere makes them non-finite — so finite inputs, the usual case, cost
    three reductions. Elsewhere the rows are marked without reading anything back, so the call
    never waits on the device.
    """
    if query.is_cpu and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active():
        total = float(query.detach().sum()) + float(key.detach().sum()) + float(value.detach().sum())
        if math.isfinite(total):  # a huge but finite sum lands below, where it is checked exactly
            return out, lse
    return poison(out, lse, nonfinite_rows(query, key, value))


__all__ = ["guard", "nonfinite_rows", "poison"]
