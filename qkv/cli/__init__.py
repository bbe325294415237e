"""The ``qkv`` command: the map from each command to the module that runs it.

``qkv trace "Thinking Machines"``  every step of self-attention on a sentence, then a narrative
``qkv trace TEXT --model``          the same for one real head of all-MiniLM-L6-v2 (``--block``: a whole encoder block)
``qkv demo``                       a guided walk-through for a newcomer
``qkv explain TEXT --focus she``   what a pretrained model's heads do with one word (:mod:`qkv.viz`)
``qkv info``                       installed backends and devices (lives in :mod:`qkv.info`)
``qkv experiments run all --out D``  measured claims about attention, with a report (:mod:`qkv.experiments`)

``trace`` and ``demo --no-model`` use only the NumPy reference, so they start without importing torch;
``explain`` and the model part of ``demo`` import torch and matplotlib only when they run;
:mod:`qkv.info` (which needs torch) is imported only when the ``info`` command is asked for.
Each command lives in its own module (:mod:`qkv.cli.trace`, :mod:`qkv.cli.demo`, :mod:`qkv.cli.explain`,
:mod:`qkv.cli.info`, :mod:`qkv.cli.experiments`) with ``add_parser(subparsers)``; argument types shared
by them are in :mod:`qkv.cli.args`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from ..glass.toy import sentence_trace, worked_example
from . import demo, experiments, explain, info, studio, trace
from ..extras import MissingExtra
from .args import MODEL_SENTENCE, UsageError
from .demo import DEMO_PARTS
from .trace import TRACE_STEPS

__all__ = [
    "main", "build_parser", "sentence_trace", "worked_example", "DEMO_PARTS", "MODEL_SENTENCE", "UsageError", "TRACE_STEPS",
]


def _version() -> str:
    try:
        from .. import __version__  # type: ignore[attr-defined]

        return str(__version__)
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        return version("qkv")
    except Exception:  # not installed: running from a source tree
        return "unknown"



def build_parser(load_info: bool = False) -> argparse.ArgumentParser:
    """The ``qkv`` argument parser; ``load_info=True`` imports :mod:`qkv.info` for its options."""
    parser = argparse.ArgumentParser(
        prog="qkv", description="Self-attention from the equations up: see every step, then go fast."
    )
    parser.add_argument("--version", action="version", version=f"qkv {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    trace.add_parser(sub)
    demo.add_parser(sub)
    explain.add_parser(sub)
    info.add_parser(sub, load_info)
    experiments.add_parser(sub)
    studio.add_parser(sub)
    return parser


def _utf8_safe_stdout() -> None:
    """Keep √, ᵀ and Chinese from crashing a terminal whose encoding cannot show them."""
    enc = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    if enc != "utf8" and hasattr(sys.stdout, "reconfigure"):
        try:
            sys.stdout.reconfigure(errors="replace")
        except Exception:  # an unusual stream: leave it alone
            pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``qkv`` command; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(load_info=command == "info")
    try:
        args = parser.parse_args(args_list)
    except SystemExit as e:  # --help, --version and usage errors
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    _utf8_safe_stdout()
    try:
        return int(args.run(args) or 0)
    except UsageError as e:
        sys.stdout.flush()  # what was printed before the mistake came to light stays above the message
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except MissingExtra as e:  # a feature whose optional packages are not installed: name the extra
        sys.stdout.flush()
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `qkv demo | head`: the reader left; exit quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot fail again
        except (OSError, ValueError, AttributeError):
            pass
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
