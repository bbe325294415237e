"""Pictures of attention, drawn from results that :mod:`qkv.analysis` computes: heatmaps (PNG), an interactive offline page (HTML), and ``qkv explain``.

:func:`save_trace_page` writes a glass-box trace (or a whole encoder block) as one interactive
offline page: step through the computation, hover a cell to see where its number comes from.
:func:`save_trace_png` draws the same as one static figure for slides. Every report speaks
English or Chinese (``lang="en"`` / ``"zh"``).

:func:`explain` also reads sentence pairs (``pair=``) and ablates heads (``ablate=``);
:func:`compare` sets two texts side by side head by head; :func:`explain_cross_attention`
explains an encoder–decoder's cross-attention in the same report.

Importing this package needs neither torch nor matplotlib (each is imported when first used)::

    from qkv.viz import explain, save_png, save_html
    ex = explain("Alice is an engineer; she leads.", focus="she", target="alice")
    print(ex.to_string()); save_png(ex, "heads.png"); save_html(ex, "report.html")
"""

from __future__ import annotations

# The analyses are qkv.analysis's, re-exported so that `from qkv.viz import explain` keeps working.
# Through the submodules of the same names: loading them here first keeps `qkv.viz.explain` and
# `qkv.viz.compare` the functions (a submodule loaded later would replace the package attribute).
from .compare import Comparison, compare, save_compare_html, save_compare_png
from .explain import (
    Explanation,
    explain,
    explain_attentions,
    explain_cross_attention,
    match_word,
)
from .html import render_html, save_html
from .png import save_png
from .trace_page import render_trace_page, save_trace_page
from .trace_png import save_trace_png, trace_figure

__all__ = [
    "Explanation", "explain", "explain_attentions", "explain_cross_attention", "match_word", "save_png", "save_html", "render_html",
    "save_trace_png", "trace_figure", "render_trace_page", "save_trace_page",
    "Comparison", "compare", "save_compare_png", "save_compare_html",
]
