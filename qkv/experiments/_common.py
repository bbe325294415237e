"""Shared pieces of the experiments: the result record, seeding, a progress bar, figures, CSV."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np

from ..extras import require
from ..locale import text
from .judge import FAILED, HELD, NOT_SHOWN

DPI = 90  # modest, so the committed report stays small


@dataclass
class Result:
    """What one experiment found: the claim, how it was tested, the numbers, and the verdict.

    ``held`` is computed from ``metrics`` by the experiment, never written by hand: False only when
    a measurement contradicts the claim beyond its noise (:mod:`qkv.experiments.judge`). Two lists
    name the parts of the claim that were not shown, each with what it would need: ``not_shown``,
    the parts a ``--quick`` run is too small to test, and ``within_noise``, the timed parts whose
    effect was not larger than this machine's noise (with the numbers). Then ``held`` covers only
    the parts that were shown. ``figures`` and ``csv`` are paths relative to the output folder.
    """

    name: str
    title: str
    claim: str
    setup: str
    result: str
    held: bool
    metrics: Dict[str, Any] = field(default_factory=dict)
    figures: List[str] = field(default_factory=list)
    csv: str = ""
    seconds: float = 0.0
    quick: bool = False
    not_shown: List[str] = field(default_factory=list)
    within_noise: List[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        """``held``, ``not shown`` or ``did not hold`` (:data:`qkv.experiments.judge.STATES`)."""
        if not self.held:
            return FAILED
        return NOT_SHOWN if self.not_shown or self.within_noise else HELD

    def verdict_in(self, lang: str) -> str:
        """The verdict in words: held; DID NOT HOLD; or what was not shown and why, e.g.
        ``not shown in quick mode (needs …; run without --quick)``, ``not shown on this machine (…)``.

        A part that was tested and failed outranks the parts that were not shown."""
        if not self.held:
            return text("experiments.verdict.failed", lang)
        parts = []
        if self.within_noise:
            parts.append(text("experiments.verdict.machine", lang, what=text("experiments.verdict.sep", lang).join(self.within_noise)))
        if self.not_shown:
            parts.append(text("experiments.verdict.quick", lang, needs=text("experiments.verdict.sep", lang).join(self.not_shown)))
        return text("experiments.verdict.sep", lang).join(parts) if parts else text("experiments.verdict.held", lang)

    @property
    def verdict(self) -> str:
        """:meth:`verdict_in` English."""
        return self.verdict_in("en")

    def to_dict(self) -> Dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["state"], d["verdict"] = self.state, self.verdict  # for readers of the JSON; derived, so load() drops them
        return d

    def save(self, out: Path) -> Path:
        """Write ``<out>/<name>.json`` (the run time is left out, so re-runs give the same file)."""
        d = self.to_dict()
        d.pop("seconds")
        path = Path(out) / f"{self.name}.json"
        path.write_text(json.dumps(d, indent=1, ensure_ascii=False, default=_plain) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: Path) -> "Result":
        d = json.loads(Path(path).read_text(encoding="utf-8"))
        d.pop("verdict", None)
        d.pop("state", None)
        return cls(**d)


def _plain(x: Any) -> Any:
    if isinstance(x, (np.generic,)):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def seed_all(seed: int) -> None:
    """Fix every random source the experiments use and ask torch for deterministic kernels."""
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


class Progress:
    """A progress bar on stderr (tqdm): redrawn in a terminal, its last state only in a log file,
    nothing when QKV_NO_PROGRESS is set."""

    def __init__(self, total: int, label: str) -> None:
        tqdm = require("tqdm", "qkv experiments", "experiments").tqdm

        tty = sys.stderr.isatty()
        self._bar = tqdm(total=max(1, total), desc=f"{label:>16}", file=sys.stderr, leave=True, dynamic_ncols=tty, ascii=not tty,
                         disable=bool(os.environ.get("QKV_NO_PROGRESS")),
                         mininterval=0.1 if tty else float("inf"))  # a log file: no redraws, the final state on close

    def step(self, info: str = "") -> None:
        self._bar.set_postfix_str(info, refresh=False)
        self._bar.update(1)
        if self._bar.n >= self._bar.total:
            self._bar.close()


def write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in rows:
            w.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in r])


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata={"Software": None})  # no version tag: same bytes across matplotlib versions
    plt.close(fig)


def label_lengths(axes: Any, ns: Sequence[int]) -> None:
    """Tick each log-scaled x axis at the measured lengths ``ns`` (no minor ticks) and draw its legend."""
    for a in axes:
        a.set_xticks(ns, [str(n) for n in ns])
        a.minorticks_off()
        a.legend()


def pyplot() -> Any:
    require("matplotlib", "qkv experiments", "experiments").use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fit_exponent(x: Sequence[float], y: Sequence[float]) -> float:
    """Slope of log y against log x: y ∝ x^slope."""
    lx = np.log(np.asarray(x, dtype=float))
    ly = np.log(np.asarray(y, dtype=float))
    return float(np.polyfit(lx, ly, 1)[0])


def fmt(x: float, digits: int = 3) -> str:
    if x == 0 or not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


class single_thread:
    """Run torch on one intra-op thread, restoring the previous count afterwards.

    The experiments' tensors are small; on a shared machine, extra threads mostly wait for each
    other (a tiny training step was measured 30× slower with two threads under load than with one).
    """

    def __enter__(self) -> "single_thread":
        import torch

        self.before = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.set_num_threads(self.before)


def largest_tensor_bytes(fn: Any) -> int:
    """Bytes of the largest tensor any torch operation makes while ``fn()`` runs (the peak a path must hold)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            result = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel() * t.element_size())
            return result

    with Largest() as mode:
        fn()
    return mode.largest


def sequential_steps(fn: Any) -> int:
    """The longest chain of dependent torch operations ``fn()`` runs: its critical path, in operator
    calls, which no amount of parallel hardware can overlap. Exact: counted, not timed, so the same
    on a quiet and a busy machine.

    Each operation's output is one step deeper than its deepest tensor input (inputs made outside
    ``fn``, such as weights, are at depth 0). An operation that runs a whole loop inside one call
    (a fused RNN kernel) counts as one step, so a recurrence is counted as written: one cell call
    per position.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakTensorKeyDictionary

    class Depth(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.depth = WeakTensorKeyDictionary()
            self.longest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            kwargs = kwargs or {}
            inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            step = 1 + max((self.depth.get(t, 0) for t in inputs), default=0)
            result = func(*args, **kwargs)
            for t in torch.utils._pytree.tree_leaves(result):
                if isinstance(t, torch.Tensor):  # an in-place result is one of the inputs: now deeper
                    self.depth[t] = max(step, self.depth.get(t, 0))
            self.longest = max(self.longest, step)
            return result

    with Depth() as mode:
        fn()
    return mode.longest


def flop_count(fn: Any) -> int:
    """Floating-point operations of the matrix products ``fn()`` issues through torch (2 per
    multiply-add), counted by torch's ``FlopCounterMode``: exact, and blind to work done inside a
    native kernel it does not know (qkv's C kernels), so count the path that runs in torch ops."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())
