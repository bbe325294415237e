"""Running many fuzz cases, in worker processes, with a progress line.

The workers live in this module (not in ``__main__``) because multiprocessing's spawn start
method cannot import a package's ``__main__`` in a child.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
import warnings

BATCH = 40  # cases per task sent to a worker


def quiet() -> None:
    # torch warns about causal_lower_right with Nq > Nk (rows that see nothing: the point);
    # Triton 3.6's interpreter trips a NumPy 2 deprecation. Neither is about qkv.
    warnings.filterwarnings("ignore", message="Lower right causal bias")
    warnings.filterwarnings("ignore", message="Conversion of an array with ndim > 0 to a scalar")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken: the slice is skipped
        return False
    return True


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one thread per process: the processes are the parallelism
    quiet()


def _run_batch(args: tuple[int, list[str]]) -> list:
    from .judge import run

    seed, cases = args
    out = []
    for case in cases:
        r = run(seed, case)
        if r.status != "failed":
            r.log = []  # keep what crosses the process boundary small
        out.append(r)
    return out


def run_many(seed: int, cases: list[str], processes: int, progress: bool = True) -> tuple[list, float]:
    batches = [(seed, cases[i : i + BATCH]) for i in range(0, len(cases), BATCH)]
    # the triton batches are slow: start them first so that they do not trail at the end
    batches.sort(key=lambda b: not b[1][0].startswith("t"))
    results: list = []
    t0 = time.perf_counter()
    last, shown = 0.0, -1

    def tick(final: bool = False) -> None:
        nonlocal last, shown
        now = time.perf_counter() - t0
        if not progress or (not final and now - last < 2.0) or (final and shown == len(results) and not sys.stderr.isatty()):
            return
        last, shown = now, len(results)
        failed = sum(r.status == "failed" for r in results)
        refused = sum(r.status == "refused" for r in results)
        rate = len(results) / now if now else 0.0
        eta = (len(cases) - len(results)) / rate if rate else 0.0
        line = f"[fuzz] {len(results)}/{len(cases)} calls  failed {failed}  refused {refused}  {now:.0f} s  eta {eta:.0f} s"
        end = "\n" if final or not sys.stderr.isatty() else ""
        print(("\r" if sys.stderr.isatty() else "") + line, end=end, file=sys.stderr, flush=True)

    if processes <= 1:
        _init_worker()
        for b in batches:
            results += _run_batch(b)
            tick()
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork after torch's thread pools exist
        with ctx.Pool(processes, initializer=_init_worker) as pool:
            for part in pool.imap_unordered(_run_batch, batches):
                results += part
                tick()
    tick(final=True)
    return results, time.perf_counter() - t0


