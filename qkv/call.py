"""One attention call, validated once and normalised for every backend.

Shape legend::

    B   flattened batch (all dims before the head dim)       Hq, Hk  query / key-value heads
    G   query heads per key-value head (Hq // Hk)            Nq, Nk  query / key lengths
    D   query/key head dim                                    Dv      value head dim

Backends receive tensors in the *grouped* layout ``(B, Hk, G, N, D)`` (keys and values with
``G = 1``), which expresses grouped-query attention as broadcasting instead of copying K/V.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from .devices import follow
from .reference.attention import causal_bias_alignment
from .masks.rules import Alignment, PositionalMask, parse_alignment, parse_causal, parse_window
from .score_mods.base import BoundScore, ScoreMod, bind, captured_tensors, check_score_mod
from .sparse import BlockSparseMask, check_mask_mod, from_block_mask, from_mask_mod

# The names a caller may pass as ``backend=`` (qkv.backends registers the implementations).
BackendName = Literal["auto", "sdpa", "chunked", "math", "triton", "flex"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores are computed in: float32 for 16-bit inputs, else the input's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of log-sum-exps and other running sums: float32, or float64 for float64
    inputs (so float64 gradients stay exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _shape(t: torch.Size | tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(s)) for s in t) + ")"


@dataclass
class AttentionCall:
    """The arguments of :func:`qkv.attention` after validation (tensors as the user gave them)."""

    query: torch.Tensor  # (..., Hq, Nq, D)
    key: torch.Tensor  # (..., Hk, Nk, D)
    value: torch.Tensor  # (..., Hk, Nk, Dv)
    given_mask: Optional[torch.Tensor]  # the attn_mask tensor; None for a block-sparse layout (see attn_mask)
    dropout_p: float
    causal: bool
    alignment: Alignment
    window: Optional[tuple[Optional[int], Optional[int]]]
    window_alignment: Optional[Alignment]
    key_padding_mask: Optional[torch.Tensor]
    scale: float
    enable_gqa: bool
    return_lse: bool
    generator: Optional[torch.Generator]
    batch_shape: tuple[int, ...]
    hq: int
    hk: int
    nq: int
    nk: int
    d: int
    dv: int
    score_mod: Optional[Any] = None  # a ScoreMod or a callable (score, batch, head, q_idx, kv_idx) -> score
    sinks: Optional[torch.Tensor] = None  # (Hq,) logits that join each row's softmax denominator
    block_sparse: Optional[BlockSparseMask] = None  # a layout kept as blocks: no Nq × Nk mask unless asked

    @property
    def attn_mask(self) -> Optional[torch.Tensor]:
        """The attn_mask as a tensor broadcastable to the scores ``(..., Hq, Nq, Nk)``.

        A :class:`~qkv.sparse.BlockSparseMask` is kept as its layout (:attr:`block_sparse`), which
        the CPU tile loops walk block by block; this is the one place its dense bool mask is
        built, on first use and once per call, for the backends that read a dense mask."""
        if self.given_mask is None and self.block_sparse is not None:
            self.given_mask = self.block_sparse.to_dense(self.device)
        return self.given_mask

    @property
    def has_attn_mask(self) -> bool:
        """Is there an attn_mask (a tensor or a block-sparse layout)? Builds nothing."""
        return self.given_mask is not None or self.block_sparse is not None

    @property
    def positional(self) -> PositionalMask:
        return PositionalMask(self.nq, self.nk, self.causal, self.window, self.alignment, self.window_alignment)

    @property
    def group(self) -> int:
        return self.hq // self.hk if self.hk else 1  # zero heads: an empty grouped layout

    @property
    def batch_size(self) -> int:
        """The batch dims flattened into one."""
        return math.prod(self.batch_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def lse_dtype(self) -> torch.dtype:
        """float32, or float64 for float64 inputs (so float64 gradients stay exact)."""
        return accumulate_dtype(self.dtype)

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def requires_grad(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        mask, sinks = self.given_mask, self.sinks  # (spelled out: asked several times a call)
        return (self.query.requires_grad or self.key.requires_grad or self.value.requires_grad
                or mask is not None and mask.requires_grad or sinks is not None and sinks.requires_grad
                or self.score_mod is not None and bool(self.score_reads))  # fmt: skip

    @functools.cached_property
    def score_reads(self) -> tuple[torch.Tensor, ...]:
        """The tensors the score function reads that need gradients: a built-in's, or those a
        Python callable reads when run once (:func:`~qkv.score_mods.base.captured_tensors`);
        none without gradients, which are all they are found for."""
        if self.score_mod is None or not torch.is_grad_enabled():
            return ()
        return captured_tensors(self.score_mod, compute_dtype(self.dtype), self.device)

    @property
    def builtin_score(self) -> bool:
        """A built-in score function (one the fused kernels run), or none at all."""
        return self.score_mod is None or isinstance(self.score_mod, ScoreMod)

    def bound_score(self) -> Optional[BoundScore]:
        """The score function bound to this call's heads, lengths and causal alignment."""
        if self.score_mod is None:
            return None
        reads = None if isinstance(self.score_mod, ScoreMod) else self.score_reads
        return bind(self.score_mod, self.hq, self.group, self.nq, self.nk, self.alignment, compute_dtype(self.dtype), reads, self.device)

    @property
    def bool_mask(self) -> bool:
        return self.block_sparse is not None or (self.given_mask is not None and self.given_mask.dtype == torch.bool)

    @property
    def rows_may_be_empty(self) -> bool:
        """Could some query row have no key to attend to?"""
        if self.nk == 0 or self.has_attn_mask or self.key_padding_mask is not None:
            return True
        if self.window is None:  # (asked on every call: causality alone answers without the positional rules)
            return self.causal and self.alignment == "bottom_right" and self.nk < self.nq  # the first row's keys end at Nk - Nq
        pm = self.positional
        return not pm.trivial and any(pm.key_range(i, i + 1)[0] >= pm.key_range(i, i + 1)[1] for i in (0, self.nq - 1))

    def positive_scale(self) -> tuple[torch.Tensor, float]:
        """``(query, scale)`` with ``scale > 0`` and the same scores: the sign moves into the
        query (exact), and a zero scale becomes zero queries (every score 0, zero gradient).

        Kernels that shift by the row maximum of the raw products, and torch's CPU flash
        kernel (NaN for causal calls with ``scale <= 0``), need a positive scale."""
        if self.scale > 0:
            return self.query, self.scale
        if self.scale == 0:
            return self.query * 0.0, 1.0
        return -self.query, -self.scale

    def score_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the score function reads: a built-in's (slopes, a table), or those a Python
        callable reads that need gradients (:attr:`score_reads`)."""
        if isinstance(self.score_mod, ScoreMod):
            return tuple(self.score_mod.tensors())
        return self.score_reads

    def in_float64(self) -> "AttentionCall":
        """The same call on float64 copies of its float tensors (differentiable: gradients flow
        back to the originals in their own dtypes); a score function's tensors follow, since it
        is bound in the call's dtype. For calls whose float32 scores overflow (qkv.overflow)."""

        def up(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return t.double() if t is not None and t.is_floating_point() else t

        return dataclasses.replace(
            self, query=up(self.query), key=up(self.key), value=up(self.value), given_mask=up(self.given_mask), sinks=up(self.sinks)
        )

    def describe(self) -> str:
        parts = [f"query {_shape(self.query.shape)}", f"key {_shape(self.key.shape)}", str(self.dtype).replace("torch.", "")]
        if self.causal:
            parts.append(f"causal ({self.alignment})")
        if self.window is not None:
            parts.append(f"window={self.window}" + (f" ({self.window_alignment})" if self.window_alignment else ""))
        if self.block_sparse is not None:
            bs = self.block_sparse
            parts.append(f"block-sparse attn_mask {bs.name} {_shape(bs.layout.shape)} blocks of {bs.block_size}")
        elif self.given_mask is not None:
            parts.append(f"{'bool' if self.bool_mask else 'float'} attn_mask {_shape(self.given_mask.shape)}")
        if self.key_padding_mask is not None:
            parts.append("key_padding_mask")
        if self.hq != self.hk:
            parts.append(f"GQA {self.hq}/{self.hk} heads")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        if self.return_lse:
            parts.append("return_lse")
        if self.score_mod is not None:
            mod = self.score_mod
            parts.append(f"score_mod={mod.describe() if isinstance(mod, ScoreMod) else getattr(mod, '__name__', type(mod).__name__)}")
        if self.sinks is not None:
            parts.append("sinks")
        return ", ".join(parts)

    # ---- normalised views for backends -------------------------------------------------

    def grouped_qkv(
        self, query: Optional[torch.Tensor] = None, upcast: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``(B, Hk, G, Nq, D)``, k ``(B, Hk, 1, Nk, D)``, v ``(B, Hk, 1, Nk, Dv)``; views when possible.

        ``query`` replaces the call's query (same shape), e.g. with its sign flipped. ``upcast``:
        16-bit tensors become float32 before they are broadcast, so the gradient a broadcast
        tensor gets is summed over its copies in float32 and rounded to 16 bits once (16-bit
        copies whose gradients pass 65504 would sum inf − inf to NaN)."""
        b, batch = self.batch_size, self.batch_shape
        up = (lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t) if upcast else (lambda t: t)

        def spread(t: torch.Tensor, h: int, n: int, d: int) -> torch.Tensor:  # broadcast batch dims, where there are any
            return t if t.shape[:-3] == batch else t.expand(*batch, h, n, d)

        q = spread(up(self.query if query is None else query), self.hq, self.nq, self.d)
        k = spread(up(self.key), self.hk, self.nk, self.d)
        v = spread(up(self.value), self.hk, self.nk, self.dv)
        q = q.reshape(b, self.hk, self.group, self.nq, self.d)
        k = k.reshape(b, self.hk, 1, self.nk, self.d)
        v = v.reshape(b, self.hk, 1, self.nk, self.dv)
        return q, k, v

    def grouped_attn_mask(self) -> Optional[torch.Tensor]:
        """attn_mask broadcastable to ``(B, Hk, G, Nq, Nk)``, last two dims expanded (a view)."""
        m = self.attn_mask
        if m is None:
            return None
        m = self.grouped_mask(m)
        return m.expand(*m.shape[:-2], self.nq, self.nk)

    def grouped_layout(self) -> Optional[torch.Tensor]:
        """The block-sparse layout as bool ``(B|1, Hk|1, G|1, Bq, Bk)`` (a view), or None."""
        return None if self.block_sparse is None else self.grouped_mask(self.block_sparse.layout.to(self.device))

    def grouped_mask(self, m: torch.Tensor) -> torch.Tensor:
        """A tensor ``(..., X, Y)`` whose dims before the last two broadcast to the call's
        ``(*batch, Hq)``, as ``(B|1, Hk|1, G|1, X, Y)``: a mask's tile, a layout."""
        rank = len(self.batch_shape) + 3
        m = m.reshape((1,) * (rank - m.dim()) + tuple(m.shape))  # (..., H|1, Nq|1, Nk|1)
        lead, h = m.shape[: rank - 3], m.shape[rank - 3]
        if all(s == 1 for s in lead):
            m = m.reshape(1, *m.shape[rank - 3 :])
        else:
            m = m.expand(*self.batch_shape, *m.shape[rank - 3 :]).reshape(self.batch_size, *m.shape[rank - 3 :])
        if h == 1:
            m = m.unsqueeze(1)  # (B|1, 1, 1, Nq|1, Nk|1)
        else:
            m = m.reshape(m.shape[0], self.hk, self.group, m.shape[-2], m.shape[-1])
        return m

    def grouped_key_padding(self) -> Optional[torch.Tensor]:
        """key_padding_mask as ``(B|1, 1, 1, 1, Nk)`` bool."""
        kp = self.key_padding_mask
        if kp is None:
            return None
        kp = kp.reshape((1,) * (len(self.batch_shape) + 1 - kp.dim()) + tuple(kp.shape))
        if all(s == 1 for s in kp.shape[:-1]):
            kp = kp.reshape(1, self.nk)
        else:
            kp = kp.expand(*self.batch_shape, self.nk).reshape(self.batch_size, self.nk)
        return kp[:, None, None, None, :]

    def ungroup(self, out: torch.Tensor) -> torch.Tensor:
        """``(B, Hk, G, Nq, X)`` or ``(B, Hk, G, Nq)`` → the caller's ``(..., Hq, Nq[, X])``."""
        tail = out.shape[4:]
        if self.query.dim() == 2:  # (Nq, D) inputs carry no head dim
            return out.reshape(self.nq, *tail)
        return out.reshape(*self.batch_shape, self.hq, self.nq, *tail)


# ---- validation ---------------------------------------------------------------------------


def check_tensor(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}; convert it with torch.as_tensor({name})")
    if t.dtype not in _FLOATS:
        raise TypeError(
            f"{name} has dtype {t.dtype}; attention needs floating point inputs "
            f"(float16, bfloat16, float32 or float64): use {name}.float()"
        )
    if t.dim() < 2:
        raise ValueError(f"{name} must have shape (..., heads, seq_len, head_dim) with at least 2 dims, got {_shape(t.shape)}")
    return t


def broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> Optional[tuple[int, ...]]:
    """NumPy broadcasting of two shapes, or None if they do not broadcast (plain Python: fast)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


def _fits(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Does ``shape`` broadcast to exactly ``target``?"""
    return len(shape) <= len(target) and broadcast_shape(shape, target) == target


def _broadcast(name_a: str, a: tuple[int, ...], name_b: str, b: tuple[int, ...]) -> tuple[int, ...]:
    out = broadcast_shape(a, b)
    if out is None:
        raise ValueError(
            f"batch dims of {name_a} {_shape(a)} and {name_b} {_shape(b)} do not broadcast; "
            "every dim before (heads, seq_len, head_dim) must match or be 1"
        )
    return out


def _check_qkv(query: Any, key: Any, value: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key and value as tensors of one dtype and device, missing leading dims added, with
    query and key head dims equal and one value per key."""
    q = check_tensor("query", query)
    k = check_tensor("key", key)
    v = check_tensor("value", value)
    rank = max(q.dim(), k.dim(), v.dim())
    if rank > 2 and not q.dim() == k.dim() == v.dim():
        # missing leading dims broadcast, as in torch SDPA: (N, D) acts as (1, 1, N, D); a tensor
        # that has them all is kept as given (no view: nothing issued, its identity kept)
        q, k, v = (t if t.dim() == rank else t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) for t in (q, k, v))
    for name, t in (("key", k), ("value", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} is {t.dtype} but query is {q.dtype}; cast with {name}.to(query.dtype)")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but query is on {q.device}; move it with {name}.to(query.device)")
    d, nk = q.shape[-1], k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(
            f"key head dim is {k.shape[-1]} but query head dim is {d}; queries and keys are compared by a dot "
            "product, so their last dims must be equal"
        )
    if v.shape[-2] != nk:
        raise ValueError(f"value has {v.shape[-2]} positions but key has {nk}; each key needs exactly one value")
    return q, k, v


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> tuple[tuple[int, ...], int, int]:
    """(batch shape, Hq, Hk): broadcast batch dims; key/value heads paired and serving the query heads."""
    if q.dim() == 2:
        hq = hk = hv = 1
        batch: tuple[int, ...] = ()
    else:
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        batch = _broadcast("query", tuple(q.shape[:-3]), "key", tuple(k.shape[:-3]))
        batch = _broadcast("query", batch, "value", tuple(v.shape[:-3]))
    if hv != hk:
        raise ValueError(f"value has {hv} heads but key has {hk}; keys and values come in pairs")
    if hq != hk and hk != 1:  # a single key/value head broadcasts to every query head
        if hk == 0:
            raise ValueError(f"key has 0 heads but query has {hq}; every query head needs a key/value head")
        if hq % hk:
            raise ValueError(
                f"key has {hk} heads but query has {hq}; {hq} is not a multiple of {hk} — grouped-query "
                "attention needs query heads to be a multiple of key/value heads"
            )
        if not enable_gqa:
            raise ValueError(
                f"key has {hk} heads but query has {hq}; pass enable_gqa=True for grouped-query attention "
                f"(each key/value head serves {hq // hk} query heads)"
            )
    return batch, hq, hk


def _check_block_sparse(mask: BlockSparseMask, scores_shape: tuple[int, ...]) -> BlockSparseMask:
    """A layout for the call's ``(Nq, Nk)`` whose batch dims broadcast to the scores' (checked on
    the layout: its dense mask is not built)."""
    nq, nk = scores_shape[-2:]
    if mask.shape != (nq, nk):
        raise ValueError(
            f"attn_mask is a BlockSparseMask for {mask.shape} but (query_len, key_len) = ({nq}, {nk}); "
            f"build it for n = {nq}" + ("" if nq == nk else f" queries and {nk} keys (qkv.sparse.from_dense)")
        )
    if not _fits((*mask.layout.shape[:-2], nq, nk), scores_shape):
        raise ValueError(
            f"attn_mask is a BlockSparseMask with layout {_shape(mask.layout.shape)}, whose batch dims do not "
            f"broadcast to the scores {_shape(scores_shape)} (..., heads, query_len, key_len); give the layout "
            "shape (query blocks, key blocks) or (batch, heads, query blocks, key blocks)"
        )
    return mask


def _unwrap_mask(attn_mask: Any, is_causal: Any, nq: int, nk: int, device: torch.device) -> tuple[Any, Any]:
    """(attn_mask, is_causal) with a torch ``CausalBias`` turned into its causal alignment and a
    FlexAttention ``BlockMask`` into a :class:`BlockSparseMask` (checked by :func:`_check_block_sparse`)."""
    bias_alignment = causal_bias_alignment(attn_mask) if attn_mask is not None else None
    if bias_alignment is not None:  # torch.nn.attention.bias.causal_upper_left / causal_lower_right
        if is_causal is not False:
            raise ValueError(
                f"attn_mask is a torch CausalBias ({bias_alignment} causal) and is_causal={is_causal!r}; "
                "the bias is already causal: pass is_causal=False, or drop attn_mask and pass "
                f"is_causal={bias_alignment!r}"
            )
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (nq, nk):
            raise ValueError(
                f"attn_mask is a CausalBias for ({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}) but query_len, "
                f"key_len = ({nq}, {nk}); build it with causal_{'lower_right' if bias_alignment == 'bottom_right' else 'upper_left'}({nq}, {nk})"
            )
        attn_mask, is_causal = None, bias_alignment
    if type(attn_mask).__name__ == "BlockMask" and type(attn_mask).__module__.startswith("torch.nn.attention"):
        attn_mask = from_block_mask(attn_mask)  # FlexAttention's: its blocks and mask function
    return attn_mask, is_causal


def _with_mask_mod(
    mask_mod: Any, attn_mask: Optional[torch.Tensor], block_sparse: Optional[BlockSparseMask], batch: tuple[int, ...],
    hq: int, nq: int, nk: int, device: torch.device,
) -> tuple[Optional[torch.Tensor], Optional[BlockSparseMask]]:  # fmt: skip
    """(attn_mask, block_sparse) with FlexAttention's ``mask_mod`` joined to them: as a layout of
    blocks (:func:`qkv.sparse.from_mask_mod`) where there is no dense mask, else folded into it."""
    size = block_sparse.block_size if block_sparse is not None else 64
    found = from_mask_mod(check_mask_mod(mask_mod), batch, hq, nq, nk, block_size=size, device=device)
    if attn_mask is None:
        return None, found if block_sparse is None else block_sparse & found
    allowed = found.to_dense(device)  # the caller's mask is Nq × Nk already
    if attn_mask.dtype == torch.bool:
        return attn_mask & allowed, None
    return attn_mask.masked_fill(~allowed, float("-inf")), None


def _check_scale(scale: Optional[float], d: int) -> float:
    """The scores' scale: ``1/√D`` by default, else any finite number."""
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0  # head dim 0: every score is 0 whatever the scale
    else:
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale={scale} must be a finite number (default 1/sqrt(head_dim))")
    return scale


def _check_attn_mask(attn_mask: Any, q: torch.Tensor, scores_shape: tuple[int, ...]) -> torch.Tensor:
    """A bool or float tensor broadcastable to the scores ``(..., Hq, Nq, Nk)``, given at least its
    last two dims; a float one in the scores' compute dtype."""
    nq, nk = scores_shape[-2], scores_shape[-1]
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor (bool or float), got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in _FLOATS:
        raise TypeError(
            f"attn_mask has dtype {attn_mask.dtype}; use a bool mask (True = may attend) or a float mask "
            "added to the scores, e.g. attn_mask.bool()"
        )
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {q.device}; move it with attn_mask.to(query.device)")
    if not _fits(tuple(attn_mask.shape), scores_shape):
        raise ValueError(
            f"attn_mask of shape {_shape(attn_mask.shape)} does not broadcast to the scores "
            f"{_shape(scores_shape)} (..., heads, query_len, key_len); give it shape "
            f"(query_len, key_len) = ({nq}, {nk}) or (batch, heads, query_len, key_len)"
        )
    if attn_mask.dim() < 2:  # a per-key mask (Nk,) or a scalar: give it the (Nq|1, Nk|1) dims
        attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.dim()) + tuple(attn_mask.shape))
    compute = compute_dtype(q.dtype)
    if attn_mask.dtype != torch.bool and attn_mask.dtype != compute:
        # in the scores' precision: a float32 bias on 16-bit inputs is not rounded to 16 bits
        attn_mask = attn_mask.to(compute)
    return attn_mask


def _check_key_padding(key_padding_mask: Any, q: torch.Tensor, want: tuple[int, ...]) -> torch.Tensor:
    """A bool ``(..., Nk)`` tensor on the query's device; one flag for every key (a last dim of 1,
    broadcast as any mask's) is spread to ``Nk`` flags, as the backends index them per key (a
    copy: a few bools a batch entry, and compiled FlexAttention refuses a zero-stride buffer).
    A mask on the CPU for inputs elsewhere is moved there (:func:`qkv.devices.follow`: a few
    bytes, no host sync); one on another accelerator is refused, as moving it would sync."""
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        got = key_padding_mask.dtype if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask).__name__
        raise TypeError(
            f"key_padding_mask must be a bool tensor (True = a real key to attend to, False = padding), got {got}; "
            "for a float bias pass attn_mask=bias[:, None, None, :] instead"
        )
    if key_padding_mask.device != q.device and key_padding_mask.device.type != "cpu":
        raise ValueError(
            f"key_padding_mask is on {key_padding_mask.device} but query is on {q.device}; "
            "move it with key_padding_mask.to(query.device)"
        )
    if key_padding_mask.dim() == 0 or not _fits(tuple(key_padding_mask.shape), want):
        raise ValueError(
            f"key_padding_mask of shape {_shape(key_padding_mask.shape)} should be (batch, key_len) = "
            f"{_shape(want)}: one flag per key, True where the key is real"
        )
    if key_padding_mask.shape[-1] != want[-1]:
        lead = tuple(key_padding_mask.shape[:-1])
        key_padding_mask = key_padding_mask.reshape(*lead, 1).expand(*lead, want[-1]).contiguous()  # (..., Nk)
    return follow(key_padding_mask, q.device)


