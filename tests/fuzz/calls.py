"""Random ``qkv.attention`` calls drawn from a seed: the fuzz test's generator.

A case is named by the base seed and a case id: ``"17"`` for the main stream, ``"t17"`` for
the small triton stream. :func:`draw` turns (seed, id) into a :class:`Spec` — plain data:
shapes, dtype, memory layouts, masks and arguments — and :func:`build` turns a spec into
tensors. Both are deterministic and independent of every other case, so
``python -m tests.fuzz --seed S --case I`` replays one case alone.

What is drawn (weights in :func:`_draw_main`):

- shapes: 0–2 batch dims (sizes 0–3, broadcast between q and k/v), heads 0–3 with GQA groups
  1–4 (or no head dim at all: ``(N, D)`` inputs), Nq/Nk from 0 to 300 with awkward sizes,
  head dims 1–80 with ``Dv != D``;
- dtypes float64/float32/float16/bfloat16; values randn, large logits or offset values,
  occasionally NaN/±inf;
- layouts: contiguous, (H, N)-swapped, transposed, permuted, strided ``[..., ::2]`` slices
  (the gaps hold NaN, or the negated bool, so a read outside the view shows), a storage
  offset, stride-0 expanded batch/head dims — for q, k, v and for the masks;
- masks: is_causal False/True/"top_left"/"bottom_right", windows (sides None/-1/0/k) with
  ``window_alignment``, key_padding_mask (with all-padding rows), bool and float attn_mask
  (broadcast shapes, -inf entries, fully masked rows, float32 masks on 16-bit inputs with a
  large common offset that 16-bit rounding would visibly damage), attn_mask with is_causal,
  torch CausalBias objects (and CausalBias with is_causal, which must raise ValueError);
- scale None/positive/large/0/negative, enable_gqa, return_lse, SDPA-style positional
  arguments, backend, and gradients with respect to any subset of q, k, v and a float mask;
- extremes (:data:`EXTREMES`): finite arguments at the float32/float64/int64 limits — scales
  up to ±3e38 and down to float32's subnormals, values whose scores reach 1e38, sinks of
  ±3e38, softcaps from 1e-30 to 3e38, ALiBi slopes and bias tables of 1e36, windows of
  2**62 and more: each must be answered exactly or refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SHORT = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16", "bool": "bool"}
BACKENDS = ("auto", "sdpa", "chunked", "math")

# Storage layouts: how the memory behind a logical tensor is arranged.
STORAGES = ("contig", "swap_hn", "t_last", "perm", "slice_last", "slice_seq", "offset")
_POISON_OFFSET = 7  # elements of poison in front of an "offset" tensor

SEQ = (1, 2, 3, 4, 5, 7, 8, 16, 17, 31, 33, 64, 97, 128)
SEQ_RARE = (0, 130, 200, 257, 300)
HEAD_DIMS = (1, 2, 4, 8, 16, 32, 59, 64, 80)
# Scores per case, B·Hq·Nq·Nk: keeps a case at a few milliseconds.
MAX_SCORES = 60_000
# Finite arguments at the limits, drawn in about 4% of the main stream's calls: which argument
# (and its weight). Each must be answered exactly (the float64 oracle on the rounded inputs) or
# refused by name; a result beyond its dtype's range (an lse of 1e39 in float32) is ±inf.
EXTREMES = {"scale": 0.3, "values": 0.2, "sinks": 0.15, "score": 0.2, "window": 0.15}
EXTREME_SCALES = (3e38, -3e38, 1e30, -1e30, 1e-30, 1e-42)
# Decoding: a few query rows against a long key/value cache (the CPU decode kernel's calls)
DECODE_ROWS = (1, 1, 2, 3, 4, 8)
DECODE_KEYS = (513, 700, 1025, 2047, 4096, 6000)


@dataclass
class TensorSpec:
    """One tensor argument: its logical shape and how its memory is laid out."""

    shape: tuple[int, ...]
    storage: str = "contig"
    perm: tuple[int, ...] = ()  # storage == "perm": the order of dims in memory
    expand: tuple[int, ...] = ()  # dims broadcast with stride 0 (the base tensor has size 1 there)

    @property
    def base_shape(self) -> tuple[int, ...]:
        return tuple(1 if i in self.expand else s for i, s in enumerate(self.shape))

    def describe(self) -> str:
        text = "(" + ",".join(map(str, self.shape)) + ")"
        marks = [] if self.storage == "contig" else [self.storage + (str(self.perm).replace(" ", "") if self.perm else "")]
        if self.expand:
            marks.append("expand" + "".join(map(str, self.expand)))
        return text + (f"[{'+'.join(marks)}]" if marks else "")


@dataclass
class MaskSpec:
    """attn_mask: a bool or float tensor, or a torch CausalBias."""

    kind: str  # "bool" | "float" | "causal_bias"
    tensor: Optional[TensorSpec] = None
    dtype: str = "bool"
    density: float = 1.0  # bool: P(True); float: P(finite entry)
    sigma: float = 1.0
    offset: float = 0.0  # a common shift: softmax ignores it, 16-bit rounding of the mask does not
    empty_rows: float = 0.0  # probability that a row is fully masked
    variant: str = ""  # causal_bias: "upper_left" | "lower_right"

    def describe(self) -> str:
        if self.kind == "causal_bias":
            return f"causal_{self.variant}()"
        assert self.tensor is not None
        extra = []
        if self.kind == "float":
            if self.density < 1:
                extra.append(f"-inf {1 - self.density:.0%}")
            if self.offset:
                extra.append(f"offset {self.offset:g}")
        elif self.density < 1:
            extra.append(f"True {self.density:.0%}")
        if self.empty_rows:
            extra.append(f"empty rows {self.empty_rows:.0%}")
        return f"{SHORT[self.dtype]}{self.tensor.describe()}" + (f"{{{', '.join(extra)}}}" if extra else "")


@dataclass
class Spec:
    """Everything about one call, as plain data."""

    seed: int
    case: str
    dtype: str
    batch: tuple[int, ...]  # broadcast batch dims
    hq: int
    hk: int
    nq: int
    nk: int
    d: int
    dv: int
    two_d: bool  # (N, D) inputs without a head dim
    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    backend: str = "auto"
    is_causal: Any = False
    window: Optional[tuple[Optional[int], Optional[int]]] = None
    window_alignment: Optional[str] = None
    key_padding: Optional[TensorSpec] = None
    kp_density: float = 1.0
    kp_empty: float = 0.0  # probability that a whole sequence is padding
    attn_mask: Optional[MaskSpec] = None
    scale: Optional[float] = None
    enable_gqa: bool = False
    return_lse: bool = False
    positional: bool = False  # pass attn_mask, dropout_p, is_causal, scale, enable_gqa positionally
    grad: tuple[str, ...] = ()  # subset of ("q", "k", "v", "mask")
    grad_api: str = "backward"  # "backward" (loss.backward()) or "func" (torch.func.grad)
    magnitude: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (sigma, mean)
    nonfinite: tuple[tuple[str, float], ...] = ()  # (tensor name, value) to plant at random places
    expect: Optional[str] = None  # the exception type an invalid call must raise
    score: Optional[str] = None  # a score function: "softcap" | "alibi" | "relbias" | "fn" | "fn_elem" (see score_mod_of)
    score_arg: float = 0.0  # softcap's cap; relbias's max distance
    score_alignment: Optional[str] = None  # alibi / relbias: where the query rows sit (None: follow is_causal)
    sinks: bool = False  # one sink logit per query head (base tensor "sinks")
    extreme: str = ""  # which argument sits at a float or integer limit (see EXTREMES)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def scores(self) -> int:
        return math.prod(self.batch) * max(self.hq, 1) * max(self.nq, 1) * max(self.nk, 1)

    @property
    def size(self) -> int:
        """A rough size for choosing the smallest reproducer of a group."""
        return math.prod(self.batch) * max(self.hq, 1) * (self.nq + 1) * (self.nk + 1) * (self.d + self.dv)

    @property
    def sdpa_compatible(self) -> bool:
        """Are all the arguments ones torch SDPA has (so SDPA may be asked the same call)?"""
        return (
            self.window is None
            and self.window_alignment is None
            and self.key_padding is None
            and not self.return_lse
            and isinstance(self.is_causal, bool)
        )

    def repro(self) -> str:
        return f"python -m tests.fuzz --seed {self.seed} --case {self.case}"

    def describe(self) -> str:
        """One line: the call in words."""
        parts = [SHORT[self.dtype], f"q{self.q.describe()}", f"k{self.k.describe()}", f"v{self.v.describe()}"]
        if self.magnitude:
            parts.append("values " + ",".join(f"{n}~{m:g}+N(0,{s:g})" if m else f"{n}~N(0,{s:g})" for n, (s, m) in self.magnitude.items()))
        if self.nonfinite:
            parts.append("nonfinite " + ",".join(f"{n}:{v}" for n, v in self.nonfinite))
        if self.attn_mask is not None:
            parts.append(f"attn_mask={self.attn_mask.describe()}")
        if self.is_causal is not False:
            parts.append(f"is_causal={self.is_causal!r}")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.window_alignment is not None:
            parts.append(f"window_alignment={self.window_alignment!r}")
        if self.key_padding is not None:
            extra = f"{{True {self.kp_density:.0%}" + (f", all-pad rows {self.kp_empty:.0%}" if self.kp_empty else "") + "}"
            parts.append(f"key_padding_mask={self.key_padding.describe()}{extra}")
        if self.scale is not None:
            parts.append(f"scale={self.scale:.4g}")
        if self.enable_gqa:
            parts.append("enable_gqa")
        if self.return_lse:
            parts.append("return_lse")
        if self.positional:
            parts.append("positional")
        if self.score is not None:
            arg = f"({self.score_arg:g})" if self.score_arg else ""
            parts.append(f"score_mod={self.score}{arg}" + (f"@{self.score_alignment}" if self.score_alignment else ""))
        if self.sinks:
            parts.append("sinks" + ("(extreme)" if self.extreme == "sinks" else ""))
        if self.extreme:
            parts.append(f"extreme={self.extreme}")
        if self.grad:
            parts.append("grad=" + ",".join(self.grad) + (" via torch.func.grad" if self.grad_api == "func" else ""))
        parts.append(f"backend={self.backend}")
        if self.expect:
            parts.append(f"expect {self.expect}")
        return " ".join(parts)

    def tags(self) -> list[str]:
        """Features of the call, for finding what a group of failures has in common."""
        t = [f"dtype={self.dtype}", f"backend={self.backend}"]
        layouts = {s.storage for s in (self.q, self.k, self.v)} - {"contig"}
        t += [f"qkv-layout={x}" for x in sorted(layouts)]
        if any(s.expand for s in (self.q, self.k, self.v)):
            t.append("qkv-expanded")
        if not all(s.storage == "contig" and not s.expand for s in (self.q, self.k, self.v)):
            t.append("qkv-noncontiguous")
        if self.two_d:
            t.append("2d-inputs")
        else:
            t.append(f"batch-dims={len(self.batch)}")
        if self.q.shape[:-3] != self.k.shape[:-3]:
            t.append("batch-broadcast")
        if 0 in (self.nq, self.nk, self.hq, *self.batch):
            t.append("empty-size")
        for name, n in (("nq", self.nq), ("nk", self.nk), ("hq", self.hq)):
            if n <= 1:
                t.append(f"{name}={n}")
        if self.nq != self.nk:
            t.append("nq!=nk")
        if 0 < self.nq <= 8 and self.nk > 512:
            t.append("decode")
        if self.dv != self.d:
            t.append("dv!=d")
        if self.hq != self.hk:
            t.append("gqa-heads")
        if self.enable_gqa:
            t.append("enable_gqa")
        if self.is_causal is not False:
            t.append(f"is_causal={self.is_causal}")
        if self.window is not None:
            t.append("window")
        if self.window_alignment is not None:
            t.append("window_alignment")
        if self.key_padding is not None:
            t.append("key_padding_mask")
        m = self.attn_mask
        if m is not None:
            t.append(f"mask={m.kind}")
            if m.kind == "causal_bias":
                t.append(f"causal_bias={m.variant}")
            else:
                assert m.tensor is not None
                if m.tensor.shape != self.scores_shape:
                    t.append("mask-broadcast")
                if m.tensor.storage != "contig" or m.tensor.expand:
                    t.append("mask-noncontiguous")
                if m.kind == "float" and m.dtype != self.dtype:
                    t.append("mask-dtype!=input")
                if m.kind == "float" and m.density < 1:
                    t.append("mask-neg-inf")
                if m.offset:
                    t.append("mask-offset")
                if m.empty_rows:
                    t.append("mask-empty-rows")
            if self.is_causal is not False:
                t.append("mask+is_causal")
        if self.scale is not None:
            t.append("scale=0" if self.scale == 0 else ("scale<0" if self.scale < 0 else "scale>0"))
        if self.return_lse:
            t.append("return_lse")
        if self.positional:
            t.append("positional")
        if self.grad:
            t.append("grad")
            t += [f"grad-{g}" for g in self.grad if g == "mask"]
            if self.grad_api == "func":
                t.append("torch.func.grad")
        if self.nonfinite:
            t.append("nonfinite")
        if self.score is not None:
            t.append(f"score_mod={self.score}")
        if self.sinks:
            t.append("sinks")
        if self.extreme:
            t.append(f"extreme={self.extreme}")
        if self.magnitude:
            t.append("big-or-offset-values")
        if self.expect:
            t.append("invalid-call")
        return t

    @property
    def scores_shape(self) -> tuple[int, ...]:
        return (self.nq, self.nk) if self.two_d else (*self.batch, self.hq, self.nq, self.nk)


# ---- drawing ------------------------------------------------------------------------------


def _pick(rng: np.random.Generator, options: dict[Any, float]) -> Any:
    keys = list(options)
    p = np.array([options[k] for k in keys], dtype=float)
    return keys[int(rng.choice(len(keys), p=p / p.sum()))]


def _seq(rng: np.random.Generator, small: bool) -> int:
    if small:
        return int(rng.choice((1, 2, 5, 16, 17, 33, 40)))
    if rng.random() < 0.08:
        return int(rng.choice(SEQ_RARE))
    return int(rng.choice(SEQ))


def _tensor_layout(rng: np.random.Generator, shape: tuple[int, ...], n_lead: int, has_heads: bool) -> TensorSpec:
    """A layout for q/k/v of logical ``shape``; ``n_lead`` batch+head dims may be expanded."""
    storage = _pick(
        rng,
        {"contig": 0.45, "swap_hn": 0.1 if has_heads else 0, "t_last": 0.1, "perm": 0.07, "slice_last": 0.1, "slice_seq": 0.06, "offset": 0.05},
    )
    perm: tuple[int, ...] = ()
    if storage == "perm":
        perm = tuple(int(i) for i in rng.permutation(len(shape)))
    expand: tuple[int, ...] = ()
    wide = [i for i in range(n_lead) if shape[i] > 1]
    if wide and rng.random() < 0.12:
        expand = tuple(sorted(int(i) for i in rng.choice(wide, size=int(rng.integers(1, len(wide) + 1)), replace=False)))
    return TensorSpec(tuple(shape), storage, perm, expand)


def _mask_layout(rng: np.random.Generator, shape: tuple[int, ...], full: tuple[int, ...]) -> TensorSpec:
    """A layout for a mask of ``shape`` (maybe broadcast) against the scores ``full``.

    "expand" passes the full shape with stride-0 dims where ``shape`` had size 1."""
    if rng.random() < 0.15 and shape != full:
        expanded = (1,) * (len(full) - len(shape)) + shape
        dims = tuple(i for i, (s, f) in enumerate(zip(expanded, full)) if s == 1 and f != 1)
        if dims:
            return TensorSpec(full, "contig", (), dims)
    storage = _pick(rng, {"contig": 0.65, "t_last": 0.15 if len(shape) > 1 else 0.0, "slice_last": 0.12, "perm": 0.08})
    perm = tuple(int(i) for i in rng.permutation(len(shape))) if storage == "perm" else ()
    return TensorSpec(tuple(shape), storage, perm)


def _broadcast_shape(
    rng: np.random.Generator, full: tuple[int, ...], min_dims: int, p_one: float = 0.3, keep_last: bool = False
) -> tuple[int, ...]:
    """A shape that broadcasts to ``full``: some dims set to 1, some leading dims dropped."""
    shape = [1 if rng.random() < p_one and not (keep_last and i == len(full) - 1) else s for i, s in enumerate(full)]
    drop = int(rng.integers(0, len(full) - min_dims + 1)) if rng.random() < 0.5 else 0
    return tuple(shape[drop:])


def _draw(seed: int, case: str) -> Spec:
    triton = case.startswith("t")
    index = int(case[1:] if triton else case)
    rng = np.random.default_rng([seed, int(triton), index])

    if triton:  # the kernels take fp16, bf16 and fp32
        dtype = _pick(rng, {"float32": 0.5, "float16": 0.25, "bfloat16": 0.25})
    else:
        dtype = _pick(rng, {"float64": 0.2, "float32": 0.35, "float16": 0.2, "bfloat16": 0.25})
    two_d = not triton and rng.random() < 0.03
    while True:
        if two_d:
            batch: tuple[int, ...] = ()
            hk = hq = 1
        else:
            n_batch = int(_pick(rng, {0: 0.3, 1: 0.45, 2: 0.25}))
            batch = tuple(0 if (not triton and rng.random() < 0.02) else int(rng.choice((1, 2, 3))) for _ in range(n_batch))
            hk = 0 if (not triton and rng.random() < 0.02) else int(_pick(rng, {1: 0.4, 2: 0.4, 3: 0.2}))
            group = int(_pick(rng, {1: 0.55, 2: 0.2, 3: 0.1, 4: 0.15}))
            hq = hk * group
        decode = not triton and not two_d and rng.random() < 0.12
        if decode:  # several parts per head, tiles of 32 keys and a ragged last tile
            nq, nk = int(rng.choice(DECODE_ROWS)), int(rng.choice(DECODE_KEYS))
        else:
            nq = _seq(rng, triton)
            nk = nq if rng.random() < 0.35 else _seq(rng, triton)
        d = int(rng.choice((8, 16, 32, 59) if triton else HEAD_DIMS))
        dv = d if rng.random() < 0.7 else int(rng.choice((8, 16, 32, 59) if triton else HEAD_DIMS))
        limit = 4 * 40 * 40 if triton else MAX_SCORES
        if math.prod(batch) * max(hq, 1) * nq * nk <= limit:
            break

    # batch dims of q and of k/v may broadcast against each other (size 1 on one side)
    q_batch, kv_batch = list(batch), list(batch)
    for i, s in enumerate(batch):
        if s > 1 and rng.random() < 0.08:
            (q_batch if rng.random() < 0.3 else kv_batch)[i] = 1
    if two_d:
        q_shape, k_shape, v_shape = (nq, d), (nk, d), (nk, dv)
    else:
        q_shape = (*q_batch, hq, nq, d)
        k_shape = (*kv_batch, hk, nk, d)
        v_shape = (*kv_batch, hk, nk, dv)
    n_lead = len(batch) + (0 if two_d else 1)
    plain = rng.random() < 0.3  # all three contiguous: the common case, and torch's fast paths
    spec = Spec(
        seed=seed,
        case=case,
        dtype=dtype,
        batch=batch,
        hq=hq,
        hk=hk,
        nq=nq,
        nk=nk,
        d=d,
        dv=dv,
        two_d=two_d,
        q=TensorSpec(q_shape) if plain else _tensor_layout(rng, q_shape, n_lead, not two_d),
        k=TensorSpec(k_shape) if plain else _tensor_layout(rng, k_shape, n_lead, not two_d),
        v=TensorSpec(v_shape) if plain else _tensor_layout(rng, v_shape, n_lead, not two_d),
    )
    spec.enable_gqa = hq != hk and (hk != 1 or rng.random() < 0.7) or rng.random() < 0.1
    spec.backend = "triton" if triton else _pick(rng, {"auto": 0.3, "sdpa": 0.25, "chunked": 0.25, "math": 0.2})

    # values: randn, or large logits (q, k), or an offset (v)
    r = rng.random()
    if r < 0.08:
        spec.magnitude = {"q": (4.0, 0.0), "k": (4.0, 0.0)}
    elif r < 0.14:
        spec.magnitude = {"v": (1.0, 3.0), "k": (1.0, 2.0)}
    finite = triton or rng.random() >= 0.05
    if not finite:
        names = [n for n in ("q", "k", "v") if rng.random() < 0.5] or ["q"]
        spec.nonfinite = tuple((n, float(rng.choice([np.nan, np.inf, -np.inf]))) for n in names)

    # positional masks
    spec.is_causal = _pick(rng, {False: 0.55, True: 0.2, "top_left": 0.08, "bottom_right": 0.17})
    if rng.random() < 0.22:
        top = max(nq, nk) + 2

        def side() -> Optional[int]:
            return _pick(rng, {None: 0.2, -1: 0.1, 0: 0.15, 1: 0.1, 2: 0.1, 5: 0.1, int(rng.integers(0, top)): 0.25})

        spec.window = (side(), side())
        if rng.random() < 0.5:
            spec.window_alignment = _pick(rng, {"top_left": 0.5, "bottom_right": 0.5})
    elif rng.random() < 0.02:
        spec.window_alignment = _pick(rng, {"top_left": 0.5, "bottom_right": 0.5})  # without a window: no effect
    scores_full = spec.scores_shape
    if rng.random() < 0.18:
        full = (nk,) if two_d else (*batch, nk)
        shape = _broadcast_shape(rng, full, 1, p_one=0.25, keep_last=True)  # (..., Nk)
        spec.key_padding = _mask_layout(rng, shape, full)
        spec.kp_density = float(rng.choice((0.4, 0.7, 0.95)))
        spec.kp_empty = float(rng.choice((0.0, 0.0, 0.3, 1.0)))

    # attn_mask
    kind = _pick(rng, {None: 0.5, "bool": 0.18, "float": 0.26, "causal_bias": 0.06})
    if kind == "causal_bias":
        spec.attn_mask = MaskSpec("causal_bias", variant=_pick(rng, {"upper_left": 0.5, "lower_right": 0.5}))
        if spec.is_causal is not False:
            if rng.random() < 0.25:
                spec.expect = "ValueError"  # torch: "CausalBias should not be used with causal=True"
            else:
                spec.is_causal = False
    elif kind is not None:
        shape = scores_full if rng.random() < 0.4 else _broadcast_shape(rng, scores_full, 2)
        m = MaskSpec(kind, _mask_layout(rng, shape, scores_full))
        m.empty_rows = float(rng.choice((0.0, 0.0, 0.0, 0.2, 0.2, 1.0)))
        if kind == "bool":
            m.density = float(rng.choice((0.2, 0.5, 0.9, 1.0)))
        else:
            m.dtype = dtype if dtype == "float32" or rng.random() < 0.5 else "float32"
            m.density = float(rng.choice((1.0, 1.0, 0.9, 0.6)))
            m.sigma = float(rng.choice((0.5, 1.0, 3.0)))
            if rng.random() < 0.3:
                # softmax ignores a common shift; rounding the mask to 16 bits does not
                # (fp16's spacing is 1/16 at 100 and 1/2 at 1000, bf16's 1/2 and 4)
                m.offset = float(rng.choice((100.0, -100.0, 1000.0)))
        spec.attn_mask = m

    r = rng.random()
    if r < 0.5:
        spec.scale = None
    elif r < 0.7:
        spec.scale = float(rng.uniform(0.05, 2.0))
    elif r < 0.75:
        spec.scale = float(rng.uniform(5.0, 20.0))
    elif r < 0.8:
        spec.scale = 0.0
    else:
        spec.scale = -float(rng.uniform(0.05, 2.0))
    spec.return_lse = rng.random() < 0.35
    spec.positional = not spec.return_lse and isinstance(spec.is_causal, bool) and rng.random() < 0.2
    if finite and rng.random() < (0.5 if triton else 0.4):
        grad = [n for n in ("q", "k", "v") if rng.random() < 0.8] if rng.random() < 0.3 else ["q", "k", "v"]
        if spec.attn_mask is not None and spec.attn_mask.kind == "float" and rng.random() < (0.05 if triton else 0.5):
            grad.append("mask")
        spec.grad = tuple(grad)
        if rng.random() < 0.15:
            spec.grad_api = "func"
    # score functions and sinks (the C loops, the torch formulation, math and the triton kernels
    # run them; triton float32 only: the 16-bit baseline that rounds P like the kernels has none)
    if spec.expect is None and (not triton or dtype == "float32"):
        if rng.random() < (0.3 if triton else 0.15):
            kinds = {"softcap": 0.35, "alibi": 0.35, "relbias": 0.3} if triton else {"softcap": 0.3, "alibi": 0.25, "relbias": 0.2, "fn": 0.15, "fn_elem": 0.1}
            spec.score = _pick(rng, kinds)
            if spec.score == "softcap":
                spec.score_arg = float(rng.choice((0.5, 3.0, 30.0)))
            elif spec.score == "relbias":
                spec.score_arg = float(rng.choice((20, 40, 128)))  # past the 16 exact offsets of 32 causal buckets
            if spec.score in ("alibi", "relbias") and rng.random() < 0.4:
                spec.score_alignment = _pick(rng, {"top_left": 0.5, "bottom_right": 0.5})
        spec.sinks = rng.random() < (0.2 if triton else 0.08)
        if (spec.score is not None or spec.sinks) and not triton:
            spec.backend = _pick(rng, {"auto": 0.35, "chunked": 0.4, "math": 0.15, "sdpa": 0.1})
            if spec.grad:
                extra = [n for n, on in (("mod", spec.score in ("alibi", "relbias", "fn", "fn_elem")), ("sinks", spec.sinks)) if on and rng.random() < 0.7]
                spec.grad = (*spec.grad, *extra)
    if spec.expect is None and not triton and rng.random() < 0.04:
        _draw_extreme(rng, spec)
    # the forward call through qkv.inspect.attention_with_stats (no gradient, keyword arguments)
    if not triton and not spec.grad and not spec.positional and spec.window_alignment is None and rng.random() < 0.12:
        spec.backend = "stats"
    return spec


def _draw_extreme(rng: np.random.Generator, spec: Spec) -> None:
    """Put one argument of ``spec`` at a float or integer limit (see :data:`EXTREMES`)."""
    spec.extreme = _pick(rng, EXTREMES)
    if spec.extreme == "scale":
        spec.scale = float(rng.choice(EXTREME_SCALES))
    elif spec.extreme == "values":  # scores up to about 1e38 (float16 holds at most 65504)
        sigma = float(rng.choice((30.0, 1e3) if spec.dtype == "float16" else (30.0, 1e15, 1e18)))
        spec.magnitude = {"q": (sigma, 0.0), "k": (sigma, 0.0)}
    elif spec.extreme == "sinks":
        spec.sinks = True
    elif spec.extreme == "score":
        spec.score = _pick(rng, {"softcap": 0.4, "alibi": 0.3, "relbias": 0.3})
        spec.score_arg = float(rng.choice((1e-30, 1e30, 3e38))) if spec.score == "softcap" else 40.0
        if spec.score == "softcap":  # a softcap reads no tensor
            spec.grad = tuple(g for g in spec.grad if g != "mod")
    else:
        big = int(rng.choice((2**62, 2**63 - 1, 10**30)))
        spec.window = _pick(rng, {(big, big): 0.4, (big, 0): 0.3, (-1, big): 0.3})


def score_mod_of(spec: Spec, table: Optional[torch.Tensor]) -> Any:
    """The score function of ``spec`` reading ``table`` (the base tensor "mod": ALiBi's slopes
    ``(Hq,)``, T5's table ``(32, Hq)``, or a bias ``(Hq, Nq + Nk - 1)`` by offset for "fn" and
    "fn_elem", the latter written per element as for FlexAttention: ``table[head][offset]``)."""
    from qkv.score_mods import ALiBi, RelativeBias, Softcap

    if spec.score == "softcap":
        return Softcap(spec.score_arg)
    assert table is not None
    if spec.score == "alibi":
        return ALiBi(table, alignment=spec.score_alignment)
    if spec.score == "relbias":
        return RelativeBias(table, bidirectional=not spec.is_causal, max_distance=int(spec.score_arg), alignment=spec.score_alignment)
    nq = spec.nq
    if spec.score == "fn_elem":

        def per_element_bias(score, batch, head, q_idx, kv_idx):  # indexes the wrong dim on tiles: mapped per element
            return score + table[head][kv_idx - q_idx + (nq - 1)]

        return per_element_bias

    def offset_bias(score, batch, head, q_idx, kv_idx):  # a learnable bias by offset, read from the closure
        return score + table[head, kv_idx - q_idx + (nq - 1)] + 0.25 * torch.cos(0.5 * q_idx)

    return offset_bias


def draw(seed: int, case: str | int) -> Spec:
    """The spec of case ``case`` ("17", or "t17" for the triton stream) under base ``seed``."""
    return _draw(int(seed), str(case))


# ---- building tensors ---------------------------------------------------------------------


@dataclass
class Inputs:
    """Base tensors of one case. ``view(name, leaf)`` lays a (maybe grad-requiring) copy of a
    base tensor out in memory as the spec says; the values are unchanged."""

    spec: Spec
    base: dict[str, torch.Tensor]  # "q", "k", "v", "mask", "kp": in the call's dtypes, base shapes
    causal_bias: Any = None

    def layout(self, name: str) -> TensorSpec:
        s = self.spec
        layouts = {"q": s.q, "k": s.k, "v": s.v, "kp": s.key_padding, "mask": s.attn_mask.tensor if s.attn_mask else None}
        return layouts[name]  # type: ignore[return-value]

    def view(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name in ("mod", "sinks"):  # the score function's tensor and the sinks: as they are
            return x
        return lay_out(x, self.layout(name))

    def logical(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The values qkv sees (expanded, any layout) — for the references."""
        return x.expand(self.layout(name).shape)


