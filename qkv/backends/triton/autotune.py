"""Tune the launch table (:data:`.configs.CONFIGS`) on this GPU: time candidate configurations of
each kernel and write the winners as rows ready to paste into ``configs.py``.

    python -m qkv.backends.triton.autotune --budget 60 --out /tmp/tune.json     # on the GPU
    TRITON_INTERPRET=1 python -m qkv.backends.triton.autotune --dry-run --out /tmp/tune.json

The GPU check (``bench/gpu_check.py``) runs it in its own slice of the time budget. Each target
is ``(head-dim bucket, kind, mask kind)`` on bf16 inputs of the benchmark's shapes (16k tokens,
hidden 2048, N = 4096; decoding: batch 8, 32/8 heads, one query row against 16k keys); each
candidate is timed with ``triton.testing.do_bench`` (median) through the launch code with
:func:`.backend.override`, after its output is compared with the current entry's (a candidate
that computes something else is rejected). Targets run most important first (head dim 128,
then 64) and stop at the budget; those not reached are reported as unmeasured. A candidate's
first call compiles it (seconds each): the candidate lists are short for that reason.

``--dry-run`` (the interpreter on a CPU) runs the same steps on tiny shapes with two small
candidates per kernel; its times mean nothing and the report says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from . import configs
from .configs import Config

C = Config
CANDIDATES: dict[str, list[Config]] = {
    "fwd": [C(128, 64, 4, 3), C(128, 64, 8, 2), C(128, 128, 8, 2), C(64, 64, 4, 3), C(128, 64, 4, 3, True), C(128, 32, 4, 4)],
    "bwd_dkdv": [C(64, 64, 4, 2), C(64, 64, 8, 2), C(64, 128, 8, 2), C(128, 64, 8, 2), C(32, 64, 4, 2)],
    "bwd_dq": [C(64, 64, 4, 2), C(64, 64, 8, 2), C(128, 64, 8, 2), C(64, 128, 8, 2), C(128, 32, 8, 2)],
    "decode": [C(16, 64, 4, 3), C(16, 128, 4, 3), C(16, 128, 8, 2), C(16, 256, 8, 2), C(16, 32, 4, 4)],
}
DRY_CANDIDATES = [configs.INTERPRETER, C(16, 32, 1, 1)]
# most important first: the benchmark's head dim 128, forward and backward, then decoding, then 64
TARGETS: list[tuple[int, str, str]] = [
    (128, "fwd", "band"), (128, "fwd", "full"), (128, "bwd_dkdv", "any"), (128, "bwd_dq", "any"), (128, "decode", "any"),
    (64, "fwd", "band"), (64, "fwd", "full"), (64, "bwd_dkdv", "any"), (64, "bwd_dq", "any"), (64, "decode", "any"),
]  # fmt: skip


def _inputs(d: int, kind: str, dry: bool, device: str):
    """Grouped q ``(B, Hk, G, Nq, D)``, k, v ``(B, Hk, 1, Nk, D)`` in bf16."""
    g = torch.Generator(device=device).manual_seed(0)
    if kind == "decode":
        b, hk, grp, nq, nk = (1, 2, 2, 1, 64) if dry else (8, 8, 4, 1, 16384)
    else:
        n = 32 if dry else 4096
        h = 2 if dry else 2048 // d
        b, hk, grp, nq, nk = (1 if dry else 16384 // n), h, 1, n, n
    dd = 16 if dry else d

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)

    return rnd(b, hk, grp, nq, dd), rnd(b, hk, 1, nk, dd), rnd(b, hk, 1, nk, dd)


def _runner(kind: str, mask: str, q, k, v) -> Callable[[], torch.Tensor]:
    """A call of the launch code that exercises ``kind`` (the backward's two kernels are timed
    together: each candidate replaces one of them)."""
    from . import backend as B

    scale = q.shape[-1] ** -0.5
    hi = 0 if mask == "band" or kind.startswith("bwd") else None
    if kind in ("fwd", "decode"):
        return lambda: B.triton_fwd(q, k, v, None, None, None, None, 0, 0, scale, None, hi, False)[0]
    out, lse = B.triton_fwd(q, k, v, None, None, None, None, 0, 0, scale, None, hi, False)
    dout = torch.randn_like(out)
    which = 0 if kind == "bwd_dq" else 1
    return lambda: B.triton_bwd(dout, None, q, k, v, out, lse, None, None, None, None, 0, 0, scale, None, hi, False)[which]


def _timer(dry: bool):
    if dry:
        def wall_ms(fn):
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

        return wall_ms
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=10, rep=30, return_mode="median")


def tune(budget: float, dry: bool, arch: Optional[str] = None, log=print) -> dict:
    """Time the candidates of each target within ``budget`` seconds: ``{"arch", "dry_run",
    "results": [{target, default, candidates: [{config, ms | error}], best}], "unmeasured": [...]}``."""
    from . import backend as B

    device = "cpu" if dry else "cuda"
    if arch is None:
        arch = "cpu-dry-run" if dry else B.device_arch(torch.cuda.current_device())
    time_ms = _timer(dry)
    t0 = time.monotonic()
    results, unmeasured = [], []
    for target in TARGETS[:5] if dry else TARGETS:
        d, kind, mask = target
        if time.monotonic() - t0 > budget:
            unmeasured.append(list(target))
            continue
        default = configs.lookup(arch, d, d, 2, kind, mask)
        q, k, v = _inputs(d, kind, dry, device)
        fn = _runner(kind, mask, q, k, v)
        want = fn().float()
        rec = {"target": list(target), "default": list(default), "candidates": []}
        cands = DRY_CANDIDATES if dry else [default] + [c for c in CANDIDATES[kind] if c != default]
        for cfg in cands:
            if time.monotonic() - t0 > budget:
                break
            entry: dict = {"config": list(cfg)}
            try:
                with B.override(kind, cfg):
                    got = fn().float()
                    err = float((got - want).abs().max())
                    if not err <= 1e-2 * max(1.0, float(want.abs().max())):
                        raise ValueError(f"output differs from the current entry's by {err:.3g}")
                    entry["ms"] = time_ms(fn)
            except Exception as exc:  # noqa: BLE001 — a candidate that fails to compile or launch is skipped
                entry["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
            rec["candidates"].append(entry)
            log(f"[{time.monotonic() - t0:5.0f}s] d{d} {kind} {mask} {tuple(cfg)}: {entry.get('ms', entry.get('error'))}")
        timed = [c for c in rec["candidates"] if "ms" in c]
        rec["best"] = min(timed, key=lambda c: c["ms"]) if timed else None
        results.append(rec)
        del q, k, v, fn, want
    return {"arch": arch, "dry_run": dry, "seconds": time.monotonic() - t0, "results": results, "unmeasured": unmeasured}


def table_rows(data: dict) -> dict:
    """The winners as :data:`configs.CONFIGS` rows (bf16/fp16: dtype bytes 2)."""
    rows = {}
    for r in data.get("results", []):
        if r.get("best"):
            d, kind, mask = r["target"]
            rows[(data["arch"], d, 2, kind, mask)] = Config(*r["best"]["config"])
    return rows


def report(data: Optional[dict]) -> list[str]:
    """Markdown: one line per target (default and winner with their times), then the rows to
    paste into ``configs.py``; "unmeasured" where nothing was timed."""
    if not data:
        return ["Autotune: unmeasured (the step did not run or wrote nothing)."]
    dry = data.get("dry_run")
    lines = [f"Architecture `{data['arch']}`, bf16, {data.get('seconds', 0):.0f} s"
             + (" — **dry run on CPU: times mean nothing, nothing measured**" if dry else ""), "",
             "| head dim | kernel | mask | current entry | ms | best | ms | speed-up |", "|---:|---|---|---|---:|---|---:|---:|"]  # fmt: skip
    for r in data.get("results", []):
        d, kind, mask = r["target"]
        cur = next((c for c in r["candidates"] if c["config"] == r["default"]), None)
        best = r.get("best")
        cur_ms = cur.get("ms") if cur else None
        fmt = lambda x: "unmeasured" if x is None or dry else f"{x:.3f}"  # noqa: E731
        speed = f"{cur_ms / best['ms']:.2f}×" if best and cur_ms and not dry else "—"
        lines.append(f"| {d} | {kind} | {mask} | {tuple(r['default'])} | {fmt(cur_ms)} | {tuple(best['config']) if best else '—'} | "
                     f"{fmt(best['ms'] if best else None)} | {speed} |")  # fmt: skip
    for d, kind, mask in data.get("unmeasured", []):
        lines.append(f"| {d} | {kind} | {mask} | — | unmeasured | — | unmeasured | — |")
    rows = table_rows(data)
    if rows and not dry:
        lines += ["", "Rows for `qkv/backends/triton/configs.py` (`CONFIGS`):", "", "```python", configs.render(rows), "```"]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=60.0, help="seconds (default 60)")
    ap.add_argument("--out", type=Path, required=True, help="JSON with every timing")
    ap.add_argument("--dry-run", action="store_true", help="the interpreter on a CPU: tiny shapes, nothing measured")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device (use --dry-run with TRITON_INTERPRET=1 on a CPU)", file=sys.stderr)
        return 2
    data = tune(args.budget, args.dry_run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    print("\n".join(report(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
