"""Older home of the Hugging Face checkpoint wrapper: it now lives in :mod:`qkv.analysis.hf_model`."""

from __future__ import annotations

from ..analysis.hf_model import HFExplainModel, is_bert_directory, load_hf  # noqa: F401

__all__ = ["HFExplainModel", "load_hf", "is_bert_directory"]
