"""Block-sparse attention masks: which (query block, key block) pairs are computed at all.

Shape legend::

    ...  batch / head dims (broadcast like any mask)   Nq, Nk  query / key length
    Bq, Bk  number of query / key blocks (ceil(N / block size))

A :class:`BlockSparseMask` is a bool ``layout (..., Bq, Bk)`` plus, optionally, a rule for the
pairs inside the computed blocks (a token-level window, causality, or an explicit dense mask).
It means exactly its dense bool mask (:meth:`BlockSparseMask.to_dense`, True = may attend):
pass it as ``attn_mask=`` to :func:`qkv.attention` or :mod:`qkv.nn` and every backend gives the
answer of that dense mask. The call keeps the layout as blocks: the ``chunked`` backend (and
``auto`` on a CPU) runs each row block over the keys of its blocks only, forward and backward,
building no ``Nq × Nk`` mask (a rule inside the blocks is applied to that small tile), so the
time follows the density; backends that read a dense mask get it built once for the call.

Constructors for the published patterns::

    longformer(n, window, global_tokens)     sliding window + global tokens (Beltagy et al., 2020)
    bigbird(n, block_size, ...)              window + global + random blocks (Zaheer et al., 2020)
    strided(n, block_size, stride)           local + strided blocks (Child et al., 2019)
    from_dense(mask, block_size)             any bool mask, with its empty blocks found
    from_mask_mod(mask_mod, batch, heads, nq, nk)  FlexAttention's mask function (b, h, q_idx, kv_idx) -> bool
    from_block_mask(block_mask)              FlexAttention's BlockMask (its layout and mask function)

``a & b`` is the mask of both (same shape and block size). ``qkv.attention(..., mask_mod=fn)``
builds ``from_mask_mod`` for the call; build it once yourself (as Flex's ``create_block_mask``)
and pass it as ``attn_mask`` to reuse it over a loop of calls.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from .elementwise import call_elementwise, check_function

__all__ = ["BlockSparseMask", "longformer", "bigbird", "strided", "from_dense", "from_mask_mod", "from_block_mask"]

Rule = Callable[[Tensor, Tensor], Tensor]  # (rows (R, 1), cols (1, C)) -> allowed (..., R, C)


def _positive_int(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")
    return value


@dataclass(frozen=True, eq=False)
class BlockSparseMask:
    """A block layout and an optional rule inside the computed blocks (see the module docstring).

    ``layout`` bool ``(..., Bq, Bk)``; ``block_size`` ``(rows, cols)`` per block; ``shape``
    ``(Nq, Nk)``; ``rule(rows, cols)`` gives the allowed pairs for index tensors ``rows (R, 1)`` and
    ``cols (1, C)`` (None = every pair of a computed block); ``name`` describes the pattern;
    ``mask_mod``, where known, is the whole mask as FlexAttention's per-element function (layouts
    made from one keep it, for engines that run mask functions).
    """

    layout: Tensor
    block_size: tuple[int, int]
    shape: tuple[int, int]
    rule: Optional[Rule] = None
    name: str = "block-sparse"
    mask_mod: Optional["MaskMod"] = None  # the per-element form of the whole mask, where one is known (Flex)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, Tensor) or self.layout.dtype != torch.bool or self.layout.dim() < 2:
            raise TypeError("layout must be a bool tensor (..., query blocks, key blocks)")
        bq, bk = self.block_size
        nq, nk = self.shape
        want = (-(-nq // bq), -(-nk // bk))
        if tuple(self.layout.shape[-2:]) != want:
            raise ValueError(
                f"layout has {tuple(self.layout.shape[-2:])} blocks but a ({nq}, {nk}) mask in blocks of "
                f"{self.block_size} has {want}"
            )

    # ---- facts ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def density(self) -> float:
        """Fraction of the ``Nq × Nk`` pairs inside computed blocks (the work a block-skipping
        kernel does, relative to dense attention)."""
        bq, bk = self.block_size
        nq, nk = self.shape
        if nq * nk == 0:
            return 0.0
        rows = torch.full((self.layout.shape[-2],), bq, dtype=torch.float64)
        cols = torch.full((self.layout.shape[-1],), bk, dtype=torch.float64)
        rows[-1], cols[-1] = nq - bq * (len(rows) - 1), nk - bk * (len(cols) - 1)  # the last blocks may be short
        area = self.layout.to(torch.float64).cpu() * rows[:, None] * cols[None, :]
        return float(area.sum() / (nq * nk * max(1, area[..., 0, 0].numel())))

    @property
    def sparsity(self) -> float:
        """1 − density."""
        return 1.0 - self.density

    def to_dense(self, device: Optional[Union[str, torch.device]] = None) -> Tensor:
        """The bool mask ``(..., Nq, Nk)`` this layout means (True = may attend)."""
        device = self.device if device is None else torch.device(device)
        bq, bk = self.block_size
        nq, nk = self.shape
        dense = self.layout.to(device).repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :nq, :nk]
        if self.rule is not None:
            rows = torch.arange(nq, device=device)[:, None]
            cols = torch.arange(nk, device=device)[None, :]
            dense = dense & self.rule(rows, cols)
        return dense.contiguous()

    def to_string(self, max_blocks: int = 48) -> str:
        """An ASCII picture of the layout (█ computed, · skipped); large layouts are shown at a
        coarser grid where a cell is computed if any block under it is."""
        lay = self.layout.flatten(0, -3).any(0).cpu() if self.layout.dim() > 2 else self.layout.cpu()
        step = max(1, -(-max(lay.shape) // max_blocks))
        if step > 1:
            r, c = -(-lay.shape[0] // step), -(-lay.shape[1] // step)
            lay = torch.nn.functional.pad(lay, (0, c * step - lay.shape[1], 0, r * step - lay.shape[0]))
            lay = lay.view(r, step, c, step).any(3).any(1)
        head = (f"{self.name}: {self.shape[0]}×{self.shape[1]} in blocks of {self.block_size[0]}×{self.block_size[1]}, "
                f"density {self.density:.1%}" + (f" (one character = {step}×{step} blocks)" if step > 1 else ""))
        rows = ["".join("█" if x else "·" for x in row) for row in lay.tolist()]
        return "\n".join([head] + rows)

    def __and__(self, other: "BlockSparseMask") -> "BlockSparseMask":
        """The pairs both masks allow: the layouts' common blocks, and both rules inside them."""
        if not isinstance(other, BlockSparseMask):
            return NotImplemented
        if other.shape != self.shape or other.block_size != self.block_size:
            raise ValueError(
                f"cannot combine a BlockSparseMask of shape {self.shape} in blocks of {self.block_size} with one of "
                f"{other.shape} in blocks of {other.block_size}; build both for the same shape and block_size"
            )
        rule = _both(self.rule, other.rule)
        both = _both(self.mask_mod, other.mask_mod) if self.mask_mod is not None and other.mask_mod is not None else None
        lay = torch.logical_and(self.layout, other.layout.to(self.layout.device))
        return BlockSparseMask(lay, self.block_size, self.shape, rule, f"{self.name} & {other.name}", both)

    def __repr__(self) -> str:
        return (f"BlockSparseMask({self.name}, shape={self.shape}, block_size={self.block_size}, "
                f"layout={tuple(self.layout.shape)}, density={self.density:.3f})")

    def __str__(self) -> str:
        return self.to_string()


