"""qkv as a Hugging Face ``transformers`` attention implementation.

>>> import qkv.hf
>>> qkv.hf.register()                                   # once per process
>>> model = AutoModel.from_config(cfg, attn_implementation="qkv")
>>> qkv.hf.register("qkv_chunked", backend="chunked")  # a name whose calls run on one backend
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
* ``scaling`` → ``scale``, ``dropout`` → ``dropout_p``;
* ``softcap=c`` (Gemma 2's ``attn_logit_softcapping``) → ``score_mod=Softcap(c)``, applied to the
  scaled scores before the mask, as HF's eager code does;
* ``s_aux`` (GPT-OSS's per-head sink logits ``module.sinks``, shape ``(H,)``) → ``sinks=s_aux``;
* ``position_bias`` (T5) → added to the float mask (the bool mask becomes ``-inf`` there).

Models whose attention layers never call transformers' attention interface (BLOOM, Falcon,
GPT-Neo, XGLM and every other class whose modeling code does not go through
``ALL_ATTENTION_FUNCTIONS``) would accept ``attn_implementation="qkv"`` and keep running their
own attention. ``register()`` makes transformers refuse them when they are built or switched
(:class:`UnsupportedModelError`, naming the class and the reason), as it does for the flash
implementations on models without support.

Observers (:func:`add_observer`, :func:`observe`) get an :class:`HFAttentionCall` per call,
with the log-sum-exp of every query row; :mod:`qkv.inspect` builds on them. Interventions
(:func:`qkv.inspect.patch`, :func:`qkv.inspect.ablate`) replace a module's q, k, v, weights or
head outputs during the call. Both are :mod:`qkv.hooks` hooks: observers watch every module's
``"call"`` point, editors a module's ``q``/``k``/``v``/``weights``/``output`` points.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, cast

import torch
from torch import Tensor

from . import hooks
from .backends import BACKENDS
from .call import BackendName
from .extras import require
from .functional import attention, attention_weights
from .score_mods import Softcap

__all__ = [
    "NAME",
    "UnsupportedModelError",
    "unsupported_reason",
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
"""The attention implementation's name in transformers: ``attn_implementation="qkv"``."""

Observer = Callable[["HFAttentionCall"], Any]


@dataclass
class HFAttentionCall:
    """One attention call made by a Hugging Face model through qkv.

    Tensors are in qkv's layout: ``query`` (B, H, Nq, D), ``key``/``value`` (B, Hk, Nk, D),
    ``output`` (B, H, Nq, D), ``lse`` (B, H, Nq) float32 natural-log log-sum-exp of each
    query row's scores (``-inf`` for a row that sees no key). ``attn_mask`` is the mask qkv
    received (None, bool or float, broadcastable to (B, H, Nq, Nk)); ``is_causal`` and
    ``window`` complete it. ``score_mod`` is the score function applied to the scaled scores
    before the mask (``Softcap`` for Gemma 2, else None) and ``sinks`` the ``(H,)`` sink
    logits that join each row's softmax denominator (GPT-OSS, else None); ``lse`` includes
    the sinks, so ``exp(score_mod(s) + mask - lse)`` are the weights the model uses.
    ``module`` is the HF attention module (``layer_idx`` is its layer, when the model sets it).
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
    score_mod: Optional[Any] = None
    sinks: Optional[Tensor] = None

    @property
    def layer_idx(self) -> Optional[int]:
        return getattr(self.module, "layer_idx", None)

    def __repr__(self) -> str:
        mask = "None" if self.attn_mask is None else f"{self.attn_mask.dtype} {tuple(self.attn_mask.shape)}"
        return (
            f"HFAttentionCall(layer_idx={self.layer_idx}, module={type(self.module).__name__}, "
            f"query={tuple(self.query.shape)}, key={tuple(self.key.shape)}, mask={mask}, "
            f"is_causal={self.is_causal}, window={self.window}, output={tuple(self.output.shape)}"
            + ("" if self.score_mod is None else f", score_mod={_describe(self.score_mod)}")
            + ("" if self.sinks is None else f", sinks={tuple(self.sinks.shape)}")
            + ")"
        )


def _describe(fn: Any) -> str:
    describe = getattr(fn, "describe", None)
    return describe() if callable(describe) else getattr(fn, "__name__", type(fn).__name__)


# ---------------------------------------------------------------------------------- observers
class _CallObserver:
    """Adapts ``fn(HFAttentionCall)`` to a :mod:`qkv.hooks` observer of every module's ``"call"`` point."""

    def __init__(self, fn: Observer) -> None:
        self.fn = fn

    def __call__(self, point: str, call: "HFAttentionCall") -> None:
        self.fn(call)


