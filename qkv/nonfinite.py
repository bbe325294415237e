"""Non-finite inputs are never hidden: one rule for every backend, forward and backward.

Backends disagree on NaN and infinity (torch's CPU flash kernel turns a NaN query row into
zeros; the math path spreads a NaN value through every row that multiplies it by a zero
weight; kernels that skip masked keys never see a bad one there), so qkv states one rule and
applies it after any backend has run (:func:`guard`; on a GPU without a device sync).

**Bad rows.** Row (b, h, i) of the output is *bad* when

1. query row i of (b, h) holds a NaN or ±inf, or
2. any key or value of (b, key/value head of h) does, or
3. the bias a built-in score function (:mod:`qkv.score_mods`) adds for query head h holds a
   NaN or ±inf at some (query row, key) offset of the call — its kernel form's ``rel[h, :]``:
   ALiBi's slope h times every offset, the entries of a relative-bias table's column h that
   the call's offsets reach (a bias that overflows the compute dtype counts too; for finite
   slopes and tables :mod:`qkv.overflow` then answers the call in float64 on the CPU).

Masks (causal, window, key padding, a bool or block-sparse ``attn_mask``) decide which keys a
row weighs, never whether an input is bad: a bad key, value or bias entry makes its rows bad
even where every row masks it out, and a fully masked bad row is bad.

**Forward.** A bad row's output and lse are NaN (sinks or not), and so is the lse of any row
whose output comes out NaN (never ``-inf`` beside a NaN output). Every other row is computed as
usual: heads and rows never mix in attention, so a bad row cannot leak into a good one.

**Gradients.** An input that a bad row reads gets a NaN gradient — whatever the masks, and
whatever the upstream gradient of that row. So does one that a row reads whose output the
formula made NaN from finite q, k, v (see below: a float mask, a Python score function):

- ``dq`` of a bad row: NaN in every entry — but a row bad through its own query alone (its
  head's keys, values and bias fine) whose every product ``q·k`` with its head's keys is
  ``-inf`` (its infinite entries all meet keys of the opposite sign) has nothing to attend to,
  whatever the masks, and keeps the formula's ``dq`` of 0, as torch's kernels give it
  (:func:`nothing_to_attend`);
- ``dk`` and ``dv`` of every key of a (b, key/value head) that some bad row reads;
- a built-in score function's tensors: NaN in every entry that a query head with a bad row
  reads (ALiBi: that head's slope; a relative-bias table: that head's column, at the buckets
  the call's offsets reach — the gradient reaches them through the kernel form's ``rel``); the
  tensors a Python callable reads get the formula's gradients;
- ``sinks``: NaN at a query head with a bad row;
- a float ``attn_mask``: NaN on those rows (every key).

Every other gradient is the formula's (finite for finite inputs and upstream gradients).

**What the formula decides.** A float ``attn_mask`` is part of the scores: ``-inf`` masks a
key, and a NaN or ``+inf`` entry makes its row's output NaN wherever the other masks let the row
see that key (the forward of every backend agrees; the rule above then unifies the gradients).
A score function given as a Python callable is opaque — qkv cannot tell which of its tensors'
entries it reads for which head — so its scores enter the softmax as it returns them, with the
same consequence for a row it makes NaN. ``sinks`` are checked when the call is validated (NaN
and ``+inf`` refused; ``-inf`` means no sink), so they only ever receive the rule's gradients.

**Where it is applied.** Every backend ends its forward in :func:`guard` with every tensor of
the call the rule names (``qkv.backends.base.follow_rule``), and :func:`qkv.attention`'s fast
path calls it too, so the rule holds in one place whatever a kernel skipped; the CPU and Triton
decoding kernels, which read every key and value anyway, check q, k and v themselves
(:class:`Checked`). On a CPU, finite inputs cost one sum per tensor (:func:`surely_finite`) and
anything else the torch form below. On a GPU, :mod:`qkv.nonfinite_device` enforces the same rule
with three Triton kernels and no host sync: one scan of q, k and v, the bad rows' NaN written
into the engine's output in place, and the gradients the engine produced fixed in place behind
an identity placed before it (:func:`gate`); each returns at once when the scan found nothing.
There the output is read only where the formula can make a row NaN (a float mask, a Python
score function), and a row the formula made NaN passes NaN to its ``dq`` too.

Statistics (``qkv.inspect``) of a bad row: every float statistic NaN, no top-k keys (-1), and
``n_keys`` the number of keys its masks allow (the values never decide it).

Shape legend: ``...`` batch dims, ``Hq``/``Hk`` query and key/value heads, ``Nq``/``Nk`` query
and key rows, ``L`` a score function's offsets (``Nq + Nk - 1``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from . import nonfinite_device


def gate(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, sinks: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> Optional[dict[str, Optional[torch.Tensor]]]:  # fmt: skip
    """The tensors to hand an engine for a call with gradients on a GPU, by role (``query``,
    ``key``, ``value``, ``sinks``, ``mask``): identity views behind which the rule fixes the
    gradients the engine produces, in place (:mod:`qkv.nonfinite_device`); :func:`guard` then
    finds the call's flags on the query it is given. None where there is nothing to gate (no
    gradient, a CPU, ``torch.compile``/``torch.func``, or a structure the kernels leave to the
    torch form): the engine reads the tensors as they are."""
    return nonfinite_device.gate(query, key, value, sinks, mask)


def bad_parts(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two causes of a bad row (module docstring), apart: bool query rows ``(..., Hq, Nq)``
    holding a NaN or ±inf, and bool query heads ``(..., Hq)`` reading a bad key, value or bias
    (``(Nq,)`` and ``()`` for 2-D inputs). ``bias``: a built-in score function's ``rel (Hq, L)``."""
    bad_q = ~torch.isfinite(query).all(-1)  # (..., Hq, Nq)
    bad_kv = ~(torch.isfinite(key).all(-1).all(-1) & torch.isfinite(value).all(-1).all(-1))  # (..., Hk)
    bad_bias = None if bias is None else ~torch.isfinite(bias).all(-1)  # (Hq,)
    if query.dim() == 2:
        return bad_q, (bad_kv if bad_bias is None else bad_kv | bad_bias.any())  # (Nq,), ()
    hq, hk = query.shape[-3], key.shape[-3]
    if hk not in (1, hq) and hk > 0:
        bad_kv = bad_kv.repeat_interleave(hq // hk, dim=-1)  # query head h reads key/value head h // G
    return bad_q, (bad_kv if bad_bias is None else bad_kv | bad_bias)


def nonfinite_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Bool ``(..., Hq, Nq)`` (``(Nq,)`` for 2-D inputs): the bad rows (module docstring).

    Shapes as :func:`qkv.attention` takes them (batch dims may broadcast; Hk divides Hq);
    ``bias``: a built-in score function's ``rel (Hq, L)``, or None.
    """
    rows, heads = bad_parts(query, key, value, bias)
    return rows | heads.unsqueeze(-1)


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
    """A backend's ``(out, lse)`` that already follow the rule: the backend applied it (through
    :func:`guard`, with the tensors of the call only it knows: the score function's bias, the
    sinks, a float mask), or saw every key and value while it ran (a decoding kernel reads the
    whole cache anyway), so :func:`guard`'s reductions, a second pass over K and V, are skipped."""

    out: torch.Tensor
    lse: Optional[torch.Tensor]


