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

from ..analysis.explain import zh_note
from .pages import asset, decode_weights, encode_weights, environment

__all__ = ["render_html", "save_html", "page_data", "decode_weights", "MAX_HTML_MAP_BYTES", "MAX_HTML_VECTOR_BYTES"]

MAX_HTML_MAP_BYTES = 8_000_000  # 16-bit maps beyond this (about 240 tokens × 72 heads) stay out of the page


def _labels(lang: str) -> dict[str, Any]:
    if lang not in _LABELS:
        raise ValueError(f"lang={lang!r} is not available; use 'en' (English) or 'zh' (Chinese)")
    return _LABELS[lang]


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
            notes.append(f"{N} tokens: the full maps would make the page {ex.maps.size * 2 / 1e6:.0f} MB; "
                         "it shows the focus token's attention only")
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
        "notes": notes if lang == "en" else [zh_note(n) for n in notes],
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
    from markupsafe import Markup

    labels = _labels(lang)
    data = page_data(ex, layer, head, max_map_bytes, lang)
    blob = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    blob = blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")  # inert inside <script>
    title = labels["title"].format(model=ex.model_name)
    shown = ex.text + (f" ‖ {ex.pair}" if getattr(ex, "pair", "") else "")
    # attends_most carries the page's own markup; every other label is plain text
    t = {key: Markup(value if key == "attends_most" else _html.escape(value, quote=False).replace('"', "&quot;"))
         for key, value in labels.items() if isinstance(value, str)}
    return environment().get_template("explain.html.j2").render(
        html_lang=labels["html_lang"], title=Markup(_html.escape(title)), css=Markup(asset("explain.css")),
        text=Markup(_html.escape(shown)), model=Markup(_html.escape(ex.model_name)), t=t,
        data_json=Markup(blob), script=Markup(asset("explain.js")),
    ) + "\n"  # jinja2 drops the template's final newline


def save_html(ex: Any, path: "str | os.PathLike[str]", layer: Optional[int] = None, head: Optional[int] = None,
              lang: str = "en") -> str:
    """Write the report for ``ex`` to ``path`` and return the path; ``lang`` is "en" or "zh"."""
    page = render_html(ex, layer, head, lang=lang)  # first: a bad layer/head must not leave an empty file behind
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
    return os.fspath(path)


