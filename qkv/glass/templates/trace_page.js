/* qkv trace page: renders the JSON in #qkv-trace-data. Every number was computed in float64 by
   qkv (qkv.glass.page); this script only formats, colours and explains them. */
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("qkv-trace-data").textContent);
  var P = D.precision;
  var S = { step: 0, head: 0, token: D.token, causal: D.causal, lang: D.lang, pinned: null };

  // ---- words -------------------------------------------------------------------------------
  // The words come from qkv's message catalogue (qkv/locale/<lang>.json, keys "page.*"), one
  // table per language, embedded by qkv.glass.page beside the data.
  var WORDS = JSON.parse(document.getElementById("qkv-trace-words").textContent);

  function t(key, params) {
    var s = WORDS[S.lang][key];
    if (s === undefined) s = WORDS.en[key];
    if (s === undefined) throw new Error("qkv trace page: no text for " + key);
    return s.replace(/\{(\w+)\}/g, function (m, name) {
      return params && params[name] !== undefined ? String(params[name]) : m;
    });
  }
  function esc(s) {
    return String(s).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }
  function fmt(v) {
    if (v === null || v === undefined) return "−∞";
    var s = v.toFixed(P);
    if (/^-0\.?0*$/.test(s)) s = s.slice(1); // never show "-0.000"
    return s;
  }
  function short(v) { return fmt(v).replace(/(\.\d*?)0+$/, "$1").replace(/\.$/, ""); } // 30.000 → 30, 0.500 → 0.5
  function fmtR(v) { return v !== null && v < 0 ? "(" + fmt(v) + ")" : fmt(v); } // right operand: 1 − (−2), not 1 − −2
  function tok(i) { return esc(D.tokens[i]); }

  // ---- the matrices of the current head and mask variant -----------------------------------
  function variant() { return D.variants[S.causal ? "causal" : "full"]; }
  function view(name) {
    var inp = D.inputs[name];
    if (inp && inp.shape) return inp;
    if (name === "q" || name === "k" || name === "v") return D.heads[S.head][name];
    var hv = variant().heads[S.head];
    if (Object.prototype.hasOwnProperty.call(hv, name)) return hv[name];
    return variant()[name] || null;
  }
  function at(m, i, c) { // value of a view at matrix position (i, c), or undefined when not shown
    var ri = m.rows.indexOf(i), ci = m.cols.indexOf(c);
    return ri < 0 || ci < 0 ? undefined : m.v[ri][ci];
  }
  function row(m, i) { return m.v[m.rows.indexOf(i)]; }
  function beforeMask() { return view("modified") || view("scaled"); } // what the mask is added to
  function sinkOf(h) { return D.sinks ? D.sinks[h] : null; } // null: no sink (or a sink of −∞)

  var STEP_MATS = {
    // each step shows what it produces, after the operands it reads where that helps
    positional: ["embeddings", "positional", "x"], x: ["x"], qkv: ["q", "k", "v"], scores: ["q", "k", "scores"],
    scaled: ["scores", "scaled"], modified: ["scaled", "modified"], mask: ["masked"], weights: ["masked", "weights"], output: ["weights", "v", "output"], concat: ["concat"],
    projected: ["projected"], residual1: ["residual1"], norm1: ["norm1"], ffn: ["ffn_hidden", "ffn_relu", "ffn_out"],
    residual2: ["residual2"], norm2: ["block_output"],
  };

  // ---- colour scales -------------------------------------------------------------------------
  function mix(rgb, f) {
    return "rgb(" + rgb.map(function (c) { return Math.round(255 + (c - 255) * f); }).join(",") + ")";
  }
  function colour(m, v, scaleMax) {
    if (v === null) return null;
    if (m.scale === "weights") return { bg: mix([38, 70, 168], 0.9 * Math.min(1, Math.max(0, v))), dark: v > 0.55 };
    var f = scaleMax > 0 ? Math.min(1, Math.abs(v) / scaleMax) : 0;
    return { bg: mix(v < 0 ? [44, 104, 182] : [196, 58, 48], 0.85 * f), dark: f > 0.62 };
  }
  function maxAbs(m) {
    var mx = 0;
    m.v.forEach(function (r) { r.forEach(function (v) { if (v !== null && Math.abs(v) > mx) mx = Math.abs(v); }); });
    return mx;
  }

  // ---- rendering -----------------------------------------------------------------------------
  function ranges(idx) {
    var parts = [], start = null, prev = null;
    idx.concat([undefined]).forEach(function (i) {
      if (i !== null && i !== undefined && prev !== null && i === prev + 1) { prev = i; return; }
      if (start !== null) parts.push(start === prev ? String(start) : start + "–" + prev);
      start = (i === null || i === undefined) ? null : i; prev = start;
    });
    return parts.join(", ");
  }
  function caption(name) {
    var key = "m_" + name;
    if (name === "masked" && !view("masked")) key = view("modified") ? "m_modified_nomask" : "m_unmasked";
    var s = t(key);
    var perHead = ["q", "k", "v", "scores", "scaled", "modified", "masked", "weights", "output"].indexOf(name) >= 0;
    if (perHead && D.num_heads > 1) s += t("of_head", { h: S.head });
    return s;
  }
  function matrixHTML(name) {
    var m = view(name);
    var shownName = name;
    if (name === "masked" && !m) { m = beforeMask(); shownName = "masked"; }
    if (!m) return "";
    var mx = maxAbs(m), maskedRef = null;
    if (name === "weights") maskedRef = view("masked");
    var h = ['<figure class="matrix" data-matrix="' + shownName + '"><figcaption>' + esc(caption(name)) +
      '<span class="shape">' + esc(t("shape", { r: m.shape[0], c: m.shape[1] })) + "</span></figcaption>"];
    h.push('<table class="m"><thead><tr><th></th>');
    m.cols.forEach(function (c) {
      if (c === null) h.push('<th class="gap">' + t("gap") + "</th>");
      else h.push("<th>" + (m.kind === "tokens" ? tok(c) : c) + "</th>");
    });
    if (m.norm) h.push("<th>" + esc(t("norm")) + "</th>");
    h.push("</tr></thead><tbody>");
    m.rows.forEach(function (i, ri) {
      if (i === null) {
        h.push('<tr class="gaprow"><th class="gap">⋮</th>' + m.cols.map(function () { return '<td class="gap"></td>'; }).join("") +
          (m.norm ? '<td class="gap"></td>' : "") + "</tr>");
        return;
      }
      h.push("<tr" + (i === S.token ? ' class="sel"' : "") + '><th scope="row">' + i + " " + tok(i) + "</th>");
      m.cols.forEach(function (c, ci) {
        if (c === null) { h.push('<td class="gap">…</td>'); return; }
        var v = m.v[ri][ci];
        var hidden = v === null || (maskedRef && at(maskedRef, i, c) === null);
        var col = colour(m, v, mx), style = "";
        if (col && !hidden) style = ' style="background:' + col.bg + (col.dark ? ";color:#fff" : "") + '"';
        h.push('<td data-m="' + shownName + '" data-r="' + ri + '" data-c="' + ci + '"' + (hidden ? ' class="masked"' : "") +
          style + ">" + fmt(v) + "</td>");
      });
      if (m.norm) h.push('<td class="norm" data-m="' + shownName + '" data-r="' + ri + '" data-c="norm">' + fmt(m.norm[ri]) + "</td>");
      h.push("</tr>");
    });
    h.push("</tbody></table>");
    var notes = [];
    if (m.cols.indexOf(null) >= 0) notes.push(t("summary", { shown: ranges(m.cols), c: m.shape[1] }));
    if (m.rows.indexOf(null) >= 0) notes.push(t("summary_rows", { shown: ranges(m.rows), r: m.shape[0] }));
    if (notes.length) h.push('<div class="summary">' + esc(notes.join(" ")) + "</div>");
    if (m.scale === "weights") h.push('<div class="legend">0<span class="bar" style="background:linear-gradient(90deg,#fff,' + mix([38, 70, 168], 0.9) + ')"></span>1</div>');
    else h.push('<div class="legend">−' + fmt(mx) + '<span class="bar" style="background:linear-gradient(90deg,' + mix([44, 104, 182], 0.85) + ',#fff,' + mix([196, 58, 48], 0.85) + ')"></span>+' + fmt(mx) + "</div>");
    h.push("</figure>");
    return h.join("");
  }

  // ---- the flow diagram (inline SVG) --------------------------------------------------------
  var FLOW_W = 226, BOX_H = 26, GAP_Y = 16;
  function renderFlow() {
    var svg = document.getElementById("flow");
    var parts = ['<defs><marker id="arrow" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" orient="auto">' +
      '<path d="M0,0 L8,4 L0,8 z" fill="#8c96a8"></path></marker></defs>'];
    var y = 6, pos = {}, cx = 100;
    D.steps.forEach(function (id) {
      pos[id] = y;
      y += BOX_H + GAP_Y;
    });
    var height = y - GAP_Y + 6;
    // edges first, so the boxes cover their ends
    D.steps.forEach(function (id, k) {
      if (k === 0) return;
      var prev = D.steps[k - 1], y0 = pos[prev] + BOX_H, y1 = pos[id];
      var fromXs = prev === "qkv" ? [cx - 62, cx] : [cx];
      var toXs = id === "qkv" ? [cx - 62, cx, cx + 62] : [cx];
      fromXs.forEach(function (x0) {
        toXs.forEach(function (x1) {
          if (fromXs.length > 1 && toXs.length > 1) return;
          parts.push('<path class="edge" d="M' + x0 + "," + y0 + " L" + x1 + "," + (y1 - 1) + '"></path>');
        });
      });
    });
    if (pos.qkv !== undefined && pos.output !== undefined) { // V skips the scores and joins at A·V
      var vx = cx + 62, vy = pos.qkv + BOX_H, oy = pos.output + BOX_H / 2;
      parts.push('<path class="edge v" d="M' + vx + "," + vy + " L" + vx + "," + oy + " L" + (cx + 56) + "," + oy + '"></path>');
    }
    D.steps.forEach(function (id, k) {
      var cls = "node" + (k === S.step ? " current" : k < S.step ? " done" : "");
      var label = esc(t("s_" + id));
      parts.push('<g class="' + cls + '" data-step="' + id + '" data-index="' + k + '"><title>' + label + "</title>");
      if (id === "qkv") {
        ["Q", "K", "V"].forEach(function (name, j) {
          var x = cx - 62 + 62 * j;
          parts.push('<rect x="' + (x - 24) + '" y="' + pos[id] + '" width="48" height="' + BOX_H + '"></rect>' +
            '<text x="' + x + '" y="' + (pos[id] + BOX_H / 2) + '">' + name + "</text>");
        });
      } else {
        parts.push('<rect x="' + (cx - 56) + '" y="' + pos[id] + '" width="112" height="' + BOX_H + '"></rect>' +
          '<text x="' + cx + '" y="' + (pos[id] + BOX_H / 2) + '">' + esc(t("f_" + id)) + "</text>");
      }
      parts.push("</g>");
    });
    svg.setAttribute("viewBox", "0 0 " + FLOW_W + " " + height);
    svg.setAttribute("aria-label", t("steps") + ": " + D.steps.map(function (id) { return t("s_" + id); }).join(" → "));
    svg.innerHTML = parts.join("");
  }

  // ---- narrative -----------------------------------------------------------------------------
  function argsort(vals) { // indices of the finite values, largest first
    return vals.map(function (v, j) { return [v, j]; }).filter(function (p) { return p[0] !== null; })
      .sort(function (a, b) { return b[0] - a[0] || a[1] - b[1]; }).map(function (p) { return p[1]; });
  }
  function vecText(vals) {
    var shown = vals.slice(0, 6).map(fmt);
    if (vals.length > 6) shown.push("… (" + vals.length + ")");
    return "[" + shown.join(", ") + "]";
  }
  function narrative(id) {
    var i = S.token, h = S.head, n = D.n, base = { i: i, tok: tok(i), n: n, d: D.d_model, dk: D.d_k, dv: D.d_v, f: D.d_ff };
    var p = Object.assign;
    if (id === "x") {
      var s = t("n_x", base);
      return s + (D.meta.model ? t("n_x_model", { model: esc(D.meta.model), layer: D.meta.layer }) : t("n_x_toy"));
    }
    if (id === "positional") return t("n_positional", base);
    if (id === "qkv") {
      var head = !D.has_x ? t("n_qkv_given") : D.num_heads > 1 ? t("n_qkv_head", { h: h, dk: D.d_k }) : "";
      return t("n_qkv", p({}, base, { headpart: head, q: vecText(D.heads[h].raw.q[i]) }));
    }
    if (id === "scores") {
      var sc = row(view("scores"), i), order = argsort(sc);
      var best = order[0], worst = order[order.length - 1];
      return t("n_scores", p({}, base, { best: tok(best), bs: fmt(sc[best]), worst: tok(worst), ws: fmt(sc[worst]) }));
    }
    if (id === "scaled") {
      var r = row(view("scaled"), i).filter(function (v) { return v !== null; });
      return t("n_scaled", p({}, base, { root: fmt(Math.sqrt(D.d_k)), lo: fmt(Math.min.apply(null, r)), hi: fmt(Math.max.apply(null, r)) }));
    }
    if (id === "modified") return modifiedNarrative(base);
    if (id === "mask") {
      var txt;
      if (S.causal) txt = t("n_mask_on", base) + (i === n - 1 ? t("n_mask_last") : t("n_mask_later", { m: n - 1 - i }));
      else txt = t("n_mask_off");
      if (D.other_masks.length) txt += t("n_mask_other", { kinds: D.other_masks.join(", ") });
      return txt;
    }
    var w = row(view("weights"), i), wo = argsort(w);
    var total = w.reduce(function (a, b) { return a + b; }, 0);
    if (id === "weights") {
      if (total === 0) return t("n_weights_none", base);
      var second = wo.length > 1 ? t("n_weights_second", { k2: tok(wo[1]), w2: fmt(w[wo[1]]) }) : "";
      var nw = t("n_weights", p({}, base, { k1: tok(wo[0]), w1: fmt(w[wo[0]]), pct: (100 * w[wo[0]]).toFixed(1), second: second, sum: fmt(total) }));
      if (sinkOf(h) !== null) nw += t("n_weights_sink", { s: fmt(sinkOf(h)), pct: (100 * (1 - total)).toFixed(1), i: i, sum: fmt(total) });
      return nw;
    }
    if (id === "output") {
      if (total === 0) return t("n_weights_none", base);
      return t("n_output", p({}, base, { k1: tok(wo[0]), w1: fmt(w[wo[0]]) }));
    }
    if (id === "concat") {
      return t("n_concat", p({}, base, { h: D.num_heads, w: D.num_heads * D.d_v, hh: h, a: h * D.d_v, b: (h + 1) * D.d_v - 1 }));
    }
    if (id === "projected") return t("n_projected", { w: view("projected").shape[1] });
    if (id === "residual1" || id === "residual2") {
      var left = id === "residual1" ? D.inputs.x : variant().norm1, right = id === "residual1" ? variant().attn : variant().ffn_out;
      return t("n_" + id, p({}, base, { x: fmt(at(left, i, 0)), a: fmtR(at(right, i, 0)), r: fmt(at(view(id), i, 0)) }));
    }
    if (id === "norm1" || id === "norm2") {
      var k = id === "norm1" ? "1" : "2";
      return t("n_" + id, p({}, base, { mu: fmt(variant()["mean" + k][i]), sd: fmt(variant()["std" + k][i]) }));
    }
    if (id === "ffn") {
      var hid = variant().ffn_hidden, off = 0;
      // count over every column when all are shown; a summarised row counts the shown ones
      row(hid, i).forEach(function (v) { if (v !== null && v <= 0) off += 1; });
      return t("n_ffn", p({}, base, { off: off }));
    }
    return "";
  }
  function finite(vals) { return vals.filter(function (v) { return v !== null; }); }
  function modifiedNarrative(base) {
    var sm = D.score_mod, i = S.token, p = Object.assign;
    var before = row(view("scaled"), i), after = row(view("modified"), i);
    if (sm.kind === "softcap") {
      var b = finite(before), a = finite(after);
      return t("n_mod_softcap", p({}, base, { c: short(sm.cap), lo: fmt(Math.min.apply(null, b)), hi: fmt(Math.max.apply(null, b)),
        lo2: fmt(Math.min.apply(null, a)), hi2: fmt(Math.max.apply(null, a)) }));
    }
    if (sm.kind === "alibi") {
      return t(sm.symmetric ? "n_mod_alibi_sym" : "n_mod_alibi", p({}, base, { h: S.head, m: fmtSlope(sm.slopes[S.head]) }));
    }
    var added = [];
    after.forEach(function (v, j) { if (v !== null && before[j] !== null) added.push(v - before[j]); });
    if (sm.kind === "relative_bias") {
      return t("n_mod_rel", p({}, base, { text: esc(sm.text), lo: fmt(Math.min.apply(null, added)), hi: fmt(Math.max.apply(null, added)) }));
    }
    var big = added.reduce(function (m, d) { return Math.abs(d) > Math.abs(m) ? d : m; }, 0);
    return t("n_mod_fn", p({}, base, { name: esc(sm.kind === "function" ? sm.name : sm.text), d: fmtR(big) }));
  }
  function fmtSlope(m) { return String(Number(m.toPrecision(3))); } // ALiBi slopes reach 1/256: keep 3 digits, not 3 decimals
  function formula(id) {
    if (id === "modified") {
      var sm = D.score_mod;
      if (sm.kind === "softcap") return t("e_modified_softcap", { c: short(sm.cap) });
      if (sm.kind === "alibi") return t(sm.symmetric ? "e_modified_alibi_sym" : "e_modified_alibi", { h: S.head, m: fmtSlope(sm.slopes[S.head]) });
      if (sm.kind === "relative_bias") return t("e_modified_rel", { text: sm.text });
      if (sm.kind === "function") return t("e_modified_fn", { name: sm.name });
      return t("e_modified_other", { text: sm.text });
    }
    if (id === "mask" && view("modified")) return t("e_mask_mod");
    if (id === "weights" && sinkOf(S.head) !== null) return t("e_weights_sink");
    if (id === "qkv") {
      return t("e_qkv", { bq: D.bias.q ? " + b_Q" : "", bk: D.bias.k ? " + b_K" : "", bv: D.bias.v ? " + b_V" : "" });
    }
    if (id === "scaled") return t("e_scaled", { root: fmt(Math.sqrt(D.d_k)) });
    if (id === "concat") return t("e_concat", { last: D.num_heads - 1, n: D.n, w: D.num_heads * D.d_v });
    return t("e_" + id);
  }

  // ---- cell explanations ---------------------------------------------------------------------
  function termList(items, cls) {
    return '<ol class="terms' + (cls ? " " + cls : "") + '">' + items.join("") + "</ol>";
  }
  function term(j, a, b, labelA, labelB) {
    return '<li class="term" data-index="' + j + '"><span class="j">[' + j + ']</span> <span class="a" title="' + esc(labelA) + '">' + fmt(a) +
      '</span> × <span class="b" title="' + esc(labelB) + '">' + fmt(b) + '</span> = <span class="p">' + fmt(a * b) + "</span></li>";
  }
  function totalLine(v) { return '<p class="eq">' + esc(t("c_total")) + ' = <span class="total">' + fmt(v) + "</span></p>"; }

  var CELL_NAMES = { projected: "Concat·W_O", ffn_hidden: "H", ffn_out: "F" };
  function explainProduct(m, name, ri, ci, leftName, wName, biasName) {
    var i = m.rows[ri], c = m.cols[ci], v = m.v[ri][ci], cell = m.cells ? m.cells[ri][ci] : null;
    var perHead = ["q", "k", "v"].indexOf(name) >= 0 && D.num_heads > 1;
    var width = name === "v" ? D.d_v : D.d_k;
    var hc = perHead ? t("c_hc", { g: S.head * width + c }) : "";
    var out = ['<p class="what">' + t("c_proj", { name: esc(CELL_NAMES[name] || name.toUpperCase()), i: i, c: c, tok: tok(i), hc: hc }) + "</p>"];
    if (!cell) {
      out.push("<p>" + esc(D.has_x ? t("c_noweights", { i: i, c: c }) : t("c_given")) + "</p>");
      out.push(totalLine(v));
      return out.join("");
    }
    out.push('<p class="eq">' + esc(leftName) + "[" + i + ", j] × " + esc(wName) + "[j, " + (perHead ? S.head * width + c : c) + "]" +
      (cell.b !== null ? " + " + esc(biasName) : "") + "</p>");
    out.push("<p>" + esc(cell.rn ? t("c_top", { k: cell.t.length, n: cell.m }) : t("c_terms", { n: cell.m })) + "</p>");
    out.push(termList(cell.t.map(function (tr) { return term(tr[0], tr[1], tr[2], leftName, wName); })));
    if (cell.rn) out.push('<p class="eq rest">+ ' + esc(t("c_rest", { n: cell.rn })) + ' = <span class="restsum">' + fmt(cell.rest) + "</span></p>");
    if (cell.b !== null) out.push('<p class="eq bias">+ ' + esc(t("c_bias")) + " " + esc(biasName) + ' = <span class="biasval">' + fmt(cell.b) + "</span></p>");
    out.push(totalLine(v));
    return out.join("");
  }

  function explainCell(name, ri, ci) {
    var m = name === "masked" && !view("masked") ? beforeMask() : view(name);
    var i = m.rows[ri];
    if (ci === "norm") return "<p>" + esc(t("c_norm_col", { i: i, n: m.shape[1] })) + "</p>" + totalLine(m.norm[ri]);
    var c = m.cols[ci], v = m.v[ri][ci], H = S.head;
    var sub = D.num_heads > 1 ? "^(" + H + ")" : "";
    if (name === "q" || name === "k" || name === "v") {
      var W = "W_" + name.toUpperCase();
      var g = S.head * (name === "v" ? D.d_v : D.d_k) + c;
      return explainProduct(m, name, ri, ci, "X", W, "b_" + name.toUpperCase() + "[" + g + "]");
    }
    if (name === "projected") return explainProduct(m, name, ri, ci, "Concat", "W_O", "");
    if (name === "ffn_hidden") return explainProduct(m, name, ri, ci, "N₁", "W₁", "b₁[" + c + "]");
    if (name === "ffn_out") return explainProduct(m, name, ri, ci, "ReLU", "W₂", "b₂[" + c + "]");
    if (name === "scores") {
      var q = D.heads[H].raw.q[i], k = D.heads[H].raw.k[c];
      var items = q.map(function (qv, j) { return term(j, qv, k[j], "q" + sub, "k" + sub); });
      return '<p class="what">' + t("c_score", { i: i, j: c, tok: tok(i), key: tok(c) }) + "</p>" +
        '<p class="eq">Σ_m q_' + i + "[m] × k_" + c + "[m]   (d_k = " + D.d_k + ")</p>" + termList(items) + totalLine(v);
    }
    if (name === "scaled") {
      var s = at(view("scores"), i, c), root = Math.sqrt(D.d_k);
      return '<p class="what">' + t("c_scaled", { i: i, j: c }) + "</p>" +
        '<p class="eq"><span class="num">' + fmt(s) + '</span> / √' + D.d_k + ' = <span class="num">' + fmt(s) + "</span> / <span class=\"root\">" +
        fmt(root) + '</span> = <span class="total">' + fmt(v) + "</span></p>";
    }
    if (name === "modified") {
      var sm = D.score_mod, s0 = at(view("scaled"), i, c), add = v === null || s0 === null ? null : v - s0;
      var head = '<p class="what">' + t("c_mod", { i: i, j: c, tok: tok(i), key: tok(c) }) + "</p>";
      if (v === null) return head + totalLine(null);
      if (sm.kind === "softcap") {
        return head + '<p class="eq">' + t("c_mod_softcap", { c: short(sm.cap), s: fmt(s0), x: fmt(s0 / sm.cap) }) + ' = <span class="total">' + fmt(v) + "</span></p>";
      }
      if (sm.kind === "alibi") {
        return head + '<p class="eq">' + t(sm.symmetric ? "c_mod_alibi_sym" : "c_mod_alibi", { s: fmt(s0), m: fmtSlope(sm.slopes[H]), i: i, j: c }) +
          ' = <span class="total">' + fmt(v) + "</span></p>";
      }
      return head + "<p>" + esc(t("c_mod_add")) + '</p><p class="eq">' + fmt(s0) + " + " + fmtR(add) + ' = <span class="total">' + fmt(v) + "</span></p>";
    }
    if (name === "masked") {
      var scaled = at(beforeMask(), i, c);
      if (v === null) {
        var why = S.causal && c > i ? t("c_hidden_causal", { i: i, j: c, tok: tok(i), key: tok(c) }) : esc(t("c_hidden_mask"));
        return '<p class="what hidden">' + why + "</p>" + totalLine(null);
      }
      var bias = v - scaled;
      if (Math.abs(bias) < 1e-12) return "<p>" + esc(t(view("modified") ? "c_visible_mod" : "c_visible")) + '</p><p class="eq">' + fmt(scaled) + " + 0 = " + fmt(v) + "</p>" + totalLine(v);
      return "<p>" + esc(t("c_bias_add")) + '</p><p class="eq">' + fmt(scaled) + " + " + fmtR(bias) + " = " + fmt(v) + "</p>" + totalLine(v);
    }
    if (name === "weights") {
      var src = view("masked") || beforeMask(), srow = row(src, i);
      var what = '<p class="what">' + t("c_weight", { i: i, j: c, tok: tok(i), key: tok(c) }) + "</p>";
      if (srow[c] === null) return what + "<p>" + t("c_weight_masked", { key: tok(c) }) + "</p>" + totalLine(0);
      var vis = srow.filter(function (x) { return x !== null; });
      if (!vis.length) return what + "<p>" + esc(t("c_all_masked")) + "</p>" + totalLine(0);
      var mx = Math.max.apply(null, vis), sum = 0;
      var exps = srow.map(function (x, j) {
        if (x === null) return null;
        var e = Math.exp(x - mx); sum += e; return [j, x, e];
      }).filter(function (e) { return e !== null; });
      var num = Math.exp(srow[c] - mx);
      var lis = exps.map(function (e) {
        return '<li class="exp" data-index="' + e[0] + '"><span class="j">[' + e[0] + ']</span> exp(' + fmt(e[1]) + " − " + fmt(mx) + ") = <span class=\"e\">" + fmt(e[2]) + "</span> · " + tok(e[0]) + "</li>";
      });
      var sink = sinkOf(H);
      if (sink !== null) { // one more term in the denominator, with no value behind it
        var es = Math.exp(sink - mx);
        sum += es;
        lis.push('<li class="sink"><span class="j">[' + esc(t("c_sink")) + "]</span> exp(" + fmt(sink) + " − " + fmt(mx) + ') = <span class="e">' +
          fmt(es) + "</span> · " + esc(t("c_sink_value")) + "</li>");
      }
      return what + '<p class="eq">' + esc(t("c_max")) + ' = <span class="max">' + fmt(mx) + "</span></p>" +
        "<p>" + esc(t("c_exps")) + "</p>" + termList(lis) +
        '<p class="eq">' + esc(t("c_sum")) + ' Σ = <span class="sum">' + fmt(sum) + "</span></p>" +
        '<p class="eq">exp(' + fmt(srow[c]) + " − " + fmtR(mx) + ') / Σ = <span class="numerator">' + fmt(num) + "</span> / " + fmt(sum) +
        ' = <span class="total">' + fmt(v) + "</span></p>";
    }
    if (name === "output") {
      var wrow = row(view("weights"), i), vcol = D.heads[H].raw.v;
      var terms = [];
      wrow.forEach(function (w, j) { if (w !== 0) terms.push(term(j, w, vcol[j][c], "A", "V")); });
      return '<p class="what">' + t("c_output", { i: i, c: c }) + " · " + tok(i) + "</p>" + termList(terms) + totalLine(v);
    }
    if (name === "concat") {
      return "<p>" + esc(t("c_concat", { c: c, cc: c % D.d_v, h: Math.floor(c / D.d_v) })) + "</p>" + totalLine(v);
    }
    if (name === "x") {
      if (D.kind === "block") {
        return '<p class="eq">E + P = ' + fmt(at(D.inputs.embeddings, i, c)) + " + " + fmt(at(D.inputs.positional, i, c)) +
          ' = <span class="total">' + fmt(v) + "</span></p>";
      }
      return "<p>" + (D.meta.model ? t("c_input_model", { tok: tok(i), layer: D.meta.layer, c: c }) : t("c_input_toy", { tok: tok(i), c: c })) + "</p>" + totalLine(v);
    }
    if (name === "embeddings") return "<p>" + t("c_emb", { tok: tok(i), c: c }) + "</p>" + totalLine(v);
    if (name === "positional") {
      var kk = 2 * Math.floor(c / 2), angle = i / Math.pow(10000, kk / D.d_model);
      return '<p class="eq">' + t("c_pos", { i: i, c: c, fn: c % 2 ? "cos" : "sin", k: kk, d: D.d_model, angle: fmt(angle) }) + "</p>" + totalLine(v);
    }
    if (name === "residual1" || name === "residual2") {
      var l = name === "residual1" ? D.inputs.x : variant().norm1, r = name === "residual1" ? variant().attn : variant().ffn_out;
      return '<p class="eq">' + t("c_sum2", { a: fmt(at(l, i, c)), b: fmtR(at(r, i, c)) }) + ' = <span class="total">' + fmt(v) + "</span></p>";
    }
    if (name === "norm1" || name === "block_output") {
      var one = name === "norm1", rm = variant()[one ? "residual1" : "residual2"];
      var mu = variant()[one ? "mean1" : "mean2"][i], sd = variant()[one ? "std1" : "std2"][i];
      var g = D.inputs[one ? "gamma1" : "gamma2"][c], b = D.inputs[one ? "beta1" : "beta2"][c];
      return "<p>" + esc(t("c_norm", { name: one ? "R₁" : "R₂", i: i, c: c })) + '</p><p class="eq">(' + fmt(at(rm, i, c)) + " − " + fmtR(mu) + ") / " +
        fmt(sd) + " × " + fmtR(g) + " + " + fmtR(b) + ' = <span class="total">' + fmt(v) + "</span></p>";
    }
    if (name === "ffn_relu") {
      return '<p class="eq">' + t("c_relu", { h: fmt(at(variant().ffn_hidden, i, c)) }) + ' = <span class="total">' + fmt(v) + "</span></p>";
    }
    return totalLine(v);
  }

  // ---- page state ----------------------------------------------------------------------------
  function setStatic() {
    document.documentElement.lang = S.lang === "zh" ? "zh-Hans" : "en";
    Array.prototype.forEach.call(document.querySelectorAll("[data-t]"), function (el) { el.textContent = t(el.dataset.t); });
    var title;
    if (D.meta.model) {
      var what = [String(D.meta.model)];
      if (D.meta.layer !== undefined) what.push(t("layer", { n: D.meta.layer }));
      if (D.meta.head !== undefined) what.push(t("head_n", { n: D.meta.head }));
      title = t("title_model", { what: what.join(" · ") });
    } else title = t(D.kind === "block" ? "title_block" : "title");
    document.title = title;
    document.getElementById("page-title").textContent = title;
    var sub = t("sub", { n: D.n, dk: D.d_k, dv: D.d_v });
    if (D.d_model !== null) sub += t("sub_model", { d: D.d_model });
    if (D.num_heads > 1) sub += t("sub_heads", { h: D.num_heads });
    if (D.d_ff !== null) sub += t("sub_ff", { f: D.d_ff });
    if (D.score_mod) sub += t("sub_score", { text: D.score_mod.text });
    if (D.sinks) sub += t("sub_sinks", { v: D.sinks.map(function (x) { return x === null ? "−∞" : short(x); }).join(", ") });
    document.getElementById("page-sub").textContent = sub;
    document.getElementById("counting").textContent = t("counting");
    document.getElementById("prev").textContent = t("prev");
    document.getElementById("next").textContent = t("next");
    document.getElementById("causal-note").textContent = D.causal_toggle ? "" : t("no_toggle");
    var hs = document.getElementById("head-select");
    hs.innerHTML = D.heads.map(function (_, h) { return '<option value="' + h + '">' + esc(t("head_n", { n: h })) + "</option>"; }).join("");
    hs.value = String(S.head);
    document.getElementById("head-control").hidden = D.num_heads < 2;
    var ts = document.getElementById("token-select");
    ts.innerHTML = D.tokens.map(function (w, i) { return '<option value="' + i + '">' + i + ": " + esc(w) + "</option>"; }).join("");
    ts.value = String(S.token);
    var ct = document.getElementById("causal-toggle");
    ct.checked = S.causal;
    ct.disabled = !D.causal_toggle;
    document.getElementById("lang-select").value = S.lang;
    var list = document.getElementById("step-list");
    list.innerHTML = D.steps.map(function (id, k) {
      return '<li><button type="button" data-step="' + id + '" data-index="' + k + '">' + esc(t("s_" + id)) + "</button></li>";
    }).join("");
  }
  function render() {
    var id = D.steps[S.step];
    renderFlow();
    Array.prototype.forEach.call(document.querySelectorAll("#step-list button"), function (b) {
      if (Number(b.dataset.index) === S.step) b.setAttribute("aria-current", "step");
      else b.removeAttribute("aria-current");
    });
    document.getElementById("step-title").textContent = t("s_" + id);
    document.getElementById("step-formula").textContent = formula(id);
    document.getElementById("narrative").innerHTML = narrative(id);
    document.getElementById("matrices").innerHTML = STEP_MATS[id].map(matrixHTML).join("");
    document.getElementById("prev").disabled = S.step === 0;
    document.getElementById("next").disabled = S.step === D.steps.length - 1;
    document.body.dataset.step = id;
    S.pinned = null;
    showHint();
  }
  function showHint() { document.getElementById("explain-body").innerHTML = '<p class="hint">' + esc(t("hint")) + "</p>"; }
  function go(k) {
    S.step = Math.max(0, Math.min(D.steps.length - 1, k));
    render();
  }
  function show(td) {
    var body = document.getElementById("explain-body");
    body.innerHTML = explainCell(td.dataset.m, Number(td.dataset.r), td.dataset.c === "norm" ? "norm" : Number(td.dataset.c));
    body.dataset.m = td.dataset.m; body.dataset.r = td.dataset.r; body.dataset.c = td.dataset.c;
    Array.prototype.forEach.call(document.querySelectorAll("td.hot"), function (e) { e.classList.remove("hot"); });
    td.classList.add("hot");
  }

  // ---- events --------------------------------------------------------------------------------
  document.getElementById("prev").addEventListener("click", function () { go(S.step - 1); });
  document.getElementById("next").addEventListener("click", function () { go(S.step + 1); });
  document.getElementById("step-list").addEventListener("click", function (e) {
    var b = e.target.closest("button[data-index]");
    if (b) go(Number(b.dataset.index));
  });
  document.getElementById("flow").addEventListener("click", function (e) {
    var g = e.target.closest("g.node");
    if (g) go(Number(g.dataset.index));
  });
  document.getElementById("lang-select").addEventListener("change", function (e) { S.lang = e.target.value; setStatic(); render(); });
  document.getElementById("head-select").addEventListener("change", function (e) { S.head = Number(e.target.value); render(); });
  document.getElementById("token-select").addEventListener("change", function (e) { S.token = Number(e.target.value); render(); });
  document.getElementById("causal-toggle").addEventListener("change", function (e) { S.causal = e.target.checked; render(); });
  var matrices = document.getElementById("matrices");
  matrices.addEventListener("mouseover", function (e) {
    var td = e.target.closest("td[data-m]");
    if (td && !S.pinned) show(td);
  });
  matrices.addEventListener("click", function (e) {
    var td = e.target.closest("td[data-m]");
    if (!td) return;
    var was = S.pinned === td;
    Array.prototype.forEach.call(document.querySelectorAll("td.pinned"), function (x) { x.classList.remove("pinned"); });
    S.pinned = was ? null : td;
    if (!was) { td.classList.add("pinned"); show(td); }
  });
  document.addEventListener("keydown", function (e) {
    var tag = e.target && e.target.tagName;
    if (tag === "SELECT" || tag === "INPUT" || tag === "TEXTAREA" || e.altKey || e.ctrlKey || e.metaKey) return;
    if (e.key === "ArrowRight" || e.key === "j") { go(S.step + 1); e.preventDefault(); }
    else if (e.key === "ArrowLeft" || e.key === "k") { go(S.step - 1); e.preventDefault(); }
    else if (e.key === "Home") { go(0); e.preventDefault(); }
    else if (e.key === "End") { go(D.steps.length - 1); e.preventDefault(); }
    else if (e.key === "Escape" && S.pinned) {
      S.pinned.classList.remove("pinned"); S.pinned = null; showHint();
    }
  });

  setStatic();
  render();
  document.body.dataset.ready = "true";
})();
