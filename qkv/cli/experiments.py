"""The ``qkv experiments`` subcommand: ``list``, ``run NAME|all [--quick] --out DIR``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..experiments import EXPERIMENTS, get, run_many
from ..experiments.judge import FAILED, HELD, NOT_SHOWN
from ..locale import LANGUAGES, text
from .args import UsageError, int_at_least, output_dir


def add_parser(sub: Any) -> None:
    """Add ``experiments`` to the ``qkv`` command's subparsers."""
    p = sub.add_parser(
        "experiments",
        help="run the experiments that test claims about self-attention",
        description="Each experiment measures one claim (the √d_k scaling, causal masking, cost against "
        "sequence length, cross-attention, parallelism, path length, head roles, tied query/key projections, "
        "block-sparse and linear attention) and writes PNG figures, a CSV and a report section "
        "whose verdict is computed from the numbers: held, not shown (a quick run too small for a part, or a "
        "timed effect within this machine's noise, with the numbers), or DID NOT HOLD (a measurement that "
        "contradicts the claim beyond its noise). The exit status is 0 when every experiment ran, whatever "
        "the verdicts.",
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
    rp.add_argument("--lang", choices=LANGUAGES, default="en",
                    help="language of the verdicts, the report's frame and this command's lines (default en; "
                    "each experiment's claim, setup and result are written in English)")
    rp.set_defaults(run=_cmd_run)


def _cmd_list(args: argparse.Namespace) -> int:
    for name in EXPERIMENTS:
        m = get(name)
        print(f"{name:16} {m.TITLE}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """Run the experiments and print one line each. The exit status says whether every experiment
    ran (0), not what it found: a verdict depends on the claim and, for timings, on the machine."""
    names = EXPERIMENTS if args.name == "all" else [args.name]
    out = Path(args.out)
    lang = args.lang
    t0 = time.perf_counter()
    try:
        out.mkdir(parents=True, exist_ok=True)  # before the first experiment, not after it
        results = run_many(names, out, quick=args.quick, seed=args.seed, lang=lang,
                           progress=lambda n: print(text("experiments.cli.running", lang, name=n), file=sys.stderr))
    except OSError as e:
        if e.filename is None:  # not about a file: a bug to report, with its traceback
            raise
        raise UsageError(f"cannot write to --out {args.out}: {e.strerror or e} ({e.filename})") from None
    state_words = {HELD: text("experiments.verdict.held", lang), NOT_SHOWN: text("experiments.verdict.not_shown", lang),
                   FAILED: text("experiments.verdict.failed", lang)}
    for r in results:
        detail = ""
        if r.state == NOT_SHOWN:  # says what was not shown and why, so it does not read as a failure
            detail = f"{r.verdict_in(lang)}; {text('experiments.cli.parts_held', lang)} "
        print(f"{r.name:16} {state_words[r.state]:12} ({r.seconds:.1f} s)  {detail}{r.result}")
    counts = {state: sum(r.state == state for r in results) for state in (HELD, NOT_SHOWN, FAILED)}
    print(text("experiments.cli.summary", lang, held=counts[HELD], not_shown=counts[NOT_SHOWN], failed=counts[FAILED]))
    print(text("experiments.cli.report", lang, md=out / "report.md", html=out / "report.html",
               seconds=f"{time.perf_counter() - t0:.0f}"))
    return 0
