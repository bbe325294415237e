"""Decoding on the CPU: a few query rows against a long key/value cache, against SDPA and
against the machine's own copy bandwidth, in one run.

Each cell times ``qkv.attention`` (auto) and ``torch.nn.functional.scaled_dot_product_attention``
on the same tensors, interleaved round by round (best of the rounds), and reports qkv's
bandwidth: the bytes of K and V (each distinct row once) over its time, as a share of a large
``Tensor.copy_`` measured in the same run with the same threads (bytes copied over time).
Where the query rows of a key/value group times their head dims ask for more arithmetic per
byte than the machine's balance (``R·2·(D + Dv)`` flop per key row against GEMM peak ÷ copy
bandwidth), the cell is compute-bound and its GFLOP/s is reported against the GEMM peak too.

    python bench/decode_cpu.py                 # the whole matrix → bench/results/decode_cpu.{md,json}
    python bench/decode_cpu.py --quick         # a few cells, for a look

Cells (B = 1 unless padded): Nq 1, 4, 8 (speculative decoding); Nk 4096, 32768, 131072; MHA
(8 heads), GQA 4:1 (32 on 8) and 8:1 (32 on 4); head dim 64 and 128; float32 and bfloat16
caches; with and without ``return_lse``; a ragged batch of 2 (key padding); 1 and 2 threads.
Nq > 1 is bottom-right causal (the new tokens see the cache and each other in order).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import best_time, cpu_name, gemm_peak, time_cell  # noqa: E402

import qkv  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Cell:
    nq: int
    nk: int
    hq: int
    hk: int
    d: int
    dtype: str
    threads: int
    lse: bool = False
    padded: bool = False

    def label(self) -> str:
        heads = f"MHA {self.hq}" if self.hq == self.hk else f"GQA {self.hq}/{self.hk}"
        extra = (", lse" if self.lse else "") + (", ragged B=2" if self.padded else "")
        return f"Nq={self.nq} Nk={self.nk} {heads} D={self.d} {self.dtype} {self.threads}T{extra}"


def matrix(quick: bool) -> list[Cell]:
    if quick:
        return [Cell(1, 32768, 32, 8, 128, dt, t) for dt in ("float32", "bfloat16") for t in (1, 2)]
    cells = []
    for nk in (4096, 32768, 131072):  # the base: one token, the three head layouts, both cache types
        for hq, hk in ((8, 8), (32, 8), (32, 4)):
            for dt in ("float32", "bfloat16"):
                for t in (1, 2):
                    cells.append(Cell(1, nk, hq, hk, 128, dt, t))
    for nq in (4, 8):  # speculative decoding
        for hq, hk in ((8, 8), (32, 8), (32, 4)):
            for dt in ("float32", "bfloat16"):
                for t in (1, 2):
                    cells.append(Cell(nq, 32768, hq, hk, 128, dt, t))
    for hq, hk in ((8, 8), (32, 8)):  # head dim 64
        for dt in ("float32", "bfloat16"):
            cells.append(Cell(1, 32768, hq, hk, 64, dt, 1))
    for dt in ("float32", "bfloat16"):  # the log-sum-exp, and a ragged batch
        for t in (1, 2):
            cells.append(Cell(1, 32768, 32, 8, 128, dt, t, lse=True))
            cells.append(Cell(1, 32768, 32, 8, 128, dt, t, padded=True))
    return cells


def copy_bandwidth(threads: int, mib: int = 512) -> float:
    """Bytes per second of a large ``dst.copy_(src)`` (bytes copied over time), best of 5."""
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return src.numel() * 4 / best_time(lambda: dst.copy_(src), 5)


def run_cell(c: Cell, rounds: int) -> dict:
    torch.set_num_threads(c.threads)
    dtype = getattr(torch, c.dtype)
    b = 2 if c.padded else 1
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, c.hq, c.nq, c.d, generator=gen).to(dtype)
    k = torch.randn(b, c.hk, c.nk, c.d, generator=gen).to(dtype)
    v = torch.randn(b, c.hk, c.nk, c.d, generator=gen).to(dtype)
    kw: dict = {"enable_gqa": c.hq != c.hk}
    mask: Optional[torch.Tensor] = None  # SDPA's mask: True = attend
    if c.nq > 1:
        kw["is_causal"] = "bottom_right"
        mask = torch.ones(c.nq, c.nk, dtype=torch.bool).tril(c.nk - c.nq)
    if c.padded:
        lengths = torch.tensor([int(0.6 * c.nk), c.nk])
        pad = torch.arange(c.nk)[None] < lengths[:, None]  # (B, Nk)
        kw["key_padding_mask"] = pad
        pm = pad[:, None, None, :]
        mask = pm if mask is None else (mask & pm)
    if c.lse:
        kw["return_lse"] = True
    fns = {
        "qkv": lambda: qkv.attention(q, k, v, **kw),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=c.hq != c.hk),
    }
    with torch.no_grad():
        out = qkv.attention(q, k, v, **kw)
        out = out[0] if isinstance(out, tuple) else out
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=c.hq != c.hk)
        err = float((out.double() - ref).abs().max())
        for fn in fns.values():
            fn()
        best = time_cell(fns, rounds)
    kv_bytes = (k.numel() + v.numel()) * k.element_size()
    rows = c.hq // c.hk * c.nq
    flops = 2 * b * c.hq * c.nq * c.nk * (2 * c.d)  # q·k and p·v for every (row, key)
    return {"cell": asdict(c), "label": c.label(), "qkv_s": best["qkv"], "sdpa_s": best["sdpa"], "kv_bytes": kv_bytes,
            "flops": flops, "rows_per_group": rows, "max_abs_err": err}


def report(results: list[dict], copy: dict[int, float], peak: dict[int, float]) -> str:
    lines = [
        "# CPU decoding: qkv against SDPA and the machine's copy bandwidth",
        "",
        f"{cpu_name()}, torch {torch.__version__}, qkv auto vs `F.scaled_dot_product_attention`, interleaved, best of "
        "the rounds; B = 1 (2 when ragged). Bandwidth = bytes of K and V / qkv's time. "
        + ", ".join(f"{t} thread{'s' if t > 1 else ''}: copy {copy[t] / 1e9:.1f} GB/s, float32 GEMM {peak[t] / 1e9:.0f} GFLOP/s"
                    for t in sorted(copy)) + ".",
        "A cell is compute-bound when its arithmetic per byte of K and V exceeds the machine's balance (GEMM peak ÷ copy"
        " bandwidth); its target is then the GEMM peak, shown in the last column.",
        "",
        "| cell | qkv ms | SDPA ms | qkv ÷ SDPA | qkv GB/s | % of copy | GFLOP/s (% of GEMM peak) | bound by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = r["cell"]["threads"]
        gbs = r["kv_bytes"] / r["qkv_s"]
        gflops = r["flops"] / r["qkv_s"]
        compute_bound = r["flops"] / r["kv_bytes"] > peak[t] / copy[t]
        lines.append(
            f"| {r['label']} | {1e3 * r['qkv_s']:.2f} | {1e3 * r['sdpa_s']:.2f} | {r['qkv_s'] / r['sdpa_s']:.2f} | "
            f"{gbs / 1e9:.1f} | {100 * gbs / copy[t]:.0f}% | {gflops / 1e9:.1f} ({100 * gflops / peak[t]:.0f}%) | "
            f"{'arithmetic' if compute_bound else 'memory'} |"
        )
    mem = [r for r in results if r["flops"] / r["kv_bytes"] <= peak[r["cell"]["threads"]] / copy[r["cell"]["threads"]]]
    if mem:
        shares = [r["kv_bytes"] / r["qkv_s"] / copy[r["cell"]["threads"]] for r in mem if r["cell"]["nk"] >= 32768]
        if shares:
            lines += ["", f"Memory-bound cells from Nk = 32768: {100 * min(shares):.0f}–{100 * max(shares):.0f}% of the copy "
                      "bandwidth."]
    ratio = [r["qkv_s"] / r["sdpa_s"] for r in results]
    lines += [f"qkv ÷ SDPA over all {len(results)} cells: {min(ratio):.2f}–{max(ratio):.2f}."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="four cells")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    cells = matrix(args.quick)
    threads = sorted({c.threads for c in cells})
    copy = {t: copy_bandwidth(t) for t in threads}
    peak = {t: gemm_peak(t) for t in threads}
    results = []
    for i, c in enumerate(cells):
        r = run_cell(c, args.rounds)
        results.append(r)
        print(f"[{i + 1}/{len(cells)}] {c.label()}: qkv {1e3 * r['qkv_s']:.2f} ms, SDPA {1e3 * r['sdpa_s']:.2f} ms, "
              f"{r['kv_bytes'] / r['qkv_s'] / 1e9:.1f} GB/s", flush=True)
    name = "decode_cpu_quick" if args.quick else "decode_cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text(report(results, copy, peak))
    (args.out / f"{name}.json").write_text(json.dumps({"copy_bytes_per_s": copy, "gemm_flops": peak, "cells": results}, indent=1))
    print((args.out / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
