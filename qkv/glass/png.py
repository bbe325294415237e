"""A glass-box trace as one static picture for slides (matplotlib, Agg backend: never a window).

:func:`save_trace_png` draws, for a :class:`~qkv.glass.trace.Trace`, the flow
X → Q, K, V → scores → ÷√d_k → (score function) → mask → softmax (with a sink) → weights·V →
output as labelled boxes and arrows, above annotated heatmaps of X, Q, K, V, the scaled (or
modified, or masked) scores, the weights and the output of one head. For a :class:`~qkv.glass.block.BlockTrace` the figure also shows the
embeddings, the positional encoding, the residual connections, both LayerNorms and the
feed-forward network. The narrated token's row is framed in every matrix that has one row per
query. Small matrices carry their numbers in the cells; long ones are drawn without numbers and
wide ones show their first :data:`MAX_COLS` feature columns (the title says so; query × key maps
always show every key).

Chinese labels (``lang="zh"``) need a font with CJK glyphs. :func:`cjk_font` looks for one
(``QKV_CJK_FONT=/path/to/font.otf`` first, then installed fonts such as Noto Sans CJK or
WenQuanYi). Without one the figure falls back to English labels and warns, rather than drawing
empty boxes for every character; token labels the fonts cannot draw become ``#i``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..locale import LANGUAGES, check_lang, messages
from ..viz.figure import cjk_font, drawable, fonts_for, matplotlib_module, pyplot
from .block import BlockTrace
from .render import fmt, short
from .trace import Trace

__all__ = ["save_trace_png", "trace_figure", "cjk_font", "MAX_COLS", "MAX_ANNOTATED_ROWS"]

MAX_COLS = 12  # wider matrices show their first 12 columns: more would be unreadable on a slide
MAX_ANNOTATED_ROWS = 12  # more rows than this: colours only, no numbers in the cells
# -- words -----------------------------------------------------------------------------------

_TEXT: dict[str, dict[str, str]] = {lang: messages(lang, "trace_png.") for lang in LANGUAGES}
"""This module's words in each language, from the catalogue (``qkv/locale/<lang>.json``, keys ``trace_png.*``)."""


@dataclass
class _Panel:
    step: str  # the Axes gid: which array the heatmap shows
    title: str
    array: np.ndarray
    rows: list[str]
    cols: list[str]
    frame_row: Optional[int]  # the narrated token's row, or None for matrices without query rows
    weights: bool = False


# -- the figure -------------------------------------------------------------------------------


def _resolve_token(tokens: Sequence[str], token: Union[int, str, None]) -> int:
    n = len(tokens)
    if token is None:
        return 0
    if isinstance(token, str):
        if token not in tokens:
            raise ValueError(f"token={token!r} is not one of the trace's tokens {list(tokens)}")
        return list(tokens).index(token)
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not -n <= token < n:
        raise ValueError(f"token={token!r} must be a token label or a 0-based index from {-n} to {n - 1}")
    return int(token) % n


def _resolve_head(t: Any, head: Optional[int]) -> tuple[Any, int, bool]:
    """(the single-head trace to draw, its index, whether it was chosen by default)."""
    if head is not None and (isinstance(head, bool) or not isinstance(head, (int, np.integer))):
        raise TypeError(f"head must be an int (0-based) or None, got {type(head).__name__}")
    if head is not None and not 0 <= head < t.num_heads:
        raise ValueError(f"head={head} is out of range; this trace has heads 0 to {t.num_heads - 1}")
    h = 0 if head is None else int(head)
    return (t if t.num_heads == 1 else t.heads[h]), h, head is None


