"""qkv as a Hugging Face ``transformers`` attention implementation.

>>> import qkv.hf
>>> qkv.hf.register()                                   # once per process
>>> model = AutoModel.from_config(cfg, attn_implementation="qkv")
>>> with qkv.hf.observe(lambda call: print(call)):      # see every attention call
...     model(**inputs)

Shape legend::

    B batch   H query heads   Hk key/value heads   Nq queries   Nk keys   D head dim

``register()`` adds ``"qkv"`` to transformers' ``AttentionInterface`` (the attention function)
and to its ``AttentionMaskInterface`` (which mask the model builds: the boolean masks of
``sdpa``, True = may attend, which are qkv's convention too; without this entry transformers
would pass no mask at all to an unknown implementation and silently drop padding). The
function receives HF's (B, H, Nq, D) queries and (B, Hk, Nk, D) keys/values and returns
(B, Nq, H, D), like every HF attention function. How HF's arguments become qkv's:

* mask ``None`` → no mask; causal models then get ``is_causal=True`` (no mask is built);
* bool 4-D ``(B|1, 1|H, Nq, Nk)`` → ``attn_mask`` as is (True = may attend);
* float 4-D (additive, e.g. ``finfo.min`` or a bias) → ``attn_mask`` as is (added to scores);
* ``module.num_key_value_groups > 1`` → ``enable_gqa=True`` (K and V are not repeated);
* ``sliding_window=w`` with no mask → ``window=(w - 1, 0)`` (HF's window counts the query itself);
  with a mask, the mask already encodes the window;
* ``scaling`` → ``scale``, ``dropout`` → ``dropout_p``.

Observers (:func:`add_observer`, :func:`observe`) get an :class:`HFAttentionCall` per call,
with the log-sum-exp of every query row; :mod:`qkv.inspect` builds on them. Interventions
(:func:`qkv.inspect.patch`, :func:`qkv.inspect.ablate`) replace a module's q, k, v, weights or
head outputs during the call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .functional import attention, attention_weights

__all__ = [
    "NAME",
    "register",
    "is_registered",
    "attention_forward",
    "HFAttentionCall",
    "add_observer",
    "remove_observer",
    "observe",
    "observers",
]

NAME = "qkv"

Observer = Callable[["HFAttentionCall"], Any]
_OBSERVERS: List[Observer] = []
# id(attention module) -> its intervention (set by qkv.inspect.patch): called as
# edit(point, tensor) -> tensor for "q", "k", "v", "weights" (when edit.edits_weights) and "output"
_EDITORS: Dict[int, Any] = {}


@dataclass
class HFAttentionCall:
    """One attention call made by a Hugging Face model through qkv.

    Tensors are in qkv's layout: ``query`` (B, H, Nq, D), ``key``/``value`` (B, Hk, Nk, D),
    ``output`` (B, H, Nq, D), ``lse`` (B, H, Nq) float32 natural-log log-sum-exp of each
    query row's scores (``-inf`` for a row that sees no key). ``attn_mask`` is the mask qkv
    received (None, bool or float, broadcastable to (B, H, Nq, Nk)); ``is_causal`` and
    ``window`` complete it. ``module`` is the HF attention module (``layer_idx`` is its
    layer, when the model sets it).
    """

    module: Any
    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Optional[Tensor]
    is_causal: bool
    window: Optional[Tuple[Optional[int], Optional[int]]]
    scale: Optional[float]
    output: Tensor
    lse: Tensor

    @property
    def layer_idx(self) -> Optional[int]:
        return getattr(self.module, "layer_idx", None)

    def __repr__(self) -> str:
        mask = "None" if self.attn_mask is None else f"{self.attn_mask.dtype} {tuple(self.attn_mask.shape)}"
        return (
            f"HFAttentionCall(layer_idx={self.layer_idx}, module={type(self.module).__name__}, "
            f"query={tuple(self.query.shape)}, key={tuple(self.key.shape)}, mask={mask}, "
            f"is_causal={self.is_causal}, window={self.window}, output={tuple(self.output.shape)})"
        )


# ---------------------------------------------------------------------------------- observers
def add_observer(fn: Observer) -> Callable[[], None]:
    """Call ``fn(HFAttentionCall)`` after every attention call; returns a function that removes it.

    While any observer is registered, calls also compute the log-sum-exp (``return_lse=True``),
    which may route them off torch's fastest kernel.
    """
    if not callable(fn):
        raise TypeError(f"an observer must be callable, got {type(fn).__name__}")
    _OBSERVERS.append(fn)
    return lambda: remove_observer(fn)


def remove_observer(fn: Observer) -> None:
    """Stop calling ``fn``; a function that is not registered is ignored."""
    for i, registered in enumerate(_OBSERVERS):
        if registered is fn or registered == fn:  # == lets a fresh bound method (list.append) match
            del _OBSERVERS[i]
            return


def observers() -> Tuple[Observer, ...]:
    """The registered observers, in call order."""
    return tuple(_OBSERVERS)


@contextlib.contextmanager
def observe(fn: Optional[Observer] = None) -> Iterator[List[HFAttentionCall]]:
    """Observe attention calls inside a ``with`` block.

    With ``fn``, each call goes to it; without, calls are appended to the yielded list
    (which holds every tensor: keep the block short on big inputs).
    """
    recorded: List[HFAttentionCall] = []
    target: Observer = fn if fn is not None else recorded.append
    remove = add_observer(target)
    try:
        yield recorded
    finally:
        remove()


@contextlib.contextmanager
def record_stats(
    *, topk: int = 5, key_positions: Sequence[int] = (0,), relative_positions: Sequence[int] = (-1, 0)
) -> Iterator[List[Any]]:
    """Streaming attention statistics of every layer of a Hugging Face model running on qkv.

    Yields a list that receives one :class:`qkv.inspect.AttentionStats` per attention call, in
    call order (``stats.layer_idx`` is set when the model numbers its layers). Computed from
    each call's q, k and log-sum-exp tile by tile, so no N×N map is ever built — what
    ``output_attentions=True`` cannot offer on long inputs.
    """
    from .inspect import attention_stats

    collected: List[Any] = []

    def on_call(c: HFAttentionCall) -> None:
        st = attention_stats(
            c.query, c.key, lse=c.lse, attn_mask=c.attn_mask, is_causal=c.is_causal, window=c.window,
            scale=c.scale, enable_gqa=c.query.shape[1] != c.key.shape[1], topk=topk,
            key_positions=key_positions, relative_positions=relative_positions,
        )  # fmt: skip
        st.layer_idx = c.layer_idx
        collected.append(st)

    with observe(on_call):
        yield collected


# ---------------------------------------------------------------------------------- the function
_UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping (tanh on the scores)",
    "s_aux": "attention sinks",
}


def attention_forward(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    position_bias: Optional[Tensor] = None,
    **kwargs: Any,
) -> Tuple[Tensor, Optional[Tensor]]:
    """A Hugging Face attention function running on :func:`qkv.attention`.

    ``query`` (B, H, Nq, D), ``key``/``value`` (B, Hk, Nk, D) → ``(out (B, Nq, H, D), weights)``;
    ``weights`` (B, H, Nq, Nk) only when ``output_attentions=True`` is passed, else None.
    See the module docstring for how HF's masks map to qkv's.
    """
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"qkv's Hugging Face attention does not support {name}= ({what}); use "
                "attn_implementation='eager' for this model"
            )
    nq, nk = query.shape[-2], key.shape[-2]
    groups = getattr(module, "num_key_value_groups", 1) or 1
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)

    mask = attention_mask
    if mask is not None:
        if mask.dim() == 2:  # (B, Nk) padding mask, from code that skipped HF's mask builder
            mask = mask.bool()[:, None, None, :]  # (B, 1, 1, Nk)
        if mask.shape[-1] > nk:  # some models build the mask for a longer (static) cache
            mask = mask[..., :nk]
        if mask.dtype != torch.bool and mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
    # As HF's sdpa: with a mask, the mask says everything; without, causality (top-left
    # aligned, so a static cache's empty tail is ignored) unless a single query decodes.
    causal = bool(is_causal) and mask is None and nq > 1
    window = (sliding_window - 1, 0) if (causal and sliding_window) else None
    if position_bias is not None:  # T5-style additive bias, combined with the mask
        bias = position_bias.to(query.dtype)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = bias + mask

    gqa = groups > 1
    dropout_p = float(dropout) if getattr(module, "training", False) else 0.0
    observed = bool(_OBSERVERS)
    ed = _EDITORS.get(id(module))
    if ed is not None:
        query, key, value = ed("q", query), ed("k", key), ed("v", value)
    result = attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal,
        scale=scaling,
        enable_gqa=gqa,
        window=window,
        return_lse=observed,
    )
    out, lse = result if observed else (result, None)  # (B, H, Nq, D), (B, H, Nq)
    if ed is not None:
        if ed.edits_weights:  # the weights themselves are edited: materialise, edit, multiply by V
            w = ed("weights", attention_weights(query, key, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=gqa, window=window))
            if dropout_p > 0:
                w = torch.nn.functional.dropout(w, dropout_p)
            b, hk, nk_, d = value.shape
            out = (w.reshape(b, hk, -1, nq, nk_) @ value.unsqueeze(2)).reshape(b, -1, nq, d)  # (B, H, Nq, D)
        out = ed("output", out)
    if observed:
        call = HFAttentionCall(module, query, key, value, mask, causal, window, scaling, out, lse)
        for fn in tuple(_OBSERVERS):
            fn(call)

    weights = None
    if kwargs.get("output_attentions"):
        weights = attention_weights(
            query, key, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=gqa, window=window
        )  # (B, H, Nq, Nk)
    return out.transpose(1, 2).contiguous(), weights  # (B, Nq, H, D)


# ---------------------------------------------------------------------------------- registration
def _interfaces() -> Tuple[Any, Any, Any]:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError(
            "qkv.hf needs transformers with AttentionInterface and masking_utils (>= 4.53): "
            "pip install -U transformers"
        ) from e
    return AttentionInterface, AttentionMaskInterface, sdpa_mask


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` (default ``"qkv"``) run on :func:`qkv.attention`.

    Registers the attention function and the boolean (sdpa-style) mask builder under
    ``name``; safe to call more than once. Returns ``name``. Afterwards:
    ``AutoModel.from_config(cfg, attn_implementation="qkv")`` or
    ``model.set_attn_implementation("qkv")``.
    """
    attention_interface, mask_interface, sdpa_mask = _interfaces()
    attention_interface.register(name, attention_forward)
    mask_interface.register(name, sdpa_mask)
    return name


def is_registered(name: str = NAME) -> bool:
    """Whether ``name`` runs qkv in transformers' attention registry."""
    try:
        attention_interface, _, _ = _interfaces()
    except ImportError:
        return False
    return attention_interface._global_mapping.get(name) is attention_forward
