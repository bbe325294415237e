"""MultiHeadAttention and KVCache against independent computations and torch.nn.MultiheadAttention."""

import pytest
import torch

from qkv.nn import KVCache, MultiHeadAttention, RotaryEmbedding

f64 = torch.float64


def ref_mha(m, query, key=None, value=None, allowed=None, bias=None, rotary=None):
    """Multi-head attention written out with plain torch ops, float64, K/V heads repeated.

    ``allowed`` (bool, True = attend) and ``bias`` (float) broadcast to (B, H, Nq, Nk).
    Returns (out (B, Nq, E), weights (B, H, Nq, Nk)).
    """
    key = query if key is None else key
    value = key if value is None else value
    b, nq, _ = query.shape
    nk = key.shape[1]
    h, hk, dh = m.num_heads, m.num_kv_heads, m.head_dim

    def lin(x, layer):
        y = x @ layer.weight.T
        return y if layer.bias is None else y + layer.bias

    q = lin(query, m.q_proj).reshape(b, nq, h, dh).permute(0, 2, 1, 3)
    k = lin(key, m.k_proj).reshape(b, nk, hk, dh).permute(0, 2, 1, 3)
    v = lin(value, m.v_proj).reshape(b, nk, hk, dh).permute(0, 2, 1, 3)
    if rotary is not None:
        q, k = rotary.rotate(q), rotary.rotate(k)
    k = k.repeat_interleave(h // hk, dim=1)
    v = v.repeat_interleave(h // hk, dim=1)
    s = q @ k.transpose(-1, -2) / dh**0.5
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)  # empty rows -> 0
    o = (w @ v).permute(0, 2, 1, 3).reshape(b, nq, h * dh)
    return lin(o, m.out_proj), w


def causal(nq, nk, offset=0):
    return torch.ones(nq, nk, dtype=torch.bool).tril(offset)


def make(d_model=24, heads=4, kv=None, **kw):
    return MultiHeadAttention(d_model, heads, num_kv_heads=kv, dtype=f64, **kw).eval()


# ------------------------------------------------------------------------- basic correctness
@pytest.mark.parametrize("heads,kv", [(4, None), (4, 2), (6, 1), (1, 1)])
@pytest.mark.parametrize("n", [1, 13])
def test_self_attention_matches_reference(heads, kv, n):
    m = make(24, heads, kv)
    x = torch.randn(3, n, 24, dtype=f64)
    out, w = m(x)
    assert w is None
    want, _ = ref_mha(m, x)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


def test_gqa_projection_widths():
    m = MultiHeadAttention(32, 8, num_kv_heads=2)
    assert m.head_dim == 4
    assert m.q_proj.out_features == 32
    assert m.k_proj.out_features == m.v_proj.out_features == 2 * 4
    mqa = MultiHeadAttention(32, 8, num_kv_heads=1)
    assert mqa.k_proj.out_features == 4


@pytest.mark.parametrize("kv", [None, 3])
def test_cross_attention_kdim_vdim_different_lengths(kv):
    m = MultiHeadAttention(18, 6, num_kv_heads=kv, kdim=5, vdim=11, dtype=f64)
    q = torch.randn(2, 7, 18, dtype=f64)
    k = torch.randn(2, 19, 5, dtype=f64)
    v = torch.randn(2, 19, 11, dtype=f64)
    out, w = m(q, k, v, need_weights=True)
    want, want_w = ref_mha(m, q, k, v)
    assert out.shape == (2, 7, 18) and w.shape == (2, 7, 19)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, want_w.mean(1), rtol=1e-10, atol=1e-12)


def test_value_defaults_to_key():
    m = make()
    q, mem = torch.randn(2, 3, 24, dtype=f64), torch.randn(2, 8, 24, dtype=f64)
    torch.testing.assert_close(m(q, mem)[0], m(q, mem, mem)[0])


