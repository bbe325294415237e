"""The ``qkv experiments`` subcommand: ``list``, ``run NAME|all [--quick] --out DIR``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..experiments import EXPERIMENTS, get, run_many
from .args import UsageError, int_at_least, output_dir


def add_parser(sub: Any) -> None:
    """Add ``experiments`` to the ``qkv`` command's subparsers."""
    p = sub.add_parser(
        "experiments",
        help="run the experiments that test claims about self-attention",
        description="Each experiment measures one claim (the √d_k scaling, causal masking, cost against "
        "sequence length, cross-attention, parallelism, path length, head roles, tied query/key projections, "
        "block-sparse and linear attention) and writes PNG figures, a CSV and a report section "
        "whose verdict is computed from the numbers.",
    )
    ex = p.add_subparsers(dest="experiments_command", metavar="{list,run}")
    ex.required = True
    lp = ex.add_parser("list", help="list the experiments and their claims")
    lp.set_defaults(run=_cmd_list)
    rp = ex.add_parser("run", help="run one experiment, or all of them, and write a report")
    rp.add_argument("name", choices=EXPERIMENTS + ["all"], metavar="NAME",
                    help=f"one of {', '.join(EXPERIMENTS)}, or all")
    rp.add_argument("--out", metavar="DIR", type=output_dir, required=True,
                    help="folder for figures, CSVs, report.md and report.html")
    rp.add_argument("--quick", action="store_true", help="small settings: seconds per experiment")
    # NumPy's legacy seeding (used by some experiments) takes 0 .. 2**32 - 1
    rp.add_argument("--seed", type=int_at_least(0, 2**32 - 1), default=0, help="random seed, 0 to 2**32-1 (default 0)")
    rp.set_defaults(run=_cmd_run)


def _cmd_list(args: argparse.Namespace) -> int:
    for name in EXPERIMENTS:
        m = get(name)
        print(f"{name:16} {m.TITLE}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    names = EXPERIMENTS if args.name == "all" else [args.name]
    out = Path(args.out)
    t0 = time.perf_counter()
    try:
        out.mkdir(parents=True, exist_ok=True)  # before the first experiment, not after it
        results = run_many(names, out, quick=args.quick, seed=args.seed,
                           progress=lambda n: print(f"running {n}…", file=sys.stderr))
    except OSError as e:
        if e.filename is None:  # not about a file: a bug to report, with its traceback
            raise
        raise UsageError(f"cannot write to --out {args.out}: {e.strerror or e} ({e.filename})") from None
    for r in results:
        if r.held and r.not_shown:  # says what the full run would add, so it does not read as a failure
            print(f"{r.name:16} {'not shown':12} ({r.seconds:.1f} s)  {r.verdict}; the parts tested held. {r.result}")
        else:
            print(f"{r.name:16} {r.verdict:12} ({r.seconds:.1f} s)  {r.result}")
    print(f"report: {out / 'report.md'} and {out / 'report.html'} ({time.perf_counter() - t0:.0f} s)")
    return 0 if all(r.held for r in results) else 1  # "not shown in quick mode" is not a failure
