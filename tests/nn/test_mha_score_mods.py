"""qkv.nn.MultiHeadAttention with a score function and learned sinks: the same numbers as
qkv.attention on its projections, parameters registered, and decoding with a KV cache equal
to attending over the whole sequence at once (ALiBi's positions follow the cache)."""

from __future__ import annotations

import torch

import qkv
from qkv.nn import KVCache, MultiHeadAttention
from qkv.score_mods import ALiBi, Softcap, alibi_slopes


def _heads(m: MultiHeadAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, n, _ = x.shape
    split = lambda t, h: t.view(b, n, h, m.head_dim).transpose(1, 2)  # noqa: E731  (B, H, N, Dh)
    return split(m.q_proj(x), m.num_heads), split(m.k_proj(x), m.num_kv_heads), split(m.v_proj(x), m.num_kv_heads)


def test_score_mod_and_sinks_match_the_functional_call():
    torch.manual_seed(0)
    slopes = torch.nn.Parameter(alibi_slopes(4).double())
    m = MultiHeadAttention(32, 4, num_kv_heads=2, score_mod=ALiBi(slopes), sinks=True, dtype=torch.float64)
    with torch.no_grad():
        m.sinks.normal_()
    assert {"score_mod_0", "sinks"} <= {n for n, _ in m.named_parameters()}
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    out, weights = m(x, is_causal=True, need_weights=True, average_attn_weights=False)
    q, k, v = _heads(m, x)
    ref = qkv.attention_ref(q, k, v, is_causal=True, enable_gqa=True, score_mod=ALiBi(slopes.detach()), sinks=m.sinks.detach())
    heads = torch.as_tensor(ref).transpose(1, 2).reshape(2, 9, 32)
    torch.testing.assert_close(out, m.out_proj(heads))
    assert bool((weights.sum(-1) < 1).all())  # the sinks took a share of every row
    out.sum().backward()
    assert slopes.grad is not None and m.sinks.grad is not None


def test_decoding_with_a_cache_matches_the_whole_sequence():
    torch.manual_seed(1)
    m = MultiHeadAttention(16, 2, score_mod=ALiBi(alibi_slopes(2)), sinks=True)
    with torch.no_grad():
        m.sinks.fill_(0.5)
    x = torch.randn(1, 7, 16)
    full, _ = m(x, is_causal=True)
    cache = KVCache()
    steps = [m(x[:, :4], is_causal=True, cache=cache)[0]]
    steps += [m(x[:, i : i + 1], is_causal=True, cache=cache)[0] for i in range(4, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-6, rtol=1e-5)


def test_softcap_module():
    m = MultiHeadAttention(16, 2, score_mod=Softcap(1.0))
    x = torch.randn(1, 5, 16) * 10
    out, w = m(x, need_weights=True, average_attn_weights=False)
    q, k, _ = _heads(m, x)
    s = (q @ k.transpose(-1, -2) / m.head_dim**0.5).tanh()
    torch.testing.assert_close(w, torch.softmax(s, -1))
