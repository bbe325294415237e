"""The lse of 16-bit inputs on a CPU: torch's fused kernel against qkv's tile loops (what ``auto``
runs for it), time and accuracy in the same run.

    python bench/lse_cpu.py [--threads 1] [--rounds 5] [--out bench/results/lse_cpu.md]

Each cell is one call with ``return_lse=True`` and no gradient, B = 1, H = 8, D = 64, Nq = Nk =
N: torch's kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, which qkv's ``sdpa``
backend calls for an lse) and ``qkv.attention(..., backend="auto")``, best of interleaved
rounds; the lse error is the largest against the float64 oracle on the same rounded inputs.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import qkv
from qkv.reference import attention_ref

from common import report_header, time_cell, write_report  # noqa: E402  (the helpers beside this script)

SIZES = (512, 1024, 2048)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def cell(dtype: torch.dtype, n: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g).to(dtype) for _ in range(3))
    fns = {
        "torch": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)[:2],
        "qkv auto": lambda: qkv.attention(q, k, v, return_lse=True),
    }
    _, ref = attention_ref(q.double(), k.double(), v.double(), return_lse=True)
    errors = {name: float(np.abs(fn()[1].double().numpy() - np.asarray(ref)).max()) for name, fn in fns.items()}
    return {"times": time_cell(fns, rounds), "errors": errors}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench/results/lse_cpu.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        *report_header("The lse of 16-bit inputs on the CPU: torch's fused kernel against qkv auto", args.threads),
        "One call with `return_lse=True`, no gradient, B = 1, H = 8, D = 64, Nq = Nk = N; best of "
        f"{args.rounds} interleaved rounds. `lse err`: largest error against the float64 oracle on the rounded inputs.",
        "",
        "| dtype | N | torch ms | qkv auto ms | auto ÷ torch | torch lse err | qkv auto lse err |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype in DTYPES:
        for n in SIZES:
            r = cell(dtype, n, args.rounds)
            t, e = r["times"], r["errors"]
            lines.append(
                f"| {str(dtype)[6:]} | {n} | {t['torch'] * 1e3:.1f} | {t['qkv auto'] * 1e3:.1f} | "
                f"{t['qkv auto'] / t['torch']:.2f} | {e['torch']:.1e} | {e['qkv auto']:.1e} |"
            )
            print(lines[-1], flush=True)
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
