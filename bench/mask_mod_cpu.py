"""Mask functions built once, on the CPU: a loop of calls with the same ``mask_mod``, and what
building its layout costs next to Flex's ``create_block_mask`` for the same mask.

    python bench/mask_mod_cpu.py --json /tmp/after.json                                  # this tree
    QKV_TREE=/tmp/old QKV_TREE_COMMIT=abc1234 python bench/mask_mod_cpu.py --json /tmp/b.json  # another tree
    python bench/mask_mod_cpu.py --report bench/results/mask_mod_cpu.md before=/tmp/before.json after=/tmp/after.json

The mask: 4 documents packed in one sequence, causal inside each, as one ``mask_mod``
(``(doc[i] == doc[j]) & (i >= j)``); B = 1, H = 8, D = 64, float32, no gradient, N = 2048 and
8192, one thread. Per N:

- build: ``qkv.sparse.from_mask_mod(fn, 1, 8, N)`` as a call builds it (64-blocks, the cache
  off) and with 128-blocks, against Flex's ``create_block_mask(fn, None, None, N, N)`` eager and
  compiled (``_compile=True``, warmed up), best of 3;
- how long finding a kept layout again takes (what a loop's later calls pay for the mask);
- loops of 20 calls, each timed: ``auto`` (chunked on a CPU) and the ``flex`` engine given
  ``mask_mod=fn``, the same with the layout or Flex BlockMask built once and passed as
  ``attn_mask`` (the fast path), and the peer — compiled ``flex_attention`` with its BlockMask
  built once. The kernels are compiled and the engines warmed up on another ``doc`` tensor
  first, so the loop's first call pays the build and nothing else; the contenders take turns
  call by call.

The load average is printed beside the numbers (a busy machine can slow a cell down).
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.environ.get("QKV_TREE", str(ROOT)))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

import qkv  # noqa: E402
from common import before_after_arguments, best_time, cpu_name, labelled_runs  # noqa: E402

HEADS, D, DOCS, LOOP = 8, 64, 4, 20


def documents(n: int, shift: int = 0) -> torch.Tensor:
    return (torch.arange(n) + shift) * DOCS // (n + shift)  # token → document


def same_doc_causal(doc: torch.Tensor):  # noqa: ANN201
    return lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j)


def build_cells(n: int) -> dict[str, float]:
    """Best-of-3 seconds to build the mask's blocks, qkv's and Flex's."""
    fn = same_doc_causal(documents(n))
    nocache = {"cache": False} if "cache" in inspect.signature(qkv.sparse.from_mask_mod).parameters else {}
    compiled = torch.compile(create_block_mask)
    compiled(fn, None, None, n, n, device="cpu")  # warm-up: compilation
    qkv.sparse.from_mask_mod(fn, 1, HEADS, n)  # kept, where this tree keeps layouts
    return {
        "qkv layout found again (as a loop's later calls)": best_time(lambda: qkv.sparse.from_mask_mod(fn, 1, HEADS, n), 20),
        "qkv layout, 64-blocks (as a call)": best_time(lambda: qkv.sparse.from_mask_mod(fn, 1, HEADS, n, **nocache), 3),
        "qkv layout, 128-blocks": best_time(lambda: qkv.sparse.from_mask_mod(fn, None, None, n, block_size=128, **nocache), 3),
        "Flex create_block_mask, eager": best_time(lambda: create_block_mask(fn, None, None, n, n, device="cpu"), 3),
        "Flex create_block_mask, compiled": best_time(lambda: compiled(fn, None, None, n, n, device="cpu"), 3),
    }


def loops(contenders: dict, n: int) -> dict[str, list[float]]:
    """Seconds of each of ``LOOP`` calls of each contender ``call(fn)``, the contenders taking
    turns call by call (a load that changes over the run weighs on all alike; each round starts
    one contender later). Each has its own mask function and ``doc`` tensor (no contender finds
    another's mask kept) and is warmed up first on another ``doc`` (compiled kernels, not the key)."""
    with torch.no_grad():
        for call in contenders.values():
            call(same_doc_causal(documents(n, shift=7)))
        fns = {name: same_doc_causal(documents(n)) for name in contenders}
        times: dict[str, list[float]] = {name: [] for name in contenders}
        names = list(contenders)
        for step in range(LOOP):
            for name in names[step % len(names) :] + names[: step % len(names)]:
                t0 = time.perf_counter()
                contenders[name](fns[name])
                times[name].append(time.perf_counter() - t0)
    return times


