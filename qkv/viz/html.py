"""A single self-contained interactive attention report (one HTML file, works offline).

:func:`save_html` writes, from an :class:`~qkv.analysis.explain.Explanation`, a page with

* a **head view**: the tokens twice, queries on the left and keys on the right, with a line from
  the selected token to every key, its width and opacity the attention weight, one colour per
  head; hovering a token shows its attention, clicking pins it; a panel names the top tokens;
* a **model view**: every layer × head as a small map (row = query, column = key); clicking one
  selects that layer and head in the head view;
* **layer and head selection** (click a head for it alone, shift-click to add heads, "all heads")
  and a per-head statistics table of the selected token (entropy, max weight, first/last token).

Everything is inline: the data (weights quantised to 16 bits, base64, in a
``<script type="application/json" id="qkv-data">``), the script and the style (``templates/explain.*``). No network request,
no CDN, no web font. In statistics mode (no maps) only the focus token's rows are shown.
"""

from __future__ import annotations

import base64
import html as _html
import json
import os
from typing import Any, Optional

import numpy as np

from ..locale import Note, check_lang, messages, word
from .pages import asset, decode_weights, encode_weights, environment, markup

__all__ = ["render_html", "save_html", "page_data", "decode_weights", "MAX_HTML_MAP_BYTES", "MAX_HTML_VECTOR_BYTES"]

MAX_HTML_MAP_BYTES = 8_000_000  # 16-bit maps beyond this (about 240 tokens × 72 heads) stay out of the page


def _labels(lang: str) -> dict[str, Any]:
    """Every visible word of the page in ``lang`` (catalogue area ``explain_page.``): the static
    ones fill the template, the script builds the rest from those under ``"js"`` ({name} placeholders)."""
    words = messages(check_lang(lang), "explain_page.")
    labels: dict[str, Any] = {key: value for key, value in words.items() if not key.startswith("js.")}
    labels["js"] = messages(lang, "explain_page.js.")
    return labels


def page_data(ex: Any, layer: Optional[int] = None, head: Optional[int] = None,
              max_map_bytes: int = MAX_HTML_MAP_BYTES, lang: str = "en") -> dict[str, Any]:
    """The data embedded in the page (JSON-ready); ``layer``/``head`` as :meth:`Explanation.select`."""
    labels = _labels(lang)
    layer, head = ex.select(layer, head)
    L, H, N = ex.focus_weights.shape  # N: keys (the queries too, except for cross-attention)
    keys = getattr(ex, "keys", ex.tokens)
    cross = getattr(ex, "key_tokens", None) is not None
    notes = list(ex.notes)
    maps = None
    if ex.maps is not None:
        if ex.maps.size * 2 <= max_map_bytes:
            maps = encode_weights(ex.maps)
        else:
            notes.append(Note("note.page_size", n=N, mb=f"{ex.maps.size * 2 / 1e6:.0f}"))
    return {
        "model": ex.model_name,
        "text": ex.text,
        "tokens": list(ex.tokens),
        "key_tokens": list(keys) if cross else None,  # cross-attention: the source tokens attended to
        "pair": getattr(ex, "pair", ""),
        "segments": getattr(ex, "segments", None),  # per token 0 / 1 / null for a sentence pair, else null
        "num_layers": L,
        "num_heads": H,
        "mode": "maps" if maps is not None else "stats",
        "notes": [word(n, lang) for n in notes],
        "focus": {"index": ex.focus_index, "token": ex.tokens[ex.focus_index], "word": ex.focus_word},
        "target": {"index": ex.target_index, "token": keys[ex.target_index], "word": ex.target_word},
        "top_heads": [{"layer": l, "head": h, "weight": round(w, 4)} for l, h, w in ex.top_heads(5)],
        "initial": {"layer": int(layer), "head": int(head)},
        "encoding": "base64 little-endian uint16, weight = value / 65535",
        "maps": maps,  # (L, H, N, N) or None
        "focus_weights": encode_weights(ex.focus_weights),  # (L, H, N)
        "vectors": None if cross else _vectors(ex),  # (L, 2, H, N, Dh) float32 base64, or None
        "head_dim": None if getattr(ex, "vectors", None) is None else int(ex.vectors.shape[-1]),
        "scale": getattr(ex, "scale", None),
        "labels": labels["js"],
        "ablation": None if getattr(ex, "ablation", None) is None else ex.ablation.to_dict(),
    }


MAX_HTML_VECTOR_BYTES = 3_000_000  # query/key vectors (neuron view) beyond this stay out of the page


def _vectors(ex: Any) -> Optional[str]:
    v = getattr(ex, "vectors", None)
    if v is None or v.size * 4 > MAX_HTML_VECTOR_BYTES:
        return None
    return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")


def render_html(ex: Any, layer: Optional[int] = None, head: Optional[int] = None,
                max_map_bytes: int = MAX_HTML_MAP_BYTES, lang: str = "en") -> str:
    """The page as a string; ``lang`` ("en" or "zh") is the language of every label and tooltip."""
    labels = _labels(lang)
    data = page_data(ex, layer, head, max_map_bytes, lang)
    blob = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    blob = blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")  # inert inside <script>
    title = labels["title"].format(model=ex.model_name)
    shown = ex.text + (f" ‖ {ex.pair}" if getattr(ex, "pair", "") else "")
    # attends_most carries the page's own markup; every other label is plain text
    t = {key: markup(value if key == "attends_most" else _html.escape(value, quote=False).replace('"', "&quot;"))
         for key, value in labels.items() if isinstance(value, str)}
    return environment().get_template("explain.html.j2").render(
        html_lang=labels["html_lang"], title=markup(_html.escape(title)), css=markup(asset("explain.css")),
        text=markup(_html.escape(shown)), model=markup(_html.escape(ex.model_name)), t=t,
        data_json=markup(blob), script=markup(asset("explain.js")),
    ) + "\n"  # jinja2 drops the template's final newline


def save_html(ex: Any, path: "str | os.PathLike[str]", layer: Optional[int] = None, head: Optional[int] = None,
              lang: str = "en") -> str:
    """Write the report for ``ex`` to ``path`` and return the path; ``lang`` is "en" or "zh"."""
    page = render_html(ex, layer, head, lang=lang)  # first: a bad layer/head must not leave an empty file behind
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
    return os.fspath(path)
