"""What ``qkv.attention`` adds to calls that run torch's own fused CPU kernel, part by part.

    python bench/auto_overhead.py            # writes bench/results/auto_overhead.md

Where ``auto`` hands a forward call to the kernel SDPA itself uses (plain, causal, GQA) or to
that kernel block by block (bottom-right causal, padding, windows), qkv's time is the
kernel's plus the non-finite rule's three input sums (``guard``) and, where the call is not
handed to SDPA unchanged (bottom-right here; plain and causal calls take auto's shortcut), the
argument checks (``validate``) and the backend choice (``select``). This script times those parts apart, and the
whole call against SDPA, interleaved round by round (``bench.common.time_cell``), at
B = 1, H = 8, D = 64, N = 1024 (bottom-right: Nq = N/4).

The guard is timed twice: with q, k, v just read (``guard``, cache-warm) and after a kernel
call has run through other memory (``guard_cold``), which is how it runs inside a call.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import cpu_name, time_cell  # noqa: E402
import qkv  # noqa: E402
from qkv.backends import select  # noqa: E402
from qkv.backends.flash_cpu import _kernel, _open_left  # noqa: E402
from qkv.call import validate  # noqa: E402
from qkv.nonfinite import guard  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
H, D = 8, 64


def _inputs(kind: str, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, dict]:
    """q, k, v and the qkv / SDPA keyword arguments of one kind of call."""
    g = torch.Generator().manual_seed(n)
    nq = n // 4 if kind == "bottom_right" else n
    q = torch.randn(1, H, nq, D, generator=g).to(dtype)
    k, v = (torch.randn(1, H, n, D, generator=g).to(dtype) for _ in range(2))
    if kind == "plain":
        return q, k, v, {}, {}
    if kind == "causal":
        return q, k, v, {"is_causal": True}, {"is_causal": True}
    return q, k, v, {"is_causal": "bottom_right"}, {"attn_mask": causal_lower_right(nq, n)}


def parts(kind: str, n: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The callables timed for one kind of call."""
    q, k, v, qkv_kw, sdpa_kw = _inputs(kind, n, dtype)
    call = validate(q, k, v, **qkv_kw)
    out = F.scaled_dot_product_attention(q, k, v, **sdpa_kw)
    scratch = torch.empty(4 << 20)  # 16 MiB: more than this CPU's L2 and a share of its L3

    def guard_cold() -> object:
        scratch.add_(1.0)  # evict q, k, v as a kernel call's own traffic would
        return guard(q, k, v, out)

    fns: dict[str, Callable[[], object]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, **sdpa_kw),
        "auto": lambda: qkv.attention(q, k, v, **qkv_kw),
        "validate": lambda: validate(q, k, v, **qkv_kw),
        "select": lambda: select(call, "auto"),
        "guard": lambda: guard(q, k, v, out),
        "guard_cold": guard_cold,
        "evict": lambda: scratch.add_(1.0),  # subtracted from guard_cold
    }
    if kind == "bottom_right":  # the two kernel calls and their merge, without any check
        fns["kernel_calls"] = lambda: _open_left(q, k, v, n - q.shape[2], call.scale)
    else:  # one call, with the kernel's own top-left causality for "causal"
        fns["kernel_calls"] = lambda: _kernel(q, k, v, kind == "causal", None, call.scale)
    return fns


def run(kind: str, n: int, dtype: torch.dtype, threads: int, rounds: int) -> dict:
    torch.set_num_threads(threads)
    fns = parts(kind, n, dtype)
    for fn in fns.values():
        fn()  # warm-up
    best = time_cell(fns, rounds)
    row = {"kind": kind, "n": n, "dtype": str(dtype).replace("torch.", ""), "threads": threads, "rounds": rounds}
    row.update({name: t for name, t in best.items()})
    row["guard_cold"] = max(0.0, best["guard_cold"] - best["evict"])
    row["auto_vs_sdpa"] = best["auto"] / best["sdpa"]
    if "kernel_calls" in best:
        row["kernel_calls_vs_sdpa"] = best["kernel_calls"] / best["sdpa"]
    return row


def write_report(meta: dict, rows: list[dict], path: Path) -> None:
    us = lambda t: f"{t * 1e6:.0f}"  # noqa: E731
    ms = lambda t: f"{t * 1e3:.2f}"  # noqa: E731
    lines = [
        "# What qkv adds to calls on torch's fused CPU kernel",
        "",
        f"{meta['date']} · {meta['cpu']} ({meta['cores']} cores) · torch {meta['torch']} · Python {meta['python']}",
        "",
        f"`python bench/auto_overhead.py`: B = 1, H = {H}, D = {D}, forward, best of each row's interleaved rounds. "
        "`kernel calls`: the torch kernel call(s) qkv makes, without checks (bottom-right: two calls and their merge). "
        "`guard cold`: the three input sums after other memory went through the cache, as inside a call.",
        "",
        "| kind | N | dtype | threads | rounds | sdpa ms | auto ms | auto ÷ sdpa | kernel calls ÷ sdpa | validate µs | select µs | guard µs | guard cold µs |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kc = r.get("kernel_calls_vs_sdpa")
        lines.append(
            f"| {r['kind']} | {r['n']} | {r['dtype']} | {r['threads']} | {r['rounds']} | {ms(r['sdpa'])} | {ms(r['auto'])} | "
            f"{r['auto_vs_sdpa']:.2f} | {'—' if kc is None else f'{kc:.2f}'} | {us(r['validate'])} | {us(r['select'])} | "
            f"{us(r['guard'])} | {us(r['guard_cold'])} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["plain", "causal", "bottom_right"], choices=["plain", "causal", "bottom_right"])
    ap.add_argument("--n", type=int, nargs="+", default=[1024])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default=str(RESULTS / "auto_overhead"), help="path without suffix for .md and .json")
    args = ap.parse_args(argv)
    rows = []
    for threads in dict.fromkeys(args.threads):
        for dtype in args.dtypes:
            for n in args.n:
                for kind in args.kinds:
                    rows.append(run(kind, n, getattr(torch, dtype), threads, args.rounds))
                    print(json.dumps(rows[-1]), flush=True)
    meta = {"date": dt.date.today().isoformat(), "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_report(meta, rows, out.with_suffix(".md"))


if __name__ == "__main__":
    main()
