"""Split text into the tokens of a toy trace: words for spaced scripts, characters for CJK.

``"Thinking Machines"`` → ``["Thinking", "Machines"]``; ``"我爱机器学习"`` → six characters, as
Chinese has no spaces and BERT-style models read it one character at a time.

The splitting is BERT's, from the ``tokenizers`` library: a normaliser that puts spaces
around every CJK ideograph and drops control characters (case and accents are kept), then a
pre-tokeniser that splits on whitespace and punctuation. Punctuation therefore becomes a
token of its own (``"hi, you"`` → ``["hi", ",", "you"]``; ``"don't"`` → ``["don", "'", "t"]``):
that is how the model's own word pieces treat it, so a toy trace and a model trace of the same
text line up. Kana and Hangul runs stay whole words (BERT splits only ideographs).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

__all__ = ["split_words"]


@lru_cache(maxsize=1)
def _splitter() -> tuple[Any, Any]:
    from tokenizers import normalizers, pre_tokenizers  # imported on first use: `qkv trace` starts light

    norm = normalizers.BertNormalizer(handle_chinese_chars=True, lowercase=False, strip_accents=False, clean_text=True)
    return norm, pre_tokenizers.BertPreTokenizer()


def split_words(text: str) -> list[str]:
    """The tokens of ``text``: words, single CJK characters and single punctuation marks, in order.

    Returns an empty list for text with no visible characters; raises ``TypeError`` for a
    non-string.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}; join a list of words with ' '.join(...)")
    norm, pre = _splitter()
    return [word for word, _span in pre.pre_tokenize_str(norm.normalize_str(text))]
