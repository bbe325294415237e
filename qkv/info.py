"""``qkv info``: the environment, the backends, and which one would run a given call and why.

The command-line options that describe the call live in :mod:`qkv.cli.info`.
"""

from __future__ import annotations

import argparse
import math
import platform
from typing import Optional

import torch

from .backends import BACKENDS, auto_order, native, order_notes, reasons_by_backend
from .call import AttentionCall, validate

__all__ = ["DTYPES", "parse_ints", "parse_shape", "parse_window", "call_from_args", "report"]

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
    )


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
    if call is not None:
        lines += ["", f"For the call: {call.describe()}"]
        reasons = reasons_by_backend(call)
        chosen = next((b.NAME for b in auto_order(call) if not reasons[b.NAME]), None)
        order = " → ".join(b.NAME for b in auto_order(call))
        lines.append(f"  auto tries {order} and picks: {chosen or 'nothing (see reasons)'}")
        lines += [f"  ({note})" for note in order_notes(call)]
        for name, rs in reasons.items():
            if rs:
                lines.append(f"  {name:<{width}}  cannot run it: " + "; ".join(rs))
            else:
                lines.append(f"  {name:<{width}}  can run it")
    return "\n".join(lines)

