"""What a score function is, and how one is bound to a call and evaluated tile by tile.

Contract (FlexAttention's ``score_mod``)::

    score_mod(score, batch, head, q_idx, kv_idx) -> new score

``score`` holds scaled scores ``q·kᵀ·scale`` in the compute dtype (float32 for 16-bit inputs,
float64 for float64); ``batch``, ``head``, ``q_idx`` and ``kv_idx`` are integer tensors: the
flattened batch index, the *query* head, the query row and the key index. As in FlexAttention
the function means what it computes for one element (0-d tensors), so code written per element
(``score + bias[batch][q_idx]``) works unchanged. qkv runs it on whole tiles where it can: it
first calls it with index tensors that broadcast against the tile, checks once per function that
this gives what the per-element call gives (:func:`qkv.elementwise.call_elementwise`), and otherwise maps it over
the elements with ``torch.vmap``, as Flex does. Like Flex's, a function may not branch in Python
on a tensor's value (``if q_idx > kv_idx``): write ``torch.where(q_idx > kv_idx, ...)``.

Order in every backend::

    s = q·kᵀ·scale  →  s = score_mod(s, b, h, i, j)  →  s = s + float attn_mask
      →  -inf where causal / window / padding / bool mask forbid  →  softmax (with sinks)  →  · V

Built-in score functions (:class:`ScoreMod` subclasses) are also plain callables with this
contract, and in addition describe themselves to the fused kernels as a :class:`KernelForm`:
an optional softcap followed by an optional bias that depends only on ``kv_idx - q_idx``.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from ..devices import follow
from ..elementwise import call_elementwise, check_function, per_element
from ..masks.rules import Alignment, parse_alignment
from .reads import MissedReads, Reads, probe_reads

ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""A score function as FlexAttention writes one: ``fn(score, batch, head, q_idx, kv_idx) -> score``."""


@dataclass(frozen=True)
class KernelForm:
    """A score function as the fused kernels run it: ``s → cap·tanh(s/cap)`` (when ``softcap``),
    then ``s + rel[h, j - i + Nq - 1]`` (when ``rel``: query head h, row i, key j; shape
    ``(Hq, Nq + Nk - 1)``, in the compute dtype, differentiable)."""

    softcap: Optional[float]
    rel: Optional[Tensor]


