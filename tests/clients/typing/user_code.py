# pyright: strict
"""Typical user code: type checkers must accept every line of it (tests/test_typing.py).

Type-checked only, never run; strict mode, so every name here needs a precise type.
"""

from __future__ import annotations

import torch
from torch import Tensor

import qkv
from qkv.nn import MultiHeadAttention
from qkv.score_mods import ALiBi, Softcap


def plain(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    out: Tensor = qkv.attention(q, k, v)
    out = qkv.attention(q, q, q, is_causal=True)
    out = qkv.attention(q, k, v, mask, 0.1, False, 0.125, False)  # SDPA's positional order
    out = qkv.attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=None)
    out = qkv.attention(q, k, v, is_causal="bottom_right", backend="chunked")
    return out.transpose(1, 2)


def gqa_and_windows(q: Tensor, k: Tensor, v: Tensor, padding: Tensor) -> Tensor:
    out = qkv.attention(q, k, v, enable_gqa=True, window=(8, 0), window_alignment="bottom_right")
    out = qkv.attention(q, k, v, window=(None, 4), key_padding_mask=padding, backend="math")
    return out + qkv.attention(q, k, v, score_mod=Softcap(30.0), sinks=torch.zeros(q.shape[-3]))


def with_lse(q: Tensor, k: Tensor, v: Tensor, want_lse: bool) -> Tensor:
    out, lse = qkv.attention(q, k, v, return_lse=True)
    plain_out = qkv.attention(q, k, v, return_lse=False)
    either = qkv.attention(q, k, v, return_lse=want_lse)
    if isinstance(either, tuple):
        either = either[0]
    return out + lse.unsqueeze(-1) + plain_out + either


def custom_score(score: Tensor, batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score - (q_idx - kv_idx).abs()


def score_functions(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    alibi = ALiBi([0.5, 0.25])
    return qkv.attention(q, k, v, score_mod=alibi) + qkv.attention(q, k, v, score_mod=custom_score)


def packed(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> tuple[Tensor, Tensor]:
    out = qkv.attention_varlen(q, k, v, cu_q, cu_k, is_causal=True, window=(16, 0))
    out2, lse = qkv.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=8, return_lse=True, backend="auto")
    return out + out2, lse


def layers(x: Tensor) -> Tensor:
    mha = MultiHeadAttention(64, 8, num_kv_heads=2, score_mod=Softcap(50.0))
    y: Tensor  # torch types Module.__call__ as returning Any
    y, weights = mha(x, is_causal=True)
    z, _ = qkv.nn.MultiHeadAttention(64, 8).forward(x, window=(4, 0), backend="sdpa")
    assert weights is None
    return y + z + qkv.attention_weights(x, x, is_causal="top_left").sum()


def model() -> None:
    bert = qkv.models.load(dtype=torch.float32)
    assert isinstance(bert, torch.nn.Module)
