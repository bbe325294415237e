"""The glass box as one interactive, offline web page: every step of attention, cell by cell.

:func:`render_trace_page` turns a :class:`~qkv.glass.trace.Trace` (or a whole encoder
:class:`~qkv.glass.block.BlockTrace`) into a single HTML file that needs no network and
works from ``file://``: a flow diagram (inline SVG) highlights the current step, every matrix is
a coloured table with its shape, and hovering or clicking a cell explains where its number
comes from with the trace's own numbers (a score as the dot product q_i·k_j term by term, a
weight as exp(s − max)/Σ, an output as the weighted sum of a value column, …). The causal
mask, the head, the narrated token and the language (English / Chinese) can be switched on
the page; both mask variants are computed here in float64, so the page only displays numbers.

The page is a jinja2 template (``templates/trace_page.html.j2``) with its script and style
inlined; the data travels as JSON inside ``<script type="application/json">`` with ``<``,
``>`` and ``&`` escaped, so no token can end the script element.

Wide matrices (a real model's d_model = 384) are summarised the way the terminal view does it
(first columns, an ellipsis column, the last columns and each row's norm); a projection cell
then lists its largest terms and the sum of the rest, whose total is exact.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

import numpy as np

from ..locale import LANGUAGES, messages, text
from .block import BlockTrace, trace_block
from ..masks.rules import parse_causal
from .render import shown
from .trace import Trace, remasked
from ..viz.pages import asset, environment, markup, script_json

__all__ = ["render_trace_page", "save_trace_page", "page_data", "page_words", "PAGE_SCHEMA_VERSION", "TOP_TERMS"]

PAGE_SCHEMA_VERSION = 2
"""Version of the JSON embedded in the page (``page_data``); 2 added the score function
(``score_mod``, the ``modified`` step and views) and ``sinks``."""
TOP_TERMS = 8
"""A projection cell with more terms than this lists the largest ones and sums the rest."""
_SIGNIFICANT = 10  # digits kept in the embedded JSON: far below any displayed precision
_LANGS = LANGUAGES


def render_trace_page(
    trace: Union["Trace", "BlockTrace"],
    *,
    lang: str = "en",
    precision: int = 3,
    token: Union[int, str, None] = None,
) -> str:
    """The interactive page of ``trace`` as an HTML string.

    ``lang`` ("en" or "zh") is the initial language (switchable on the page), ``precision`` the
    decimals shown, ``token`` the query token narrated first (index counted from 0, or label).
    """
    data = page_data(trace, lang=lang, precision=precision, token=token)
    env = environment("qkv.glass")
    template = env.get_template("trace_page.html.j2")
    return template.render(
        data_json=script_json(data),
        words_json=script_json(page_words()),
        script=markup(asset("trace_page.js", "qkv.glass")),
        style=markup(asset("trace_page.css", "qkv.glass")),
        lang=data["lang"],
        title=_static_title(data),
    )


def save_trace_page(
    trace: Union["Trace", "BlockTrace"],
    path: Union[str, "os.PathLike[str]"],
    *,
    lang: str = "en",
    precision: int = 3,
    token: Union[int, str, None] = None,
) -> str:
    """Write :func:`render_trace_page` to ``path`` (UTF-8) and return the absolute path."""
    html = render_trace_page(trace, lang=lang, precision=precision, token=token)
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    return os.path.abspath(path)


# -- the data the page shows ------------------------------------------------------------------


def page_data(
    trace: Union["Trace", "BlockTrace"],
    *,
    lang: str = "en",
    precision: int = 3,
    token: Union[int, str, None] = None,
) -> dict[str, Any]:
    """Everything the page displays, as JSON-ready lists (non-finite values become None).

    Matrices are "views": ``{"shape", "rows", "cols", "v", "norm", "scale", "kind"}`` where
    ``rows``/``cols`` are the shown indices (None = the ellipsis), ``v`` the shown values and
    ``norm`` each row's Euclidean norm when columns were left out. Projection views carry
    ``cells``: per shown cell the largest terms ``[index, left, right]``, the rest's sum and
    count, and the bias. ``score_mod`` describes the trace's score function (None without
    one) and ``sinks`` holds each head's sink logit (None without sinks; null for a head whose
    sink is −∞).
    """
    if lang not in _LANGS:
        raise ValueError(f"lang={lang!r} is not supported; use 'en' (English) or 'zh' (Chinese)")
    if isinstance(precision, bool) or not isinstance(precision, (int, np.integer)) or not 0 <= precision <= 10:
        raise ValueError(f"precision={precision!r} must be an int from 0 to 10 (decimals shown on the page)")
    if isinstance(trace, BlockTrace):
        att, block = trace.attention, trace
    elif isinstance(trace, Trace):
        att, block = trace, None
    else:
        raise TypeError(
            f"trace must be a qkv.glass.Trace or BlockTrace, got {type(trace).__name__}; "
            "build one with qkv.glass.trace(...) or qkv.cli.sentence_trace(...)"
        )
    causal = bool(parse_causal(att.is_causal)[0])
    other_masks = [k for k in att.mask_kinds if k != "causal"]
    toggle = not (causal and other_masks)  # a causal trace with its own mask cannot be un-masked exactly
    variants = {_key(causal): _variant(att, block, causal)}
    if toggle:
        variants[_key(not causal)] = _variant(att, block, not causal)
    heads = _heads(att)
    steps = _steps(att, block)
    return {
        "schema_version": PAGE_SCHEMA_VERSION,
        "kind": "block" if block is not None else "attention",
        "lang": lang,
        "precision": int(precision),
        "token": _token_index(att.tokens, token),
        "tokens": list(att.tokens),
        "n": att.n,
        "d_k": att.d_k,
        "d_v": att.d_v,
        "d_model": att.d_model,
        "d_ff": None if block is None else block.d_ff,
        "eps": None if block is None else block.eps,
        "num_heads": att.num_heads,
        "meta": {str(k): (v.item() if isinstance(v, np.generic) else v) for k, v in att.meta.items()},
        "has_x": att.x is not None,
        "bias": {n: getattr(att, "b_" + n) is not None for n in ("q", "k", "v")},
        "causal": causal,
        "causal_toggle": toggle,
        "other_masks": other_masks,
        "score_mod": None if att.score_mod is None else json.loads(json.dumps(att.score_mod)),
        "sinks": None if att.sinks is None else [_round(s) for s in att.sinks],
        "steps": steps,
        "inputs": _inputs(att, block),
        "heads": [
            {
                "q": _view(h["q"], cells=h.get("q_cells")),
                "k": _view(h["k"], cells=h.get("k_cells")),
                "v": _view(h["v"], cells=h.get("v_cells")),
                "raw": {"q": _num(h["q"]), "k": _num(h["k"]), "v": _num(h["v"])},
            }
            for h in heads
        ],
        "variants": variants,
    }


def _key(causal: bool) -> str:
    return "causal" if causal else "full"


def _token_index(tokens: list[str], token: Union[int, str, None]) -> int:
    if token is None:
        return 0
    n = len(tokens)
    if isinstance(token, (int, np.integer)) and not isinstance(token, bool):
        i = int(token)
        if not -n <= i < n:
            raise ValueError(f"token={token} is out of range: there are {n} tokens, counted from 0 (0 … {n - 1})")
        return i % n
    if isinstance(token, str):
        if token in tokens:
            return tokens.index(token)
        low = [t.lower() for t in tokens]
        if token.lower() in low:
            return low.index(token.lower())
        raise ValueError(f"token={token!r} is not one of the tokens {tokens}; pass one of them or an index from 0")
    raise TypeError(f"token must be an int index (from 0) or a token string, got {type(token).__name__}")


def _steps(att: "Trace", block: Optional["BlockTrace"]) -> list[str]:
    steps: list[str] = []
    if block is not None:
        steps.append("positional")
    elif att.x is not None:
        steps.append("x")
    steps += ["qkv", "scores", "scaled"]
    if att.modified is not None:
        steps.append("modified")
    steps += ["mask", "weights", "output"]
    if att.num_heads > 1:
        steps.append("concat")
    if att.w_o is not None:
        steps.append("projected")
    if block is not None:
        steps += ["residual1", "norm1", "ffn", "residual2", "norm2"]
    return steps


def _heads(att: "Trace") -> list[dict[str, Any]]:
    """Per head: Q, K, V slices and, when X and the weights are known, each cell's terms."""
    out = []
    for h in range(att.num_heads):
        qs, vs = slice(h * att.d_k, (h + 1) * att.d_k), slice(h * att.d_v, (h + 1) * att.d_v)
        one: dict[str, Any] = {"q": att.q[:, qs], "k": att.k[:, qs], "v": att.v[:, vs]}
        if att.x is not None and att.w_q is not None:
            for name, cols in (("q", qs), ("k", qs), ("v", vs)):
                w = getattr(att, "w_" + name)[:, cols]
                b = getattr(att, "b_" + name)
                one[name + "_cells"] = _product_cells(att.x, w, None if b is None else b[cols], one[name])
        out.append(one)
    return out