# ------------------------------------------------------------------------------- masks
@pytest.mark.parametrize("kv", [None, 2])
def test_attn_mask_shapes_and_kinds(kv):
    b, h, nq, nk = 2, 4, 5, 9
    m = make(24, h, kv)
    q, k = torch.randn(b, nq, 24, dtype=f64), torch.randn(b, nk, 24, dtype=f64)
    allowed = torch.rand(b, h, nq, nk) > 0.3
    allowed[..., 0] = True
    bias = torch.randn(b, h, nq, nk, dtype=f64)
    for mask2d in (allowed[0, 0], bias[0, 0]):
        want = ref_mha(m, q, k, allowed=mask2d if mask2d.dtype == torch.bool else None,
                       bias=None if mask2d.dtype == torch.bool else mask2d)[0]
        torch.testing.assert_close(m(q, k, attn_mask=mask2d)[0], want, rtol=1e-10, atol=1e-12)
    want3 = ref_mha(m, q, k, allowed=allowed[:, :1])[0]
    torch.testing.assert_close(m(q, k, attn_mask=allowed[:, 0])[0], want3, rtol=1e-10, atol=1e-12)
    want4 = ref_mha(m, q, k, allowed=allowed)[0]
    torch.testing.assert_close(m(q, k, attn_mask=allowed)[0], want4, rtol=1e-10, atol=1e-12)
    want_b = ref_mha(m, q, k, bias=bias)[0]
    torch.testing.assert_close(m(q, k, attn_mask=bias)[0], want_b, rtol=1e-10, atol=1e-12)


def test_causal_window_and_key_padding():
    m = make(24, 4, 2)
    x = torch.randn(3, 11, 24, dtype=f64)
    kpm = torch.rand(3, 11) > 0.3
    kpm[:, 0] = True
    allowed = causal(11, 11) & ~causal(11, 11, -4) & kpm[:, None, None, :]  # causal, 3 keys back
    out = m(x, is_causal=True, window=(3, 0), key_padding_mask=kpm)[0]
    torch.testing.assert_close(out, ref_mha(m, x, allowed=allowed)[0], rtol=1e-10, atol=1e-12)


def test_padding_keys_do_not_matter():
    m = make()
    x = torch.randn(2, 10, 24, dtype=f64)
    kpm = torch.ones(2, 10, dtype=torch.bool)
    kpm[:, 7:] = False
    out1 = m(x, key_padding_mask=kpm)[0]
    x2 = x.clone()
    x2[:, 7:] = torch.randn(2, 3, 24, dtype=f64) * 10
    out2 = m(x2, key_padding_mask=kpm)[0]
    torch.testing.assert_close(out1[:, :7], out2[:, :7], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out1[:, :7], m(x[:, :7])[0], rtol=1e-10, atol=1e-12)


def test_fully_masked_row_gives_bias_only_and_no_nan():
    m = make()
    x = torch.randn(2, 4, 24, dtype=f64)
    allowed = torch.ones(4, 4, dtype=torch.bool)
    allowed[2] = False
    out, w = m(x, attn_mask=allowed, need_weights=True)
    assert not out.isnan().any() and not w.isnan().any()
    torch.testing.assert_close(out[:, 2], m.out_proj.bias.expand(2, 24))
    assert (w[:, 2] == 0).all()
    torch.testing.assert_close(m(x, attn_mask=allowed)[0], out)


# -------------------------------------------------------------------------- need_weights
@pytest.mark.parametrize("kv", [None, 2, 1])
def test_need_weights_per_head_and_averaged(kv):
    m = make(24, 4, kv)
    x = torch.randn(2, 6, 24, dtype=f64)
    out, w = m(x, need_weights=True, average_attn_weights=False, is_causal=True)
    _, w_avg = m(x, need_weights=True, is_causal=True)
    want, want_w = ref_mha(m, x, allowed=causal(6, 6))
    assert w.shape == (2, 4, 6, 6) and w_avg.shape == (2, 6, 6)
    torch.testing.assert_close(w, want_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w_avg, want_w.mean(1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out, m(x, is_causal=True)[0], rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------- torch parity
def torch_pair(batch_first, bias=True, kdim=None, vdim=None, e=20, h=4):
    t = torch.nn.MultiheadAttention(e, h, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first, dtype=f64)
    t.eval()
    return t, MultiHeadAttention.from_torch(t)


def run_torch(t, q, k, v, **kw):
    if not t.batch_first:
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    out, w = t(q, k, v, **kw)
    return (out if t.batch_first else out.transpose(0, 1)), w


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("average", [True, False])
def test_parity_with_torch_self_attention(batch_first, average):
    t, m = torch_pair(batch_first)
    x = torch.randn(3, 8, 20, dtype=f64)
    want, want_w = run_torch(t, x, x, x, need_weights=True, average_attn_weights=average)
    out, w = m(x, need_weights=True, average_attn_weights=average)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False])
