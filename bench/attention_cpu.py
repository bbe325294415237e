"""CPU benchmark: time and peak memory against sequence length for every qkv backend,
with torch's own ``scaled_dot_product_attention`` measured in the same run as the peer.

    python bench/attention_cpu.py                 # full grid, writes bench/results/attention_cpu.md
    python bench/attention_cpu.py --quick         # a smaller grid for a smoke run

Time: median of repeated runs (each run long enough to swamp timer noise), qkv and the peer
interleaved so drift on a shared machine hits both. Memory: every configuration runs in a
fresh subprocess that reports its peak resident memory above what the inputs already hold
(Linux VmHWM − VmRSS), so allocator caches of earlier runs cannot hide anything.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import cpu_name, proc_status_kib  # noqa: E402
import qkv  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _median_time(fn: Callable[[], object], min_run_s: float = 0.05, repeats: int = 7) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(min_run_s / one))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def time_pair(fa: Callable[[], object], fb: Callable[[], object], rounds: int = 3, **kw) -> tuple[float, float]:
    """Interleave two timings; report each one's best median over ``rounds`` rounds."""
    a, b = [], []
    for _ in range(rounds):
        a.append(_median_time(fa, **kw))
        b.append(_median_time(fb, **kw))
    return min(a), min(b)


def inputs(b: int, h: int, n: int, d: int, grad: bool = False):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(b, h, n, d, generator=g).requires_grad_(grad) for _ in range(3)]


# ---- time ---------------------------------------------------------------------------------


def time_grid(ns: list[int], b: int, h: int, d: int, math_max: int) -> list[dict]:
    rows = []
    for causal in (False, True):
        for n in ns:
            q, k, v = inputs(b, h, n, d)
            peer = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            row = {"n": n, "causal": causal}
            for name in ("auto", "chunked", "math"):
                if name == "math" and n > math_max:
                    continue
                fn = lambda name=name: qkv.attention(q, k, v, is_causal=causal, backend=name)  # noqa: E731
                small = n <= 1024  # microseconds: more, longer rounds against timer and neighbour noise
                t_qkv, t_peer = time_pair(fn, peer, rounds=5 if small else 3, min_run_s=0.05 if small else 0.0)
                row[name], row[f"{name}_peer"], row[f"{name}_ratio"] = t_qkv, t_peer, t_qkv / t_peer
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def time_extras(n: int, b: int, h: int, d: int) -> list[dict]:
    """Calls with masks and grouped heads (SDPA's same call as the peer), features SDPA lacks
    (the peer is SDPA's plain causal call), and forward+backward."""
    rows = []
    q, k, v = inputs(b, h, n, d)
    kv1 = [t[:, :1].contiguous() for t in (k, v)]  # one key/value head: multi-query attention
    mask = torch.rand(n, n, generator=torch.Generator().manual_seed(0)) > 0.2
    sdpa = F.scaled_dot_product_attention
    causal_peer = ("SDPA causal", lambda: sdpa(q, k, v, is_causal=True))
    cases = [
        ("bool attn_mask", (q, k, v), {"attn_mask": mask}, ("SDPA same call", lambda: sdpa(q, k, v, attn_mask=mask))),
        ("multi-query (1 kv head)", (q, *kv1), {"enable_gqa": True, "is_causal": True},
         ("SDPA same call", lambda: sdpa(q, *kv1, is_causal=True, enable_gqa=True))),
        ("window (256, 0)", (q, k, v), {"window": (256, 0)}, causal_peer),
        ("causal bottom_right", (q, k, v), {"is_causal": "bottom_right"}, causal_peer),
        ("causal + return_lse", (q, k, v), {"is_causal": True, "return_lse": True}, causal_peer),
    ]  # fmt: skip
    for label, args, kw, (peer_name, peer) in cases:
        for backend in ("auto", "chunked"):
            t, tp = time_pair(lambda: qkv.attention(*args, backend=backend, **kw), peer, rounds=2, min_run_s=0.0)
            rows.append({"case": label, "backend": backend, "n": n, "time": t, "peer": peer_name, "peer_time": tp})
            print(json.dumps(rows[-1]), flush=True)
    qg, kg, vg = inputs(b, h, n, d, grad=True)
    do = torch.randn(b, h, n, d)

    def fwd_bwd(fn):
        def run():
            qg.grad = kg.grad = vg.grad = None
            fn().backward(do)

        return run

    peer = fwd_bwd(lambda: sdpa(qg, kg, vg, is_causal=True))
    for backend in ("chunked", "math"):
        t, tp = time_pair(fwd_bwd(lambda: qkv.attention(qg, kg, vg, is_causal=True, backend=backend)), peer, rounds=2, min_run_s=0.0)
        rows.append({"case": "causal forward+backward", "backend": backend, "n": n, "time": t, "peer": "SDPA forward+backward", "peer_time": tp})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- memory -------------------------------------------------------------------------------


