"""Turn a :class:`~qkv.glass.trace.Trace` into text for a terminal or HTML for a notebook.

Both renderers walk the same list of :class:`Block` s (one per matrix, in computation order),
so the terminal and the notebook always show the same steps with the same formulas.

Heads are counted from 0 (head 0 is the first), like tokens and the JSON. A matrix whose
columns are features (X, W, Q, K, V, outputs) and that is wider than :data:`WIDE_COLS` shows
its first and last columns, an ellipsis column and each row's length ``‖row‖``; one taller
than :data:`TALL_ROWS` shows its first and last rows. Token × token matrices (scores, weights)
always show every column: which key a query weighs is the point of them.
"""

from __future__ import annotations

import html
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from ..locale import LANGUAGES, check_lang, messages
from ..viz.pages import iframe

if TYPE_CHECKING:
    from .trace import Trace

__all__ = [
    "Block", "blocks", "fmt", "short", "vec", "root", "width", "format_matrix", "trace_to_string", "trace_to_html",
    "WIDE_COLS", "TALL_ROWS", "shown", "summary_note", "score_fn_formula", "score_fn_note",
    "STYLE", "html_table", "notebook_frame",
]

WIDE_COLS = 10
"""Feature matrices with more columns than this are summarised (first 4, …, last 2, ‖row‖)."""
TALL_ROWS = 64
"""Matrices with more rows than this (a model's 384-row W_Q) show their first 6 and last 2 rows."""
_HEAD_COLS, _TAIL_COLS, _HEAD_ROWS, _TAIL_ROWS = 4, 2, 6, 2

_SUB = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def fmt(value: float, precision: int = 3) -> str:
    """Fixed-point with ``precision`` decimals; ``-inf`` stays readable and ``-0.000`` loses its sign."""
    if np.isneginf(value):
        return "-inf"
    if np.isposinf(value):
        return "inf"
    s = f"{value:.{precision}f}"
    if s.startswith("-") and float(s) == 0.0:
        s = s[1:]
    return s


def short(value: float, precision: int = 3) -> str:
    """Like :func:`fmt` but without trailing zeros, for prose: 14.000 → 14, 0.500 → 0.5."""
    s = fmt(value, precision)
    if "." in s and "inf" not in s:
        s = s.rstrip("0").rstrip(".")
    return "0" if s in ("", "-0") else s


def vec(values: np.ndarray, precision: int = 3, max_items: int = 8) -> str:
    """A vector for prose: ``[0.1, -2, 3.25]``; long ones show their ends and their length."""
    items = [short(float(v), precision) for v in values]
    if len(items) <= max_items:
        return "[" + ", ".join(items) + "]"
    dim = str(len(items)).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))
    return "[" + ", ".join(items[:4]) + ", …, " + ", ".join(items[-2:]) + f"] ∈ ℝ{dim}"  # language-neutral length


def root(d: int, precision: int = 3) -> str:
    """``√d = r`` when the root is whole, else ``√d ≈ r``."""
    r = float(np.sqrt(d))
    return f"√{d} {'=' if r.is_integer() else '≈'} {short(r, precision)}"


@dataclass
class Block:
    """One titled matrix of a trace (or a heading when ``array`` is None)."""

    step: str  # the step name used by to_string(steps=...), e.g. "scores"
    title: str  # the formula, e.g. "scores = Q·Kᵀ"
    note: str = ""  # one line on what the numbers mean
    array: Optional[np.ndarray] = None
    rows: Sequence[str] = ()
    cols: Sequence[str] = ()
    heat: bool = False  # shade cells by value (attention weights)
    footer: str = ""
    features: bool = False  # columns are feature dimensions (summarised when wide), not tokens


_TEXT: dict[str, dict[str, str]] = {lang: messages(lang, "render.") for lang in LANGUAGES}
"""This module's words in each language, from the catalogue (``qkv/locale/<lang>.json``, keys ``render.*``)."""


def _text(lang: str) -> dict[str, str]:
    return _TEXT[check_lang(lang)]


def _dims(n: int) -> list[str]:
    return [str(i) for i in range(n)]