def guard(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor] = None,
    *, bias: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
    opaque: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:  # fmt: skip
    """Apply the rule, forward and backward, to a backend's ``out (..., Hq, Nq, Dv)`` and ``lse
    (..., Hq, Nq)``.

    ``bias``: a built-in score function's ``rel (Hq, L)`` (differentiable: its gradient reaches
    the slopes or the table); ``sinks (Hq,)`` and a float ``mask`` (broadcastable to the scores)
    only receive the rule's gradients; ``opaque``: the call has a Python score function (which,
    like a float mask, can make a row NaN). Finite inputs, the usual case, cost the reductions
    of :func:`surely_finite` on a CPU; otherwise the rows are marked without reading anything
    back, so the call never waits on a device, and where gradients are wanted
    :class:`_GradientRule` adds the rule's NaN to every gradient a bad row reaches, whatever the
    backend computed there. On a GPU (:func:`qkv.nonfinite_device.use_kernels`) three Triton
    kernels do it instead: one scan, a poison written in place, and (behind the gate a call's
    engine reads through, :func:`gate`) a fix of the gradients in place; see
    :mod:`qkv.nonfinite_device`."""
    inputs = (query, key, value, bias, sinks, mask)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    # the output is checked too where it matters: a row the formula made NaN (a float mask's NaN
    # or +inf, a Python score function's NaN) gets a NaN lse, and passes NaN on as a bad row does
    watch = grad or lse is not None
    if nonfinite_device.use_kernels(query, key, value, out, lse, bias):
        # off the CPU the output is read only where the formula can make a row NaN
        done = nonfinite_device.apply(query, key, value, out, lse, bias=bias, read_out=watch and (mask is not None or opaque))
        if done is not None:
            return done
    elif surely_finite(query, key, value, *([] if bias is None else [bias]), *([out] if watch else [])):
        return out, lse
    own, heads = bad_parts(query, key, value, bias)
    rows = own | heads.unsqueeze(-1)
    if watch:
        rows = rows | torch.isnan(out).any(-1)  # (..., Hq, Nq)
    if not grad:
        return poison(out, lse, rows)
    dq_rows = rows & (heads.unsqueeze(-1) | ~own | ~nothing_to_attend(query, key))
    res = _GradientRule.apply(rows, dq_rows, out, lse, *inputs)
    return (res, None) if lse is None else tuple(res)  # type: ignore[return-value]


