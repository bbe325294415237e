"""The GPU check: one command for a short, rare GPU window (``make gpu-check``).

    python bench/gpu_check.py                     # on the GPU host: tests, benchmark, report (≤ 8 min)
    python bench/gpu_check.py --budget 300        # a shorter window
    python bench/gpu_check.py --dry-run --out-dir /tmp/gc   # on a CPU: every step, nothing measured

It runs with the interpreter it is started with and qkv from this source tree (the GPU host
has no network: nothing is installed, no venv is made), in steps that each get a slice of the
budget:

1. **The kernels' tests on CUDA**: ``pytest -m device`` with ``QKV_TEST_DEVICE=cuda`` over
   :data:`KERNEL_TESTS` — the triton kernels' own tests, the statistics and varlen kernels and
   the fuzz slice of triton calls — judged by the same float64 oracle and tolerance rule as on
   the CPU (tests/device.py). They must finish.
2. **Benchmark**: ``bench/attention_gpu.py --quick --order size`` (head dim 64 and 128, N 1k–16k,
   causal and not, forward / backward / forward+backward, a sliding window and GQA; SDPA's
   flash and cuDNN kernels and compiled FlexAttention in the same run). It flushes its report
   after every cell, so a cut run still leaves one.
3. **FlashAttention's ported suite on the triton backend** (:data:`PORTED_TESTS`), on what is
   left; a cut there is reported, and what ran is judged.
4. **Report**: ``<out-dir>/attention_gpu_<device>.md/.json`` (the benchmark) and
   ``<out-dir>/gpu_check_<device>.md`` (the summary: verdict, test counts and failures, one
   line per benchmark case with qkv's TFLOP/s against the device's matmul ceiling and the best
   peer, the kernel configurations), printed too. Logs and JUnit XML go to ``--log-dir``.

Exit status: 0 when no test failed and every qkv benchmark output was finite and within the
tolerance rule; 1 when anything was wrong, or the kernels' tests ran out of time; 2 when there
is no GPU (without ``--dry-run``). ``--dry-run`` runs the same steps on a CPU: the tests are
collected, not run (the main suite runs them through the interpreter), and the benchmark runs
its tiny CPU grid; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_gpu  # noqa: E402  (the benchmark script beside this one)
from attention_gpu import fmt_num  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "attention_gpu.py"
IMPLS = "qkv,sdpa-flash,sdpa-cudnn,flex"  # the peers that matter on a Hopper GPU
# The files holding the tests marked ``device`` (tests/test_gpu_check.py checks that none is
# missing). Only these are collected, so a test module that needs what the GPU host lacks (a
# browser, say) cannot stop the check. The kernels' own tests must finish; FlashAttention's
# ported suite (hundreds of shapes, each a Triton compile) runs last, on what is left.
KERNEL_TESTS = (
    "tests/backends/test_triton.py",
    "tests/backends/test_triton_score_mods.py",
    "tests/backends/test_triton_tiles.py",
    "tests/inspect/test_stats_triton.py",
    "tests/inspect/test_score_mods_inspect.py",
    "tests/test_varlen.py",
    "tests/test_finite_limits.py",
    "tests/test_nonfinite_rule.py",
    "tests/fuzz/test_fuzz.py",
)
PORTED_TESTS = ("tests/test_flash_attn_port.py",)
DEVICE_TESTS = KERNEL_TESTS + PORTED_TESTS
DRY_IMPLS = "qkv,sdpa-flash,sdpa-math"


def slug(name: str) -> str:
    """A file-name piece for a device name: "NVIDIA H100 80GB HBM3" → "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


@dataclass
class Environment:
    device: str
    cuda: bool
    versions: dict[str, str]


def environment(dry_run: bool) -> Environment:
    import numpy
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001 — reported, the tests will say more
        triton_version = f"not importable ({type(e).__name__})"
    cuda = torch.cuda.is_available() and not dry_run
    if cuda:
        p = torch.cuda.get_device_properties(0)
        device = f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
    else:
        device = "CPU dry run"
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": triton_version,
        "numpy": numpy.__version__,
        "git": attention_gpu.git_rev(),
    }
    return Environment(device, cuda, versions)


# ---- step 1 and 3: the tests on CUDA ------------------------------------------------------


