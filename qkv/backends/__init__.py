"""Attention backends: each declares what it supports and explains what it does not.

``select(call, "auto")`` walks the order :mod:`.dispatch`'s table gives the call and returns the
first backend with no reasons against it; a named backend either runs or raises
:class:`BackendError` listing every reason — it never falls back silently.
"""

from __future__ import annotations

import logging
from typing import Optional

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
    to the next engine, a named backend raises :class:`BackendError` with it."""
    while True:
        chosen = select(call, backend)
        try:
            return chosen.forward(call)
        except EngineFailed as e:
            if backend != "auto":
                raise BackendError(f"backend {backend!r} cannot run this call ({call.describe()}):\n  - {e}") from e
            _log.warning("qkv.attention(%s): %s failed (%s); auto goes on to the next engine", call.describe(), chosen.NAME, e)


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
    "Backend", "BackendError", "BACKENDS", "ROUTES", "Route", "auto_order", "get_backend", "order_notes",
    "plain_sdpa_call", "reasons_by_backend", "route", "run", "select",
]  # fmt: skip
