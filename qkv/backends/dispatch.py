"""``auto``'s choice, written once: one table of rows, read by everything that chooses.

A row is (the calls it applies to, the engines in the order ``auto`` tries them, why). The
conditions read a :class:`Shape` — what can be told of a call from its tensors' sizes, dtypes,
device and which arguments are there — and, where that is not enough, the validated
:class:`~qkv.call.AttentionCall` (``also``). From this one table:

- :func:`qkv.backends.auto_order` takes the first deciding row that applies (then moves the
  engines of every applying ``last`` row to the end);
- :func:`qkv.backends.order_notes` prints that row's reason (``qkv info``, the debug log);
- :func:`plain_sdpa_call` — ``qkv.attention``'s fast path, before validation — asks the same rows
  of the raw tensors' :class:`Shape` and runs torch SDPA directly only where the table certainly
  says SDPA first;
- :func:`chunked_kernel` picks which of chunked's CPU kernels runs a call (:data:`KERNELS`).

Each threshold lives here, beside the measurement that set it; adding an engine is adding rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, Optional

import torch

from ..call import AttentionCall
from ..score_mods.base import ScoreMod
from . import chunked_native
from .decode_cpu import MAX_QUERY_ROWS, can_decode
from .flash_cpu import can_fuse, lse_misses_rule
from .sdpa import needs_dense_mask
from .triton import MAX_DECODE_ROWS, decode_fits

# Below this many scores per head the one-shot math path beats chunked's loop on a CPU, and a
# bool mask is too small for chunked's block-sparse dispatch to beat one dense kernel call.
MATH_MAX_SCORES = 1 << 14
# Above this many scores (all query heads), a mask that qkv has to build for SDPA costs more than it saves.
DENSE_MASK_LIMIT = 1 << 22
# Values of another head dim than the keys' (Dv ≠ D) on the CPU: torch's kernel falls back to its
# math formulation (the Nq × Nk matrix, q and k each scaled by √scale and rounded), which
# chunked's tile loops beat from 256 × 256 scores on (float32, one thread, no gradient: 0.64×
# its time at 256², 0.33× at 1024², 0.31× at 2048², 1.21× at 128²) while staying closer to the
# oracle at large logits (torch's fallback at 0.45–0.85 of the strict rule, chunked ≤ 0.53;
# bench/results/large_logits_cpu.md).
VALUE_DIM_MIN_SCORES = 1 << 16
# Causal self-attention without gradients, up to this length, runs faster on the tile loops
# than on torch's fused kernel: the loops' key range ends at each row block's diagonal (tiles of
# band_rows(N) × 256), while the fused kernel's 512-key blocks compute past it. Measured
# float32, B = 1, 8 heads, D = 64, 2-core AVX-512 EPYC, loops vs fused: N = 1024 17.0 vs
# 19.7 ms on 1 thread, 9.1 vs 10.4 on 2; N = 2048 59.9 vs 64.4 and 31.4 vs 33.0; N = 4096
# 230.6 vs 233.4 (1 thread); 8 query heads on 2, N = 1024: 16.9 vs 19.6 and 9.1 vs 10.0; N = 512
# 5.4 vs 6.9 and 2.5 vs 3.6. Below 512 the loops' per-call cost wins back what they save (N = 128:
# 0.53 vs 0.47 ms).
CAUSAL_TILES_MIN_N, CAUSAL_TILES_MAX_N = 512, 4096
# From this many scores per head a Python score function without gradients runs on compiled
# FlexAttention on the CPU (measured beside its row in ROUTES).
FLEX_CPU_MIN_SCORES = 1 << 18

MaskKind = Optional[Literal["bool", "float"]]


class Shape(NamedTuple):
    """What the rows read first: sizes, dtype, device and which arguments a call has. Every field
    can be read off the raw tensors too, so the fast path asks the same rows before validating;
    there a bool mask counts as ``positional`` as well, since validation may turn it into key
    padding (a row's ``when`` must hold for the raw call wherever it holds for the validated one).
    A named tuple: made on every call, and the key of :func:`order_names`'s cache."""

    device: str  # "cpu", "cuda", ...
    dtype: torch.dtype
    nq: int
    nk: int
    hq: int
    d: int
    dv: int
    causal: bool
    mask: MaskKind  # a dense attn_mask tensor's kind
    grad: bool  # gradients will be asked for
    lse: bool = False
    positional: bool = False  # a window or a key padding mask
    block_sparse: bool = False  # a block-sparse layout
    score: Optional[Literal["builtin", "python"]] = None
    sinks: bool = False
    dropout: bool = False
    bottom_right: bool = False  # the causal alignment puts the last query at the last key

    @property
    def scores(self) -> int:
        """Scores per head: Nq · Nk."""
        return self.nq * self.nk

    @staticmethod
    def of(call: AttentionCall) -> "Shape":
        given = call.given_mask if call.block_sparse is None else None
        score = call.score_mod
        return Shape(
            call.query.device.type, call.query.dtype, call.nq, call.nk, call.hq, call.d, call.dv, call.causal,
            None if given is None else ("bool" if given.dtype == torch.bool else "float"), call.requires_grad,
            call.return_lse, call.window is not None or call.key_padding_mask is not None, call.block_sparse is not None,
            None if score is None else ("builtin" if isinstance(score, ScoreMod) else "python"), call.sinks is not None,
            call.dropout_p > 0.0, call.alignment == "bottom_right",
        )  # positional, in the fields' order: a call's cost (fmt: skip)


@dataclass(frozen=True)
class Route:
    """One row of ``auto``'s choice. ``when`` reads the :class:`Shape`; ``also``, where given, the
    validated call (the fast path, which has no validated call, then leaves the call to the
    table). A ``last`` row does not decide: it moves its engines to the end of the order."""

    when: Callable[[Shape], bool]
    order: tuple[str, ...]
    why: str
    also: Optional[Callable[[AttentionCall], bool]] = None
    last: bool = False
    # where the order was measured: a report under bench/results/ and what it showed (every row
    # that decides calls on a GPU has one; tests/backends/test_dispatch.py holds it)
    measured: Optional[str] = None

    def applies(self, call: AttentionCall, shape: Optional[Shape] = None) -> bool:
        return self.when(shape or Shape.of(call)) and (self.also is None or self.also(call))


def _cpu(s: Shape) -> bool:
    return s.device == "cpu"


def _may_need_dense_mask(s: Shape) -> bool:
    """Could SDPA need an Nq × Nk mask built for this call (:func:`.sdpa.needs_dense_mask`)? A window
    or padding, or causality with a mask or with rows shifted against the keys."""
    return s.positional or s.causal and (s.mask is not None or s.block_sparse or s.bottom_right and s.nq != s.nk)


def causal_prefill(call: AttentionCall) -> bool:
    """Causal float32 self-attention, ``CAUSAL_TILES_MIN_N`` ≤ Nq = Nk ≤ ``CAUSAL_TILES_MAX_N``,
    on a CPU with no gradient and nothing else (no mask, window, padding, score function, sinks
    or dropout), the C tile loops built: the call those loops run faster than torch's kernel."""
    return _causal_prefill_shape(Shape.of(call)) and call.batch_size * call.hq * call.d * call.dv > 0 and chunked_native.available(call.dtype)


def _causal_prefill_shape(s: Shape) -> bool:
    return (
        _cpu(s) and s.causal and s.nq == s.nk and CAUSAL_TILES_MIN_N <= s.nk <= CAUSAL_TILES_MAX_N
        and s.dtype == torch.float32 and s.mask is None and not s.grad
        and not (s.positional or s.block_sparse or s.score or s.sinks or s.dropout)
    )  # fmt: skip


def _decode_shape(s: Shape) -> bool:
    # the shape alone (whether the kernel is built, can_decode asks): a row's `when` reads the
    # Shape and this module's thresholds only, so order_names may keep its answer per shape
    return (
        _cpu(s) and 0 < s.nq <= MAX_QUERY_ROWS and s.nk > s.nq and s.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not s.grad and s.mask != "float" and not s.block_sparse and s.score is None and not s.dropout
    )  # fmt: skip


def _cuda_decode_shape(s: Shape) -> bool:
    """A decoding call (``Nq <= 8`` rows against more keys) without gradients on a GPU, of a kind
    the triton backend's decoding kernels take (no dropout, block-sparse layout or Python score
    function)."""
    return (
        s.device == "cuda" and 0 < s.nq <= MAX_DECODE_ROWS and s.nk > s.nq and not s.grad and s.dtype != torch.float64
        and not s.dropout and not s.block_sparse and s.score != "python"
    )  # fmt: skip


def value_dim_fallback(s: Shape) -> bool:
    """Would torch's CPU kernel run this float32 call on its slower, less exact math fallback
    (Dv ≠ D) at a size where chunked's tile loops are faster (:data:`VALUE_DIM_MIN_SCORES`)?"""
    return _cpu(s) and s.dtype == torch.float32 and s.dv != s.d and s.scores >= VALUE_DIM_MIN_SCORES


CHUNKED_FIRST = ("chunked", "sdpa", "math")
SDPA_FIRST = ("sdpa", "chunked", "math")
# The GPU measurements the rows for CUDA cite (bf16, torch 2.11, peers in the same run).
H200 = "bench/results/attention_gpu_nvidia-h200.md (NVIDIA H200, main at a621e09)"

# The first deciding row that applies decides; the catch-all rows at the end take the rest.
ROUTES: tuple[Route, ...] = (
    Route(
        lambda s: s.device == "cuda" and (s.sinks or s.lse and s.grad),
        ("triton", "flex", "sdpa", "chunked", "math"),
        "triton first: sinks and a differentiable lse run in qkv's own kernels only",
        measured=f"{H200}: the sinks cell (causal, B 4, H 16, N 4096, D 128) forward 105 TFLOP/s against 117 for the "
        "same call without sinks, forward + backward 131 against 140 (Flex, SDPA: no sinks)",
    ),
    # Decoding is memory-bound: its time is one read of K and V. On the H200 that measured main at
    # a621e09 (bf16, 1 query row against 32k keys, B 8, GQA 32/8, D 128)
    # SDPA's kernel alone took 0.25 ms (4.26 TB/s) but auto on SDPA 3.28 ms (328 GB/s): the
    # non-finite rule's reductions over K and V after it. Any rule pass after another engine
    # reads K and V a second time; qkv's decoding kernels apply the rule in their one read.
    Route(
        _cuda_decode_shape,
        ("triton", "sdpa", "flex", "chunked", "math"),
        "triton first: a decoding call (few query rows, long cache) runs qkv's decoding kernels, which read each "
        "key/value row once for all the query rows of its group and apply the non-finite rule in that same read",
        also=lambda call: decode_fits(call.nq, call.nk, call.group),
        measured=f"{H200}: decoding (B 8, GQA 32/8, D 128, 1 row against 8k keys, 8 rows against 32k) SDPA's kernels "
        "alone 3260-3385 and 707-1356 GB/s, auto on SDPA with the rule after it 300 and 283, qkv triton 297 and 316",
    ),
    # Measured with the non-finite rule after qkv's kernels (~1.5 ms forward, ~1.7 forward +
    # backward at B 4, H 16, N 4096, D 128 on the H200: auto on cuDNN less cuDNN alone on the
    # causal cell of that size) and none after Flex's: kernel against kernel the window margin
    # may vanish (triton's forward about 0.41 ms by that difference, Flex's 0.40), and a softcap
    # alone may favour triton (about 1.3 against 1.54 ms); both unmeasured as such. auto on these
    # calls took Flex's time plus that same rule cost (window: 1.92 ms against Flex's 0.40), so it
    # ran Flex, as its log says, in a time close to qkv triton's (1.93) by coincidence.
    Route(
        lambda s: s.device == "cuda" and (_may_need_dense_mask(s) or s.block_sparse or s.score is not None),
        ("flex", "triton", "sdpa", "chunked", "math"),
        "flex first: compiled FlexAttention runs windows, padding, block masks, mask and score functions faster than "
        "qkv's triton kernels on a GPU (H200, bf16, forward, qkv's non-finite rule included: a window 4.9x, ALiBi "
        "4.1x, T5 bias 3.2x, softcap 1.8x), which take what Flex declines",
        also=lambda call: needs_dense_mask(call) or call.block_sparse is not None or call.score_mod is not None,
        measured=f"{H200}: causal window 1024, B 4, H 16, N 4096, D 128: Flex 304 TFLOP/s forward and 299 forward + "
        "backward, qkv triton 62.5 and 98.9; score functions (causal, N 4096, D 128) forward Flex / qkv triton: "
        "softcap 178 / 97.2, ALiBi 337 / 83.1, T5 bias 259 / 81.3; forward + backward 183 / 106, 342 / 99.7, 226 / 99.0 "
        "(qkv's times include the non-finite rule, Flex's none); the H100 run before it "
        "(bench/results/gpu_check_nvidia-h100-80gb-hbm3.md): triton at 0.33 (window) and 0.4-0.7 (score functions) of Flex",
    ),
    # Compiled Flex against qkv's tile loops for a Python score function without gradients
    # (float32, 1 thread, 8 heads, D = 64, causal, s + 0.01·(i − j); bench/results/flex_cpu.md):
    # 7.98 vs 14.03 ms at N = 512, 25.3 vs 34.7 at 1024, 89.7 vs 112.6 at 2048 (2.73 vs 6.38 at
    # 256). A new function or shape compiles first (3.6–7.9 s cold on that machine): below 512²
    # scores that takes over a thousand calls to repay.
    Route(
        lambda s: _cpu(s) and s.score == "python" and not s.grad and not s.lse and s.dtype != torch.float64
        and s.scores >= FLEX_CPU_MIN_SCORES,
        ("flex", "chunked", "sdpa", "math"),
        "flex first: compiled FlexAttention runs a Python score function without gradients faster than qkv's tile "
        "loops, which call it from Python tile by tile (set QKV_COMPILE=0 to keep them)",
    ),
    Route(
        _decode_shape,
        CHUNKED_FIRST,  # SDPA reads each K/V row once per query head
        "chunked first: a decoding call (few query rows, long cache) runs its kernel that reads each key/value row "
        "once for all the query rows of its group",
        also=can_decode,
    ),
    Route(
        _causal_prefill_shape,
        CHUNKED_FIRST,  # torch's kernel computes 512-key blocks past the diagonal
        "chunked first: causal self-attention without gradients runs faster on its tile loops, whose key range "
        "stops at each row block's diagonal",
        also=causal_prefill,
    ),
    Route(
        lambda s: _cpu(s) and s.lse and s.dtype in (torch.float16, torch.bfloat16),
        CHUNKED_FIRST,  # torch's kernel: 1.8e-5, the tile loops on upcast inputs: 6e-7 (lse_misses_rule)
        "chunked first: its tile loops compute the lse of 16-bit inputs in float32, where torch's fused kernel "
        "misses the accuracy rule on it",
        also=lse_misses_rule,
    ),
    Route(
        value_dim_fallback,
        CHUNKED_FIRST,  # VALUE_DIM_MIN_SCORES
        "chunked first: with values of another head dim than the keys', torch's CPU kernel falls back to its math "
        "formulation, slower and less exact than the tile loops at this size",
    ),
    Route(
        lambda s: _cpu(s) and s.block_sparse and s.scores > MATH_MAX_SCORES,
        CHUNKED_FIRST,
        "chunked first: it walks the block-sparse layout's blocks, forward and backward, where SDPA would get the "
        "dense Nq × Nk mask",
    ),
    Route(
        lambda s: _cpu(s) and not s.grad and (_may_need_dense_mask(s) or s.mask == "bool" or s.block_sparse)
        and s.scores > MATH_MAX_SCORES,
        CHUNKED_FIRST,
        "chunked first: without gradients it runs the call on torch's fused CPU kernel block by block, skipping what "
        "the window, padding or a bool mask's empty blocks rule out, where SDPA would get a dense mask",
        also=lambda call: (needs_dense_mask(call) or call.bool_mask) and can_fuse(call),
    ),
    Route(
        lambda s: _cpu(s) and _may_need_dense_mask(s) and s.scores * s.hq > DENSE_MASK_LIMIT,
        CHUNKED_FIRST,  # (on a GPU such a call is Flex's, above)
        "chunked first: SDPA would need an Nq × Nk mask built for it",
        also=needs_dense_mask,
    ),
    Route(
        lambda s: s.device == "cuda",
        ("sdpa", "triton", "flex", "chunked", "math"),
        "sdpa first: torch's fused kernels (cuDNN, flash, memory-efficient) run this call natively, the fastest on "
        "every dense cell measured (H200, bf16: cuDNN, torch's own choice there); triton next",
        measured=f"{H200}: every dense and GQA cell (D 64 and 128, N 1024-16384, causal and not) cuDNN first: forward "
        "333-627 TFLOP/s against compiled Flex's 249-496 and qkv triton's 31-334, backward 251-540 against 192-416 and "
        "104-331; causal B 4, H 16, N 4096, D 128 forward cuDNN 0.48 ms, qkv triton 2.37 (0.86 less the rule)",
    ),
    Route(
        lambda s: s.scores <= MATH_MAX_SCORES,
        ("sdpa", "math", "chunked"),
        "sdpa first: torch's fused kernel runs a plain call fastest; below this size the one-shot math path beats "
        "chunked's loop",
    ),
    Route(lambda s: True, SDPA_FIRST, "sdpa first: torch's fused kernel runs a plain call fastest"),
    # Gradients from torch's CPU kernels miss qkv's accuracy rule on every kind of call. Measured
    # against the float64 oracle (err / bound of the rule, worst of 6 seeds): float32 dV 30× where
    # queries match their own keys (q = k, std 4: one key takes a row's weight, as in real models'
    # self-matching and sink heads) and 1.3× on plain std-3 inputs, because torch recomputes the
    # weights from a float32 lse whose rounding (an ulp of 90 is 8e-6) scales every weight of the
    # row; 16-bit inputs (a forward lse off by up to ~5e-5, each head's gradient rounded to 16
    # bits; the sdpa backend refuses them); shared key/value heads (gradients summed in the input
    # dtype: dV 7× in bfloat16); float masks (dV 6×); float64 with logits of 1e31 (NaN gradients
    # from finite inputs, a fuzz case). qkv's chunked backward keeps each row's maximum and sum
    # apart (≤ 0.5×), as fast in float64 (8 heads × 1024 × 64, one thread: 315 ms against torch's
    # 355; 28 against 25 ms at 256).
    Route(
        lambda s: _cpu(s) and s.grad,
        ("sdpa",),
        "sdpa last: torch's CPU backward misses the accuracy rule for gradients",
        last=True,
    ),
)


def route(call: AttentionCall, shape: Optional[Shape] = None) -> Route:
    """The deciding row of :data:`ROUTES` for ``call`` (the table's last deciding row takes any call)."""
    shape = shape or Shape.of(call)
    return next(r for r in ROUTES if not r.last and r.applies(call, shape))


def order_names(call: AttentionCall, shape: Optional[Shape] = None) -> tuple[list[str], list[str]]:
    """``auto``'s order of backend names for ``call``, and the reasons: the deciding row's, then
    each applying ``last`` row's. Kept per :class:`Shape` where no row that applies reads the
    validated call (``also``): then the rows' answer is the shape's, and a call of a shape seen
    before costs the :class:`Shape` and one lookup. ``shape`` (default ``Shape.of(call)``) asks
    the table about the call as another shape: ``shape._replace(device="cuda")`` gives the
    order these tensors would get on a GPU."""
    shape = Shape.of(call) if shape is None else shape
    cache = _order_cache()[0]
    found = cache.get(shape)
    if found is None:
        found, keyed = _order(call, shape)
        if keyed:
            if len(cache) >= _ORDER_CACHE_SIZE:
                cache.clear()
            cache[shape] = found
    return list(found[0]), list(found[1])


def _order(call: AttentionCall, shape: Shape) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], bool]:
    """:func:`order_names`'s answer, and whether it is the shape's alone (no ``also`` was read)."""
    keyed = True
    chosen = None
    for row in ROUTES:
        if not row.last and row.when(shape):
            keyed = keyed and row.also is None
            if row.also is None or row.also(call):
                chosen = row
                break
    assert chosen is not None  # the table's last deciding row takes any call
    names, notes = list(chosen.order), []
    for row in ROUTES:
        if row.last and row.when(shape):
            keyed = keyed and row.also is None
            if row.also is None or row.also(call):
                names = [n for n in names if n not in row.order] + [n for n in row.order if n in names]
                notes.append(row.why)
    if names[0] == chosen.order[0]:  # the deciding row's reason, where its first engine stayed first
        notes.insert(0, chosen.why)
    return (tuple(names), tuple(notes)), keyed


