"""What every self-contained page qkv writes shares: one jinja2 environment over ``templates/``,
inline assets, JSON for a ``<script>`` element, and 16-bit weights in base64.

The pages (the trace stepper, the attention report, the comparison) carry their script, style
and data inline, so a page is one file that works offline and in a notebook's iframe.
"""

from __future__ import annotations

import base64
import json
from functools import lru_cache
from importlib import resources
from typing import Any

import numpy as np
from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup


@lru_cache(maxsize=None)
def environment() -> Environment:
    """The jinja2 environment of ``qkv/viz/templates`` (autoescaped; undefined names are errors)."""
    return Environment(loader=PackageLoader("qkv.viz", "templates"), autoescape=True, trim_blocks=True,
                       lstrip_blocks=True, undefined=StrictUndefined)


@lru_cache(maxsize=None)
def asset(name: str) -> Markup:
    """``templates/<name>`` (a script or a style sheet) as markup to inline into a page."""
    text = resources.files("qkv.viz").joinpath("templates", name).read_text(encoding="utf-8")
    if "</script" in text.lower() or "</style" in text.lower():  # would end the inline element early
        raise RuntimeError(f"templates/{name} must not contain a closing script or style tag")
    return Markup(text)


def script_json(data: Any) -> Markup:
    """``data`` as JSON that is safe inside an inline ``<script>`` element."""
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    # Inside <script> only "</" can end the element; escaping <, > and & covers it and "<!--".
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    payload = payload.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return Markup(payload)


def encode_weights(a: np.ndarray) -> str:
    """Weights in [0, 1] as base64 little-endian uint16 (value / 65535: 1.5e-5 steps)."""
    q = np.round(np.clip(a, 0.0, 1.0) * 65535.0).astype("<u2")
    return base64.b64encode(q.tobytes()).decode("ascii")


def decode_weights(b64: str, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`encode_weights`: base64 little-endian uint16 → float weights of ``shape``."""
    return (np.frombuffer(base64.b64decode(b64), dtype="<u2").astype(np.float64) / 65535.0).reshape(shape)


__all__ = ["asset", "decode_weights", "encode_weights", "environment", "script_json"]
