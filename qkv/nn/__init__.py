"""Attention modules: multi-head attention, Transformer layers, positional encodings, KV cache.

All modules are batch-first ``(B, N, d_model)`` and use qkv mask conventions: boolean masks
are True where a query **may attend** (key padding masks included).
"""

from .attention import MultiHeadAttention
from .cache import KVCache
from .linear_attention import LinearAttention
from .positional import RotaryEmbedding, SinusoidalPositionalEncoding, sinusoidal_table
from .transformer import (
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "MultiHeadAttention",
    "KVCache",
    "LinearAttention",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "sinusoidal_table",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]
