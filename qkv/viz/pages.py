"""What every qkv page shares: the jinja2 templates, inline assets, safe inline JSON, and the
16-bit encoding of attention weights the pages decode."""

from __future__ import annotations

import base64
import html
import json
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import numpy as np

from ..extras import require

if TYPE_CHECKING:
    from jinja2 import Environment

__all__ = ["environment", "asset", "script_json", "markup", "encode_weights", "decode_weights", "iframe"]


def encode_weights(a: np.ndarray) -> str:
    """Weights in [0, 1] as base64 little-endian uint16 (value / 65535): how pages embed maps."""
    q = np.round(np.clip(a, 0.0, 1.0) * 65535.0).astype("<u2")  # 16 bits: weights to 1.5e-5
    return base64.b64encode(q.tobytes()).decode("ascii")


def decode_weights(b64: str, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of the page's encoding: base64 little-endian uint16 → float weights of ``shape``."""
    return (np.frombuffer(base64.b64decode(b64), dtype="<u2").astype(np.float64) / 65535.0).reshape(shape)


def markup(text: str) -> Any:
    """``text`` marked safe for the templates (markupsafe's Markup: inlined scripts and styles)."""
    return require("markupsafe", "qkv's HTML pages").Markup(text)


def script_json(data: Any) -> Any:
    """``data`` as JSON that is safe inside an inline ``<script>`` element (a jinja2 Markup)."""
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    # Inside <script> only "</" can end the element; escaping <, > and & covers it and "<!--".
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    payload = payload.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return markup(payload)


@lru_cache(maxsize=None)
def environment(package: str = "qkv.viz") -> "Environment":
    """The jinja2 environment of a package's page templates (``<package>/templates``), autoescaping."""
    jinja2 = require("jinja2", "qkv's HTML pages")
    return jinja2.Environment(
        loader=jinja2.PackageLoader(package, "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )


@lru_cache(maxsize=None)
def asset(name: str, package: str = "qkv.viz") -> str:
    """The text of ``<package>/templates/<name>`` (a script or style sheet to inline into a page)."""
    text = resources.files(package).joinpath("templates", name).read_text(encoding="utf-8")
    if "</script" in text.lower() or "</style" in text.lower():  # would end the inline element early
        raise RuntimeError(f"templates/{name} must not contain a closing script or style tag")
    return text


def iframe(page: str, height: int) -> str:
    """A whole self-contained page as one sandboxed ``<iframe srcdoc=…>`` (scripts run; the page
    cannot reach the notebook around it): how qkv's interactive views show in a notebook."""
    return (f'<iframe srcdoc="{html.escape(page, quote=True)}" style="width:100%;height:{height}px;'
            'border:1px solid #ddd" sandbox="allow-scripts"></iframe>')