def _observer_hooks() -> List[Tuple[hooks.Hook, _CallObserver]]:
    return [(h, h.fn) for h in hooks.registered(hooks.EVERY) if isinstance(h.fn, _CallObserver)]


def add_observer(fn: Observer) -> Callable[[], None]:
    """Call ``fn(HFAttentionCall)`` after every attention call; returns a function that removes it.

    While any observer is registered, calls also compute the log-sum-exp (``return_lse=True``),
    which may route them off torch's fastest kernel.
    """
    if not callable(fn):
        raise TypeError(f"an observer must be callable, got {type(fn).__name__}")
    hooks.add_observer(hooks.EVERY, _CallObserver(fn), points=("call",))
    return lambda: remove_observer(fn)


def remove_observer(fn: Observer) -> None:
    """Stop calling ``fn``; a function that is not registered is ignored."""
    for h, observer in _observer_hooks():
        if observer.fn is fn or observer.fn == fn:  # == lets a fresh bound method (list.append) match
            hooks.Handle(h).remove()
            return


def observers() -> Tuple[Observer, ...]:
    """The registered observers, in call order."""
    return tuple(observer.fn for _, observer in _observer_hooks())


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

# ---------------------------------------------------------------------------------- the function
# Arguments some models pass that qkv cannot express. Each is refused rather than ignored: the
# sparse indices are what those models fold into the mask only for "eager" and "sdpa".
_UNSUPPORTED_KWARGS = {
    "sinks": "per-token sink logits (qkv's sinks are one logit per head, as GPT-OSS's s_aux)",
    "indices": "sparse attention indices (top-k keys per query)",
    "block_indices": "block-sparse attention indices",
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
    softcap: Optional[float] = None,
    s_aux: Optional[Tensor] = None,
    *,
    backend: BackendName = "auto",
    **kwargs: Any,
) -> Tuple[Tensor, Optional[Tensor]]:
    """A Hugging Face attention function running on :func:`qkv.attention`.

    ``query`` (B, H, Nq, D), ``key``/``value`` (B, Hk, Nk, D) → ``(out (B, Nq, H, D), weights)``;
    ``weights`` (B, H, Nq, Nk) only when ``output_attentions=True`` is passed, else None.
    ``backend`` is :func:`qkv.attention`'s (a name registered with ``register(name, backend=...)``
    passes its own). See the module docstring for how HF's arguments map to qkv's.
    """
    _refuse_kwargs(module, kwargs)
    score_mod = Softcap(softcap) if softcap else None  # HF passes None (or 0) for "no cap"
    sinks = _sinks(module, s_aux, query)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    mask, causal, window = _masks(attention_mask, position_bias, bool(is_causal), sliding_window, query, key.shape[-2])
    call: Dict[str, Any] = dict(
        attn_mask=mask, is_causal=causal, scale=scaling, window=window, score_mod=score_mod, sinks=sinks,
        enable_gqa=(getattr(module, "num_key_value_groups", 1) or 1) > 1,
    )  # fmt: skip
    dropout_p = float(dropout) if getattr(module, "training", False) else 0.0

    hp = hooks.site(module)
    if hp is None:  # nothing hooks this module: the plain call
        out = attention(query, key, value, dropout_p=dropout_p, backend=backend, **call)  # (B, H, Nq, D)
    else:
        query, key, value, out = _hooked_attention(module, hp, query, key, value, dropout_p, call, backend)

    weights = None
    if kwargs.get("output_attentions"):
        # (B, H, Nq, Nk); with sinks a row sums to less than one, as in HF's eager code
        weights = attention_weights(query, key, **call)
    return out.transpose(1, 2).contiguous(), weights  # (B, Nq, H, D)


