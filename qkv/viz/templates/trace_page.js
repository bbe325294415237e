/* qkv trace page: renders the JSON in #qkv-trace-data. Every number was computed in float64 by
   qkv (qkv.viz.trace_page); this script only formats, colours and explains them. */
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("qkv-trace-data").textContent);
  var P = D.precision;
  var S = { step: 0, head: 0, token: D.token, causal: D.causal, lang: D.lang, pinned: null };

  // ---- words -------------------------------------------------------------------------------
  var WORDS = {
    en: {
      title: "Self-attention, step by step", title_block: "An encoder block, step by step",
      title_model: "{what} — attention, step by step", layer: "layer {n}", head_n: "head {n}",
      counting: "Tokens, heads and layers are counted from 0, as in Python and in qkv's JSON.",
      sub: "{n} tokens · d_k = {dk} · d_v = {dv}", sub_model: " · d_model = {d}", sub_heads: " · {h} heads",
      sub_ff: " · d_ff = {f}",
      language: "Language", head: "Head", token: "Token", causal: "causal mask", steps: "Steps",
      prev: "← Previous", next: "Next →", keys: "Keys: ← / → or k / j move between steps; click a cell to pin its explanation, Esc to unpin.",
      cell: "This cell", hint: "Hover over a cell, or click it to pin, to see where its number comes from.",
      no_toggle: "The trace is causal and has its own mask as well, so the unmasked variant cannot be recovered.",
      shape: "{r} × {c}", summary: "Showing columns {shown} of {c}; ‖row‖ is each full row's length.",
      summary_rows: "Showing rows {shown} of {r}.", norm: "‖row‖", gap: "…",
      // step names (list) and flow-chart labels
      s_positional: "Embeddings + positions", s_x: "Input X", s_qkv: "Q, K, V projections", s_scores: "Scores Q·Kᵀ",
      s_scaled: "Scale by 1/√d_k", s_mask: "Mask", s_weights: "Softmax weights", s_output: "Weighted sum of V",
      s_concat: "Concatenate heads", s_projected: "Output projection W_O", s_residual1: "Residual 1",
      s_norm1: "LayerNorm 1", s_ffn: "Feed-forward", s_residual2: "Residual 2", s_norm2: "LayerNorm 2",
      f_positional: "E + P", f_x: "X", f_scores: "Q·Kᵀ", f_scaled: "÷ √d_k", f_mask: "mask", f_weights: "softmax",
      f_output: "A·V", f_concat: "concat", f_projected: "· W_O", f_residual1: "X + attention", f_norm1: "LayerNorm",
      f_ffn: "feed-forward", f_residual2: "+ residual", f_norm2: "LayerNorm",
      // formulas
      e_positional: "X = E + P,   P[pos, 2i] = sin(pos / 10000^(2i/d_model)),   P[pos, 2i+1] = cos(pos / 10000^(2i/d_model))",
      e_x: "X: one row of d_model numbers per token", e_qkv: "Q = X·W_Q{bq},   K = X·W_K{bk},   V = X·W_V{bv}",
      e_scores: "S = Q·Kᵀ   (S[i, j] = q_i · k_j)", e_scaled: "S / √d_k = S / {root}",
      e_mask: "S/√d_k + M,   M[i, j] = −∞ where query i may not see key j", e_weights: "A[i, j] = exp(s_ij − max_i) / Σ_j exp(s_ij − max_i)",
      e_output: "O = A·V   (O[i, c] = Σ_j A[i, j] · V[j, c])", e_concat: "Concat(head 0, …, head {last})   ({n} × {w})",
      e_projected: "Concat · W_O", e_residual1: "R₁ = X + MultiHead(X)", e_norm1: "N₁ = (R₁ − μ) / σ · γ₁ + β₁,   σ = √(var + ε)",
      e_ffn: "F = ReLU(N₁·W₁ + b₁)·W₂ + b₂", e_residual2: "R₂ = N₁ + F", e_norm2: "Y = (R₂ − μ) / σ · γ₂ + β₂",
      // matrix captions
      m_x: "X", m_embeddings: "embeddings E", m_positional: "positions P", m_q: "Q", m_k: "K", m_v: "V",
      m_scores: "scores S = Q·Kᵀ", m_scaled: "scaled S/√d_k", m_masked: "masked scores", m_unmasked: "scaled scores (no mask)",
      m_weights: "weights A", m_output: "output A·V", m_concat: "concatenated heads", m_projected: "Concat·W_O",
      m_residual1: "R₁ = X + attention", m_norm1: "LayerNorm₁", m_ffn_hidden: "H = N₁·W₁ + b₁", m_ffn_relu: "ReLU",
      m_ffn_out: "F = ReLU·W₂ + b₂", m_residual2: "R₂ = N₁ + F", m_block_output: "block output Y", of_head: " (head {h})",
      // narratives
      n_x: "Each of the {n} tokens enters as a row of {d} numbers; “{tok}” is row {i}. ",
      n_x_model: "These are the real hidden states of {model} entering layer {layer}, so every number below is what the model itself computes.",
      n_x_toy: "They are small toy numbers, so every product below can be checked by hand.",
      n_positional: "Attention by itself does not know the order of the words, so a position code is added to every embedding: sine waves in the even columns, cosine waves in the odd ones, each column a different wavelength. “{tok}” sits at position {i}; its embedding plus its position code is its row of X.",
      n_qkv: "Three learned matrices turn each row of X into a query (what this token is looking for), a key (what it offers to the others) and a value (what it passes on when chosen). {headpart}“{tok}” gets the query {q}.",
      n_qkv_head: "Head {h} owns {dk} columns of each. ", n_qkv_given: "Q, K and V were given directly, not computed from an X. ",
      n_scores: "Row {i} compares the query of “{tok}” with every key by a dot product: the larger, the better the match. Its best match is “{best}” ({bs}), its weakest “{worst}” ({ws}).",
      n_scaled: "Dot products grow with d_k, and large scores would push the softmax to give nearly all weight to one key. Dividing by √d_k = √{dk} = {root} keeps them moderate: the scores of “{tok}” now run from {lo} to {hi}.",
      n_mask_on: "With the causal mask a token may look only at itself and the tokens before it, as in a decoder that must not peek ahead. “{tok}” (position {i}) sees tokens 0 … {i}; ",
      n_mask_later: "the {m} later keys get −∞, so their weight will be exactly 0.", n_mask_last: "it is the last token, so nothing is hidden from it.",
      n_mask_off: "No causal mask: every token may attend to every token, before and after it, as in an encoder. Tick “causal mask” above to hide later tokens.",
      n_mask_other: " The trace also carries its own attention mask ({kinds}).",
      n_weights: "Softmax turns each row into positive weights that add up to 1. “{tok}” gives the most weight to “{k1}” ({w1}, {pct}%){second}. Row {i} sums to {sum}.",
      n_weights_second: ", then “{k2}” ({w2})", n_weights_none: "Every key of “{tok}” is masked, so its weights are all 0 and its output is 0.",
      n_output: "The output of “{tok}” is an average of the value rows, weighted by its attention: Σ_j A[{i}, j] · v_j. The largest share comes from the value of “{k1}” (weight {w1}), so the output leans towards it. Each output row has d_v = {dv} numbers.",
      n_concat: "The {h} heads ran side by side, each on its own columns; their outputs ({dv} numbers each) are placed next to each other, giving {n} × {w}. Head {hh} fills columns {a} … {b}.",
      n_projected: "W_O mixes the heads' outputs into one row of {w} numbers per token. This is the attention layer's result.",
      n_residual1: "The attention result is added to its own input X (a residual connection), so the layer only has to learn a change. For “{tok}”, column 0: {x} + {a} = {r}.",
      n_norm1: "LayerNorm rescales every row on its own: subtract the row's mean, divide by its standard deviation, then multiply by γ and add β (both learned per column). For “{tok}”: μ = {mu}, σ = {sd}.",
      n_ffn: "The same two-layer network runs on every token separately: widen to d_ff = {f} with W₁ and b₁, switch off the negative units with ReLU ({off} of {f} off for “{tok}”), then come back to d_model = {d} with W₂ and b₂.",
      n_residual2: "The feed-forward result is added to its input (the output of LayerNorm 1), a second residual connection. For “{tok}”, column 0: {x} + {a} = {r}.",
      n_norm2: "A second LayerNorm gives the block's output; in a stack of blocks it is the next block's input. For “{tok}”: μ = {mu}, σ = {sd}.",
      // cell explanations
      c_proj: "{name}[{i}, {c}]: token “{tok}”, column {c}{hc}", c_hc: " (column {g} of the full matrix)",
      c_terms: "the {n} terms", c_top: "the {k} largest of {n} terms", c_rest: "the other {n} terms", c_bias: "bias",
      c_total: "total", c_given: "Given directly (Trace.from_qkv): there is no X or W to expand.",
      c_noweights: "x_{i} · column {c} of the weight matrix (this per-head trace does not keep the weights).",
      c_score: "S[{i}, {j}] = q_{i} · k_{j}: query of “{tok}”, key of “{key}”", c_scaled: "S[{i}, {j}] / √d_k",
      c_hidden_causal: "Hidden: key {j} (“{key}”) comes after query {i} (“{tok}”), so the causal mask sets it to −∞.",
      c_hidden_mask: "Hidden by the trace's attention mask: −∞.", c_visible: "Visible: the scaled score passes unchanged.",
      c_bias_add: "scaled score + mask value", c_weight: "A[{i}, {j}]: how much “{tok}” attends to “{key}”",
      c_weight_masked: "Key “{key}” is masked: exp(−∞) = 0, so its weight is 0.", c_max: "row maximum",
      c_exps: "exp(s_ij − max) for the visible keys", c_sum: "sum", c_all_masked: "Every key of this row is masked: all weights are 0.",
      c_output: "O[{i}, {c}]: Σ_j A[{i}, j] · V[j, {c}]", c_concat: "Column {c} of the concatenation is column {cc} of head {h}'s output.",
      c_input_model: "Hidden state of “{tok}” entering layer {layer}, feature {c}.", c_input_toy: "Toy input of “{tok}”, feature {c}.",
      c_emb: "Embedding of “{tok}”, feature {c}.",
      c_pos: "Position {i}, column {c}: {fn}({i} / 10000^({k}/{d})) = {fn}({angle})",
      c_sum2: "{a} + {b}", c_norm: "(r − μ) / σ · γ + β, with r = {name}[{i}, {c}], μ, σ of row {i}, γ, β of column {c}",
      c_relu: "max(0, {h})", c_norm_col: "Length of the whole row {i} (all {n} columns).",
      // a score function (the "modified" step) and sinks
      s_modified: "Score function", f_modified: "score_mod", m_modified: "modified scores s′",
      m_modified_nomask: "modified scores s′ (no mask)",
      e_modified_softcap: "s′ = {c} · tanh(s / {c})   (softcap: every score inside (−{c}, {c}))",
      e_modified_alibi: "s′ = s + m_h · (j − i)   (ALiBi; head {h}: m = {m})",
      e_modified_alibi_sym: "s′ = s − m_h · |j − i|   (ALiBi; head {h}: m = {m})",
      e_modified_rel: "s′ = s + table[bucket(j − i), h]   ({text})",
      e_modified_fn: "s′ = {name}(s, batch, head, q_idx, kv_idx)", e_modified_other: "s′ = score_mod(s)   ({text})",
      e_mask_mod: "s′ + M,   M[i, j] = −∞ where query i may not see key j",
      n_mod_softcap: "Softcapping squashes every score smoothly into (−{c}, {c}): scores far below {c} barely move and large ones flatten out near ±{c}, so no single key can run away with the softmax. The scores of “{tok}” ran from {lo} to {hi}; now they run from {lo2} to {hi2}.",
      n_mod_alibi: "ALiBi penalises farther keys by slope·distance. Head {h}'s slope is m = {m}, so a key d positions before “{tok}” loses m·d (a key after it gains m·d, which a causal mask usually hides). Nearby tokens are favoured without any position embedding.",
      n_mod_alibi_sym: "ALiBi penalises farther keys by slope·distance. Head {h}'s slope is m = {m}, so a key d positions away from “{tok}”, on either side, loses m·d. Nearby tokens are favoured without any position embedding.",
      n_mod_rel: "A relative position bias adds a learned number for each query–key distance ({text}). For “{tok}” the numbers added run from {lo} to {hi}.",
      n_mod_fn: "The score function {name} is called on every scaled score, with its batch, head, query and key indices, and returns a new score. In the row of “{tok}” the largest change is {d}.",
      c_mod: "s′[{i}, {j}]: the score function on the scaled score of “{tok}” and “{key}”",
      c_mod_softcap: "{c} · tanh({s} / {c}) = {c} · tanh({x})", c_mod_alibi: "{s} + {m} · ({j} − {i})",
      c_mod_alibi_sym: "{s} − {m} · |{j} − {i}|", c_mod_add: "scaled score + what the function added",
      c_visible_mod: "Visible: the modified score passes unchanged.",
      e_weights_sink: "A[i, j] = exp(s_ij − max_i) / (Σ_j exp(s_ij − max_i) + exp(sink_h − max_i))",
      n_weights_sink: " This head has a sink (logit {s}): it joins the denominator but has no value, so it absorbs {pct}% of row {i}'s attention and the row sums to {sum}, not 1.",
      c_sink: "sink", c_sink_value: "no value", sub_score: " · score function: {text}", sub_sinks: " · sinks {v}",
    },
    zh: {
      title: "自注意力逐步演示", title_block: "编码器块逐步演示",
      title_model: "{what} — 注意力逐步演示", layer: "第 {n} 层", head_n: "第 {n} 个头",
      counting: "词元、头和层都从 0 开始编号（与 Python 和 qkv 的 JSON 一致）。",
      sub: "{n} 个词元 · d_k = {dk} · d_v = {dv}", sub_model: " · d_model = {d}", sub_heads: " · {h} 个头",
      sub_ff: " · d_ff = {f}",
      language: "语言", head: "注意力头", token: "词元", causal: "因果掩码", steps: "步骤",
      prev: "← 上一步", next: "下一步 →", keys: "按键：← / → 或 k / j 切换步骤；点击单元格可固定说明，按 Esc 取消。",
      cell: "当前单元格", hint: "把鼠标移到单元格上（或点击固定），查看这个数是怎么算出来的。",
      no_toggle: "这个轨迹既有因果掩码又有自己的掩码，无法还原出不带掩码的版本。",
      shape: "{r} × {c}", summary: "显示第 {shown} 列（共 {c} 列）；‖row‖ 是整行的长度（范数）。",
      summary_rows: "显示第 {shown} 行（共 {r} 行）。", norm: "‖行‖", gap: "…",
      s_positional: "嵌入 + 位置编码", s_x: "输入 X", s_qkv: "投影得到 Q、K、V", s_scores: "打分 Q·Kᵀ",
      s_scaled: "缩放 1/√d_k", s_mask: "掩码", s_weights: "softmax 注意力权重", s_output: "对 V 加权求和",
      s_concat: "拼接各个头", s_projected: "输出投影 W_O", s_residual1: "残差连接 1",
      s_norm1: "层归一化 1", s_ffn: "前馈网络", s_residual2: "残差连接 2", s_norm2: "层归一化 2",
      f_positional: "E + P", f_x: "X", f_scores: "Q·Kᵀ", f_scaled: "÷ √d_k", f_mask: "掩码", f_weights: "softmax",
      f_output: "A·V", f_concat: "拼接", f_projected: "· W_O", f_residual1: "X + 注意力", f_norm1: "层归一化",
      f_ffn: "前馈网络", f_residual2: "+ 残差", f_norm2: "层归一化",
      e_positional: "X = E + P，   P[pos, 2i] = sin(pos / 10000^(2i/d_model))，   P[pos, 2i+1] = cos(pos / 10000^(2i/d_model))",
      e_x: "X：每个词元一行，每行 d_model 个数", e_qkv: "Q = X·W_Q{bq}，   K = X·W_K{bk}，   V = X·W_V{bv}",
      e_scores: "S = Q·Kᵀ   （S[i, j] = q_i · k_j）", e_scaled: "S / √d_k = S / {root}",
      e_mask: "S/√d_k + M，   查询 i 不能看到键 j 时 M[i, j] = −∞", e_weights: "A[i, j] = exp(s_ij − max_i) / Σ_j exp(s_ij − max_i)",
      e_output: "O = A·V   （O[i, c] = Σ_j A[i, j] · V[j, c]）", e_concat: "Concat(头 0, …, 头 {last})   （{n} × {w}）",
      e_projected: "Concat · W_O", e_residual1: "R₁ = X + MultiHead(X)", e_norm1: "N₁ = (R₁ − μ) / σ · γ₁ + β₁，   σ = √(方差 + ε)",
      e_ffn: "F = ReLU(N₁·W₁ + b₁)·W₂ + b₂", e_residual2: "R₂ = N₁ + F", e_norm2: "Y = (R₂ − μ) / σ · γ₂ + β₂",
      m_x: "X", m_embeddings: "嵌入 E", m_positional: "位置编码 P", m_q: "Q（查询）", m_k: "K（键）", m_v: "V（值）",
      m_scores: "打分 S = Q·Kᵀ", m_scaled: "缩放后 S/√d_k", m_masked: "掩码后的打分", m_unmasked: "缩放后的打分（无掩码）",
      m_weights: "注意力权重 A", m_output: "输出 A·V", m_concat: "拼接后的各头输出", m_projected: "Concat·W_O",
      m_residual1: "R₁ = X + 注意力", m_norm1: "层归一化₁", m_ffn_hidden: "H = N₁·W₁ + b₁", m_ffn_relu: "ReLU",
      m_ffn_out: "F = ReLU·W₂ + b₂", m_residual2: "R₂ = N₁ + F", m_block_output: "块输出 Y", of_head: "（头 {h}）",
      n_x: "{n} 个词元各自以一行 {d} 个数进入；“{tok}”是第 {i} 行。",
      n_x_model: "这些是 {model} 第 {layer} 层输入处真实的隐藏状态，下面每个数都是模型自己算出的。",
      n_x_toy: "这些是很小的示例数字，下面每一次乘法都可以手算核对。",
      n_positional: "注意力本身不知道词的先后顺序，所以要给每个嵌入加上位置编码：偶数列是正弦波，奇数列是余弦波，每一列的波长都不同。“{tok}”位于位置 {i}；它的嵌入加上位置编码，就是 X 的这一行。",
      n_qkv: "三个学到的矩阵把 X 的每一行变成查询（这个词元在找什么）、键（它能提供什么）和值（被选中时传递的内容）。{headpart}“{tok}”的查询向量是 {q}。",
      n_qkv_head: "头 {h} 使用每个矩阵中属于它的 {dk} 列。", n_qkv_given: "Q、K、V 是直接给定的，不是由 X 算出来的。",
      n_scores: "第 {i} 行用点积把“{tok}”的查询和每个键比较：点积越大，匹配越好。它最匹配的是“{best}”（{bs}），最不匹配的是“{worst}”（{ws}）。",
      n_scaled: "点积会随 d_k 增大而变大，分数太大会让 softmax 几乎把全部权重给一个键。除以 √d_k = √{dk} = {root} 让分数保持适中：“{tok}”的分数现在在 {lo} 到 {hi} 之间。",
      n_mask_on: "有因果掩码时，每个词元只能看它自己和它前面的词元，就像解码器不能偷看后面的内容。“{tok}”（位置 {i}）能看到词元 0 … {i}；",
      n_mask_later: "后面的 {m} 个键被设为 −∞，它们的权重会恰好为 0。", n_mask_last: "它是最后一个词元，没有任何键被遮住。",
      n_mask_off: "没有因果掩码：每个词元都能关注所有词元，包括它后面的，就像编码器一样。勾选上方的“因果掩码”可以遮住后面的词元。",
      n_mask_other: "这个轨迹还带有它自己的注意力掩码（{kinds}）。",
      n_weights: "softmax 把每一行变成加起来等于 1 的正权重。“{tok}”把最多的注意力给了“{k1}”（{w1}，{pct}%）{second}。第 {i} 行的和是 {sum}。",
      n_weights_second: "，其次是“{k2}”（{w2}）", n_weights_none: "“{tok}”的所有键都被遮住，所以它的权重全是 0，输出也是 0。",
      n_output: "“{tok}”的输出是各个值向量按注意力权重的加权平均：Σ_j A[{i}, j] · v_j。贡献最大的是“{k1}”的值（权重 {w1}），所以输出偏向它。每个输出行有 d_v = {dv} 个数。",
      n_concat: "{h} 个头并行计算，各自使用自己的列；把它们的输出（每个 {dv} 个数）并排放在一起，得到 {n} × {w}。头 {hh} 占第 {a} … {b} 列。",
      n_projected: "W_O 把各个头的输出混合成每个词元一行 {w} 个数，这就是注意力层的结果。",
      n_residual1: "把注意力的结果加回到它自己的输入 X 上（残差连接），这样这一层只需要学习一个“变化量”。“{tok}”的第 0 列：{x} + {a} = {r}。",
      n_norm1: "层归一化对每一行单独处理：减去这一行的均值，除以它的标准差，再乘以 γ、加上 β（每一列各有一个，都是学出来的）。“{tok}”：μ = {mu}，σ = {sd}。",
      n_ffn: "同一个两层网络分别作用在每个词元上：先用 W₁ 和 b₁ 扩展到 d_ff = {f} 维，再用 ReLU 把负值单元关掉（“{tok}”有 {off}/{f} 个被关掉），最后用 W₂ 和 b₂ 变回 d_model = {d} 维。",
      n_residual2: "把前馈网络的结果加回到它的输入（层归一化 1 的输出）上，这是第二个残差连接。“{tok}”的第 0 列：{x} + {a} = {r}。",
      n_norm2: "第二个层归一化给出整个块的输出；多个块叠起来时，它就是下一个块的输入。“{tok}”：μ = {mu}，σ = {sd}。",
      c_proj: "{name}[{i}, {c}]：词元“{tok}”，第 {c} 列{hc}", c_hc: "（完整矩阵的第 {g} 列）",
      c_terms: "全部 {n} 项", c_top: "{n} 项中最大的 {k} 项", c_rest: "其余 {n} 项", c_bias: "偏置",
      c_total: "合计", c_given: "直接给定（Trace.from_qkv）：没有 X 和 W 可以展开。",
      c_noweights: "x_{i} 与权重矩阵第 {c} 列的点积（这个单头轨迹没有保存权重）。",
      c_score: "S[{i}, {j}] = q_{i} · k_{j}：“{tok}”的查询，“{key}”的键", c_scaled: "S[{i}, {j}] / √d_k",
      c_hidden_causal: "被遮住：键 {j}（“{key}”）在查询 {i}（“{tok}”）之后，因果掩码把它设为 −∞。",
      c_hidden_mask: "被轨迹自带的注意力掩码遮住：−∞。", c_visible: "可见：缩放后的分数原样通过。",
      c_bias_add: "缩放后的分数 + 掩码值", c_weight: "A[{i}, {j}]：“{tok}”对“{key}”的注意力",
      c_weight_masked: "键“{key}”被遮住：exp(−∞) = 0，所以权重是 0。", c_max: "这一行的最大值",
      c_exps: "可见键的 exp(s_ij − max)", c_sum: "总和", c_all_masked: "这一行的键全被遮住：权重全为 0。",
      c_output: "O[{i}, {c}]：Σ_j A[{i}, j] · V[j, {c}]", c_concat: "拼接结果的第 {c} 列就是头 {h} 输出的第 {cc} 列。",
      c_input_model: "“{tok}”进入第 {layer} 层时的隐藏状态，第 {c} 个特征。", c_input_toy: "“{tok}”的示例输入，第 {c} 个特征。",
      c_emb: "“{tok}”的嵌入，第 {c} 个特征。",
      c_pos: "位置 {i}，第 {c} 列：{fn}({i} / 10000^({k}/{d})) = {fn}({angle})",
      c_sum2: "{a} + {b}", c_norm: "(r − μ) / σ · γ + β，其中 r = {name}[{i}, {c}]，μ、σ 来自第 {i} 行，γ、β 来自第 {c} 列",
      c_relu: "max(0, {h})", c_norm_col: "整个第 {i} 行（全部 {n} 列）的长度。",
      s_modified: "打分函数", f_modified: "打分函数", m_modified: "修改后的打分 s′",
      m_modified_nomask: "修改后的打分 s′（无掩码）",
      e_modified_softcap: "s′ = {c} · tanh(s / {c})   （softcap：每个分数都落在 (−{c}, {c}) 之内）",
      e_modified_alibi: "s′ = s + m_h · (j − i)   （ALiBi；头 {h}：m = {m}）",
      e_modified_alibi_sym: "s′ = s − m_h · |j − i|   （ALiBi；头 {h}：m = {m}）",
      e_modified_rel: "s′ = s + table[bucket(j − i), h]   （{text}）",
      e_modified_fn: "s′ = {name}(s, batch, head, q_idx, kv_idx)", e_modified_other: "s′ = score_mod(s)   （{text}）",
      e_mask_mod: "s′ + M，   查询 i 不能看到键 j 时 M[i, j] = −∞",
      n_mod_softcap: "softcap 把每个分数平滑地压进 (−{c}, {c})：远小于 {c} 的分数几乎不变，大的分数在 ±{c} 附近变平，这样没有哪个键能独占 softmax。“{tok}”的分数原来在 {lo} 到 {hi} 之间，现在在 {lo2} 到 {hi2} 之间。",
      n_mod_alibi: "ALiBi 按“斜率 × 距离”惩罚较远的键。头 {h} 的斜率 m = {m}，所以在“{tok}”之前相隔 d 个位置的键减去 m·d（在它之后的键反而加上 m·d，通常被因果掩码遮住）。这样不需要位置编码，也会偏向附近的词元。",
      n_mod_alibi_sym: "ALiBi 按“斜率 × 距离”惩罚较远的键。头 {h} 的斜率 m = {m}，所以无论在前还是在后，与“{tok}”相隔 d 个位置的键都减去 m·d。这样不需要位置编码，也会偏向附近的词元。",
      n_mod_rel: "相对位置偏置按查询与键的距离，加上一个学到的数（{text}）。“{tok}”这一行加上的数在 {lo} 到 {hi} 之间。",
      n_mod_fn: "打分函数 {name} 作用在每个缩放后的分数上（同时拿到批次、头、查询和键的编号），返回新的分数。“{tok}”这一行变化最大的是 {d}。",
      c_mod: "s′[{i}, {j}]：打分函数作用在“{tok}”与“{key}”缩放后的分数上",
      c_mod_softcap: "{c} · tanh({s} / {c}) = {c} · tanh({x})", c_mod_alibi: "{s} + {m} · ({j} − {i})",
      c_mod_alibi_sym: "{s} − {m} · |{j} − {i}|", c_mod_add: "缩放后的分数 + 函数加上的数",
      c_visible_mod: "可见：修改后的分数原样通过。",
      e_weights_sink: "A[i, j] = exp(s_ij − max_i) / (Σ_j exp(s_ij − max_i) + exp(sink_h − max_i))",
      n_weights_sink: "这个头有一个汇聚项（sink，logit {s}）：它加进分母却没有值，所以吸收了第 {i} 行 {pct}% 的注意力，这一行的和是 {sum}，而不是 1。",
      c_sink: "汇聚项", c_sink_value: "没有值", sub_score: " · 打分函数：{text}", sub_sinks: " · 汇聚项（sink）{v}",
    },
  };

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
