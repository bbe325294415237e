"""Older home of :func:`trace_model`: the glass-box trace of a real head now lives in
:mod:`qkv.analysis.glass` (it builds a :mod:`qkv.reference` trace, a layer above inspect).

Names are looked up there when first used, so importing this module imports nothing above it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["trace_model", "load_model", "MAX_TOKENS", "BUNDLED_NAME"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ..analysis import glass  # lazy and upward on purpose: a re-export for older imports

        return getattr(glass, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