class ScoreMod:
    """Base class of the built-in score functions (:mod:`qkv.score_mods`).

    A subclass implements :meth:`relative` (a bias by relative position, if any), sets
    ``softcap`` if it caps, and names itself in :meth:`describe`. ``alignment`` places the
    query rows for position-based functions: ``"top_left"`` (query row i at position i),
    ``"bottom_right"`` (the last query at the last key) or None to follow ``is_causal``.
    """

    softcap: Optional[float] = None
    alignment: Optional[Alignment] = None

    def bias(self, rel: Tensor, head: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
        """The additive bias for key position minus query position ``rel`` and query head
        ``head`` (broadcasting integer tensors), or None for a function without one."""
        return None

    def tensors(self) -> tuple[Tensor, ...]:
        """The learnable tensors the function reads (gradients flow to them)."""
        return ()

    def check_heads(self, heads: int) -> None:
        """Raise ValueError if the function cannot serve ``heads`` query heads."""

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ValueError if a parameter cannot be held in ``dtype``, the dtype the call's scores
        are computed in (float32 for float32, float16 and bfloat16 inputs; float64 for float64):
        one that becomes 0 or ±inf there would change the function, not round it. Built-ins with
        tensors check them by default (:func:`check_fits`)."""
        for t in self.tensors():
            check_fits(type(self).__name__, t, dtype)

    def describe(self) -> str:
        """One line for logs and the glass box, e.g. ``softcap 30·tanh(s/30)``."""
        return type(self).__name__

    def kernel_form(self, heads: int, nq: int, nk: int, alignment: Alignment, dtype: torch.dtype,
                    device: Optional[torch.device] = None) -> KernelForm:  # fmt: skip
        """This function for one call (query positions placed by ``self.alignment`` or, when
        that is None, by the call's ``alignment``), its bias on ``device`` (the call's; None:
        where the function's tensors are)."""
        fn = self if device is None else self.on(device)
        offset = nk - nq if (fn.alignment or alignment) == "bottom_right" else 0
        where = device if device is not None else fn.tensors()[0].device if fn.tensors() else None
        rel = torch.arange(max(nq + nk - 1, 0), device=where) - (nq - 1) - offset  # key position − query position
        b = fn.bias(rel[None, :], torch.arange(heads, device=where)[:, None], dtype)
        if b is not None and device is not None:
            b = follow(b, device)  # a subclass that keeps its tensors where on() cannot see them
        return KernelForm(fn.softcap, None if b is None else b.expand(heads, rel.numel()))

    def on(self, device: torch.device) -> "ScoreMod":
        """This function reading its tensors on ``device``: itself when they are there, else a
        copy whose tensor attributes are moved there (differentiably, gradients reach the
        originals; see :func:`qkv.devices.follow`)."""
        moved = {id(t): follow(t, device) for t in self.tensors() if t.device != device}
        if not moved:
            return self
        fn = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, Tensor) and id(value) in moved:
                setattr(fn, name, moved[id(value)])
        return fn

    def __call__(self, score: Tensor, batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """FlexAttention's contract, with query row i at position i (top-left)."""
        if self.softcap is not None:
            score = softcapped(score, self.softcap)
        b = self.bias(kv_idx - q_idx, head, score.dtype)
        return score if b is None else score + b

    def __repr__(self) -> str:
        return f"<qkv score_mod {self.describe()}>"


def check_fits(what: str, t: Tensor, dtype: torch.dtype) -> None:
    """Raise ValueError if a finite entry of ``t`` (a score function's parameter) overflows
    ``dtype`` — a float64 tensor's 1e39 is +inf in float32, and a bias of ±inf is a mask, not the
    number given. Entries that underflow to 0 are rounding: a bias below float32's smallest
    number changes no float32 score. Reads the tensor (a device sync) only when its dtype holds
    numbers ``dtype`` cannot."""
    if not t.is_floating_point() or torch.finfo(t.dtype).max <= torch.finfo(dtype).max or torch.compiler.is_compiling():
        return
    x = t.detach()
    over = torch.isinf(x.to(dtype)) & torch.isfinite(x)
    if bool(over.any()):
        big = float(x[over].abs().max())
        name = str(dtype).replace("torch.", "")
        raise ValueError(
            f"{what}: {big:.3g} becomes inf in {name}, the dtype these inputs' scores are computed in (float32 for "
            f"float32, float16 and bfloat16 inputs); keep every entry within ±{torch.finfo(dtype).max:.3g}, or pass "
            "float64 inputs"
        )


class _Softcap(torch.autograd.Function):
    """``cap·tanh(s/cap)`` with the derivative ``1 − tanh²(s/cap)`` applied directly: autograd
    through the two scalings would multiply the gradient by the cap and then divide it, which
    overflows for a cap near float32's largest number and underflows for a tiny one."""

    generate_vmap_rule = True

    @staticmethod
    def forward(score: Tensor, cap: float) -> Tensor:
        return torch.tanh(score / cap) * cap

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        score, cap = inputs
        ctx.save_for_backward(score)
        ctx.cap = cap

    @staticmethod
    def backward(ctx, grad: Tensor):
        (score,) = ctx.saved_tensors
        t = torch.tanh(score / ctx.cap)
        return grad * (1 - t * t), None


def softcapped(score: Tensor, cap: float) -> Tensor:
    """``cap·tanh(score/cap)``, differentiable without overflow at any cap the kernels take."""
    return _Softcap.apply(score, cap)


def apply_form(form: KernelForm, score: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor, nq: int) -> Tensor:
    """A kernel form on a tile: index tensors broadcast against ``score``; rows of ``nq``."""
    if form.softcap is not None:
        score = softcapped(score, form.softcap)
    if form.rel is not None:
        score = score + form.rel.to(score.dtype)[head, kv_idx - q_idx + (nq - 1)]
    return score


def check_score_mod(score_mod: Any) -> Optional[Any]:
    """``score_mod`` as given (None, a :class:`ScoreMod` or a callable of five arguments), or
    a TypeError that says what is expected."""
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    return check_function(
        score_mod, "score_mod", ("score", "batch", "head", "q_idx", "kv_idx"), "score",
        "; see qkv.score_mods for softcap, ALiBi and relative bias",
    )  # fmt: skip


def captured_tensors(fn: Any, dtype: torch.dtype = torch.float32, device: Any = None) -> tuple[Tensor, ...]:
    """Tensors a score function reads that may need gradients: a built-in's own tensors; for a
    Python callable, those it reads when called once on one element of ``dtype`` scores on
    ``device`` (:func:`qkv.score_mods.reads.probe_reads`), however it reaches them. Tiles the
    backends evaluate are watched too, so a read this probe could not see (a branch on a
    tile's shape, say) still gets its gradient."""
    if isinstance(fn, ScoreMod):
        return tuple(t for t in fn.tensors() if t.requires_grad)
    score = torch.zeros((), dtype=dtype, device=device)
    idx = tuple(torch.zeros((), dtype=torch.long, device=device) for _ in range(4))
    one = torch.Size((1,))
    return probe_reads(fn, (score, *idx), lambda watched: per_element(watched, one, *(t.reshape(1) for t in (score, *idx))))


@dataclass(frozen=True)
class BoundScore:
    """A score function bound to one call, evaluated on tiles of the grouped layout
    ``(B, Hk, G, Nq, Nk)``; :meth:`narrow` follows the backends' head and batch blocks."""

    fn: Optional[ScoreFn]  # the user's callable, a built-in, or None where only the kernel form is known
    form: Optional[KernelForm]  # how fused kernels run it (built-ins), else None
    tensors: tuple[Tensor, ...]  # what it reads that needs gradients (for a built-in: form.rel)
    group: int  # G: query heads per key/value head
    nq: int
    batch0: int = 0  # offsets of the current block in the full call's batch and key/value heads
    head0: int = 0
    # a Python function: the tensors it holds, each read as the one in `tensors` at its place
    # (a float32 upcast, a backward's leaf); empty where it reads `tensors` themselves
    originals: tuple[Tensor, ...] = ()
    watch: bool = False  # a Python function: a read requiring grad beyond these raises MissedReads

    def narrow(self, batch: slice, heads: slice) -> "BoundScore":
        return replace(self, batch0=self.batch0 + (batch.start or 0), head0=self.head0 + (heads.start or 0))

    def watching(self, tensors: Sequence[Tensor]) -> "BoundScore":
        """A Python function bound to read ``tensors`` (those it holds) and watched on every tile:
        a tensor requiring grad that it reads beyond them raises :class:`MissedReads`."""
        return replace(self, tensors=tuple(tensors), originals=(), watch=True)

    def with_tensors(self, tensors: Sequence[Tensor]) -> "BoundScore":
        """The same function reading ``tensors`` in place of its own: a built-in's ``rel``; for a
        Python function, ``tensors`` (16-bit ones upcast to float32, differentiably, so that
        their gradients are summed in float32 as Flex sums them and rounded once) read wherever
        it reads the tensors it holds, however it reaches them (:class:`Reads` swaps them as
        its torch operations receive them); :attr:`tensors` are then the upcast ones."""
        if not tensors:
            return self
        if self.form is None:
            with torch.enable_grad():  # the upcast is part of the graph, even inside a backward
                read = tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors)
            held = self.originals or self.tensors
            if all(r is o for r, o in zip(read, held)):  # the very tensors it reads already: nothing to swap
                return self
            return replace(self, tensors=read, originals=held)
        if self.form.rel is None:
            return self
        return replace(self, form=KernelForm(self.form.softcap, tensors[0]), tensors=tuple(tensors))

    def indices(self, shape: torch.Size, q0: int, k0: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """batch, query head, q_idx, kv_idx of a tile ``(b, h, G, n, w)`` at rows q0, keys k0."""
        b, h, g, n, w = shape
        ar = functools.partial(torch.arange, device=device)
        batch = ar(self.batch0, self.batch0 + b).view(b, 1, 1, 1, 1)
        head = (ar(self.head0, self.head0 + h).view(1, h, 1, 1, 1) * self.group + ar(g).view(1, 1, g, 1, 1))
        return batch, head, ar(q0, q0 + n).view(1, 1, 1, n, 1), ar(k0, k0 + w).view(1, 1, 1, 1, w)

    def vjp(self, raw: Tensor, q0: int, k0: int) -> tuple[Tensor, Callable[[Tensor], list[Tensor]]]:
        """A built-in's modified tile and ``dS' → [dS, d(each of self.tensors)]`` (see :func:`form_vjp`)."""
        assert self.form is not None
        _, head, qi, ki = self.indices(raw.shape, q0, k0, raw.device)
        mod, chain = form_vjp(self.form, raw, head, qi, ki, self.nq)
        if self.tensors:
            return mod, chain
        return mod, lambda ds: chain(ds)[:1]

    def apply(self, s: Tensor, q0: int, k0: int) -> Tensor:
        """The modified scores of a tile ``s (b, h, G, n, w)`` (out of place; autograd flows)."""
        return self.evaluate(s, *self.indices(s.shape, q0, k0, s.device))

    def evaluate(self, s: Tensor, batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The function on scores ``s`` with index tensors of any layout that broadcasts against
        them (chosen heads, arbitrary rows); its result checked and in ``s``'s dtype."""
        if self.form is not None:
            out = apply_form(self.form, s, head, q_idx, kv_idx, self.nq)
        else:
            out = self._call(s, batch, head, q_idx, kv_idx)
        if not isinstance(out, Tensor):
            raise TypeError(f"score_mod returned {type(out).__name__}; it must return the new scores as a tensor")
        if out.shape != s.shape:
            try:
                out = out.expand(s.shape)
            except RuntimeError:
                raise ValueError(
                    f"score_mod returned shape {tuple(out.shape)} for scores of shape {tuple(s.shape)}; it must "
                    "return one score per (batch, head, query, key), e.g. score + bias[head, q_idx - kv_idx]"
                ) from None
        return out.to(s.dtype) if out.dtype != s.dtype else out

    def _call(self, s: Tensor, batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Any:
        """The Python function on a tile, its reads swapped and watched where asked."""
        assert self.fn is not None
        held = self.originals or self.tensors
        swap = {id(o): t for o, t in zip(self.originals, self.tensors) if o is not t}
        if not (swap or self.watch) or torch.compiler.is_compiling():  # (a traced graph sees every read itself)
            return call_elementwise(self.fn, s.shape, s, batch, head, q_idx, kv_idx)
        seen = Reads(swap)
        out = call_elementwise(self.fn, s.shape, s, batch, head, q_idx, kv_idx, around=seen.around)
        missed = seen.missed(held) if self.watch else []
        if missed:
            raise MissedReads(missed)
        return out


def form_vjp(form: KernelForm, raw: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor, nq: int) -> tuple[Tensor, Callable[[Tensor], list[Tensor]]]:
    """A kernel form on a tile of scaled scores, and its vector-Jacobian product written out:
    ``dS' → [dS, d rel]`` (``d rel`` only when the form has a bias). No autograd, so it runs
    inside custom ops and under ``torch.func`` alike."""
    cap, t = form.softcap, None
    mod = raw
    if cap is not None:
        t = torch.tanh(raw / cap)
        mod = t * cap
    where = None
    if form.rel is not None:
        where = (head, kv_idx - q_idx + (nq - 1))
        mod = mod + form.rel.to(raw.dtype)[where]

    def chain(ds: Tensor) -> list[Tensor]:
        out = [ds if t is None else ds * (1 - t * t)]
        if form.rel is not None and where is not None:
            drel = torch.zeros_like(form.rel, dtype=ds.dtype)
            idx = torch.broadcast_tensors(*where, ds)[:2]
            drel.index_put_(idx, ds, accumulate=True)
            out.append(drel.to(form.rel.dtype))
        return out

    return mod, chain


def bind(
    score_mod: Any, heads: int, group: int, nq: int, nk: int, alignment: Alignment, dtype: torch.dtype,
    reads: Optional[Sequence[Tensor]] = None, device: Optional[torch.device] = None,
) -> BoundScore:  # fmt: skip
    """``score_mod`` for one call with ``heads`` query heads in groups of ``group``, scores
    computed in ``dtype`` on ``device`` (a built-in's bias is made there); ``reads``: what
    :func:`captured_tensors` found for a Python function (found here when None)."""
    if isinstance(score_mod, ScoreMod):
        score_mod.check_heads(heads)
        form = score_mod.kernel_form(heads, nq, nk, alignment, dtype, device)
        rel = form.rel
        tensors = (rel,) if rel is not None and rel.requires_grad else ()
        return BoundScore(score_mod, form, tensors, group, nq)
    found = captured_tensors(score_mod, dtype) if reads is None else tuple(reads)
    return BoundScore(score_mod, None, found, group, nq)


def alignment_arg(alignment: Any) -> Optional[Alignment]:
    return parse_alignment(alignment, "alignment")
