"""``attention_varlen``: attention over a packed batch of sequences of different lengths.

Shape legend::

    Tq, Tk   total query / key rows over the batch      Hq, Hk   query / key-value heads
    S        number of sequences                         D, Dv    head dims

    q (Tq, Hq, D)   k (Tk, Hk, D)   v (Tk, Hk, Dv)   cu_seqlens_q (S+1,)   cu_seqlens_k (S+1,)
    out (Tq, Hq, Dv)   lse (Hq, Tq) float32

Sequence ``s`` is rows ``cu_seqlens_q[s] : cu_seqlens_q[s+1]`` of ``q`` and attends only to rows
``cu_seqlens_k[s] : cu_seqlens_k[s+1]`` of ``k``/``v`` (flash-attn's ``flash_attn_varlen_func``
layout). The triton backend reads the offsets in the kernel, so no padding is computed;
every other backend runs one :func:`qkv.attention` call per sequence.

Semantics follow ``flash_attn_varlen_func``, so code ported from FlashAttention gives the same
numbers: ``is_causal=True`` and windows are aligned **bottom-right** within each sequence (its
last query sits at its last key) — unlike :func:`qkv.attention`, whose ``is_causal=True`` is
SDPA's top-left alignment. ``is_causal="top_left"`` asks for SDPA's alignment here too.
``window=(left, right)`` takes ``-1`` for an unbounded side, as ``window_size`` does.

``score_mod`` and ``sinks`` are :func:`qkv.attention`'s, applied per sequence: a score
function's ``batch`` index is the sequence's, ``q_idx``/``kv_idx`` count from the sequence's
start, and a built-in one (:mod:`qkv.score_mods`) whose ``alignment`` is None places its query
positions as causal calls here do (bottom-right, as FlashAttention's ALiBi, unless
``is_causal="top_left"``). The triton kernel runs the built-ins and sinks; a Python function
runs in the per-sequence loop.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Literal, Optional, Tuple, Union, overload

import torch

from .call import BackendName, check_sinks, check_tensor, compute_dtype
from .masks.rules import Alignment, IsCausal, PositionalMask, parse_causal, parse_window
from .score_mods.base import ScoreMod, check_score_mod


def _check_cu(name: str, cu: torch.Tensor, total: int, total_name: str) -> list[int]:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 offsets, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"{name} has dtype {cu.dtype}; it must hold integer offsets: "
            f"build it with torch.tensor([0, len0, len0 + len1, ...], dtype=torch.int32)"
        )
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries (0 first, the total last), got shape {tuple(cu.shape)}")
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name}[0] is {vals[0]}; the offsets must start at 0")
    bad = next((i for i in range(len(vals) - 1) if vals[i + 1] < vals[i]), None)
    if bad is not None:
        raise ValueError(
            f"{name} is not increasing: {name}[{bad + 1}] = {vals[bad + 1]} < {name}[{bad}] = {vals[bad]}; "
            "it holds cumulative sequence lengths, e.g. torch.cumsum(lengths, 0) with a 0 in front"
        )
    if vals[-1] != total:
        raise ValueError(
            f"{name}[-1] is {vals[-1]} but {total_name} has {total} rows; the last offset must equal the packed total"
        )
    return vals


# The result's type follows return_lse, as qkv.attention's does.
@overload
def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    *,
    is_causal: IsCausal = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: Literal[False] = False,
    backend: BackendName = "auto",
    score_mod: Any = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor: ...


@overload
def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    *,
    is_causal: IsCausal = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: Literal[True],
    backend: BackendName = "auto",
    score_mod: Any = None,
    sinks: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    *,
    is_causal: IsCausal = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    backend: BackendName = "auto",
    score_mod: Any = None,
    sinks: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]: ...


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    *,
    is_causal: IsCausal = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    backend: BackendName = "auto",
    score_mod: Any = None,
    sinks: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention within each sequence of a packed batch (see the module docstring for shapes).

    ``is_causal`` and ``window`` apply per sequence, aligned bottom-right as in FlashAttention
    (``is_causal="top_left"`` for SDPA's alignment); so do ``score_mod`` and ``sinks`` (see the
    module docstring). ``max_seqlen_*`` default to the longest sequence; sequences may be
    empty. ``backend="auto"`` uses the triton kernel on CUDA when it can run the call, else
    loops over sequences; a named backend never falls back.
    Validation reads the offsets on the host (one device sync).
    """
    q, k, v, hq, _ = _check_packed(q, k, v, enable_gqa)
    cq, ck, lens_q, lens_k = _check_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    causal, alignment = parse_causal(is_causal)
    if is_causal is True or not causal:  # FlashAttention's convention for causal and windows
        alignment = "bottom_right"
    win = parse_window(window)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale={scale} must be a finite number (default 1/sqrt(head_dim))")
    score_mod = check_score_mod(score_mod)
    if isinstance(score_mod, ScoreMod):
        score_mod.check_heads(hq)
        score_mod.check_dtype(compute_dtype(q.dtype))  # a cap or bias the kernels' precision cannot hold
        if score_mod.alignment is None:  # follow this call's alignment, not qkv.attention's top-left default
            score_mod = copy.copy(score_mod)
            score_mod.alignment = alignment
    if sinks is not None:
        sinks = check_sinks(sinks, hq, q)

    from .backends import BACKENDS, BackendError, get_backend

    triton = BACKENDS.get("triton")
    why = _triton_reasons(triton, q, v) if triton is not None else ["triton backend is not registered"]
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        why.append(
            "a Python score_mod cannot run in its kernel; use a built-in from qkv.score_mods (Softcap, ALiBi, "
            "RelativeBias) or another backend, which runs it per sequence"
        )
    if backend == "triton" and why:
        raise BackendError("backend 'triton' cannot run this varlen call:\n  - " + "\n  - ".join(why))
    if backend == "triton" or (backend == "auto" and q.device.type == "cuda" and not why):
        out, lse = _packed_triton(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max(lens_q), max(lens_k), causal, win, alignment, scale, score_mod, sinks
        )  # fmt: skip
        return (out, lse) if return_lse else out
    if backend != "auto":
        get_backend(backend)  # unknown names raise here
    return _per_sequence(
        q, k, v, cq, ck, alignment if causal else False, win, alignment, scale, enable_gqa, return_lse, backend, score_mod, sinks
    )  # fmt: skip


