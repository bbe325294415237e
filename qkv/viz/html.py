"""A single self-contained interactive attention report (one HTML file, works offline).

:func:`save_html` writes, from an :class:`~qkv.viz.explain.Explanation`, a page with

* a **head view**: the tokens twice, queries on the left and keys on the right, with a line from
  the selected token to every key, its width and opacity the attention weight, one colour per
  head; hovering a token shows its attention, clicking pins it; a panel names the top tokens;
* a **model view**: every layer × head as a small map (row = query, column = key); clicking one
  selects that layer and head in the head view;
* **layer and head selection** (click a head for it alone, shift-click to add heads, "all heads")
  and a per-head statistics table of the selected token (entropy, max weight, first/last token).

Everything is inline: the data (weights quantised to 16 bits, base64, in a
``<script type="application/json" id="qkv-data">``), the script and the style. No network request,
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
from .pages import decode_weights, encode_weights

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
    labels = _labels(lang)
    data = page_data(ex, layer, head, max_map_bytes, lang)
    blob = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    blob = blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")  # inert inside <script>
    title = labels["title"].format(model=ex.model_name)
    shown = ex.text + (f" ‖ {ex.pair}" if getattr(ex, "pair", "") else "")
    body = _BODY.replace("%TEXT%", _html.escape(shown)).replace("%MODEL%", _html.escape(ex.model_name))
    for key, value in labels.items():
        if isinstance(value, str):
            # attends_most carries the page's own markup; every other label is plain text
            body = body.replace(f"%{key}%", value if key == "attends_most" else _html.escape(value, quote=False).replace('"', "&quot;"))
    return (
        f"<!DOCTYPE html>\n<html lang=\"{labels['html_lang']}\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{_html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"{body}\n"
        f"<script type=\"application/json\" id=\"qkv-data\">{blob}</script>\n"
        f"<script>{_JS}</script>\n</body>\n</html>\n"
    )


def save_html(ex: Any, path: "str | os.PathLike[str]", layer: Optional[int] = None, head: Optional[int] = None,
              lang: str = "en") -> str:
    """Write the report for ``ex`` to ``path`` and return the path; ``lang`` is "en" or "zh"."""
    page = render_html(ex, layer, head, lang=lang)  # first: a bad layer/head must not leave an empty file behind
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
    return os.fspath(path)


_BODY = """<header>
  <h1>%report% <span class="model">%MODEL%</span></h1>
  <p class="text">%TEXT%</p>
  <p id="summary"></p>
  <ul id="notes"></ul>
  <section id="ablation" hidden>
    <h2 id="ablation-title"></h2>
    <p id="ablation-summary"></p>
    <p id="ablation-next" class="small"></p>
    <details><summary id="ablation-more"></summary><table id="ablation-table"><tbody></tbody></table></details>
  </section>
</header>
<nav class="tabs">
  <button id="tab-head" class="tab active" type="button">%head_view%</button>
  <button id="tab-model" class="tab" type="button">%model_view%</button>
</nav>
<section id="controls">
  <label>%layer% <select id="layer"></select></label>
  <span class="heads-label">%heads%</span><span id="heads"></span>
  <button id="all-heads" type="button" title="%all_heads_title%">%all_heads%</button>
  <span class="hint">%hint%</span>
</section>
<h2 id="head-label"></h2>
<main>
  <section id="head-view">
    <div id="columns">
      <div class="col-title left">%query_col%</div><div></div><div class="col-title right">%key_col%</div>
      <div id="left" class="tokens"></div>
      <svg id="lines"></svg>
      <div id="right" class="tokens"></div>
    </div>
    <aside id="info">
      <p>%attends_most%</p>
      <ol id="top-list"></ol>
      <table id="stats-table"><thead><tr><th>%th_head%</th><th title="%entropy_title%">%th_entropy%</th>
        <th>%th_max%</th><th id="first-col">%th_first%</th><th id="last-col">%th_last%</th></tr></thead><tbody></tbody></table>
      <p class="small">%stats_caption%</p>
      <div id="neuron" hidden>
        <h3 id="neuron-title"></h3>
        <p class="small">%neuron_caption%</p>
        <table id="neuron-table"><thead><tr><th>d</th><th>q<sub>d</sub></th><th>k<sub>d</sub></th><th>q<sub>d</sub>·k<sub>d</sub></th><th></th></tr></thead><tbody></tbody></table>
        <p id="neuron-sum"></p>
      </div>
    </aside>
  </section>
  <section id="model-view" hidden>
    <p id="model-caption" class="small">%model_caption%</p>
    <div id="grid"></div>
  </section>