def _inputs(att: "Trace", block: Optional["BlockTrace"]) -> dict[str, Any]:
    inputs: dict[str, Any] = {}
    if att.x is not None:
        inputs["x"] = _view(att.x)
    if block is not None:
        inputs["embeddings"] = _view(block.embeddings)
        inputs["positional"] = _view(block.positional)
        inputs["gamma1"], inputs["beta1"] = _num(block.gamma1), _num(block.beta1)
        inputs["gamma2"], inputs["beta2"] = _num(block.gamma2), _num(block.beta2)
        inputs["b1"], inputs["b2"] = _num(block.b1), _num(block.b2)
    return inputs


def _variant(att: "Trace", block: Optional["BlockTrace"], causal: bool) -> dict[str, Any]:
    """The steps from the scores on, with the causal mask on or off (recomputed in float64)."""
    causal_now = bool(parse_causal(att.is_causal)[0])
    same = causal_now == causal
    # Only a non-causal trace is ever re-masked with its own mask kept: a causal trace with a
    # mask of its own gets no toggle (page_data), and a causal one without has nothing to keep.
    per_head: list["Trace"]
    if same:
        per_head = att.heads if att.heads else [att]
    else:
        per_head = []
        for i in range(att.num_heads):
            h = att.heads[i] if att.heads else att
            extra = None
            base = h.scaled if h.modified is None else h.modified  # what the mask was added to
            if h.masked is not None and not causal_now:  # keep the trace's own mask under the toggle
                extra = np.where(np.isfinite(h.masked), h.masked - base, -np.inf)
            per_head.append(remasked(h, causal, extra))
    out: dict[str, Any] = {
        "heads": [
            {
                "scores": _view(h.scores, features=False),
                "scaled": _view(h.scaled, features=False),
                "modified": None if h.modified is None else _view(h.modified, features=False),
                "masked": None if h.masked is None else _view(h.masked, features=False),
                "weights": _view(h.weights, features=False, scale="weights"),
                "output": _view(h.output),
                "raw_output": _num(h.output),
            }
            for h in per_head
        ]
    }
    concat = per_head[0].output if att.num_heads == 1 else np.concatenate([h.output for h in per_head], axis=-1)
    if att.num_heads > 1:
        out["concat"] = _view(concat)
    projected = None
    if att.w_o is not None:
        projected = concat @ att.w_o  # (N, d_model_out)
        out["projected"] = _view(projected, cells=_product_cells(concat, att.w_o, None, projected))
    if block is not None:
        out.update(_block_steps(block, att, causal, same))
    return out


