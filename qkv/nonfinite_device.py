"""The non-finite rule (:mod:`qkv.nonfinite`) off the CPU: one scan, and kernels that return at once.

On a GPU the rule must not read anything back to the host, and the torch form of it (bool tensors
of the inputs' size, about 25 kernels, 49 with gradients) costs more than the attention kernel at
N ≤ 4096 (measured on an H200: ~1 ms per call). Here it is three Triton kernels
(:mod:`qkv.nonfinite_kernels`), one launch each, decided by the call's structure, never its data:

- **scan** (every call): reads q, k, v and a built-in score function's bias once and writes a
  few int32 flag words: per query row, per key/value head, per bias head, and one word for the
  whole call. No tensor of the inputs' size, no host sync.
- **poison** (every call): NaN into the bad rows of the engine's ``out`` and ``lse`` *in place*;
  each program reads the call's word first and stops when nothing is bad (unless the output must
  be read: a float mask or a Python score function can make a row NaN, whose lse the rule makes
  NaN and whose gradients it makes NaN). With gradients it also sets the gradient flags, and
  finds the rows with nothing to attend to (:func:`qkv.nonfinite.nothing_to_attend`) only where
  a bad query row asks.
- **gradients** (calls with gradients): an identity autograd function placed *before* the engine
  on q, k, v, the sinks and a float mask (:func:`gate`); its backward writes NaN into the
  gradients the engine produced, in place, where the flags say, and returns at once when they
  are clear. A built-in score function's bias (bound inside the engine) gets the rule's NaN added
  to its small ``(Hq, L)`` gradient instead (:class:`_BiasRule`).

**Why writing into ``out`` in place is safe.** A raw kernel write does not bump autograd's
version counter, and an engine's backward may read the ``out`` and ``lse`` it saved (flash
kernels recompute their weights from them). Only bad rows are written, and row (b, h, i) of an
attention output depends on nothing but its query row, its (b, key/value head)'s keys and values,
head h's bias and sink, and row i of a mask. So whatever the engine's backward does with a NaN
there lands only in those inputs' gradients, which the rule makes NaN anyway — all but one: a bad
query row with nothing to attend to keeps the formula's ``dq`` of 0, which the gradient kernel
writes back (bit 2 of its flag). That is why the gradient kernel must see the engine's ``dq`` per
output row: a query broadcast over the batch against keys that are not (its rows summed by
autograd before any gate could see them) takes the torch form; so does a call whose out needs
gradients without a gate (a Python score function reading tensors with gradients: their
gradients are the formula's, which a NaN written into ``out`` would change).

:func:`use_kernels` decides the path by the query's device (:data:`KERNEL_DEVICES`), and off it
under ``torch.compile`` and ``torch.func`` transforms (where :mod:`qkv.nonfinite`'s torch form
traces and batches); :func:`launch` is the one place a kernel starts, so a test can count the
launches of a call on tensors of any device.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any, Optional, Sequence

import torch

#: device types whose calls take the kernels (tests add "cpu" under Triton's interpreter, or
#: "meta" with :func:`launch` counting instead of launching)
KERNEL_DEVICES: tuple[str, ...] = ("cuda",)

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor subclasses (fake, distributed) take the torch form
SCAN_ELEMENTS = 8192  # elements per scan program: 16 KiB of bf16 in flight each
POISON_ROWS = 128  # output rows per poison program: few programs to start when nothing is bad


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Is Triton installed (the kernels' only requirement besides the device)?"""
    return importlib.util.find_spec("triton") is not None


def use_kernels(*tensors: Optional[torch.Tensor]) -> bool:
    """Does a call on these tensors take the kernels: the first one's device is in
    :data:`KERNEL_DEVICES`, all are plain tensors, and no ``torch.compile`` or ``torch.func``
    transform is tracing?"""
    first = tensors[0]
    return (
        first is not None and first.device.type in KERNEL_DEVICES and all(t is None or type(t) in _PLAIN for t in tensors)
        and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active() and available()
    )  # fmt: skip