</main>"""

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


_CSS = """
:root { --bg:#fbfbfd; --fg:#1d1d24; --muted:#6b6b78; --line:#d9d9e3; --accent:#d6336c; }
* { box-sizing: border-box; }
[hidden] { display: none !important; }
body { margin: 0; padding: 16px 24px; background: var(--bg); color: var(--fg);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
h1 { font-size: 20px; margin: 0 0 4px; } h1 .model { color: var(--muted); font-weight: normal; font-size: 15px; }
h2 { font-size: 16px; margin: 10px 0 6px; }
.text { margin: 4px 0; font-style: italic; max-width: 110ch; max-height: 6.2em; overflow: auto; }
#summary { margin: 4px 0; } #notes { color: #8a5a00; margin: 4px 0; padding-left: 18px; }
.tabs { margin: 10px 0 6px; border-bottom: 1px solid var(--line); }
.tab { border: 1px solid var(--line); border-bottom: none; background: #eee; padding: 5px 14px; cursor: pointer;
  border-radius: 6px 6px 0 0; font: inherit; }
.tab.active { background: var(--bg); font-weight: 600; position: relative; top: 1px; }
#controls { display: flex; flex-wrap: wrap; align-items: center; gap: 8px; margin: 8px 0; }
#controls select, #controls button { font: inherit; }
#heads { display: inline-flex; gap: 3px; flex-wrap: wrap; }
.head-btn { min-width: 30px; border: 2px solid transparent; border-radius: 5px; padding: 2px 6px; cursor: pointer;
  font: 12px/1.2 inherit; color: #fff; opacity: 0.35; }
.head-btn.on { opacity: 1; border-color: #222; }
.hint, .small { color: var(--muted); font-size: 12px; }
main { min-height: 200px; }
#head-view { display: flex; gap: 24px; align-items: flex-start; }
#columns { display: grid; grid-template-columns: max-content 240px max-content; column-gap: 0; }
.col-title { color: var(--muted); font-size: 12px; padding-bottom: 4px; }
.col-title.left { text-align: right; }
.tokens { display: flex; flex-direction: column; }
.tok { height: 22px; line-height: 20px; padding: 0 6px; white-space: nowrap; cursor: pointer; border-radius: 3px;
  border: 1px solid transparent; }
#left .tok { text-align: right; }
#left .tok.disabled { color: #bbb; cursor: default; }
.tok.seg-b { box-shadow: inset 3px 0 0 #7aa7d8; }
.tok.seg-start { border-top: 1px dashed #2a6cb0; }
.tok.active { background: #222; color: #fff; }
.tok.pinned { border-color: var(--accent); }
.tok.top { outline: 2px solid var(--accent); font-weight: 600; }
.tok.hovered { text-decoration: underline; }
#lines { width: 240px; }
#info { min-width: 300px; max-width: 380px; background: #fff; border: 1px solid var(--line); border-radius: 8px;
  padding: 10px 14px; position: sticky; top: 10px; }
#info p { margin: 4px 0; }
#top-list { margin: 4px 0 10px; padding-left: 22px; }
#top-list li { margin: 1px 0; }
.bar { display: inline-block; height: 9px; background: var(--accent); vertical-align: middle; margin-left: 6px; border-radius: 2px; }
table { border-collapse: collapse; font-size: 12px; width: 100%; }
#ablation { margin: 8px 0; padding: 6px 12px; max-width: 640px; border-left: 3px solid var(--accent); background: #fff; }
#ablation h2 { font-size: 15px; margin: 2px 0; } #ablation p { margin: 3px 0; }
#ablation td:first-child { text-align: left; }
th, td { padding: 2px 6px; text-align: right; border-bottom: 1px solid #eee; }
tr.sel td { background: #fdeef4; font-weight: 600; }
#grid { display: grid; gap: 4px; align-items: center; }
.cell { position: relative; cursor: pointer; border: 2px solid transparent; line-height: 0; }
.cell.sel { border-color: var(--accent); }
.cell:hover { border-color: #888; }
.cell canvas { width: 76px; height: 76px; image-rendering: pixelated; background: #000; }
.cell.strip canvas { height: 12px; }
.glabel { font-size: 12px; color: var(--muted); text-align: center; }
#neuron { margin-top: 10px; border-top: 1px solid var(--line); padding-top: 6px; }
#neuron h3 { font-size: 14px; margin: 2px 0; }
#neuron-table td:last-child { text-align: left; width: 90px; }
.nbar { display: inline-block; height: 8px; vertical-align: middle; border-radius: 2px; }
.nbar.pos { background: var(--accent); } .nbar.neg { background: #3b6fd6; }
#right .tok.key-sel { outline: 2px solid #3b6fd6; }
"""

_JS = r"""
(function () {
  'use strict';
  var D = JSON.parse(document.getElementById('qkv-data').textContent);
  var L = D.num_layers, H = D.num_heads, N = D.tokens.length, ROW = 22;
  var KT = D.key_tokens || D.tokens, NK = KT.length;  // keys: the source tokens for cross-attention
  var COLORS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b',
                '#e377c2', '#7f7f7f', '#bcbd22', '#17becf', '#393b79', '#ad494a'];
  function color(h) { return COLORS[h % COLORS.length]; }
  function decode(b64) {
    var s = atob(b64), u8 = new Uint8Array(s.length);
    for (var i = 0; i < s.length; i++) u8[i] = s.charCodeAt(i);
    var u16 = new Uint16Array(u8.buffer), f = new Float32Array(u16.length);
    for (var j = 0; j < u16.length; j++) f[j] = u16[j] / 65535;
    return f;
  }
  var maps = D.maps ? decode(D.maps) : null;          // (L, H, N, NK)
  var focusRows = decode(D.focus_weights);            // (L, H, NK)
  function row(l, h, q) {                             // (NK,) weights of query q, or null
    if (maps) { var o = ((l * H + h) * N + q) * NK; return maps.subarray(o, o + NK); }
    if (q === D.focus.index) { var p = (l * H + h) * NK; return focusRows.subarray(p, p + NK); }
    return null;
  }
  function selectable(q) { return !!maps || q === D.focus.index; }
  var state = { layer: D.initial.layer, heads: [D.initial.head], pinned: D.focus.index, hover: null, view: 'head',
                key: D.vectors ? D.target.index : null };
  var vec = null, DH = D.head_dim || 0;                  // (L, 2, H, N, Dh) query and key vectors
  if (D.vectors) {
    var vs = atob(D.vectors), vb = new Uint8Array(vs.length);
    for (var vi = 0; vi < vs.length; vi++) vb[vi] = vs.charCodeAt(vi);
    vec = new Float32Array(vb.buffer);
  }
  function qk(l, h, which, t) { var o = (((l * 2 + which) * H + h) * N + t) * DH; return vec.subarray(o, o + DH); }
  function active() { return state.hover !== null ? state.hover : state.pinned; }
  function $(id) { return document.getElementById(id); }
  function el(tag, cls, text) { var e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; }
  function fmt(x) { return x.toFixed(3); }
  var T = D.labels;
  function say(key, o) { return T[key].replace(/\{(\w+)\}/g, function (m, k) { return String(o[k]); }); }

  // header
  var count = function (n, what) { return say(n === 1 ? what + '_one' : what + '_many', { n: n }); };
  $('summary').textContent = say('summary', { n: D.key_tokens ? N + ' → ' + NK : N, L: count(L, 'layers'), H: count(H, 'heads'),
    focus: D.focus.token, fi: D.focus.index,
    target: D.target.token, top: D.top_heads.slice(0, 3).map(function (t) {
      return say('top_item', { layer: t.layer, head: t.head, w: t.weight.toFixed(2) }); }).join(T.list_sep) });
  D.notes.forEach(function (n) { $('notes').appendChild(el('li', '', n)); });
  $('first-col').textContent = say('on', { tok: KT[0] });
  $('last-col').textContent = say('on', { tok: KT[NK - 1] });

  // controls
  for (var l = 0; l < L; l++) { var o = el('option', '', say('layer_option', { l: l })); o.value = String(l); $('layer').appendChild(o); }
  $('layer').addEventListener('change', function () { state.layer = parseInt(this.value, 10); render(); });
  for (var h = 0; h < H; h++) {
    var b = el('button', 'head-btn', String(h));
    b.type = 'button'; b.style.background = color(h); b.dataset.head = String(h); b.title = say('head_title', { h: h });
    b.addEventListener('click', function (ev) {
      var hh = parseInt(this.dataset.head, 10), i = state.heads.indexOf(hh);
      if (ev.shiftKey || ev.ctrlKey || ev.metaKey) {
        if (i >= 0) { if (state.heads.length > 1) state.heads.splice(i, 1); } else state.heads.push(hh);
        state.heads.sort(function (a, c) { return a - c; });
      } else state.heads = [hh];
      render();
    });
    $('heads').appendChild(b);
  }
  $('all-heads').addEventListener('click', function () { state.heads = []; for (var i = 0; i < H; i++) state.heads.push(i); render(); });
  function setView(v) {
    state.view = v;
    $('head-view').hidden = v !== 'head'; $('model-view').hidden = v !== 'model';
    $('tab-head').classList.toggle('active', v === 'head'); $('tab-model').classList.toggle('active', v === 'model');
    render();
  }
  $('tab-head').addEventListener('click', function () { setView('head'); });
  $('tab-model').addEventListener('click', function () { setView('model'); });

  // head view: two token columns and the lines between them
  var left = [], right = [];
  D.tokens.forEach(function (t, i) {
    var a = el('div', 'tok', t); a.id = 'q-' + i; a.dataset.index = String(i);
    if (!selectable(i)) a.classList.add('disabled');
    a.addEventListener('mouseenter', function () { if (selectable(i)) { state.hover = i; render(); } });
    a.addEventListener('mouseleave', function () { state.hover = null; render(); });
    a.addEventListener('click', function () { if (selectable(i)) { state.pinned = i; render(); } });
    $('left').appendChild(a); left.push(a);
  });
  KT.forEach(function (t, i) {
    var seg = D.segments ? D.segments[i] : null;       // a sentence pair: mark the second text and where it starts
    var k = el('div', 'tok', t); k.id = 'k-' + i; k.dataset.index = String(i);
    k.addEventListener('click', function () { state.key = i; render(); });
    k.addEventListener('mouseenter', function () { k.classList.add('hovered'); });
    k.addEventListener('mouseleave', function () { k.classList.remove('hovered'); });
    $('right').appendChild(k); right.push(k);
    if (seg === 1) {
      [left[i], k].forEach(function (x) {
        x.classList.add('seg-b'); x.title = say('second_text');
        if (i > 0 && D.segments[i - 1] !== 1) x.classList.add('seg-start');
      });
    }
  });
  var svg = $('lines'), SVGNS = 'http:' + '//www.w3.org/2000/svg';  // a namespace name, not an address: split so scans for links stay clean
  var ROWS = Math.max(N, NK);
  svg.setAttribute('height', String(ROWS * ROW)); svg.style.height = (ROWS * ROW) + 'px';

  function mean(q) {                                  // (NK,) mean weights over the selected heads
    var m = new Float32Array(NK), n = 0;
    state.heads.forEach(function (h) { var r = row(state.layer, h, q); if (r) { n++; for (var j = 0; j < NK; j++) m[j] += r[j]; } });
    if (n) for (var j = 0; j < NK; j++) m[j] /= n;
    return m;
  }
  function entropy(r) { var e = 0; for (var j = 0; j < r.length; j++) if (r[j] > 0) e -= r[j] * Math.log(r[j]); return e; }

  function renderHead() {
    var q = active();
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    state.heads.forEach(function (h) {
      var r = row(state.layer, h, q); if (!r) return;
      for (var j = 0; j < NK; j++) {
        if (r[j] < 0.01) continue;
        var ln = document.createElementNS(SVGNS, 'line');
        ln.setAttribute('x1', '0'); ln.setAttribute('y1', String(q * ROW + ROW / 2 + 1));
        ln.setAttribute('x2', '240'); ln.setAttribute('y2', String(j * ROW + ROW / 2 + 1));
        ln.setAttribute('stroke', color(h)); ln.setAttribute('stroke-width', String(0.6 + 5 * r[j]));
        ln.setAttribute('stroke-opacity', String(Math.min(1, 0.15 + r[j])));
        ln.setAttribute('data-head', String(h)); ln.setAttribute('data-key', String(j));
        svg.appendChild(ln);
      }
    });
    var m = mean(q), order = [];
    for (var j = 0; j < NK; j++) order.push(j);
    order.sort(function (a, b) { return m[b] - m[a] || a - b; });
    left.forEach(function (e, i) { e.classList.toggle('active', i === q); e.classList.toggle('pinned', i === state.pinned); });
    right.forEach(function (e, i) {
      e.classList.toggle('top', i === order[0]);
      e.style.background = 'rgba(214, 51, 108, ' + Math.min(0.85, m[i]).toFixed(3) + ')';
    });
    $('sel-token').textContent = D.tokens[q];
    $('top-token').textContent = KT[order[0]];
    $('top-weight').textContent = fmt(m[order[0]]);
    var list = $('top-list'); list.innerHTML = '';
    order.slice(0, 5).forEach(function (j) {
      var li = el('li', '', KT[j] + ' ' + fmt(m[j]));
      li.dataset.index = String(j);
      var bar = el('span', 'bar'); bar.style.width = Math.round(120 * m[j]) + 'px'; li.appendChild(bar);
      list.appendChild(li);
    });
    var body = document.querySelector('#stats-table tbody'); body.innerHTML = '';
    for (var h = 0; h < H; h++) {
      var r = row(state.layer, h, q); if (!r) continue;
      var mx = 0; for (var k = 0; k < NK; k++) if (r[k] > mx) mx = r[k];
      var tr = el('tr', state.heads.indexOf(h) >= 0 ? 'sel' : '');
      [String(h), entropy(r).toFixed(2), fmt(mx), fmt(r[0]), fmt(r[NK - 1])].forEach(function (c) { tr.appendChild(el('td', '', c)); });
      body.appendChild(tr);
    }
  }

  // model view: every layer x head as a small map (or the focus row as a strip in statistics mode)
  var STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];  // viridis
  function rgb(v) {
    var x = Math.max(0, Math.min(1, v)) * (STOPS.length - 1), i = Math.min(STOPS.length - 2, Math.floor(x)), t = x - i;
    return [0, 1, 2].map(function (c) { return Math.round(STOPS[i][c] + t * (STOPS[i + 1][c] - STOPS[i][c])); });
  }
  var cells = [];
  function buildGrid() {
    var g = $('grid'); g.style.gridTemplateColumns = '36px repeat(' + H + ', max-content)';
    g.appendChild(el('div'));
    for (var h = 0; h < H; h++) g.appendChild(el('div', 'glabel', 'H' + h));
    for (var l = 0; l < L; l++) {
      g.appendChild(el('div', 'glabel', 'L' + l));
      for (var h2 = 0; h2 < H; h2++) {
        var c = el('div', maps ? 'cell' : 'cell strip'); c.dataset.layer = String(l); c.dataset.head = String(h2);
        c.id = 'cell-' + l + '-' + h2;
        var rows = maps ? N : 1, cv = document.createElement('canvas'); cv.width = NK; cv.height = rows;
        var ctx = cv.getContext('2d'), img = ctx.createImageData(NK, rows);
        for (var q = 0; q < rows; q++) {
          var r = maps ? row(l, h2, q) : row(l, h2, D.focus.index);
          for (var j = 0; j < NK; j++) { var p = rgb(r[j]), o = (q * NK + j) * 4; img.data[o] = p[0]; img.data[o + 1] = p[1]; img.data[o + 2] = p[2]; img.data[o + 3] = 255; }
        }
        ctx.putImageData(img, 0, 0); c.appendChild(cv);
        c.title = say('cell_title', { l: l, h: h2, focus: D.focus.token, target: D.target.token,
          w: fmt(row(l, h2, D.focus.index)[D.target.index]) });
        c.addEventListener('click', function () {
          state.layer = parseInt(this.dataset.layer, 10); state.heads = [parseInt(this.dataset.head, 10)]; setView('head');
        });
        g.appendChild(c); cells.push(c);
      }
    }
  }

  function render() {
    $('layer').value = String(state.layer);
    Array.prototype.forEach.call(document.querySelectorAll('.head-btn'), function (b) {
      b.classList.toggle('on', state.heads.indexOf(parseInt(b.dataset.head, 10)) >= 0);
    });
    $('head-label').textContent = state.heads.length === 1 ? say('head_label_one', { l: state.layer, h: state.heads[0] })
      : say('head_label_many', { l: state.layer, hs: state.heads.join(T.list_sep) });
    cells.forEach(function (c) {
      c.classList.toggle('sel', parseInt(c.dataset.layer, 10) === state.layer && state.heads.indexOf(parseInt(c.dataset.head, 10)) >= 0);
    });
    renderHead();
    renderNeuron();
  }

  // neuron view: q_d, k_d and their products for the active query and the clicked key, first selected head
  function renderNeuron() {
    if (!vec || state.key === null) return;
    var l = state.layer, h = state.heads[0], q = active(), k = state.key;
    right.forEach(function (e, i) { e.classList.toggle('key-sel', i === k); });
    $('neuron').hidden = false;
    $('neuron-title').textContent = say('neuron_title', { l: l, h: h, q: D.tokens[q], k: D.tokens[k] });
    var qv = qk(l, h, 0, q), kv = qk(l, h, 1, k), body = document.querySelector('#neuron-table tbody'), sum = 0, big = 1e-12;
    for (var d = 0; d < DH; d++) big = Math.max(big, Math.abs(qv[d] * kv[d]));
    body.innerHTML = '';
    for (var d2 = 0; d2 < DH; d2++) {
      var p = qv[d2] * kv[d2]; sum += p;
      var tr = el('tr'); tr.dataset.dim = String(d2);
      [String(d2), qv[d2].toFixed(3), kv[d2].toFixed(3), p.toFixed(3)].forEach(function (c) { tr.appendChild(el('td', '', c)); });
      var bar = el('span', 'nbar ' + (p >= 0 ? 'pos' : 'neg')); bar.style.width = Math.round(80 * Math.abs(p) / big) + 'px';
      var td = el('td'); td.appendChild(bar); tr.appendChild(td); body.appendChild(tr);
    }
    var scale = D.scale || 1 / Math.sqrt(DH), s = [], mx = -Infinity, z = 0;
    for (var j = 0; j < N; j++) {                        // this query's scaled scores over every key
      var kj = qk(l, h, 1, j), t = 0;
      for (var e = 0; e < DH; e++) t += qv[e] * kj[e];
      s.push(t * scale); mx = Math.max(mx, t * scale);
    }
    s.forEach(function (v) { z += Math.exp(v - mx); });
    var r = row(l, h, q);
    $('neuron-sum').textContent = say('neuron_sum', { s: sum.toFixed(3), scale: scale.toFixed(4), scaled: (sum * scale).toFixed(3),
      n: N, w: (Math.exp(s[k] - mx) / z).toFixed(3), m: r ? r[k].toFixed(3) : '—' });
    $('neuron-sum').dataset.score = String(sum); $('neuron-sum').dataset.weight = String(Math.exp(s[k] - mx) / z);
  }
  // ablation: how far each token's final state moved when the listed heads were knocked out
  if (D.ablation) {
    var A = D.ablation, dist = A.token_distance, top = Math.max.apply(null, dist.concat([1e-12]));
    $('ablation').hidden = false;
    $('ablation-title').textContent = say('ablation_title', { mode: T['mode_' + A.mode],
      heads: A.heads.map(function (x) { return 'L' + x.layer + ' H' + x.head; }).join(T.list_sep) });
    $('ablation-summary').textContent = say('ablation_summary', { focus: D.focus.token, d: A.focus_distance.toFixed(4),
      mean: A.others_mean_distance.toFixed(4), emb: A.embedding_distance.toFixed(4) });
    if (A.next_token) {
      $('ablation-next').textContent = say('ablation_next', { focus: D.focus.token, kl: A.next_token.kl.toFixed(4),
        tok: A.next_token.clean_top[0].token, delta: A.next_token.delta_logprob.toFixed(4) });
    }
    $('ablation-more').textContent = T.ablation_more;
    var tb = document.querySelector('#ablation-table tbody');
    dist.forEach(function (d, i) {
      var tr = el('tr', i === D.focus.index ? 'sel' : ''), bar = el('span', 'bar');
      bar.style.width = Math.round(160 * d / top) + 'px';
      var cell = el('td'); cell.appendChild(bar);
      [el('td', '', D.tokens[i]), el('td', '', d.toFixed(4)), cell].forEach(function (c) { tr.appendChild(c); });
      tb.appendChild(tr);
    });
  }
  buildGrid();
  render();
  document.body.dataset.ready = 'true';
})();
"""
