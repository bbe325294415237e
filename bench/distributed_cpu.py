"""Ring attention on CPU: per-rank peak memory and time against sequence length and world size.

Spawns W gloo ranks on loopback (W in 1, 2, 4), each with one thread, runs causal ring
attention (zigzag layout, ``chunked`` local blocks, float32, forward and backward) and reports
per rank the peak resident memory above the rank's baseline after import and warm-up (VmHWM
minus baseline VmRSS, peak reset through /proc/self/clear_refs; inputs included) and the wall time.
Then, for a fixed per-rank memory budget, the longest sequence that fit at each world size.

    python bench/distributed_cpu.py [--out bench/results/distributed_cpu.md] [--budget-mb 128]

On a machine with fewer cores than ranks the ranks share cores, so times above W = cores
measure oversubscription, not scaling; the memory column is what this benchmark is about.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from tests.distributed import ok_values, spawn

B, H, D = 1, 4, 64


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _worker(rank, world, lengths):
    from qkv.distributed import ring_attention

    rows = []
    x = torch.randn(B, H, 16, D, requires_grad=True)
    ring_attention(x, x, x, is_causal=True, layout="zigzag", backend="chunked").sum().backward()  # warm-up
    base = _status_kb("VmRSS")  # lengths run in increasing order, so each peak is that length's own
    for n in sorted(lengths):
        g = torch.Generator().manual_seed(n)
        nl = n // world
        if world > 1:
            torch.distributed.barrier()
        _reset_peak()
        q, k, v = (torch.randn(B, H, nl, D, generator=g).requires_grad_() for _ in range(3))
        do = torch.randn(B, H, nl, D, generator=g)
        t0 = time.perf_counter()
        out = ring_attention(q, k, v, is_causal=True, layout="zigzag", backend="chunked")
        t1 = time.perf_counter()
        fwd_peak = (_status_kb("VmHWM") - base) / 1024
        out.backward(do)
        t2 = time.perf_counter()
        rows.append((n, (_status_kb("VmHWM") - base) / 1024, t1 - t0, t2 - t1, fwd_peak))
        del out, q, k, v, do
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-mb", type=float, default=128.0)
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--worlds", default="1,2,4")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    worlds = [int(x) for x in args.worlds.split(",")]
    table = []
    for w in worlds:
        t0 = time.monotonic()
        per_rank = ok_values(spawn(_worker, w, lengths, timeout=900, pg_timeout_s=600))
        for i, n in enumerate(lengths):
            mem = max(r[i][1] for r in per_rank)
            fwd = max(r[i][2] for r in per_rank)
            bwd = max(r[i][3] for r in per_rank)
            fmem = max(r[i][4] for r in per_rank)
            table.append((w, n, mem, fwd, bwd, fmem))
            print(f"W={w} N={n:6d}: peak fwd +{fmem:7.1f} fwd+bwd +{mem:7.1f} MiB/rank  fwd {fwd:6.2f}s  bwd {bwd:6.2f}s", flush=True)
        print(f"  (W={w} took {time.monotonic() - t0:.0f}s)", flush=True)

    lines = [
        "# Ring attention on CPU: per-rank memory and time",
        "",
        (
            f"- Date: {datetime.date.today()}; host: {platform.machine()}, {os.cpu_count()} CPU cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}"
        ),
        (
            f"- Causal ring attention, zigzag layout, `chunked` local blocks, float32, B={B}, H={H}, D={D}; "
            "gloo on loopback, one thread per rank; forward then backward."
        ),
        (
            "- Memory: peak RSS on the worst rank above its RSS after import and a tiny warm-up "
            "(VmHWM − baseline VmRSS; peak reset via /proc/self/clear_refs), inputs, outputs and gradients included."
        ),
        f"- Ranks share {os.cpu_count()} cores: times at W > cores measure oversubscription, not scaling.",
        "- W=1 is plain `qkv.attention` (the ring is skipped without a process group); W>1 is the ring.",
        "",
        "| W | N | N/W | peak MiB/rank, forward | peak MiB/rank, forward+backward | forward s | backward s |",
        "|---|---|---|---|---|---|---|",
    ]
    for w, n, mem, fwd, bwd, fmem in table:
        lines.append(f"| {w} | {n} | {n // w} | {fmem:.1f} | {mem:.1f} | {fwd:.2f} | {bwd:.2f} |")
    lines += ["", f"Longest N (of those measured) whose forward+backward fits {args.budget_mb:.0f} MiB per rank:", ""]
    for w in worlds:
        fits = [n for ww, n, mem, *_ in table if ww == w and mem <= args.budget_mb]
        lines.append(f"- W={w}: {max(fits) if fits else 'none'}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
