"""Pictures of a :class:`~qkv.analysis.compare.Comparison`: the PNG figure and the offline page.

The comparison itself (running the model on both texts, aligning tokens, distances) lives in
:mod:`qkv.analysis.compare`; this module only draws what it gives.
Shapes: ``L`` layers, ``H`` heads, ``Na`` / ``Nb`` tokens; ``distance (L, H)``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from ..locale import check_lang, messages, shorten
from .figure import CMAP, fonts_for, matplotlib_module, pyplot, tick_labels

if TYPE_CHECKING:  # the type drawn; views never run the analysis
    from ..analysis.compare import Comparison

__all__ = ["figure", "save_compare_png", "page_data", "render_compare_html", "save_compare_html"]


# -- pictures ------------------------------------------------------------------------------------


def figure(cmp: Comparison, layer: Optional[int] = None, head: Optional[int] = None, lang: str = "en") -> Any:
    """Four panels: the per-head distance grid, head (layer, head)'s map for A and for B, and B − A."""
    matplotlib = matplotlib_module()

    check_lang(lang)
    layer, head = cmp.select(layer, head)
    families, lang = fonts_for(lang)
    with matplotlib.rc_context({"font.family": families}):
        return _figure(cmp, layer, head, messages(lang, "compare_png."))


def _figure(cmp: Comparison, layer: int, head: int, tx: dict[str, str]) -> Any:

    plt = pyplot()
    a, b = cmp.a, cmp.b
    has_maps = a.maps is not None and b.maps is not None
    n = max(len(a.tokens), len(b.tokens))
    side = max(4.0, min(9.0, 0.25 * n + 2.0))
    fig, axes = plt.subplots(1, 4 if has_maps else 2, figsize=((4 if has_maps else 2) * side + 1, side + 1.2), dpi=100)
    im = axes[0].imshow(cmp.distance, cmap="magma", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
    axes[0].set_xlabel(tx["head"])
    axes[0].set_ylabel(tx["layer"])
    axes[0].set_title(tx["moved"].format(tok=a.tokens[a.focus_index]), fontsize=10)
    axes[0].add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="cyan", linewidth=2))
    fig.colorbar(im, ax=axes[0], fraction=0.046, pad=0.04)
    if has_maps:
        for ax, ex, name in ((axes[1], a, "A"), (axes[2], b, "B")):
            ax.imshow(ex.maps[layer, head], cmap=CMAP, vmin=0.0, vmax=1.0, interpolation="nearest")
            tick_labels(ax, ex.tokens, "x")
            tick_labels(ax, ex.tokens, "y", (ex.focus_index,))
            ax.set_title(tx["map"].format(name=name, l=layer, h=head), fontsize=10)
        diff, ia, _ = cmp.difference(layer, head)
        lim = max(1e-6, float(np.abs(diff).max()))
        im = axes[3].imshow(diff, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        tick_labels(axes[3], [a.tokens[i] for i in ia], "x")
        tick_labels(axes[3], [a.tokens[i] for i in ia], "y")
        axes[3].set_title(tx["diff"], fontsize=10)
        fig.colorbar(im, ax=axes[3], fraction=0.046, pad=0.04)
    else:  # long texts keep no maps: the focus rows on the aligned tokens
        x = np.arange(len(cmp.pairs))
        axes[1].bar(x - 0.2, [a.focus_weights[layer, head, i] for i, _ in cmp.pairs], 0.4, label="A")
        axes[1].bar(x + 0.2, [b.focus_weights[layer, head, j] for _, j in cmp.pairs], 0.4, label="B")
        tick_labels(axes[1], [a.tokens[i] for i, _ in cmp.pairs], "x")
        axes[1].legend()
        axes[1].set_title(tx["rows"].format(tok=a.tokens[a.focus_index], l=layer, h=head), fontsize=10)
    fig.suptitle(f"{a.model_name}: A = “{shorten(a.text, 80)}”   B = “{shorten(b.text, 80)}”", fontsize=11)
    fig.tight_layout()
    return fig


def save_compare_png(cmp: Comparison, path: "str | os.PathLike[str]", layer: Optional[int] = None,
                     head: Optional[int] = None, lang: str = "en") -> str:
    """Write :func:`figure` to ``path`` (PNG) and return the path."""

    fig = figure(cmp, layer, head, lang)
    try:
        fig.savefig(path, format="png")
    finally:
        pyplot().close(fig)
    return os.fspath(path)


def page_data(cmp: Comparison, layer: Optional[int] = None, head: Optional[int] = None) -> dict[str, Any]:
    """The data the comparison page draws from (JSON-ready; maps as 16-bit base64 like the report)."""
    from .html import MAX_HTML_MAP_BYTES
    from .pages import encode_weights as encode

    layer, head = cmp.select(layer, head)
    a, b = cmp.a, cmp.b
    L, H = cmp.num_layers, cmp.num_heads
    small = all(ex.maps is not None and ex.maps.size * 2 <= MAX_HTML_MAP_BYTES for ex in (a, b))
    side = lambda ex: {  # noqa: E731
        "text": ex.text, "tokens": list(ex.tokens), "focus": ex.focus_index, "target": ex.target_index,
        "rows": encode(ex.focus_weights), "maps": encode(ex.maps) if small else None,
    }
    return {
        "model": a.model_name, "num_layers": L, "num_heads": H, "a": side(a), "b": side(b),
        "pairs": [[i, j] for i, j in cmp.pairs], "distance": np.round(cmp.distance, 4).tolist(),
        "initial": {"layer": layer, "head": head}, "notes": list(cmp.notes),
        "encoding": "base64 little-endian uint16, weight = value / 65535",
    }


def _page_text(lang: str) -> dict[str, Any]:
    """The page's words in ``lang`` (catalogue area ``compare_page.``), the table's column heads
    (``cols.0`` …) gathered into the list ``"cols"``."""
    words = messages(lang, "compare_page.")
    tx: dict[str, Any] = {key: value for key, value in words.items() if not key.startswith("cols.")}
    tx["cols"] = [words[f"cols.{i}"] for i in range(sum(key.startswith("cols.") for key in words))]
    return tx


def render_compare_html(cmp: Comparison, layer: Optional[int] = None, head: Optional[int] = None,
                        lang: str = "en") -> str:
    """The comparison as one offline page: the distance grid (click a head), both maps and B − A;
    ``lang`` ("en" or "zh") is the language of every label."""
    from .pages import asset, environment, markup, script_json

    tx = _page_text(check_lang(lang))
    data = page_data(cmp, layer, head)
    data["labels"] = {k: tx[k] for k in ("head_title", "rows_title", "cols")}
    return environment().get_template("compare.html.j2").render(
        data_json=script_json(data), script=markup(asset("compare.js")), t=tx,
        title=tx["title"].format(model=cmp.a.model_name), a=cmp.a.text, b=cmp.b.text,
        report=cmp.to_string(lang=lang),
    )


def save_compare_html(cmp: Comparison, path: "str | os.PathLike[str]", layer: Optional[int] = None,
                      head: Optional[int] = None, lang: str = "en") -> str:
    """Write :func:`render_compare_html` to ``path`` and return the path."""
    page = render_compare_html(cmp, layer, head, lang)  # first: a bad head must not leave an empty file
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return os.fspath(path)