def _poison(x: torch.Tensor) -> torch.Tensor:
    """What fills the gaps of a strided view: NaN, or the negated mask for bools."""
    return ~x.detach() if x.dtype == torch.bool else torch.full_like(x.detach(), float("nan"))


def lay_out(x: torch.Tensor, t: TensorSpec) -> torch.Tensor:
    """``x`` (base shape) with the memory layout ``t`` asks for; differentiable, same values."""
    if t.storage == "swap_hn":
        x = x.transpose(-3, -2).contiguous().transpose(-3, -2)
    elif t.storage == "t_last":
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif t.storage == "perm":
        x = x.permute(t.perm).contiguous().permute(tuple(int(i) for i in np.argsort(t.perm)))
    elif t.storage == "slice_last":
        x = torch.stack([x, _poison(x)], dim=-1).flatten(-2)[..., ::2]
    elif t.storage == "slice_seq":
        x = torch.stack([x, _poison(x)], dim=-2).flatten(-3, -2)[..., ::2, :]
    elif t.storage == "offset":
        pad = _poison(x.reshape(-1)[:1].expand(_POISON_OFFSET)) if x.numel() else x.new_zeros(_POISON_OFFSET)
        x = torch.cat([pad, x.reshape(-1)])[_POISON_OFFSET:].view(x.shape)
    if t.expand:
        x = x.expand(t.shape)
    return x


