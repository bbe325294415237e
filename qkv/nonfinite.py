"""Non-finite inputs are never hidden: the rows they reach come out NaN, on every backend.

Backends disagree on NaN and infinity (torch's CPU flash kernel turns a NaN query row into
zeros; the math path spreads a NaN value through every row that multiplies it by a zero
weight), so qkv states one rule and enforces it after any backend has run (on a GPU without a
device sync):

    row (b, h, i) of the output and of the lse is NaN when query row i holds a NaN or ±inf,
    or when any key or value of (b, key/value head of h) does.

Every other row is computed as usual: heads and rows never mix in attention, so a bad row
cannot leak into a good one.

Gradients: ``dk`` and ``dv`` of a key/value head are NaN (every key) when any row reading it
is bad, and ``dq`` of every row reading a head with a NaN or infinite key or value is NaN —
even where masks or padding exclude the bad entry, since kernels that skip masked keys would
return zeros where others return NaN (:func:`gradient_rule` states the answer for all). The
``dq`` of a NaN or infinite query row itself is what the formula gives, entry by entry, as
torch's own kernels give it.

Statistics (``qkv.inspect``) of a bad row: every float statistic NaN, no top-k keys (-1), and
``n_keys`` the number of keys its masks allow (the values never decide it).

Shape legend: ``...`` batch dims, ``Hq``/``Hk`` query and key/value heads, ``Nq`` query rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

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


def surely_finite(*tensors: torch.Tensor) -> bool:
    """True when the tensors certainly hold no NaN or infinity, decided cheaply: on a CPU
    (outside ``torch.compile`` and ``torch.func`` transforms) one sum each — a NaN or infinity
    anywhere makes it non-finite; a huge but finite sum answers False, to be checked exactly.
    Elsewhere False, so that nothing is read back from a device."""
    if not all(t.is_cpu for t in tensors) or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    return math.isfinite(sum(float(t.detach().sum()) for t in tensors))


class Checked(NamedTuple):
    """A backend's ``(out, lse)`` that already follow the rule: the backend saw every key and
    value while it ran (a decoding kernel reads the whole cache anyway), so :func:`guard`'s
    reductions, a second pass over K and V, are skipped."""

    out: torch.Tensor
    lse: Optional[torch.Tensor]


def guard(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Apply the rule to a backend's ``out``/``lse``: finite inputs, the usual case, cost the
    three reductions of :func:`surely_finite`; otherwise the rows are marked without reading
    anything back, so the call never waits on a device."""
    if surely_finite(query, key, value):
        return out, lse
    return poison(out, lse, nonfinite_rows(query, key, value))


def gradient_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule for gradients (module docstring), in the grouped layout: q ``(B, Hk, G, Nq, D)``,
    k/v ``(B, Hk, 1, Nk, ·)`` and gradients of the same shapes."""
    if surely_finite(q, k, v):
        return dq, dk, dv
    kv_bad = ~(torch.isfinite(k).flatten(2).all(-1) & torch.isfinite(v).flatten(2).all(-1))  # (B, Hk)
    heads = kv_bad | ~torch.isfinite(q).flatten(2).all(-1)  # (B, Hk): some row reading the head is bad
    nan = float("nan")
    at = lambda m: m[:, :, None, None, None]  # noqa: E731  (B, Hk) -> broadcast over (G|1, N, D)
    return dq.masked_fill(at(kv_bad), nan), dk.masked_fill(at(heads), nan), dv.masked_fill(at(heads), nan)


__all__ = ["Checked", "gradient_rule", "guard", "nonfinite_rows", "poison", "surely_finite"]
