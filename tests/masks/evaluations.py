"""Counting how often a Python mask function runs, and on how many pairs, without touching it
(a counter in its closure would change its key): a profile hook that sees each call of the
function's code and reads the shapes of the index tensors it was handed."""

from __future__ import annotations

import math
import sys
import threading
from typing import Any, Callable

import torch


class Evaluations:
    """``with Evaluations(fn) as ev: ...`` → ``ev.calls`` (Python calls of ``fn``'s code) and
    ``ev.pairs`` (the (query, key) pairs they were asked about: the broadcast size of ``q_idx``
    and ``kv_idx``, a 0-d pair under vmap counting one). Calls made in other threads count too."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.code = fn.__code__
        self.calls = 0
        self.pairs = 0

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is self.code:
            self.calls += 1
            names = self.code.co_varnames[: self.code.co_argcount]
            i, j = frame.f_locals[names[2]], frame.f_locals[names[3]]
            shapes = [t.shape if isinstance(t, torch.Tensor) else () for t in (i, j)]
            self.pairs += math.prod(torch.broadcast_shapes(*shapes))

    def __enter__(self) -> "Evaluations":
        self._before = sys.getprofile()
        sys.setprofile(self._hook)
        threading.setprofile(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self._before)
        threading.setprofile(None)
