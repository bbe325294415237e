
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