def build(spec: Spec) -> Inputs:
    """The base tensors of ``spec`` (fresh randn values from the case's own seed)."""
    index = int(spec.case.lstrip("t"))
    rng = np.random.default_rng([spec.seed, int(spec.case.startswith("t")), index, 1])
    dtype = spec.torch_dtype
    base: dict[str, torch.Tensor] = {}
    for name in ("q", "k", "v"):
        t: TensorSpec = getattr(spec, name)
        sigma, mean = spec.magnitude.get(name, (1.0, 0.0))
        x = rng.standard_normal(t.base_shape) * sigma + mean
        for bad_name, value in spec.nonfinite:
            if bad_name == name and x.size:
                flat = x.reshape(-1)
                flat[rng.integers(0, flat.size, size=int(rng.integers(1, 3)))] = value
        base[name] = torch.from_numpy(x).to(dtype)
    aux = torch.float64 if spec.dtype == "float64" else torch.float32
    hq = 1 if spec.two_d else spec.hq
    if spec.score in ("alibi", "relbias", "fn", "fn_elem"):
        offsets = (hq, max(spec.nq + spec.nk - 1, 0))
        shape = {"alibi": (hq,), "relbias": (32, hq), "fn": offsets, "fn_elem": offsets}[spec.score]
        x = rng.standard_normal(shape) * (0.3 if spec.score == "alibi" else 1.0)
        if spec.extreme == "score":  # slopes and biases of 1e36: scores far beyond float32's range
            x = x * 1e36
        base["mod"] = torch.from_numpy(np.abs(x) if spec.score == "alibi" else x).to(aux)
    if spec.sinks:
        x = rng.standard_normal(hq) * 2.0
        if spec.extreme == "sinks":
            x = rng.choice((3e38, -3e38, 2.5e38, 1e30, -1e30), size=hq)
        if hq and rng.random() < 0.2:
            x[rng.integers(0, hq)] = -np.inf  # no sink on one head
        base["sinks"] = torch.from_numpy(x).to(aux)
    if spec.key_padding is not None:
        shape = spec.key_padding.base_shape
        kp = rng.random(shape) < spec.kp_density
        if kp.ndim > 1 and spec.kp_empty:
            rows = rng.random(shape[:-1]) < spec.kp_empty
            kp[rows] = False
        elif spec.kp_empty == 1.0:
            kp[...] = False
        base["kp"] = torch.from_numpy(kp)
    m = spec.attn_mask
    causal_bias = None
    if m is not None and m.kind == "causal_bias":
        from torch.nn.attention.bias import causal_lower_right, causal_upper_left

        causal_bias = (causal_lower_right if m.variant == "lower_right" else causal_upper_left)(spec.nq, spec.nk)
    elif m is not None:
        assert m.tensor is not None
        shape = m.tensor.base_shape
        empty = rng.random(shape[:-1]) < m.empty_rows if len(shape) > 1 else np.zeros((), bool)
        if m.kind == "bool":
            a = rng.random(shape) < m.density
            a[empty] = False
            base["mask"] = torch.from_numpy(a)
        else:
            f = rng.standard_normal(shape) * m.sigma + m.offset
            f[rng.random(shape) >= m.density] = -np.inf
            f[empty] = -np.inf
            base["mask"] = torch.from_numpy(f).to(DTYPES[m.dtype])
    return Inputs(spec, base, causal_bias)