def test_parity_with_torch_causal_and_key_padding(batch_first):
    t, m = torch_pair(batch_first)
    x = torch.randn(3, 9, 20, dtype=f64)
    ignore = torch.zeros(3, 9, dtype=torch.bool)  # torch convention: True = ignore
    ignore[0, 6:] = True
    ignore[2, 2:4] = True
    torch_causal = torch.ones(9, 9, dtype=torch.bool).triu(1)  # True = masked out
    want, want_w = run_torch(t, x, x, x, attn_mask=torch_causal, key_padding_mask=ignore, need_weights=True)
    out, w = m(x, is_causal=True, key_padding_mask=~ignore, need_weights=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=1e-10, atol=1e-12)
    out2, _ = m(x, attn_mask=~torch_causal, key_padding_mask=~ignore)
    torch.testing.assert_close(out2, want, rtol=1e-10, atol=1e-12)


def test_parity_with_torch_float_mask_3d():
    t, m = torch_pair(True, h=5)
    q, k = torch.randn(2, 4, 20, dtype=f64), torch.randn(2, 6, 20, dtype=f64)
    bias = torch.randn(2 * 5, 4, 6, dtype=f64)  # torch: (B·H, Nq, Nk)
    want, _ = run_torch(t, q, k, k, attn_mask=bias)
    out, _ = m(q, k, k, attn_mask=bias.view(2, 5, 4, 6))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_parity_with_torch_cross_attention_kdim_vdim(batch_first, bias):
    t, m = torch_pair(batch_first, bias=bias, kdim=7, vdim=13)
    assert t.in_proj_weight is None  # the separate q/k/v weights path
    q = torch.randn(2, 5, 20, dtype=f64)
    k, v = torch.randn(2, 11, 7, dtype=f64), torch.randn(2, 11, 13, dtype=f64)
    ignore = torch.zeros(2, 11, dtype=torch.bool)
    ignore[1, 8:] = True
    want, want_w = run_torch(t, q, k, v, key_padding_mask=ignore, need_weights=True)
    out, w = m(q, k, v, key_padding_mask=~ignore, need_weights=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=1e-10, atol=1e-12)


def test_from_torch_copies_config_and_rejects_unsupported():
    t = torch.nn.MultiheadAttention(16, 2, dropout=0.25)
    m = MultiHeadAttention.from_torch(t)
    assert (m.d_model, m.num_heads, m.dropout, m.training) == (16, 2, 0.25, True)
    assert m.q_proj.weight.data_ptr() != t.in_proj_weight.data_ptr()  # a copy, not a view
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(16, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(16, 2, add_zero_attn=True))


# ----------------------------------------------------------------------- incremental decoding
def decode_stepwise(m, x, chunks, cache, rotary=None):
    outs, start = [], 0
    for size in chunks:
        outs.append(m(x[:, start : start + size], is_causal=True, cache=cache, rotary=rotary)[0])
        start += size
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("heads,kv", [(4, None), (4, 2), (4, 1)])
@pytest.mark.parametrize("use_rotary", [False, True])
@pytest.mark.parametrize("max_len", [None, 40])
def test_cached_decoding_equals_full_causal(heads, kv, use_rotary, max_len):
    m = make(24, heads, kv)
    rotary = RotaryEmbedding(m.head_dim) if use_rotary else None
    x = torch.randn(2, 21, 24, dtype=f64)
    full = m(x, is_causal=True, rotary=rotary)[0]
    want = ref_mha(m, x, allowed=causal(21, 21), rotary=rotary)[0]
    torch.testing.assert_close(full, want, rtol=1e-10, atol=1e-12)
    cache = KVCache(max_len)
    chunks = [4] + [1] * 12 + [3, 2]  # a prompt, single tokens (past the 16-slot growth), chunks
    got = decode_stepwise(m, x, chunks, cache, rotary)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)
    assert cache.length == len(cache) == 21
    assert cache.keys.shape == (2, kv or heads, 21, m.head_dim)


def test_cached_decoding_with_sliding_window():
    m = make(24, 4, 2)
    x = torch.randn(2, 15, 24, dtype=f64)
    full = m(x, is_causal=True, window=(4, 0))[0]
    allowed = causal(15, 15) & ~causal(15, 15, -5)
    torch.testing.assert_close(full, ref_mha(m, x, allowed=allowed)[0], rtol=1e-10, atol=1e-12)
    cache = KVCache()
    outs, start = [], 0
    for size in [6, 1, 1, 3, 1, 1, 2]:
        outs.append(m(x[:, start : start + size], is_causal=True, window=(4, 0), cache=cache)[0])
        start += size
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-12)


