"""GPU benchmark: forward, backward and forward+backward TFLOP/s of qkv's Triton backend and of
``qkv.attention``'s own choice (``auto``) against torch's SDPA kernels (flash, cuDNN,
memory-efficient, math) and compiled FlexAttention, measured in the same run and quoted
against the device's own measured matmul ceiling (decoding: GB/s of K and V against its copy rate).

    python bench/attention_gpu.py --out bench/results/attention_gpu.md     # full grid (stops at --max-seconds)
    python bench/attention_gpu.py --quick                                   # smaller grid, shorter timing
    python bench/attention_gpu.py --headdims 128 --seqlens 2048,4096        # one slice of the grid
    python bench/attention_gpu.py --kinds window,gqa --only 'n16384'        # extras; regex on case ids
    python bench/attention_gpu.py --list                                    # the selected case ids, no run
    python bench/attention_gpu.py --quick --order size --max-seconds 240    # breadth first under a budget
    python bench/attention_gpu.py --merge a.json b.json --out all.md        # one report from split runs (CPU)
    python bench/attention_gpu.py --dry-run --qkv-backend chunked --out /tmp/r.md   # CPU, tiny shapes

Grid (FlashAttention's benchmark): hidden 2048 = heads × head dim, 16384 tokens per batch
(batch = 16384 // N), N = 512 … 16384, head dim 64/128/256, causal and not, bfloat16, inputs in
qkv's (B, H, N, D) layout. Extras at head dim 128: sliding window (causal, 256 and 1024 keys to
the left), grouped-query attention (32 query heads on 8 or 4 key/value heads, causal), score
functions and sinks (causal: softcap 30, ALiBi, a T5 bias of 32 buckets, sinks; ``qkv-plain``
is the same call without them, so a row shows what each costs), and decoding (1 or 8 query
rows per head against 8k or 32k cached keys, 32/8 heads, batch 8, no mask, forward only, in GB/s
of K and V), and ``qkv.inspect``'s per-head statistics in one pass (``attention_stats``, causal,
N = 4096 and 16384) against the plain forward on the same inputs, in milliseconds: no peer offers
them. Implementations: ``qkv`` (``--qkv-backend``, triton by default), ``auto``
(``qkv.attention``'s choice, on every cell), ``qkv-plain``, the SDPA kernels (not on windows or
score functions, which SDPA cannot express) and ``flex`` (no sinks).

Per-call cost outside the kernels (its own section): a tiny call's wall time through
``qkv.attention`` against a bare launch of the same Triton kernel with its arguments prepared
once, and the forward at N = 1024 causal against full (``2·causal − full``: the time that does
not halve with the work).

FLOPs (counted in ``attention_flops`` only): forward 4·B·Hq·D·P, P = attended (query, key)
pairs: N² for full attention, N²/2 when causal (FlashAttention's convention, diagonal ignored),
the exact band count (w+1)(N − w/2) for a causal window of w left keys. Backward = 2.5 ×
forward, forward+backward = 3.5 × forward.

Timing: ``triton.testing.do_bench`` median over ~100 ms after ~25 ms warm-up, with CUDA events.
do_bench zeroes a 256 MB buffer before every timed call, so L2 (50 MB on H100/H200) starts cold;
a query alone here is ≥ 64 MB, so no separate input rotation is needed. Inputs are fresh random
normals each run (seed in the JSON), created with requires_grad: forward is the training forward,
as in FlashAttention's benchmark. Backward replays ``out.backward(dout, retain_graph=True)`` on
one stored forward. FlexAttention is ``torch.compile(flex_attention, dynamic=False)``; its
BlockMask is built once per case, outside the timing, as a model reuses it across layers.

Guards: every case first compares each implementation's output with an fp32 SDPA reference on
a slice (one batch entry, ≤ 2 key/value heads) and marks it ✗ when
``err > 2·err(bf16 SDPA) + 4e-3·max|ref|`` (ENGINEERING.md's rule); a NaN in qkv's output or
gradients is printed loudly and makes the exit status 1. Each (case, implementation) cell runs
under its own guard: a refusal becomes "n/a" with the reason, an out-of-memory becomes "OOM",
memory is freed, and the run goes on. Results are flushed to Markdown and JSON after every
cell, so a run stopped by a time limit (or SIGTERM) leaves a partial report; ``--max-seconds``
stops starting new cells when the budget is nearly spent.

``--order size`` runs the cases from the smallest sequence length up (every kind at N = 1k, then
4k, ...), so a budget cut drops the largest cases rather than whole kinds; ``grid`` (the
default) keeps the grid's order. The report lists the kernel configurations (tile sizes, warps,
stages) qkv's triton backend launched for each head dim, the starting point for tuning.

``--dry-run`` runs the same code on CPU with tiny shapes and a wall-clock timer, skipping the
CUDA-only peers (cuDNN, memory-efficient, FlexAttention) so the case generation, FLOP counting,
guards and report are exercised without a GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import qkv  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DTYPE = torch.bfloat16
DTYPE_NAME = str(DTYPE).replace("torch.", "")
MODES = ("fwd", "bwd", "fwd+bwd")
MODE_TITLES = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward + backward"}
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}  # backward does 2.5× the forward's matmul work
KINDS = ("dense", "window", "gqa", "score", "decode", "stats")
SCORES = ("softcap", "alibi", "t5", "sinks")

# The correctness rule of ENGINEERING.md: err(candidate) <= 2·err(plain SDPA, same dtype) + floor.
TOL_FACTOR = 2.0
FLOOR = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-6}


# ---- FLOPs --------------------------------------------------------------------------------


def attended_pairs(n: int, causal: bool = False, window: Optional[int] = None) -> float:
    """(query, key) pairs the kernel must compute for N queries over N keys.

    Full: N². Causal: N²/2 (FlashAttention's convention). Causal window of ``w`` left keys:
    query i sees keys max(0, i−w) … i, which sums exactly to (w+1)(N − w/2) when N > w.
    """
    if window is not None:
        return n * (n + 1) / 2 if n <= window + 1 else (window + 1) * (n - window / 2)
    return n * n / 2 if causal else float(n * n)


def attention_flops(batch: int, heads: int, n: int, d: int, causal: bool = False, window: Optional[int] = None) -> dict[str, float]:
    """FLOPs per call of each mode: forward 4·B·H·D·pairs (two matmuls of 2 FLOPs per
    multiply-add), backward 2.5 × forward, forward+backward 3.5 × forward. ``heads`` = query heads."""
    fwd = 4.0 * batch * heads * d * attended_pairs(n, causal, window)
    return {mode: FLOP_FACTOR[mode] * fwd for mode in MODES}


# ---- cases --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    kind: str  # one of KINDS
    batch: int
    hq: int
    hkv: int
    n: int  # sequence length (keys; queries too, except decode)
    d: int
    causal: bool
    window: Optional[int] = None  # keys to the left each query sees besides itself (causal band)
    score: Optional[str] = None  # "score": one of SCORES
    nq: int = 0  # "decode": query rows per head (against n cached keys)

    @property
    def id(self) -> str:
        if self.kind == "window":
            return f"window{self.window}-d{self.d}-n{self.n}"
        tag = "causal" if self.causal else "full"
        if self.kind == "gqa":
            return f"gqa{self.hq}x{self.hkv}-d{self.d}-n{self.n}-{tag}"
        if self.kind == "score":
            return f"{self.score}-d{self.d}-n{self.n}-{tag}"
        if self.kind == "decode":
            return f"decode-q{self.nq}-kv{self.n}-{self.hq}x{self.hkv}-d{self.d}"
        if self.kind == "stats":
            return f"stats-d{self.d}-n{self.n}-{tag}"
        return f"dense-d{self.d}-n{self.n}-{tag}"

    @property
    def queries(self) -> int:
        return self.nq or self.n

    @property
    def modes(self) -> tuple[str, ...]:
        """Decoding and statistics have no gradient: forward only."""
        return ("fwd",) if self.kind in ("decode", "stats") else MODES

    def flops(self) -> dict[str, float]:
        if self.kind == "decode":  # every query row sees every cached key
            fwd = 4.0 * self.batch * self.hq * self.d * self.nq * self.n
            return {mode: FLOP_FACTOR[mode] * fwd for mode in MODES}
        return attention_flops(self.batch, self.hq, self.n, self.d, self.causal, self.window)

    def kv_bytes(self) -> int:
        """Bytes of K and V (bf16) a decoding call must read: its roofline is this over the copy rate."""
        return 2 * self.batch * self.hkv * self.n * self.d * 2


@dataclass(frozen=True)
class Grid:
    tokens: int = 16384  # per batch: batch = tokens // N
    hidden: int = 2048  # heads = hidden // head dim
    seqlens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    headdims: tuple[int, ...] = (64, 128, 256)
    extra_d: int = 128
    extra_seqlens: tuple[int, ...] = (4096, 16384)
    windows: tuple[int, ...] = (256, 1024)
    gqa: tuple[tuple[int, int], ...] = ((32, 8), (32, 4))  # (query heads, key/value heads)
    scores: tuple[str, ...] = SCORES  # causal, head dim extra_d, at extra_seqlens
    # (query rows, cached keys): Nq <= 8, KV >= 8k; (1, 32768) is the call the H200 first timed (auto 3.28 ms, SDPA 0.25 ms)
    decode: tuple[tuple[int, int], ...] = ((1, 8192), (1, 32768), (8, 32768))
    decode_batch: int = 8
    decode_heads: tuple[int, int] = (32, 8)  # (query heads, key/value heads)
    math_max_n: int = 4096  # SDPA math materialises B·H·N² scores (and their gradient)
    stats_seqlens: tuple[int, ...] = (4096, 16384)  # qkv.inspect's statistics in one pass against the forward


GRIDS = {
    "full": Grid(),
    "quick": Grid(seqlens=(1024, 4096, 16384), headdims=(64, 128), extra_seqlens=(4096,), windows=(1024,), gqa=((32, 8),)),
    "dry": Grid(tokens=128, hidden=128, seqlens=(32, 64), headdims=(64, 128), extra_d=64, extra_seqlens=(64,), windows=(16,), gqa=((4, 2),),
                decode=((1, 64), (4, 128)), decode_batch=2, decode_heads=(4, 2), math_max_n=32, stats_seqlens=(64,)),
}  # fmt: skip


def build_cases(grid: Grid, headdims=None, seqlens=None, kinds=KINDS, only: Optional[str] = None) -> list[Case]:
    """The grid's cases, filtered: ``headdims``/``seqlens`` replace the grid's lists (extras too;
    decoding keeps its own lengths), ``kinds`` picks among :data:`KINDS`, ``only`` is a regex
    searched in each case id."""
    dims = tuple(headdims or grid.headdims)
    dense_ns = tuple(seqlens or grid.seqlens)
    extra_ns = tuple(seqlens or grid.extra_seqlens)
    cases: list[Case] = []
    if "dense" in kinds:
        for d in dims:
            for n in dense_ns:
                for causal in (False, True):
                    h = grid.hidden // d
                    cases.append(Case("dense", max(1, grid.tokens // n), h, h, n, d, causal))
    if grid.extra_d in dims:
        d, h = grid.extra_d, grid.hidden // grid.extra_d
        if "window" in kinds:
            cases += [Case("window", max(1, grid.tokens // n), h, h, n, d, True, w) for w in grid.windows for n in extra_ns]
        if "gqa" in kinds:
            cases += [Case("gqa", max(1, grid.tokens // n), hq, hk, n, d, True) for hq, hk in grid.gqa for n in extra_ns]
        if "score" in kinds:
            cases += [Case("score", max(1, grid.tokens // n), h, h, n, d, True, score=sc) for sc in grid.scores for n in extra_ns]
        if "decode" in kinds:
            hq, hk = grid.decode_heads
            cases += [Case("decode", grid.decode_batch, hq, hk, kv, d, False, nq=nq) for nq, kv in grid.decode]
        if "stats" in kinds:
            cases += [Case("stats", max(1, grid.tokens // n), h, h, n, d, True) for n in tuple(seqlens or grid.stats_seqlens)]
    if only:
        cases = [c for c in cases if re.search(only, c.id)]
    return cases


ORDERS = ("grid", "size")


def order_cases(cases: list[Case], order: str) -> list[Case]:
    """``grid``: as built; ``size``: by sequence length (a decoding call by its query rows, the
    cheapest cells), then grid order (a stable sort)."""
    return sorted(cases, key=lambda c: c.queries) if order == "size" else list(cases)


# ---- implementations ----------------------------------------------------------------------


class Unsupported(Exception):
    """The implementation declines this case; the message is the reason shown in the report."""


@dataclass(frozen=True)
class Context:
    device: str
    qkv_backend: str
    math_max_n: int
    dry_run: bool


Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@lru_cache(maxsize=None)
def score_parts(case: Case, device: str) -> dict:
    """qkv's arguments for a score-function case (the same tensors for every implementation and
    the reference: drawn once per case from a fixed seed)."""
    from qkv.score_mods import ALiBi, RelativeBias, Softcap, alibi_slopes

    g = torch.Generator().manual_seed(0)
    if case.score == "softcap":
        return {"score_mod": Softcap(30.0)}
    if case.score == "alibi":
        return {"score_mod": ALiBi(alibi_slopes(case.hq).to(device))}
    if case.score == "t5":
        return {"score_mod": RelativeBias((torch.randn(32, case.hq, generator=g) * 0.5).to(device), bidirectional=False)}
    if case.score == "sinks":
        return {"sinks": torch.randn(case.hq, generator=g).to(device)}
    return {}


def qkv_kwargs(case: Case, ctx: Context, plain: bool = False) -> dict:
    """qkv.attention's keywords for a case; ``plain``: without its score function or sinks."""
    kw: dict = {"enable_gqa": case.hq != case.hkv}
    if case.window is not None:
        kw["window"] = (case.window, 0)  # query p sees keys p−w … p: causal by construction
    else:
        kw["is_causal"] = case.causal
    if case.kind == "score" and not plain:
        kw.update(score_parts(case, ctx.device))
    return kw


