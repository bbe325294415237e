"""Pictures of attention, drawn from results that :mod:`qkv.analysis` computes: heatmaps (PNG), an
interactive offline page (HTML) and the comparison page. (The glass box's own page and figure
live with it, in :mod:`qkv.glass`.) Views only
draw: the analyses (``explain``, ``compare``, ``explain_cross_attention``) live in
:mod:`qkv.analysis`.

Every report speaks English or Chinese (``lang="en"`` / ``"zh"``).

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

__all__ = [
    "save_png", "save_html", "render_html",
    "save_compare_png", "save_compare_html", "render_compare_html",
]
