"""Analysis: what runs a pretrained model and measures its heads; :mod:`qkv.viz` draws the results.

- :mod:`~qkv.analysis.explain`: :func:`explain` (where one token's attention goes in every head),
  :func:`explain_attentions` (the same from maps you already have), :func:`explain_cross_attention`;
  the result, :class:`Explanation`, prints itself (``to_string``, ``to_dict``).
- :mod:`~qkv.analysis.compare`: :func:`compare` two texts head by head (:class:`Comparison`).
- :mod:`~qkv.analysis.ablation`: :func:`ablation_effect` of knocking out heads (:class:`Ablation`).
- :mod:`~qkv.analysis.loading`: :func:`load_model`, the bundled model, a BERT directory or any local
  Hugging Face checkpoint (:mod:`~qkv.analysis.hf_model`), each read once per process.

Importing this package needs neither torch nor transformers (each is imported when first used).
"""

from __future__ import annotations

from .ablation import Ablation, ablation_effect, check_heads, final_states, parse_head
from .compare import Comparison, align_tokens, compare
from .explain import Explanation, explain, explain_attentions, explain_cross_attention, match_word
from .loading import load_model

__all__ = [
    "Explanation", "explain", "explain_attentions", "explain_cross_attention", "match_word",
    "Comparison", "compare", "align_tokens",
    "Ablation", "ablation_effect", "parse_head", "check_heads", "final_states",
    "load_model",
]