STATS_TOPK = 5  # attention_stats' default top-k


def build_qkv(case: Case, ctx: Context, backend: Optional[str] = None, plain: bool = False) -> Run:
    if case.kind == "stats" and not plain:
        return build_stats(case, ctx)
    kw = dict(qkv_kwargs(case, ctx, plain), backend=backend or ctx.qkv_backend)
    return lambda q, k, v: qkv.attention(q, k, v, **kw)


def build_stats(case: Case, ctx: Context) -> Run:
    """``qkv.inspect.attention_stats`` in one pass (no lse given: it is found on the way), the
    triton kernel when qkv's backend is triton, else the tiled torch pass; the run returns the
    lse it found, which the guard checks (entropy, top-k and the rest come from the same sums)."""
    from qkv.inspect import attention_stats

    which = "triton" if ctx.qkv_backend == "triton" else "torch"
    return lambda q, k, v: attention_stats(q, k, is_causal=case.causal, topk=STATS_TOPK, backend=which).lse


def build_sdpa(backend: str, case: Case, ctx: Context) -> Run:
    if backend == "MATH" and case.n > ctx.math_max_n:
        raise Unsupported(f"not run above N = {ctx.math_max_n}: materialises B·H·N² scores")
    which = getattr(SDPBackend, backend)
    kw = {"is_causal": case.causal}
    if case.hq != case.hkv:
        kw["enable_gqa"] = True

    def run(q, k, v):
        with sdpa_kernel(which):  # only the forward picks a kernel; backward follows it
            return F.scaled_dot_product_attention(q, k, v, **kw)

    return run