def _attention_panels(t: Any, ht: Any, x: Optional[np.ndarray], tx: dict[str, str], i: int,
                      toks: list[str], block: bool) -> list[_Panel]:
    def dims(a: np.ndarray) -> list[str]:
        return [str(c) for c in range(a.shape[1])]

    out = []
    if x is not None and not block:
        out.append(_Panel("x", tx["t_x"], x, toks, dims(x), i))
    for name in ("q", "k", "v"):
        a = getattr(ht, name)
        out.append(_Panel(name, tx["t_" + name], a, toks, dims(a), i if name == "q" else None))
    if ht.modified is not None:
        text = (ht.score_mod or {}).get("text", "")
        out.append(_Panel("modified", tx["t_modified"].format(text=text), ht.modified, toks, toks, i))
        if ht.masked is not None:
            out.append(_Panel("masked", tx["t_masked_mod"], ht.masked, toks, toks, i))
    else:
        src = "masked" if ht.masked is not None else "scaled"
        out.append(_Panel(src, tx["t_" + src], getattr(ht, src), toks, toks, i))
    title = tx["t_weights"]
    if ht.sinks is not None:
        title = tx["t_weights_sink"].format(s=short(float(ht.sinks[0])))
    out.append(_Panel("weights", title, ht.weights, toks, toks, i, weights=True))
    out.append(_Panel("output", tx["t_output"], ht.output, toks, dims(ht.output), i))
    if t.projected is not None:
        out.append(_Panel("projected", tx["t_projected"], t.projected, toks, dims(t.projected), i))
    return out


def _block_panels(b: Any, tx: dict[str, str], i: int, toks: list[str]) -> tuple[list[_Panel], list[_Panel]]:
    def p(step: str, key: str) -> _Panel:
        a = getattr(b, step)
        return _Panel(step, tx[key], a, toks, [str(c) for c in range(a.shape[1])], i)

    before = [p("embeddings", "t_embeddings"), p("positional", "t_positional"), p("x", "t_x_block")]
    after = [p("residual1", "t_residual1"), p("norm1", "t_norm1"), p("ffn_hidden", "t_ffn_hidden"),
             p("ffn_relu", "t_ffn_relu"), p("ffn_out", "t_ffn_out"), p("residual2", "t_residual2"),
             p("output", "t_block_output")]
    return before, after


def _box(ax: Any, x: float, y: float, text: str, color: str) -> Any:
    return ax.text(x, y, text, ha="center", va="center", fontsize=9, gid="flow",
                   bbox=dict(boxstyle="round,pad=0.4", facecolor=color, edgecolor="#444", linewidth=1))


def _arrow(ax: Any, a: Any, b: Any, *, start: tuple[float, float] = (1.0, 0.5), end: tuple[float, float] = (0.0, 0.5),
           style: str = "arc3", color: str = "#333", dashed: bool = False) -> None:
    """An arrow from box ``a`` to box ``b``, edge to edge (points given as fractions of each box)."""
    ax.annotate("", xy=end, xycoords=b, xytext=start, textcoords=a,
                arrowprops=dict(arrowstyle="->", color=color, lw=1.2, shrinkA=4, shrinkB=4, connectionstyle=style,
                                linestyle="--" if dashed else "-"))


def _score_fn_label(info: Optional[dict[str, Any]], tx: dict[str, str]) -> Optional[str]:
    """The flow box of a score function, e.g. "score fn / softcap 30"; None without one."""
    if info is None:
        return None
    kind = info.get("kind")
    if kind == "softcap" and "cap" in info:
        what = tx["fn_softcap"].format(c=short(float(info["cap"])))
    elif kind == "alibi":
        what = tx["fn_alibi"]
    elif kind == "relative_bias":
        what = tx["fn_rel"]
    else:
        what = str(info.get("name", "score_mod"))
    return tx["modfn"].format(what=what)


def _attention_flow(ax: Any, tx: dict[str, str], masked: bool, score_fn: Optional[str] = None,
                    sink: bool = False) -> None:
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    xs = np.linspace(0.05, 0.95, 9)
    x_box = _box(ax, xs[0], 0.5, tx["X"], "#e8eefc")
    qkv = {name: _box(ax, xs[1], y, tx[name], "#fde8d8") for name, y in (("Q", 0.85), ("K", 0.5), ("V", 0.15))}
    for b in qkv.values():
        _arrow(ax, x_box, b)
    chain = [(tx["scores"], "#eef7e8"), (tx["scale"], "#eef7e8")]
    if score_fn is not None:
        chain.append((score_fn, "#e8f4f7"))
    chain += [(tx["mask" if masked else "nomask"], "#eef7e8"), (tx["softmax_sink" if sink else "softmax"], "#f3e8fc"),
              (tx["sum"], "#fff6d6"), (tx["out"], "#e8eefc")]
    boxes = [_box(ax, xs[k + 2], 0.5, text, color) for k, (text, color) in enumerate(chain)]
    for a, b in zip(boxes, boxes[1:]):
        _arrow(ax, a, b)
    _arrow(ax, qkv["Q"], boxes[0])
    _arrow(ax, qkv["K"], boxes[0])
    # V skips the scoring steps: along the bottom, then up into the weighted sum
    _arrow(ax, qkv["V"], boxes[-2], end=(0.5, 0.0), style="angle,angleA=0,angleB=90,rad=0")


