"use strict";
// qkv studio's page: one page, no reload. It asks the server (qkv/studio/server.py) and draws
// what comes back; every number it shows is the server's (float64 from qkv.glass for one head,
// 16-bit maps from qkv.analysis for the overview). The only arithmetic here is drawing: colours
// from weights, and B − A of two maps in the comparison's picture.
//
// Rules the Content-Security-Policy and safety impose: every text goes in with textContent (never
// innerHTML), no inline handlers (addEventListener only), styles set through element.style.
(() => {
  const WORDS = JSON.parse(document.getElementById("qkv-words").textContent);  // {en: {...}, zh: {...}}
  const LIMITS = JSON.parse(document.getElementById("qkv-limits").textContent);
  const $ = (id) => document.getElementById(id);
  const DEBOUNCE_MS = 300;
  const CARD_LABELS = 16;  // a card's map has token labels up to this many tokens (beyond, they would not be legible)
  const VIEWS = ["tutorial", "heads", "head", "intervene", "compare"];

  // ---- state: everything the page shows is drawn from here ---------------------------------
  const state = {
    lang: document.body.dataset.lang in WORDS ? document.body.dataset.lang : "en",
    view: "tutorial",
    models: [], model: null,
    text: "", second: "", pair: false,
    focus: null, target: null, pick: "focus",      // token indices chosen by clicking; null: the server picks
    analysis: null, maps: null,                     // the last /api/analyze answer and its decoded maps
    asked: null,                                    // the request that answer answers: every view asks about its texts
    failed: false,                                  // the last analysis was refused (its words are in the status line)
    sort: "order", filter: "all",
    layer: 0, head: 0, token: null, step: 0,        // the open head; token null: the focus token
    headData: null, headKey: "",
    off: [], history: [], mode: "zero", temperature: 1, iv: null, ivMaps: null, ivKey: "",
    cmp: null, cmpMaps: null, cmpKey: "", cmpLayer: 0, cmpHead: 0, cmpChosen: false,
    tut: {}, tutChapter: 0, tutStep: 0, tutHead: 0,
    switched: false,                                // left the tutorial once the first analysis came back
  };

  // ---- words --------------------------------------------------------------------------------
  /** The catalogue's text for ``key`` in the page's language (English, then the key, as fallbacks). */
  function t(key) {
    const w = WORDS[state.lang] || WORDS.en;
    return key in w ? w[key] : key in WORDS.en ? WORDS.en[key] : key;
  }
  /** ``t(key)`` with its {name} placeholders filled from ``values``. */
  function say(key, values = {}) {
    return t(key).replace(/\{(\w+)\}/g, (m, name) => (name in values ? String(values[name]) : m));
  }
  /** Every static label of the template: data-w (text), data-w-placeholder, data-w-title, data-w-aria. */
  function applyWords() {
    document.documentElement.lang = state.lang === "zh" ? "zh-CN" : "en";
    document.title = t("title");
    for (const e of document.querySelectorAll("[data-w]")) e.textContent = t(e.dataset.w);
    for (const e of document.querySelectorAll("[data-w-placeholder]")) e.placeholder = t(e.dataset.wPlaceholder);
    for (const e of document.querySelectorAll("[data-w-title]")) e.title = t(e.dataset.wTitle);
    for (const e of document.querySelectorAll("[data-w-aria]")) e.setAttribute("aria-label", t(e.dataset.wAria));
    for (const b of document.querySelectorAll(".langs button")) b.classList.toggle("on", b.dataset.lang === state.lang);
  }

  // ---- small DOM helpers ---------------------------------------------------------------------
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); return e; }
  function button(cls, text, onClick) {
    const b = el("button", cls, text);
    b.type = "button";
    if (onClick) b.addEventListener("click", onClick);
    return b;
  }
  function options(select, items, value) {  // items: [[value, label], ...]
    clear(select);
    for (const [v, label] of items) {
      const o = el("option", null, label);
      o.value = String(v);
      select.appendChild(o);
    }
    if (value !== undefined && value !== null) select.value = String(value);
  }
  function message(id, text, kind) {  // a view's one-line message ("" hides it)
    const e = $(id);
    e.textContent = text || "";
    e.hidden = !text;
    e.classList.toggle("error", kind === "error");
    e.classList.toggle("pending", kind === "busy");
  }
  /** A number as the page shows it: 3 decimals (masked: −∞); the full value stays in title/data-value. */
  function fmt(x, digits = 3) {
    if (x === null || x === undefined) return "−∞";
    if (!Number.isFinite(x)) return String(x);
    const s = x.toFixed(digits);
    return /^-0\.0*$/.test(s) ? s.slice(1) : s;
  }
  /** A small non-negative quantity (a divergence): 4 decimals, or 2 significant digits below 0.001. */
  function small(x) { return x !== 0 && Math.abs(x) < 1e-3 ? x.toExponential(1) : fmt(x, 4); }
  function numCell(x, step) {
    const td = el("td", "num", fmt(x));
    const full = x === null || x === undefined ? "-inf" : String(x);  // String(double): the shortest exact spelling
    td.title = full;
    td.dataset.value = full;
    if (step) td.dataset.step = step;
    return td;
  }
  function debounce(fn, ms) {
    let timer = 0;
    return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
  }
  const headName = (l, h) => say("head_name", { l, h });

  // ---- the server: one channel per question, only the latest answer of each is used ----------
  class ApiError extends Error {
    constructor(text, status, model) { super(text); this.status = status; this.model = model || null; }
  }
  const latest = {};        // channel -> sequence number of its newest request
  const pending = new Set();
  /** POST ``body`` (or GET without one) to ``path``. Resolves to the JSON answer, or to null when a
   * newer request on the same channel was sent meanwhile (a stale answer is dropped unread). */
  async function ask(channel, path, body) {
    const seq = (latest[channel] = (latest[channel] || 0) + 1);
    pending.add(channel);
    document.body.classList.add("busy");
    try {
      // the server words its refusals in the page's language (a request's own lang field wins)
      const headers = { Accept: "application/json", "Accept-Language": state.lang };
      const init = body === undefined ? { headers }
        : { method: "POST", headers: { ...headers, "Content-Type": "application/json" }, body: JSON.stringify(body) };
      let response;
      try {
        response = await fetch(path, init);
      } catch (e) {
        if (seq !== latest[channel]) return null;
        throw new ApiError(t("err_offline"), 0);
      }
      let data = null;
      try { data = await response.json(); } catch (e) { data = null; }
      if (seq !== latest[channel]) return null;
      if (!response.ok) throw new ApiError((data && data.error) || `HTTP ${response.status}`, response.status, data && data.model);
      return data;
    } finally {
      if (seq === latest[channel]) pending.delete(channel);
      document.body.classList.toggle("busy", pending.size > 0);
    }
  }
  /** Forget ``channel``'s request on its way: its answer, when it comes, is dropped. */
  function drop(channel) {
    latest[channel] = (latest[channel] || 0) + 1;
    pending.delete(channel);
    document.body.classList.toggle("busy", pending.size > 0);
  }
  /** Words for an error: the server's own line, with what kind of limit it is when it is one. */
  function errorText(e) {
    if (e.status === 413) return `${t("err_limit")} ${e.message}`;
    if (e.status === 503) return `${t("err_model")} ${e.message}`;
    return e.message;
  }
  /** A view's message line showing the refusal ``e``; when the server named a model that answers
   * the request instead, a button switches to it (one click). */
  function showError(id, e) {
    message(id, errorText(e), "error");
    const other = e.model && state.models.find((m) => m.id === e.model && m.id !== state.model);
    if (other) {
      const b = button("switch", say("switch_model", { name: other.name }), () => switchModel(other.id));
      b.dataset.model = other.id;
      $(id).append(" ", b);
    }
  }

  // ---- maps: (L, H, Nq, Nk) weights as 16-bit integers, decoded when first drawn -------------
  const LITTLE = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
  class Maps {
    constructor(packed) {
      [this.L, this.H, this.Nq, this.Nk] = packed.shape;
      this.b64 = packed.data;
      this.u16 = null;
    }
    /** The raw 16-bit weights (value / 65535), decoded once. */
    get data() {
      if (!this.u16) {
        const s = atob(this.b64);
        const bytes = new Uint8Array(s.length);
        for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
        if (LITTLE) this.u16 = new Uint16Array(bytes.buffer);
        else {  // a big-endian machine: read the little-endian pairs one by one
          const view = new DataView(bytes.buffer);
          this.u16 = new Uint16Array(bytes.length / 2);
          for (let i = 0; i < this.u16.length; i++) this.u16[i] = view.getUint16(2 * i, true);
        }
        this.b64 = null;
      }
      return this.u16;
    }
    offset(l, h) { return (l * this.H + h) * this.Nq * this.Nk; }
    at(l, h, q, k) { return this.data[this.offset(l, h) + q * this.Nk + k] / 65535; }
  }

  // ---- colours ------------------------------------------------------------------------------
  function ramp(stops) {  // 256 RGB entries through evenly spaced stops
    const lut = new Uint8ClampedArray(256 * 3);
    for (let i = 0; i < 256; i++) {
      const x = (i / 255) * (stops.length - 1), j = Math.min(stops.length - 2, Math.floor(x)), f = x - j;
      for (let c = 0; c < 3; c++) lut[i * 3 + c] = stops[j][c] + f * (stops[j + 1][c] - stops[j][c]);
    }
    return lut;
  }
  // weights 0 → 1: paper white to deep blue; differences −m → +m: blue, white, red
  const SEQ = ramp([[255, 255, 255], [208, 225, 242], [125, 180, 220], [44, 121, 186], [12, 52, 115], [8, 24, 66]]);
  const DIV = ramp([[33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130], [178, 24, 43]]);
  const lutIndex = (v) => Math.max(0, Math.min(255, Math.round(v * 255)));
  function rgb(lut, i) { return `rgb(${lut[i * 3]}, ${lut[i * 3 + 1]}, ${lut[i * 3 + 2]})`; }
  function shade(e, v) {  // a table cell's background for a weight in [0, 1]
    e.style.backgroundColor = rgb(SEQ, lutIndex(v * 0.8));
    if (v > 0.55) e.classList.add("dark");
  }

  /** A 1-pixel-per-cell canvas of rows × cols; ``fill(px)`` writes RGBA into the pixel array. */
  function pixels(rows, cols, fill) {
    const c = document.createElement("canvas");
    c.width = cols; c.height = rows;
    const ctx = c.getContext("2d"), img = ctx.createImageData(cols, rows);
    fill(img.data);
    ctx.putImageData(img, 0, 0);
    return c;
  }
  /** One head of ``maps`` as pixels: the 16-bit weight's top byte indexes the colour table. */
  function headPixels(maps, l, h) {
    const d = maps.data, o = maps.offset(l, h), n = maps.Nq * maps.Nk;
    return pixels(maps.Nq, maps.Nk, (px) => {
      for (let i = 0; i < n; i++) {
        const c = (d[o + i] >> 8) * 3;
        px[4 * i] = SEQ[c]; px[4 * i + 1] = SEQ[c + 1]; px[4 * i + 2] = SEQ[c + 2]; px[4 * i + 3] = 255;
      }
    });
  }
  /** A matrix of floats (rows of numbers) as pixels through ``lut`` after ``norm``. */
  function matrixPixels(m, lut, norm) {
    const rows = m.length, cols = rows ? m[0].length : 0;
    return pixels(rows, cols, (px) => {
      for (let i = 0; i < rows; i++) for (let j = 0; j < cols; j++) {
        const c = lutIndex(norm(m[i][j])) * 3, o = 4 * (i * cols + j);
        px[o] = lut[c]; px[o + 1] = lut[c + 1]; px[o + 2] = lut[c + 2]; px[o + 3] = 255;
      }
    });
  }

  /** Draw ``src`` (1 px per cell) on ``canvas`` with token labels when they fit, and the query
   * row ``hi`` outlined. ``size``: the map's side in CSS pixels. Big maps (``fit`` false) size the
   * canvas to whole cells; a card's canvas (``fit`` true) keeps the square its style gives it and
   * its labels are small. Remembers its geometry, so a click or a hover can find the cell. */
  function drawMap(canvas, src, rowLabels, colLabels, hi, size = 440, fit = false) {
    const rows = src.height, cols = src.width, n = Math.max(rows, cols, 1);
    const font = fit ? 8 : 12, most = fit ? 6 : 12;
    const labelled = !!(rowLabels && colLabels) && n <= (fit ? CARD_LABELS : 48);
    const ctx0 = canvas.getContext("2d");
    ctx0.font = `${font}px system-ui, sans-serif`;
    const clip = (s) => (s.length > most ? s.slice(0, most - 1) + "…" : s);
    const widest = (ls) => Math.max(0, ...ls.map((s) => ctx0.measureText(clip(s)).width));
    let left = labelled ? Math.ceil(widest(rowLabels)) + (fit ? 3 : 8) : 0, top = labelled ? Math.ceil(widest(colLabels)) + (fit ? 3 : 8) : 0;
    let cell;
    if (fit) {  // one square: the labels take at most a third of it
      left = top = Math.min(Math.max(left, top), Math.floor(size / 3));
      cell = (size - left) / n;
    } else cell = Math.max(2, Math.min(30, Math.floor(size / n)));
    const w = fit ? size : left + cols * cell, h = fit ? size : top + rows * cell, dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
    if (!fit) { canvas.style.width = `${w}px`; canvas.style.height = `${h}px`; }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(src, left, top, cols * cell, rows * cell);
    if (labelled) {
      ctx.font = `${font}px system-ui, sans-serif`;
      ctx.fillStyle = "#333";
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      rowLabels.forEach((s, i) => ctx.fillText(clip(s), left - 2, top + (i + 0.5) * cell));
      colLabels.forEach((s, j) => {
        ctx.save();
        ctx.translate(left + (j + 0.5) * cell, top - 2);
        ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left";
        ctx.fillText(clip(s), 0, 0);
        ctx.restore();
      });
    }
    if (hi !== null && hi !== undefined && hi < rows) {
      ctx.strokeStyle = "#e8590c";
      ctx.lineWidth = 2;
      ctx.strokeRect(left + 1, top + hi * cell + 1, cols * cell - 2, cell - 2);
    }
    canvas.qkvGeometry = { left, top, cell, rows, cols, w, h };
    canvas.dataset.labels = labelled ? "1" : "";
  }
  /** The (row, column) of a drawn map under the mouse, or null. */
  function cellAt(canvas, event) {
    const g = canvas.qkvGeometry;
    if (!g) return null;
    const r = canvas.getBoundingClientRect(), scale = r.width / g.w || 1;
    const x = (event.clientX - r.left) / scale - g.left, y = (event.clientY - r.top) / scale - g.top;
    const i = Math.floor(y / g.cell), j = Math.floor(x / g.cell);
    return i >= 0 && i < g.rows && j >= 0 && j < g.cols ? [i, j] : null;
  }
  function rowAt(canvas, event) {  // the row of a map under a click (its label included), or null
    const g = canvas.qkvGeometry;
    if (!g) return null;
    const r = canvas.getBoundingClientRect(), scale = r.width / g.w || 1;
    const i = Math.floor(((event.clientY - r.top) / scale - g.top) / g.cell);
    return i >= 0 && i < g.rows ? i : null;
  }
  /** Hovering a map shows the cell's words in the tip (``canvas.qkvCell(i, j)``: its line). */
  function hoverable(canvas) {
    canvas.addEventListener("mousemove", (ev) => {
      const c = ev.currentTarget.qkvCell ? cellAt(ev.currentTarget, ev) : null;
      tip(c && ev.currentTarget.qkvCell(c[0], c[1]), ev);
    });
    canvas.addEventListener("mouseleave", () => tip(null));
  }
  function tip(text, ev) {
    const e = $("tip");
    if (!text) { e.hidden = true; return; }
    e.textContent = text;
    e.hidden = false;
    const x = Math.min(ev.clientX + 14, window.innerWidth - e.offsetWidth - 8);
    e.style.left = `${Math.max(4, x)}px`;
    e.style.top = `${ev.clientY + 16}px`;
  }
  /** The tip line of a weight: head ``name``, query ``i`` and key ``j`` of ``toks``. */
  const cellWords = (name, qs, ks, i, j, w) => say("hover_cell", { name, q: qs[i], qi: i, k: ks[j], ki: j, w: fmt(w) });
  function drawLegends() {
    for (const [id, lut] of [["legend-seq", SEQ], ["legend-div", DIV]]) {
      const c = $(id), ctx = c.getContext("2d"), img = ctx.createImageData(c.width, 1);
      for (let i = 0; i < c.width; i++) {
        const k = Math.round((i / (c.width - 1)) * 255) * 3;
        img.data.set([lut[k], lut[k + 1], lut[k + 2], 255], 4 * i);
      }
      ctx.putImageData(img, 0, 0);
    }
  }

  // ---- head cards: one small map each, drawn only while on screen ----------------------------
  const onScreen = new Set();
  const observer = new IntersectionObserver((entries) => {
    for (const e of entries) {
      if (e.isIntersecting) { onScreen.add(e.target); drawCard(e.target); } else onScreen.delete(e.target);
    }
  }, { rootMargin: "150px" });
  function drawCard(card) {
    const maps = card.qkvMaps, toks = card.qkvTokens;
    if (!maps || card.qkvDrawn === maps) return;
    const l = +card.dataset.layer, h = +card.dataset.head;
    const src = headPixels(maps, l, h), cv = card.querySelector("canvas");
    const side = Math.round(cv.getBoundingClientRect().width);
    if (toks && maps.Nq <= CARD_LABELS && side > 0) drawMap(cv, src, toks, toks, null, side, true);
    else {  // one pixel per weight, scaled by the card's style
      cv.width = src.width; cv.height = src.height;
      cv.getContext("2d").drawImage(src, 0, 0);
      cv.qkvGeometry = { left: 0, top: 0, cell: 1, rows: src.height, cols: src.width, w: src.width, h: src.height };
      cv.dataset.labels = "";
    }
    cv.qkvCell = toks ? (i, j) => cellWords(headName(l, h), toks, toks, i, j, maps.at(l, h, i, j)) : null;
    card.qkvDrawn = maps;
    card.dataset.drawn = "1";
  }
  /** Show ``maps`` (of ``tokens``) on every card of ``grid``; those on screen are drawn now, the rest when scrolled to. */
  function setCardMaps(grid, maps, tokens) {
    for (const card of grid.querySelectorAll(".card")) {
      card.qkvMaps = maps;
      card.qkvTokens = tokens;
      if (card.qkvDrawn !== maps) delete card.dataset.drawn;
      if (onScreen.has(card)) drawCard(card);
    }
  }
  /** ``grid``'s L × H cards, made once per shape; ``onClick(layer, head)``. */
  function cards(grid, L, H, onClick) {
    const shape = `${L}x${H}`;
    if (grid.dataset.shape === shape) return [...grid.querySelectorAll(".card")];
    for (const old of grid.querySelectorAll(".card")) { observer.unobserve(old); onScreen.delete(old); }
    clear(grid);
    grid.dataset.shape = shape;
    grid.style.gridTemplateColumns = `repeat(${Math.min(H, 12)}, minmax(0, 112px))`;
    const made = [];
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) {
      const card = button("card");
      card.dataset.layer = String(l);
      card.dataset.head = String(h);
      card.id = `${grid.id}-${l}-${h}`;
      const mini = el("canvas", "mini");
      hoverable(mini);
      card.append(mini, el("span", "card-name"), el("span", "card-kind"), el("span", "card-stats"), el("span", "card-badge"));
      card.addEventListener("click", (ev) => onClick(l, h, ev));
      grid.appendChild(card);
      observer.observe(card);
      made.push(card);
    }
    return made;
  }

  // ---- views ---------------------------------------------------------------------------------
  function show(view) {
    state.view = view;
    saveUrl();
    for (const v of VIEWS) {
      $(`view-${v}`).hidden = v !== view;
      const tab = $(`tab-${v}`);
      tab.classList.toggle("on", v === view);
      tab.setAttribute("aria-selected", String(v === view));
    }
    refreshView();
  }
  function refreshView() {
    const draw = { tutorial: ensureTutorial, heads: renderHeads, head: ensureHead, intervene: ensureIntervene, compare: ensureCompare };
    draw[state.view]();
  }
  const isToy = () => !!state.analysis && state.analysis.model.kind === "toy";
  /** How many of the analysis's tokens are the first text's: the glass box, interventions and the
   * comparison read that text alone (a sentence pair's second text is the overview's only). */
  function ownCount() {
    const a = state.analysis;
    return a.segments ? a.segments.filter((x) => x !== 1).length : a.tokens.length;
  }
  /** The token whose output an intervention reports: the chosen focus; for a decoder nobody has
   * chosen one for, the last token (its next-token prediction is the sentence's continuation). */
  function outputFocus() {
    const a = state.analysis;
    return state.focus === null && a.model.kind === "decoder" ? ownCount() - 1 : ownFocus();
  }
  const ownFocus = () => (state.analysis.focus !== null && state.analysis.focus < ownCount() ? state.analysis.focus : null);
  const modelInfo = () => state.models.find((m) => m.id === state.model) || null;

  // ---- 1. the tutorial -----------------------------------------------------------------------
  async function ensureTutorial() {
    const lang = state.lang;
    if (!state.tut[lang]) {
      try {
        const data = await ask("tutorial", `/api/tutorial?lang=${encodeURIComponent(lang)}`);
        if (!data) return;
        state.tut[lang] = data;
      } catch (e) {
        $("tut-intro").textContent = errorText(e);
        return;
      }
    }
    if (state.view === "tutorial" && state.lang === lang) renderTutorial();
  }
  /** The matrices one chapter shows, in the order the computation makes them. */
  function tutMatrices(step) {
    const tr = step.trace, one = tr.heads && tr.heads.length ? tr.heads[state.tutHead] : tr, s = one.steps;
    const list = [];
    const add = (name, m, cols, values = {}) => { if (m) list.push({ name, m, cols, values }); };
    const dims = (m) => m[0].map((_, j) => String(j));
    const d = one.d_k, r = fmt(Math.sqrt(d));
    add("x", tr.steps.x, tr.steps.x && dims(tr.steps.x));
    add("q", s.q, dims(s.q)); add("k", s.k, dims(s.k)); add("v", s.v, dims(s.v));
    add("scores", s.scores, tr.tokens); add("scaled", s.scaled, tr.tokens, { d, r });
    add("modified", s.modified, tr.tokens); add("masked", s.masked, tr.tokens);
    add("weights", s.weights, tr.tokens); add("output", s.output, dims(s.output));
    if (tr.concat) add("concat", tr.concat, dims(tr.concat), { h: tr.num_heads });
    if (tr.projected) add("projected", tr.projected, dims(tr.projected));
    return list;
  }
  function renderTutorial() {
    const data = state.tut[state.lang];
    if (!data) return;
    const step = data.steps[state.tutChapter], tr = step.trace;
    // chapters
    const nav = clear($("tut-chapters"));
    data.steps.forEach((s, i) => {
      const b = button(`chapter${i === state.tutChapter ? " on" : ""}`, say("chapter", { i: i + 1, name: t(`tut_${s.name}`) }),
        () => { state.tutChapter = i; state.tutStep = 0; state.tutHead = 0; renderTutorial(); });
      b.dataset.chapter = s.name;
      nav.appendChild(b);
    });
    $("tut-title").textContent = t(`tut_${step.name}`);
    $("tut-intro").textContent = t(`tut_${step.name}_intro`);
    // the two heads: one switch per head
    const switches = clear($("tut-heads"));
    if (tr.heads && tr.heads.length) {
      tr.heads.forEach((_, h) => switches.appendChild(button(`toggle${h === state.tutHead ? " on" : ""}`, say("head_n", { h }),
        () => { state.tutHead = h; renderTutorial(); })));
    }
    // the matrices, the current one outlined and explained
    const mats = tutMatrices(step);
    state.tutStep = Math.min(state.tutStep, mats.length - 1);
    const box = clear($("tut-mats"));
    mats.forEach((mx, i) => {
      const fig = matrix(mx.m, tr.tokens, mx.cols, say(`mx_${mx.name}`, mx.values), mx.name, step.token, 8);
      fig.classList.toggle("current", i === state.tutStep);
      fig.addEventListener("click", () => { state.tutStep = i; renderTutorial(); });
      box.appendChild(fig);
    });
    const cur = mats[state.tutStep];
    $("tut-where").textContent = say("where", { i: state.tutStep + 1, n: mats.length, chapter: state.tutChapter + 1,
                                                chapters: data.steps.length });
    $("tut-explain").textContent = say(`mx_${cur.name}_help`, { ...cur.values, t: tr.tokens[step.token] });
    $("tut-prev").disabled = state.tutChapter === 0 && state.tutStep === 0;
    $("tut-next").disabled = state.tutChapter === data.steps.length - 1 && state.tutStep === mats.length - 1;
    story($("tut-story"), step.story);
    $("tut-text").textContent = step.text;
  }
  function tutMove(delta) {
    const data = state.tut[state.lang];
    if (!data) return;
    const count = tutMatrices(data.steps[state.tutChapter]).length;
    let i = state.tutStep + delta;
    if (i < 0 && state.tutChapter > 0) {
      state.tutChapter -= 1; state.tutHead = 0;
      i = tutMatrices(data.steps[state.tutChapter]).length - 1;
    } else if (i >= count && state.tutChapter < data.steps.length - 1) {
      state.tutChapter += 1; state.tutHead = 0; i = 0;
    }
    state.tutStep = Math.max(0, Math.min(i, tutMatrices(data.steps[state.tutChapter]).length - 1));
    renderTutorial();
    const cur = $("tut-mats").querySelector(".current");
    if (cur && cur.scrollIntoView) cur.scrollIntoView({ block: "nearest", inline: "nearest" });
  }
  /** A matrix as a small table: rows are tokens, columns ``cols`` (at most ``maxCols``, the rest
   * elided in the middle); weight-like matrices shaded. ``hiRow``: the story's token. */
  function matrix(m, rows, cols, title, name, hiRow, maxCols) {
    const fig = el("figure", "mat");
    fig.dataset.mat = name;
    const n = cols.length;
    let shown = [...cols.keys()];
    if (maxCols && n > maxCols) shown = [0, 1, 2, 3, -1, n - 2, n - 1];
    fig.appendChild(el("figcaption", null, `${title}   (${m.length}×${n})`));
    const wrap = el("div", "scroll"), table = el("table", "matrix"), head = el("tr");
    head.appendChild(el("th"));
    for (const j of shown) head.appendChild(el("th", "col", j < 0 ? "…" : cols[j]));
    table.appendChild(el("thead")).appendChild(head);
    const body = table.appendChild(el("tbody"));
    const weightLike = name === "weights";
    m.forEach((row, i) => {
      const tr = el("tr", i === hiRow ? "hi" : null);
      tr.appendChild(el("th", "row", rows[i] !== undefined ? rows[i] : String(i)));
      for (const j of shown) {
        if (j < 0) { tr.appendChild(el("td", "gap", "…")); continue; }
        const td = numCell(row[j], name);
        if (weightLike) shade(td, row[j]);
        tr.appendChild(td);
      }
      body.appendChild(tr);
    });
    wrap.appendChild(table);
    fig.appendChild(wrap);
    return fig;
  }
  /** A story (lines of text) as paragraphs; indented lines keep their indent. */
  function story(box, text) {
    clear(box);
    for (const line of String(text || "").split("\n")) {
      box.appendChild(el("p", !line.trim() ? "gap" : /^\s/.test(line) ? "indent" : null, line));
    }
  }

  // ---- the text box, the model and the tokens ------------------------------------------------
  function analyzeBody() {
    if (!state.model || !state.text.trim()) return null;
    return { model: state.model, text: state.text, pair: state.pair && state.second.trim() ? state.second : null,
             focus: state.focus, target: state.target, lang: state.lang };
  }
  /** Whether the analysis on screen answers the texts and model in the boxes now (a token
   * clicked in it is then a token of these texts). */
  function current() {
    const b = analyzeBody(), a = state.asked;
    return !!(b && a && state.analysis && b.model === a.model && b.text === a.text && b.pair === a.pair);
  }
  /** What a view without an analysis says: nothing after a refusal (the status line says why). */
  const waiting = () => (state.failed ? "" : state.text.trim() ? t("working") : t("type_first"));
  function forget() {
    state.analysis = null; state.maps = null; state.asked = null;
    state.iv = null; state.ivMaps = null; state.ivKey = "";
    state.cmp = null; state.cmpKey = "";
    state.headData = null; state.headKey = "";
  }
  async function runAnalyze() {
    const body = analyzeBody();
    saveUrl();
    if (!body) {
      drop("analyze");
      state.failed = false;
      forget();
      renderTokens(); message("status", "");
      refreshView();
      return;
    }
    message("status", t("working"), "busy");
    let data;
    try {
      data = await ask("analyze", "/api/analyze", body);
    } catch (e) {
      // the refusal replaces the last answer: no tokens, maps or hints of another text stay on screen
      state.failed = true;
      forget();
      renderTokens();
      refreshView();
      showError("status", e);
      if (e.status === 503) { modelError(e.message); loadModels(); }  // the picker marks the model that failed
      return;
    }
    if (!data) return;  // a newer request is on its way
    state.failed = false;
    state.asked = body;
    state.analysis = data;
    state.maps = new Maps(data.maps);
    const info = modelInfo();
    if (info) Object.assign(info, data.model);
    modelError(null);
    if (state.layer >= data.layers || state.head >= data.heads) { state.layer = 0; state.head = 0; }
    if (state.cmpLayer >= data.layers || state.cmpHead >= data.heads) { state.cmpLayer = 0; state.cmpHead = 0; }
    state.off = state.off.filter(([l, h]) => l < data.layers && h < data.heads);
    document.body.dataset.analyses = String((+document.body.dataset.analyses || 0) + 1);
    message("status", say("status_ready", { n: data.tokens.length, max: LIMITS.max_tokens, model: data.model.name,
                                            L: data.layers, H: data.heads }));
    renderTokens();
    fillHeadSelects();
    if (state.view === "tutorial" && !state.switched) { state.switched = true; show("heads"); } else refreshView();
  }

  function modelError(text) {
    const e = $("model-error");
    const info = modelInfo();
    const line = text || (info && info.error ? say("model_failed_line", { name: info.name, error: info.error }) : "");
    e.textContent = line;
    e.hidden = !line;
  }
  async function loadModels() {
    let data;
    try {
      data = await ask("models", "/api/models");
      if (!data) return;
      state.models = data.models;
    } catch (e) {
      message("status", errorText(e), "error");
      return;
    }
    // the page opens on the server's choice (the real model when there is one), unless the address names another
    if (!state.models.some((m) => m.id === state.model) && state.models.length) state.model = data.default || state.models[0].id;
    fillModels();
    modelError(null);
  }
  /** Use model ``id``: what was computed with the previous one is forgotten, the text runs again. */
  function switchModel(id) {
    state.model = id;
    $("model").value = id;
    forget();
    state.focus = null; state.target = null; state.token = null;
    state.off = []; state.history = []; state.cmpChosen = false;
    state.layer = 0; state.head = 0;
    modelError(null);
    runAnalyze();
  }
  function fillModels() {
    const label = (m) => (m.error ? say("model_failed", { name: m.name }) : m.id === "toy" ? t("toy_model") : m.name);
    options($("model"), state.models.map((m) => [m.id, label(m)]), state.model);
  }

  function renderTokens() {
    const box = clear($("tokens")), a = state.analysis;
    const line = $("focus-line"), notes = clear($("notes"));
    if (!a) { line.textContent = state.text.trim() || state.failed ? "" : t("type_first"); return; }
    a.tokens.forEach((tok, i) => {
      const b = button("tok", tok);
      b.dataset.index = String(i);
      b.setAttribute("role", "option");
      if (i === a.focus) b.classList.add("focus");
      if (i === a.target) b.classList.add("target");
      if (a.segments && a.segments[i] === 1) b.classList.add("seg-b");
      b.title = say("token_title", { i, t: tok });
      b.addEventListener("click", (ev) => chooseToken(i, ev.shiftKey || state.pick === "target" ? "target" : "focus"));
      box.appendChild(b);
    });
    line.textContent = a.focus === null || a.focus === undefined ? "" : say("focus_line", {
      f: a.tokens[a.focus], fi: a.focus, t: a.target === null ? "—" : a.tokens[a.target], ti: a.target === null ? "—" : a.target });
    for (const n of a.notes || []) notes.appendChild(el("li", null, n));
  }
  function chooseToken(i, what) {
    if (!current()) return;  // the tokens on screen are another text's (its answer is on its way): no stale index
    if (what === "target") state.target = i;
    else { state.focus = i; state.target = null; state.token = null; }
    runAnalyze();
  }
  function counter(id, text) {
    const e = $(id);
    e.textContent = say("count", { n: text.length, max: LIMITS.max_chars });
    e.classList.toggle("over", text.length > LIMITS.max_chars);
  }

  // ---- 2. the whole model at a glance --------------------------------------------------------
  const SORTS = ["order", "entropy", "mean_distance", "sink", "link"];
  const KINDS = ["first-token", "previous-token", "self", "broad", "sink-logit"];
  const kindWord = (k) => t(`kind_${String(k).replace(/-/g, "_")}`);
  function fillHeadControls() {
    options($("sort"), SORTS.map((s) => [s, t(`sort_${s}`)]), state.sort);
    options($("filter"), [["all", t("filter_all")], ["linked", t("filter_linked")], ...KINDS.map((k) => [k, kindWord(k)])], state.filter);
    options($("iv-mode"), [["zero", t("mode_zero")], ["mean", t("mode_mean")], ["patch", t("mode_patch")]], state.mode);
  }
  function statOf(l, h) {
    const a = state.analysis;
    return a.stats.find((s) => s.layer === l && s.head === h) || null;
  }
  /** How much the focus token's query gives the target, per head (read from the map). */
  function linkWeight(l, h) {
    const a = state.analysis;
    return a.focus === null || a.target === null ? 0 : state.maps.at(l, h, a.focus, a.target);
  }
  function renderHeads() {
    const a = state.analysis, grid = $("grid");
    if (!a) {
      message("heads-empty", waiting());
      clear(grid); grid.dataset.shape = ""; clear($("linked")); $("heads-summary").textContent = "";
      return;
    }
    message("heads-empty", "");
    const linked = new Map(a.top_heads.map((x, i) => [`${x.layer}.${x.head}`, { rank: i, weight: x.weight }]));
    const all = cards(grid, a.layers, a.heads, (l, h) => openHead(l, h));
    const rows = [];
    for (const card of all) {
      const l = +card.dataset.layer, h = +card.dataset.head, s = statOf(l, h), link = linked.get(`${l}.${h}`);
      card.querySelector(".card-name").textContent = headName(l, h);
      card.querySelector(".card-kind").textContent = s ? kindWord(s.kind) : "";
      card.querySelector(".card-stats").textContent = s
        ? say("stats_short", { e: fmt(s.entropy, 2), d: fmt(s.mean_distance, 1), s: fmt(s.sink, 2) }) : "";
      card.querySelector(".card-badge").textContent = link ? say("link_badge", { w: fmt(link.weight, 2) }) : "";
      card.classList.toggle("linked", !!link);
      card.dataset.kind = s ? s.kind : "";
      if (link) card.dataset.rank = String(link.rank); else delete card.dataset.rank;
      card.title = s ? say("card_title", { name: headName(l, h), kind: kindWord(s.kind), e: fmt(s.entropy), d: fmt(s.mean_distance),
                                            s: fmt(s.sink), top: s.top_token || "—" }) : headName(l, h);
      rows.push({ card, l, h, s, link });
    }
    // sort (CSS order: no DOM moves) and filter
    const key = {
      order: (r) => r.l * a.heads + r.h,
      entropy: (r) => (r.s ? r.s.entropy : 0),                 // most focused first
      mean_distance: (r) => -(r.s ? r.s.mean_distance : 0),    // longest reach first
      sink: (r) => -(r.s ? r.s.sink : 0),                      // most weight on the first token first
      link: (r) => -linkWeight(r.l, r.h),                      // focus → target weight, largest first
    }[state.sort];
    rows.sort((x, y) => key(x) - key(y) || x.l - y.l || x.h - y.h);
    let shown = 0;
    rows.forEach((r, i) => {
      r.card.style.order = String(i);
      const pass = state.filter === "all" || (state.filter === "linked" ? !!r.link : r.s && r.s.kind === state.filter);
      r.card.hidden = !pass;
      if (pass) shown += 1;
    });
    setCardMaps(grid, state.maps, a.tokens);
    $("heads-summary").textContent = say("heads_summary", { shown, n: rows.length, L: a.layers, H: a.heads, N: a.tokens.length });
    // the heads linking focus → target, strongest first
    const box = clear($("linked"));
    if (a.top_heads.length && a.focus !== null && a.target !== null) {
      box.appendChild(el("span", "chips-label", say("linked_label", { f: a.tokens[a.focus], t: a.tokens[a.target] })));
      for (const x of a.top_heads) {
        const chip = button("chip", `${headName(x.layer, x.head)}  ${fmt(x.weight, 2)}`, () => openHead(x.layer, x.head));
        chip.dataset.layer = String(x.layer); chip.dataset.head = String(x.head);
        box.appendChild(chip);
      }
    }
  }
  function openHead(l, h) {
    state.layer = l; state.head = h;
    show("head");
  }

  // ---- 3. one head in the float64 glass box --------------------------------------------------
  function fillHeadSelects() {
    const a = state.analysis;
    if (!a) return;
    const ls = [...Array(a.layers).keys()].map((l) => [l, String(l)]), hs = [...Array(a.heads).keys()].map((h) => [h, String(h)]);
    options($("head-layer"), ls, state.layer); options($("head-head"), hs, state.head);
    options($("cmp-layer"), ls, state.cmpLayer); options($("cmp-head"), hs, state.cmpHead);
  }
  /** The glass box's steps for a trace's ``steps``: the score function and the mask only when present. */
  const STEP_NAMES = (s) => ["q", "k", "scores", "scaled", ...(s.modified ? ["modified"] : []), ...(s.masked ? ["masked"] : []),
                            "weights", "output"];
  async function ensureHead() {
    const a = state.analysis;
    saveUrl();
    if (!a) { message("head-message", waiting()); clearHead(); return; }
    fillHeadSelects();
    const s = statOf(state.layer, state.head);
    $("head-kind").textContent = s ? say("head_summary", { name: headName(state.layer, state.head), kind: kindWord(s.kind),
      e: fmt(s.entropy, 2), d: fmt(s.mean_distance, 2), s: fmt(s.sink, 2) }) : "";
    // the glass box reads what the overview read: the text, or the sentence pair
    const asked = state.asked, pair = a.segments ? asked.pair : null;
    let token = state.token !== null ? state.token : (pair ? a.focus : ownFocus());
    if (token === null || token >= a.tokens.length) token = 0;
    const body = { model: asked.model, text: asked.text, pair, layer: state.layer, head: state.head, token, lang: state.lang };
    const key = JSON.stringify(body);
    // same head, another token: redraw the numbers now (the trace has every row), the story follows
    const same = state.headData && state.headData.qkvBase === JSON.stringify({ ...body, token: 0, lang: "" });
    if (same) renderGlass(token);
    else clearHead();  // another head or text: no numbers of the old one stay on screen
    if (state.headKey === key && state.headData) { message("head-message", ""); return; }
    message("head-message", t("working"), "busy");
    let data;
    try {
      data = await ask("head", "/api/head", body);
    } catch (e) {
      showError("head-message", e);
      return;
    }
    if (!data) return;
    data.qkvBase = JSON.stringify({ ...body, token: 0, lang: "" });
    state.headData = data; state.headKey = key;
    message("head-message", "");
    if (state.view === "head") renderGlass(data.token);
  }
  function clearHead() {
    clear($("glass")); clear($("steps")); clear($("query-tokens")); clear($("head-story"));
    $("step-explain").textContent = ""; $("big-caption").textContent = "";
    const c = $("big"); c.width = 1; c.height = 1; c.qkvGeometry = null; c.qkvCell = null;
  }
  /** The open head's glass box for query ``token``: the big map, the step buttons, every step
   * up to the current one (later steps stay hidden until stepped to), the story. */
  function renderGlass(token) {
    const d = state.headData, tr = d.trace, s = tr.steps, toks = tr.tokens, n = toks.length;
    const names = STEP_NAMES(s);
    state.step = Math.min(state.step, names.length - 1);
    // the big map, from the trace's own float64 weights, the query row outlined
    drawMap($("big"), matrixPixels(s.weights, SEQ, (v) => v), toks, toks, token);
    $("big").qkvCell = (i, j) => cellWords(headName(d.layer, d.head), toks, toks, i, j, s.weights[i][j]);
    $("big-caption").textContent = say("big_caption", { name: headName(d.layer, d.head), t: toks[token], i: token });
    // query token picker
    const qbox = clear($("query-tokens"));
    toks.forEach((tok, i) => {
      const b = button(`tok${i === token ? " focus" : ""}`, tok, () => { state.token = i; ensureHead(); });
      b.dataset.index = String(i);
      qbox.appendChild(b);
    });
    // step buttons
    const stepsBox = clear($("steps"));
    names.forEach((name, i) => {
      const b = button("step-btn", say("step_button", { i: i + 1, name: t(`st_${name}`) }), () => { state.step = i; applyStep(true); });
      b.dataset.step = name;
      stepsBox.appendChild(b);
    });
    // the steps themselves
    const box = clear($("glass")), dk = tr.d_k, root = fmt(1 / d.scale), tokName = toks[token];
    const block = (name, title) => {
      const sec = el("section", "gstep");
      sec.dataset.step = name;
      sec.appendChild(el("h4", null, title));
      box.appendChild(sec);
      return sec;
    };
    const vecTable = (row, step, label) => {  // one row of numbers, columns by dimension
      const table = el("table", "matrix"), h = el("tr"), r = el("tr", "hi");
      h.appendChild(el("th"));
      r.appendChild(el("th", "row", label));
      row.forEach((x, j) => { h.appendChild(el("th", "col", String(j))); r.appendChild(numCell(x, step)); });
      table.append(el("thead"), el("tbody"));
      table.tHead.appendChild(h); table.tBodies[0].appendChild(r);
      const wrap = el("div", "scroll");
      wrap.appendChild(table);
      return wrap;
    };
    block("q", say("g_q", { t: tokName, d: dk })).appendChild(vecTable(s.q[token], "q", tokName));
    const kBlock = block("k", say("g_k", { n, d: dk }));
    kBlock.appendChild(matrix(s.k, toks, s.k[0].map((_, j) => String(j)), t("g_k_table"), "k", null, 0));
    // the query's row across the keys: one column per step, revealed as it is reached
    const keys = block("scores", say("g_row", { t: tokName }));
    keys.dataset.steps = names.filter((x) => ["scores", "scaled", "modified", "masked", "weights"].includes(x)).join(" ");
    const table = el("table", "matrix keys"), head = el("tr");
    const cols = names.filter((x) => ["scores", "scaled", "modified", "masked", "weights"].includes(x));
    head.appendChild(el("th", null, t("g_key")));
    for (const c of cols) { const th = el("th", "col", t(`g_col_${c}`)); th.dataset.col = c; head.appendChild(th); }
    const bar = el("th", "col", ""); bar.dataset.col = "weights"; head.appendChild(bar);
    table.appendChild(el("thead")).appendChild(head);
    const tbody = table.appendChild(el("tbody"));
    for (let j = 0; j < n; j++) {
      const row = el("tr", j === token ? "self" : null);
      row.appendChild(el("th", "row", toks[j]));
      for (const c of cols) {
        const td = numCell(s[c][token][j], c);
        td.dataset.col = c; td.dataset.key = String(j);
        if (c === "weights") shade(td, s.weights[token][j]);
        row.appendChild(td);
      }
      const bt = el("td", "barcell"), b = el("span", "bar");
      b.style.width = `${Math.round(100 * s.weights[token][j])}%`;
      bt.dataset.col = "weights";
      bt.appendChild(b);
      row.appendChild(bt);
      tbody.appendChild(row);
    }
    const wrap = el("div", "scroll tall");
    wrap.appendChild(table);
    keys.appendChild(wrap);
    const out = block("output", say("g_output", { t: tokName, d: tr.d_v }));
    out.appendChild(vecTable(s.output[token], "output", tokName));
    const det = el("details"), sum = el("summary", null, t("g_v_rows"));
    det.append(sum, matrix(s.v, toks, s.v[0].map((_, j) => String(j)), t("g_v_table"), "v", null, 0));
    out.appendChild(det);
    box.dataset.token = String(token);
    box.dataset.layer = String(d.layer);
    box.dataset.head = String(d.head);
    state.glassNames = names;
    state.glassValues = { t: tokName, d: dk, r: root, fn: tr.score_mod ? tr.score_mod.kind || "" : "" };
    applyStep();
    story($("head-story"), d.token === token ? d.story : "");
  }
  /** Show steps up to the current one, outline it, and say what it does (``scroll``: bring it into view). */
  function applyStep(scroll = false) {
    const names = state.glassNames || [];
    if (!names.length) return;
    const cur = names[state.step], upto = new Set(names.slice(0, state.step + 1));
    for (const sec of $("glass").querySelectorAll(".gstep")) {
      const own = sec.dataset.steps ? sec.dataset.steps.split(" ") : [sec.dataset.step];
      sec.hidden = !own.some((x) => upto.has(x));
      sec.classList.toggle("current", own.includes(cur));
    }
    for (const c of $("glass").querySelectorAll("[data-col]")) {
      c.hidden = !upto.has(c.dataset.col);
      c.classList.toggle("current", c.dataset.col === cur);
    }
    $("steps").querySelectorAll(".step-btn").forEach((b, i) => {
      b.classList.toggle("on", i === state.step); b.classList.toggle("done", i < state.step);
    });
    $("step-explain").textContent = say(`gx_${cur}`, state.glassValues);
    $("step-prev").disabled = state.step === 0;
    $("step-next").disabled = state.step === names.length - 1;
    $("glass").dataset.step = cur;
    const current = $("glass").querySelector(".gstep.current");
    if (scroll && current && current.scrollIntoView) current.scrollIntoView({ block: "nearest" });
  }

  // ---- 4. knock heads out, or patch them from the second text --------------------------------
  const offKey = (l, h) => state.off.some(([a, b]) => a === l && b === h);
  function toggleHead(l, h) {
    if (isToy()) return;
    state.history.push(state.off.map((x) => x.slice()));
    state.off = offKey(l, h) ? state.off.filter(([a, b]) => !(a === l && b === h)) : [...state.off, [l, h]];
    ensureIntervene();
  }
  async function ensureIntervene() {
    const a = state.analysis;
    $("undo").disabled = !state.history.length;
    $("clear").disabled = !state.off.length;
    $("temp-box").hidden = !(a && a.model.kind === "decoder");
    if (!a) {
      message("iv-message", waiting());
      clear($("iv-output")); clear($("iv-lines"));
      return;
    }
    if (isToy()) { message("iv-message", t("needs_pretrained")); renderIntervene(); return; }
    if (!state.off.length) {
      state.iv = null; state.ivMaps = null; state.ivKey = "";
      drop("intervene");
      message("iv-message", t("iv_pick"));
      renderIntervene();
      return;
    }
    markOff();
    if (state.mode === "patch" && !state.second.trim()) { message("iv-message", t("iv_need_second"), "error"); return; }
    const body = { model: state.asked.model, text: state.asked.text, heads: state.off, mode: state.mode,
                   source: state.mode === "patch" ? state.second : null, focus: outputFocus(), temperature: state.temperature,
                   lang: state.lang };
    const key = JSON.stringify(body);
    if (state.ivKey === key && state.iv) { message("iv-message", ""); renderIntervene(); return; }
    message("iv-message", t("working"), "busy");
    let data;
    try {
      data = await ask("intervene", "/api/intervene", body);
    } catch (e) {
      showError("iv-message", e);
      return;
    }
    if (!data) return;
    state.iv = data; state.ivMaps = new Maps(data.maps); state.ivKey = key;
    message("iv-message", "");
    if (state.view === "intervene") renderIntervene();
  }
  /** The knocked-out set on the page now (chips, cards), before the server has answered. */
  function markOff() {
    renderOffChips();
    for (const card of $("iv-grid").querySelectorAll(".card")) {
      card.classList.toggle("off", offKey(+card.dataset.layer, +card.dataset.head));
    }
  }
  function renderOffChips() {
    const box = clear($("iv-off"));
    box.appendChild(el("span", "chips-label", state.off.length ? t("iv_off") : ""));
    for (const [l, h] of state.off) {
      const chip = button("chip off", `${headName(l, h)} ×`, () => toggleHead(l, h));
      chip.title = t("iv_restore");
      box.appendChild(chip);
    }
  }
  function renderIntervene() {
    const a = state.analysis, iv = state.iv;
    renderOffChips();
    $("undo").disabled = !state.history.length;
    $("clear").disabled = !state.off.length;
    const out = clear($("iv-output")), lines = clear($("iv-lines"));
    if (!a) return;
    const grid = $("iv-grid");
    const all = cards(grid, a.layers, a.heads, (l, h) => toggleHead(l, h));
    for (const card of all) {
      const l = +card.dataset.layer, h = +card.dataset.head, off = offKey(l, h);
      const change = iv ? iv.change[l][h] : 0;
      card.querySelector(".card-name").textContent = headName(l, h);
      card.querySelector(".card-kind").textContent = off ? t("iv_knocked") : "";
      card.querySelector(".card-stats").textContent = say("change_short", { c: fmt(change) });
      card.querySelector(".card-badge").textContent = "";
      card.dataset.change = String(change);
      card.classList.toggle("off", off);
      card.classList.toggle("changed", change > 0.01);
      card.title = say(off ? "iv_card_on" : "iv_card_off", { name: headName(l, h), c: fmt(change) });
    }
    setCardMaps(grid, state.ivMaps || state.maps, iv ? iv.tokens : a.tokens);
    if (isToy()) return;
    // the output's change: the sentence embedding's similarity (an encoder) or the next token (a decoder)
    if (a.model.kind !== "decoder") {
      const sim = iv && iv.output.encoder ? iv.output.encoder.similarity : 1;  // nothing knocked out: unchanged
      const box = el("div", "big-number");
      box.appendChild(el("span", null, t("similarity")));
      const v = el("strong", null, fmt(sim, 6));
      v.id = "similarity";
      v.dataset.value = String(sim);
      box.append(v, el("span", "hint", t("similarity_hint")));
      out.appendChild(box);
    }
    if (iv && iv.output && iv.output.decoder) {
      const dec = iv.output.decoder;
      out.appendChild(el("p", "kl", say("kl_line", { kl: small(dec.kl), temp: fmt(dec.temperature, 1) })));
      const pair = el("div", "next-tokens");
      for (const [title, rows] of [[t("next_clean"), dec.clean], [t("next_changed"), dec.changed]]) {
        const fig = el("figure", "probs");
        fig.appendChild(el("figcaption", null, title));
        const table = el("table", "matrix");
        for (const r of rows) {
          const tr = el("tr");
          tr.appendChild(el("th", "row", r.token));
          tr.appendChild(numCell(r.p, "p"));
          const bt = el("td", "barcell"), b = el("span", "bar");
          b.style.width = `${Math.round(100 * r.p)}%`;
          bt.appendChild(b);
          tr.appendChild(bt);
          table.appendChild(tr);
        }
        fig.appendChild(table);
        pair.appendChild(fig);
      }
      out.appendChild(pair);
    }
    for (const line of iv ? iv.lines : []) lines.appendChild(el("li", /^\s/.test(line) ? "indent" : null, line));
  }

  // ---- 5. two texts side by side -------------------------------------------------------------
  async function ensureCompare() {
    const a = state.analysis;
    if (!a) { message("cmp-message", waiting()); clear($("cmp-rank")); return; }
    if (isToy()) { message("cmp-message", t("needs_pretrained")); return; }
    if (!state.second.trim()) { message("cmp-message", t("cmp_need_second")); return; }
    fillHeadSelects();
    const body = { model: state.asked.model, text: state.asked.text, other: state.second, focus: ownFocus(), lang: state.lang };
    const key = JSON.stringify(body);
    if (state.cmpKey === key && state.cmp) { message("cmp-message", ""); renderCompare(); return; }
    message("cmp-message", t("working"), "busy");
    let data;
    try {
      data = await ask("compare", "/api/compare", body);
    } catch (e) {
      showError("cmp-message", e);
      return;
    }
    if (!data) return;
    state.cmp = data; state.cmpKey = key; state.cmpAsked = body;
    state.cmpMaps = { a: new Maps(data.a.maps), b: new Maps(data.b.maps) };
    if (!state.cmpChosen && data.top_changes.length) {  // until one is chosen: the head that moved most
      state.cmpLayer = data.top_changes[0].layer; state.cmpHead = data.top_changes[0].head;
    }
    message("cmp-message", "");
    if (state.view === "compare") renderCompare();
  }
  function renderCompare() {
    const c = state.cmp, m = state.cmpMaps, l = state.cmpLayer, h = state.cmpHead;
    if (!c) return;
    fillHeadSelects();
    // heads ranked by the server's distance (how far the focus token's attention moved)
    const ranked = [];
    c.distance.forEach((row, li) => row.forEach((dist, hi) => ranked.push([dist, li, hi])));
    ranked.sort((x, y) => y[0] - x[0] || x[1] - y[1] || x[2] - y[2]);
    const box = clear($("cmp-rank"));
    box.appendChild(el("span", "chips-label", t("cmp_ranked")));
    for (const [dist, li, hi] of ranked.slice(0, 10)) {
      const chip = button(`chip${li === l && hi === h ? " on" : ""}`, `${headName(li, hi)}  ${fmt(dist)}`,
        () => { state.cmpLayer = li; state.cmpHead = hi; state.cmpChosen = true; renderCompare(); });
      chip.dataset.layer = String(li); chip.dataset.head = String(hi);
      box.appendChild(chip);
    }
    const ta = c.a.tokens, tb = c.b.tokens;
    drawMap($("cmp-a"), headPixels(m.a, l, h), ta, ta, c.a.focus, 360);
    drawMap($("cmp-b"), headPixels(m.b, l, h), tb, tb, c.b.focus, 360);
    $("cmp-a").qkvCell = (i, j) => cellWords(headName(l, h), ta, ta, i, j, m.a.at(l, h, i, j));
    $("cmp-b").qkvCell = (i, j) => cellWords(headName(l, h), tb, tb, i, j, m.b.at(l, h, i, j));
    $("cmp-a-caption").textContent = say("cmp_a", { name: headName(l, h), text: state.cmpAsked.text });
    $("cmp-b-caption").textContent = say("cmp_b", { name: headName(l, h), text: state.cmpAsked.other });
    // B − A on the aligned tokens: plain subtraction of the two drawn maps
    const pairs = c.alignment, diff = pairs.map(([qa, qb]) => pairs.map(([ka, kb]) => m.b.at(l, h, qb, kb) - m.a.at(l, h, qa, ka)));
    let most = 0;
    for (const row of diff) for (const v of row) most = Math.max(most, Math.abs(v));
    const scale = most > 0 ? most : 1, labels = pairs.map(([ia, ib]) => (ta[ia] === tb[ib] ? ta[ia] : `${ta[ia]}/${tb[ib]}`));
    drawMap($("cmp-d"), matrixPixels(diff, DIV, (v) => 0.5 + v / (2 * scale)), labels, labels, null, 360);
    $("cmp-d").qkvCell = (i, j) => say("hover_diff", { name: headName(l, h), q: labels[i], k: labels[j],
                                                       w: `${diff[i][j] > 0 ? "+" : ""}${fmt(diff[i][j])}` });
    $("cmp-d-caption").textContent = say("cmp_diff", { name: headName(l, h), m: fmt(most), dist: fmt(c.distance[l][h]) });
    $("cmp-d").dataset.max = String(most);
    $("cmp-report").textContent = c.report;
  }

  // ---- events --------------------------------------------------------------------------------
  function wire() {
    for (const v of VIEWS) $(`tab-${v}`).addEventListener("click", () => { if (v !== "tutorial") state.switched = true; show(v); });
    for (const b of document.querySelectorAll(".langs button")) b.addEventListener("click", () => setLang(b.dataset.lang));
    $("model").addEventListener("change", (e) => switchModel(e.target.value));
    const typed = debounce(() => {
      state.text = $("text").value;
      state.focus = null; state.target = null; state.token = null;
      runAnalyze();
    }, DEBOUNCE_MS);
    $("text").addEventListener("input", () => { counter("count", $("text").value); typed(); });
    const typedSecond = debounce(() => {
      state.second = $("second").value;
      if (!state.pair) { saveUrl(); refreshView(); return; }
      // a sentence pair's second text moved: indices into it are stale, those into the first text hold
      const own = current() ? ownCount() : 0;
      if (state.focus !== null && state.focus >= own) { state.focus = null; state.target = null; }
      if (state.target !== null && state.target >= own) state.target = null;
      if (state.token !== null && state.token >= own) state.token = null;
      runAnalyze();
    }, DEBOUNCE_MS);
    $("second").addEventListener("input", () => { counter("count-second", $("second").value); typedSecond(); });
    $("pair").addEventListener("change", (e) => {
      state.pair = e.target.checked; state.focus = null; state.target = null; state.token = null;
      runAnalyze();
    });
    for (const [id, what] of [["pick-focus", "focus"], ["pick-target", "target"]]) {
      $(id).addEventListener("click", () => {
        state.pick = what;
        $("pick-focus").classList.toggle("on", what === "focus");
        $("pick-target").classList.toggle("on", what === "target");
      });
    }
    // the overview
    $("sort").addEventListener("change", (e) => { state.sort = e.target.value; renderHeads(); });
    $("filter").addEventListener("change", (e) => { state.filter = e.target.value; renderHeads(); });
    // one head
    $("head-layer").addEventListener("change", (e) => { state.layer = +e.target.value; ensureHead(); });
    $("head-head").addEventListener("change", (e) => { state.head = +e.target.value; ensureHead(); });
    $("step-prev").addEventListener("click", () => { state.step = Math.max(0, state.step - 1); applyStep(true); });
    $("step-next").addEventListener("click", () => {
      state.step = Math.min((state.glassNames || [1]).length - 1, state.step + 1);
      applyStep(true);
    });
    for (const id of ["big", "cmp-a", "cmp-b", "cmp-d"]) hoverable($(id));
    $("big").addEventListener("click", (ev) => { const i = rowAt($("big"), ev); if (i !== null) { state.token = i; ensureHead(); } });
    // the tutorial
    $("tut-prev").addEventListener("click", () => tutMove(-1));
    $("tut-next").addEventListener("click", () => tutMove(1));
    // interventions
    $("iv-mode").addEventListener("change", (e) => { state.mode = e.target.value; ensureIntervene(); });
    const tempSoon = debounce(() => ensureIntervene(), DEBOUNCE_MS);
    $("temp").addEventListener("input", (e) => {
      state.temperature = +e.target.value;
      $("temp-value").textContent = fmt(state.temperature, 1);
      tempSoon();
    });
    $("undo").addEventListener("click", () => { if (state.history.length) { state.off = state.history.pop(); ensureIntervene(); } });
    $("clear").addEventListener("click", () => {
      if (!state.off.length) return;
      state.history.push(state.off.map((x) => x.slice()));
      state.off = [];
      ensureIntervene();
    });
    // comparison
    $("cmp-layer").addEventListener("change", (e) => { state.cmpLayer = +e.target.value; state.cmpChosen = true; renderCompare(); });
    $("cmp-head").addEventListener("change", (e) => { state.cmpHead = +e.target.value; state.cmpChosen = true; renderCompare(); });
    // keyboard: arrows step through the tutorial or the glass box when no field has the focus
    document.addEventListener("keydown", (ev) => {
      if (ev.target instanceof HTMLInputElement || ev.target instanceof HTMLSelectElement) return;
      const d = ev.key === "ArrowRight" ? 1 : ev.key === "ArrowLeft" ? -1 : 0;
      if (!d) return;
      if (state.view === "tutorial") tutMove(d);
      else if (state.view === "head" && state.glassNames) {
        state.step = Math.max(0, Math.min(state.glassNames.length - 1, state.step + d));
        applyStep(true);
      }
    });
  }
  /** Switch the page's language: every label now, the server's words (stories, notes, reports) asked again. */
  function setLang(lang) {
    if (!(lang in WORDS) || lang === state.lang) return;
    state.lang = lang;
    document.body.dataset.lang = lang;
    applyWords();
    fillHeadControls();
    fillModels();
    modelError(null);
    counter("count", $("text").value);
    counter("count-second", $("second").value);
    if (analyzeBody()) runAnalyze();  // its notes are worded by the server; the current view follows
    else { saveUrl(); renderTokens(); refreshView(); }
  }

  // ---- the address: the texts and the view, so a reload or a shared link restores them --------
  // They live in the fragment (#text=…&view=…), which never reaches the server or its logs.
  let written = "";
  function saveUrl() {
    const p = new URLSearchParams();
    if (state.text) p.set("text", state.text);
    if (state.second) p.set("second", state.second);
    if (state.pair) p.set("pair", "1");
    if (state.model) p.set("model", state.model);
    if (state.focus !== null) p.set("focus", String(state.focus));
    if (state.target !== null) p.set("target", String(state.target));
    p.set("view", state.view);
    if (state.view === "head") { p.set("layer", String(state.layer)); p.set("head", String(state.head)); }
    p.set("lang", state.lang);
    const fresh = !state.text && !state.second && state.view === "tutorial";  // nothing to restore: a bare address
    const hash = fresh ? "" : `#${p.toString()}`;
    if (hash === location.hash) return;
    written = hash;
    history.replaceState(null, "", hash || location.pathname + location.search);
  }
  /** The state the address names (before anything is drawn or asked). */
  function restoreUrl() {
    const p = new URLSearchParams(location.hash.slice(1));
    const index = (k) => (/^\d{1,6}$/.test(p.get(k) || "") ? +p.get(k) : null);
    const text = (k) => (p.get(k) || "").slice(0, LIMITS.max_chars);
    state.text = text("text"); state.second = text("second"); state.pair = p.get("pair") === "1";
    $("text").value = state.text; $("second").value = state.second; $("pair").checked = state.pair;
    if (p.get("model")) state.model = p.get("model");  // kept only if the server offers it (loadModels)
    if (state.text.trim()) { state.focus = index("focus"); state.target = index("target"); }
    if (p.get("lang") in WORDS) { state.lang = p.get("lang"); document.body.dataset.lang = state.lang; }
    if (VIEWS.includes(p.get("view"))) {
      state.view = p.get("view");
      state.switched = state.view !== "tutorial";  // the analysis does not move a restored view
    }
    if (index("layer") !== null && index("head") !== null) { state.layer = index("layer"); state.head = index("head"); }
    written = location.hash;
  }

  // ---- start ---------------------------------------------------------------------------------
  restoreUrl();
  applyWords();
  fillHeadControls();
  drawLegends();
  counter("count", state.text);
  counter("count-second", state.second);
  renderTokens();
  wire();
  show(state.view);
  loadModels().then(() => { if (analyzeBody()) runAnalyze(); });
  // an address edited by hand, or a shared link opened in this tab: start again from it
  window.addEventListener("hashchange", () => { if (location.hash !== written) location.reload(); });
})();