def _check_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """q, k, v packed as ``(T, H, D)`` with one dtype and device, matching head dims, a value per
    key, and query heads served by the key/value heads; also returns (Hq, Hk)."""
    q, k, v = check_tensor("q", q), check_tensor("k", k), check_tensor("v", v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be packed as (total_len, heads, head_dim), got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} is {t.dtype} but q is {q.dtype}; cast with {name}.to(q.dtype)")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it with {name}.to(q.device)")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k head dim is {k.shape[2]} but q head dim is {q.shape[2]}; they must be equal")
    if v.shape[0] != k.shape[0] or v.shape[1] != k.shape[1]:
        raise ValueError(f"v {tuple(v.shape)} must have the rows and heads of k {tuple(k.shape)}")
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk and hk != 1:
        if hq % hk:
            raise ValueError(f"k has {hk} heads but q has {hq}; {hq} is not a multiple of {hk}")
        if not enable_gqa:
            raise ValueError(f"k has {hk} heads but q has {hq}; pass enable_gqa=True for grouped-query attention")
    return q, k, v, hq, hk


def _check_offsets(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
    max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
) -> tuple[list[int], list[int], list[int], list[int]]:  # fmt: skip
    """Offsets (host lists) and sequence lengths of queries and keys, as many of each, with the
    given maxima no shorter than the longest sequence."""
    cq = _check_cu("cu_seqlens_q", cu_seqlens_q, total_q, "q")
    ck = _check_cu("cu_seqlens_k", cu_seqlens_k, total_k, "k")
    if len(cq) != len(ck):
        raise ValueError(
            f"cu_seqlens_q describes {len(cq) - 1} sequences but cu_seqlens_k describes {len(ck) - 1}; "
            "every query sequence needs its key sequence"
        )
    lens_q = [b - a for a, b in zip(cq, cq[1:])]
    lens_k = [b - a for a, b in zip(ck, ck[1:])]
    for name, given, lens in (("max_seqlen_q", max_seqlen_q, lens_q), ("max_seqlen_k", max_seqlen_k, lens_k)):
        if given is not None and given < max(lens):
            raise ValueError(f"{name}={given} is shorter than the longest sequence ({max(lens)}); pass None to compute it")
    return cq, ck, lens_q, lens_k