def _refuse_kwargs(module: Any, kwargs: Dict[str, Any]) -> None:
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"qkv's Hugging Face attention does not support {name}= ({what}), which "
                f"{type(module).__name__} passes; load this model with attn_implementation='eager' or 'sdpa'"
            )


def _sinks(module: Any, s_aux: Optional[Tensor], query: Tensor) -> Optional[Tensor]:
    """GPT-OSS's ``s_aux`` as qkv's sinks: one float logit per query head, ``(H,)``."""
    if s_aux is None:
        return None
    h = query.shape[1]
    if not isinstance(s_aux, Tensor) or not s_aux.is_floating_point() or s_aux.shape != (h,):
        got = f"{s_aux.dtype} {tuple(s_aux.shape)}" if isinstance(s_aux, Tensor) else type(s_aux).__name__
        raise ValueError(
            f"{type(module).__name__} passes s_aux={got}; qkv takes attention sinks as one float "
            f"logit per query head, shape ({h},)"
        )
    return s_aux.to(query.device)


def _masks(
    attention_mask: Optional[Tensor], position_bias: Optional[Tensor], is_causal: bool,
    sliding_window: Optional[int], query: Tensor, nk: int,
) -> Tuple[Optional[Tensor], bool, Optional[Tuple[int, int]]]:  # fmt: skip
    """HF's mask arguments as qkv's: ``(attn_mask, is_causal, window)``."""
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
    causal = is_causal and mask is None and query.shape[-2] > 1
    window = (sliding_window - 1, 0) if (causal and sliding_window) else None
    if position_bias is not None:  # T5-style additive bias, combined with the mask
        bias = position_bias.to(query.dtype)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = bias + mask
    return mask, causal, window


