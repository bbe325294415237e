"""``python -m tests.fuzz``: run the fuzz cases outside pytest, or replay one.

    python -m tests.fuzz                      # the CI amount (QKV_FUZZ_CASES, default 3000)
    python -m tests.fuzz --long               # 20,000 calls + 200 triton calls, 2 processes
    python -m tests.fuzz --seed S --case I    # replay case I ("I" or "tI") of seed S, verbosely

Prints a progress line, then the summary of :func:`.report.summary`. Exits 1 if any call failed.
The triton slice runs on the test device of tests/device.py: the GPU when there is one,
else Triton's CPU interpreter (``QKV_TEST_DEVICE`` chooses).
"""

from __future__ import annotations

from ..device import DEVICE  # noqa: I001  (before triton is imported: it sets TRITON_INTERPRET)

import argparse
import os
import sys

from .runner import quiet, run_many, triton_available

CI_CASES, CI_TRITON = 3000, 16
LONG_CASES, LONG_TRITON = 20_000, 200


def replay(seed: int, case: str) -> int:
    """Run one case and print everything about it."""
    import torch

    from .calls import build, draw
    from .judge import judge

    quiet()
    spec = draw(seed, case)
    print(f"case {case} of seed {seed}: {spec.describe()}\n")
    print(spec, "\n")
    inputs = build(spec)
    for name, base in inputs.base.items():
        view = inputs.view(name, base)
        print(f"  {name:4s} {tuple(view.shape)} {str(view.dtype)[6:]} strides {view.stride()} (base {tuple(base.shape)})")
    if inputs.causal_bias is not None:
        print(f"  mask {inputs.causal_bias!r}")
    print("  torch", torch.__version__)
    res = judge(spec)
    print()
    for line in res.log:
        print("  " + line.replace("\n", "\n  "))
    print(f"\n{res.status.upper()} in {res.seconds:.2f} s" + (f": refused ({'; '.join(res.refusal)})" if res.refusal else ""))
    for f in res.findings:
        print(f"  {f.kind} [{f.backend}]: {f.detail}")
    print(f"reproduce: {res.repro}")
    return 1 if res.status == "failed" else 0


def main(argv: list[str] | None = None) -> int:
    from .report import CASES_ENV, base_seed, summary

    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description="Fuzz qkv.attention against the float64 oracle.")
    p.add_argument("--long", action="store_true", help=f"{LONG_CASES} calls and {LONG_TRITON} triton calls")
    p.add_argument("--seed", type=int, help="base seed (default: $QKV_FUZZ_SEED, else fresh)")
    p.add_argument("--case", help="replay one case verbosely (an index, or tI for the triton slice)")
    p.add_argument("--cases", type=int, help=f"main-stream calls (default: ${CASES_ENV} or {CI_CASES}; --long: {LONG_CASES})")
    p.add_argument("--triton-cases", type=int, help=f"triton calls (default {CI_TRITON}; --long: {LONG_TRITON}; 0 to skip)")
    p.add_argument("--processes", type=int, default=2, help="worker processes (default 2)")
    args = p.parse_args(argv)

    seed = args.seed if args.seed is not None else base_seed()
    if args.case is not None:
        return replay(seed, args.case)
    n = args.cases if args.cases is not None else (LONG_CASES if args.long else int(os.environ.get(CASES_ENV, CI_CASES)))
    nt = args.triton_cases if args.triton_cases is not None else (LONG_TRITON if args.long else CI_TRITON)
    if nt and not triton_available():
        print("[fuzz] triton is not importable: skipping the triton slice", file=sys.stderr)
        nt = 0
    cases = [str(i) for i in range(n)] + [f"t{i}" for i in range(nt)]
    print(f"[fuzz] base seed {seed}: {n} calls + {nt} triton calls (on {DEVICE}) on {args.processes} process(es)", file=sys.stderr)
    results, seconds = run_many(seed, cases, args.processes)
    results.sort(key=lambda r: (r.case.startswith("t"), int(r.case.lstrip("t"))))
    print(summary(results, seed=seed, seconds=seconds, processes=args.processes))
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