def nothing_to_attend(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Bool ``(..., Hq, Nq)``: query rows whose every product ``q·k`` with the keys of their head
    is ``-inf`` — no NaN in the row, and each of its infinite entries meets keys all of the
    opposite sign (a zero would make NaN) — found from each key dim's extremes, not the products.
    Only for rows with an infinite entry is this ever true (finite products are finite)."""
    if key.shape[-2] == 0:
        return torch.ones(query.shape[:-1], dtype=torch.bool, device=query.device)
    kmax, kmin = key.amax(-2), key.amin(-2)  # (..., Hk, D)
    if query.dim() > 2:
        hq, hk = query.shape[-3], key.shape[-3]
        if hk not in (1, hq) and hk > 0:
            kmax, kmin = kmax.repeat_interleave(hq // hk, dim=-2), kmin.repeat_interleave(hq // hk, dim=-2)
        kmax, kmin = kmax.unsqueeze(-2), kmin.unsqueeze(-2)  # (..., Hq, 1, D)
    inf = float("inf")
    meets_negative = ((query != inf) | (kmax < 0)) & ((query != -inf) | (kmin > 0))
    return (meets_negative & ~torch.isnan(query)).all(-1) & torch.isinf(query).any(-1)


def _fit(bad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Bool ``bad`` reduced (any) over the dims that ``shape`` broadcasts (size 1, or missing in
    front), then expanded to ``shape`` (a view: the caller decides what to materialise)."""
    extra = bad.dim() - len(shape)
    if extra > 0:
        bad = bad.flatten(0, extra - 1).any(0)  # (flatten, not reshape(-1, ...): sizes may be 0)
    elif extra < 0:
        bad = bad.reshape((1,) * -extra + tuple(bad.shape))
    for d, (have, want) in enumerate(zip(bad.shape, shape)):
        if want == 1 and have != 1:
            bad = bad.any(d, keepdim=True)
    return bad.expand(shape)


def gradient_rule(rows: torch.Tensor, dq_rows: torch.Tensor, shapes: dict[str, Optional[torch.Size]]) -> dict[str, torch.Tensor]:
    """The rule for gradients (module docstring) as bool patterns, one per input: True where its
    gradient is NaN. ``rows``: the rows that pass NaN on — the bad rows (:func:`nonfinite_rows`)
    and those the formula made NaN; ``dq_rows``: those whose ``dq`` is NaN (a row bad through its
    own query alone keeps the formula's where it has nothing to attend to,
    :func:`nothing_to_attend`); ``shapes``: the inputs' shapes by name (``query``, ``key``,
    ``value``, ``bias``, ``sinks``, ``mask``; None for an absent one)."""
    if rows.dim() == 1:  # 2-D inputs: one head
        rows, dq_rows = rows.unsqueeze(0), dq_rows.unsqueeze(0)  # (1, Nq)
    with_bad = rows.any(-1)  # (..., Hq): query heads with a bad row
    hq = with_bad.shape[-1]
    key = shapes.get("key")
    hk = key[-3] if key is not None and len(key) >= 3 else 1
    if hk == hq or hk == 0:
        kv = with_bad
    elif hk == 1:
        kv = with_bad.any(-1, keepdim=True)
    else:
        kv = with_bad.unflatten(-1, (hk, hq // hk)).any(-1)  # (..., Hk): query head h reads key/value head h // G
    sources = {
        "query": dq_rows.unsqueeze(-1),  # (..., Hq, Nq, 1)
        "key": kv[..., None, None],  # (..., Hk, 1, 1)
        "value": kv[..., None, None],
        "bias": with_bad.unsqueeze(-1),  # (..., Hq, 1)
        "sinks": with_bad,  # (..., Hq)
        "mask": rows.unsqueeze(-1),  # (..., Hq, Nq, 1)
    }
    return {name: _fit(sources[name], shape) for name, shape in shapes.items() if shape is not None}


def _nan_where(pattern: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NaN where the bool ``pattern`` (an expanded view) is True, else 0, in ``dtype``: computed at
    the size the pattern has before its expansion and expanded again, so that only the sum
    autograd makes with the backend's gradient is full size."""
    base = pattern[tuple(slice(None) if st else slice(0, 1) for st in pattern.stride())]  # size 1 where expanded
    return torch.where(base, float("nan"), 0.0).to(dtype).expand(pattern.shape)


_ROLES = ("query", "key", "value", "bias", "sinks", "mask")


class _GradientRule(torch.autograd.Function):
    """``(out, lse)`` with the ``rows`` poisoned (:func:`poison`); backward: the upstream
    gradients pass on unchanged, and each input gets NaN where :func:`gradient_rule` says (0
    elsewhere), which autograd adds to what the backend gave it. So the rule holds however a
    backend's backward treats the entries its masks skip, in one place for every backend."""

    generate_vmap_rule = True

    @staticmethod
    def forward(rows, dq_rows, out, lse, *inputs):  # inputs: query, key, value, bias, sinks, mask (None when absent)
        out, lse = poison(out, lse, rows)
        return out if lse is None else (out, lse)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        rows, dq_rows, _, lse, *tensors = inputs
        ctx.save_for_backward(rows, dq_rows)
        ctx.shapes = {n: (t.shape if t is not None and t.is_floating_point() else None) for n, t in zip(_ROLES, tensors)}
        ctx.dtypes = [None if t is None else t.dtype for t in tensors]
        ctx.has_lse = lse is not None

    @staticmethod
    def backward(ctx, dout, dlse=None):
        rows, dq_rows = ctx.saved_tensors
        wanted = {n: s for i, (n, s) in enumerate(ctx.shapes.items()) if ctx.needs_input_grad[4 + i]}
        nans = gradient_rule(rows, dq_rows, wanted)
        grads = [None if n not in nans else _nan_where(nans[n], dt) for n, dt in zip(_ROLES, ctx.dtypes)]
        return (None, None, dout, dlse if ctx.has_lse else None, *grads)


__all__ = ["Checked", "bad_parts", "gate", "gradient_rule", "guard", "nonfinite_rows", "nothing_to_attend", "poison", "surely_finite"]
