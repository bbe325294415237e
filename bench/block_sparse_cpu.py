"""Block-sparse attention on the CPU: what a BigBird layout costs next to full attention.

    python bench/block_sparse_cpu.py --pass fwd --threads 1 --json /tmp/a.json   # one cell, JSON out
    python bench/block_sparse_cpu.py --report bench/results/block_sparse_cpu.md a.json b.json ...

Cell: BigBird (``qkv.sparse.bigbird``: 3 window blocks, 1 global, 2 random, seed 0) at N = 8192
in 128-blocks (``--layout longformer|strided``: layouts with a rule inside their blocks), B = 1, H = 8, D = 64, float32; forward alone (no gradient) or forward +
backward. Per backend (``auto``, ``chunked``) the full call (same backend, no mask) and the
sparse call (``attn_mask=BlockSparseMask``) are timed in the same run, interleaved round by
round, best of rounds; the figure is sparse ÷ full against the layout's density (the goal:
≤ 1.3 × density + a fixed cost). The peer is torch SDPA given the dense bool mask (built once,
outside the timing), against SDPA without a mask. The load average is printed beside the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import qkv  # noqa: E402
from common import before_after_arguments, cpu_name, labelled_runs, time_cell  # noqa: E402


LAYOUTS = {
    "bigbird": lambda n, block: qkv.sparse.bigbird(n, block, 3, 1, 2, seed=0),
    "longformer": lambda n, block: qkv.sparse.longformer(n, 2 * block, 1, block_size=block),  # a rule inside the blocks
    "strided": lambda n, block: qkv.sparse.strided(n, block, 4),  # causal inside the blocks
}


def run_cell(n: int, block: int, heads: int, d: int, threads: int, grad: bool, rounds: int, kind: str = "bigbird") -> dict:
    """Best-of-rounds seconds per contender for one cell, with the layout's density."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    layout = LAYOUTS[kind](n, block)
    dense = layout.to_dense()  # for SDPA only, built outside the timing
    q, k, v = (torch.randn(1, heads, n, d, requires_grad=grad) for _ in range(3))
    dout = torch.randn(1, heads, n, d)

    def call(fn):
        def go():
            out = fn()
            if grad:
                torch.autograd.backward(out, dout)
        return go

    fns = {}
    for backend in ("auto", "chunked"):
        fns[f"{backend} full"] = call(lambda b=backend: qkv.attention(q, k, v, backend=b))
        fns[f"{backend} sparse"] = call(lambda b=backend: qkv.attention(q, k, v, attn_mask=layout, backend=b))
    fns["sdpa full"] = call(lambda: F.scaled_dot_product_attention(q, k, v))
    fns["sdpa dense mask"] = call(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))
    warm = {}
    for name, fn in fns.items():  # the warm-up call counts as a first round
        warm[name] = time_cell({name: fn}, 1)[name]
    best = time_cell(fns, rounds, warm)
    return {
        "layout": kind, "n": n, "block": block, "heads": heads, "d": d, "threads": threads, "pass": "fwd+bwd" if grad else "fwd",
        "density": layout.density, "rounds": rounds, "seconds": best, "loadavg": os.getloadavg(),
        "torch": torch.__version__, "cpu": cpu_name(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
    }  # fmt: skip


def report(cells: list[dict], labels: list[str]) -> str:
    """A markdown table of sparse ÷ full per backend, against the density."""
    c0 = cells[0]
    lines = [
        "# Block-sparse attention on the CPU",
        "",
        f"`bench/block_sparse_cpu.py`: B = 1, H = {c0['heads']}, D = {c0['d']}, float32, {c0['block']}-blocks. The headline "
        "layout is BigBird (3 window, 1 global, 2 random blocks, seed 0) at N = 8192, density "
        f"**{c0['density']:.4f}** (goal: sparse ÷ full ≤ 1.3 × density = {1.3 * c0['density']:.3f}, plus a fixed cost). "
        "Full and sparse calls of the same backend timed in one run, interleaved, best of rounds (the warm-up call "
        "counts as a round); SDPA with the dense bool mask against SDPA without a mask is the peer. `before`: the "
        "code where the call carried the dense mask and the kernels found its blocks again; `after`: the layout "
        "carried to the tile loops.",
        "",
        f"{c0['cpu']}, torch {c0['torch']}, Python {platform.python_version()}, {c0['date']}.",
        "",
        "| code | layout | N | threads | pass | auto full | auto sparse | **auto ÷** | chunked full | chunked sparse | **chunked ÷** "
        "| sdpa full | sdpa dense mask | sdpa ÷ | ÷ density (auto / chunked) | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, c in zip(labels, cells):
        s = c["seconds"]
        ra, rc = s["auto sparse"] / s["auto full"], s["chunked sparse"] / s["chunked full"]
        rs = s["sdpa dense mask"] / s["sdpa full"]
        ms = lambda x: f"{1e3 * x:.0f} ms"  # noqa: E731
        lines.append(
            f"| {label} | {c.get('layout', 'bigbird')} (density {c['density']:.3f}) | {c['n']} | {c['threads']} | {c['pass']} | {ms(s['auto full'])} | {ms(s['auto sparse'])} | **{ra:.3f}** | "
            f"{ms(s['chunked full'])} | {ms(s['chunked sparse'])} | **{rc:.3f}** | {ms(s['sdpa full'])} | "
            f"{ms(s['sdpa dense mask'])} | {rs:.2f} | {ra / c['density']:.2f} / {rc / c['density']:.2f} | "
            f"{c['loadavg'][0]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="bigbird")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--pass", dest="pass_", choices=["fwd", "fwd+bwd"], default="fwd")
    p.add_argument("--rounds", type=int, default=3)
    before_after_arguments(p)
    a = p.parse_args()
    if a.report:
        Path(a.report).write_text(report(*labelled_runs(a.runs)))
        return
    cell = run_cell(a.n, a.block, a.heads, a.d, a.threads, a.pass_ == "fwd+bwd", a.rounds, a.layout)
    print(json.dumps(cell, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(cell))


if __name__ == "__main__":
    main()
