"""qkv — self-attention from the equations to the metal.

- :func:`qkv.attention` — exact attention, a drop-in superset of torch's SDPA;
  :func:`qkv.attention_varlen` for packed variable-length batches; score functions
  (:mod:`qkv.score_mods`: softcapping, ALiBi, T5 relative bias, your own) and attention
  sinks (:mod:`qkv.sinks`).
- :func:`qkv.linear_attention` — linear attention (elu, relu, FAVOR+ features) in O(N);
  :mod:`qkv.sparse` — block-sparse masks (Longformer, BigBird, strided, from a dense mask).
- :func:`qkv.trace` / :class:`qkv.Trace` — the glass box: every step, with the numbers.
- :mod:`qkv.nn` — multi-head attention, Transformer layers, positional encodings, KV cache.
- :mod:`qkv.inspect` — attention maps and streaming statistics without the N×N matrix.
- :mod:`qkv.models` — a real pretrained BERT (all-MiniLM-L6-v2) rebuilt on :mod:`qkv.nn`.
- :mod:`qkv.hf` — qkv as an attention implementation inside Hugging Face ``transformers``.
- :mod:`qkv.viz` — heatmaps and the offline interactive HTML report.
- :mod:`qkv.distributed` — context parallelism: ring and Ulysses attention over a sequence
  sharded across the ranks of a ``torch.distributed`` group.
- :mod:`qkv.reference` — the NumPy float64 oracle.
"""

from __future__ import annotations

from . import reference
from .reference import Trace, attention_ref, trace

__version__ = "0.1.0"


def __getattr__(name: str):
    # torch-backed parts load on first use, so `qkv trace` starts without importing torch.
    if name in ("attention", "attention_weights"):
        from . import functional

        value = getattr(functional, name)
    elif name in ("linear_attention", "LinearAttentionState"):
        from . import linear

        value = getattr(linear, name)
    elif name == "attention_varlen":
        from .varlen import attention_varlen

        value = attention_varlen
    elif name in ("nn", "backends", "functional", "inspect", "models", "hf", "viz", "distributed", "sparse", "linear", "score_mods", "sinks"):
        import importlib

        value = importlib.import_module(f".{name}", __name__)
    elif name == "BackendError":
        from .backends import BackendError

        value = BackendError
    else:
        raise AttributeError(f"module 'qkv' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


__all__ = [
    "attention",
    "attention_weights",
    "attention_varlen",
    "linear_attention",
    "LinearAttentionState",
    "attention_ref",
    "trace",
    "Trace",
    "reference",
    "nn",
    "sparse",
    "score_mods",
    "sinks",
    "backends",
    "functional",
    "inspect",
    "models",
    "hf",
    "viz",
    "distributed",
    "BackendError",
    "__version__",
]