def flex_mask_mod(case: Case):
    """FlexAttention's mask_mod for the case (True = attend), or None for full attention."""
    if case.window is not None:
        w = case.window
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= w)
    if case.causal:
        return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    return None


@lru_cache(maxsize=1)
def compiled_flex():
    """One compiled flex_attention; every new shape recompiles, so lift dynamo's recompile cap."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 4096))
            break
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8192)
    return torch.compile(flex_attention, dynamic=False)


def flex_score(case: Case, ctx: Context) -> Optional[Callable]:
    """FlexAttention's score_mod for a score case (qkv's built-ins follow Flex's contract);
    raises for sinks, which Flex has no argument for."""
    if case.kind != "score":
        return None
    if case.score == "sinks":
        raise Unsupported("FlexAttention has no attention sinks")
    mod = score_parts(case, ctx.device)["score_mod"]
    if case.score == "t5":  # Flex traces the function: give it a gather it can compile
        n = case.n
        rel = mod.kernel_form(case.hq, n, n, "top_left", torch.float32).rel  # (H, 2N-1)
        return lambda score, b, h, q_idx, kv_idx: score + rel[h, kv_idx - q_idx + (n - 1)]
    return mod


def build_flex(case: Case, ctx: Context) -> Run:
    from torch.nn.attention.flex_attention import create_block_mask

    score_mod = flex_score(case, ctx)
    mask_mod = flex_mask_mod(case)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, case.queries, case.n, device=ctx.device)
    flex = compiled_flex()
    gqa = case.hq != case.hkv
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask, score_mod=score_mod, enable_gqa=gqa)


@dataclass(frozen=True)
class Peer:
    build: Callable[[Case, Context], Run]
    kinds: tuple[str, ...]
    cuda_only: bool = False


# name -> how to build its call for a case. SDPA has no sliding window or score function, so it
# sits out "window" and "score". "qkv" is the backend under test (--qkv-backend, triton by
# default), "auto" qkv.attention's own choice, "qkv-plain" the backend under test on the same
# call without its score function or sinks (what a score function or sinks cost). On a "stats"
# case "qkv" is qkv.inspect's statistics in one pass and "qkv-plain" the plain forward: no peer
# offers the statistics.
ATTENTION_KINDS = tuple(k for k in KINDS if k != "stats")
PEERS: dict[str, Peer] = {
    "qkv": Peer(build_qkv, KINDS),
    "auto": Peer(partial(build_qkv, backend="auto"), ATTENTION_KINDS),
    "qkv-plain": Peer(partial(build_qkv, plain=True), ("score", "stats")),
    "sdpa-flash": Peer(partial(build_sdpa, "FLASH_ATTENTION"), ("dense", "gqa", "decode")),
    "sdpa-cudnn": Peer(partial(build_sdpa, "CUDNN_ATTENTION"), ("dense", "gqa", "decode"), cuda_only=True),
    "sdpa-efficient": Peer(partial(build_sdpa, "EFFICIENT_ATTENTION"), ("dense", "gqa", "decode"), cuda_only=True),
    "sdpa-math": Peer(partial(build_sdpa, "MATH"), ("dense", "gqa", "decode")),
    "flex": Peer(build_flex, ATTENTION_KINDS, cuda_only=True),
}
# implementations that are qkv itself (the rest are peers)
OURS = ("qkv", "auto", "qkv-plain")


# ---- inputs and the correctness guard -----------------------------------------------------


def make_inputs(case: Case, ctx: Context, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=ctx.device).manual_seed(seed)

    def randn(h, n):  # (B, H, N, D)
        t = torch.randn(case.batch, h, n, case.d, device=ctx.device, dtype=DTYPE, generator=g)
        return t if case.kind in ("decode", "stats") else t.requires_grad_()

    return randn(case.hq, case.queries), randn(case.hkv, case.n), randn(case.hkv, case.n)


def check_slice(case: Case) -> tuple[int, int]:
    """(query heads, key/value heads) compared by the guard: batch entry 0, ≤ 2 kv heads."""
    hkv = min(case.hkv, 2)
    return hkv * (case.hq // case.hkv), hkv


def dense_mask(case: Case, device) -> Optional[torch.Tensor]:
    """The (N, N) bool mask (True = attend) of a window case for SDPA; None otherwise."""
    if case.window is None:
        return None
    i = torch.arange(case.n, device=device)
    diff = i[:, None] - i[None, :]  # query − key
    return (diff >= 0) & (diff <= case.window)


REF_ROWS = 256  # a score case is checked on its first query rows (its relative positions stay the same)


def reference(case: Case, q, k, v, ctx: Optional[Context] = None) -> dict:
    """fp32 reference on the check slice, and how far the plain bf16 computation lands from it:
    SDPA for plain cases, qkv's ``math`` backend on the first :data:`REF_ROWS` query rows (all
    heads) for score functions and sinks, and its lse there for the statistics (whose run
    returns the lse it found)."""
    hq, hkv = check_slice(case)
    with torch.no_grad():
        if case.kind == "stats":
            qs, ks, vs = q[:1, :, :REF_ROWS], k[:1], v[:1]
            ref = qkv.attention(qs.float(), ks.float(), vs.float(), is_causal=case.causal, backend="math", return_lse=True)[1]
            base = qkv.attention(qs, ks, vs, is_causal=case.causal, backend="math", return_lse=True)[1]
        elif case.kind == "score":
            kw = qkv_kwargs(case, ctx or Context(str(q.device.type), "math", 0, False))
            qs, ks, vs = q[:1, :, :REF_ROWS], k[:1], v[:1]
            ref = qkv.attention(qs.float(), ks.float(), vs.float(), backend="math", **kw)
            base = qkv.attention(qs, ks, vs, backend="math", **kw)
        else:
            qs, ks, vs = q[:1, :hq], k[:1, :hkv], v[:1, :hkv]
            ks, vs = (t.repeat_interleave(case.hq // case.hkv, dim=1) for t in (ks, vs))  # (1, hq, N, D)
            mask = dense_mask(case, q.device)
            kw = {"attn_mask": mask, "is_causal": case.causal and mask is None}
            ref = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float(), **kw)
            base = F.scaled_dot_product_attention(qs, ks, vs, **kw)
        base_err = (base.float() - ref).abs().max().item()
        bound = TOL_FACTOR * base_err + FLOOR[DTYPE] * max(1.0, ref.abs().max().item())
    return {"ref": ref, "base_err": base_err, "bound": bound}


def check_output(case: Case, out: torch.Tensor, ref: dict) -> dict:
    hq, _ = check_slice(case)
    got = out[:1, :, :REF_ROWS] if case.kind in ("score", "stats") else out[:1, :hq]
    err = (got.detach().float() - ref["ref"]).abs().max().item()
    return {"err": err, "bound": ref["bound"], "base_err": ref["base_err"], "ok": err <= ref["bound"]}


# ---- timing -------------------------------------------------------------------------------


def gpu_timer(warmup_ms: int, rep_ms: int):
    from triton.testing import do_bench

    def time_ms(fn, grad_to_none=None) -> float:
        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median")

    return time_ms


def cpu_timer(fn, grad_to_none=None, repeats: int = 1) -> float:
    """Dry-run stand-in for do_bench: median wall time in ms; the numbers mean nothing."""
    fn()
    samples = []
    for _ in range(repeats):
        for t in grad_to_none or ():
            t.grad = None
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str, collect: bool = False) -> None:
    """Return cached blocks to the device; ``collect`` also breaks reference cycles (slow: ~0.1 s),
    needed after a failure, whose traceback may hold the tensors."""
    if collect:
        gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_ceilings(ctx: Context, time_ms) -> dict:
    """The device's own roofs: a large bf16 matmul and a device-to-device copy."""
    n = 256 if ctx.dry_run else 8192
    a, b = (torch.randn(n, n, device=ctx.device, dtype=DTYPE) for _ in range(2))
    mm_ms = time_ms(lambda: torch.mm(a, b))
    numel = (1 << 18) if ctx.dry_run else (1 << 28)  # float32: 1 MiB / 1 GiB
    src = torch.randn(numel, device=ctx.device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    out = {
        "matmul_n": n,
        "matmul_tflops": 2 * n**3 / mm_ms / 1e9,
        "copy_bytes": src.numel() * src.element_size(),
        "copy_gbps": 2 * src.numel() * src.element_size() / copy_ms / 1e6,  # read + write
    }
    del a, b, src, dst
    free_memory(ctx.device)
    return out


def wall_us(fn, device: str, iters: int) -> float:
    """Wall-clock µs per call of ``fn`` over ``iters`` calls after one warm-up: for a call whose
    kernel is tiny this is the host's cost (Python, validation, launches)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters * 1e6


def measure_overhead(ctx: Context, time_ms, grid: "Grid") -> dict:
    """The per-call cost outside the kernels, two ways: a tiny call's wall time through
    ``qkv.attention`` against a bare launch of the same kernel, and a forward at N = 1024,
    causal against full (2·causal − full: the part that does not halve with the work)."""
    n = grid.seqlens[0] if ctx.dry_run else 1024
    d = 64
    heads, batch = grid.hidden // d, max(1, grid.tokens // n)
    iters = 5 if ctx.dry_run else 200
    ov: dict = {"backend": ctx.qkv_backend, "n": n, "batch": batch, "heads": heads, "tiny_n": 16 if ctx.dry_run else 128,
                "iters": iters}  # fmt: skip
    try:
        g = torch.Generator(device=ctx.device).manual_seed(0)
        tiny = [torch.randn(1, 1, ov["tiny_n"], d, device=ctx.device, dtype=DTYPE, generator=g) for _ in range(3)]
        ov["wrapper_us"] = wall_us(lambda: qkv.attention(*tiny, is_causal=True, backend=ctx.qkv_backend), ctx.device, iters)
        ov["auto_us"] = wall_us(lambda: qkv.attention(*tiny, is_causal=True), ctx.device, iters)
        if ctx.qkv_backend == "triton" and ctx.device == "cuda":
            from qkv.backends.triton.backend import bare_forward

            ov["bare_us"] = wall_us(bare_forward(*tiny, d**-0.5, causal=True), ctx.device, iters)
            ov["overhead_us"] = ov["wrapper_us"] - ov["bare_us"]
        else:
            ov["error"] = "the bare launch needs the triton backend on CUDA"
        big = [torch.randn(batch, heads, n, d, device=ctx.device, dtype=DTYPE, generator=g) for _ in range(3)]
        ov["full_us"] = 1e3 * time_ms(lambda: qkv.attention(*big, backend=ctx.qkv_backend))
        ov["causal_us"] = 1e3 * time_ms(lambda: qkv.attention(*big, is_causal=True, backend=ctx.qkv_backend))
        ov["fixed_us"] = 2 * ov["causal_us"] - ov["full_us"]
    except Exception as exc:  # noqa: BLE001 — reported, the run goes on
        ov["error"] = failure(exc, [])["reason"]
    free_memory(ctx.device)
    return ov


# ---- one cell: a case × an implementation -------------------------------------------------


def failure(exc: BaseException, caught: list) -> dict:
    """Status and a one-line reason for a cell or mode that did not produce a time."""
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return {"status": "oom", "reason": "out of memory"}
    if isinstance(exc, Unsupported):
        return {"status": "skip", "reason": str(exc)}
    lines = [str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__]
    for w in caught:  # SDPA explains a refusal in warnings before raising "No available kernel"
        msg = str(w.message).strip().splitlines()[0] if str(w.message).strip() else ""
        if msg and msg not in lines:
            lines.append(msg)
    reason = f"{type(exc).__name__}: " + " / ".join(lines)
    return {"status": "error", "reason": reason[:400]}


def run_mode(mode: str, fn: Run, q, k, v, out, dout, time_ms, flops: float) -> dict:
    grads = [q, k, v]
    if mode == "fwd":
        call = lambda: fn(q, k, v)  # noqa: E731
    elif mode == "bwd":
        call = lambda: out.backward(dout, retain_graph=True)  # noqa: E731
    else:
        call = lambda: fn(q, k, v).backward(dout)  # noqa: E731
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()  # first call compiles / autotunes, outside the timing
        ms = time_ms(call, grad_to_none=grads if mode != "fwd" else None)
        return {"status": "ok", "ms": ms, "tflops": flops / ms / 1e9}
    except Exception as exc:  # noqa: BLE001 — one failing mode must not lose the others
        return failure(exc, caught)


def run_cell(name: str, case: Case, ctx: Context, inputs, ref: dict, time_ms) -> dict:
    """Build, probe, check and time one implementation on one case; never raises an Exception."""
    peer = PEERS[name]
    q, k, v = inputs
    rec: dict = {"status": "ok"}
    caught: list = []
    try:
        if peer.cuda_only and ctx.device != "cuda":
            raise Unsupported("needs CUDA (dry run on CPU)")
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn = peer.build(case, ctx)
            out = fn(q, k, v)
            sync(ctx.device)
        rec["first_call_s"] = time.perf_counter() - t0
        if not torch.isfinite(out).all():
            rec.update(status="nan", reason="NaN or inf in the output")
        else:
            # qkv-plain answers another call (no score function): its time is what it is for
            rec["check"] = check_output(case, out, ref) if name != "qkv-plain" else {"ok": True, "err": math.nan, "bound": math.nan,
                                                                                      "base_err": math.nan}  # fmt: skip
            dout = torch.randn_like(out) if out.requires_grad else None
            flops = case.flops()
            rec["modes"] = {m: run_mode(m, fn, q, k, v, out, dout, time_ms, flops[m]) for m in case.modes}
            fwd = rec["modes"]["fwd"]
            if case.kind == "decode" and fwd["status"] == "ok":
                fwd["gbps"] = case.kv_bytes() / fwd["ms"] / 1e6  # K and V read once: the decoding roofline
            if any(t.grad is not None and not torch.isfinite(t.grad).all() for t in (q, k, v)):
                rec.update(status="nan", reason="NaN or inf in the gradients")
    except Exception as exc:  # noqa: BLE001 — one failing cell must not stop the run
        rec = {**rec, **failure(exc, caught)}
    finally:
        out = dout = None  # noqa: F841 — drop the graph before freeing memory
        for t in (q, k, v):
            t.grad = None
    statuses = [rec["status"]] + [m["status"] for m in rec.get("modes", {}).values()]
    free_memory(ctx.device, collect=any(s in ("oom", "error") for s in statuses))
    return rec


# ---- the run: budget, incremental flush ---------------------------------------------------


class Budget:
    """Stops starting cells when what is left is less than the longest cell so far (plus slack)."""

    def __init__(self, seconds: float):
        self.seconds, self.t0, self.longest = seconds, time.monotonic(), 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def allows_another(self) -> bool:
        if self.seconds <= 0:
            return True
        slack = min(10.0, 0.05 * self.seconds)
        return self.seconds - self.elapsed() > 1.25 * self.longest + slack

    def record(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)


class Recorder:
    """Holds the run's data and rewrites the Markdown report and its JSON after every cell."""

    def __init__(self, out: Path, meta: dict, cases: list[Case]):
        self.out = out
        self.data: dict = {"runs": [{"meta": meta, "ceilings": {}}], "cases": [], "not_run": [c.id for c in cases]}
        self.qkv_failures: list[str] = []

    def start_case(self, case: Case, seed: int) -> dict:
        rec = {"id": case.id, "run": 0, **dataclasses.asdict(case), "flops": case.flops(), "seed": seed, "results": {}}
        self.data["cases"].append(rec)
        return rec

    def finish_case(self, case: Case, complete: bool) -> None:
        if complete:
            self.data["not_run"].remove(case.id)

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        json_path = self.out.with_suffix(".json")
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, json_path)  # a reader never sees half a file
        self.out.write_text(render_report(self.data))


