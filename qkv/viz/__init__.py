"""Pictures of attention: heatmaps (PNG), an interactive offline page (HTML), and ``qkv explain``.

Every report speaks English or Chinese (``lang="en"`` / ``"zh"``); :func:`save_trace_png` draws
a glass-box trace or a whole encoder block as one static figure for slides.

Importing this package needs neither torch nor matplotlib (each is imported when first used)::

    from qkv.viz import explain, save_png, save_html
    ex = explain("Alice is an engineer; she leads.", focus="she", target="alice")
    print(ex.to_string()); save_png(ex, "heads.png"); save_html(ex, "report.html")
"""

from __future__ import annotations

from .explain import Explanation, explain, explain_attentions, match_word
from .html import render_html, save_html
from .png import save_png
from .trace_png import save_trace_png, trace_figure

__all__ = [
    "Explanation", "explain", "explain_attentions", "match_word", "save_png", "save_html", "render_html",
    "save_trace_png", "trace_figure",
]
