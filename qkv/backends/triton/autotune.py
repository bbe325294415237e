"""Tune the launch table (:data:`.configs.CONFIGS`) on this GPU: time candidate configurations of
every kernel and write the winners as rows ready to paste into ``configs.py``.

    python -m qkv.backends.triton.autotune --budget 60 --out /tmp/tune.json     # on the GPU
    python -m qkv.backends.triton.autotune --kinds decode --out /tmp/tune.json   # one kernel's targets
    TRITON_INTERPRET=1 python -m qkv.backends.triton.autotune --dry-run --out /tmp/tune.json

The GPU check (``bench/gpu_check.py``) runs it in its own slice of the time budget. Each target
is ``(head-dim bucket, kind, mask kind)`` on bf16 inputs of the benchmark's shapes (16k tokens,
hidden 2048, N = 4096; decoding: batch 8, 32/8 heads, one query row against 16k keys), through
the launch code with :func:`.backend.override`; a kind is a kernel (``fwd``, ``bwd_dkdv``,
``bwd_dq``, ``decode`` — whatever kernel the launch code runs for it, the decoding kernels of
:mod:`.decode` included). Each candidate's output is first compared with the current entry's
(one that computes something else is rejected), then timed with ``triton.testing.do_bench``
(median).

Every target is reached within the budget: each gets an equal share of what is left, and its
candidates run in order (the current entry first, as the baseline) until the share is spent,
so a short budget times fewer candidates per kernel instead of leaving kernels out. A
candidate's first call compiles it (about a second on an H200), which is why the lists are
short and ordered by promise (:data:`CANDIDATES`): what won on the H200, then compiled
FlexAttention's own Hopper choices (``torch/_inductor/template_heuristics/triton.py``: forward
128×128 tiles, 4 warps, 3 stages at d64 and 128×64, 8 warps, 3 stages at d128; backward 64-row
by 128-key tiles for dK/dV and 128 by 64 for dQ, 8 warps, 3 stages). A candidate that fails to
compile or launch (shared memory, a compiler error) is recorded and skipped; warp-specialised
candidates are skipped on Triton 3.6, whose ``NVGPUWarpSpecialization`` pass fails on these
kernels (the H200 run, ``kernels.py`` forward loop). The JSON is rewritten after every
candidate, so a step cut at its deadline leaves what it measured.

``--dry-run`` (the interpreter on a CPU) runs the same steps on tiny shapes with two small
candidates per kernel; its times mean nothing and the report says so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from . import configs
from .configs import Config

C = Config
# (kind, head-dim bucket) → candidates, most promising first; the current entry is timed first
# whether listed or not.
CANDIDATES: dict[tuple[str, int], list[Config]] = {
    ("fwd", 64): [C(128, 128, 4, 3), C(64, 64, 4, 3), C(128, 64, 4, 3), C(64, 128, 4, 3)],
    ("fwd", 128): [C(64, 64, 4, 3), C(128, 64, 8, 3), C(128, 128, 8, 2), C(128, 64, 4, 3, True)],
    ("bwd_dkdv", 64): [C(64, 128, 8, 3), C(64, 64, 4, 3), C(64, 128, 4, 2)],
    ("bwd_dkdv", 128): [C(64, 128, 8, 3), C(64, 64, 4, 3), C(64, 128, 8, 2)],
    ("bwd_dq", 64): [C(128, 64, 8, 3), C(64, 64, 4, 3), C(64, 128, 4, 3)],
    ("bwd_dq", 128): [C(128, 64, 8, 3), C(64, 64, 4, 3), C(64, 64, 8, 3)],
    # decoding is memory-bound: longer key tiles and deeper pipelines keep more loads in flight
    ("decode", 64): [C(16, 128, 4, 3), C(16, 256, 8, 3), C(16, 64, 4, 4)],
    ("decode", 128): [C(16, 128, 4, 3), C(16, 64, 4, 4), C(16, 128, 8, 3)],
}
DRY_CANDIDATES = [configs.INTERPRETER, C(16, 32, 1, 1)]
# most important first: the benchmark's head dim 128, forward and backward, then decoding, then 64
TARGETS: list[tuple[int, str, str]] = [
    (128, "fwd", "band"), (128, "fwd", "full"), (128, "bwd_dkdv", "any"), (128, "bwd_dq", "any"), (128, "decode", "any"),
    (64, "fwd", "band"), (64, "fwd", "full"), (64, "bwd_dkdv", "any"), (64, "bwd_dq", "any"), (64, "decode", "any"),
]  # fmt: skip
DRY_TARGETS = TARGETS[:5]  # every kernel once, at head dim 128
MIN_CANDIDATES = 2  # the baseline and one challenger per target, whatever the share says
WS_SKIPPED = "skipped: Triton 3.6's NVGPUWarpSpecialization pass fails on these kernels (measured on an H200)"


def warp_specialization_works(version: Optional[str] = None) -> bool:
    """Can this Triton compile the forward with ``warp_specialize=True``? Not 3.6 (its pass
    failed on the H200, an assertion in TaskIdPropagation); later versions are tried."""
    if version is None:
        from importlib.metadata import PackageNotFoundError, version as pkg_version

        try:
            version = pkg_version("triton")
        except PackageNotFoundError:
            return False
    m = re.match(r"(\d+)\.(\d+)", version)
    return bool(m) and (int(m.group(1)), int(m.group(2))) > (3, 6)


def candidates(kind: str, d: int, current: Config, dry: bool) -> list[Config]:
    """The current entry first, then :data:`CANDIDATES` for the kind and head-dim bucket."""
    if dry:
        return list(DRY_CANDIDATES)
    return [current] + [c for c in CANDIDATES.get((kind, d), []) if c != current]


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
    if kind in ("fwd", "decode"):  # decoding as a call without gradients runs it: the non-finite rule inside
        return lambda: B.triton_fwd(q, k, v, None, None, None, None, 0, 0, scale, None, hi, False, check=kind == "decode")[0]
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


def _error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _try(B, kind: str, cfg: Config, fn, want: torch.Tensor, time_ms) -> dict:
    """One candidate: ``{"ms": …}``, or ``{"error": …}`` when it fails to compile, launch or agree."""
    try:
        with B.override(kind, cfg):
            got = fn().float()
            err = float((got - want).abs().max())
            if not err <= 1e-2 * max(1.0, float(want.abs().max())):
                raise ValueError(f"output differs from the current entry's by {err:.3g}")
            return {"ms": time_ms(fn)}
    except Exception as exc:  # noqa: BLE001 — a candidate that fails to compile or launch is skipped
        return {"error": _error(exc)}


def tune(budget: float, dry: bool, arch: Optional[str] = None, log=print, kinds=None,
         save: Optional[Callable[[dict], None]] = None, clock: Callable[[], float] = time.monotonic) -> dict:  # fmt: skip
    """Time the candidates of each target within ``budget`` seconds: ``{"arch", "dry_run",
    "results": [{target, default, candidates: [{config, ms | error | skipped}], best}],
    "unmeasured": [...]}``. ``kinds``: only these kernels; ``save``: called with the data after
    every candidate; ``clock``: seconds (the budget's)."""
    from . import backend as B

    device = "cpu" if dry else "cuda"
    if arch is None:
        arch = "cpu-dry-run" if dry else B.device_arch(torch.cuda.current_device())
    time_ms = _timer(dry)
    ws_ok = warp_specialization_works()
    t0 = clock()
    targets = [t for t in (DRY_TARGETS if dry else TARGETS) if kinds is None or t[1] in kinds]
    # "unmeasured": the targets not started yet, so that a run cut or killed says which they are
    data: dict = {"arch": arch, "dry_run": dry, "seconds": 0.0, "budget": budget, "results": [], "unmeasured": [list(t) for t in targets]}

    def flush() -> None:
        data["seconds"] = clock() - t0
        if save is not None:
            save(data)

    for i, target in enumerate(targets):
        d, kind, mask = target
        left = budget - (clock() - t0)
        if left <= 0:
            break
        data["unmeasured"].remove(list(target))
        deadline = clock() + left / (len(targets) - i)  # an equal share of what is left
        default = configs.lookup(arch, d, d, 2, kind, mask)
        rec: dict = {"target": list(target), "default": list(default), "candidates": [], "best": None}
        data["results"].append(rec)
        try:
            q, k, v = _inputs(d, kind, dry, device)
            fn = _runner(kind, mask, q, k, v)
            want = fn().float()
        except Exception as exc:  # noqa: BLE001 — the target's own setup failed: say so, go on
            rec["error"] = _error(exc)
            log(f"[{clock() - t0:5.0f}s] d{d} {kind} {mask}: {rec['error']}")
            flush()
            continue
        for cfg in candidates(kind, d, default, dry):
            timed = sum("ms" in c for c in rec["candidates"])
            if timed >= MIN_CANDIDATES and clock() > deadline or clock() - t0 > budget:
                break
            entry: dict = {"config": list(cfg)}
            if cfg.warp_specialize and not ws_ok:
                entry["skipped"] = WS_SKIPPED
            else:
                entry.update(_try(B, kind, cfg, fn, want, time_ms))
            rec["candidates"].append(entry)
            done = [c for c in rec["candidates"] if "ms" in c]
            rec["best"] = min(done, key=lambda c: c["ms"]) if done else None
            log(f"[{clock() - t0:5.0f}s] d{d} {kind} {mask} {tuple(cfg)}: {entry.get('ms', entry.get('error', entry.get('skipped')))}")
            flush()
        del q, k, v, fn, want
    flush()
    return data


def table_rows(data: dict) -> dict:
    """The winners as :data:`configs.CONFIGS` rows (bf16/fp16: dtype bytes 2)."""
    rows = {}
    for r in data.get("results", []):
        if r.get("best"):
            d, kind, mask = r["target"]
            rows[(data["arch"], d, 2, kind, mask)] = Config(*r["best"]["config"])
    return rows


def report(data: Optional[dict]) -> list[str]:
    """Markdown: one line per target (default and winner with their times, candidates timed and
    failed), then the rows to paste into ``configs.py``; "unmeasured" where nothing was timed."""
    if not data:
        return ["Autotune: unmeasured (the step did not run or wrote nothing)."]
    dry = data.get("dry_run")
    lines = [f"Architecture `{data['arch']}`, bf16, {data.get('seconds', 0):.0f} s"
             + (" — **dry run on CPU: times mean nothing, nothing measured**" if dry else ""), "",
             "| head dim | kernel | mask | current entry | ms | best | ms | speed-up | timed | failed |",
             "|---:|---|---|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    skipped: set[str] = set()
    for r in data.get("results", []):
        d, kind, mask = r["target"]
        cur = next((c for c in r["candidates"] if c["config"] == r["default"]), None)
        best = r.get("best")
        cur_ms = cur.get("ms") if cur else None
        fmt = lambda x: "unmeasured" if x is None or dry else f"{x:.3f}"  # noqa: E731
        speed = f"{cur_ms / best['ms']:.2f}×" if best and cur_ms and not dry else "—"
        timed = sum("ms" in c for c in r["candidates"])
        failed = sum("error" in c for c in r["candidates"])
        skipped |= {c["skipped"] for c in r["candidates"] if "skipped" in c}
        lines.append(f"| {d} | {kind} | {mask} | {tuple(r['default'])} | {fmt(cur_ms)} | {tuple(best['config']) if best else '—'} | "
                     f"{fmt(best['ms'] if best else None)} | {speed} | {timed} | {failed} |")  # fmt: skip
    for d, kind, mask in data.get("unmeasured", []):
        lines.append(f"| {d} | {kind} | {mask} | — | unmeasured | — | unmeasured | — | 0 | 0 |")
    errors = [f"`{tuple(c['config'])}` d{r['target'][0]} {r['target'][1]}: {c['error']}"
              for r in data.get("results", []) for c in r["candidates"] if "error" in c]  # fmt: skip
    errors += [f"d{r['target'][0]} {r['target'][1]} {r['target'][2]}: {r['error']}" for r in data.get("results", []) if r.get("error")]
    if errors:
        lines += ["", "Failed: " + "; ".join(errors)]
    if skipped:
        lines += ["", "Warp-specialised candidates " + "; ".join(sorted(skipped)) + "."]
    rows = table_rows(data)
    if rows and not dry:
        lines += ["", "Rows for `qkv/backends/triton/configs.py` (`CONFIGS`):", "", "```python", configs.render(rows), "```"]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=60.0, help="seconds (default 60)")
    ap.add_argument("--out", type=Path, required=True, help="JSON with every timing (rewritten after every candidate)")
    ap.add_argument("--kinds", help=f"only these kernels, comma-separated, of {','.join(configs.KINDS)}")
    ap.add_argument("--dry-run", action="store_true", help="the interpreter on a CPU: tiny shapes, nothing measured")
    args = ap.parse_args(argv)
    kinds = None if not args.kinds else tuple(k.strip() for k in args.kinds.split(","))
    if kinds is not None and set(kinds) - set(configs.KINDS):
        ap.error(f"--kinds {args.kinds}: choose from {', '.join(configs.KINDS)}")
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device (use --dry-run with TRITON_INTERPRET=1 on a CPU)", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(data: dict) -> None:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(args.out)  # a reader never sees half a file

    data = tune(args.budget, args.dry_run, kinds=kinds, save=save)
    print("\n".join(report(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
