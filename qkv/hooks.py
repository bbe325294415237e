"""Hook points: where observers see, and editors change, what an attention module computes.

Shape legend::

    B batch   H query heads   Hk key/value heads   Nq / Nk query / key length   Dh head dim

Every attention site (:class:`qkv.nn.MultiHeadAttention`, and :func:`qkv.hf.attention_forward`
for Hugging Face models) passes its intermediate tensors through named hook points. A point is
named ``<module path>.<point>`` (``encoder.layers.3.self_attn.weights``): the module's name in
``model.named_modules()`` and one of::

    q        (B, H, Nq, Dh)    after the head split (and rotary)
    k, v     (B, Hk, Nk, Dh)   after the head split (and rotary, and the KV cache)
    weights  (B, H, Nq, Nk)    softmax weights; editing them materialises them and multiplies by V
    lse      (B, H, Nq)        log-sum-exp of each row, or None; observed with the call's
                               ``query``, ``key`` and mask arguments as context
    output   (B, H, Nq, Dh)    each head's output, before the heads merge and the output projection
    call     (object)          the whole call as one record (qkv.hf's HFAttentionCall)

Hooks are registered on a module object (or on :data:`EVERY` module), never set as attributes:

* an **editor** ``fn(point, tensor) -> tensor`` replaces the tensor at its points;
* an **observer** ``fn(point, tensor, **context) -> None`` sees it, after every edit.

Hooks run in registration order (an enclosing registration first). :func:`add_editor` and
:func:`add_observer` return a :class:`Handle` that removes the hook; it is a context manager, so
``with add_editor(module, fn, points=("output",)):`` leaves nothing behind, also when the forward
pass raises. An attention site asks :func:`site` once per call: None when nothing hooks the
module (one dictionary lookup), else a :class:`Site` that applies edits and calls observers.
:func:`apply_edit` and :func:`attend_weights` are the one implementation of replacing a point's
tensor and of the weight-editing path, shared by every site.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "POINTS",
    "EVERY",
    "Hook",
    "Handle",
    "Site",
    "Edit",
    "add_editor",
    "add_observer",
    "registered",
    "site",
    "point_name",
    "matches",
    "apply_edit",
    "attend_weights",
]

POINTS: Tuple[str, ...] = ("q", "k", "v", "weights", "lse", "output", "call")

# An edit given by a user: a replacement tensor (broadcast to the point's shape) or tensor -> tensor.
Edit = Union[Tensor, Callable[[Tensor], Optional[Tensor]]]


class _Every:
    def __repr__(self) -> str:
        return "EVERY"


EVERY: Any = _Every()  # register on this instead of a module: the hook sees every module's calls


@dataclass(frozen=True, eq=False)
class Hook:
    """One registered hook. ``points`` None means every point.

    ``wants_lse``: an ``lse`` observer that asks the attention call itself for the log-sum-exp
    (else the site may pass None). ``attend``: an observer that may run the attention call
    itself, ``attend(q, k, v, **call) -> (out, lse)`` or None to decline; used only when it is
    the module's sole ``lse`` observer.
    """

    module: Any
    fn: Callable[..., Any]
    edits: bool
    points: Optional[frozenset[str]] = None
    wants_lse: bool = False
    attend: Optional[Callable[..., Optional[Tuple[Tensor, Tensor]]]] = None

    def at(self, point: str) -> bool:
        return self.points is None or point in self.points


_HOOKS: Dict[Any, List[Hook]] = {}  # module (or EVERY) -> its hooks, in registration order


class Handle:
    """Removes its hook: ``handle.remove()``, or on leaving ``with handle:``. Removing twice is harmless."""

    def __init__(self, hook: Hook) -> None:
        self.hook = hook

    def remove(self) -> None:
        hooks = _HOOKS.get(self.hook.module)
        if hooks is None:
            return
        for i, h in enumerate(hooks):
            if h is self.hook:
                del hooks[i]
                break
        if not hooks:
            del _HOOKS[self.hook.module]

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _add(hook: Hook) -> Handle:
    if not callable(hook.fn):
        raise TypeError(f"a hook must be callable, got {type(hook.fn).__name__}")
    unknown = sorted((hook.points or frozenset()) - set(POINTS))
    if unknown:
        raise ValueError(f"unknown hook point(s) {unknown}; points are {list(POINTS)}")
    _HOOKS.setdefault(hook.module, []).append(hook)
    return Handle(hook)


def add_editor(module: Any, fn: Callable[[str, Tensor], Tensor], *, points: Any = None) -> Handle:
    """Call ``fn(point, tensor) -> tensor`` at ``points`` (None: all) of ``module``; the result replaces the tensor."""
    return _add(Hook(module, fn, True, None if points is None else frozenset(points)))


def add_observer(
    module: Any,
    fn: Callable[..., Any],
    *,
    points: Any = None,
    wants_lse: bool = False,
    attend: Optional[Callable[..., Optional[Tuple[Tensor, Tensor]]]] = None,
) -> Handle:
    """Call ``fn(point, tensor, **context)`` at ``points`` (None: all) of ``module`` (or :data:`EVERY`)."""
    return _add(Hook(module, fn, False, None if points is None else frozenset(points), wants_lse, attend))


def registered(module: Any) -> Tuple[Hook, ...]:
    """The hooks registered on ``module`` itself (or on :data:`EVERY`), in call order."""
    return tuple(_HOOKS.get(module, ()))


class Site:
    """The hooks of one attention call; what the attention code calls at each point."""

    def __init__(self, hooks: List[Hook]) -> None:
        self.hooks = hooks

    def edits(self, point: str) -> bool:
        return any(h.edits and h.at(point) for h in self.hooks)

    def observes(self, point: str) -> bool:
        return any(not h.edits and h.at(point) for h in self.hooks)

    @property
    def wants_lse(self) -> bool:
        """Whether an ``lse`` observer asks the attention call itself for the log-sum-exp."""
        return any(h.wants_lse and not h.edits and h.at("lse") for h in self.hooks)

    def edit(self, point: str, t: Tensor) -> Tensor:
        for h in self.hooks:
            if h.edits and h.at(point):
                t = h.fn(point, t)
        return t

    def observe(self, point: str, value: Any, **context: Any) -> None:
        for h in self.hooks:
            if not h.edits and h.at(point):
                h.fn(point, value, **context)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **call: Any) -> Optional[Tuple[Tensor, Tensor]]:
        """``(out, lse)`` from the sole ``lse`` observer's ``attend``, or None (run the call as usual)."""
        lse_observers = [h for h in self.hooks if not h.edits and h.at("lse")]
        if len(lse_observers) != 1 or lse_observers[0].attend is None:
            return None
        return lse_observers[0].attend(q, k, v, **call)

    def edited_weights(self, weights: Callable[[], Tensor]) -> Optional[Tensor]:
        """The edited weights (B, H, Nq, Nk) when an editor changes them (materialising
        ``weights()``), else None: the call then runs fused."""
        return self.edit("weights", weights()) if self.edits("weights") else None


