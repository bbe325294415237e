"""``qkv info``: the environment, the backends, and which one would run a given call and why."""

from __future__ import annotations

import argparse
import math
import platform
from typing import Optional

import torch

from .backends import BACKENDS, auto_order, native, order_notes, reasons_by_backend
from .call import AttentionCall, validate
from .cli import UsageError, _int_at_least

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def _ints(text: str, what: str, example: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what} (whole numbers separated by commas), e.g. {example}") from None


def _shape(text: str) -> tuple[int, int, int, int]:
    shape = _ints(text, "B,H,N,D", "2,8,1024,64")
    if len(shape) != 4 or min(shape) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a query shape; give 4 whole numbers >= 0, B,H,N,D, e.g. 2,8,1024,64")
    return shape  # type: ignore[return-value]


def _window(text: str) -> tuple[Optional[int], Optional[int]]:
    parts = tuple(None if p.strip().lower() == "none" else p for p in text.split(","))
    if len(parts) == 1:
        parts *= 2  # one number: the same on both sides, as window=w means
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not LEFT,RIGHT; e.g. 128,0 (none or -1: unbounded on that side)")
    ints = [None if p is None else _ints(p, "a window size", "128,0")[0] for p in parts]
    return ints[0], ints[1]


def _device(text: str) -> torch.device:
    """A device that exists here: a name torch parses and on which a tensor can be made."""
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device name; use cpu, cuda, cuda:1, mps, ...") from None
    try:
        torch.empty(0, device=dev)
    except Exception as e:  # torch raises AssertionError, RuntimeError or others, by build
        raise argparse.ArgumentTypeError(
            f"device {text!r} is not available here ({e}); `qkv info` without --device shows what this machine has"
        ) from None
    return dev


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", type=_shape, default=(1, 8, 1024, 64), help="query shape B,H,N,D (default 1,8,1024,64)")
    p.add_argument("--kv-len", type=_int_at_least(0), help="key/value length (default: the query length)")
    p.add_argument("--kv-heads", type=_int_at_least(1), help="key/value heads, for grouped-query attention")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--device", type=_device, default=torch.device("cpu"))
    p.add_argument("--causal", nargs="?", const="top_left", choices=["top_left", "bottom_right"], help="causal mask and its alignment")
    p.add_argument("--window", type=_window, help="sliding window LEFT,RIGHT (--window=-1,0 for a leading minus)")
    p.add_argument("--padding", action="store_true", help="with a key_padding_mask")
    p.add_argument("--mask", choices=["bool", "float"], help="with a dense attn_mask")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--return-lse", action="store_true")
    p.add_argument("--grad", action="store_true", help="inputs require gradients")


def call_from_args(args: argparse.Namespace) -> AttentionCall:
    """A call with the described shapes, built from zero-stride views (no real memory)."""
    shape = _shape(args.shape) if isinstance(args.shape, str) else tuple(args.shape)
    b, h, n, d = shape
    nk = n if args.kv_len is None else args.kv_len
    hk = h if args.kv_heads is None else args.kv_heads
    for name, dims in (("query", (b, h, n, d)), ("key/value", (b, hk, nk, d)), ("attn_mask", (n, nk))):
        if math.prod(dims) >= 2**63:
            raise ValueError(f"{name} {dims} would have more than 2**63 elements; torch cannot index that many")
    dtype, device = _DTYPES[args.dtype], torch.device(args.device)

    def fake(*s: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.zeros((), dtype=dt, device=device).expand(*s)

    q, k, v = fake(b, h, n, d), fake(b, hk, nk, d), fake(b, hk, nk, d)
    if args.grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    window = (_window(args.window) if isinstance(args.window, str) else args.window) if args.window else None
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


def run(args: argparse.Namespace) -> int:
    try:
        call = call_from_args(args)
    except (ValueError, TypeError) as e:  # validate() on the described call: the options contradict
        raise UsageError(str(e)) from None
    print(report(call))
    return 0