def measure_memory_child(backend: str, n: int, d: int, causal: bool) -> None:
    torch.set_num_threads(2)
    q, k, v = inputs(1, 1, n, d)
    warm = inputs(1, 1, 8, d)  # import lazily loaded modules and probes before measuring
    if backend == "torch-sdpa":
        F.scaled_dot_product_attention(*warm)
    else:
        qkv.attention(*warm, backend=backend)
    before = proc_status_kib("VmRSS")
    if backend == "torch-sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        out = qkv.attention(q, k, v, is_causal=causal, backend=backend)
    peak = proc_status_kib("VmHWM")
    print(json.dumps({"extra_bytes": (peak - before) * 1024, "out_sum": float(out.sum())}))


def memory_grid(ns: list[int], d: int, math_max: int) -> list[dict]:
    rows = []
    for n in ns:
        row: dict = {"n": n, "scores_bytes": n * n * 4}
        for backend in ("torch-sdpa", "sdpa", "chunked", "math"):
            if backend == "math" and n > math_max:
                continue
            res = subprocess.run(
                [sys.executable, __file__, "--memory-child", backend, str(n), str(d)],
                capture_output=True,
                text=True,
                check=True,
            )
            row[backend] = json.loads(res.stdout.strip().splitlines()[-1])["extra_bytes"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---- report -------------------------------------------------------------------------------


def _ms(t: float) -> str:
    return f"{t * 1e3:.3f}" if t < 0.01 else f"{t * 1e3:.1f}"


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def write_report(meta: dict, times: list[dict], extras: list[dict], mem: list[dict], path: Path) -> None:
    lines = [
        "# qkv CPU benchmark",
        "",
        f"{meta['date']} · {meta['cpu']} · {meta['threads']} threads · torch {meta['torch']} · Python {meta['python']}",
        "",
        f"Forward time, float32, batch {meta['b']} × {meta['h']} heads, head dim {meta['d']}. "
        "`×` = time relative to `torch.nn.functional.scaled_dot_product_attention` measured in the same run.",
        "",
        "Each backend is timed in alternation with its own SDPA measurement; the SDPA column is the one paired with `auto`.",
        "",
        "| N | causal | torch SDPA ms | qkv auto ms | auto × | chunked ms | chunked × | math ms | math × |",
        "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in times:
        math_cells = f"{_ms(r['math'])} | {r['math_ratio']:.2f}" if "math" in r else "— | —"
        lines.append(
            f"| {r['n']} | {'yes' if r['causal'] else 'no'} | {_ms(r['auto_peer'])} | {_ms(r['auto'])} | {r['auto_ratio']:.2f} | "
            f"{_ms(r['chunked'])} | {r['chunked_ratio']:.2f} | {math_cells} |"
        )
    lines += [
        "",
        f"More calls at N = {extras[0]['n'] if extras else '?'} (same batch, heads and head dim). For features SDPA lacks "
        "the peer is SDPA's plain causal call, the closest thing it can do.",
        "",
        "| case | backend | ms | peer | peer ms | × peer |",
        "|---|---|---:|---|---:|---:|",
    ]
    for r in extras:
        lines.append(
            f"| {r['case']} | {r['backend']} | {_ms(r['time'])} | {r['peer']} | {_ms(r['peer_time'])} | {r['time'] / r['peer_time']:.2f} |"
        )
    lines += [
        "",
        f"Peak extra memory of one forward call (batch 1, 1 head, head dim {meta['d']}, float32), MiB above the inputs, "
        "each in a fresh process. `% of N²` compares with the N×N float32 score matrix.",
        "",
        "| N | N×N scores MiB | torch SDPA | qkv sdpa | chunked | chunked % of N² | math |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in mem:
        math_cell = _mib(r["math"]) if "math" in r else "—"
        lines.append(
            f"| {r['n']} | {_mib(r['scores_bytes'])} | {_mib(r['torch-sdpa'])} | {_mib(r['sdpa'])} | {_mib(r['chunked'])} | "
            f"{100 * r['chunked'] / r['scores_bytes']:.2f}% | {math_cell} |"
        )
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "time": times, "extras": extras, "memory": mem}, indent=1))
    print(f"wrote {path}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-child":
        backend, n, d = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        measure_memory_child(backend, n, d, causal=False)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "attention_cpu.md")
    args = ap.parse_args()
    b, h, d = 1, 4, 64
    if args.quick:
        ns, mem_ns, extra_n = [16, 256, 2048], [2048, 4096], 1024
    else:
        ns, mem_ns, extra_n = [16, 64, 256, 1024, 2048, 4096, 8192], [1024, 4096, 16384], 4096
    meta = {
        "date": dt.date.today().isoformat(),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "b": b,
        "h": h,
        "d": d,
    }
    times = time_grid(ns, b, h, d, math_max=4096)
    extras = time_extras(extra_n, b, h, d)
    mem = memory_grid(mem_ns, d, math_max=16384)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_report(meta, times, extras, mem, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    main()
