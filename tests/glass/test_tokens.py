"""split_words: words for spaced scripts, one token per CJK character, punctuation on its own."""

from __future__ import annotations

import pytest

from qkv.glass.tokens import split_words
from qkv.glass.toy import sentence_trace


def test_chinese_is_split_into_characters():
    assert split_words("我爱机器学习") == ["我", "爱", "机", "器", "学", "习"]


def test_spaced_words_stay_whole_with_their_case():
    assert split_words("Thinking Machines") == ["Thinking", "Machines"]
    assert split_words("  the   cat\tsat\n") == ["the", "cat", "sat"]


def test_mixed_text_and_punctuation():
    assert split_words("我爱 machine learning！") == ["我", "爱", "machine", "learning", "！"]
    assert split_words("hi, you.") == ["hi", ",", "you", "."]
    assert split_words("café") == ["café"]  # accents are kept


def test_empty_and_wrong_types():
    assert split_words("") == [] and split_words(" \n ") == []
    with pytest.raises(TypeError, match="text must be a string"):
        split_words(["a", "b"])  # type: ignore[arg-type]


def test_sentence_trace_uses_split_words():
    t = sentence_trace("我爱机器学习")
    assert t.tokens == ["我", "爱", "机", "器", "学", "习"] and t.x.shape == (6, 4)
    assert sentence_trace("Thinking Machines").tokens == ["Thinking", "Machines"]
    with pytest.raises(ValueError, match="the sentence is empty"):
        sentence_trace(" ")