def loud(msg: str) -> None:
    bar = "!" * 78
    print(f"\n{bar}\n{msg}\n{bar}\n", file=sys.stderr, flush=True)


def progress(budget: Budget, case: Case, name: str, rec: dict) -> None:
    if rec["status"] != "ok":
        summary = f"{rec['status']}: {rec.get('reason', '')}"[:160]
    else:
        cells = [f"{m} {r['tflops']:.4g}" if r["status"] == "ok" else f"{m} {r['status']}" for m, r in rec["modes"].items()]
        summary = "  ".join(cells) + " TFLOP/s" + ("" if rec["check"]["ok"] else "  ✗ check")
    print(f"[{budget.elapsed():6.0f}s] {case.id:<28} {name:<15} {summary}", flush=True)


def run_cases(cases: list[Case], impls: list[str], ctx: Context, rec: Recorder, budget: Budget, time_ms) -> None:
    for case in cases:
        if not budget.allows_another():
            print(f"[{budget.elapsed():6.0f}s] budget nearly spent: {len(rec.data['not_run'])} cases not started", flush=True)
            return
        seed = int.from_bytes(os.urandom(4), "little")
        crec = rec.start_case(case, seed)
        inputs = make_inputs(case, ctx, seed)
        try:
            ref = reference(case, *inputs, ctx=ctx)
        except Exception as exc:  # noqa: BLE001
            crec["error"] = failure(exc, [])["reason"]
            ref = {"ref": None, "base_err": math.nan, "bound": math.nan}
        if ref["ref"] is None:
            free_memory(ctx.device, collect=True)
        complete = True
        for name in impls:
            if case.kind not in PEERS[name].kinds:
                continue
            if not budget.allows_another():
                complete = False
                break
            t0 = time.monotonic()
            cell = run_cell(name, case, ctx, inputs, ref, time_ms) if ref["ref"] is not None else {"status": "error", "reason": crec["error"]}
            budget.record(time.monotonic() - t0)
            crec["results"][name] = cell
            progress(budget, case, name, cell)
            if name in OURS:
                qkv_guard(case, cell, rec, name)
            rec.save()
        del inputs, ref
        free_memory(ctx.device)
        rec.finish_case(case, complete)
        rec.save()