@dataclass
class TestResult:
    name: str = "tests"
    seconds: float = 0.0
    timed_out: bool = False
    returncode: Optional[int] = None
    counts: dict[str, int] = field(default_factory=dict)  # tests, failed, errors, skipped, passed
    failures: list[str] = field(default_factory=list)  # "test id: first line of the message"
    required: bool = True  # False: a budget cut leaves the step incomplete, not failed
    collect_only: bool = False  # a dry run (where the optional step may have nothing to collect)
    tail: str = ""

    @property
    def wrong(self) -> Optional[str]:
        """What went wrong, or None."""
        c = self.counts
        if c.get("failed") or c.get("errors"):
            return f"{self.name}: {c.get('failed', 0)} failed, {c.get('errors', 0)} errors"
        if self.timed_out:
            return None if not self.required else f"{self.name}: ran out of time after {c.get('tests', 0)} tests"
        if not c.get("tests"):  # (a dry run collects no triton case of the ported suite: fine)
            return None if self.collect_only and not self.required else f"{self.name}: none ran (exit {self.returncode})"
        if self.returncode != 0:
            return f"{self.name}: pytest exited {self.returncode}"
        return None

    def line(self) -> str:
        counts = ", ".join(f"{k} {n}" for k, n in self.counts.items()) or "no results"
        cut = " — **cut at its time budget** (the rest not run)" if self.timed_out else ""
        return f"{counts} in {self.seconds:.0f} s" + (" (collected, not run)" if self.collect_only else "") + cut


def step_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_step(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[Optional[int], bool, str, float]:
    """(returncode, timed_out, output tail, seconds). The output is echoed and kept in ``log``.
    At the deadline the command gets SIGINT (pytest then stops and still writes its JUnit XML;
    the benchmark writes its partial report), its whole process group SIGTERM 20 s later and
    SIGKILL 10 s after that."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)  # fmt: skip
    expired = threading.Event()

    def stop() -> None:
        expired.set()
        try:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):  # whatever is left of the group
            deadline = time.monotonic() + grace
            try:
                os.killpg(proc.pid, sig)
                while time.monotonic() < deadline:
                    time.sleep(0.1)
                    os.killpg(proc.pid, 0)  # raises once the group is gone
            except ProcessLookupError:
                return

    timer = threading.Timer(timeout, stop)
    timer.start()
    try:
        with open(log, "w") as fh:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                fh.write(line)
        proc.wait()
    finally:
        timer.cancel()
    tail = log.read_text()[-4000:]
    return (None if expired.is_set() else proc.returncode), expired.is_set(), tail, time.monotonic() - t0


def parse_junit(path: Path) -> tuple[dict[str, int], list[str]]:
    """Counts and failing tests from pytest's JUnit XML."""
    if not path.exists():
        return {}, []
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            for tag, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
                el = case.find(tag)
                if el is not None:
                    counts[key] += 1
                    if key != "skipped":
                        msg = (el.get("message") or el.text or "").strip().splitlines()
                        name = f"{case.get('classname', '')}::{case.get('name', '')}"
                        failures.append(f"{name}: {msg[0][:200] if msg else tag}")
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts, failures


def run_tests(args: argparse.Namespace, name: str, paths: tuple[str, ...], timeout: float, required: bool) -> TestResult:
    """``pytest -m device`` over ``paths`` on CUDA (collected only on a dry run)."""
    junit = args.log_dir / f"gpu_check_{slug(name)}.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "device", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE",
           f"--junitxml={junit}", *paths]  # fmt: skip
    if args.workers > 1 and not args.dry_run:
        cmd[3:3] = ["-n", str(args.workers)]
    extra = {"QKV_TEST_DEVICE": "cpu" if args.dry_run else "cuda"}
    if args.dry_run:
        cmd.append("--collect-only")  # the main suite runs them through the interpreter
    print(f"\n== {name}: {' '.join(cmd[1:])} (QKV_TEST_DEVICE={extra['QKV_TEST_DEVICE']}, ≤ {timeout:.0f} s)", flush=True)
    rc, timed_out, tail, seconds = run_step(cmd, step_env(extra), max(timeout, 1.0), args.log_dir / f"gpu_check_{slug(name)}.log")
    res = TestResult(name=name, seconds=seconds, timed_out=timed_out, returncode=rc, required=required, collect_only=args.dry_run, tail=tail)
    if args.dry_run:
        m = re.search(r"(\d+)(?:/\d+)? tests? collected", tail)
        res.counts = {"tests": int(m.group(1)) if m else 0}
    else:
        res.counts, res.failures = parse_junit(junit)
    return res


