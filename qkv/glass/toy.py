"""Small seeded numbers for the glass box: toy embeddings and weights a learner can follow by hand.

Everything is rounded to one decimal. Embeddings depend only on ``(seed, word)``, so a repeated
word gets the same row, as with a real embedding table.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import numpy as np

from .tokens import split_words
from .trace import Trace, trace

__all__ = ["SENTENCE", "toy_embeddings", "toy_weights", "sentence_trace", "worked_example"]

SENTENCE = "Thinking Machines"
"""The tutorials' two-word sentence, the toy traces' default text."""


def toy_embeddings(tokens: Sequence[str], d_model: int, seed: int = 0) -> np.ndarray:
    """One row of ``d_model`` numbers per token, from ``(seed, token)`` alone. Shape (N, d_model)."""
    return np.stack(
        [np.random.default_rng([seed, zlib.crc32(w.encode("utf-8"))]).normal(size=d_model) for w in tokens]
    ).round(1)


def toy_weights(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """A (rows, cols) weight matrix, N(0, 0.7²) rounded to one decimal."""
    return rng.normal(scale=0.7, size=(rows, cols)).round(1)


def sentence_trace(
    sentence: str = SENTENCE,
    *,
    d_model: int = 4,
    d_k: int = 3,
    heads: int = 1,
    causal: bool = False,
    seed: int = 0,
    score_mod: Any = None,
    sinks: Any = None,
) -> Trace:
    """Trace self-attention on a sentence with small seeded random numbers.

    Tokens come from :func:`qkv.glass.tokens.split_words`: words, each CJK character on its
    own ("我爱机器学习" gives six tokens), and each punctuation mark on its own.

    Embeddings come from ``(seed, word)`` alone, so a repeated word gets the same row, as with a
    real embedding table. Weights come from ``seed``. Everything is rounded to one decimal so the
    arithmetic can be followed by hand. Shapes: ``x (N, d_model)``, ``W_Q, W_K, W_V
    (d_model, heads·d_k)``, and ``W_O (heads·d_k, d_model)`` when ``heads > 1``. ``score_mod``
    and ``sinks`` are passed on to :func:`~qkv.glass.trace.trace`.
    """
    if not isinstance(sentence, str):
        raise TypeError(f"sentence must be a string, got {type(sentence).__name__}")
    tokens = split_words(sentence)
    if not tokens:
        raise ValueError('the sentence is empty; pass some words, e.g. qkv trace "Thinking Machines" or "我爱机器学习"')
    x = toy_embeddings(tokens, d_model, seed)  # (N, d_model)
    rng = np.random.default_rng(seed)
    width = heads * d_k
    w_q, w_k, w_v = (toy_weights(rng, d_model, width) for _ in range(3))
    w_o = toy_weights(rng, width, d_model) if heads > 1 else None
    return trace(x, w_q, w_k, w_v, w_o=w_o, num_heads=heads, is_causal=causal, tokens=tokens, score_mod=score_mod,
                 sinks=sinks)


def worked_example() -> Trace:
    """The tutorials' numbers: two tokens, d_k = 64, q₁·k₁ = 112 and q₁·k₂ = 96.

    With q₁ all ones, keys filled with 1.75 and 1.5 give exactly those dot products; the values
    are the unit vectors, so each output row reads back as that row's weights.
    """
    d_k = 64
    q = np.stack([np.ones(d_k), np.full(d_k, 0.5)])  # (2, 64)
    k = np.stack([np.full(d_k, 1.75), np.full(d_k, 1.5)])  # (2, 64): 64·1.75 = 112, 64·1.5 = 96
    v = np.eye(2)  # (2, 2)
    return Trace.from_qkv(q, k, v, tokens=["Thinking", "Machines"])