def qkv_guard(case: Case, cell: dict, rec: Recorder, name: str = "qkv") -> None:
    tag = "" if name == "qkv" else f" ({name})"
    if cell["status"] == "nan":
        rec.qkv_failures.append(f"{case.id}{tag}: {cell['reason']}")
        loud(f"qkv{tag} produced NaN on {case.id}: {cell['reason']}")
    elif cell["status"] == "ok" and not cell["check"]["ok"]:
        c = cell["check"]
        loud(f"qkv{tag} disagrees with the fp32 reference on {case.id}: max error {c['err']:.3e} > bound {c['bound']:.3e}")


# ---- report -------------------------------------------------------------------------------


def fmt_num(x: float) -> str:
    """A rate for a table: whole numbers from 100, one decimal from 10, else 3 significant digits."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def _gflop(flops: float) -> str:
    return f"{flops / 1e9:.5g}"


class Reasons:
    """Numbered footnotes for cells that have no time, one number per (implementation, reason)."""

    def __init__(self):
        self.index: dict[tuple[str, str], int] = {}

    def ref(self, impl: str, reason: str) -> int:
        return self.index.setdefault((impl, reason), len(self.index) + 1)

    def lines(self) -> list[str]:
        return [f"{i}. `{impl}`: {reason}" for (impl, reason), i in self.index.items()]


def cell_text(res: Optional[dict], mode: str, ceiling: float, impl: str, reasons: Reasons) -> str:
    if res is None:
        return "—"
    if res["status"] == "ok":
        wrong = "" if res["check"]["ok"] else " ✗"  # any implementation's output that fails the guard
        res = res["modes"][mode]
        if res["status"] == "ok" and "gbps" in res:  # decoding: bytes of K and V per second
            return f"{fmt_num(res['gbps'])} GB/s{wrong}"
        if res["status"] == "ok":
            return f"{fmt_num(res['tflops'])} ({res['tflops'] / ceiling:.0%}){wrong}"
    if res["status"] == "oom":
        return "OOM"
    if res["status"] == "nan":
        return "NaN!"
    return f"n/a [{reasons.ref(impl, res['reason'])}]"


def check_text(res: Optional[dict]) -> str:
    if res is None:
        return "—"
    if res["status"] == "nan":
        return "NaN!"
    if "check" not in res:
        return "—"
    c = res["check"]
    return f"✓ {c['err']:.1e}" if c["ok"] else f"✗ {c['err']:.1e} > {c['bound']:.1e}"


def cell_tflops(res: Optional[dict], mode: str) -> Optional[float]:
    """TFLOP/s of one implementation's result in ``mode``, or None when it has no time."""
    if res and res["status"] == "ok" and mode in res["modes"] and res["modes"][mode]["status"] == "ok":
        return res["modes"][mode]["tflops"]
    return None


