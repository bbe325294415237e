"""Wrong calls: type checkers must report an error on each line whose comment starts with "error:"
(tests/test_typing.py matches them by line number). Type-checked only, never run."""

from __future__ import annotations

from torch import Tensor

import qkv


def wrong(q: Tensor, cu: Tensor) -> object:
    qkv.attention(q, q, q, windw=(8, 0))  # error: misspelt keyword
    qkv.attention(q, q, q, backend="fast")  # error: unknown backend
    # a Tensor is iterable, so `out, lse = qkv.attention(q, q, q)` cannot be caught; a typed target can
    pair: tuple[Tensor, Tensor] = qkv.attention(q, q, q)  # error: a plain call returns a Tensor
    qkv.attention(q, q, q, is_causal="top_right")  # error: unknown alignment
    qkv.attention(q, q, q, window_alignment="center")  # error: unknown alignment
    qkv.attention_varlen(q, q, q, cu, cu, backend="flash")  # error: unknown backend
    qkv.nn.MultiHeadAttention(64, 8).forward(q, backend="fast")  # error: unknown backend
    return pair
