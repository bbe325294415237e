"""A real model's head in the glass box: one head of all-MiniLM-L6-v2 traced step by step in float64.

:func:`trace_model` runs the model up to the chosen layer to get the hidden states that really
enter it, takes that head's real W_Q, W_K, W_V columns and biases, and hands them to
:func:`qkv.glass.trace`: every matrix, printed or exported exactly like a toy trace::

    x        (N, 384)   hidden states entering layer L (word pieces, [CLS] … [SEP])
    w_q, w_k (384, 32)  head H's columns of the layer's query/key projections (d_k = 32)
    w_v      (384, 32)  head H's columns of the value projection
    b_q, b_k, b_v (32,) head H's share of the projection biases
    weights  (N, N)     equal to the model's own attention weights for that head

Layers, heads and tokens are counted from 0, as in ``qkv explain``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from .trace import Trace, trace

__all__ = ["trace_model", "resolve_model", "encode_text", "MAX_TOKENS", "BUNDLED_NAME"]

MAX_TOKENS = 64
"""Default limit on word pieces: a trace keeps and prints several N × N matrices per step."""
BUNDLED_NAME = "all-MiniLM-L6-v2"

def resolve_model(model: Union[None, str, os.PathLike, Any]) -> tuple[Any, str]:
    """(model, its name) from None (the bundled model), a directory, or a loaded model.

    Directories are read through :func:`qkv.models.load_shared`: once per process, shared with
    ``qkv explain``.
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        if not (hasattr(model, "embeddings") and hasattr(model, "encoder") and hasattr(model, "tokenizer")):
            raise TypeError(
                f"model must be None (the bundled {BUNDLED_NAME}), a model directory, or a model from "
                f"qkv.models.load(); got {type(model).__name__}"
            )
        return model, _name(getattr(model, "path", None))
    from qkv.models import default_model_dir, load_shared

    key = str(default_model_dir() if model is None else Path(model))
    if model is not None and not Path(model).is_dir():
        raise FileNotFoundError(
            f"model={str(model)!r} is not a directory; pass a BERT-style model directory holding config.json, "
            "model.safetensors and tokenizer.json, or None for the bundled model"
        )
    return load_shared(key), _name(key)


def _name(path: Optional[Union[str, os.PathLike]]) -> str:
    if path is None:
        return "model"
    try:
        from qkv.models import default_model_dir

        if Path(path).resolve() == default_model_dir().resolve():
            return BUNDLED_NAME
    except (ImportError, FileNotFoundError):
        pass
    return os.path.basename(os.path.normpath(str(path)))


def _count(value: Any, name: str, n: int, what: str, model_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int from 0 to {n - 1} ({model_name} has {n} {what}), got {value!r}")
    if not 0 <= value < n:
        raise ValueError(f"{name}={value} is out of range: {model_name} has {n} {what}, counted from 0; use 0 to {n - 1}")
    return int(value)


def encode_text(model: Any, text: str, pair: Optional[str] = None) -> tuple[list[int], list[str], list[int]]:
    """Word-piece ids, strings and segment ids of ``text`` (and ``pair``, the second text of a
    sentence pair: ``[CLS] text [SEP] pair [SEP]``), with no padding or truncation."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(model.tokenizer.to_str())  # a copy: the model's own keeps its padding settings
    tok.no_padding()
    tok.no_truncation()
    enc = tok.encode(text) if pair is None else tok.encode(text, pair)
    return list(enc.ids), list(enc.tokens), list(enc.type_ids)


def trace_model(
    text: str,
    model: Union[None, str, os.PathLike, Any] = None,
    *,
    layer: int,
    head: int,
    max_tokens: int = MAX_TOKENS,
    pair: Optional[str] = None,
) -> Trace:
    """Trace head ``head`` of layer ``layer`` of a BERT model on ``text``, in float64.

    ``model``: None for the bundled all-MiniLM-L6-v2, a BERT-style model directory, or a model
    returned by :func:`qkv.models.load`. Tokens are the model's word pieces (``[CLS]``,
    ``##ing``, ``[SEP]``). Shapes for all-MiniLM-L6-v2: ``x (N, 384)``, ``w_q, w_k, w_v
    (384, 32)``, ``b_q, b_k, b_v (32,)``; the trace's ``weights (N, N)`` equal the model's own
    weights for that head (up to float32 rounding of the hidden states). ``meta`` records the
    model, layer and head. ``pair``: a second text, traced as the sentence pair the model reads
    (``[CLS] text [SEP] pair [SEP]`` with its segment ids). Raises ValueError naming ``layer``,
    ``head``, ``text``, ``pair`` or ``max_tokens`` when one is out of range.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError('text is empty; pass a sentence, e.g. trace_model("Alice said she would come", layer=1, head=3)')
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be a positive int (default {MAX_TOKENS})")
    import torch

    m, name = resolve_model(model)
    cfg = m.config
    layer = _count(layer, "layer", cfg.num_hidden_layers, "layers", name)
    head = _count(head, "head", cfg.num_attention_heads, "heads per layer", name)
    if pair is not None and (not isinstance(pair, str) or not pair.strip()):
        raise ValueError(f"pair={pair!r} must be a non-empty string (the second text of a sentence pair) or None")
    ids, tokens, types = encode_text(m, text, pair)
    limit = min(int(max_tokens), int(cfg.max_position_embeddings))
    if len(ids) > limit:
        why = (f"max_tokens={max_tokens}: every step keeps N × N matrices to print; shorten the text or raise max_tokens"
               if limit == max_tokens else f"the model reads at most {limit}")
        raise ValueError(f"text has {len(ids)} word pieces (with [CLS] and [SEP]) but the limit is {limit} ({why})")

    attn = m.encoder.layers[layer].self_attn
    for arg, what in (("score_mod", "a score function"), ("sinks", "attention sinks")):
        # the trace computes softmax(q·kᵀ·scale): it would show other weights than the model's
        if getattr(attn, arg, None) is not None:
            raise NotImplementedError(
                f"layer {layer}'s attention has {what} ({arg}=), which the glass-box trace does not model; "
                "use qkv.inspect.attention_map for its exact weights"
            )
    d_model = int(attn.d_model)
    dh = int(attn.head_dim)
    kv = head // (attn.num_heads // attn.num_kv_heads)  # the key/value head this query head reads
    input_ids = torch.tensor([ids], dtype=torch.long, device=m.device)  # (1, N)
    with torch.inference_mode():
        segments = torch.tensor([types], dtype=torch.long, device=m.device) if pair is not None else None  # (1, N)
        out = m(input_ids, torch.ones_like(input_ids), segments, output_hidden_states=True)
    x = out.hidden_states[layer][0].double().cpu().numpy()  # (N, d_model): what enters layer `layer`

    def columns(linear: Any, h: int) -> tuple[np.ndarray, Optional[np.ndarray]]:
        w = linear.weight.detach().double().cpu().numpy()  # (out, in): nn.Linear computes x·Wᵀ
        cols = w[h * dh : (h + 1) * dh].T  # (d_model, dh): this head's columns of x·W
        b = None if linear.bias is None else linear.bias.detach().double().cpu().numpy()[h * dh : (h + 1) * dh]
        return cols, b

    w_q, b_q = columns(attn.q_proj, head)
    w_k, b_k = columns(attn.k_proj, kv)
    w_v, b_v = columns(attn.v_proj, kv)
    meta = {"model": name, "layer": layer, "head": head, "source": "model", "d_model": d_model}
    return trace(x, w_q, w_k, w_v, b_q=b_q, b_k=b_k, b_v=b_v, tokens=tokens, meta=meta)