def _row_check(t: "Trace", weights: np.ndarray, precision: int, tx: dict[str, str]) -> str:
    sums = weights.sum(axis=-1)
    parts = [f"{tok} {fmt(s, precision)}" + ("" if s > 0 else tx["empty_row"]) for tok, s in zip(t.tokens, sums)]
    if t.sinks is not None:  # the sink takes its share of every row, so the weights alone sum to less than 1
        shares = t.sink_share
        parts = [p + tx["sink_part"].format(v=fmt(sh, precision)) for p, sh in zip(parts, shares)]
        ok = all(abs(s + sh - 1) < 1e-9 or s + sh == 0 for s, sh in zip(sums, shares))
        return tx["sums"].format(parts=tx["sep"].join(parts), verdict=tx["ok_sink" if ok else "bad_sink"])
    ok = all(abs(s - 1) < 1e-9 or s == 0 for s in sums)
    return tx["sums"].format(parts=tx["sep"].join(parts), verdict=tx["ok" if ok else "bad"])


def score_fn_formula(info: dict[str, Any], sub: str = "", h: Optional[int] = None, precision: int = 3) -> str:
    """The modified step as a formula, e.g. ``modified = 30·tanh(scaled / 30)``."""
    kind = info.get("kind")
    if kind == "softcap" and "cap" in info:
        c = short(info["cap"], precision)
        return f"modified{sub} = {c}·tanh(scaled{sub} / {c})"
    if kind == "alibi":
        return f"modified{sub} = scaled{sub} " + (f"− m{sub}·|j − i|" if info.get("symmetric") else f"+ m{sub}·(j − i)")
    if kind == "relative_bias":
        return f"modified{sub} = scaled{sub} + table[bucket(j − i), {0 if h is None else h}]"
    if kind == "function":
        return f"modified{sub} = {info.get('name', 'score_mod')}(scaled{sub}, b, h, i, j)"
    return f"modified{sub} = score_mod(scaled{sub})"


def score_fn_note(info: dict[str, Any], tx: dict[str, str], h: Optional[int] = None, precision: int = 3) -> str:
    """One line on what the score function does (in ``tx``'s language), with head ``h``'s numbers."""
    kind, text = info.get("kind"), str(info.get("text", ""))
    if kind == "softcap" and "cap" in info:
        return tx["mod_softcap"].format(text=text, c=short(info["cap"], precision))
    if kind == "alibi" and info.get("slopes"):
        m = info["slopes"][0 if h is None else h]
        return tx["mod_alibi_sym" if info.get("symmetric") else "mod_alibi"].format(text=text, m=short(m, max(precision, 4)))
    if kind == "relative_bias":
        return tx["mod_rel"].format(text=text)
    if kind == "function":
        return tx["mod_fn"].format(name=info.get("name", text))
    return tx["mod_other"].format(text=text)


def _head_blocks(t: "Trace", h: Optional[int], precision: int, tx: dict[str, str]) -> list[Block]:
    """The steps from Q, K, V to the output for one head (h = None: the only head)."""
    toks = list(t.tokens)
    sub = "" if h is None else str(h).translate(_SUB)
    out: list[Block] = []
    if h is not None:
        q0, q1 = h * t.d_k, (h + 1) * t.d_k
        v0, v1 = h * t.d_v, (h + 1) * t.d_v
        for name, lo, hi, what in (("q", q0, q1, "queries"), ("k", q0, q1, "keys"), ("v", v0, v1, "values")):
            arr = getattr(t, name)
            out.append(Block(name, f"{name.upper()}{sub} = {name.upper()}[:, {lo}:{hi}]",
                             tx["slice"].format(h=h, what=tx[what]), arr, toks, _dims(arr.shape[1]), features=True))
    out.append(Block("scores", f"scores{sub} = Q{sub}·K{sub}ᵀ", tx["scores"], t.scores, toks, toks))
    out.append(Block("scaled", f"scaled{sub} = scores{sub} / √d_k",
                     tx["scaled"].format(d=t.d_k, r=root(t.d_k, precision)), t.scaled, toks, toks))
    before = "scaled"
    if t.modified is not None:
        info = t.score_mod or {}
        out.append(Block("modified", score_fn_formula(info, sub, h, precision), score_fn_note(info, tx, h, precision),
                         t.modified, toks, toks))
        before = "modified"
    if t.masked is not None:
        note = "; ".join(tx[k] for k in ("causal", "bool", "float") if k in t.mask_kinds) + tx["hidden"]
        out.append(Block("masked", f"masked{sub} = {before}{sub} + mask", note, t.masked, toks, toks))
    src = "masked" if t.masked is not None else before
    if t.sinks is not None:
        title = tx["softmax_sink"].format(s=sub, src=src, v=fmt(float(t.sinks[0]), precision))
        note = tx["weights_sink"]
    else:
        title, note = tx["softmax"].format(s=sub, src=src), tx["weights"]
    out.append(Block("weights", title, note, t.weights, toks, toks,
                     heat=True, footer=_row_check(t, t.weights, precision, tx)))
    out.append(Block("output", f"output{sub} = weights{sub}·V{sub}", tx["out"],
                     t.output, toks, _dims(t.output.shape[1]), features=True))
    return out