def _block_flow(ax: Any, tx: dict[str, str]) -> None:
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    chain = [("E", "#e8eefc"), ("PE", "#e8eefc"), ("MHA", "#fde8d8"), ("add", "#eef7e8"), ("LN", "#f3e8fc"),
             ("FFN", "#fff6d6"), ("add", "#eef7e8"), ("LN", "#f3e8fc"), ("block_out", "#e8eefc")]
    xs = np.linspace(0.05, 0.95, len(chain))
    boxes = [_box(ax, xs[k], 0.3, tx[key], color) for k, (key, color) in enumerate(chain)]
    for a, b in zip(boxes, boxes[1:]):
        _arrow(ax, a, b)
    for a, b in ((1, 3), (4, 6)):  # the residual paths skip their sublayer
        _arrow(ax, boxes[a], boxes[b], start=(0.5, 1.0), end=(0.5, 1.0), style="arc3,rad=-0.3", color="#888",
               dashed=True)


def _heatmap(fig: Any, ax: Any, p: _Panel, tx: dict[str, str], precision: int) -> None:
    from matplotlib.patches import Rectangle

    a = p.array
    title = p.title
    if a.shape[1] > MAX_COLS and p.cols is not p.rows:  # feature columns are cut; a query × key map never
        title += "\n(" + tx["first_cols"].format(k=MAX_COLS, n=a.shape[1]) + ")"
        a = a[:, :MAX_COLS]
        cols = p.cols[:MAX_COLS]
    else:
        cols = p.cols
    shown = np.ma.masked_invalid(a)
    cmap = pyplot().get_cmap("Blues" if p.weights else "RdBu_r").with_extremes(bad="#cccccc")  # masked: grey
    if p.weights:  # up to the largest weight: near-uniform rows over many tokens stay visible
        vmin, vmax = 0.0, max(float(np.nanmax(np.where(np.isfinite(a), a, 0.0))), 1e-9)
    else:
        lim = float(np.max(np.abs(a[np.isfinite(a)]))) if np.isfinite(a).any() else 1.0
        vmin, vmax = -(lim or 1.0), (lim or 1.0)
    ax.imshow(shown, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    ax.set_gid(p.step)
    ax.set_title(title, fontsize=9)
    n_rows, n_cols = a.shape
    ax.set_yticks(range(n_rows) if n_rows <= 40 else range(0, n_rows, -(-n_rows // 40)))
    ax.set_yticklabels([p.rows[r] for r in ax.get_yticks()], fontsize=7)
    ax.set_xticks(range(n_cols) if n_cols <= 40 else range(0, n_cols, -(-n_cols // 40)))
    ax.set_xticklabels([cols[c] for c in ax.get_xticks()], fontsize=7,
                       rotation=45 if p.cols is p.rows else 0, ha="right" if p.cols is p.rows else "center")
    if n_rows <= MAX_ANNOTATED_ROWS and n_cols <= MAX_COLS:
        for r in range(n_rows):
            for c in range(n_cols):
                v = float(a[r, c])
                level = (v - vmin) / (vmax - vmin) if np.isfinite(v) else 0.0
                dark = level > 0.75 if p.weights else abs(level - 0.5) > 0.33
                ax.text(c, r, fmt(v, precision), ha="center", va="center", fontsize=7 if n_cols > 6 else 8,
                        color="white" if dark else "black", gid=f"cell:{r}:{c}")
    if p.frame_row is not None:
        ax.add_patch(Rectangle((-0.5, p.frame_row - 0.5), n_cols, 1, fill=False, edgecolor="crimson", linewidth=2.2,
                               clip_on=False))


def trace_figure(trace: Any, *, lang: str = "en", head: Optional[int] = None, token: Union[int, str, None] = None,
                 precision: int = 2) -> Any:
    """The matplotlib figure :func:`save_trace_png` saves (close it with ``plt.close(fig)``).

    Each heatmap's Axes has ``get_gid()`` = the step it shows (``"q"``, ``"weights"``, ``"norm1"`` …)
    and each number in a cell is a Text with gid ``"cell:row:col"``.
    """
    check_lang(lang)
    if not isinstance(trace, (Trace, BlockTrace)):
        raise TypeError(f"trace must be a qkv.glass Trace or BlockTrace, got {type(trace).__name__}")
    families, lang = fonts_for(lang)
    plt = pyplot()
    matplotlib = matplotlib_module()

    # Concrete family names (not "sans-serif"): each Text keeps them, so a later savefig outside
    # this context still draws Chinese with the CJK font and everything else with DejaVu Sans.
    with matplotlib.rc_context({"font.family": families, "axes.unicode_minus": False}):
        return _draw(plt, trace, BlockTrace, lang, head, token, precision, families)


def _draw(plt: Any, trace: Any, block_cls: type, lang: str, head: Optional[int], token: Union[int, str, None],
          precision: int, families: list[str]) -> Any:
    tx = _TEXT[lang]
    is_block = isinstance(trace, block_cls)
    t = trace.attention if is_block else trace
    i = _resolve_token(t.tokens, token)
    ht, h, default = _resolve_head(t, head)
    toks = [tok if drawable(tok, families) else f"#{k}" for k, tok in enumerate(t.tokens)]
    head_text = tx["head_of"].format(h=h, n=t.num_heads) + (tx["head_default"] if default and t.num_heads > 1 else "")
    panels = _attention_panels(t, ht, t.x, tx, i, toks, is_block)
    if is_block:
        before, after = _block_panels(trace, tx, i, toks)
        panels = before + panels + after
        ncols = 6
    else:
        ncols = 4
    nrows = -(-len(panels) // ncols)
    n = len(toks)
    cell_h = max(2.2, min(6.0, 0.25 * n + 1.4))
    flows = 2 if is_block else 1
    fig = plt.figure(figsize=(4.0 * ncols, 2.0 * flows + cell_h * nrows + 0.8), dpi=100)
    gs = fig.add_gridspec(flows + nrows, ncols, height_ratios=[2.0] * flows + [cell_h] * nrows,
                          hspace=0.7, wspace=0.35, left=0.05, right=0.98, top=0.93, bottom=0.06)
    if is_block:
        _block_flow(fig.add_subplot(gs[0, :]), tx)
    _attention_flow(fig.add_subplot(gs[flows - 1, :]), tx, ht.masked is not None, _score_fn_label(ht.score_mod, tx),
                    ht.sinks is not None)
    for k, p in enumerate(panels):
        ax = fig.add_subplot(gs[flows + k // ncols, k % ncols])
        _heatmap(fig, ax, p, tx, precision)
    tok = toks[i]
    if is_block:
        title = tx["block_title"].format(n=n, d=trace.d_model, f=trace.d_ff, head=head_text, i=i, tok=tok)
    else:
        title = tx["title"].format(n=n, head=head_text, i=i, tok=tok)
    meta = getattr(t, "meta", None) or {}
    if meta.get("model") is not None:  # a model's trace says where it comes from
        where = tx["meta"].format(model=meta["model"])
        if meta.get("layer") is not None:
            where += tx["meta_layer"].format(layer=meta["layer"])
        title = where + tx["meta_sep"] + title
    fig.suptitle(title, fontsize=13)
    return fig


def save_trace_png(trace: Any, path: "str | os.PathLike[str]", *, lang: str = "en", head: Optional[int] = None,
                   token: Union[int, str, None] = None) -> str:
    """Draw ``trace`` (a Trace or a BlockTrace) and write it to ``path`` as a PNG; returns the absolute path.

    ``head`` (0-based) picks the head a multi-head trace shows (head 0 by default, and the title
    says so); ``token`` (0-based index or label, default 0) is the row framed in red; ``lang`` is
    "en" or "zh" (Chinese needs a CJK font, see :func:`cjk_font`; without one the labels stay
    English and a warning says why).
    """
    fig = trace_figure(trace, lang=lang, head=head, token=token)
    plt = pyplot()
    try:
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return os.path.abspath(os.fspath(path))
