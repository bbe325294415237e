// qkv explain --compare: click a head of the distance grid to see its maps for A and B and B − A.
(function () {
  'use strict';
  var D = JSON.parse(document.getElementById('qkv-data').textContent);
  var L = D.num_layers, H = D.num_heads;
  var $ = function (id) { return document.getElementById(id); };
  var T = D.labels;
  function say(key, o) { return T[key].replace(/\{(\w+)\}/g, function (m, k) { return String(o[k]); }); }
  function decode(b64) {                                // base64 little-endian uint16 → weights
    if (!b64) return null;
    var s = atob(b64), out = new Float32Array(s.length / 2);
    for (var i = 0; i < out.length; i++) out[i] = (s.charCodeAt(2 * i) | (s.charCodeAt(2 * i + 1) << 8)) / 65535;
    return out;
  }
  var A = { side: D.a, rows: decode(D.a.rows), maps: decode(D.a.maps), n: D.a.tokens.length };
  var B = { side: D.b, rows: decode(D.b.rows), maps: decode(D.b.maps), n: D.b.tokens.length };
  function row(S, l, h, q) {                            // (N,) one query row of one head
    if (q === undefined) return S.rows.subarray((l * H + h) * S.n, (l * H + h + 1) * S.n);
    var o = ((l * H + h) * S.n + q) * S.n;
    return S.maps.subarray(o, o + S.n);
  }
  function el(tag, cls, text) { var e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; }
  function heat(w) { var c = Math.round(255 * (1 - w)); return 'rgb(' + c + ',' + c + ',255)'; }
  // toFixed without a sign on a zero ("-0.000" reads as a loss where nothing changed)
  function fixed(v, digits) {
    var s = v.toFixed(digits);
    return /^-0\.?0*$/.test(s) ? s.slice(1) : s;
  }
  function diverge(d, lim) {
    var t = Math.min(1, Math.abs(d) / lim), c = Math.round(255 * (1 - t));
    return d >= 0 ? 'rgb(255,' + c + ',' + c + ')' : 'rgb(' + c + ',' + c + ',255)';
  }
  var state = { l: D.initial.layer, h: D.initial.head };

  // the L × H grid of distances
  var grid = $('grid'), head = el('tr');
  head.appendChild(el('th', '', ''));
  for (var h = 0; h < H; h++) head.appendChild(el('th', '', 'H' + h));
  grid.appendChild(head);
  var cells = [];
  for (var l = 0; l < L; l++) {
    var tr = el('tr');
    tr.appendChild(el('th', '', 'L' + l));
    for (h = 0; h < H; h++) {
      var d = D.distance[l][h], td = el('td', '', d.toFixed(2));
      td.style.background = 'rgba(200,30,80,' + d.toFixed(3) + ')';
      td.style.color = d > 0.55 ? '#fff' : '#222';
      td.tabIndex = 0; td.title = 'layer ' + l + ', head ' + h + ': ' + d.toFixed(4);
      td.dataset.l = String(l); td.dataset.h = String(h);
      td.addEventListener('click', function (e) { select(+e.currentTarget.dataset.l, +e.currentTarget.dataset.h); });
      tr.appendChild(td); cells.push(td);
    }
    grid.appendChild(tr);
  }
  document.addEventListener('keydown', function (e) {
    var m = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] }[e.key];
    if (!m) return;
    e.preventDefault();
    select(Math.max(0, Math.min(L - 1, state.l + m[0])), Math.max(0, Math.min(H - 1, state.h + m[1])));
  });

  function drawMap(table, labels, focus, value, color) {
    table.textContent = '';
    var n = labels.length, thead = el('thead'), tr = el('tr');
    tr.appendChild(el('th'));
    labels.forEach(function (t) { tr.appendChild(el('th', '', t)); });
    thead.appendChild(tr); table.appendChild(thead);
    var body = el('tbody');
    for (var i = 0; i < n; i++) {
      tr = el('tr');
      tr.appendChild(el('th', i === focus ? 'focus' : '', labels[i]));
      for (var j = 0; j < n; j++) {
        var v = value(i, j), td = el('td');
        td.style.background = color(v); td.title = labels[i] + ' → ' + labels[j] + ': ' + fixed(v, 4);
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
    table.appendChild(body);
  }

  function select(l, h) {
    state.l = l; state.h = h;
    cells.forEach(function (c) { c.classList.toggle('sel', +c.dataset.l === l && +c.dataset.h === h); });
    $('head-title').textContent = say('head_title', { l: l, h: h, d: D.distance[l][h].toFixed(3) });
    if (A.maps && B.maps) {
      drawMap($('map-a'), D.a.tokens, D.a.focus, function (i, j) { return row(A, l, h, i)[j]; }, heat);
      drawMap($('map-b'), D.b.tokens, D.b.focus, function (i, j) { return row(B, l, h, i)[j]; }, heat);
      var pa = D.pairs.map(function (p) { return p[0]; }), pb = D.pairs.map(function (p) { return p[1]; });
      var lim = 1e-6;
      pa.forEach(function (i, x) { pa.forEach(function (j, y) {
        lim = Math.max(lim, Math.abs(row(B, l, h, pb[x])[pb[y]] - row(A, l, h, i)[j])); }); });
      var fa = pa.indexOf(D.a.focus);
      drawMap($('map-d'), pa.map(function (i) { return D.a.tokens[i]; }), fa,
        function (x, y) { return row(B, l, h, pb[x])[pb[y]] - row(A, l, h, pa[x])[pa[y]]; },
        function (v) { return diverge(v, lim); });
      // the colour scale of B − A: blue where B attends less, red where it attends more
      $('scale-bar').style.background = 'linear-gradient(to right, ' + diverge(-lim, lim) + ', #fff, ' + diverge(lim, lim) + ')';
      $('scale-lo').textContent = fixed(-lim, 3);
      $('scale-hi').textContent = '+' + fixed(lim, 3);
    }
    // the focus rows, token by token (aligned tokens side by side; the rest alone)
    var ra = row(A, l, h), rb = row(B, l, h), rows = $('rows');
    $('rows-title').textContent = say('rows_title', { a: D.a.tokens[D.a.focus], b: D.b.tokens[D.b.focus] });
    rows.textContent = '';
    var tr = el('tr');
    T.cols.forEach(function (t) { tr.appendChild(el('th', '', t)); });
    rows.appendChild(tr);
    var i = 0, j = 0, k = 0;
    function add(ia, jb) {
      var r = el('tr', ia === null || jb === null ? 'only' : '');
      var va = ia === null ? 0 : ra[ia], vb = jb === null ? 0 : rb[jb];
      [ia === null ? '' : D.a.tokens[ia], ia === null ? '' : va.toFixed(3),
       jb === null ? '' : D.b.tokens[jb], jb === null ? '' : vb.toFixed(3), fixed(vb - va, 3)]
        .forEach(function (t) { r.appendChild(el('td', '', t)); });
      rows.appendChild(r);
    }
    while (i < A.n || j < B.n) {
      var p = k < D.pairs.length ? D.pairs[k] : [A.n, B.n];
      if (i < p[0]) add(i++, null);
      else if (j < p[1]) add(null, j++);
      else { add(i++, j++); k++; }
    }
    document.body.dataset.ready = '1';
  }
  select(state.l, state.h);
})();