_ORDER_CACHE_SIZE = 4096
_ORDERS: dict[Shape, tuple[tuple[str, ...], tuple[str, ...]]] = {}
_SDPA_FIRST: dict[Shape, bool] = {}
_ORDERS_FOR: list[tuple] = [()]  # the table and thresholds the kept answers were read from


def _order_cache() -> tuple[dict[Shape, tuple[tuple[str, ...], tuple[str, ...]]], dict[Shape, bool]]:
    """The kept orders and :func:`_sdpa_first` answers, emptied when the table or a threshold of
    this module has changed since they were read (a test, or a user tuning a threshold, assigns a
    new one)."""
    table = (ROUTES, MATH_MAX_SCORES, DENSE_MASK_LIMIT, VALUE_DIM_MIN_SCORES, CAUSAL_TILES_MIN_N, CAUSAL_TILES_MAX_N,
             FLEX_CPU_MIN_SCORES, MAX_DECODE_ROWS)  # fmt: skip
    if _ORDERS_FOR[0] != table:
        _ORDERS.clear()
        _SDPA_FIRST.clear()
        _ORDERS_FOR[0] = table
    return _ORDERS, _SDPA_FIRST


def plain_sdpa_call(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
    dropout_p: float, is_causal: object, scale: Optional[float],
) -> bool:  # fmt: skip
    """Whether ``auto`` would run this call on torch SDPA as given, decided without validating it.

    True only for a 4-D CPU call of plain tensors whose :class:`Shape` the table's rows send to
    SDPA first with no row that needs the validated call (``also``) or moves SDPA last: values
    pairing with keys, no empty size (torch's shapes ignore broadcasting there), ``scale > 0``,
    dropout in [0, 1), a mask on the query's device in its dtype (or bool) not combined with
    ``is_causal``. The caller checks the keyword-only features (window, padding, lse, score_mod,
    sinks). Inputs not of the plain kind (a non-tensor, an odd scale) answer False, and the call
    is validated, which explains them."""
    try:
        if not (
            query.is_cpu
            and query.dim() == 4
            and key.dim() == 4
            and value.dim() == 4
            and value.shape[1] == key.shape[1]
            and value.shape[2] == key.shape[2]
            and query.numel()
            and key.numel()
            and (scale is None or 0.0 < scale < math.inf)
            and (dropout_p == 0.0 or 0.0 < dropout_p < 1.0)
            and (
                attn_mask is None
                or (
                    not is_causal
                    and attn_mask.__class__ is torch.Tensor
                    and attn_mask.device == query.device
                    and (attn_mask.dtype is torch.bool or attn_mask.dtype is query.dtype)
                )
            )
        ):
            return False
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        shape = Shape(
            device="cpu", dtype=query.dtype, nq=query.shape[-2], nk=key.shape[-2], hq=query.shape[1],
            d=query.shape[-1], dv=value.shape[-1], causal=bool(is_causal),
            mask=None if attn_mask is None else ("bool" if attn_mask.dtype is torch.bool else "float"),
            grad=grad or (attn_mask is not None and attn_mask.requires_grad), dropout=dropout_p > 0.0,
            positional=attn_mask is not None and attn_mask.dtype is torch.bool,  # it may be key padding
        )  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):  # not tensors, or a scale/probability that does not compare
        return False
    return _sdpa_first(shape)


