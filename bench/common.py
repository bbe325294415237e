"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Optional


def proc_status_kib(field: str) -> int:
    """A memory field of /proc/self/status in KiB: ``VmRSS`` (now) or ``VmHWM`` (peak so far)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, for report headers."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report_header(title: str, threads: int) -> list[str]:
    """The first lines of a markdown report: its title, and where and when it was measured."""
    import torch  # (here: the other helpers serve scripts that import it late)

    return [
        f"# {title}",
        "",
        f"{datetime.date.today()} · {cpu_name()} · torch {torch.__version__} · {threads} thread(s) · "
        f"load average {os.getloadavg()[0]:.2f} at the start",
        "",
    ]


def before_after_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a benchmark run once per tree and reported side by side: ``--threads``,
    ``--json`` (where to write this tree's run) and ``--report PATH label=path.json ...``."""
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the run here")
    p.add_argument("--report", help="write a markdown table of the runs given (label=path.json) here")
    p.add_argument("runs", nargs="*", help="label=path.json, with --report")


def labelled_runs(specs: list[str]) -> tuple[list[dict], list[str]]:
    """``label=path.json`` arguments, as a before/after report takes them: (the runs, their labels)."""
    pairs = [s.split("=", 1) for s in specs]
    return [json.loads(Path(path).read_text()) for _, path in pairs], [label for label, _ in pairs]


def write_report(lines: list[str], out: str) -> None:
    """End a markdown report with the load average it finished under, and write it to ``out``."""
    lines.append(f"\nLoad average at the end: {os.getloadavg()[0]:.2f}.")
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` (already warmed up), in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_peak(threads: int, n: int = 2048, dtype: "object" = None) -> float:
    """FLOP/s of an n × n × n matmul on ``threads`` threads (float32 unless ``dtype``), best of 3:
    the arithmetic ceiling the attention cells are compared with."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=dtype or torch.float32)
    b = torch.randn(n, n, dtype=dtype or torch.float32)
    a @ b
    return 2 * n**3 / best_time(lambda: a @ b, 3)


def time_cell(fns: dict[str, Callable[[], object]], rounds: int, warm: Optional[dict[str, float]] = None) -> dict[str, float]:
    """Best of ``rounds`` interleaved timings per contender (each already called once).

    ``warm`` holds warm-up times that count as a first round: a call that takes seconds has
    nothing left to warm up, and at N = 16384 a bfloat16 backward takes minutes on some CPUs."""
    warm = warm or {}
    best = {name: warm.get(name, float("inf")) for name in fns}
    names = list(fns)
    for r in range(rounds):
        # Each round starts one contender later, so that no contender always runs right after
        # the same other one (whose caches, threads and allocations it would inherit).
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if r == 0 and name in warm:
                continue
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best
