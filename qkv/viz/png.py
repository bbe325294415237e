"""Attention heatmaps as PNG files (matplotlib, Agg backend: no screen needed).

:func:`save_png` draws, from an :class:`~qkv.analysis.explain.Explanation`:

* with maps: a grid of every layer × head as a small map (row = query, column = key; the focused
  head framed in red), and the focused head's full map with token labels and a colorbar;
* in statistics mode (no maps): the focus token's weight on every token, one row per layer·head.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ..locale import check_lang, messages
from .figure import CMAP, drawable, fonts_for, matplotlib_module, pyplot, tick_labels

__all__ = ["save_png", "figure"]


def figure(ex: Any, layer: Optional[int] = None, head: Optional[int] = None, lang: str = "en") -> Any:
    """The matplotlib figure for ``ex``; the big map shows ``(layer, head)``, default the top head's.

    ``lang`` ("en" or "zh") is the language of titles and axis labels; Chinese needs a CJK font
    (see :func:`qkv.glass.png.cjk_font`), without one the labels stay English with a warning.
    """
    matplotlib = matplotlib_module()

    check_lang(lang)
    layer, head = ex.select(layer, head)
    families, lang = fonts_for(lang)
    # token labels no installed font can draw become their index instead of empty boxes
    toks = [tok if drawable(tok, families) else f"#{k}" for k, tok in enumerate(ex.tokens)]
    keys = [tok if drawable(tok, families) else f"#{k}" for k, tok in enumerate(getattr(ex, "keys", ex.tokens))]
    with matplotlib.rc_context({"font.family": families}):
        return _figure(ex, layer, head, messages(lang, "png."), toks, keys)


def _figure(ex: Any, layer: int, head: int, tx: dict[str, str], toks: list[str], keys: list[str]) -> Any:
    plt = pyplot()
    L, H = ex.num_layers, ex.num_heads
    f, t = ex.focus_index, ex.target_index
    if ex.maps is None:
        return _stats_figure(plt, ex, tx, toks, keys)
    n = max(len(toks), len(keys))
    big = max(5.0, min(11.0, 0.28 * n + 2.5))
    fig = plt.figure(figsize=(H * 0.95 + big + 1.5, max(L * 0.95 + 1.2, big + 0.5)), dpi=100)
    gs = fig.add_gridspec(1, 2, width_ratios=[H * 0.95, big], wspace=0.12, left=0.04, right=0.97, top=0.9, bottom=0.16)
    grid = gs[0].subgridspec(L, H, wspace=0.08, hspace=0.08)
    for l in range(L):
        for h in range(H):
            ax = fig.add_subplot(grid[l, h])
            ax.imshow(ex.maps[l, h], cmap=CMAP, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
            ax.set_xticks([])
            ax.set_yticks([])
            if l == 0:
                ax.set_title(f"H{h}", fontsize=8)
            if h == 0:
                ax.set_ylabel(f"L{l}", fontsize=8, rotation=0, labelpad=12, va="center")
            if (l, h) == (layer, head):
                for s in ax.spines.values():
                    s.set_edgecolor("red")
                    s.set_linewidth(2.5)
    fig.text(0.04 + 0.5 * H * 0.95 / (H * 0.95 + big) * 0.9, 0.93, tx["grid"].format(L=L, H=H),
             ha="center", fontsize=11)
    ax = fig.add_subplot(gs[1])
    im = ax.imshow(ex.maps[layer, head], cmap=CMAP, vmin=0.0, interpolation="nearest")
    tick_labels(ax, keys, "x", (t,))
    tick_labels(ax, toks, "y", (f,))
    ax.set_xlabel(tx["key"])
    ax.set_ylabel(tx["query"])
    w = float(ex.focus_weights[layer, head, t])
    ax.set_title(tx["head"].format(layer=layer, head=head, a=toks[f], b=keys[t], w=w), fontsize=11)
    ax.add_patch(_rect(plt, (t - 0.5, f - 0.5)))
    start = getattr(ex, "pair_start", None)
    if start:  # a sentence pair: where the second text begins, on both axes
        ax.axvline(start - 0.5, color="#2a6cb0", linestyle="--", linewidth=1.2)
        ax.axhline(start - 0.5, color="#2a6cb0", linestyle="--", linewidth=1.2)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=tx["weight"])
    fig.suptitle(tx["suptitle"].format(model=ex.model_name, n=n), fontsize=13)
    return fig


def _rect(plt: Any, xy: tuple[float, float]) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle(xy, 1, 1, fill=False, edgecolor="red", linewidth=2)


def _stats_figure(plt: Any, ex: Any, tx: dict[str, str], toks: list[str], keys: list[str]) -> Any:
    L, H, N = ex.focus_weights.shape
    rows = ex.focus_weights.reshape(L * H, N)  # (L·H, N)
    fig, ax = plt.subplots(figsize=(min(24.0, 6 + N * 0.03), 10), dpi=100)
    im = ax.imshow(rows, cmap=CMAP, vmin=0.0, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(0, L * H, H))
    ax.set_yticklabels([f"L{l} H0" for l in range(L)], fontsize=8)
    tick_labels(ax, keys, "x", (ex.target_index,))
    ax.set_xlabel(tx["key"])
    ax.set_ylabel(tx["layer_head"])
    ax.set_title(tx["stats"].format(N=N, tok=toks[ex.focus_index], i=ex.focus_index), fontsize=11)
    fig.colorbar(im, ax=ax, label=tx["weight"])
    fig.tight_layout()
    return fig


def save_png(ex: Any, path: "str | os.PathLike[str]", layer: Optional[int] = None, head: Optional[int] = None,
             lang: str = "en") -> str:
    """Write the heatmaps of ``ex`` to ``path`` (PNG) and return the path; ``lang`` as in :func:`figure`."""
    plt = pyplot()
    fig = figure(ex, layer, head, lang)
    try:
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return os.fspath(path)
