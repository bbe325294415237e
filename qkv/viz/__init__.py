"""Pictures of attention, drawn from results that :mod:`qkv.analysis` computes: heatmaps (PNG), an
interactive offline page (HTML), the glass-box trace page, and the comparison page. Views only
draw: the analyses (``explain``, ``compare``, ``explain_cross_attention``) live in
:mod:`qkv.analysis`.

:func:`save_trace_page` writes a glass-box trace (or a whole encoder block) as one interactive
offline page: step through the computation, hover a cell to see where its number comes from.
:func:`save_trace_png` draws the same as one static figure for slides. Every report speaks
English or Chinese (``lang="en"`` / ``"zh"``).

Importing this package needs neither torch nor matplotlib (each is imported when first used)::

    from qkv.analysis import explain
    from qkv.viz import save_html, save_png
    ex = explain("Alice is an engineer; she leads.", focus="she", target="alice")
    print(ex.to_string()); save_png(ex, "heads.png"); save_html(ex, "report.html")
"""

from __future__ import annotations

from .compare import render_compare_html, save_compare_html, save_compare_png
from .html import render_html, save_html
from .png import save_png
from .trace_page import render_trace_page, save_trace_page
from .trace_png import save_trace_png, trace_figure

__all__ = [
    "save_png", "save_html", "render_html", "save_trace_png", "trace_figure", "render_trace_page", "save_trace_page",
    "save_compare_png", "save_compare_html", "render_compare_html",
]
