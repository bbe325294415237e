"""A Python score function on the CPU without gradients: compiled FlexAttention against qkv's
tile loops, the time ``auto``'s row for it is set by (qkv/backends/dispatch.py).

    python bench/flex_cpu.py [--threads 1] [--rounds 7] [--out bench/results/flex_cpu.md]

Each cell: float32, B = 1, 8 heads, D = 64, causal, ``score_mod = s + 0.01·(i − j)``, no
gradient. ``flex``: qkv's flex engine (compiled FlexAttention; its first call, compilation
included, is reported apart); ``chunked``: the tile loops calling the function tile by tile;
``auto``: what ``qkv.attention`` picks; ``sdpa+mask``: torch SDPA with the bias as a dense
float mask built outside the timing. Best of interleaved rounds; largest |Δ| against the float64
oracle for each path. Torch keeps compiled kernels on disk (``TORCHINDUCTOR_CACHE_DIR``), so a
second run finds them and its first calls are short; run with an empty cache directory to time
compilation from scratch.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import qkv
from qkv.backends import select
from qkv.call import validate

from common import report_header, time_cell, write_report  # noqa: E402  (the helpers beside this script)

SIZES = (128, 256, 512, 1024, 2048)


def score(s, b, h, i, j):  # the benchmark's Python score function (one code object: compiled once)
    return s + 0.01 * (i - j)


def cell(n: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    bias = (0.01 * (i - j)).float().masked_fill(j > i, float("-inf"))
    fns = {
        "flex": lambda: qkv.attention(q, k, v, is_causal=True, score_mod=score, backend="flex"),
        "chunked": lambda: qkv.attention(q, k, v, is_causal=True, score_mod=score, backend="chunked"),
        "auto": lambda: qkv.attention(q, k, v, is_causal=True, score_mod=score),
        "sdpa+mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
    }
    with torch.no_grad():
        t0 = time.perf_counter()
        fns["flex"]()
        first = time.perf_counter() - t0
        ref = qkv.attention(q.double(), k.double(), v.double(), is_causal=True, score_mod=score, backend="chunked")
        errs = {name: float((fn().double() - ref).abs().max()) for name, fn in fns.items()}
        times = time_cell(fns, rounds)
    picked = select(validate(q, k, v, is_causal=True, score_mod=score)).NAME
    return {"times": times, "errs": errs, "first": first, "auto": picked}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="bench/results/flex_cpu.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        *report_header("A Python score function on the CPU: compiled FlexAttention against qkv's tile loops", args.threads),
        f"float32, B = 1, 8 heads, D = 64, causal, `s + 0.01·(i − j)`, no gradient; best of {args.rounds} interleaved "
        "rounds. `first flex call`: the engine's first call at this shape, compilation included. `max |Δ|`: against "
        "the float64 oracle.",
        "",
        "| N | flex ms | chunked ms | sdpa+mask ms | auto ms | chunked ÷ flex | auto runs | first flex call s | "
        "max \\|Δ\\| flex | max \\|Δ\\| chunked |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for n in SIZES:
        r = cell(n, args.rounds)
        t, e = r["times"], r["errs"]
        lines.append(
            f"| {n} | {t['flex'] * 1e3:.2f} | {t['chunked'] * 1e3:.2f} | {t['sdpa+mask'] * 1e3:.2f} | {t['auto'] * 1e3:.2f} | "
            f"{t['chunked'] / t['flex']:.2f} | {r['auto']} | {r['first']:.1f} | {e['flex']:.1e} | {e['chunked']:.1e} |"
        )
        print(lines[-1], flush=True)
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