def _hooked_attention(
    module: Any, hp: hooks.Site, query: Tensor, key: Tensor, value: Tensor, dropout_p: float, call: Dict[str, Any],
    backend: BackendName,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The call through its hook points (:mod:`qkv.hooks`): edits of q, k, v, weights and output,
    then the ``"call"`` observers → the (edited) ``query, key, value`` and ``out`` (B, H, Nq, D)."""
    query, key, value = hp.edit("q", query), hp.edit("k", key), hp.edit("v", value)
    observed = hp.observes("call")
    result: Any = attention(query, key, value, dropout_p=dropout_p, return_lse=observed, backend=backend, **call)
    out, lse = result if observed else (result, None)  # (B, H, Nq, D), (B, H, Nq)
    # the weights themselves edited: materialise, edit, multiply by V
    weights = hp.edited_weights(lambda: attention_weights(query, key, **call))
    if weights is not None:
        out = hooks.attend_weights(weights, value, dropout_p)
    out = hp.edit("output", out)
    if observed:
        hp.observe("call", HFAttentionCall(
            module, query, key, value, call["attn_mask"], call["is_causal"], call["window"], call["scale"], out,
            cast(Tensor, lse), call["score_mod"], call["sinks"],
        ))  # fmt: skip
    return query, key, value, out


# ---------------------------------------------------------------------------------- registration
def _interfaces() -> Tuple[Any, Any, Any]:
    require("transformers", "qkv.hf (attn_implementation=\"qkv\")")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError(
            "qkv.hf needs transformers with AttentionInterface and masking_utils (>= 4.53): "
            "pip install -U transformers"
        ) from e
    return AttentionInterface, AttentionMaskInterface, sdpa_mask


def register(name: str = NAME, backend: BackendName = "auto") -> str:
    """Make ``attn_implementation=name`` (default ``"qkv"``) run on :func:`qkv.attention`.

    Registers the attention function and the boolean (sdpa-style) mask builder under
    ``name``, and makes transformers refuse, under that name, model classes whose attention
    does not go through the interface (:class:`UnsupportedModelError`). Safe to call more
    than once. Returns ``name``. Afterwards:
    ``AutoModel.from_config(cfg, attn_implementation="qkv")`` or
    ``model.set_attn_implementation("qkv")``.

    ``backend``: every call under ``name`` runs on that :func:`qkv.attention` backend, which
    never falls back (``register("qkv_chunked", backend="chunked")`` runs a model on qkv's own
    tile loops even where ``auto`` would hand a plain call to torch's SDPA).
    """
    forward = _forward_on(backend)
    attention_interface, mask_interface, sdpa_mask = _interfaces()
    attention_interface.register(name, forward)
    mask_interface.register(name, sdpa_mask)
    _NAMES.add(name)
    _install_checks()
    return name


def is_registered(name: str = NAME) -> bool:
    """Whether ``name`` runs qkv in transformers' attention registry (on any backend)."""
    try:
        attention_interface, _, _ = _interfaces()
    except ImportError:
        return False
    fn = attention_interface._global_mapping.get(name)
    return fn is attention_forward or any(fn is f for f in _ON_BACKEND.values())


_ON_BACKEND: Dict[str, Callable[..., Tuple[Tensor, Optional[Tensor]]]] = {}  # backend -> its attention function


def _forward_on(backend: str) -> Callable[..., Tuple[Tensor, Optional[Tensor]]]:
    """:func:`attention_forward` with ``backend`` fixed (the same function for the same backend,
    so that registering twice changes nothing)."""
    if backend == "auto":
        return attention_forward
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; choose 'auto' or one of {sorted(BACKENDS)}")
    if backend not in _ON_BACKEND:

        @functools.wraps(attention_forward)
        def on_backend(*args: Any, **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
            return attention_forward(*args, backend=backend, **kwargs)  # type: ignore[arg-type]

        _ON_BACKEND[backend] = on_backend
    return _ON_BACKEND[backend]


# ---------------------------------------------------------------------------------- refusal
class UnsupportedModelError(ValueError):
    """A model class whose attention would not run on qkv under ``attn_implementation="qkv"``.

    transformers accepts any registered name, even for classes that never call its attention
    interface; those would silently keep their own attention (or fail with a bare KeyError).
    """


_NAMES: set[str] = set()  # the names register() gave qkv

# Architectures that qkv could run exactly with a little wiring, said in the refusal.
_NOT_WIRED = "is one qkv can express (qkv.score_mods.ALiBi), but it is not wired yet. "
_NOTES = {
    "bloom": "BLOOM's ALiBi bias " + _NOT_WIRED,
    "mpt": "MPT's ALiBi bias " + _NOT_WIRED,
    "falcon": "Falcon's rotary or ALiBi attention " + _NOT_WIRED,
}

# transformers' own test of a modeling file (PreTrainedModel._can_set_attn_implementation): it
# defines an attention layer, and no code in it reaches the interface. Older releases indexed
# ALL_ATTENTION_FUNCTIONS[...] instead of calling get_interface(...): both count.
_DEFINES_ATTENTION = re.compile(r"^class \w*Attention\w*\(nn\.Module\):", re.MULTILINE)
_USES_INTERFACE = re.compile(r"ALL_ATTENTION_FUNCTIONS\s*(?:\.get_interface\(|\[)")
# A layer that computes attention itself: softmax of a product, torch's SDPA or torch's MHA.
_SOFTMAX = re.compile(r"softmax\(")
_PRODUCT = re.compile(r"matmul\(|bmm\(|einsum\(|\s@\s")
_FUSED = re.compile(r"scaled_dot_product_attention\(|multi_head_attention_forward\(")


@functools.lru_cache(maxsize=None)
def _file_bypasses(module_name: str) -> bool:
    try:
        src = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):  # no source (a REPL class): nothing to judge by
        return False
    return bool(_DEFINES_ATTENTION.search(src)) and not _USES_INTERFACE.search(src)


_OWN_ATTENTION: Dict[type, bool] = {}  # module class -> whether it computes attention itself


def _computes_own_attention(cls: type) -> bool:
    if cls not in _OWN_ATTENTION:
        _OWN_ATTENTION[cls] = _judge_module_class(cls)
    return _OWN_ATTENTION[cls]


def _judge_module_class(cls: type) -> bool:
    if not re.search("Attention|Attn", cls.__name__):
        return False
    owner = next((k for k in cls.__mro__ if "forward" in vars(k)), None)
    if owner is None or owner is torch.nn.Module:
        return False
    try:
        src = inspect.getsource(owner)
    except (OSError, TypeError):
        return False
    if "ALL_ATTENTION_FUNCTIONS" in src or "attention_interface" in src:
        return False
    return bool(_FUSED.search(src) or (_SOFTMAX.search(src) and _PRODUCT.search(src)))


def unsupported_reason(model: Any) -> Optional[str]:
    """Why ``model`` (a transformers ``PreTrainedModel`` or its class) cannot run on qkv's
    attention, or None when every attention layer it has goes through the interface.

    A class is refused when a modeling file it comes from defines attention layers that never
    call ``ALL_ATTENTION_FUNCTIONS`` (transformers' own test for
    ``set_attn_implementation``); a built model also when any of its modules named like an
    attention layer computes a softmax of scores, torch's SDPA or torch's multi-head attention
    itself (an audio tower, a pooling head).
    """
    from transformers import PreTrainedModel

    cls = model if isinstance(model, type) else type(model)
    for k in cls.__mro__:
        if k is PreTrainedModel:
            break
        if issubclass(k, PreTrainedModel) and _file_bypasses(k.__module__):
            return (
                f"its attention layers ({k.__module__}) compute attention themselves and never call "
                "transformers' attention interface, so 'qkv' would be accepted and never run"
            )
    if isinstance(model, torch.nn.Module):
        own = [f"{n} ({type(m).__name__})" for n, m in model.named_modules() if _computes_own_attention(type(m))]
        if own:
            more = f" and {len(own) - 2} more" if len(own) > 2 else ""
            return (
                f"its module{'s' if len(own) > 1 else ''} {', '.join(own[:2])}{more} compute attention "
                "outside transformers' attention interface, so the model would run partly on qkv and "
                "partly on its own attention"
            )
    return None


def _refuse(model: Any, name: str) -> None:
    reason = unsupported_reason(model)
    if reason is not None:
        note = _NOTES.get(str(getattr(getattr(model, "config", None), "model_type", "")), "")
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot run on attn_implementation={name!r}: {reason}. {note}"
            "Load it with attn_implementation='eager' or 'sdpa'."
        )


def _install_checks() -> None:
    """Refuse unsupported classes where transformers validates a name: when a model is built
    (and when ``set_attn_implementation`` switches one), and after its layers exist.

    transformers has no per-implementation compatibility hook, so the two PreTrainedModel methods
    it always runs there are wrapped, once per process.
    """
    from transformers import PreTrainedModel

    if getattr(PreTrainedModel.get_correct_attn_implementation, "_qkv_checks", False):
        return
    correct, post_init = PreTrainedModel.get_correct_attn_implementation, PreTrainedModel.post_init

    @functools.wraps(correct)
    def get_correct_attn_implementation(self: Any, requested: Optional[str], *args: Any, **kwargs: Any) -> str:
        if requested is not None and requested in _NAMES:  # before the layers exist (Falcon's KeyError)
            _refuse(self, requested)
        return correct(self, requested, *args, **kwargs)

    @functools.wraps(post_init)
    def checked_post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = post_init(self, *args, **kwargs)
        name = getattr(self.config, "_attn_implementation", None)
        if isinstance(name, str) and name in _NAMES:
            _refuse(self, name)
        return result

    get_correct_attn_implementation._qkv_checks = True  # type: ignore[attr-defined]
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation  # type: ignore[method-assign,assignment]
    PreTrainedModel.post_init = checked_post_init  # type: ignore[method-assign,assignment]
