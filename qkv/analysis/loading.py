"""The model behind an analysis: the bundled all-MiniLM-L6-v2, a BERT directory, or any local
Hugging Face checkpoint, each loaded once per process through :func:`qkv.models.load_shared`."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["load_model"]


def load_model(path: Optional[str] = None) -> Any:
    """The model in directory ``path`` (None or "": the bundled all-MiniLM-L6-v2).

    BERT checkpoints are rebuilt natively by :func:`qkv.models.load`; other architectures
    (GPT-2, LLaMA, Mistral, Qwen2, …) run through transformers on qkv's attention
    (:func:`qkv.analysis.hf_model.load_hf`). The cache is :mod:`qkv.models`'s one cache.
    """
    try:
        from qkv.models import load_shared
    except ImportError as e:
        raise RuntimeError(f"cannot load the pretrained model: qkv.models is not available ({e})") from e
    if path:
        from .hf_model import is_bert_directory, load_hf

        if not is_bert_directory(path):
            return load_shared(path, build=load_hf)
    return load_shared(path or None)
