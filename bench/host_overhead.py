"""The host path of a small ``qkv.attention`` call against torch SDPA's own, part by part.

    python bench/host_overhead.py                      # this machine's device (CUDA if present)
    python bench/host_overhead.py --device cpu --out bench/results/host_overhead_cpu.md

A tiny call (B 1, H 8, N 128, D 64 on a GPU; on a CPU, whose kernel takes milliseconds at that
size, N 8, D 16) costs what the host spends on it: Python,
argument checks, the choice of engine, launch preparation, and each tensor operation issued
(on a GPU, each is a kernel launch). Timed per call, best of interleaved rounds: on CUDA wall
time, each round ended by a synchronize so queued work counts; on a CPU the calling thread's CPU
time with one torch thread (the whole call runs on it), which a busy machine's waits for a core
do not inflate:

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` itself, the floor;
- ``auto``: ``qkv.attention`` as a user calls it (on a CPU a plain call takes the shortcut
  straight to SDPA, :func:`qkv.backends.plain_sdpa_call`);
- ``auto, validated`` (on a CPU): the same call with ``is_causal="top_left"`` (``True``'s meaning;
  ``None`` for ``False``), which no shortcut takes: every argument validated, the engine chosen by the table and
  prepared — the path every call on a GPU takes;
- ``triton``: ``backend="triton"`` (on CUDA only: the CPU interpreter measures nothing useful);
- the parts, apart: ``validate`` (:func:`qkv.call.validate`), ``select`` (auto's choice,
  :func:`qkv.backends.select`), and ``rule`` (:func:`qkv.nonfinite.guard` on the output: the
  non-finite rule every engine's answer passes, which a GPU pays in kernel launches).

The host path over SDPA is ``auto, validated − sdpa``; less the rule it is what validation,
routing and launch preparation cost. ``ops`` counts the tensor operations one call issues (a
``TorchDispatchMode``; views included), SDPA's own beside it; ``py calls`` the Python and C
functions it enters, a measure of the host path no load changes. ``--profile`` adds the
functions a call spends its time in (cProfile), for finding what is left. The load average is
printed beside the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import cpu_name  # noqa: E402
import qkv  # noqa: E402
from qkv.backends import BACKENDS, select  # noqa: E402
from qkv.call import validate  # noqa: E402
from qkv.nonfinite import guard  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# the kinds of call: qkv's keywords, SDPA's (None: SDPA has no such argument)
KINDS: dict[str, tuple[dict, Optional[dict]]] = {
    "causal": ({"is_causal": True}, {"is_causal": True}),
    "full": ({}, {}),
    "window": ({"window": (4, 0)}, None),
}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def ops_of(fn: Callable[[], object]) -> list[str]:
    """The aten operations one call of ``fn`` issues."""
    with _Count() as c:
        fn()
    return c.ops


def contenders(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], object]]:
    qkv_kw, sdpa_kw = KINDS[kind]
    # the same meaning, no shortcut: is_causal "top_left" is True's, None is False's
    validated = dict(qkv_kw, is_causal="top_left" if qkv_kw.get("is_causal") else None)
    call = validate(q, k, v, **qkv_kw)
    out = qkv.attention(q, k, v, **qkv_kw)
    fns: dict[str, Callable[[], object]] = {}
    if sdpa_kw is not None:
        fns["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, **sdpa_kw)
    fns["auto"] = lambda: qkv.attention(q, k, v, **qkv_kw)
    if q.is_cpu and "window" not in qkv_kw:  # (elsewhere, and for a window, auto is the validated path)
        fns["auto, validated"] = lambda: qkv.attention(q, k, v, **validated)
    if q.is_cuda and BACKENDS["triton"].available() is None:
        fns["triton"] = lambda: qkv.attention(q, k, v, backend="triton", **qkv_kw)
    fns["validate"] = lambda: validate(q, k, v, **qkv_kw)
    fns["select"] = lambda: select(call, "auto")
    fns["rule"] = lambda: guard(q, k, v, out)
    return fns


def python_calls(fn: Callable[[], object]) -> int:
    """Python and C functions one call of ``fn`` enters (``sys.setprofile``): a count of the host
    path's work that a busy machine does not change."""
    n = [0]

    def count(frame, event, arg):  # noqa: ANN001, ANN202
        if event in ("call", "c_call"):
            n[0] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0] - 1  # (setprofile's own return)


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, calls: int, clock: Callable[[], float], sync: Callable[[], None]) -> dict[str, float]:
    """Best per-call time of each contender over ``rounds`` rounds of ``calls`` calls, the
    contenders interleaved and each round starting one later (``bench.common.time_cell``'s order)."""
    best = {name: float("inf") for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = fns[name]
            sync()
            t0 = clock()
            for _ in range(calls):
                fn()
            sync()
            best[name] = min(best[name], (clock() - t0) / calls)
    return best


def measure(kind: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int], rounds: int, calls: int) -> dict:
    b, h, n, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    fns = contenders(kind, q, k, v)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # on a CPU the calling thread's CPU time (one torch thread: all of a call's work is on it),
    # which waiting for a core on a busy machine does not inflate; on a GPU wall time, queued
    # kernels included by the synchronize that ends each round
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    for fn in fns.values():
        fn()
    sync()
    us = {name: t * 1e6 for name, t in interleaved(fns, rounds, calls, clock, sync).items()}
    call = validate(q, k, v, **KINDS[kind][0])
    timed = ("sdpa", "auto", "auto, validated", "triton")
    row = {
        "kind": kind, "shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "us": us,
        "engine": select(call, "auto").NAME, "clock": "wall" if device.type == "cuda" else "thread CPU",
        "ops": {name: len(ops_of(fns[name])) for name in timed if name in fns},
        "python_calls": {name: python_calls(fns[name]) for name in timed if name in fns},
    }  # fmt: skip
    whole = us.get("auto, validated", us["auto"])
    if "sdpa" in us:
        row["over_sdpa_us"] = whole - us["sdpa"]
        row["over_sdpa_less_rule_us"] = whole - us["sdpa"] - us["rule"]
    return row


