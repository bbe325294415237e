"""The tensors a Python score function reads, found by watching it run.

A score function reaches tensors in many ways: its closure, default arguments and globals, a
list, tuple or dict, a ``functools.partial``, a bound method, an ``nn.Module``, the attributes
of any object. Looking for them by inspecting the function misses some, and a tensor missed
is a gradient silently lost. So qkv watches instead: while the function runs, a
``TorchFunctionMode`` (:class:`Reads`) sees every tensor that each torch operation in it receives.
A tensor that the caller did not hand in and no operation inside the function made came from
outside; where it requires grad, its gradient is owed to the caller.

The same mode reads a stand-in in place of a tensor where asked (``swap``): a 16-bit table
upcast to float32, so that its gradient is summed over tiles in float32, or in a backward the
leaf a gradient is taken against. Tiles evaluated inside the chunked backend's autograd
function are watched strictly: a tensor that requires grad and is not among those the call was
bound with raises :class:`MissedReads`, and the call is made again with it (see
:func:`qkv.backends.chunked_autograd.scored_attention`), so no read escapes its gradient.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["MissedReads", "Reads", "probe_reads"]


class MissedReads(RuntimeError):
    """A score function read tensors that require grad beyond those its call was bound with."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        super().__init__(f"the score function read {len(tensors)} tensor(s) requiring grad that its call did not know of")
        self.tensors = tuple(tensors)


def _wrapped_by_transform(t: Tensor) -> bool:
    """A ``torch.func`` wrapper (vmap's batched or grad's tracking tensor)."""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


class Reads(TorchFunctionMode):
    """Watches the torch operations run inside it: :attr:`found` lists, in order of first
    read, the tensors from outside (not in ``inputs``, not made inside) that require grad or
    that a ``torch.func`` transform outside tracks — with ``every=True``, every tensor from
    outside (what a cache keyed on a mask function's tensors must cover); a tensor whose id is
    in ``swap`` is read as ``swap[id]`` instead (and counts as found)."""

    def __init__(self, swap: Mapping[int, Tensor] | None = None, every: bool = False) -> None:
        super().__init__()
        self._every = every
        self._made: set[int] = set()
        self._alive: list[Any] = []  # holds what was made, so that no id is reused meanwhile
        self._swap = dict(swap or {})
        self._seen: dict[int, Tensor] = {}
        # a transform's wrappers made inside (vmap over a tile's elements) are the function's
        # arguments; one made outside, at this level or below, wraps a tensor from outside
        top = torch._C._functorch.peek_interpreter_stack()
        self._outer_level = top.level() if top is not None else 0

    def around(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` watched while it runs, its arguments counted as handed in (not read from
        outside). Only the function is watched: what the caller does around it (vmap's own
        unwrapping, say) makes tensors this mode never sees made."""

        @functools.wraps(fn)
        def watched(*args: Any) -> Any:
            handed = [a for a in args if isinstance(a, Tensor)]
            self._made.update(id(a) for a in handed)
            self._alive.extend(handed)
            with self:
                return fn(*args)

        return watched

    @property
    def found(self) -> list[Tensor]:
        return list(self._seen.values())

    def missed(self, known: Sequence[Tensor]) -> list[Tensor]:
        """What was found that is not among ``known``."""
        ids = {id(t) for t in known}
        return [t for i, t in self._seen.items() if i not in ids]

    def _outside(self, t: Tensor) -> bool:
        if id(t) in self._made:
            return False
        if _wrapped_by_transform(t):
            level = torch._C._functorch.maybe_get_level(t)
            return 0 < level <= self._outer_level
        return self._every or t.requires_grad

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        flat, spec = tree_flatten((args, kwargs or {}))
        swapped = False
        for n, x in enumerate(flat):
            if isinstance(x, Tensor) and self._outside(x):
                self._seen.setdefault(id(x), x)
                stand_in = self._swap.get(id(x))
                if stand_in is not None:
                    flat[n], swapped = stand_in, True
        if swapped:
            args, kwargs = tree_unflatten(flat, spec)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and id(t) not in self._made:
                self._made.add(id(t))
                self._alive.append(t)
        return out


def probe_reads(fn: Callable[..., Any], args: Sequence[Tensor], mapped: Callable[[Callable[..., Any]], Any]) -> tuple[Tensor, ...]:
    """The tensors from outside that ``fn(*args)`` reads and that require grad (or that a
    transform tracks), found by calling it once on ``args`` (0-d tensors: one element, as
    FlexAttention's contract means it); where that call fails, ``mapped(watched fn)`` is
    watched instead (the same call mapped with ``torch.vmap``). A function that fails both ways
    reads what it read before failing: the call itself then raises what is wrong."""
    watch = Reads()
    try:
        watch.around(fn)(*args)
    except Exception:  # noqa: BLE001 - any failure here is the real call's to report
        try:
            mapped(watch.around(fn))
        except Exception:  # noqa: BLE001
            pass
    return tuple(watch.found)