def site(module: Any) -> Optional[Site]:
    """The hooks on ``module`` and on :data:`EVERY`, or None when there are none."""
    own, every = _HOOKS.get(module), _HOOKS.get(EVERY)
    if not own and not every:
        return None
    return Site([*(every or ()), *(own or ())])


# ---------------------------------------------------------------------------------- naming
def point_name(path: str, point: str) -> str:
    """``<module path>.<point>``; the model itself (path ``""``) has plain point names."""
    return f"{path}.{point}" if path else point


def matches(pattern: str, path: str, point: str) -> bool:
    """Whether glob ``pattern`` selects ``point`` of the module at ``path`` (``"*.weights"``
    selects the model's own ``weights`` too)."""
    names = (f"{path}.{point}",) if path else (point, f".{point}")
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)


# ---------------------------------------------------------------------------------- editing
def apply_edit(edit: Edit, t: Tensor, name: str) -> Tensor:
    """``t`` replaced by ``edit``: a tensor broadcast to ``t``'s shape, or ``edit(copy of t)``
    (which may write in place), checked to keep the shape; ``name`` is the point, for errors."""
    if isinstance(edit, Tensor):
        try:
            return edit.to(device=t.device, dtype=t.dtype).expand_as(t)
        except RuntimeError:
            raise ValueError(
                f"the replacement for {name} has shape {tuple(edit.shape)}, which does not broadcast to the "
                f"point's shape {tuple(t.shape)}"
            ) from None
    got = edit(t.clone())  # a clone: an edit may write in place without touching the model's own tensor
    if got is None:
        raise ValueError(f"the edit for {name} returned None; return the tensor to use (e.g. the edited argument)")
    if not isinstance(got, Tensor) or got.shape != t.shape:
        shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
        raise ValueError(f"the edit for {name} returned {shape}; it must return a tensor of shape {tuple(t.shape)}")
    return got.to(t.dtype)


def attend_weights(weights: Tensor, value: Tensor, dropout_p: float = 0.0) -> Tensor:
    """Weights ``(B, H, Nq, Nk)`` (dropped out first when ``dropout_p > 0``) times values
    ``(B, Hk, Nk, Dh)`` → ``(B, H, Nq, Dh)``; query head ``h`` reads value head ``h // (H / Hk)``."""
    p = torch.nn.functional.dropout(weights, dropout_p) if dropout_p > 0 else weights
    b, hk, nk, d = value.shape
    h, nq = p.shape[1], p.shape[2]
    p = p.reshape(b, hk, h // hk, nq, nk)  # (B, Hk, G, Nq, Nk): G query heads per kv head
    return (p @ value.unsqueeze(2)).reshape(b, h, nq, d)
