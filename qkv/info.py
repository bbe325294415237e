"""``qkv info``: the environment, the backends, and which one would run a given call and why.

The command-line options that describe the call live in :mod:`qkv.cli.info`.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from dataclasses import replace
from typing import Any, Optional

import torch

from .backends import BACKENDS, auto_order, flex, native, order_notes, reasons_by_backend, route
from .call import AttentionCall, validate

__all__ = ["DTYPES", "parse_ints", "parse_shape", "parse_window", "call_from_args", "compile_flex", "report"]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def parse_ints(text: str, what: str, example: str) -> tuple[int, ...]:
    """Whole numbers separated by commas (or x), e.g. ``2,8,1024,64``."""
    try:
        return tuple(int(x) for x in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what} (whole numbers separated by commas), e.g. {example}") from None


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """A query shape ``B,H,N,D`` (four whole numbers >= 0)."""
    shape = parse_ints(text, "B,H,N,D", "2,8,1024,64")
    if len(shape) != 4 or min(shape) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a query shape; give 4 whole numbers >= 0, B,H,N,D, e.g. 2,8,1024,64")
    return shape  # type: ignore[return-value]


def parse_window(text: str) -> tuple[Optional[int], Optional[int]]:
    """A sliding window ``LEFT,RIGHT``; none or -1 leaves that side unbounded."""
    parts = tuple(None if p.strip().lower() == "none" else p for p in text.split(","))
    if len(parts) == 1:
        parts *= 2  # one number: the same on both sides, as window=w means
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not LEFT,RIGHT; e.g. 128,0 (none or -1: unbounded on that side)")
    ints = [None if p is None else parse_ints(p, "a window size", "128,0")[0] for p in parts]
    return ints[0], ints[1]


def call_from_args(args: argparse.Namespace) -> AttentionCall:
    """A call with the described shapes, built from zero-stride views (no real memory)."""
    shape = parse_shape(args.shape) if isinstance(args.shape, str) else tuple(args.shape)
    b, h, n, d = shape
    nk = n if args.kv_len is None else args.kv_len
    hk = h if args.kv_heads is None else args.kv_heads
    for name, dims in (("query", (b, h, n, d)), ("key/value", (b, hk, nk, d)), ("attn_mask", (n, nk))):
        if math.prod(dims) >= 2**63:
            raise ValueError(f"{name} {dims} would have more than 2**63 elements; torch cannot index that many")
    dtype, device = DTYPES[args.dtype], torch.device(args.device)

    def fake(*s: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.zeros((), dtype=dt, device=device).expand(*s)

    q, k, v = fake(b, h, n, d), fake(b, hk, nk, d), fake(b, hk, nk, d)
    if args.grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    window = (parse_window(args.window) if isinstance(args.window, str) else args.window) if args.window else None
    mask = None
    if args.mask:
        mask = fake(n, nk, dt=torch.bool if args.mask == "bool" else dtype)
    return validate(
        q,
        k,
        v,
        mask,
        args.dropout,
        args.causal or False,
        None,
        hk != h,
        window=window,
        key_padding_mask=fake(b, nk, dt=torch.bool) if args.padding else None,
        return_lse=args.return_lse,
        score_mod=_score_mod(getattr(args, "score_mod", None), h),
    )


def _score_mod(kind: Optional[str], heads: int) -> Any:
    """The score function ``qkv info --score-mod`` describes."""
    from .score_mods import ALiBi, Softcap, alibi_slopes

    if kind == "python":
        return lambda s, b, h, i, j: s + 0.01 * (i - j)
    if kind == "softcap":
        return Softcap(30.0)
    if kind == "alibi":
        return ALiBi(alibi_slopes(heads))
    return None


def compile_flex(call: AttentionCall) -> str:
    """Run ``call``'s shapes once on compiled FlexAttention (random inputs, the call's masks and
    score function) and say how long it took, compilation included — or why it cannot run."""
    engine = BACKENDS["flex"]
    reasons = engine.not_supported_reasons(call)
    if reasons:
        return "flex cannot run this call: " + "; ".join(reasons)

    def real(t: torch.Tensor) -> torch.Tensor:
        out = torch.randn(t.shape, dtype=t.dtype, device=t.device) if t.is_floating_point() else torch.ones(t.shape, dtype=t.dtype, device=t.device)
        return out.requires_grad_(t.requires_grad)

    live = replace(call, query=real(call.query), key=real(call.key), value=real(call.value),
                   given_mask=None if call.given_mask is None else real(call.given_mask),
                   key_padding_mask=None if call.key_padding_mask is None else real(call.key_padding_mask))  # fmt: skip
    before = len(flex.compile_log())
    t0 = time.perf_counter()
    engine.forward(live)
    took = time.perf_counter() - t0
    new = flex.compile_log()[before:]
    return f"flex ran the call in {took:.2f} s" + (" (its first of this kind: compilation included)" if new else " (already compiled)")


def report(call: Optional[AttentionCall] = None) -> str:
    """Human-readable report: environment, backends, and per-backend reasons for ``call``."""
    lines = [
        f"qkv {__import__('qkv').__version__} · torch {torch.__version__} · Python {platform.python_version()}",
        f"CPU threads: {torch.get_num_threads()} · CUDA: {'yes, ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no'}",
        f"Native CPU kernels (qkv/csrc): {native.status()}",
        "",
        "Backends:",
    ]
    width = max(len(n) for n in BACKENDS)
    for name, b in BACKENDS.items():
        why = b.available()
        lines.append(f"  {name:<{width}}  {'available' if why is None else 'unavailable: ' + why} — {b.DESCRIPTION}")
    compiled = flex.compile_log()
    lines.append(
        f"Compilation ({flex.COMPILE_ENV}): {'on' if flex.compile_enabled() else 'off'}; FlexAttention compiled for "
        f"{len(compiled)} kind(s) of call in this process"
        + (f", first calls (compilation included): {', '.join(f'{r.seconds:.1f} s' for r in compiled)}" if compiled else "")
    )
    if call is not None:
        lines += ["", f"For the call: {call.describe()}"]
        reasons = reasons_by_backend(call)
        chosen = next((b.NAME for b in auto_order(call) if not reasons[b.NAME]), None)
        order = " → ".join(b.NAME for b in auto_order(call))
        lines.append(f"  auto tries {order} and picks: {chosen or 'nothing (see reasons)'}")
        lines += [f"  ({note})" for note in order_notes(call)]
        measured = route(call).measured
        if measured:
            lines.append(f"  (measured: {measured})")
        for name, rs in reasons.items():
            if rs:
                lines.append(f"  {name:<{width}}  cannot run it: " + "; ".join(rs))
            else:
                lines.append(f"  {name:<{width}}  can run it")
    return "\n".join(lines)