# ---- step 2: the benchmark ----------------------------------------------------------------


@dataclass
class BenchResult:
    seconds: float = 0.0
    timed_out: bool = False
    returncode: Optional[int] = None
    data: dict = field(default_factory=dict)
    tail: str = ""

    @property
    def wrong(self) -> list[str]:
        """qkv cells with NaN or outside the tolerance rule."""
        out = []
        for c in self.data.get("cases", []):
            r = c["results"].get("qkv")
            if r and r["status"] == "nan":
                out.append(f"{c['id']}: {r['reason']}")
            elif r and r["status"] == "ok" and not r["check"]["ok"]:
                out.append(f"{c['id']}: max error {r['check']['err']:.3e} > bound {r['check']['bound']:.3e}")
        return out

    @property
    def problems(self) -> list[str]:
        out = [f"benchmark: qkv wrong on {w}" for w in self.wrong]
        if not self.data.get("cases"):
            out.append(f"benchmark: no results (exit {self.returncode}{', timed out' if self.timed_out else ''})")
        elif self.returncode not in (0, None):  # None: cut at the deadline, its partial report stands
            out.append(f"benchmark exited {self.returncode}")
        return out


def run_bench(args: argparse.Namespace, out: Path, seconds: float) -> BenchResult:
    cmd = [sys.executable, str(BENCH), "--quick", "--order", "size", "--out", str(out), "--max-seconds", f"{max(seconds - 15, 1):.0f}"]
    if args.dry_run:
        cmd += ["--dry-run", "--qkv-backend", "chunked", "--impls", DRY_IMPLS]
    else:
        cmd += ["--impls", IMPLS]
    print(f"\n== benchmark: {' '.join(cmd[1:])} (≤ {seconds:.0f} s)", flush=True)
    rc, timed_out, tail, secs = run_step(cmd, step_env({}), max(seconds, 1.0) + 30, args.log_dir / "gpu_check_bench.log")
    res = BenchResult(seconds=secs, timed_out=timed_out, returncode=rc, tail=tail)
    js = out.with_suffix(".json")
    if js.exists():
        res.data = json.loads(js.read_text())
    return res


# ---- step 3: the summary ------------------------------------------------------------------


def _best_peer(results: dict, mode: str) -> tuple[Optional[str], Optional[float]]:
    timed = [(t, name) for name, r in results.items() if name != "qkv" and (t := attention_gpu.cell_tflops(r, mode)) is not None]
    if not timed:
        return None, None
    t, name = max(timed)
    return name, t


def bench_lines(data: dict) -> list[str]:
    """One row per case: qkv's forward and forward+backward TFLOP/s, % of the matmul ceiling,
    the best peer and the ratio, and the correctness check."""
    if not data.get("cases"):
        return ["(no benchmark results)"]
    runs = data["runs"]
    ce = runs[0].get("ceilings") or {}
    lines = []
    if ce:
        lines.append(f"Ceilings: bf16 matmul {fmt_num(ce['matmul_tflops'])} TFLOP/s, copy {fmt_num(ce['copy_gbps'])} GB/s.")
        lines.append("")
    lines += ["| case | qkv fwd | best peer fwd | qkv ÷ peer | qkv fwd+bwd | best peer fwd+bwd | qkv ÷ peer | check |",
              "|---|---:|---|---:|---:|---|---:|---|"]  # fmt: skip
    ceiling = ce.get("matmul_tflops") or float("nan")
    for c in data["cases"]:
        res = c["results"]
        q = res.get("qkv")
        cells = [f"`{c['id']}`"]
        for mode in ("fwd", "fwd+bwd"):
            ours = attention_gpu.cell_tflops(q, mode)
            peer, theirs = _best_peer(res, mode)
            cells.append(f"{fmt_num(ours)} ({ours / ceiling:.0%})" if ours is not None else (q or {}).get("status", "—"))
            cells.append(f"{fmt_num(theirs)} {peer}" if theirs is not None else "—")
            cells.append(f"{ours / theirs:.2f}×" if ours is not None and theirs else "—")
        if q and q.get("status") == "ok":
            chk = q["check"]
            cells.append(f"✓ {chk['err']:.1e}" if chk["ok"] else f"✗ {chk['err']:.1e} > {chk['bound']:.1e}")
        else:
            cells.append((q or {}).get("status", "—"))
        lines.append("| " + " | ".join(cells) + " |")
    if data.get("not_run"):
        lines += ["", f"Not run (budget): {', '.join(data['not_run'])}"]
    return lines