def blocks(t: "Trace", precision: int = 3, lang: str = "en") -> list[Block]:
    """Every matrix of the trace in the order it is computed."""
    tx = _text(lang)
    toks = list(t.tokens)
    out: list[Block] = []
    given = t.x is None
    if not given:
        out.append(Block("x", "X", tx["x"], t.x, toks, _dims(t.x.shape[1]), features=True))
    meta = t.meta or {}
    for name, w, role in (("q", t.w_q, "query"), ("k", t.w_k, "key"), ("v", t.w_v, "value")):
        up = name.upper()
        b = getattr(t, "b_" + name)
        if w is not None:
            note = tx["w"].format(role=tx[role])
            if meta.get("source") == "model" and "layer" in meta and "head" in meta:
                note = tx["w_model"].format(role=tx[role], layer=meta["layer"], head=meta["head"], d=w.shape[1],
                                            width=meta.get("d_model", w.shape[0]))
            out.append(Block(name, f"W_{up}", note, w, _dims(w.shape[0]), _dims(w.shape[1]), features=True))
        if b is not None:
            out.append(Block(name, f"b_{up}", tx["b"].format(role=tx[role]), b.reshape(1, -1), [""], _dims(b.shape[0]),
                             features=True))
        arr = getattr(t, name)
        plus = "" if b is None else f" + b_{up}"
        title = tx["given"].format(m=up) if given else f"{up} = X·W_{up}{plus}"
        if t.head is not None and not given:  # a head on its own: its columns of the full projection
            d = t.d_v if name == "v" else t.d_k
            sub = str(t.head).translate(_SUB)
            title = f"{up}{sub} = (X·W_{up}{plus})[:, {t.head * d}:{(t.head + 1) * d}]"
        out.append(Block(name, title, tx[name], arr, toks, _dims(arr.shape[1]), features=True))
    if t.num_heads == 1:
        out.extend(_head_blocks(t, None, precision, tx))
    else:
        for h, ht in enumerate(t.heads):
            cols = tx["cols"].format(a=h * t.d_k, b=(h + 1) * t.d_k - 1, c=h * t.d_v, d=(h + 1) * t.d_v - 1)
            out.append(Block("head", tx["head"].format(h=h, n=t.num_heads, last=t.num_heads - 1), cols))
            out.extend(_head_blocks(ht, h, precision, tx))
        parts = " | ".join(f"output{str(h).translate(_SUB)}" for h in range(t.num_heads))
        out.append(Block("concat", f"concat = [{parts}]", tx["concat"], t.concat, toks, _dims(t.concat.shape[1]),
                         features=True))
    if t.projected is not None:
        w = t.w_o
        if w is not None:
            out.append(Block("projected", "W_O", tx["w"].format(role=tx["output"]), w,
                             _dims(w.shape[0]), _dims(w.shape[1]), features=True))
        src = "concat" if t.num_heads > 1 else "output"
        out.append(Block("projected", f"projected = {src}·W_O", tx["proj"],
                         t.projected, toks, _dims(t.projected.shape[1]), features=True))
    return out