def test_cached_decoding_with_key_padding():
    """Left-padded prompts: the padding mask lives in the cache and hides pads forever after."""
    m = make(24, 4, 2)
    b, n = 3, 12
    x = torch.randn(b, n, 24, dtype=f64)
    kpm = torch.ones(b, n, dtype=torch.bool)
    kpm[0, :3] = False
    kpm[1, :1] = False
    allowed = causal(n, n) & kpm[:, None, None, :]
    want = ref_mha(m, x, allowed=allowed)[0]
    torch.testing.assert_close(m(x, is_causal=True, key_padding_mask=kpm)[0], want, rtol=1e-10, atol=1e-12)
    valid = kpm[:, :, None]  # rows of padding queries attend to nothing useful; compare real ones

    # masks for the new positions only
    cache = KVCache()
    outs = [m(x[:, :5], is_causal=True, cache=cache, key_padding_mask=kpm[:, :5])[0]]
    for t in range(5, n):
        outs.append(m(x[:, t : t + 1], is_causal=True, cache=cache)[0])
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got * valid, want * valid, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cache.key_padding_mask, kpm)

    # the full-length mask at every step
    cache.reset()
    outs = [m(x[:, t : t + 1], is_causal=True, cache=cache, key_padding_mask=kpm[:, : t + 1])[0] for t in range(n)]
    torch.testing.assert_close(torch.cat(outs, 1) * valid, want * valid, rtol=1e-10, atol=1e-12)


def test_cached_decoding_with_attn_mask_over_all_keys():
    m = make()
    x = torch.randn(2, 6, 24, dtype=f64)
    bias = torch.randn(6, 6, dtype=f64)
    full = m(x, attn_mask=bias, is_causal=True)[0]
    cache = KVCache()
    outs = [m(x[:, t : t + 1], cache=cache, is_causal=True, attn_mask=bias[t : t + 1, : t + 1])[0] for t in range(6)]
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-12)


def test_cached_decoding_keeps_gradients():
    """Under autograd the cache must not overwrite tensors that earlier steps saved."""
    m = make(24, 4, 2)
    x = torch.randn(2, 7, 24, dtype=f64)
    full = m(x, is_causal=True)[0]
    g_full = torch.autograd.grad(full.square().sum(), m.k_proj.weight)[0]
    got = decode_stepwise(m, x, [3, 1, 1, 2], KVCache(max_len=16))
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)
    g_step = torch.autograd.grad(got.square().sum(), m.k_proj.weight)[0]
    torch.testing.assert_close(g_step, g_full, rtol=1e-9, atol=1e-11)


def test_kv_cache_bookkeeping():
    cache = KVCache(max_len=5)
    assert cache.length == 0 and cache.keys is None and "length=0" in repr(cache)
    k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 6)
    keys, values, mask = cache.update(k, v)
    assert mask is None and keys.shape == (2, 3, 4, 8) and values.shape == (2, 3, 4, 6)
    with pytest.raises(ValueError, match="max_len=5"):
        cache.update(k[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match="reset"):
        cache.update(k[:1, :, :1], v[:1, :, :1])
    cache.update(k[:, :, :1], v[:, :, :1], torch.tensor([[True], [False]]))
    torch.testing.assert_close(cache.key_padding_mask, torch.tensor([[True] * 5, [True] * 4 + [False]]))
    cache.reorder(torch.tensor([1, 1]))
    torch.testing.assert_close(cache.keys[0], torch.cat((k[1], k[1, :, :1]), 1))
    assert cache.key_padding_mask[:, -1].tolist() == [False, False]
    cache.reset()
    assert cache.length == 0 and cache.key_padding_mask is None
    keys, _, _ = cache.update(k[:1], v[:1])  # a different batch after reset is fine
    torch.testing.assert_close(keys, k[:1])
    with pytest.raises(TypeError, match="bool"):
        cache.update(k[:1, :, :1], v[:1, :, :1], torch.ones(1, 1))


def test_kv_cache_grows_without_max_len():
    cache = KVCache()
    ks = torch.randn(1, 2, 50, 4)
    for t in range(50):
        keys, values, _ = cache.update(ks[:, :, t : t + 1], ks[:, :, t : t + 1])
    torch.testing.assert_close(keys, ks)
    assert cache.capacity >= 50 and cache.capacity < 128


# ------------------------------------------------------------------------------ rotary
def test_rotary_in_module_matches_manual_rotation():
    m = make(32, 4, 2)
    rotary = RotaryEmbedding(8)
    x = torch.randn(2, 9, 32, dtype=f64)
    out = m(x, rotary=rotary)[0]
    torch.testing.assert_close(out, ref_mha(m, x, rotary=rotary)[0], rtol=1e-10, atol=1e-12)
    # explicit positions equal to the default change nothing; shifting all of them changes nothing either
    torch.testing.assert_close(m(x, rotary=rotary, positions=torch.arange(9))[0], out)
    torch.testing.assert_close(m(x, rotary=rotary, positions=torch.arange(9) + 50)[0], out, rtol=1e-9, atol=1e-11)


# ------------------------------------------------------------------------- misc behaviour
@pytest.mark.parametrize("backend", ["math", "chunked"])
def test_backend_is_passed_through(backend):
    m = make(24, 4, 2)
    x = torch.randn(2, 10, 24, dtype=f64)
    kpm = torch.rand(2, 10) > 0.2
    want = m(x, is_causal=True, key_padding_mask=kpm)[0]
    got = m(x, is_causal=True, key_padding_mask=kpm, backend=backend)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_dropout_only_in_training():
    m = MultiHeadAttention(16, 2, dropout=0.5)
    x = torch.randn(2, 12, 16)
    m.eval()
    torch.testing.assert_close(m(x)[0], m(x)[0])
    m.train()
    a, b = m(x)[0], m(x)[0]
    assert not torch.allclose(a, b)
    _, w = m(x, need_weights=True)  # returned weights are the probabilities before dropout
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 12))


