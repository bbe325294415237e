"""Attention backends: each declares what it supports and explains what it does not.

``select(call, "auto")`` walks the order :mod:`.dispatch`'s table gives the call and returns the
first backend with no reasons against it; a named backend either runs or raises
:class:`BackendError` listing every reason — it never falls back silently.
"""

from __future__ import annotations

import logging
from typing import Iterator, Optional, Sequence

import torch

from ..call import AttentionCall
from .base import Backend, EngineFailed
from .chunked import ChunkedBackend
from .flex import FlexBackend
from .dispatch import ROUTES, Route, order_names, plain_sdpa_call, route
from .math import MathBackend
from .sdpa import SdpaBackend
from .triton import TritonBackend

_log = logging.getLogger("qkv")


def debug_logged() -> bool:
    """Is qkv's debug log on, outside a traced graph? Tracing is asked first: ``torch.compile``
    reads ``is_compiling()`` as a constant and never reaches the logger (a logger method in a
    traced function is a graph break)."""
    return not torch.compiler.is_compiling() and _log.isEnabledFor(logging.DEBUG)


BACKENDS: dict[str, Backend] = {
    b.NAME: b for b in (SdpaBackend(), ChunkedBackend(), MathBackend(), TritonBackend(), FlexBackend())
}


class BackendError(RuntimeError):
    """A backend was named (or ``auto`` searched) and nothing can run the call."""


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend={name!r} is unknown; choose 'auto' or one of {sorted(BACKENDS)}") from None


def auto_order(call: AttentionCall) -> list[Backend]:
    """Backends in the order ``auto`` tries them for this call (fastest first; :data:`.dispatch.ROUTES`)."""
    return [BACKENDS[n] for n in order_names(call)[0]]


def order_notes(call: AttentionCall) -> list[str]:
    """Why :func:`auto_order` put the backends in their order for this call (for logs and ``qkv info``)."""
    return order_names(call)[1]


def reasons_by_backend(call: AttentionCall) -> dict[str, list[str]]:
    """Every backend's reasons against ``call`` (an empty list means it can run it)."""
    return {name: b.not_supported_reasons(call) for name, b in BACKENDS.items()}


def run(call: AttentionCall, backend: str = "auto") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``select(call, backend).forward(call)``. An engine that fails in a way only trying shows
    (:class:`.base.EngineFailed`: a compiler error) gives its reason from then on: ``auto`` goes on
    to the next engine of its order (never back to one that failed), a named backend raises
    :class:`BackendError` with it.

    The debug log says which engine answered, once it has (:func:`ran`): the engine named there
    is the engine that ran, after any that failed on the way (each also a warning)."""
    if backend != "auto":
        chosen = select(call, backend)
        try:
            result = chosen.forward(call)
        except EngineFailed as e:
            raise BackendError(f"backend {backend!r} cannot run this call ({call.describe()}):\n  - {e}") from e
        if debug_logged():
            ran(call, chosen, backend)
        return result
    failed: list[str] = []
    for candidate in _runnable(call):
        try:
            result = candidate.forward(call)
        except EngineFailed as e:
            _log.warning("qkv.attention(%s): %s failed (%s); auto goes on to the next engine", call.describe(), candidate.NAME, e)
            failed.append(f"{candidate.NAME} failed ({e})")
            continue
        if debug_logged():
            ran(call, candidate, backend, failed)
        return result
    raise _nothing_runs(call, failed)


def _runnable(call: AttentionCall) -> Iterator[Backend]:
    """``auto``'s order for ``call``, the engines with a reason against it left out (each asked
    when reached: the first that can run the call is all a call usually costs)."""
    for candidate in auto_order(call):
        if not candidate.not_supported_reasons(call):
            yield candidate


def _nothing_runs(call: AttentionCall, failed: Sequence[str] = ()) -> BackendError:
    lines = [f"  {n}: {'; '.join(r)}" for n, r in reasons_by_backend(call).items() if r]
    lines += [f"  {f}" for f in failed]
    return BackendError(f"no backend can run this call ({call.describe()}):\n" + "\n".join(lines))


def ran(call: AttentionCall, engine: Backend, backend: str = "auto", failed: Sequence[str] = ()) -> None:
    """Log (debug) that ``engine`` answered ``call``: for ``auto`` with its order, the reasons of
    the engines it passed over (or their failures) and the table's notes; the record carries the
    engine's name as ``record.qkv_engine``."""
    kernel = getattr(engine, "kernel", None)  # chunked: which of its kernels (dispatch.KERNELS)
    what = engine.NAME + (f"'s {kernel(call)} kernel" if callable(kernel) else "")
    if backend != "auto":
        _log.debug("qkv.attention(%s): backend %s ran", call.describe(), what, extra={"qkv_engine": engine.NAME})
        return
    order = auto_order(call)
    before = order[: order.index(engine)] if engine in order else []
    passed = "; ".join(f"{b.NAME}: {', '.join(r)}" for b in before if (r := b.not_supported_reasons(call)))
    _log.debug(
        "qkv.attention(%s): auto ran %s (order %s)%s%s%s",
        call.describe(), what, " → ".join(b.NAME for b in order), "".join(f"; {f}" for f in failed),
        f"; cannot run it: {passed}" if passed else "", "".join(f"; {n}" for n in order_notes(call)),
        extra={"qkv_engine": engine.NAME},
    )  # fmt: skip


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
    chosen = next(_runnable(call), None)
    if chosen is None:
        raise _nothing_runs(call)
    return chosen


__all__ = [
    "Backend", "BackendError", "BACKENDS", "ROUTES", "Route", "auto_order", "get_backend", "order_notes",
    "plain_sdpa_call", "ran", "reasons_by_backend", "route", "run", "select",
]  # fmt: skip
