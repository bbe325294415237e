"""Argument types shared by the ``qkv`` commands, and :class:`UsageError`."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Callable, Optional

from ..locale import LANGUAGES, text

__all__ = [
    "UsageError", "MODEL_SENTENCE", "WROTE", "int_at_least", "precision", "megabytes", "cap", "sink_list",
    "existing_parent", "output_file", "output_dir", "existing_dir", "write_error", "Precision", "shared_options",
]

MODEL_SENTENCE = (
    "Alice is an outstanding software engineer; she led the development of the company's core "
    "recommendation system."
)  # the same text as qkv.analysis.explain.SENTENCE, kept here so that importing the CLI stays light


class UsageError(Exception):
    """A mistake in the command line found after parsing (an unwritable --out, a device not here).

    :func:`main` prints it as ``qkv COMMAND: error: MESSAGE`` on stderr and exits with 2, as
    argparse does for the mistakes it finds itself.
    """


def int_at_least(low: int, high: Optional[int] = None, why: str = "") -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            n = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{n} is too small; use {low} or more")
        if high is not None and n > high:
            raise argparse.ArgumentTypeError(f"{n} is too large; use at most {high}{why}")
        return n

    return parse


def precision(s: str) -> int:
    n = int_at_least(0)(s)
    if n > 15:
        raise argparse.ArgumentTypeError(f"{n} digits is more than float64 holds; use 0 to 15")
    return n


def _number(s: str, not_a_number: str, ok: Callable[[float], bool], not_ok: str) -> float:
    """``s`` as a float that ``ok`` accepts; each failure explained by its own message."""
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(not_a_number.format(s=s)) from None
    if not ok(x):
        raise argparse.ArgumentTypeError(not_ok.format(s=s))
    return x


def megabytes(s: str) -> float:
    """A finite number of megabytes >= 0 (inf, nan and negatives are mistakes, not limits)."""
    return _number(s, "{s!r} is not a number of megabytes, e.g. 50", lambda x: math.isfinite(x) and x >= 0,
                   "{s} is not a size; use a finite number of megabytes >= 0, e.g. 50 (a large one such as 1e6 for no limit)")


def cap(s: str) -> float:
    """--softcap: a finite number > 0."""
    return _number(s, "{s!r} is not a number; give the cap, e.g. 30 (scores end up inside (-30, 30))",
                   lambda x: math.isfinite(x) and x > 0, "{s} is not a cap; use a finite number > 0, e.g. 30")


def sink_list(s: str) -> list[float]:
    """--sinks: comma-separated finite logits (one for every head, or one per head)."""
    parts = [p.strip() for p in s.split(",")]
    if not s.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"{s!r} is not a list of sink logits; give one number, or one per head: 0.5 or 0.5,-1")
    values = []
    for p in parts:
        try:
            x = float(p)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{p!r} is not a number; give sink logits such as 0.5 or 0.5,-1") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"{p} is not a sink logit; use finite numbers such as 0.5 or -1")
        values.append(x)
    return values


def existing_parent(path: str) -> str:
    """The deepest folder of ``path`` that exists (``path`` itself when it does)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def output_file(s: str) -> str:
    """A file path we could create or overwrite: checked before any work, so a typo costs no model run."""
    if not s:
        raise argparse.ArgumentTypeError("the file name is empty")
    parent = os.path.dirname(os.path.abspath(s))
    if os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"cannot write {s}: it is a directory; give a file name such as {os.path.join(s, 'x')}")
    if not os.path.exists(parent):
        raise argparse.ArgumentTypeError(f"cannot write {s}: directory {parent} does not exist (create it first)")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {s}: {parent} is not a directory")
    target = s if os.path.exists(s) else parent
    if not os.access(target, os.W_OK):
        what = "the file" if target == s else f"directory {parent}"
        raise argparse.ArgumentTypeError(f"cannot write {s}: {what} is not writable")
    return s


def output_dir(s: str) -> str:
    """A folder that exists or could be created (with its parents)."""
    if not s:
        raise argparse.ArgumentTypeError("the folder name is empty")
    if os.path.exists(s) and not os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"cannot write into {s}: it exists and is not a directory")
    base = existing_parent(s)
    if not os.path.isdir(base):
        raise argparse.ArgumentTypeError(f"cannot create {s}: {base} is not a directory")
    if not os.access(base, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {s}: {base} is not writable")
    return s


def existing_dir(s: str) -> str:
    if not os.path.isdir(s):
        what = "does not exist" if not os.path.exists(s) else "is not a directory"
        raise argparse.ArgumentTypeError(
            f"{s} {what}; pass a model directory holding config.json, model.safetensors and tokenizer.json"
        )
    return s


def write_error(flag: str, path: str, e: OSError) -> UsageError:
    """An OSError met while writing ``path`` (given as ``flag``) as a one-line usage error."""
    return UsageError(f"cannot write {flag} {path}: {e.strerror or e}")


WROTE = {lang: text("cli.wrote", lang, kind="{kind}", path="{path}") for lang in LANGUAGES}


class Precision(argparse.Action):
    """Stores --precision and remembers that it was given (--json rounds only then)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.precision_given = True


def shared_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lang", choices=("en", "zh"), default="en", help="language of the explanation (default en)")
    p.add_argument("--precision", type=precision, default=3, action=Precision, help="decimals shown (default 3)")
    p.set_defaults(precision_given=False)