def config_lines(data: dict) -> list[str]:
    configs = (data.get("runs") or [{}])[0].get("meta", {}).get("kernel_configs") or {}
    if not configs:
        return []
    out = ["", "Kernel configurations (qkv triton): " + "; ".join(
        f"d{d} {kind} {c['BLOCK_M']}×{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}" for d, kinds in configs.items() for kind, c in kinds.items()
    )]  # fmt: skip
    return out


def summary(env: Environment, tests: list[TestResult], bench: BenchResult, bench_path: Path, dry_run: bool, total: float) -> tuple[str, bool]:
    """The one-screen report and the verdict: True when nothing was wrong (a step cut at its
    budget is reported, and fails the check only when it is a required one)."""
    problems = [w for t in tests if (w := t.wrong)] + bench.problems
    ok = not problems
    v = env.versions
    lines = [
        f"# GPU check — {env.device}",
        "",
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC} · Python {v['python']} · torch {v['torch']} (CUDA {v['cuda']}) · "
        f"triton {v['triton']} · numpy {v['numpy']} · git {v['git']} · {total:.0f} s in all"
        + (" · **dry run on CPU: tests collected, not run; numbers mean nothing**" if dry_run else ""),
        "",
        f"**Verdict: {'PASS' if ok else 'FAIL'}**" + ("" if ok else " — " + "; ".join(problems)),
        "",
        "## Tests on the device (`pytest -m device`, the float64 oracle and the tolerance rule of the CPU suite)",
        "",
    ]
    for t in tests:
        lines.append(f"- **{t.name}**: {t.line()}")
        lines += [f"  - {f}" for f in t.failures[:20]]
        if len(t.failures) > 20:
            lines.append(f"  - … and {len(t.failures) - 20} more")
    lines += ["", f"## Benchmark ({bench.seconds:.0f} s; full tables in `{bench_path.name}`)", "",
              "TFLOP/s, bf16, median of do_bench; in parentheses the share of the measured matmul ceiling.", ""]  # fmt: skip
    lines += bench_lines(bench.data) + config_lines(bench.data)
    return "\n".join(lines) + "\n", ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    # measured on an H100: the kernels' tests ~160 s with the fuzz slice on 14 workers (mostly
    # Triton compiling), the benchmark's quick grid 99 s, the ported suite 123 s
    # 117 s measured at 58b1598 (65 tests), plus an estimate for the score-function tests (a
    # Triton compile per flag combination); 0.45 of the default budget allows 202 s
    ap.add_argument("--kernel-tests-budget", type=float, default=200.0, help="seconds for the kernels' tests (default 200)")
    ap.add_argument("--bench-budget", type=float, default=140.0, help="seconds for the benchmark (default 140); the ported suite gets the rest")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="pytest-xdist workers (Triton compiles on the CPUs)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results", help="where the reports go")
    ap.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "qkv-gpu-check", help="the steps' logs and JUnit XML")
    ap.add_argument("--dry-run", action="store_true", help="CPU: collect the tests, run the benchmark's CPU grid")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    env = environment(args.dry_run)
    if not env.cuda and not args.dry_run:
        print("no CUDA device: run this on the GPU host, or pass --dry-run to check the steps on a CPU", file=sys.stderr)
        return 2
    name = "cpu-dry-run" if args.dry_run else slug(env.device.split(" (")[0])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    left = lambda: args.budget - (time.monotonic() - t0)  # noqa: E731
    print(f"GPU check on {env.device}: {json.dumps(env.versions)}; budget {args.budget:.0f} s", flush=True)
    tests = [run_tests(args, "kernel tests", KERNEL_TESTS, min(args.kernel_tests_budget, 0.45 * left()), required=True)]
    bench_path = args.out_dir / f"attention_gpu_{name}.md"
    bench = run_bench(args, bench_path, min(args.bench_budget, left() - 30))
    tests.append(run_tests(args, "ported FlashAttention suite", PORTED_TESTS, left() - 10, required=False))
    text, ok = summary(env, tests, bench, bench_path, args.dry_run, time.monotonic() - t0)
    (args.out_dir / f"gpu_check_{name}.md").write_text(text)
    print("\n" + text, flush=True)
    print(f"wrote {args.out_dir / f'gpu_check_{name}.md'}, {bench_path} and its .json; logs in {args.log_dir}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