def width(s: str) -> int:
    """Columns a string takes in a terminal: CJK characters are two wide."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in s)


def _rjust(s: str, n: int) -> str:
    return " " * (n - width(s)) + s


def _ljust(s: str, n: int) -> str:
    return s + " " * (n - width(s))


def _ranges(idx: Sequence[Optional[int]]) -> str:
    """[0, 1, 2, 3, None, 30, 31] → "0–3, 30–31"."""
    parts, run = [], []
    for i in list(idx) + [None]:
        if i is not None and (not run or i == run[-1] + 1):
            run.append(i)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}")
        run = [] if i is None else [i]
    return ", ".join(parts)


def shown(shape: Sequence[int], features: bool = True) -> tuple[list[Optional[int]], list[Optional[int]], bool]:
    """Which (row, column) indices a summarised matrix shows: None marks the ellipsis.

    The third item says whether a ``‖row‖`` column is added (only when columns were left out).
    """
    n_rows, n_cols = int(shape[0]), int(shape[1])
    rows: list[Optional[int]] = list(range(n_rows))
    if n_rows > TALL_ROWS:
        rows = list(range(_HEAD_ROWS)) + [None] + list(range(n_rows - _TAIL_ROWS, n_rows))
    cols: list[Optional[int]] = list(range(n_cols))
    wide = features and n_cols > WIDE_COLS
    if wide:
        cols = list(range(_HEAD_COLS)) + [None] + list(range(n_cols - _TAIL_COLS, n_cols))
    return rows, cols, wide


def summary_note(shape: Sequence[int], features: bool = True, lang: str = "en") -> str:
    """The line under a summarised matrix saying what was left out ("" when nothing was)."""
    tx = _text(lang)
    rows, cols, wide = shown(shape, features)
    notes = []
    if wide:
        notes.append(tx["summary"].format(shown=_ranges(cols), n=shape[1]))
    if None in rows:
        notes.append(tx["summary_rows"].format(shown=_ranges(rows), n=shape[0]))
    return " ".join(notes)


def format_matrix(a: np.ndarray, rows: Sequence[str], cols: Sequence[str], precision: int = 3,
                  indent: str = "  ", features: bool = False) -> list[str]:
    """Right-aligned columns under their labels, row labels on the left.

    With ``features=True`` a matrix wider than :data:`WIDE_COLS` shows its first and last
    columns, a ``…`` column and each row's length ``‖row‖``; with any setting one taller than
    :data:`TALL_ROWS` shows its first and last rows around a ``⋮`` row.
    """
    r_idx, c_idx, wide = shown(a.shape, features)
    col_labels = ["…" if j is None else cols[j] for j in c_idx] + (["‖row‖"] if wide else [])
    row_labels = ["⋮" if i is None else rows[i] for i in r_idx]
    cells = []
    for i in r_idx:
        if i is None:
            cells.append(["⋮" if j is None else "" for j in c_idx] + ([""] if wide else []))
            continue
        row = ["…" if j is None else fmt(float(a[i, j]), precision) for j in c_idx]
        if wide:
            row.append(fmt(float(np.linalg.norm(a[i])), precision))
        cells.append(row)
    w = max([width(c) for r in cells for c in r] + [width(c) for c in col_labels])
    lw = max(width(r) for r in row_labels)
    lines = [indent + " " * lw + "".join("  " + _rjust(c, w) for c in col_labels)]
    for label, row in zip(row_labels, cells):
        lines.append(indent + _ljust(label, lw) + "".join("  " + _rjust(c, w) for c in row))
    return lines


def _header(t: "Trace", tx: dict[str, str]) -> str:
    dims = [tx["n_tokens"].format(n=t.n, s="s" if t.n != 1 else "")]
    if t.d_model is not None:
        dims.append(f"d_model = {t.d_model}")
    dims += [f"d_k = {t.d_k}", f"d_v = {t.d_v}", tx["n_heads"].format(n=t.num_heads, s="s" if t.num_heads != 1 else "")]
    if t.mask_kinds:
        dims.append(tx["mask"].format(kinds=tx["sep"].join(tx["kind_" + k] for k in t.mask_kinds)))
    if t.score_mod is not None:
        dims.append(tx["score_fn"].format(text=t.score_mod.get("text", "")))
    if t.sinks is not None:
        dims.append(tx["sink_list"].format(values=" ".join(short(float(s)) for s in t.sinks)))
    head = tx["header"].format(dims=tx["sep"].join(dims))
    meta = t.meta or {}
    if "model" in meta and "layer" in meta and "head" in meta:
        head += "\n" + tx["model"].format(model=meta["model"], layer=meta["layer"], head=meta["head"])
    return head


def trace_to_string(t: "Trace", precision: int = 3, steps: Optional[Sequence[str]] = None, lang: str = "en") -> str:
    """The terminal rendering behind :meth:`Trace.to_string`."""
    if isinstance(precision, bool) or not isinstance(precision, (int, np.integer)) or not 0 <= precision <= 15:
        raise ValueError(f"precision={precision!r} must be an int from 0 to 15 (digits after the point)")
    tx = _text(lang)
    lines = [_header(t, tx), tx["tokens"] + tx["sep"].join(t.tokens)]
    for b in blocks(t, precision, lang):
        if steps is not None and b.step not in steps and b.step != "head":
            continue
        if b.array is None:
            lines += ["", f"=== {b.title} ({b.note}) ==="]
            continue
        shape = "×".join(str(s) for s in b.array.shape)
        lines += ["", f"{b.title}   ({shape})   {b.note}"]
        lines += format_matrix(b.array, b.rows, b.cols, precision, features=b.features)
        note = summary_note(b.array.shape, b.features, lang)
        if note:
            lines.append("  " + note)
        if b.footer:
            lines.append("  " + b.footer)
    return "\n".join(lines)


# -- HTML -------------------------------------------------------------------------------------

STYLE = """<style>
.qkv-trace { font-family: system-ui, sans-serif; }
.qkv-trace table { border-collapse: collapse; margin: 4px 0 14px 0; font-size: 13px; }
.qkv-trace caption { text-align: left; padding: 2px 0; }
.qkv-trace caption span, .qkv-trace .qkv-sum { color: #555; }
.qkv-trace th, .qkv-trace td { padding: 2px 8px; border: 1px solid #ddd; text-align: right; }
.qkv-trace th { background: #f3f4f6; font-weight: 600; }
.qkv-trace tr th:first-child { text-align: left; }
.qkv-trace td { font-variant-numeric: tabular-nums; }
.qkv-trace td.qkv-inf { color: #999; }
.qkv-trace .qkv-sum { margin: -10px 0 14px 0; font-size: 12px; }
</style>"""


def html_table(b: Block, precision: int, lang: str = "en") -> str:
    e = html.escape
    shape = "×".join(str(s) for s in b.array.shape)
    r_idx, c_idx, wide = shown(b.array.shape, b.features)
    heads = ["…" if j is None else b.cols[j] for j in c_idx] + (["‖row‖"] if wide else [])
    parts = [
        "<table>",
        f"<caption><code>{e(b.title)}</code> <span>({shape}) {e(b.note)}</span></caption>",
        "<tr><th></th>" + "".join(f"<th>{e(c)}</th>" for c in heads) + "</tr>",
    ]
    for i in r_idx:
        if i is None:
            parts.append("<tr><th>⋮</th>" + "".join("<td>⋮</td>" if j is None else "<td></td>" for j in c_idx)
                         + ("<td></td>" if wide else "") + "</tr>")
            continue
        cells = []
        for j in c_idx:
            if j is None:
                cells.append("<td>…</td>")
                continue
            v = b.array[i, j]
            text = e(fmt(float(v), precision))
            if b.heat and np.isfinite(v):
                alpha = float(np.clip(v, 0.0, 1.0))  # weights are probabilities: shade = weight
                fg = "#fff" if alpha > 0.55 else "#111"
                cells.append(f'<td style="background:rgba(37,99,235,{alpha:.3f});color:{fg}">{text}</td>')
            elif not np.isfinite(v):
                cells.append(f'<td class="qkv-inf">{text}</td>')
            else:
                cells.append(f"<td>{text}</td>")
        if wide:
            cells.append(f"<td>{e(fmt(float(np.linalg.norm(b.array[i])), precision))}</td>")
        parts.append(f"<tr><th>{e(b.rows[i])}</th>" + "".join(cells) + "</tr>")
    parts.append("</table>")
    note = summary_note(b.array.shape, b.features, lang)
    if note:
        parts.append(f'<div class="qkv-sum">{e(note)}</div>')
    if b.footer:
        parts.append(f'<div class="qkv-sum">{e(b.footer)}</div>')
    return "\n".join(parts)


def trace_to_html(t: "Trace", precision: int = 3, lang: str = "en") -> str:
    """Self-contained HTML: tables, a scoped stylesheet, no scripts or external resources."""
    e = html.escape
    tx = _text(lang)
    out = ['<div class="qkv-trace">', STYLE,
           f"<p><strong>{e(_header(t, tx)).replace(chr(10), '<br>')}</strong><br>{e(tx['tokens'] + tx['sep'].join(t.tokens))}</p>"]
    for b in blocks(t, precision, lang):
        if b.array is None:
            out.append(f"<h4>{e(b.title)} <small>({e(b.note)})</small></h4>")
        else:
            out.append(html_table(b, precision, lang))
    out.append("</div>")
    return "\n".join(out)


def notebook_frame(trace: Any, height: int = 760) -> str:
    """A trace's interactive stepper page as one sandboxed ``<iframe srcdoc=…>`` for notebooks
    (the page carries its data, script and style: no network); the static tables when the
    page's template is not installed."""
    try:
        # at call time: the page module imports this one at its top
        from .page import render_trace_page
    except ImportError:  # installed without the [viz] extra (no jinja2): the static tables
        return trace.to_html()
    return iframe(render_trace_page(trace), height)
