"""``qkv info``: the environment, the backends, and which one would run a given call and why."""

from __future__ import annotations

import argparse
import platform
from typing import Optional

import torch

from .backends import BACKENDS, auto_order, reasons_by_backend
from .call import AttentionCall, validate

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="1,8,1024,64", help="query shape B,H,N,D (default 1,8,1024,64)")
    p.add_argument("--kv-len", type=int, help="key/value length (default: the query length)")
    p.add_argument("--kv-heads", type=int, help="key/value heads, for grouped-query attention")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--causal", nargs="?", const="top_left", choices=["top_left", "bottom_right"], help="causal mask and its alignment")
    p.add_argument("--window", help="sliding window LEFT,RIGHT")
    p.add_argument("--padding", action="store_true", help="with a key_padding_mask")
    p.add_argument("--mask", choices=["bool", "float"], help="with a dense attn_mask")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--return-lse", action="store_true")
    p.add_argument("--grad", action="store_true", help="inputs require gradients")


def call_from_args(args: argparse.Namespace) -> AttentionCall:
    """A call with the described shapes, built from zero-stride views (no real memory)."""
    shape = _ints(args.shape)
    if len(shape) != 4:
        raise SystemExit(f"--shape wants B,H,N,D (4 numbers), got {args.shape!r}")
    b, h, n, d = shape
    nk = args.kv_len or n
    hk = args.kv_heads or h
    dtype, device = _DTYPES[args.dtype], torch.device(args.device)

    def fake(*s: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.zeros((), dtype=dt, device=device).expand(*s)

    q, k, v = fake(b, h, n, d), fake(b, hk, nk, d), fake(b, hk, nk, d)
    if args.grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    window = _ints(args.window) if args.window else None
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
        for name, rs in reasons.items():
            if rs:
                lines.append(f"  {name:<{width}}  cannot run it: " + "; ".join(rs))
            else:
                lines.append(f"  {name:<{width}}  can run it")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        call = call_from_args(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}")
        return 2
    print(report(call))
    return 0