def _packed_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_q: int, max_k: int, causal: bool, win: Any, alignment: Alignment, scale: float, score_mod: Any,
    sinks: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The packed call on the Triton kernel in one launch: out ``(Tq, Hq, Dv)``, lse ``(Hq, Tq)``."""
    from .backends.triton.backend import run_attention

    hq, hk = q.shape[1], k.shape[1]
    g = hq // hk
    total_q = q.shape[0]
    qg = q.unflatten(1, (hk, g)).permute(1, 2, 0, 3).unsqueeze(0)  # (1, Hk, G, Tq, D)
    kg = k.permute(1, 0, 2)[None, :, None]  # (1, Hk, 1, Tk, D)
    vg = v.permute(1, 0, 2)[None, :, None]
    lo, hi = PositionalMask(0, 0, causal, win, alignment).bounds()
    rel, rel_base = _varlen_bias(score_mod, hq, max(max_q, max_k), q.device)
    out, lse = run_attention(
        qg, kg, vg, None, None, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32),
        max_q, max_k, scale=scale, lo=lo, hi=hi, bottom_right=alignment == "bottom_right",
        softcap=score_mod.softcap if score_mod is not None else None, rel=rel, rel_base=rel_base,
        rel_shift=score_mod is not None and score_mod.alignment == "bottom_right", sinks=sinks,
    )  # fmt: skip
    out = out[0].permute(2, 0, 1, 3).reshape(total_q, hq, v.shape[2])  # (Tq, Hq, Dv)
    lse = lse[0].reshape(hq, total_q)  # (Hq, Tq)
    return out, lse


def _per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cq: list[int], ck: list[int], is_causal: IsCausal, win: Any,
    alignment: Alignment, scale: float, enable_gqa: bool, return_lse: bool, backend: BackendName, score_mod: Any,
    sinks: Optional[torch.Tensor],
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """The packed call as one :func:`qkv.attention` call per sequence, outputs packed back."""
    outs, lses = [], []
    for s in range(len(cq) - 1):
        qs = q[cq[s] : cq[s + 1]].transpose(0, 1)  # (Hq, n, D)
        ks = k[ck[s] : ck[s + 1]].transpose(0, 1)  # (Hk, m, D)
        vs = v[ck[s] : ck[s + 1]].transpose(0, 1)
        from .functional import attention

        mod = score_mod
        if mod is not None and not isinstance(mod, ScoreMod):  # its batch index is the sequence's
            mod = functools.partial(_sequence_score, score_mod, s)
        res = attention(
            qs, ks, vs, is_causal=is_causal, window=win, window_alignment=alignment,
            scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, backend=backend, score_mod=mod, sinks=sinks,
        )  # fmt: skip
        o, l = res if return_lse else (res, None)
        outs.append(o.transpose(0, 1))  # (n, Hq, Dv)
        if l is not None:
            lses.append(l)  # (Hq, n)
    out = torch.cat(outs, 0)
    if return_lse:
        return out, torch.cat(lses, 1).float()
    return out


def _sequence_score(fn, seq: int, score, batch, head, q_idx, kv_idx):
    """``fn`` called on sequence ``seq``'s tiles with that batch index."""
    return fn(score, batch + seq, head, q_idx, kv_idx)


def _varlen_bias(score_mod: Optional[ScoreMod], hq: int, longest: int, device: torch.device) -> tuple[Optional[torch.Tensor], int]:
    """A built-in's bias for the packed kernel: ``(Hq, 2L - 1)`` float32 over key-minus-query
    positions ``-(L-1) .. L-1`` (``L`` the longest sequence; positions placed per sequence by
    the kernel), and the index of position 0. Differentiable in the function's tensors."""
    if score_mod is None:
        return None, 0
    ts = score_mod.tensors()
    at = ts[0].device if ts else device
    n = max(1, longest)
    d = torch.arange(-(n - 1), n, device=at)
    b = score_mod.bias(d[None, :], torch.arange(hq, device=at)[:, None], torch.float32)
    if b is None:
        return None, 0
    return b.expand(hq, d.numel()).to(device), n - 1


def _triton_reasons(triton, q: torch.Tensor, v: torch.Tensor) -> list[str]:
    """Why the triton kernel cannot run a varlen call with these tensors (empty: it can)."""
    reasons = []
    why = triton.available()
    if why:
        reasons.append(why)
    if q.dtype not in triton.DTYPES:
        reasons.append(f"dtype {q.dtype} is not supported (supported: {', '.join(str(d) for d in triton.DTYPES)})")
    if q.device.type not in triton.DEVICES:
        reasons.append("needs a CUDA device (or TRITON_INTERPRET=1 for the slow CPU interpreter)")
    if max(q.shape[2], v.shape[2]) > 256:
        reasons.append(f"head dim {max(q.shape[2], v.shape[2])} > 256")
    return reasons


__all__ = ["attention_varlen"]