def _block_steps(block: "BlockTrace", att: "Trace", causal: bool, same: bool) -> dict[str, Any]:
    b = block
    if not same:
        b = trace_block(
            block.embeddings, w_q=att.w_q, w_k=att.w_k, w_v=att.w_v, w_o=att.w_o, num_heads=att.num_heads,
            w1=block.w1, b1=block.b1, w2=block.w2, b2=block.b2, gamma1=block.gamma1, beta1=block.beta1,
            gamma2=block.gamma2, beta2=block.beta2, eps=block.eps, is_causal=causal, tokens=block.tokens,
            positional=bool(np.any(block.positional)),
        )
    return {
        "attn": _view(b.attention.result),
        "residual1": _view(b.residual1),
        "norm1": _view(b.norm1),
        "mean1": _num(b.mean1),
        "std1": _num(b.std1),
        "ffn_hidden": _view(b.ffn_hidden, cells=_product_cells(b.norm1, b.w1, b.b1, b.ffn_hidden)),
        "ffn_relu": _view(b.ffn_relu),
        "ffn_out": _view(b.ffn_out, cells=_product_cells(b.ffn_relu, b.w2, b.b2, b.ffn_out)),
        "residual2": _view(b.residual2),
        "block_output": _view(b.output),
        "mean2": _num(b.mean2),
        "std2": _num(b.std2),
    }


