"""The GPU check: one command for a short, rare GPU window (``make gpu-check``).

    python bench/gpu_check.py                     # on the GPU host: tests, autotune, benchmark, report (≤ 7 min)
    python bench/gpu_check.py --budget 300        # a shorter window
    python bench/gpu_check.py --dry-run --out-dir /tmp/gc   # on a CPU: every step, nothing measured

It runs with the interpreter it is started with and qkv from this source tree (the GPU host
has no network: nothing is installed, no venv is made), in steps that each get a slice of the
budget (:data:`BUDGETS`, from what each step took on an H200, with a margin):

1. **The device tests on CUDA**, one ``pytest -m "device and not heavy"`` run with
   ``QKV_TEST_DEVICE=cuda`` over :data:`KERNEL_TESTS` and :data:`PORTED_TESTS` — the triton
   kernels' own tests, compiled Flex's, the statistics and varlen kernels, the fuzz slice of
   triton calls, and a representative subset of FlashAttention's ported suite (its other triton
   cases are marked ``heavy``) — judged by the same float64 oracle and tolerance rule as on the
   CPU (tests/device.py). They must finish. The report lists the slowest tests, the next run's
   guide to its budget.
2. **Autotune** (:mod:`qkv.backends.triton.autotune`): candidate launch configurations of every
   kernel (forward, both backward kernels, decoding) timed on the device, the winners written
   into the report as rows ready to paste into ``qkv/backends/triton/configs.py`` (its own
   slice, ``--autotune-budget``, shared equally among the kernels; a dry run runs it through the
   interpreter and measures nothing).
3. **Benchmark**: ``bench/attention_gpu.py --quick --order size`` (head dim 64 and 128, N 1k–16k,
   causal and not, forward / backward / forward+backward, a sliding window, GQA, score
   functions and sinks, decoding, ``qkv.inspect``'s statistics in one pass against the forward,
   and the per-call cost outside the kernels; qkv's triton kernels and ``auto`` beside SDPA's
   flash and cuDNN kernels and compiled FlexAttention in the same run). It flushes its report
   after every cell, so a cut run still leaves one.
4. **The heavy device tests** (the rest of the ported suite's triton grid), on what is left; a
   cut there is reported, not a failure, and what ran is judged.
5. **Report**: ``<out-dir>/attention_gpu_<device>.md/.json`` (the benchmark) and
   ``<out-dir>/gpu_check_<device>.md`` (the summary: the correctness verdict, the goals of
   issues 36 and 44 judged cell by cell — PASS, FAIL or "unmeasured" where a cell did not run — test
   counts and failures, one line per benchmark case with qkv's and auto's rates against the
   best peer, the per-call overhead, the kernel configurations and the autotune table),
   printed too. Logs and JUnit XML go to ``--log-dir``.

Exit status: 0 when no test failed and every qkv benchmark output was finite and within the
tolerance rule; 1 when anything was wrong, or the device tests of step 1 ran out of time; 2 when
there is no GPU (without ``--dry-run``). ``--dry-run`` runs the same steps on a CPU: the tests are
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
from attention_gpu import check_text, fmt_num  # noqa: E402
import nonfinite_cost  # noqa: E402  (the non-finite rule's kernels timed per cell)

from qkv.backends.triton import autotune  # noqa: E402  (imports no triton: the report reads its results)

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "attention_gpu.py"
IMPLS = "qkv,auto,qkv-plain,sdpa-flash,sdpa-cudnn,flex"  # qkv (triton), auto, and the peers that matter on a Hopper GPU
# The files holding the tests marked ``device`` (tests/bench/test_gpu_check.py checks that none is
# missing). Only these are collected, so a test module that needs what the GPU host lacks (a
# browser, say) cannot stop the check. The kernels' own tests must finish; FlashAttention's
# ported suite (hundreds of shapes, each a Triton compile) runs last, on what is left.
KERNEL_TESTS = (
    "tests/backends/test_triton.py",
    "tests/backends/test_triton_score_mods.py",
    "tests/backends/test_triton_tiles.py",
    "tests/backends/test_triton_decode.py",
    "tests/backends/test_flex_cuda.py",
    "tests/inspect/test_stats_triton.py",
    "tests/inspect/test_score_mods_inspect.py",
    "tests/test_varlen.py",
    "tests/test_overflow.py",
    "tests/contract/test_edge_calls.py",
    "tests/contract/test_finite_limits.py",
    "tests/contract/test_nonfinite_rule.py",
    "tests/test_nonfinite_device.py",
    "tests/fuzz/test_fuzz.py",
)
PORTED_TESTS = ("tests/ports/test_flash_attn_port.py",)
PORTED_NAME = "ported FlashAttention suite"
KERNEL_NAME = "kernel tests"
HEAVY_NAME = "heavy device tests"
DEVICE_TESTS = KERNEL_TESTS + PORTED_TESTS
# Seconds per step for the default 7-minute budget. Measured on an H200 (main at a621e09, 16
# workers): the kernel tests 127 s, 65 of the ported suite's triton cases 54 s, the autotune
# about 1.3 s per candidate, the benchmark 147 s (every cell; about half of it compiling Flex).
# The device tests of step 1 (the kernel tests, with the decoding kernels' since, and the ported
# suite's representative subset of 46 triton cases, one run) get 185 s, the autotune 50 s (about
# three candidates for each of its ten targets), the benchmark 160 s (it starts no cell in its
# last 15 s); the ~25 s left start the steps and absorb a step's stop (pytest takes up to 20 s to
# wind down at its deadline), or run heavy tests. Each step's time is in the report.
BUDGETS = {"total": 420.0, "tests": 185.0, "autotune": 50.0, "bench": 160.0}
SLOWEST = 8  # tests listed by time in the report
DRY_IMPLS = "qkv,auto,qkv-plain,sdpa-flash,sdpa-math"


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
    slowest: list[tuple[float, str]] = field(default_factory=list)  # (seconds, test id), longest first
    note: str = ""  # what the step covers, for the report
    not_run: str = ""  # why the (optional) step was not started

    @property
    def wrong(self) -> Optional[str]:
        """What went wrong, or None."""
        c = self.counts
        if self.not_run and not self.required:
            return None
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
        if self.not_run:
            return self.not_run + (f" ({self.note})" if self.note else "")
        counts = ", ".join(f"{k} {n}" for k, n in self.counts.items()) or "no results"
        cut = " — **cut at its time budget** (the rest not run)" if self.timed_out else ""
        note = f" ({self.note})" if self.note else ""
        return f"{counts} in {self.seconds:.0f} s" + (" (collected, not run)" if self.collect_only else "") + note + cut

    def slowest_line(self) -> Optional[str]:
        if not self.slowest:
            return None
        return "slowest: " + ", ".join(f"`{name}` {t:.0f} s" for t, name in self.slowest)


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


def _cases(path: Path, module: Optional[str] = None, exclude: tuple[str, ...] = ()) -> list[ET.Element]:
    """The JUnit XML's test cases, those of one test module (a dotted prefix of their class
    name) or of every module but ``exclude``."""
    if not path.exists():
        return []
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))

    def inside(case: ET.Element, mod: str) -> bool:
        name = case.get("classname", "")
        return name == mod or name.startswith(mod + ".")

    cases = [c for suite in suites for c in suite.iter("testcase")]
    if module is not None:
        cases = [c for c in cases if inside(c, module)]
    return [c for c in cases if not any(inside(c, m) for m in exclude)]


def _module(path: str) -> str:
    """``tests/ports/test_x.py`` → ``tests.ports.test_x`` (JUnit's class name prefix)."""
    return path.removesuffix(".py").replace("/", ".")


def slowest(path: Path, n: int = SLOWEST, module: Optional[str] = None, exclude: tuple[str, ...] = ()) -> list[tuple[float, str]]:
    """The ``n`` longest tests of the JUnit XML: ``(seconds, module::name)``, longest first."""
    timed = [(float(c.get("time") or 0), f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name', '')}") for c in _cases(path, module, exclude)]
    return sorted(timed, key=lambda t: -t[0])[:n]


def parse_junit(path: Path, module: Optional[str] = None, exclude: tuple[str, ...] = ()) -> tuple[dict[str, int], list[str]]:
    """Counts and failing tests from pytest's JUnit XML (of one test module, or all but some:
    see :func:`_cases`)."""
    if not path.exists():
        return {}, []
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in _cases(path, module, exclude):
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


@dataclass(frozen=True)
class Group:
    """Tests of one pytest run reported as one step: those of ``modules`` (test file paths), or
    with ``modules`` empty every test the run's other groups do not claim."""

    name: str
    modules: tuple[str, ...] = ()
    required: bool = True
    note: str = ""


def _xdist_args(workers: int) -> list[str]:
    """``-n workers``, and work stealing where pytest-xdist has it (3.2 on): a worker that runs
    out of tests takes some from a busy one, so a long test at the end of a queue does not hold
    up the step while other workers idle."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in re.findall(r"\d+", version("pytest-xdist"))[:2])
    except (PackageNotFoundError, ValueError):
        return ["-n", str(workers)]
    return ["-n", str(workers)] + (["--dist", "worksteal"] if (major, minor) >= (3, 2) else [])


def run_tests(args: argparse.Namespace, name: str, paths: tuple[str, ...], timeout: float, groups: tuple[Group, ...],
              marker: str = "device") -> list[TestResult]:  # fmt: skip
    """One ``pytest -m <marker>`` run over ``paths`` on CUDA (collected only on a dry run), its
    results reported per group."""
    junit = args.log_dir / f"gpu_check_{slug(name)}.xml"
    junit.unlink(missing_ok=True)
    paths = tuple(p for p in paths if (ROOT / p).exists())  # (a tree from before a test file was added)
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE",
           f"--durations={SLOWEST}", f"--junitxml={junit}", *paths]  # fmt: skip
    if args.workers > 1 and not args.dry_run:
        cmd[3:3] = _xdist_args(args.workers)
    extra = {"QKV_TEST_DEVICE": "cpu" if args.dry_run else "cuda"}
    if args.dry_run:
        cmd.append("--collect-only")  # the main suite runs them through the interpreter
    print(f"\n== {name}: {' '.join(cmd[1:])} (QKV_TEST_DEVICE={extra['QKV_TEST_DEVICE']}, ≤ {timeout:.0f} s)", flush=True)
    log = args.log_dir / f"gpu_check_{slug(name)}.log"
    rc, timed_out, tail, seconds = run_step(cmd, step_env(extra), max(timeout, 1.0), log)
    claimed = tuple(_module(m) for g in groups for m in g.modules)
    out = []
    for g in groups:
        res = TestResult(name=g.name, seconds=seconds, timed_out=timed_out, returncode=rc, required=g.required,
                         collect_only=args.dry_run, tail=tail, note=g.note)  # fmt: skip
        mods = tuple(_module(m) for m in g.modules)
        if args.dry_run:  # collect-only prints one node id per line
            ids = [ln.split("::")[0] for ln in log.read_text().splitlines() if "::" in ln and not ln.startswith(" ")]
            mine = [i for i in ids if (_module(i) in mods if mods else _module(i) not in claimed)]
            res.counts = {"tests": len(mine)}
        else:
            picks = [(m, ()) for m in mods] if mods else [(None, claimed)]
            for module, exclude in picks:
                counts, failures = parse_junit(junit, module, exclude)
                for k, n in counts.items():
                    res.counts[k] = res.counts.get(k, 0) + n
                res.failures += failures
                res.slowest += slowest(junit, SLOWEST, module, exclude)
            res.slowest = sorted(res.slowest, key=lambda t: -t[0])[:SLOWEST]
            if rc == 1 and not (res.counts.get("failed") or res.counts.get("errors")):
                res.returncode = 0  # pytest's "some test failed" belongs to the group that holds it
        out.append(res)
    return out


# ---- step 2: the benchmark ----------------------------------------------------------------


@dataclass
class StepResult:
    """What a step that runs a script in its own process left: its time, exit and JSON report."""

    seconds: float = 0.0
    timed_out: bool = False
    returncode: Optional[int] = None
    data: dict = field(default_factory=dict)


@dataclass
class BenchResult(StepResult):
    tail: str = ""

    @property
    def wrong(self) -> list[str]:
        """qkv cells with NaN or outside the tolerance rule."""
        out = []
        for c in self.data.get("cases", []):
            for name in attention_gpu.OURS:
                r = c["results"].get(name)
                tag = "" if name == "qkv" else f" ({name})"
                if r and r["status"] == "nan":
                    out.append(f"{c['id']}{tag}: {r['reason']}")
                elif r and r["status"] == "ok" and not r["check"]["ok"]:
                    out.append(f"{c['id']}{tag}: max error {r['check']['err']:.3e} > bound {r['check']['bound']:.3e}")
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


# ---- step 2b: the autotune -----------------------------------------------------------------


class TuneResult(StepResult):
    """The autotune step's result (its JSON: the timed configurations and the winners)."""


def run_autotune(args: argparse.Namespace, seconds: float) -> TuneResult:
    """``python -m qkv.backends.triton.autotune`` in its own process and time slice (the
    interpreter on a dry run). A failure here is reported, not a failed check: it measures
    speed, not correctness."""
    out = args.log_dir / "gpu_check_autotune.json"
    out.unlink(missing_ok=True)
    # ~8 s of the slice start the process (torch, triton); the JSON is rewritten after every
    # candidate, so a cut or a crash keeps what was timed
    cmd = [sys.executable, "-m", "qkv.backends.triton.autotune", "--budget", f"{max(seconds - 10, 1):.0f}", "--out", str(out)]
    extra = {}
    if args.dry_run:
        cmd.append("--dry-run")
        extra["TRITON_INTERPRET"] = "1"
    print(f"\n== autotune: {' '.join(cmd[1:])} (≤ {seconds:.0f} s)", flush=True)
    rc, timed_out, _, secs = run_step(cmd, step_env(extra), max(seconds, 1.0) + 20, args.log_dir / "gpu_check_autotune.log")
    res = TuneResult(seconds=secs, timed_out=timed_out, returncode=rc)
    if out.exists():
        res.data = json.loads(out.read_text())
    return res


# ---- step 3: the summary ------------------------------------------------------------------


def _best_peer(results: dict, mode: str) -> tuple[Optional[str], Optional[float]]:
    timed = [(t, name) for name, r in results.items() if name not in attention_gpu.OURS and (t := attention_gpu.cell_tflops(r, mode)) is not None]
    if not timed:
        return None, None
    t, name = max(timed)
    return name, t


def _rate(res: Optional[dict], mode: str, decode: bool) -> Optional[float]:
    """TFLOP/s (GB/s of K and V for decoding) of one result, or None."""
    return attention_gpu._gbps(res) if decode else attention_gpu.cell_tflops(res, mode)


def _best(results: dict, mode: str, decode: bool, names=None) -> tuple[Optional[str], Optional[float]]:
    timed = [(t, n) for n, r in results.items() if n not in attention_gpu.OURS and (names is None or n in names)
             and (t := _rate(r, mode, decode)) is not None]  # fmt: skip
    return (max(timed)[1], max(timed)[0]) if timed else (None, None)


def bench_lines(data: dict) -> list[str]:
    """One row per case: qkv's and auto's forward and forward+backward TFLOP/s (GB/s for
    decoding), % of the matmul ceiling, the best peer and the ratios, and the correctness check."""
    if not data.get("cases"):
        return ["(no benchmark results)"]
    runs = data["runs"]
    ce = runs[0].get("ceilings") or {}
    lines = []
    if ce:
        lines.append(f"Ceilings: bf16 matmul {fmt_num(ce['matmul_tflops'])} TFLOP/s, copy {fmt_num(ce['copy_gbps'])} GB/s.")
        lines.append("")
    lines += ["| case | qkv fwd | auto fwd | best peer fwd | qkv ÷ peer | auto ÷ peer | qkv fwd+bwd | auto fwd+bwd | best peer fwd+bwd | qkv ÷ peer | auto ÷ peer | check |",
              "|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---|"]  # fmt: skip
    ceiling = ce.get("matmul_tflops") or float("nan")
    for c in data["cases"]:
        if c.get("kind") == "stats":
            continue
        res = c["results"]
        q = res.get("qkv")
        decode = c.get("kind") == "decode"
        cells = [f"`{c['id']}`"]
        for mode in ("fwd", "fwd+bwd"):
            if decode and mode != "fwd":
                cells += ["—"] * 5
                continue
            peer, theirs = _best(res, mode, decode)
            for name in ("qkv", "auto"):
                t = _rate(res.get(name), mode, decode)
                if t is None:
                    cells.append((res.get(name) or {}).get("status", "—"))
                else:
                    cells.append(f"{fmt_num(t)} GB/s" if decode else f"{fmt_num(t)} ({t / ceiling:.0%})")
            cells.append((f"{fmt_num(theirs)} GB/s {peer}" if decode else f"{fmt_num(theirs)} {peer}") if theirs is not None else "—")
            for name in ("qkv", "auto"):
                t = _rate(res.get(name), mode, decode)
                cells.append(f"{t / theirs:.2f}×" if t is not None and theirs else "—")
        if q and q.get("status") == "ok":
            chk = q["check"]
            cells.append(f"✓ {chk['err']:.1e}" if chk["ok"] else f"✗ {chk['err']:.1e} > {chk['bound']:.1e}")
        else:
            cells.append((q or {}).get("status", "—"))
        lines.append("| " + " | ".join(cells) + " |")
    stats = [c for c in data["cases"] if c.get("kind") == "stats"]
    if stats:
        lines += ["", "`qkv.inspect.attention_stats` in one pass against the plain forward, same inputs:", ""]
        for c in stats:
            fwd, st, r = attention_gpu._ms(c["results"].get("qkv-plain")), attention_gpu._ms(c["results"].get("qkv")), attention_gpu.stats_ratio(c)
            shown = f"{st:.3g} ms against {fwd:.3g} ms: {r:.2f}×" if r is not None else "unmeasured"
            lines.append(f"- `{c['id']}`: {shown} ({check_text(c['results'].get('qkv'))})")
    if data.get("not_run"):
        lines += ["", f"Not run (budget): {', '.join(data['not_run'])}"]
    return lines


# ---- the goals of issues 36 and 44, cell by cell -----------------------------------------------

FLEX_KINDS = ("dense", "window", "gqa", "score")  # where compiled FlexAttention runs (no sinks)
OVERHEAD_US = 50.0
DECODE_GBPS = 4000.0  # issue 44: at memory speed, K and V counted once (an H200 copies at ~4.2 TB/s)
AUTO = 0.95  # auto against the best peer
AUTO_SHORT = 0.85  # ... on forward cells below N = 4096, where a call's fixed costs weigh most (issue 44)


@dataclass
class Goal:
    goal: str
    cell: str
    value: str
    target: str
    verdict: str  # PASS, FAIL or unmeasured


def _judge(value: Optional[float], ok: Optional[bool], dry_run: bool) -> str:
    if value is None or ok is None or dry_run:
        return "unmeasured"
    return "PASS" if ok else "FAIL"


def goals(data: dict, ported: Optional[TestResult], dry_run: bool) -> list[Goal]:
    """Every goal of the issue on every benchmark cell it names: PASS, FAIL, or "unmeasured"
    (the cell did not run, a peer had no time, or a dry run, whose numbers mean nothing)."""
    out: list[Goal] = []

    def add(goal, cell, value, target, ok, shown=None):
        text = "—" if value is None or dry_run else (shown or f"{value:.2f}×")  # a dry run's numbers are not shown as results
        out.append(Goal(goal, cell, text, target, _judge(value, ok, dry_run)))

    for c in data.get("cases", []):
        res, cid, kind = c["results"], c["id"], c.get("kind", "dense")
        if kind == "stats":  # no peer: the statistics against qkv's own forward
            r = attention_gpu.stats_ratio(c)
            add("statistics in one pass ≤ 1.0× the forward", cid, r, "≤ 1.00×", None if r is None else r <= 1.0)
            continue
        decode = kind == "decode"
        for mode in ("fwd",) if decode else ("fwd", "fwd+bwd"):
            _, best = _best(res, mode, decode)
            auto = _rate(res.get("auto"), mode, decode)
            r = auto / best if auto is not None and best else None
            if c.get("score") != "sinks":  # no other engine has sinks: no peer to compare with
                want = AUTO_SHORT if mode == "fwd" and 0 < c.get("n", 0) < 4096 and not decode else AUTO
                add(f"auto ≥ {want:.2f}× the best peer", f"{cid} {mode}", r, f"≥ {want:.2f}×", None if r is None else r >= want)
            if kind in FLEX_KINDS and c.get("score") != "sinks":
                ours, flex = _rate(res.get("qkv"), mode, decode), _rate(res.get("flex"), mode, decode)
                r = ours / flex if ours is not None and flex else None
                add("qkv triton ≥ 1.0× compiled Flex", f"{cid} {mode}", r, "≥ 1.0×", None if r is None else r >= 1.0)
        if kind == "dense" and c.get("n", 0) >= 4096:
            ours, cudnn = _rate(res.get("qkv"), "fwd", False), _rate(res.get("sdpa-cudnn"), "fwd", False)
            r = ours / cudnn if ours is not None and cudnn else None
            add("dense forward ≥ 0.75× cuDNN (N ≥ 4096)", f"{cid} fwd", r, "≥ 0.75×", None if r is None else r >= 0.75)
        if c.get("score") == "sinks":
            for mode in ("fwd", "fwd+bwd"):
                ours, plain = _rate(res.get("qkv"), mode, False), _rate(res.get("qkv-plain"), mode, False)
                r = plain / ours if ours and plain else None  # time with sinks ÷ time without
                add("sinks cost ≤ 1.1× the call without", f"{cid} {mode}", r, "≤ 1.10×", None if r is None else r <= 1.1)
        if decode:
            g = _gbps(res.get("qkv"))
            add(f"decoding ≥ {DECODE_GBPS / 1000:g} TB/s", cid, g, f"≥ {DECODE_GBPS:.0f} GB/s", None if g is None else g >= DECODE_GBPS,
                f"{g:.0f} GB/s" if g else None)  # fmt: skip
    for cid in data.get("not_run", []):
        out.append(Goal("every goal of the cell", cid, "—", "—", "unmeasured"))
    ov = data.get("overhead") or {}
    for key, what in (("overhead_us", "wrapper − bare launch"), ("fixed_us", f"2·causal − full, N = {ov.get('n', 1024)}")):
        v = ov.get(key)
        add("per-call cost outside the kernels ≤ 50 µs", what, v, "≤ 50 µs", None if v is None else v <= OVERHEAD_US,
            f"{v:.1f} µs" if v is not None else None)  # fmt: skip
    if ported is not None:
        ran = not ported.timed_out and not ported.wrong and bool(ported.counts.get("tests"))
        out.append(Goal("the ported FlashAttention suite runs to the end", "tests/ports/test_flash_attn_port.py",
                        "—" if dry_run else ported.line(), "all pass",
                        "unmeasured" if dry_run or ported.timed_out else ("PASS" if ran else "FAIL")))  # fmt: skip
    return out


def _gbps(res):
    return attention_gpu._gbps(res)


def goal_lines(rows: list[Goal]) -> tuple[list[str], str]:
    """The goals table and its verdict: PASS when every cell passed, FAIL when one failed,
    else INCOMPLETE (what is unmeasured)."""
    fails = sum(r.verdict == "FAIL" for r in rows)
    unmeasured = sum(r.verdict == "unmeasured" for r in rows)
    verdict = "FAIL" if fails else "INCOMPLETE" if unmeasured or not rows else "PASS"
    head = f"**Goals: {verdict}** — {sum(r.verdict == 'PASS' for r in rows)} pass, {fails} fail, {unmeasured} unmeasured"
    lines = [head, "", "| goal | cell | value | target | verdict |", "|---|---|---:|---|---|"]
    lines += [f"| {r.goal} | `{r.cell}` | {r.value} | {r.target} | {r.verdict} |" for r in rows]
    return lines, verdict


def config_lines(data: dict) -> list[str]:
    configs = (data.get("runs") or [{}])[0].get("meta", {}).get("kernel_configs") or {}
    if not configs:
        return []
    out = ["", "Kernel configurations (qkv triton): " + "; ".join(
        f"d{d} {kind} {c['BLOCK_M']}×{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}" for d, kinds in configs.items() for kind, c in kinds.items()
    )]  # fmt: skip
    return out


def summary(env: Environment, tests: list[TestResult], bench: BenchResult, bench_path: Path, dry_run: bool, total: float,
            tune: Optional["TuneResult"] = None) -> tuple[str, bool]:  # fmt: skip
    """The one-screen report and the verdict: True when nothing was wrong (a step cut at its
    budget is reported, and fails the check only when it is a required one). The goals of issue
    36 are judged cell by cell beside it (:func:`goals`); they do not change the exit status."""
    problems = [w for t in tests if (w := t.wrong)] + bench.problems
    ok = not problems
    ported = next((t for t in tests if t.name == PORTED_NAME), None)
    goal_rows, _ = goal_lines(goals(bench.data, ported, dry_run))
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
        "## Goals (issues 36 and 44: H100/H200, bf16, the benchmark's cells, peers measured in the same run)",
        "",
        *goal_rows,
        "",
        "## Tests on the device (`pytest -m device`, the float64 oracle and the tolerance rule of the CPU suite)",
        "",
    ]
    for t in tests:
        lines.append(f"- **{t.name}**: {t.line()}")
        if t.slowest_line():
            lines.append(f"  - {t.slowest_line()}")
        lines += [f"  - {f}" for f in t.failures[:20]]
        if len(t.failures) > 20:
            lines.append(f"  - … and {len(t.failures) - 20} more")
    lines += ["", f"## Benchmark ({bench.seconds:.0f} s; full tables in `{bench_path.name}`)", "",
              "TFLOP/s, bf16, median of do_bench; in parentheses the share of the measured matmul ceiling.", ""]  # fmt: skip
    lines += bench_lines(bench.data) + config_lines(bench.data)
    lines += attention_gpu.render_overhead((bench.data or {}).get("overhead") or {})
    lines += ["", f"## Autotune of the launch table ({tune.seconds:.0f} s)" if tune else "## Autotune of the launch table", ""]
    lines += autotune.report(tune.data if tune else None)
    if tune and tune.timed_out:
        lines += ["", "(cut at its time budget)"]
    return "\n".join(lines) + "\n", ok


RULE_COST_SECONDS = 20.0  # the non-finite rule's kernels against SDPA's, per cell (bench/nonfinite_cost.py)
MIN_HEAVY_SECONDS = 30.0  # less than this left: the heavy tests are not started (xdist alone takes ~15 s to start)
HEAVY_NOTE = "the ported suite's other triton cases, on the time left"


def step_slices(total: float, tests: Optional[float], tune: Optional[float], bench: Optional[float]) -> dict[str, float]:
    """Seconds for each step: the given ones, else :data:`BUDGETS` shrunk in proportion to a
    total below the default."""
    scale = min(1.0, total / BUDGETS["total"])
    given = {"tests": tests, "autotune": tune, "bench": bench}
    return {k: float(v) if v is not None else round(BUDGETS[k] * scale, 1) for k, v in given.items()}


def quick_groups(dry_run: bool) -> tuple[Group, ...]:
    """Step 1's groups: the kernel tests, and the ported suite's subset (required on a GPU; a
    CPU collects none of its triton cases)."""
    return (Group(KERNEL_NAME),
            Group(PORTED_NAME, PORTED_TESTS, required=not dry_run, note="its representative subset; the other triton cases are the heavy tests"))  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=BUDGETS["total"], help=f"seconds for the whole check (default {BUDGETS['total']:.0f}); "
                    "a smaller one shrinks every step's default slice in proportion")  # fmt: skip
    ap.add_argument("--kernel-tests-budget", type=float, help=f"seconds for the device tests of step 1 (default {BUDGETS['tests']:.0f})")
    ap.add_argument("--autotune-budget", type=float, help=f"seconds for the launch table's autotune (default {BUDGETS['autotune']:.0f})")
    # breadth first (--order size), so a cut drops the largest cells
    ap.add_argument("--bench-budget", type=float, help=f"seconds for the benchmark (default {BUDGETS['bench']:.0f}); the heavy tests get the rest")
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
    slices = step_slices(args.budget, args.kernel_tests_budget, args.autotune_budget, args.bench_budget)
    print(f"GPU check on {env.device}: {json.dumps(env.versions)}; budget {args.budget:.0f} s, slices {json.dumps(slices)}", flush=True)
    tests = run_tests(args, "device tests", DEVICE_TESTS, min(slices["tests"], left() - slices["autotune"] - slices["bench"]), quick_groups(args.dry_run),
                      marker="device and not heavy")  # fmt: skip
    tune = run_autotune(args, min(slices["autotune"], max(left() - slices["bench"], 10)))
    bench_path = args.out_dir / f"attention_gpu_{name}.md"
    bench = run_bench(args, bench_path, min(slices["bench"], left() - 5))
    rule_cost = None if args.dry_run else nonfinite_cost.time_rule(min(RULE_COST_SECONDS, max(left() - 15, 0)))
    rest = left() - 10
    if rest >= MIN_HEAVY_SECONDS:
        tests += run_tests(args, HEAVY_NAME, PORTED_TESTS, rest, (Group(HEAVY_NAME, required=False, note=HEAVY_NOTE),), marker="device and heavy")
    else:
        tests.append(TestResult(name=HEAVY_NAME, required=False, note=HEAVY_NOTE, not_run=f"not run: {max(rest, 0):.0f} s left"))
    text, ok = summary(env, tests, bench, bench_path, args.dry_run, time.monotonic() - t0, tune)
    text += "\n".join(nonfinite_cost.render(rule_cost)) + "\n"
    (args.out_dir / f"gpu_check_{name}.md").write_text(text)
    print("\n" + text, flush=True)
    print(f"wrote {args.out_dir / f'gpu_check_{name}.md'}, {bench_path} and its .json; logs in {args.log_dir}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