def launch(name: str, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch kernel ``name`` of :mod:`qkv.nonfinite_kernels` on the current stream of the first
    tensor's device."""
    from . import nonfinite_kernels  # triton, imported at the first launch

    kernel = getattr(nonfinite_kernels, name)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _overlaps(t: torch.Tensor) -> bool:
    """Does ``t`` reach one element through two indices (a zero stride on a dim of size > 1)?"""
    return any(st == 0 and s > 1 for s, st in zip(t.shape, t.stride()))


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Row-major strides of ``shape``, 0 on its dims of size 1 (so they broadcast)."""
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc if shape[d] != 1 else 0
        acc *= shape[d]
    return out


class _Segment:
    """A tensor ``(..., C)`` as rows for :func:`scan_kernel` / :func:`grads_kernel`: up to 4 row
    dims after merging, read once each (``dedupe``: a zero-stride dim as size 1), with the flag
    words at ``off`` (``row // div``). ``ok`` is False where the rows need more than 4 dims."""

    def __init__(self, t: Optional[torch.Tensor], off: int = 0, div: int = 1, dedupe: bool = True):
        self.t, self.off, self.div = t, off, max(1, div)
        self.sizes, self.strides, self.c, self.sc, self.rows, self.ok = [1, 1, 1, 1], [0, 0, 0, 0], 0, 1, 0, True
        if t is None or t.numel() == 0:
            return
        shape, stride = list(t.shape), list(t.stride())
        if dedupe:
            shape = [1 if st == 0 else s for s, st in zip(shape, stride)]
        self.c, self.sc = shape[-1], stride[-1]
        dims: list[list[int]] = []
        for s, st in zip(shape[:-1], stride[:-1]):
            if s == 1:
                continue
            if dims and dims[-1][1] == st * s:
                dims[-1] = [dims[-1][0] * s, st]
            else:
                dims.append([s, st])
        if len(dims) > 4:
            self.ok = False
            return
        dims = [[1, 0]] * (4 - len(dims)) + dims
        self.sizes, self.strides = [d[0] for d in dims], [d[1] for d in dims]
        self.rows = math.prod(self.sizes)

    def args(self) -> list[Any]:
        return [self.rows, *self.sizes[1:], *self.strides, self.c, self.sc, self.off, self.div]


def _launch_rows(kernel: str, words: torch.Tensor, segments: Sequence[_Segment], fallback: torch.Tensor) -> None:
    """One launch of ``kernel`` over these segments' rows (absent ones get no programs)."""
    c = max([s.c for s in segments[:3] if s.rows] or [s.c for s in segments if s.rows] or [1])  # q, k, v's head dims (a bias row loops)
    block_c = min(_pow2(c), 256)
    block_r = max(16, SCAN_ELEMENTS // block_c)
    starts, total = [], 0
    for s in segments:
        starts.append(total)
        total += -(-s.rows // block_r)
    if total == 0:
        return
    args: list[Any] = [words, *(s.t if s.rows else fallback for s in segments)]
    for s in segments:
        args += s.args()
    launch(kernel, (total,), *args, *starts[1:], BLOCK_R=block_r, BLOCK_C=block_c)


def _dedupe_shape(t: torch.Tensor, dims: int) -> list[int]:
    """The first ``dims`` sizes of ``t``, 1 where its stride is 0 (what the scan reads once)."""
    return [1 if st == 0 else s for s, st in zip(t.shape[:dims], t.stride()[:dims])]


def _align(strides: Sequence[int], shape: Sequence[int], nb: int) -> list[int]:
    """Strides over ``nb`` batch dims of a tensor whose batch dims ``shape`` (with ``strides``)
    broadcast to them, right-aligned: 0 where it has size 1 or no such dim."""
    out = [0] * nb
    for j in range(1, min(len(shape), nb) + 1):
        out[nb - j] = strides[len(shape) - j] if shape[len(shape) - j] != 1 else 0
    return out


def _merge(ob: Sequence[int], maps: dict[str, list[int]]) -> Optional[tuple[int, dict[str, list[int]]]]:
    """The batch dims ``ob`` merged where every tensor's strides allow (each a stride of the next
    times its size), size-1 dims dropped: ``(size of the second, {name: [stride0, stride1]})``,
    None when more than 2 dims remain."""
    merged: list[tuple[int, dict[str, int]]] = []
    for d, s in enumerate(ob):
        if s == 1:
            continue
        st = {n: m[d] for n, m in maps.items()}
        if merged and all(merged[-1][1][n] == st[n] * s for n in st):
            merged[-1] = (merged[-1][0] * s, st)
        else:
            merged.append((s, st))
    if len(merged) > 2:
        return None
    merged = [(1, {n: 0 for n in maps})] * (2 - len(merged)) + merged
    return merged[1][0], {n: [merged[0][1][n], merged[1][1][n]] for n in maps}


def _batch_dims(t: torch.Tensor) -> int:
    return max(0, t.dim() - 3)


def _padded(t: torch.Tensor, nb: int) -> list[int]:
    """The batch sizes of ``t`` (dims before ``(H, N, D)``), padded with 1s in front to ``nb``."""
    lead = list(t.shape[: _batch_dims(t)])
    return [1] * (nb - len(lead)) + lead


RULE_ATTR = "_qkv_nonfinite_rule"  # the gated query carries its call's Rule (no registry to leak)


class Rule:
    """One call's rule on the device: its flag words (one int32 tensor, zeroed when allocated) and
    where the kernels find each tensor. ``grads``: the tensors :func:`gate` put a gate on, by role
    (query, key, value, sinks, mask); None for a call without gradients."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grads: Optional[dict[str, torch.Tensor]] = None):
        self.query, self.key, self.value = query, key, value
        self.hq = query.shape[-3] if query.dim() >= 3 else 1
        self.hk = key.shape[-3] if key.dim() >= 3 else 1
        self.qf = _dedupe_shape(query, query.dim() - 1)  # (..., Hq, Nq): the query rows the scan reads
        self.kf = _dedupe_shape(key, key.dim() - 2)  # (..., Hk): the key heads it reads
        self.vf = _dedupe_shape(value, value.dim() - 2)
        self.gated = grads is not None
        self.mask = None if grads is None else grads.get("mask")
        sizes = {"qf": math.prod(self.qf), "kf": math.prod(self.kf), "vf": math.prod(self.vf), "bf": self.hq}
        if self.gated:
            sizes.update(gq=math.prod(query.shape[:-1]), gk=math.prod(key.shape[:-2]), gv=math.prod(value.shape[:-2]), gh=self.hq,
                         gm=0 if self.mask is None else math.prod(self.mask.shape[:-1]))  # fmt: skip
        self.off, total = {}, 1  # word 0: bit 1, an input is bad; bit 2, some gradient flag is set
        for name, n in sizes.items():
            self.off[name] = total
            total += n
        self.words = torch.zeros(total, dtype=torch.int32, device=query.device)

    def fits(self, ob: Sequence[int], out_strides: Sequence[int], lse_strides: Sequence[int]) -> bool:
        """Do the kernels take this call with an output of batch dims ``ob`` and these strides?"""
        return all(_Segment(t).ok for t in (self.query, self.key, self.value)) and self._maps(ob, out_strides, lse_strides) is not None

    def _maps(self, ob: Sequence[int], out_strides: Sequence[int], lse_strides: Sequence[int]):
        """Each tensor's strides over the output's batch dims ``ob``, merged (:func:`_merge`)."""
        nb = len(ob)
        q, k, v = self.query, self.key, self.value
        qb, kb, vb = _batch_dims(q), _batch_dims(k), _batch_dims(v)
        maps = {
            "qf": _align(_contiguous_strides(self.qf)[:qb], self.qf[:qb], nb),
            "kf": _align(_contiguous_strides(self.kf)[:kb], self.kf[:kb], nb),
            "vf": _align(_contiguous_strides(self.vf)[:vb], self.vf[:vb], nb),
            "o": _align(out_strides[:nb], ob, nb),
            "l": _align(lse_strides[:nb], ob, nb) if lse_strides else [0] * nb,
            "q": _align(q.stride()[:qb], q.shape[:qb], nb),
            "k": _align(k.stride()[:kb], k.shape[:kb], nb),
            "gq": _align(_contiguous_strides(q.shape[:-1])[:qb], q.shape[:qb], nb),
            "gk": _align(_contiguous_strides(k.shape[:-2])[:kb], k.shape[:kb], nb),
            "gv": _align(_contiguous_strides(v.shape[:-2])[:vb], v.shape[:vb], nb),
            "gm": self._mask_strides(nb)[:nb],
        }
        return _merge(ob, maps)

    def _mask_strides(self, nb: int) -> list[int]:
        """The mask's row flags over ``(..., Hq, Nq)`` (``nb`` batch dims): 0 where it broadcasts."""
        if self.mask is None:
            return [0] * (nb + 2)
        lead = list(self.mask.shape[:-1])
        return _align(_contiguous_strides(lead), lead, nb + 2)

    def scan(self, bias: Optional[torch.Tensor]) -> None:
        """The one read of q, k, v and ``bias (Hq, L)``: :func:`~qkv.nonfinite_kernels.scan_kernel`."""
        q, k, v = self.query, self.key, self.value
        segs = [
            _Segment(q, self.off["qf"]),
            _Segment(k, self.off["kf"], div=_dedupe_shape(k, k.dim())[-2]),
            _Segment(v, self.off["vf"], div=_dedupe_shape(v, v.dim())[-2]),
            _Segment(bias, self.off["bf"], dedupe=False),
        ]
        _launch_rows("scan_kernel", self.words, segs, q)

    def finish(
        self, out: torch.Tensor, lse: Optional[torch.Tensor], *, bias: Optional[torch.Tensor], read_out: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Scan, then :func:`~qkv.nonfinite_kernels.poison_kernel` on ``out (..., Hq, Nq, Dv)`` and
        ``lse (..., Hq, Nq)`` in place (contiguous copies first where their strides do not merge:
        :meth:`fits` held for contiguous ones)."""
        self.scan(bias)
        ob = list(out.shape[:-3])
        merged = self._maps(ob, out.stride(), [] if lse is None else lse.stride())
        if merged is None:
            out, lse = out.contiguous(), None if lse is None else lse.contiguous()
            merged = self._maps(ob, out.stride(), [] if lse is None else lse.stride())
        assert merged is not None, "Rule.fits() before the engine"
        nb1, st = merged
        nq, dv = out.shape[-2], out.shape[-1]
        rows = math.prod(out.shape[:-1])  # (..., Hq, Nq)
        if rows == 0:
            return out, lse
        q, k, v = self.query, self.key, self.value
        d, nk = q.shape[-1], k.shape[-2]
        block_m = min(POISON_ROWS, max(16, _pow2(nq)))
        nmb = -(-nq // block_m)
        three = out.dim() >= 3
        h_of = lambda t, d: t.stride(d) if t.dim() >= 3 else 0  # noqa: E731  (a 2-D tensor has one head)
        qf, kf, vf = _contiguous_strides(self.qf), _contiguous_strides(self.kf), _contiguous_strides(self.vf)
        gq, gk, gv = _contiguous_strides(q.shape[:-1]), _contiguous_strides(k.shape[:-2]), _contiguous_strides(v.shape[:-2])
        gm = self._mask_strides(len(ob))[len(ob) :]
        off = self.off
        launch(
            "poison_kernel", (rows // nq * nmb,), self.words, out, out if lse is None else lse, q, k,
            self.hq, nq, nk, max(1, self.hq // max(1, self.hk)), d, dv, nb1, nmb,
            off["qf"], off["kf"], off["vf"], off["bf"],
            off.get("gq", 0), off.get("gk", 0), off.get("gv", 0), off.get("gh", 0), off.get("gm", 0),
            *st["qf"], qf[-2] if q.dim() >= 3 else 0, qf[-1],
            *st["kf"], kf[-1] if k.dim() >= 3 else 0, *st["vf"], vf[-1] if v.dim() >= 3 else 0,
            1 if bias is not None and bias.shape[0] != 1 else 0,
            *st["o"], out.stride(-3) if three else 0, out.stride(-2), out.stride(-1),
            *st["l"], (lse.stride(-2) if three else 0) if lse is not None else 0, 0 if lse is None else lse.stride(-1),
            *st["q"], h_of(q, -3), q.stride(-2), q.stride(-1),
            *st["k"], h_of(k, -3), k.stride(-2), k.stride(-1),
            *st["gq"], gq[-2] if q.dim() >= 3 else 0, gq[-1], *st["gk"], gk[-1] if k.dim() >= 3 else 0,
            *st["gv"], gv[-1] if v.dim() >= 3 else 0,
            *st["gm"], gm[0], gm[1],
            READ_OUT=read_out, HAS_LSE=lse is not None, HAS_BIAS=bias is not None, GRAD=self.gated, HAS_GMASK=self.mask is not None,
            BLOCK_M=block_m, BLOCK_DV=min(_pow2(max(1, dv)), 128), BLOCK_N=32, BLOCK_D=min(_pow2(max(1, d)), 64),
        )  # fmt: skip
        return out, lse

    def fix_gradients(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:func:`~qkv.nonfinite_kernels.grads_kernel` on the engine's gradients, in place (on a
        copy where one is read through two indices, has rows past 4 dims, or a double backward
        will differentiate it): NaN where the rule says, the formula's 0 in ``dq`` where a bad row
        had nothing to attend to."""
        grads = {
            n: g.contiguous() if _overlaps(g) or not _Segment(g, dedupe=False).ok else g.clone() if torch.is_grad_enabled() else g
            for n, g in grads.items()
        }  # fmt: skip
        if not grads:
            return grads
        off, k, v = self.off, self.key, self.value
        sinks = grads.get("sinks")
        segs = [
            _Segment(grads.get("query"), off["gq"], dedupe=False),
            _Segment(grads.get("key"), off["gk"], div=k.shape[-2], dedupe=False),
            _Segment(grads.get("value"), off["gv"], div=v.shape[-2], dedupe=False),
            _Segment(None if sinks is None else sinks.unsqueeze(-1), off["gh"], dedupe=False),
            _Segment(grads.get("mask"), off["gm"], dedupe=False),
        ]
        _launch_rows("grads_kernel", self.words, segs, next(iter(grads.values())))
        return grads

    def heads_passing_nan(self) -> torch.Tensor:
        """Bool ``(Hq,)``: query heads with a row that passes NaN on (a view of the words: no sync)."""
        return self.words[self.off["gh"] : self.off["gh"] + self.hq] != 0


class _Gate(torch.autograd.Function):
    """Identity on the tensors a call's engine reads (q, k, v, sinks, a float mask); backward: the
    gradients the engine produced, after :meth:`Rule.fix_gradients` (in place)."""

    @staticmethod
    def forward(ctx, rule: Rule, names: tuple[str, ...], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.rule, ctx.names = rule, names
        ctx.set_materialize_grads(False)  # a gradient the engine does not produce stays None: nothing to fix
        outs = tuple(t.view_as(t) for t in tensors)
        ctx.mark_non_differentiable(*(o for o, wanted in zip(outs, ctx.needs_input_grad[2:]) if not wanted))
        return outs

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):  # type: ignore[override]
        fixed = ctx.rule.fix_gradients({n: g for n, g in zip(ctx.names, grads) if g is not None})
        return (None, None, *(fixed.get(n) for n in ctx.names))


class _BiasRule(torch.autograd.Function):
    """Identity on ``(out, lse)``; backward: NaN added to a built-in score function's bias
    ``rel (Hq, L)`` on the heads with a row that passes NaN on (its gradient is small; the engine
    binds its own ``rel``, which no gate can reach)."""

    @staticmethod
    def forward(ctx, rule: Rule, bias: torch.Tensor, out: torch.Tensor, *lse: torch.Tensor):  # type: ignore[override]
        ctx.rule, ctx.shape, ctx.dtype = rule, bias.shape, bias.dtype
        ctx.set_materialize_grads(False)
        return (out.view_as(out), *(t.view_as(t) for t in lse))

    @staticmethod
    def backward(ctx, dout: Optional[torch.Tensor], *dlse: Optional[torch.Tensor]):  # type: ignore[override]
        heads = ctx.rule.heads_passing_nan()  # (Hq,)
        if ctx.shape[0] == 1:
            heads = heads.any(0, keepdim=True)
        dbias = torch.where(heads, float("nan"), 0.0).to(ctx.dtype)[:, None].expand(ctx.shape)
        return (None, dbias, dout, *dlse)


def gate(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None
) -> Optional[dict[str, Optional[torch.Tensor]]]:
    """Put the rule's gate (:class:`_Gate`) before the engine, for a call with gradients on the
    kernels' path: the tensors to hand the engine, by role (q, k, v, sinks, mask), the query
    carrying the call's :class:`Rule`; None where the call keeps the torch form (no gradient,
    another path, or a structure the kernels do not take: module docstring)."""
    named = {"query": query, "key": key, "value": value, "sinks": sinks, "mask": mask}
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in named.values()):
        return None
    if not use_kernels(query, key, value, sinks, mask):
        return None
    nb = max(_batch_dims(query), _batch_dims(key), _batch_dims(value))
    padded = [_padded(t, nb) for t in (query, key, value)]
    ob = [next((s for s in col if s != 1), 1) for col in zip(*padded)]  # the output's batch dims
    if padded[0] != ob:
        return None  # the query broadcast over the batch: autograd sums its rows before a gate sees them
    through = {n: t for n, t in named.items() if t is not None and (n in ("query", "key", "value") or t.requires_grad)}
    rule = Rule(query, key, value, through)
    out_shape = [*ob, rule.hq, query.shape[-2], value.shape[-1]] if query.dim() >= 3 else [query.shape[-2], value.shape[-1]]
    if not rule.fits(ob, _contiguous_strides(out_shape), _contiguous_strides(out_shape[:-1])):
        return None
    outs = _Gate.apply(rule, tuple(through), *through.values())
    gated = dict(named, **dict(zip(through, outs)))
    setattr(gated["query"], RULE_ATTR, rule)
    return gated


def apply(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor], *,
    bias: Optional[torch.Tensor], read_out: bool,
) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:  # fmt: skip
    """:func:`qkv.nonfinite.guard` on the kernels' path: ``(out, lse)`` after the rule (the same
    tensors, written in place), or None where the torch form must run: an output that needs
    gradients without a gate, or one read through two indices."""
    rule = getattr(query, RULE_ATTR, None)
    if rule is None:
        if out.requires_grad or (lse is not None and lse.requires_grad) or _overlaps(out) or (lse is not None and _overlaps(lse)):
            return None
        rule = Rule(query, key, value)
        ob = list(out.shape[:-3])
        shape = list(out.shape)
        if not rule.fits(ob, _contiguous_strides(shape), _contiguous_strides(shape[:-1])):
            return None
    elif _overlaps(out) or (lse is not None and _overlaps(lse)):
        out, lse = out.contiguous(), None if lse is None else lse.contiguous()
    out, lse = rule.finish(out, lse, bias=bias, read_out=read_out)
    if rule.gated and bias is not None and bias.requires_grad and torch.is_grad_enabled():
        res = _BiasRule.apply(rule, bias, out, *([] if lse is None else [lse]))
        out, lse = res[0], (None if lse is None else res[1])
    return out, lse


__all__ = ["KERNEL_DEVICES", "RULE_ATTR", "Rule", "apply", "available", "gate", "launch", "use_kernels"]