def test_gradients_reach_every_parameter():
    m = MultiHeadAttention(16, 4, num_kv_heads=2, kdim=6, vdim=10)
    q, k, v = torch.randn(2, 3, 16), torch.randn(2, 5, 6), torch.randn(2, 5, 10)
    m(q, k, v)[0].sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_close_to_float64(dtype):
    m = make(32, 4, 2)
    x = torch.randn(2, 17, 32, dtype=f64)
    want = m(x, is_causal=True)[0]
    m_lo = make(32, 4, 2).to(dtype)
    m_lo.load_state_dict(m.state_dict())
    got = m_lo(x.to(dtype), is_causal=True)[0]
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------ errors
def test_constructor_errors():
    with pytest.raises(ValueError, match=r"d_model=10 is not divisible by num_heads=3.*\[1, 2, 5, 10\]"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match=r"num_heads=6 is not a multiple of num_kv_heads=4.*\[1, 2, 3, 6\]"):
        MultiHeadAttention(12, 6, num_kv_heads=4)


def test_forward_errors():
    m = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"query has last dimension 12 .*d_model=16"):
        m(torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match=r"query must be 3-D .*unsqueeze\(0\)"):
        m(torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"key must be 3-D"):
        m(x, torch.randn(2, 2, 3, 16))
    with pytest.raises(ValueError, match=r"batch sizes differ: query 2, key 3"):
        m(x, torch.randn(3, 5, 16))
    with pytest.raises(ValueError, match=r"key has 5 positions but value has 4"):
        m(x, x, torch.randn(2, 4, 16))
    with pytest.raises(ValueError, match="value was given without key"):
        m(x, value=x)
    with pytest.raises(TypeError, match=r"~mask"):
        m(x, key_padding_mask=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 4\)"):
        m(x, key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask has shape \(8, 5, 5\).*\(B, H, Nq, Nk\)"):
        m(x, attn_mask=torch.ones(8, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="kdim"):
        MultiHeadAttention(16, 4, kdim=8)(x)
    with pytest.raises(ValueError, match="rotary"):
        m(x, positions=torch.arange(5))


def test_bad_call_leaves_cache_untouched():
    m = make()
    cache = KVCache()
    x = torch.randn(2, 3, 24, dtype=f64)
    m(x, cache=cache, is_causal=True)
    with pytest.raises(ValueError, match="attn_mask"):
        m(x[:, :1], cache=cache, attn_mask=torch.ones(1, 1, dtype=torch.bool))  # must span 4 keys
    with pytest.raises(ValueError, match=r"\(2, 1\) for the new keys or \(2, 4\)"):
        m(x[:, :1], cache=cache, key_padding_mask=torch.ones(2, 3, dtype=torch.bool))
    assert cache.length == 3 and cache.key_padding_mask is None