# Row columns and section title per case kind; sections group cases by (kind, head dim, query heads).
ROW_COLUMNS = {
    "dense": [("N", lambda c: c["n"]), ("batch", lambda c: c["batch"]), ("causal", lambda c: "yes" if c["causal"] else "no")],
    "window": [("N", lambda c: c["n"]), ("batch", lambda c: c["batch"]), ("window", lambda c: c["window"])],
    "gqa": [("N", lambda c: c["n"]), ("batch", lambda c: c["batch"]), ("kv heads", lambda c: c["hkv"]),
            ("causal", lambda c: "yes" if c["causal"] else "no")],
    "score": [("N", lambda c: c["n"]), ("batch", lambda c: c["batch"]), ("score", lambda c: c["score"])],
    "decode": [("N", lambda c: c["nq"]), ("batch", lambda c: c["batch"]), ("KV", lambda c: c["n"]),
               ("heads", lambda c: f"{c['hq']}/{c['hkv']}")],
    "stats": [("N", lambda c: c["n"]), ("batch", lambda c: c["batch"])],
}  # fmt: skip


def section_title(kind: str, d: int, hq: int, tokens: int) -> str:
    if kind == "dense":
        return f"Head dim {d} · {hq} heads · hidden {hq * d} · {tokens} tokens per batch"
    if kind == "window":
        return f"Sliding window (causal; each query sees itself and `window` keys before it) · head dim {d} · {hq} heads"
    if kind == "score":
        return f"Score functions and sinks (causal; softcap 30, ALiBi, T5 bias with 32 buckets, sinks) · head dim {d} · {hq} heads"
    if kind == "decode":
        return f"Decoding (N query rows per head against a KV cache, no mask, no gradient; GB/s of K and V) · head dim {d} · {hq} query heads"
    if kind == "stats":
        return f"Attention statistics in one pass against the forward (causal, no gradient) · head dim {d} · {hq} heads"
    return f"Grouped-query attention (causal) · head dim {d} · {hq} query heads"


def _ms(res: Optional[dict]) -> Optional[float]:
    """The forward's ms of one result, or None."""
    if res and res["status"] == "ok" and res["modes"].get("fwd", {}).get("status") == "ok":
        return res["modes"]["fwd"]["ms"]
    return None


def stats_ratio(case: dict) -> Optional[float]:
    """Time of the statistics in one pass ÷ time of the plain forward on the same inputs."""
    stats, fwd = _ms(case["results"].get("qkv")), _ms(case["results"].get("qkv-plain"))
    return stats / fwd if stats is not None and fwd else None


