"""JSON round-trips for trace arrays: ``None`` spells a masked (−∞) or non-finite cell.

``to_json`` rounds (optionally) and turns every non-finite value into ``None``; ``from_json``
reads ``None`` back as −∞, the only non-finite value a trace step holds.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["to_json", "from_json"]


def to_json(a: Optional[np.ndarray], precision: Optional[int] = None) -> Any:
    """Nested lists (or a scalar) for ``a``; non-finite cells become ``None``."""
    if a is None:
        return None
    if precision is not None:
        a = np.round(a, precision)
    obj = np.where(np.isfinite(a), a, np.nan).astype(object)
    obj[~np.isfinite(a)] = None  # −∞ (masked) has no JSON spelling
    return obj.tolist() if obj.ndim else obj.item()


def from_json(a: Any) -> Optional[np.ndarray]:
    """float64 array from ``to_json``'s output; ``None`` cells read back as −∞."""
    if a is None:
        return None
    arr = np.array(a, dtype=object)
    out = np.where(arr == None, -np.inf, arr)  # noqa: E711  (elementwise test for null)
    return out.astype(np.float64)
