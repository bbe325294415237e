"""qkv — self-attention from the equations to the metal.

- :func:`qkv.attention` — exact attention, a drop-in superset of torch's SDPA;
  :func:`qkv.attention_varlen` for packed variable-length batches; score functions
  (:mod:`qkv.score_mods`: softcapping, ALiBi, T5 relative bias, your own) and attention
  sinks (:mod:`qkv.sinks`).
- :func:`qkv.linear_attention` — linear attention (elu, relu, FAVOR+ features) in O(N);
  :mod:`qkv.sparse` — block-sparse masks (Longformer, BigBird, strided, from a dense mask).
- :func:`qkv.trace` / :class:`qkv.Trace` — the glass box (:mod:`qkv.glass`): every step, with the numbers.
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

from typing import TYPE_CHECKING

from . import glass, reference
from .glass import Trace, trace
from .reference import attention_ref

if TYPE_CHECKING:
    # What __getattr__ provides at run time, named for type checkers (which do not run it), so
    # that they see the real signatures instead of Any.
    from . import backends as backends
    from . import distributed as distributed
    from . import functional as functional
    from . import allocation as allocation
    from . import hf as hf
    from . import hooks as hooks
    from . import inspect as inspect
    from . import linear as linear
    from . import masks as masks
    from . import models as models
    from . import nn as nn
    from . import nonfinite as nonfinite
    from . import score_mods as score_mods
    from . import sinks as sinks
    from . import sparse as sparse
    from . import viz as viz
    from .backends import BackendError as BackendError
    from .functional import attention as attention
    from .functional import attention_weights as attention_weights
    from .linear import LinearAttentionState as LinearAttentionState
    from .linear import linear_attention as linear_attention
    from .varlen import attention_varlen as attention_varlen

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
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
    elif name in ("nn", "backends", "functional", "inspect", "models", "hf", "viz", "distributed", "sparse", "linear",
                  "score_mods", "sinks", "hooks", "nonfinite", "allocation", "masks"):
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
    "glass",
    "masks",
    "nn",
    "sparse",
    "score_mods",
    "sinks",
    "backends",
    "functional",
    "inspect",
    "models",
    "hf",
    "hooks",
    "nonfinite",
    "allocation",
    "viz",
    "distributed",
    "BackendError",
    "__version__",
]