def built_once(run_with, build):  # noqa: ANN001, ANN201
    """``call(fn)`` that builds ``build(fn)`` on its first call with ``fn`` (timed with it) and
    runs ``run_with(built)``: the fast path, a mask built once and passed on."""
    built: dict[int, object] = {}

    def call(fn):  # noqa: ANN001, ANN202
        if id(fn) not in built:
            built.clear()
            built[id(fn)] = build(fn)
        return run_with(built[id(fn)])

    return call


def loop_cells(n: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, D) for _ in range(3))
    peer = torch.compile(flex_attention, dynamic=False)  # static, as the flex engine compiles on a CPU
    flex_mask = lambda f: create_block_mask(f, None, None, n, n, device="cpu")  # noqa: E731
    return loops({
        "auto, mask_mod=": lambda f: qkv.attention(q, k, v, mask_mod=f),
        "auto, layout built once": built_once(lambda m: qkv.attention(q, k, v, attn_mask=m),
                                              lambda f: qkv.sparse.from_mask_mod(f, 1, HEADS, n)),
        "flex, mask_mod=": lambda f: qkv.attention(q, k, v, mask_mod=f, backend="flex"),
        "flex, BlockMask built once": built_once(lambda m: qkv.attention(q, k, v, attn_mask=m, backend="flex"), flex_mask),
        "peer: Flex, BlockMask built once": built_once(lambda m: peer(q, k, v, block_mask=m), flex_mask),
    }, n)  # fmt: skip


def run(ns: list[int], threads: int) -> dict:
    torch.set_num_threads(threads)
    tree = os.environ.get("QKV_TREE", str(ROOT))
    commit = os.environ.get("QKV_TREE_COMMIT")  # what a QKV_TREE holds (an exported tree has no git)
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = "?"
    cells = []
    for n in ns:
        load0 = os.getloadavg()[0]
        cells.append({"n": n, "build": build_cells(n), "loops": loop_cells(n), "loadavg": [load0, os.getloadavg()[0]]})
    return {"cells": cells, "threads": threads, "tree": tree, "commit": commit, "torch": torch.__version__,
            "python": platform.python_version(), "cpu": cpu_name(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes")}  # fmt: skip


def report(runs: list[dict], labels: list[str]) -> str:
    r0 = runs[0]
    ms = lambda x: f"{1e3 * x:.1f}"  # noqa: E731
    lines = [
        "# Mask functions built once (CPU)",
        "",
        f"`bench/mask_mod_cpu.py`: 4 documents, causal inside each, as one `mask_mod`; B = 1, H = {HEADS}, D = {D}, float32, "
        f"no gradient, {r0['threads']} thread(s). {r0['cpu']}, torch {r0['torch']}, Python {r0['python']}, {r0['date']}.",
        "",
        "## Building the layout against Flex's `create_block_mask` (ms: best of 3 builds, of 20 look-ups)",
        "",
        "| code | N | " + " | ".join(runs[0]["cells"][0]["build"]) + " | load avg |",
        "|---|---:|" + "---:|" * len(runs[0]["cells"][0]["build"]) + "---|",
    ]
    for label, r in zip(labels, runs):
        for c in r["cells"]:
            lines.append(f"| {label} | {c['n']} | " + " | ".join(f"{1e3 * x:.2f}" for x in c["build"].values())
                         + f" | {c['loadavg'][0]:.2f} |")  # fmt: skip
    lines += [
        "",
        f"## A loop of {LOOP} calls with the same `mask_mod` (ms)",
        "",
        "`first`: the loop's first call (the build included); `then`: the mean of the other calls; `loop`: all of them.",
        "",
        "| code | N | contender | first | then | loop | loop ÷ peer's | load avg |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for label, r in zip(labels, runs):
        for c in r["cells"]:
            peer = sum(c["loops"]["peer: Flex, BlockMask built once"])
            for name, times in c["loops"].items():
                rest = times[1:]
                lines.append(f"| {label} | {c['n']} | {name} | {ms(times[0])} | {ms(sum(rest) / len(rest))} | "
                             f"{ms(sum(times))} | {sum(times) / peer:.2f} | {c['loadavg'][0]:.2f}–{c['loadavg'][1]:.2f} |")  # fmt: skip
    trees = ", ".join(f"`{lab}`: {r['commit']}" for lab, r in zip(labels, runs))
    lines += ["", f"Trees: {trees}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    before_after_arguments(p)
    a = p.parse_args()
    if a.report:
        Path(a.report).write_text(report(*labelled_runs(a.runs)))
        print(Path(a.report).read_text())
        return
    found = run(a.n, a.threads)
    print(json.dumps(found, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(found))


if __name__ == "__main__":
    main()
