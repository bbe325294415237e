"""FlexAttention's per-element functions, run on whole tiles where that means the same.

A score function ``(score, batch, head, q_idx, kv_idx) -> score`` or a mask function
``(batch, head, q_idx, kv_idx) -> bool`` means, as in FlexAttention, what it computes for one
element: each argument a 0-d tensor. Calling it once per element is slow, so qkv first calls it
with arguments that broadcast against a whole tile (``q_idx (R, 1)``, ``kv_idx (1, C)``, ...),
and keeps that where it gives what the per-element call gives: checked once per function on a
corner of the tile (:func:`call_elementwise`). A function that raises on tiles (``bias[b][i]``
indexes the wrong dim), returns another shape or disagrees (``bias[h].sum()`` sums every head)
is mapped over the elements with ``torch.vmap`` from then on, as Flex maps it.

Like Flex's, a function may not branch in Python on a tensor's value (``if q_idx > kv_idx``):
write ``torch.where(q_idx > kv_idx, ...)``.
"""

from __future__ import annotations

import inspect
import math
import types
import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["call_elementwise", "check_function", "per_element", "runs_on_tiles"]

# How each function was found to run: True where calling it on broadcasting tiles gives what the
# per-element call gives, False where it must be mapped. Keyed by a plain function's code (a
# lambda made anew for each call is checked once), else by the callable itself, held weakly.
_RUNS_ON_TILES: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
_RUNS_ON_TILES_BY_CODE: dict[Any, bool] = {}
_MAX_CODES = 4096  # functions made by exec in a loop would otherwise grow the table without end
_CORNER_LEAD, _CORNER_ROWS, _CORNER_COLS = 2, 4, 4  # the corner of a tile compared element by element
_CALL_ERRORS = (IndexError, RuntimeError, TypeError, ValueError)