def _sdpa_first(shape: Shape) -> bool:
    """Do the table's rows send a call of ``shape`` to SDPA first, with no row that needs the
    validated call (``also``) or moves SDPA last? Kept per shape, as :func:`order_names` is."""
    kept = _order_cache()[1]
    found = kept.get(shape)
    if found is None:
        first = next(r for r in ROUTES if not r.last and r.when(shape))
        found = (
            first.also is None  # a row that needs the validated call leaves the call to validation
            and first.order[0] == "sdpa"
            and not any(r.last and r.when(shape) and "sdpa" in r.order for r in ROUTES)
        )
        if len(kept) >= _ORDER_CACHE_SIZE:
            kept.clear()
        kept[shape] = found
    return found


@dataclass(frozen=True)
class Kernel:
    """One row of chunked's own choice of CPU kernel (all under the same tile rules)."""

    applies: Callable[[AttentionCall], bool]
    name: Literal["decode", "flash_cpu", "tiles"]
    why: str


KERNELS: tuple[Kernel, ...] = (
    Kernel(
        can_decode, "decode",
        "a few query rows against a longer cache, no gradient: each key/value row is read once for all the rows "
        "of its group, the whole call at memory speed",
    ),
    Kernel(causal_prefill, "tiles", "causal self-attention the tile loops run faster than torch's fused kernel"),
    Kernel(
        can_fuse, "flash_cpu",
        "no gradient on a CPU: torch's fused kernel, block by block, is the fastest exact path there",
    ),
)  # fmt: skip


def chunked_kernel(call: AttentionCall, default_tiles: bool = True) -> str:
    """Which of chunked's kernels runs ``call``: the first row of :data:`KERNELS` that applies,
    else ``"tiles"`` (also whenever the caller chose its own tile sizes: ``default_tiles`` False)."""
    if default_tiles:
        for k in KERNELS:
            if k.applies(call):
                return k.name
    return "tiles"


__all__ = [
    "CAUSAL_TILES_MAX_N", "CAUSAL_TILES_MIN_N", "CHUNKED_FIRST", "DENSE_MASK_LIMIT", "FLEX_CPU_MIN_SCORES", "KERNELS", "Kernel",
    "MATH_MAX_SCORES", "ROUTES", "Route", "SDPA_FIRST", "Shape", "VALUE_DIM_MIN_SCORES", "causal_prefill",
    "chunked_kernel", "order_names", "plain_sdpa_call", "route", "value_dim_fallback",
]  # fmt: skip
