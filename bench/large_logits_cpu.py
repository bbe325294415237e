"""Float32 forward calls with large logits on a CPU: torch's kernel against qkv's own paths, time
and accuracy in the same run.

    python bench/large_logits_cpu.py [--threads 1] [--rounds 5] [--seeds 8] [--out bench/results/large_logits_cpu.md]

Each cell is one forward call (no gradient) in float32 whose scores have a standard deviation
of about 30 (``scale = 0.05``, ``q, k ~ N(0, 1) · σ`` with ``scale · σ² · √D = 30``): torch's
``scaled_dot_product_attention``, qkv's ``chunked`` (its C tile loops), ``math`` and ``auto``.
Time: best of interleaved rounds. Accuracy: over ``--seeds`` draws, the worst ratio of each
path's largest error against the float64 oracle (on the same rounded inputs) to the strict rule
``2 · err(math) + 1e-6 · max|ref|`` (docs/guarantees.md, without the logit term).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F

import qkv
from qkv.reference import attention_ref

from common import report_header, time_cell, write_report  # noqa: E402  (the helpers beside this script)

# (label, hq, hk, nq, nk, d, dv). With Dv ≠ D torch's CPU kernel falls back to its math
# formulation (it scales q and k by √scale, each rounded); Dv = D is the control.
SHAPES = (
    ("Dv = D", 8, 8, 1024, 1024, 64, 64),
    ("Dv ≠ D", 8, 8, 64, 64, 64, 32),
    ("Dv ≠ D", 8, 8, 128, 128, 64, 32),
    ("Dv ≠ D", 8, 8, 256, 256, 64, 32),
    ("Dv ≠ D", 8, 8, 512, 512, 64, 32),
    ("Dv ≠ D", 8, 8, 1024, 1024, 64, 32),
    ("Dv ≠ D", 8, 8, 2048, 2048, 64, 32),
    ("GQA 6/2, Dv 3", 6, 2, 47, 31, 64, 3),
    ("GQA 8/2, Dv ≠ D", 8, 2, 1024, 1024, 128, 64),
)
SCALE = 0.05
LOGIT_STD = 30.0
PATHS = ("torch", "chunked", "math", "auto")


def _inputs(hq: int, hk: int, nq: int, nk: int, d: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    sigma = math.sqrt(LOGIT_STD / (SCALE * math.sqrt(d)))
    q = torch.randn(1, hq, nq, d, generator=g) * sigma
    k = torch.randn(1, hk, nk, d, generator=g) * sigma
    v = torch.randn(1, hk, nk, dv, generator=g)
    return q, k, v


def _fns(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    gqa = q.shape[1] != k.shape[1]
    return {
        "torch": lambda: F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=gqa),
        **{p: (lambda p=p: qkv.attention(q, k, v, scale=SCALE, enable_gqa=gqa, backend=p)) for p in PATHS[1:]},
    }


def cell(shape: tuple, rounds: int, seeds: int) -> dict:
    _, hq, hk, nq, nk, d, dv = shape
    worst = dict.fromkeys(PATHS, 0.0)
    for seed in range(seeds if nq * nk <= 1 << 20 else 2):
        q, k, v = _inputs(hq, hk, nq, nk, d, dv, seed)
        ref = np.asarray(attention_ref(q.double(), k.double(), v.double(), scale=SCALE, enable_gqa=hq != hk))
        with torch.no_grad():
            errs = {p: float(np.abs(fn().double().numpy() - ref).max()) for p, fn in _fns(q, k, v).items()}
        limit = 2 * errs["math"] + 1e-6 * float(np.abs(ref).max())
        for p in PATHS:
            worst[p] = max(worst[p], errs[p] / limit)
    q, k, v = _inputs(hq, hk, nq, nk, d, dv, 0)
    with torch.no_grad():
        fns = _fns(q, k, v)
        for fn in fns.values():
            fn()
        times = time_cell(fns, rounds)
    return {"times": times, "worst": worst}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--out", default="bench/results/large_logits_cpu.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        *report_header("Float32 forward calls with large logits on the CPU: torch's kernel against qkv's paths", args.threads),
        f"One forward call, float32, no gradient, B = 1, scale {SCALE}, scores of standard deviation ~{LOGIT_STD:g}; best of "
        f"{args.rounds} interleaved rounds. `÷ rule`: the worst over {args.seeds} draws (2 above 1M scores) of the "
        "largest error against the float64 oracle divided by `2 · err(math) + 1e-6 · max|ref|`.",
        "",
        "| shape | Nq × Nk | D / Dv | torch ms | chunked ms | math ms | auto ms | chunked ÷ torch | "
        "torch ÷ rule | chunked ÷ rule | auto ÷ rule |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in SHAPES:
        r = cell(shape, args.rounds, args.seeds)
        t, w = r["times"], r["worst"]
        label, _, _, nq, nk, d, dv = shape
        lines.append(
            f"| {label} | {nq} × {nk} | {d} / {dv} | {t['torch'] * 1e3:.3f} | {t['chunked'] * 1e3:.3f} | "
            f"{t['math'] * 1e3:.3f} | {t['auto'] * 1e3:.3f} | {t['chunked'] / t['torch']:.2f} | {w['torch']:.2f} | "
            f"{w['chunked']:.2f} | {w['auto']:.2f} |"
        )
        print(lines[-1], flush=True)
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