def render_stats_section(cases: list[dict], reasons: Reasons) -> list[str]:
    """Milliseconds, not TFLOP/s: the statistics do the score matmul and no P·V."""
    lines = ["", f"`qkv.inspect.attention_stats(q, k, is_causal=True, topk={STATS_TOPK})` — entropy, largest weight, top-{STATS_TOPK} "
             "weights and keys, mean distance, weight on key 0 and on keys i−1 and i of every query row — in one pass that finds "
             "the lse on the way (no lse given), against the plain forward `qkv.attention(q, k, v, is_causal=True)` (`qkv-plain`) "
             "on the same inputs; no peer here offers these statistics.", "",
             "| N | batch | forward ms | statistics ms | statistics ÷ forward | lse check |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for c in cases:
        cells = [str(c["n"]), str(c["batch"])]
        for name in ("qkv-plain", "qkv"):
            ms, res = _ms(c["results"].get(name)), c["results"].get(name)
            cells.append(f"{ms:.3g}" if ms is not None else "—" if res is None else
                         "OOM" if res["status"] == "oom" else "NaN!" if res["status"] == "nan" else f"n/a [{reasons.ref(name, res['reason'])}]")  # fmt: skip
        r = stats_ratio(c)
        cells += [f"{r:.2f}×" if r is not None else "—", check_text(c["results"].get("qkv"))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_section(kind: str, cases: list[dict], runs: list[dict], qkv_backend: str, reasons: Reasons) -> list[str]:
    present = {name for c in cases for name in c["results"]}
    impls = [n for n in PEERS if kind in PEERS[n].kinds and n in present]
    others = [n for n in impls if n not in OURS]
    baseline = [n for n in others if n.startswith("sdpa-")] or others
    ratio_head = "qkv ÷ best SDPA" if baseline and baseline[0].startswith("sdpa-") else f"qkv ÷ {' / '.join(baseline)}"
    names = [f"qkv {qkv_backend}" if n == "qkv" else n for n in impls]
    rows = ROW_COLUMNS[kind]
    lines: list[str] = []
    if kind == "window":
        lines += ["", "SDPA has no sliding-window argument (a dense N×N mask would be a different workload), so FlexAttention is the peer."]
    if kind == "score":
        lines += ["", "`qkv-plain`: the same call without its score function or sinks; FlexAttention has no sinks."]
    for mode in (("fwd",) if kind == "decode" else MODES):
        head = [h for h, _ in rows] + [f"GFLOP {mode}"] + names + [ratio_head]
        if mode == "fwd":
            head.append("qkv check")
        align = [":---:" if h == "causal" else "---:" for h in head]
        lines += ["", f"### {MODE_TITLES[mode]}", "", "| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
        for c in cases:
            ceiling = runs[c["run"]]["ceilings"].get("matmul_tflops") or math.nan
            cells = [str(f(c)) for _, f in rows] + [_gflop(c["flops"][mode])]
            cells += [cell_text(c["results"].get(n), mode, ceiling, n, reasons) for n in impls]
            ours = cell_tflops(c["results"].get("qkv"), mode)
            best = max((t for t in (cell_tflops(c["results"].get(n), mode) for n in baseline) if t is not None), default=None)
            if kind == "decode":
                ours, best = _gbps(c["results"].get("qkv")), max((t for t in (_gbps(c["results"].get(n)) for n in baseline) if t), default=None)
            cells.append(f"{ours / best:.2f}×" if ours is not None and best else "—")
            if mode == "fwd":
                cells.append(check_text(c["results"].get("qkv")))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _gbps(res: Optional[dict]) -> Optional[float]:
    """GB/s of K and V of a decoding result, or None."""
    if res and res["status"] == "ok" and res["modes"].get("fwd", {}).get("status") == "ok":
        return res["modes"]["fwd"].get("gbps")
    return None


def render_overhead(ov: dict) -> list[str]:
    """The per-call cost outside the kernels (:func:`measure_overhead`)."""
    if not ov:
        return []

    def us(x):
        return "unmeasured" if x is None else f"{x:.1f} µs"

    lines = ["", "## Per-call cost outside the kernels", "",
             f"Wall-clock µs per call of a tiny forward (B = 1, H = 1, N = {ov['tiny_n']}, D = 64), averaged over {ov['iters']} calls; "
             f"and GPU time of a forward at N = {ov['n']} (B = {ov['batch']}, {ov['heads']} heads, D = 64), causal against full: "
             "with the kernel time halved by causality, `2·causal − full` is what does not scale with the work.", "",
             "| what | value |", "|---|---:|",
             f"| qkv.attention (`{ov['backend']}`), tiny call | {us(ov.get('wrapper_us'))} |",
             f"| qkv.attention (`auto`), tiny call | {us(ov.get('auto_us'))} |",
             f"| bare kernel launch (arguments prepared once) | {us(ov.get('bare_us'))} |",
             f"| wrapper − bare | {us(ov.get('overhead_us'))} |",
             f"| forward full, N = {ov['n']} | {us(ov.get('full_us'))} |",
             f"| forward causal, N = {ov['n']} | {us(ov.get('causal_us'))} |",
             f"| 2·causal − full | {us(ov.get('fixed_us'))} |"]  # fmt: skip
    if ov.get("error"):
        lines += ["", f"Not measured: {ov['error']}"]
    return lines


def render_report(data: dict) -> str:
    runs, cases = data["runs"], data["cases"]
    meta = runs[0]["meta"]
    lines = ["# qkv GPU attention benchmark", ""]
    for i, run in enumerate(runs):
        m, ce = run["meta"], run["ceilings"]
        prefix = f"Run {i + 1}: " if len(runs) > 1 else ""
        lines.append(
            f"{prefix}{m['date']} · {m['device']} · torch {m['torch']} (CUDA {m['cuda']}, cuDNN {m['cudnn']}) · "
            f"triton {m['triton']} · Python {m['python']} · qkv `{m['qkv_backend']}` backend · git {m['git']}  "
        )
        lines.append(f"`{m['command']}`" + (" — **dry run on CPU: numbers mean nothing**" if m["dry_run"] else ""))
        lines.append("")
        if ce:
            lines.append(
                f"Ceilings measured in this run: bf16 matmul {ce['matmul_n']}³ **{fmt_num(ce['matmul_tflops'])} TFLOP/s**; "
                f"device-to-device copy of {ce['copy_bytes'] / 2**20:.0f} MiB **{fmt_num(ce['copy_gbps'])} GB/s** (read + write)."
            )
            lines.append("")
    if len({r["meta"]["device"] for r in runs}) > 1:
        lines += ["**These runs used different devices: compare numbers only within a run.**", ""]
    bad = [c for c in cases if _qkv_bad(c)]
    if bad:
        lines += ["## ⚠ Correctness", ""] + [f"- `{c['id']}`: {_qkv_bad(c)}" for c in bad] + [""]
    lines += [
        f"TFLOP/s of {DTYPE_NAME} attention per implementation, median of `triton.testing.do_bench` (CUDA events, cold L2, "
        "after warm-up); in parentheses the fraction of the matmul ceiling above. FLOPs per call (the GFLOP column): "
        "forward 4·B·H·D·P with P = N² (N²/2 causal; (w+1)(N − w/2) for a causal window of w keys), "
        "backward 2.5×, forward+backward 3.5× the forward. Forward runs on inputs that require grad (the training forward).",
        "",
        "`n/a [k]`: the implementation refused the case, reason k at the end; `OOM`: out of memory; `—`: not run. "
        "`qkv check`: max |error| of qkv's output against fp32 SDPA on a slice (batch 0, ≤ 2 kv heads); ✗ when above "
        "2 × bf16 SDPA's own error + 4e-3·max|ref|, on any implementation's cell.",
    ]
    reasons = Reasons()
    groups: dict[tuple, list[dict]] = {}
    for c in cases:
        groups.setdefault((KINDS.index(c["kind"]), c["d"], c["hq"]), []).append(c)
    for kind_i, d, hq in sorted(groups):
        group = sorted(groups[kind_i, d, hq], key=lambda c: (c["n"], c["window"] or 0, -c["hkv"], c["causal"]))
        kind = KINDS[kind_i]
        lines += ["", f"## {section_title(kind, d, hq, group[0]['batch'] * group[0]['n'])}"]
        if kind == "stats":
            lines += render_stats_section(group, reasons)
        else:
            lines += render_section(kind, group, runs, meta["qkv_backend"], reasons)
    lines += render_overhead(data.get("overhead") or {})
    configs = meta.get("kernel_configs") or {}
    if configs:
        lines += ["", f"## Kernel configurations (qkv triton, {DTYPE_NAME}; from the launch table for this GPU, mask kind `any`)", "",
                  "| head dim | kernel | BLOCK_M | BLOCK_N | warps | stages |", "|---:|---|---:|---:|---:|---:|"]  # fmt: skip
        for d, kinds in configs.items():
            for kind, c in kinds.items():
                lines.append(f"| {d} | {kind} | {c['BLOCK_M']} | {c['BLOCK_N']} | {c['num_warps']} | {c['num_stages']} |")
    if reasons.index:
        lines += ["", "## Reasons", ""] + reasons.lines()
    if data["not_run"]:
        ids = data["not_run"]
        lines += ["", f"## Not run ({len(ids)} cases: time budget or interruption)", "", ", ".join(f"`{i}`" for i in ids), "",
                  "Resume with `--only '^(" + "|".join(ids) + ")$'` and merge the JSON files with `--merge`."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _qkv_bad(c: dict) -> str:
    res = c["results"].get("qkv")
    if not res:
        return ""
    if res["status"] == "nan":
        return res["reason"]
    if res["status"] == "ok" and not res["check"]["ok"]:
        return f"max error {res['check']['err']:.3e} > bound {res['check']['bound']:.3e}"
    return ""


def merge(paths: list[Path]) -> dict:
    """One data set from several runs' JSON; a case measured again in a later file replaces the earlier one."""
    runs: list[dict] = []
    by_id: dict[str, dict] = {}
    complete: set[str] = set()
    pending: list[str] = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        offset = len(runs)
        runs += d["runs"]
        for c in d["cases"]:
            if c["id"] not in d["not_run"]:
                complete.add(c["id"])
                by_id[c["id"]] = {**c, "run": c["run"] + offset}
            elif c["id"] not in complete:  # a partial case never replaces a complete one
                by_id[c["id"]] = {**c, "run": c["run"] + offset}
        pending += [i for i in d["not_run"] if i not in pending]
    return {"runs": runs, "cases": list(by_id.values()), "not_run": [i for i in pending if i not in complete]}


# ---- main ---------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "attention_gpu.md", help="Markdown report; the JSON goes next to it")
    ap.add_argument("--quick", action="store_true", help="smaller grid and shorter timing")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, wall-clock timer: checks the logic only")
    ap.add_argument("--qkv-backend", default="triton", help="qkv backend to measure (default triton)")
    ap.add_argument("--headdims", type=_ints, help="e.g. 64,128 (extras run when their head dim 128 is included)")
    ap.add_argument("--seqlens", type=_ints, help="e.g. 2048,4096 (applies to the extras too)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="any of dense,window,gqa")
    ap.add_argument("--only", help="regex searched in case ids, e.g. 'd128-n(2048|4096)-causal'")
    ap.add_argument("--impls", default=",".join(PEERS), help=f"implementations to run, of {','.join(PEERS)}")
    ap.add_argument("--order", choices=ORDERS, default="grid", help="grid order, or smallest N first (breadth first under a budget)")
    ap.add_argument("--math-max-seqlen", type=int, help="largest N for SDPA's math backend")
    ap.add_argument("--max-seconds", type=float, default=540.0, help="stop starting cells near this budget; 0 = none")
    ap.add_argument("--list", action="store_true", help="print the selected case ids and exit")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON", help="render one report from these runs' JSON files")
    args = ap.parse_args(argv)
    unknown = set(args.impls.split(",")) - set(PEERS) | set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        ap.error(f"unknown --impls/--kinds {sorted(unknown)}; choose from {list(PEERS)} and {list(KINDS)}")
    return args


def git_rev() -> str:
    """The commit measured: ``QKV_GIT_REV`` where the tree travelled without its .git (the GPU
    host), else git's answer."""
    if os.environ.get("QKV_GIT_REV"):
        return os.environ["QKV_GIT_REV"]
    try:
        res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5)
        return res.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def kernel_configs(ctx: Context, headdims) -> dict:
    """Tile sizes, warps and stages qkv's triton backend launches per head dim ({} for other backends)."""
    if ctx.qkv_backend != "triton":
        return {}
    try:
        from qkv.backends.triton.backend import launch_config
    except Exception:  # noqa: BLE001 — no triton: the qkv column already says why
        return {}
    item = torch.tensor([], dtype=DTYPE).element_size()
    dev = torch.device(ctx.device)
    return {str(d): {kind: launch_config(kind, d, d, item, device=dev)._asdict() for kind in ("fwd", "bwd_dkdv", "bwd_dq", "decode")}
            for d in headdims}


def collect_meta(args: argparse.Namespace, ctx: Context) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cuda = ctx.device == "cuda"
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)" if props else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cudnn": (torch.backends.cudnn.version() if cuda else None) or "none",
        "triton": triton_version,
        "python": platform.python_version(),
        "git": git_rev(),
        "qkv_backend": ctx.qkv_backend,
        "dtype": DTYPE_NAME,
        "dry_run": ctx.dry_run,
        "command": " ".join(["python", "bench/attention_gpu.py", *sys.argv[1:]]),
        "kernel_configs": kernel_configs(ctx, args.headdims or GRIDS["dry" if ctx.dry_run else "quick" if args.quick else "full"].headdims),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        data = merge(args.merge)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(render_report(data))
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
        print(f"wrote {args.out}")
        return 0
    grid = GRIDS["dry" if args.dry_run else "quick" if args.quick else "full"]
    cases = order_cases(build_cases(grid, args.headdims, args.seqlens, args.kinds.split(","), args.only), args.order)
    if args.list:
        print("\n".join(c.id for c in cases))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or use --dry-run to check the logic on CPU", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # fewer OOMs from fragmentation
    ctx = Context("cpu" if args.dry_run else "cuda", args.qkv_backend, args.math_max_seqlen or grid.math_max_n, args.dry_run)
    if args.qkv_backend not in qkv.backends.BACKENDS:
        loud(f"qkv has no {args.qkv_backend!r} backend here (have {sorted(qkv.backends.BACKENDS)}); its column will say why")
    time_ms = cpu_timer if args.dry_run else gpu_timer(*((10, 40) if args.quick else (25, 100)))
    rec = Recorder(args.out, collect_meta(args, ctx), cases)
    budget = Budget(args.max_seconds)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` → SystemExit → the finally below
    print(f"{len(cases)} cases; budget {args.max_seconds:.0f} s; writing {args.out}", flush=True)
    try:
        rec.data["runs"][0]["ceilings"] = measure_ceilings(ctx, time_ms)
        print(f"ceilings: {json.dumps(rec.data['runs'][0]['ceilings'])}", flush=True)
        rec.data["overhead"] = measure_overhead(ctx, time_ms, grid)
        print(f"per-call overhead: {json.dumps(rec.data['overhead'])}", flush=True)
        rec.save()
        run_cases(cases, args.impls.split(","), ctx, rec, budget, time_ms)
    finally:
        rec.data["runs"][0]["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
        rec.save()
        print(f"wrote {args.out} and {args.out.with_suffix('.json')} after {budget.elapsed():.0f} s", flush=True)
    if rec.qkv_failures:
        loud("qkv produced NaN:\n" + "\n".join(rec.qkv_failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