def _both(first: Optional[Callable[..., Tensor]], second: Optional[Callable[..., Tensor]]) -> Optional[Callable[..., Tensor]]:
    """A predicate true where both are (None: every pair; one None: the other)."""
    if first is None or second is None:
        return first if second is None else second

    def both(*idx: Tensor) -> Tensor:
        return first(*idx) & second(*idx)

    return both


def _layout_grid(n: int, block_size: int) -> tuple[int, Tensor]:
    nb = -(-n // block_size)
    return nb, torch.arange(nb)


def longformer(n: int, window: int, global_tokens: Union[int, Sequence[int]] = (), *, block_size: int = 64) -> BlockSparseMask:
    """Longformer's pattern: token i sees tokens j with ``|i − j| ≤ window``; global tokens see
    everything and are seen by everything. ``global_tokens``: a count (the first tokens, e.g.
    [CLS]) or a list of indices."""
    _positive_int("n", n)
    _positive_int("window", window, 0)
    _positive_int("block_size", block_size)
    if isinstance(global_tokens, int) and not isinstance(global_tokens, bool):
        if not 0 <= global_tokens <= n:
            raise ValueError(f"global_tokens={global_tokens} must be between 0 and n={n}")
        g = list(range(global_tokens))
    else:
        g = sorted(set(int(t) for t in global_tokens))
        bad = [t for t in g if not 0 <= t < n]
        if bad:
            raise ValueError(f"global_tokens {bad} are outside 0..{n - 1}")
    glob = torch.zeros(n, dtype=torch.bool)
    glob[g] = True
    nb, b = _layout_grid(n, block_size)
    # a block pair is computed if any of its pairs is in the window band, or it holds a global row/col
    near = (b[:, None] - b[None, :]).abs() * block_size <= window + block_size - 1
    gb = torch.zeros(nb, dtype=torch.bool)
    gb[[t // block_size for t in g]] = True
    layout = near | gb[:, None] | gb[None, :]

    def rule(rows: Tensor, cols: Tensor) -> Tensor:
        gd = glob.to(rows.device)
        return ((rows - cols).abs() <= window) | gd[rows] | gd[cols]

    return BlockSparseMask(layout, (block_size, block_size), (n, n), rule, f"longformer(window={window}, global={len(g)})")


def bigbird(
    n: int, block_size: int = 64, num_window_blocks: int = 3, num_global_blocks: int = 1, num_random_blocks: int = 2,
    seed: int = 0,
) -> BlockSparseMask:
    """BigBird's block pattern: each query block sees ``num_window_blocks`` blocks around itself
    (odd, centred), the first ``num_global_blocks`` blocks (which also see everything), and
    ``num_random_blocks`` other key blocks drawn with ``seed``."""
    _positive_int("n", n)
    _positive_int("block_size", block_size)
    _positive_int("num_window_blocks", num_window_blocks)
    if num_window_blocks % 2 == 0:
        raise ValueError(f"num_window_blocks={num_window_blocks} must be odd (the block itself and as many on each side)")
    _positive_int("num_global_blocks", num_global_blocks, 0)
    _positive_int("num_random_blocks", num_random_blocks, 0)
    nb, b = _layout_grid(n, block_size)
    layout = (b[:, None] - b[None, :]).abs() <= num_window_blocks // 2
    layout[:num_global_blocks, :] = True
    layout[:, :num_global_blocks] = True
    gen = torch.Generator().manual_seed(seed)
    for i in range(nb):
        free = (~layout[i]).nonzero().flatten()
        if free.numel():
            pick = free[torch.randperm(free.numel(), generator=gen)[:num_random_blocks]]
            layout[i, pick] = True
    name = f"bigbird(window={num_window_blocks}, global={num_global_blocks}, random={num_random_blocks})"
    return BlockSparseMask(layout, (block_size, block_size), (n, n), None, name)


def strided(n: int, block_size: int, stride: int, *, causal: bool = True) -> BlockSparseMask:
    """The Sparse Transformer's strided pattern on blocks: query block i sees key blocks j with
    ``i − stride < j ≤ i`` (local) or ``(i − j) % stride == 0`` (strided, the "summary" blocks).
    ``causal=True`` (default) also applies token-level causality inside the blocks, the
    autoregressive form; ``causal=False`` mirrors the pattern to both sides."""
    _positive_int("n", n)
    _positive_int("block_size", block_size)
    _positive_int("stride", stride)
    nb, b = _layout_grid(n, block_size)
    dist = b[:, None] - b[None, :]
    if causal:
        layout = (dist >= 0) & ((dist < stride) | (dist % stride == 0))
        rule: Optional[Rule] = lambda rows, cols: cols <= rows  # noqa: E731
    else:
        layout = (dist.abs() < stride) | (dist % stride == 0)
        rule = None
    return BlockSparseMask(layout, (block_size, block_size), (n, n), rule, f"strided(stride={stride}{', causal' if causal else ''})")


def from_dense(mask: Tensor, block_size: Union[int, tuple[int, int]] = 64) -> BlockSparseMask:
    """The layout of a bool mask ``(..., Nq, Nk)``: blocks with some True entry are computed, and
    the mask itself decides inside them (``to_dense()`` gives ``mask`` back)."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() < 2:
        raise TypeError("from_dense needs a bool tensor (..., Nq, Nk) with True = may attend")
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    _positive_int("block_size", bq)
    _positive_int("block_size", bk)
    nq, nk = mask.shape[-2:]
    rq, rk = -(-nq // bq), -(-nk // bk)
    padded = torch.nn.functional.pad(mask, (0, rk * bk - nk, 0, rq * bq - nq))
    layout = padded.reshape(*mask.shape[:-2], rq, bq, rk, bk).any(-1).any(-2)
    def rule(rows: Tensor, cols: Tensor) -> Tensor:
        return mask.to(rows.device)[..., rows[:, 0], :][..., cols[0]]

    return BlockSparseMask(layout, (bq, bk), (nq, nk), rule, "from_dense")


MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (batch, head, q_idx, kv_idx) -> allowed

# Pairs evaluated at once while a mask function's layout is found (bounds the memory it takes).
_LAYOUT_CHUNK = 1 << 22


def check_mask_mod(mask_mod: Any) -> MaskMod:
    """``mask_mod`` if it is callable with FlexAttention's four arguments, else a TypeError saying so."""
    return check_function(mask_mod, "mask_mod", ("batch", "head", "q_idx", "kv_idx"), "bool tensor")


def _allowed(mask_mod: MaskMod, b: Tensor, h: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """The mask function on broadcasting index tensors ``(B|1, H|1, R|1, C|1)``, as a bool tensor."""
    shape = torch.broadcast_shapes(b.shape, h.shape, rows.shape, cols.shape)
    if math.prod(shape) == 0:  # no pair to ask about
        return torch.zeros(shape, dtype=torch.bool, device=rows.device)
    out = call_elementwise(mask_mod, shape, b, h, rows, cols)
    if isinstance(out, (bool, np.bool_)):  # a constant, as FlexAttention takes it: every pair, or none
        out = torch.tensor(bool(out), device=rows.device)
    if not isinstance(out, Tensor):
        raise TypeError(
            f"mask_mod returned {type(out).__name__}; it must return a bool tensor (True = may attend) or a constant True/False"
        )
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod returned {out.dtype} values; it must return bool (True = may attend)")
    return out.reshape((1,) * (len(shape) - out.dim()) + tuple(out.shape))  # (B|1, H|1, R|1, C|1), however few dims


def from_mask_mod(
    mask_mod: MaskMod,
    batch: Union[int, Sequence[int], None],
    heads: Optional[int],
    nq: int,
    nk: Optional[int] = None,
    *,
    block_size: Union[int, tuple[int, int]] = 64,
    device: Union[str, torch.device, None] = None,
) -> BlockSparseMask:
    """FlexAttention's ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` as a layout of blocks (the
    ones holding an allowed pair) and the function itself as the rule inside them — what Flex's
    ``create_block_mask`` builds. ``batch`` (an int or the batch dims; ``batch`` is then the
    flattened index) and ``heads`` may be None where the function reads neither. The function is
    evaluated over every pair once, a few million at a time: no ``Nq × Nk`` mask is kept."""
    mask_mod = check_mask_mod(mask_mod)
    nk = nq if nk is None else nk
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    for name, value in (("nq", nq), ("nk", nk)):
        _positive_int(name, value, 0)
    _positive_int("block_size", bq)
    _positive_int("block_size", bk)
    batch_shape = () if batch is None else (batch,) if isinstance(batch, int) else tuple(batch)
    nb, nh = math.prod(batch_shape), 1 if heads is None else _positive_int("heads", heads, 0)
    dev = torch.device("cpu") if device is None else torch.device(device)
    b = torch.arange(nb, device=dev).view(nb, 1, 1, 1)
    h = torch.arange(nh, device=dev).view(1, nh, 1, 1)
    rq, rk = -(-nq // bq), -(-nk // bk)
    cols_per = max(bk, _LAYOUT_CHUNK // max(1, nb * nh * bq) // bk * bk)  # keys per evaluation, whole blocks
    rows_out = []
    if nb * nh == 0:  # no batch entry or head to ask about: an empty layout of the call's dims
        empty = torch.zeros(nb, nh, rq, rk, dtype=torch.bool, device=dev)
        return BlockSparseMask(_with_batch_dims(empty, batch_shape), (bq, bk), (nq, nk), None, "mask_mod", mask_mod)
    for i in range(rq):
        rows = torch.arange(i * bq, min(nq, (i + 1) * bq), device=dev).view(1, 1, -1, 1)
        parts = []
        for k0 in range(0, nk, cols_per):
            cols = torch.arange(k0, min(nk, k0 + cols_per), device=dev).view(1, 1, 1, -1)
            ok = _allowed(mask_mod, b, h, rows, cols).expand(-1, -1, rows.shape[2], cols.shape[3])
            pad = -ok.shape[-1] % bk
            ok = torch.nn.functional.pad(ok, (0, pad)) if pad else ok
            parts.append(ok.any(-2).reshape(*ok.shape[:2], -1, bk).any(-1))  # (B|1, H|1, key blocks)
        rows_out.append(torch.cat(parts, -1) if parts else torch.zeros(1, 1, rk, dtype=torch.bool, device=dev))
    lead = torch.broadcast_shapes(*(r.shape[:2] for r in rows_out)) if rows_out else (1, 1)
    layout = torch.stack([r.expand(*lead, rk) for r in rows_out], -2) if rows_out else torch.zeros(1, 1, 0, rk, dtype=torch.bool, device=dev)
    layout = _with_batch_dims(layout, batch_shape)

    def rule(r: Tensor, c: Tensor) -> Tensor:  # rows (R, 1), cols (1, C) -> (..., H|1, R, C)
        bb, hh = b.to(r.device), h.to(r.device)
        return _with_batch_dims(_allowed(mask_mod, bb, hh, r.view(1, 1, -1, 1), c.view(1, 1, 1, -1)), batch_shape)

    name = getattr(mask_mod, "__name__", type(mask_mod).__name__)
    return BlockSparseMask(layout, (bq, bk), (nq, nk), rule, f"mask_mod {name if name != '<lambda>' else ''}".strip(), mask_mod)


def _with_batch_dims(t: Tensor, batch_shape: tuple[int, ...]) -> Tensor:
    """``(B|1, H|1, ...)`` with the flattened batch unflattened to ``batch_shape`` (ones where it broadcasts)."""
    if t.shape[0] == 1:
        return t.reshape(*((1,) * len(batch_shape)), *t.shape[1:])
    return t.reshape(*batch_shape, *t.shape[1:])


def from_block_mask(block_mask: Any) -> BlockSparseMask:
    """FlexAttention's ``BlockMask`` as qkv's layout: its blocks and its ``mask_mod`` as the rule
    inside them (``qkv.attention`` takes a BlockMask as ``attn_mask`` through this)."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"from_block_mask needs a torch.nn.attention.flex_attention.BlockMask, got {type(block_mask).__name__}")
    nq, nk = block_mask.seq_lengths
    bq, bk = block_mask.BLOCK_SIZE
    layout = block_mask.to_dense().to(torch.bool)  # (B|1, H|1, Q blocks, KV blocks)
    layout = layout[..., : -(-nq // bq), : -(-nk // bk)]
    mask_mod = block_mask.mask_mod
    dev = layout.device

    def rule(r: Tensor, c: Tensor) -> Tensor:
        nb, nh = layout.shape[0], layout.shape[1]
        b = torch.arange(nb, device=r.device).view(nb, 1, 1, 1)
        h = torch.arange(nh, device=r.device).view(1, nh, 1, 1)
        return _allowed(mask_mod, b, h, r.view(1, 1, -1, 1), c.view(1, 1, 1, -1))

    return BlockSparseMask(layout.to(dev), (bq, bk), (nq, nk), rule, "flex BlockMask", mask_mod)