def check_function(fn: Any, name: str, params: tuple[str, ...], returns: str, hint: str = "") -> Any:
    """``fn`` if it can be called with FlexAttention's positional ``params``, else a TypeError that
    names the argument (``name``) and what it must accept."""
    shape = f"{name}({', '.join(params)}) -> {returns}"
    if not callable(fn):
        raise TypeError(f"{name} must be callable as {shape}, got {type(fn).__name__}{hint}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return fn
    try:
        sig.bind(*range(len(params)))
    except TypeError:
        count = ("one", "two", "three", "four", "five", "six")[len(params) - 1]
        raise TypeError(
            f"{name} {getattr(fn, '__name__', fn)!r} takes ({', '.join(sig.parameters)}); it must accept {count} "
            f"positional arguments ({', '.join(params)}), FlexAttention's contract"
        ) from None
    return fn


def per_element(fn: Callable[..., Any], shape: torch.Size, *args: Tensor) -> Tensor:
    """``fn`` called once per element of ``shape``, as FlexAttention calls it: every argument
    expanded to ``shape``, flattened, and mapped over with ``torch.vmap`` (0-d tensors each). An
    empty ``shape`` gives the first argument expanded to it, without calling ``fn``: empty, of its
    dtype, and still in its graph (an empty output of a differentiable call requires grad too)."""
    if math.prod(shape) == 0:  # nothing to call it on (vmap needs one element at least)
        return args[0].expand(shape).clone()
    flat = [t.expand(shape).reshape(-1) for t in args]
    out = torch.vmap(fn)(*flat)
    if not isinstance(out, Tensor):
        raise TypeError(f"{getattr(fn, '__name__', 'the function')} returned {type(out).__name__}; it must return a tensor")
    return out.reshape(shape)


def _verdict(fn: Any) -> "bool | None":
    if isinstance(fn, types.FunctionType):
        return _RUNS_ON_TILES_BY_CODE.get(fn.__code__)
    try:
        return _RUNS_ON_TILES.get(fn)
    except TypeError:  # not weak-referenceable: checked on each call
        return None


def _remember(fn: Any, runs_on_tiles: bool) -> None:
    if isinstance(fn, types.FunctionType):
        if len(_RUNS_ON_TILES_BY_CODE) >= _MAX_CODES:
            _RUNS_ON_TILES_BY_CODE.clear()
        _RUNS_ON_TILES_BY_CODE[fn.__code__] = runs_on_tiles
        return
    try:
        _RUNS_ON_TILES[fn] = runs_on_tiles
    except TypeError:
        pass


def _same_corner(fn: Any, out: Tensor, shape: torch.Size, args: tuple[Tensor, ...]) -> bool:
    """Does the tile result ``out`` match the per-element call on the tile's corner? (A function
    whose per-element call fails cannot be compared: its tile result stands.)"""
    lead = len(shape) - 2
    corner = tuple(slice(0, _CORNER_LEAD) for _ in range(lead)) + (slice(0, _CORNER_ROWS), slice(0, _CORNER_COLS))
    sub = [t.detach().expand(shape)[corner] for t in args]
    try:
        with torch.no_grad():
            want = per_element(fn, sub[0].shape, *sub)
    except _CALL_ERRORS:
        return True
    got = out.detach().expand(shape)[corner]
    if want.dtype == torch.bool or got.dtype == torch.bool:
        return bool(torch.equal(got.to(torch.bool), want.to(torch.bool)))
    return bool(torch.allclose(got.to(want.dtype), want, rtol=1e-5, atol=1e-6, equal_nan=True))


def _broadcasts(got: torch.Size, shape: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(got, shape) == shape
    except RuntimeError:
        return False


def call_elementwise(
    fn: Callable[..., Any], shape: torch.Size, *args: Tensor, around: Optional[Callable[[Callable[..., Any]], Callable[..., Any]]] = None
) -> Tensor:  # fmt: skip
    """``fn(*args)`` for arguments that broadcast to ``shape`` (a tile of scores, or of mask
    pairs), meaning what its per-element call means (see the module docstring). On a function's
    first call the tile result is compared with :func:`per_element` on the tile's corner. The
    result broadcasts to ``shape`` (its dtype the function's), except where the function fails
    per element too: then what it returned on the tile comes back for the caller to refuse, or
    the per-element call's error is raised. ``around(fn)``, where given, is what runs in
    ``fn``'s place, on the tile or per element (a watch on what it reads); the way ``fn`` runs is
    still remembered for ``fn``."""
    run = fn if around is None else around(fn)
    verdict = _verdict(fn)
    if verdict is False:
        return per_element(run, shape, *args)
    try:
        out = run(*args)
    except _CALL_ERRORS:
        out = None
    fits = isinstance(out, Tensor) and _broadcasts(out.shape, shape)
    if fits and (verdict or _same_corner(fn, out, shape, args)):
        if verdict is None:
            _remember(fn, True)
        return out  # type: ignore[return-value]
    try:
        mapped = per_element(run, shape, *args)
    except _CALL_ERRORS:
        if out is not None:
            return out  # wrong on tiles and per element: the caller says what is wrong with this result
        raise
    if verdict is None:
        _remember(fn, False)
    return mapped


def runs_on_tiles(fn: Callable[..., Any], sizes: tuple[int, int, int, int], dtype: torch.dtype) -> bool:
    """Does score function ``fn`` run on broadcasting tiles for a call of ``sizes`` (batch, query
    heads, Nq, Nk), or must it be mapped per element? Found once per function on a small probe
    (the sizes' first few indices), as :func:`call_elementwise` finds it; a function that fails
    both ways counts as running on tiles (its call then raises what is wrong)."""
    verdict = _verdict(fn)
    if verdict is None:
        b, h, nq, nk = (min(n, lim) for n, lim in zip(sizes, (_CORNER_LEAD, _CORNER_LEAD, _CORNER_ROWS, _CORNER_COLS)))
        idx = (torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1),
               torch.arange(nq).view(1, 1, nq, 1), torch.arange(nk).view(1, 1, 1, nk))  # fmt: skip
        if b * h * nq * nk == 0:
            return True
        try:
            with torch.no_grad():
                call_elementwise(fn, torch.Size((b, h, nq, nk)), torch.zeros(b, h, nq, nk, dtype=dtype), *idx)
        except _CALL_ERRORS:
            return True
        verdict = _verdict(fn)
    return verdict is not False
