"""Older home of the explanation: it now lives in :mod:`qkv.analysis.explain` (viz only draws)."""

from __future__ import annotations

from ..analysis.explain import (  # noqa: F401  (re-exported for older imports)
    MAX_MAP_BYTES,
    MAX_MAP_TOKENS,
    SENTENCE,
    Explanation,
    explain,
    explain_attentions,
    explain_cross_attention,
    match_word,
    zh_note,
)

__all__ = ["Explanation", "explain", "explain_attentions", "explain_cross_attention", "match_word", "zh_note",
           "SENTENCE", "MAX_MAP_TOKENS", "MAX_MAP_BYTES"]