def profile(fn: Callable[[], object], calls: int, top: int = 15) -> str:
    """The ``top`` functions by own time over ``calls`` calls of ``fn`` (cProfile's table)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    text = out.getvalue()
    return text[text.index("ncalls") :].rstrip() if "ncalls" in text else text.strip()


def write_report(meta: dict, rows: list[dict], path: Path, profiles: Optional[dict[str, str]] = None) -> None:
    f = lambda x: "—" if x is None else f"{x:.1f}"  # noqa: E731
    cols = ("sdpa", "auto", "auto, validated", "triton", "validate", "select", "rule")
    lines = [
        "# The host path of a small call: qkv.attention against torch SDPA",
        "",
        f"{meta['date']} · {meta['device']} · torch {meta['torch']} · Python {meta['python']} · "
        f"load average {meta['load_start']:.2f} at the start, {meta['load_end']:.2f} at the end",
        "",
        f"`{meta['command']}`: µs per call ({meta['clock']} time), best of {meta['rounds']} interleaved rounds of "
        f"{meta['calls']} calls (bench/host_overhead.py's docstring says what each column times). `over SDPA`: the "
        "validated path (every call on a GPU) less SDPA; `less the rule`: that without the non-finite rule's own "
        "time, i.e. validation, routing and launch preparation. `ops`: tensor operations per call; `py calls`: "
        "Python and C functions entered per call (auto's on the validated path, SDPA's).",
        "",
        "| call | dtype | engine | " + " | ".join(cols) + " | over SDPA | less the rule | ops | py calls |",
        "|---|---|---|" + "---:|" * (len(cols) + 4),
    ]
    for r in rows:
        ops, py = r["ops"], r["python_calls"]
        mine = "auto, validated" if "auto, validated" in ops else "auto"
        lines.append(
            f"| {r['kind']} {tuple(r['shape'])} | {r['dtype']} | {r['engine']} | "
            + " | ".join(f(r["us"].get(c)) for c in cols)
            + f" | {f(r.get('over_sdpa_us'))} | {f(r.get('over_sdpa_less_rule_us'))} | {ops[mine]} / {ops.get('sdpa', '—')} "
            f"| {py[mine]} / {py.get('sdpa', '—')} |"
        )
    for name, text in (profiles or {}).items():
        lines += ["", f"Where {name} spends its time (cProfile, own time; the profiler inflates each function alike):", "",
                  "```", text, "```"]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    # on a CPU the kernel of N = 128 takes milliseconds, hiding the host path: tiny inputs there
    ap.add_argument("--shape", default=None, help="B,H,N,D (default 1,8,128,64 on CUDA, 1,8,8,16 on a CPU)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=100, help="calls per round")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (a tiny call wants one)")
    ap.add_argument("--profile", action="store_true", help="add where auto's (and triton's) causal call spends its time")
    ap.add_argument("--out", default=None, help="report path (.md; a .json beside it); default bench/results/host_overhead_<device>.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    shape = tuple(int(x) for x in (args.shape or ("1,8,128,64" if device.type == "cuda" else "1,8,8,16")).split(","))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_name()} ({os.cpu_count()} cores, {args.threads} thread)"
    slug = "cpu" if device.type == "cpu" else "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    out = Path(args.out) if args.out else RESULTS / f"host_overhead_{slug}.md"
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    rows = []
    for kind in args.kinds:
        rows.append(measure(kind, device, dtype, shape, args.rounds, args.calls))  # type: ignore[arg-type]
        print(json.dumps(rows[-1]), flush=True)
    profiles = {}
    if args.profile:
        q, k, v = (torch.randn(*shape, device=device, dtype=dtype) for _ in range(3))  # type: ignore[misc]
        validated = {"is_causal": "top_left"} if device.type == "cpu" else {"is_causal": True}
        profiles["auto (causal)"] = profile(lambda: qkv.attention(q, k, v, **validated), args.calls)
        if device.type == "cuda" and BACKENDS["triton"].available() is None:
            profiles["triton (causal)"] = profile(lambda: qkv.attention(q, k, v, is_causal=True, backend="triton"), args.calls)
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": name, "torch": torch.__version__,
        "python": platform.python_version(), "load_start": load_start, "load_end": os.getloadavg()[0], "rounds": args.rounds,
        "calls": args.calls, "seconds": time.monotonic() - t0, "clock": rows[0]["clock"] if rows else "",
        "command": "python bench/host_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "profiles": profiles}, indent=1))
    write_report(meta, rows, out, profiles)
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
