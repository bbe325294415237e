"""``qkv info``: the argument handling; :mod:`qkv.info` (and so torch) is imported only when it runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .args import UsageError, int_at_least


def add_parser(sub: Any, load: bool = False) -> None:
    """Add ``info``; import :mod:`qkv.info` (and so torch) only when that command is run."""
    help_ = "show backends, devices and versions"
    p = sub.add_parser("info", help=help_, description=help_)
    if not load:
        p.set_defaults(run=lambda a: 0)  # parsing only; main() rebuilds with load=True for info
        return
    try:
        from .. import info  # noqa: F401  (imports torch: a missing or broken one is reported here)
    except Exception as e:  # torch missing or broken: say so instead of a traceback
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(run=lambda a, e=e: _info_failed(e))
        return
    add_arguments(p)
    p.set_defaults(run=run)


def _info_failed(e: Exception) -> int:
    print(f"qkv info: cannot load qkv.info ({type(e).__name__}: {e}); is torch installed?", file=sys.stderr)
    return 1


def _device(text: str) -> Any:
    """A device that exists here: a name torch parses and on which a tensor can be made."""
    import torch  # only the info command needs it

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
    """The options that describe a call for :func:`qkv.info.report`."""
    import torch  # only the info command needs it

    from ..info import DTYPES, parse_shape, parse_window

    p.add_argument("--shape", type=parse_shape, default=(1, 8, 1024, 64), help="query shape B,H,N,D (default 1,8,1024,64)")
    p.add_argument("--kv-len", type=int_at_least(0), help="key/value length (default: the query length)")
    p.add_argument("--kv-heads", type=int_at_least(1), help="key/value heads, for grouped-query attention")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", type=_device, default=torch.device("cpu"))
    p.add_argument("--causal", nargs="?", const="top_left", choices=["top_left", "bottom_right"], help="causal mask and its alignment")
    p.add_argument("--window", type=parse_window, help="sliding window LEFT,RIGHT (--window=-1,0 for a leading minus)")
    p.add_argument("--padding", action="store_true", help="with a key_padding_mask")
    p.add_argument("--mask", choices=["bool", "float"], help="with a dense attn_mask")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--return-lse", action="store_true")
    p.add_argument("--grad", action="store_true", help="inputs require gradients")
    p.add_argument("--score-mod", choices=["python", "softcap", "alibi"],
                   help="with a score function: a Python one (s + 0.01·(i − j)) or a built-in")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="run the call once on compiled FlexAttention (random inputs) and report the time it took, "
                        "compilation included")  # fmt: skip

def run(args: argparse.Namespace) -> int:
    """Print the report for the call the options describe."""
    from ..info import call_from_args, compile_flex, report

    try:
        call = call_from_args(args)
    except (ValueError, TypeError) as e:  # validate() on the described call: the options contradict
        raise UsageError(str(e)) from None
    if args.compile:
        print(compile_flex(call))
    print(report(call))
    return 0