# Every visible word of the page, per language. Static ones fill %key% in _BODY; the script
# builds the rest from the templates under "js" ({name} placeholders).
_LABELS: dict[str, dict[str, Any]] = {
    "en": {
        "html_lang": "en", "title": "qkv attention report: {model}", "report": "Attention report",
        "head_view": "Head view", "model_view": "Model view", "layer": "Layer", "heads": "Heads",
        "all_heads": "all heads", "all_heads_title": "show every head of this layer",
        "hint": "click a head to see it alone, shift-click to add it; hover a token, click to pin it",
        "query_col": "query (attends)", "key_col": "key (attended to)",
        "attends_most": '<b id="sel-token"></b> attends most to <b id="top-token"></b> (<span id="top-weight"></span>)',
        "th_head": "head", "entropy_title": "entropy of the weights, nats", "th_entropy": "entropy", "th_max": "max",
        "th_first": "first", "th_last": "last",
        "stats_caption": "Statistics of the selected token's row in each head of this layer.",
        "model_caption": "Each cell is one head's map (rows: queries, columns: keys). Click one to open it in the head view.",
        "neuron_caption": "Neuron view: the query and key vectors behind one weight. Click a key on the right.",
        "js": {
            "neuron_title": 'Layer {l} · Head {h}: "{q}" → "{k}"',
            "second_text": "second sentence of the pair",
            "neuron_sum": "score q·k = {s}; × {scale} = {scaled}; softmax over the {n} keys = {w} (the map: {m})",
            "summary": '{n} tokens, {L} \u00d7 {H}. Focus "{focus}" (token {fi}), target "{target}": '
                       "strongest in {top}.",
            "top_item": "L{layer} H{head} ({w})", "list_sep": ", ", "on": 'on "{tok}"', "layers_one": "1 layer", "layers_many": "{n} layers", "heads_one": "1 head",
            "heads_many": "{n} heads", "layer_option": "Layer {l}",
            "head_title": "head {h}", "head_label_one": "Layer {l} \u00b7 Head {h}",
            "head_label_many": "Layer {l} \u00b7 Heads {hs}",
            "cell_title": 'layer {l}, head {h}: "{focus}" \u2192 "{target}" {w}',
            "ablation_title": "Ablating {heads} ({mode})",
            "mode_zero": "zeroed", "mode_mean": "mean output", "ablation_more": "every token",
            "ablation_summary": 'Cosine distance of each token\'s final state with and without those heads: "{focus}" '
                                "{d}, the other tokens {mean} on average; the sentence embedding {emb}.",
            "ablation_next": 'Next token after "{focus}": KL(clean \u2016 ablated) = {kl} nats; log-probability of '
                             '"{tok}" {delta}.',
        },
    },
    "zh": {
        "html_lang": "zh-CN", "title": "qkv 注意力报告：{model}", "report": "注意力报告",
        "head_view": "注意力头视图", "model_view": "模型视图", "layer": "层", "heads": "头",
        "all_heads": "全部头", "all_heads_title": "显示这一层的所有头",
        "hint": "点击一个头单独查看，按住 Shift 点击可加入；鼠标悬停在词元上查看，点击固定",
        "query_col": "查询（发出关注）", "key_col": "键（被关注）",
        "attends_most": '<b id="sel-token"></b> 最关注 <b id="top-token"></b>（<span id="top-weight"></span>）',
        "th_head": "头", "entropy_title": "权重的熵，单位 nats", "th_entropy": "熵", "th_max": "最大",
        "th_first": "首个", "th_last": "末个",
        "stats_caption": "所选词元在这一层每个头中那一行注意力的统计。",
        "model_caption": "每个格子是一个头的注意力矩阵（行：查询，列：键）。点击即可在注意力头视图中打开。",
        "neuron_caption": "神经元视图：一个权重背后的查询向量与键向量。点击右侧的键。",
        "js": {
            "neuron_title": "第 {l} 层 · 第 {h} 个头：“{q}” → “{k}”",
            "second_text": "句对中的第二句",
            "neuron_sum": "分数 q·k = {s}；× {scale} = {scaled}；对 {n} 个键做 softmax = {w}（注意力矩阵中：{m}）",
            "summary": "{n} 个词元，{L} \u00d7 {H}。关注词元“{focus}”（第 {fi} 个词元），目标“{target}”："
                       "联系最强的是 {top}。",
            "top_item": "L{layer} H{head}（{w}）", "list_sep": "、", "on": "在“{tok}”上", "layers_one": "1 层", "layers_many": "{n} 层", "heads_one": "1 个头", "heads_many": "{n} 个头", "layer_option": "第 {l} 层",
            "head_title": "第 {h} 个头", "head_label_one": "第 {l} 层 \u00b7 第 {h} 个头",
            "head_label_many": "第 {l} 层 \u00b7 第 {hs} 个头",
            "cell_title": "第 {l} 层，第 {h} 个头：“{focus}” \u2192 “{target}” {w}",
            "ablation_title": "消融 {heads}（{mode}）",
            "mode_zero": "置零", "mode_mean": "换成平均输出", "ablation_more": "每个词元",
            "ablation_summary": "去掉这些头前后，每个词元最终表示的余弦距离：“{focus}”为 {d}，其他词元平均 {mean}；句向量 {emb}。",
            "ablation_next": "“{focus}”之后的下一个词元：KL(原始 \u2016 消融) = {kl} nats；“{tok}”的对数概率变化 {delta}。",
        },
    },
}


