"""What every qkv figure shares: pyplot on Agg, fonts that can draw the labels' language, token ticks.

Used by the explanation heatmaps (:mod:`qkv.viz.png`), the comparison figure
(:mod:`qkv.viz.compare`) and the glass-box figure (:mod:`qkv.glass.png`).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Optional, Sequence

from ..extras import require

__all__ = ["pyplot", "cjk_font", "drawable", "fonts_for", "tick_labels", "CMAP"]

CMAP = "viridis"  # the colour map of every attention heatmap
_KNOWN_CJK = (
    "Noto Sans CJK SC", "Noto Sans SC", "Source Han Sans SC", "Source Han Sans CN", "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei", "Microsoft YaHei", "SimHei", "PingFang SC", "Hiragino Sans GB", "Heiti SC",
    "Noto Sans CJK JP", "Noto Sans CJK TC", "AR PL UMing CN", "AR PL UKai CN", "Droid Sans Fallback",
)
_PROBE = "注意力词元输出"  # characters a Chinese figure certainly uses


def matplotlib_module() -> Any:
    """The matplotlib package, or :class:`~qkv.extras.MissingExtra` naming the ``viz`` extra."""
    return require("matplotlib", "qkv's figures (PNG)")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, quiet about CJK fonts without a bold face."""
    import logging

    mpl = matplotlib_module()

    fonts_log = logging.getLogger("matplotlib.font_manager")
    if fonts_log.level == logging.NOTSET:  # CJK fonts rarely ship a bold face; the regular one is fine
        fonts_log.setLevel(logging.ERROR)
    mpl.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@functools.lru_cache(maxsize=256)
def _charmap(path: str) -> frozenset[int]:
    from matplotlib.ft2font import FT2Font

    try:
        return frozenset(FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):
        return frozenset()


def _covers(path: str, text: str) -> bool:
    codes = _charmap(path)
    return all(ord(c) in codes for c in text if not c.isspace())


@functools.lru_cache(maxsize=None)
def cjk_font() -> Optional[str]:
    """The family name of a font that can draw Chinese, or None when this machine has none.

    ``QKV_CJK_FONT`` may name a font file (.ttf, .otf, .ttc), which is registered with matplotlib.
    """
    pyplot()
    from matplotlib import font_manager as fm

    path = os.environ.get("QKV_CJK_FONT")
    if path:
        if not os.path.isfile(path):
            warnings.warn(f"QKV_CJK_FONT={path!r} is not a file; looking for an installed CJK font instead", stacklevel=2)
        elif _covers(path, _PROBE):
            fm.fontManager.addfont(path)
            return fm.FontProperties(fname=path).get_name()
        else:
            warnings.warn(f"QKV_CJK_FONT={path!r} has no Chinese glyphs; looking for an installed CJK font instead",
                          stacklevel=2)
    fonts = {f.name: f.fname for f in fm.fontManager.ttflist}
    for name in _KNOWN_CJK:
        if name in fonts and _covers(fonts[name], _PROBE):
            return name
    for name, fname in sorted(fonts.items()):  # any other font that happens to cover Chinese
        if "last resort" not in name.lower() and _covers(fname, _PROBE):  # Last Resort draws placeholder boxes
            return name
    known = set(fonts.values())
    for fname in sorted(fm.findSystemFonts()):  # installed after matplotlib cached its font list
        if fname not in known and "lastresort" not in fname.lower().replace(" ", "") and _covers(fname, _PROBE):
            fm.fontManager.addfont(fname)
            return fm.FontProperties(fname=fname).get_name()
    return None


def drawable(text: str, families: Sequence[str]) -> bool:
    """Whether one of ``families`` has a glyph for every character of ``text``."""
    paths = [_find(f) for f in families]
    return all(any(_covers(p, c) for p in paths) for c in text if not c.isspace())


@functools.lru_cache(maxsize=32)
def _find(family: str) -> str:
    from matplotlib import font_manager as fm

    return fm.findfont(fm.FontProperties(family=[family]), fallback_to_default=True)


def fonts_for(lang: str) -> tuple[list[str], str]:
    """(font families to draw with, the language the labels can be drawn in): English, with a
    warning, when ``lang`` is "zh" and no font on this machine draws Chinese."""
    families = _families(lang)
    if families is None:
        warnings.warn("no font with Chinese glyphs was found, so the figure is drawn with English labels; "
                      "install one (e.g. apt-get install fonts-noto-cjk) or set QKV_CJK_FONT=/path/to/font.otf",
                      UserWarning, stacklevel=4)
        return ["DejaVu Sans"], "en"
    return families, lang


def _families(lang: str) -> Optional[list[str]]:
    if lang == "en":
        return ["DejaVu Sans"]
    name = cjk_font()
    return None if name is None else [name, "DejaVu Sans"]


_MAX_LABELS = 80  # more token labels than this are unreadable: show every k-th


def tick_labels(ax: Any, tokens: list[str], axis: str, highlight: tuple[int, ...] = ()) -> None:
    """Label ``axis`` ("x" or "y") of ``ax`` with ``tokens`` (every k-th beyond 80), ``highlight`` in bold red."""
    n = len(tokens)
    step = max(1, -(-n // _MAX_LABELS))
    pos = list(range(0, n, step))
    labels = [tokens[i] for i in pos]
    if axis == "x":
        ax.set_xticks(pos)
        ax.set_xticklabels(labels, rotation=90, fontsize=8)
        ticks = ax.get_xticklabels()
    else:
        ax.set_yticks(pos)
        ax.set_yticklabels(labels, fontsize=8)
        ticks = ax.get_yticklabels()
    for p, t in zip(pos, ticks, strict=False):  # matplotlib may add no label for an off-axis tick
        if p in highlight:
            t.set_color("crimson")
            t.set_fontweight("bold")