def _product_cells(left: np.ndarray, w: np.ndarray, bias: Optional[np.ndarray], result: np.ndarray) -> list[list[Any]]:
    """For every shown cell of ``result = left·w (+ bias)``: its terms left_im·w_mc.

    With at most :data:`TOP_TERMS` terms all are listed in order; otherwise the largest by
    magnitude, plus the sum and count of the rest, so the terms still add up to the cell.
    """
    rows, cols, _ = shown(result.shape)
    m = left.shape[1]
    cells: list[list[Any]] = []
    for i in rows:
        line: list[Any] = []
        for c in cols:
            if i is None or c is None:
                line.append(None)
                continue
            terms = left[i] * w[:, c]  # (m,)
            if m <= TOP_TERMS:
                idx = np.arange(m)
            else:
                idx = np.sort(np.argsort(-np.abs(terms), kind="stable")[:TOP_TERMS])
            rest = np.ones(m, dtype=bool)
            rest[idx] = False
            line.append({
                "t": [[int(j), _round(left[i, j]), _round(w[j, c])] for j in idx],
                "rest": _round(terms[rest].sum()) if rest.any() else None,
                "rn": int(rest.sum()),
                "b": None if bias is None else _round(bias[c]),
                "m": int(m),
            })
        cells.append(line)
    return cells


def _view(a: np.ndarray, *, features: bool = True, scale: str = "signed", cells: Any = None) -> dict[str, Any]:
    """A matrix as the page shows it (see :func:`page_data`)."""
    rows, cols, wide = shown(a.shape, features)
    values = [[None if (i is None or c is None) else _round(a[i, c]) for c in cols] for i in rows]
    norm = None
    if wide:
        norm = [None if i is None else _round(np.linalg.norm(a[i])) for i in rows]
    view: dict[str, Any] = {
        "shape": [int(a.shape[0]), int(a.shape[1])],
        "rows": rows,
        "cols": cols,
        "v": values,
        "norm": norm,
        "scale": scale,
        "kind": "tokens" if not features else "features",
    }
    if cells is not None:
        view["cells"] = cells
    return view


def _round(x: Any) -> Optional[float]:
    x = float(x)
    if not np.isfinite(x):
        return None
    return float(f"{x:.{_SIGNIFICANT}g}")


def _num(a: Optional[np.ndarray]) -> Any:
    if a is None:
        return None
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 0:
        return _round(a)
    return [_num(r) if a.ndim > 1 else _round(r) for r in a]


# -- template ---------------------------------------------------------------------------------


def _static_title(data: dict[str, Any]) -> str:
    """The <title> before the script runs (the script retitles it on a language switch)."""
    meta, lang = data["meta"], data["lang"]
    if "model" in meta:  # the same words the script uses when it retitles the page
        parts = [str(meta["model"])]
        if "layer" in meta:
            parts.append(text("page.layer", lang, n=meta["layer"]))
        if "head" in meta:
            parts.append(text("page.head_n", lang, n=meta["head"]))
        return text("page.title_model", lang, what=" · ".join(parts))
    if data["kind"] == "block":
        return text("page.title_block", lang)
    return text("page.title", lang)


def page_words() -> dict[str, dict[str, str]]:
    """The page script's words: for each language, the catalogue's ``page.*`` messages keyed by
    the rest of the key (the script fills their ``{name}`` placeholders itself)."""
    return {lang: messages(lang, "page.") for lang in LANGUAGES}