def _padding_from_mask(
    attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor], q: torch.Tensor, nk: int
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A bool ``attn_mask`` that is the same for every head and query row — ``(…, 1, 1, Nk)``, what
    transformers passes while generating a padded batch — is key padding: it becomes
    ``key_padding_mask`` (joined with any given), so that every backend takes its padding path
    (ragged lengths skipped, decoding kernels) instead of a mask it must read entry by entry."""
    if (
        attn_mask is None
        or attn_mask.dtype != torch.bool
        or q.dim() < 3
        or attn_mask.dim() < 3
        or attn_mask.shape[-3] != 1
        or attn_mask.shape[-2] != 1
    ):
        return attn_mask, key_padding_mask
    kp = attn_mask[..., 0, 0, :]  # (…, Nk|1)
    if kp.shape[-1] != nk:
        kp = kp.expand(*kp.shape[:-1], nk)
    return None, kp if key_padding_mask is None else key_padding_mask & kp


def validate(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: Any = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window: Any = None,
    window_alignment: Any = None,
    key_padding_mask: Any = None,
    return_lse: bool = False,
    generator: Optional[torch.Generator] = None,
    score_mod: Any = None,
    sinks: Any = None,
    mask_mod: Any = None,
) -> AttentionCall:
    """Check every argument of :func:`qkv.attention` and raise errors that say how to fix them.

    A plain call (no mask, window, padding, score function, sinks, generator or mask function) is
    checked once per kind (:func:`_plain_key`: shapes, dtypes, devices and the scalar arguments,
    everything its checks read): a call of a kind checked before costs one lookup."""
    plain = _plain_key(query, key, value, (dropout_p, is_causal, scale, enable_gqa, window_alignment, return_lse),
                       (attn_mask, window, key_padding_mask, generator, score_mod, sinks, mask_mod))  # fmt: skip
    kept = None if plain is None else _PLAIN_CALLS.get(plain)
    if kept is not None:
        return AttentionCall(query, key, value, **kept)
    q, k, v = _check_qkv(query, key, value)
    nq, d, nk = q.shape[-2], q.shape[-1], k.shape[-2]
    batch, hq, hk = _check_heads(q, k, v, enable_gqa)
    attn_mask, is_causal = _unwrap_mask(attn_mask, is_causal, nq, nk, q.device)
    causal, alignment = parse_causal(is_causal)
    win = parse_window(window)
    win_alignment = parse_alignment(window_alignment)
    scale = _check_scale(scale, d)
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    block_sparse = None
    if isinstance(attn_mask, BlockSparseMask):  # kept as blocks (see AttentionCall.attn_mask)
        block_sparse, attn_mask = _check_block_sparse(attn_mask, (*batch, hq, nq, nk)), None
    elif attn_mask is not None:
        attn_mask = _check_attn_mask(attn_mask, q, (*batch, hq, nq, nk))
    if key_padding_mask is not None:
        key_padding_mask = _check_key_padding(key_padding_mask, q, (*batch, nk))
    attn_mask, key_padding_mask = _padding_from_mask(attn_mask, key_padding_mask, q, nk)
    if mask_mod is not None:
        attn_mask, block_sparse = _with_mask_mod(mask_mod, attn_mask, block_sparse, batch, hq, nq, nk, q.device)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    score_mod = check_score_mod(score_mod)
    if isinstance(score_mod, ScoreMod):
        score_mod.check_heads(hq)
        score_mod.check_dtype(compute_dtype(q.dtype))  # a cap or bias the kernels' precision cannot hold
        score_mod = score_mod.on(q.device)  # ALiBi(alibi_slopes(8)) on the CPU for CUDA inputs: moved once, differentiably
    if sinks is not None:
        sinks = check_sinks(sinks, hq, q)
    call = AttentionCall(
        query=q, key=k, value=v, given_mask=attn_mask, dropout_p=dropout_p, causal=causal, alignment=alignment,
        window=win, window_alignment=win_alignment, key_padding_mask=key_padding_mask, scale=scale,
        enable_gqa=bool(enable_gqa), return_lse=bool(return_lse), generator=generator, batch_shape=batch, hq=hq, hk=hk,
        nq=nq, nk=nk, d=d, dv=v.shape[-1], score_mod=score_mod, sinks=sinks, block_sparse=block_sparse,
    )  # fmt: skip
    if plain is not None:
        _remember(plain, call)
    return call


_PLAIN_CALLS: dict[tuple, dict[str, Any]] = {}  # plain calls' checked fields, by _plain_key
_PLAIN_CALLS_LIMIT = 1024
_FIELDS_BUT_TENSORS = tuple(f.name for f in dataclasses.fields(AttentionCall) if f.name not in ("query", "key", "value"))
_SCALARS = (bool, int, float, str, type(None))


def _plain_key(query: Any, key: Any, value: Any, scalars: tuple, others: tuple) -> Optional[tuple]:
    """What a plain call's checks read — the tensors' shapes, dtypes and devices and the
    ``scalars`` with their types (``True`` and ``1`` are checked differently) — as a key; None
    where any of ``others`` (masks, window, padding, generator, score or mask function, sinks) is
    given, for tensors of a subclass or of different ranks, for scalars of other types (a 0-d
    tensor as scale may change), and while ``torch.compile`` or ``torch.func`` traces."""
    if any(x is not None for x in others) or not type(query) is type(key) is type(value) is torch.Tensor:
        return None
    if any(type(x) not in _SCALARS for x in scalars) or not query.dim() == key.dim() == value.dim():
        return None
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return None
    return (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device, key.device,
            value.device, scalars, tuple(map(type, scalars)))  # fmt: skip


def _remember(plain: tuple, call: AttentionCall) -> None:
    if len(_PLAIN_CALLS) >= _PLAIN_CALLS_LIMIT:
        _PLAIN_CALLS.clear()
    _PLAIN_CALLS[plain] = {f: getattr(call, f) for f in _FIELDS_BUT_TENSORS}  # no tensor among them


def check_sinks(sinks: Any, hq: int, q: torch.Tensor) -> torch.Tensor:
    """``sinks``: one logit per query head ``(Hq,)``, float, on the query's device, no NaN or +inf."""
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        got = sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise TypeError(f"sinks must be a float tensor of shape (query_heads,) = ({hq},), got {got}")
    if sinks.shape != (hq,):
        raise ValueError(
            f"sinks has shape {_shape(sinks.shape)} but the call has {hq} query heads; give one logit per "
            f"query head, shape ({hq},)"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {q.device}; move it with sinks.to(query.device)")
    if not torch.compiler.is_compiling() and bool((torch.isnan(sinks) | (sinks == float("inf"))).any()):
        raise ValueError("sinks holds NaN or +inf; a sink is a finite logit (or -inf for no sink on that head)")
    return sinks


def validate_qk(
    query: Any,
    key: Any,
    attn_mask: Any = None,
    is_causal: Any = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Any = None,
    key_padding_mask: Any = None,
    window_alignment: Any = None,
    *,
    score_mod: Any = None,
    sinks: Any = None,
) -> AttentionCall:
    """:func:`validate` for a call about the weights alone (they do not depend on V)."""
    if not isinstance(key, torch.Tensor):
        check_tensor("key", key)
    value = key[..., :1]  # a one-column view satisfies validation and keeps an lse pass cheap
    return validate(
        query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa,
        window=window, window_alignment=window_alignment, key_padding_mask=key_padding_mask,
        score_mod=score_mod, sinks=sinks,
    )  # fmt: skip
