"""The GPU check (``make gpu-check``, ``bench/gpu_check.py``) and the device selection of the
tests, on a CPU: everything but the GPU itself is exercised here, so that a GPU window is spent
measuring. ``--dry-run`` runs every step with the CPU standing in."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from .. import device
from ..helpers import BENCH, SUBPROCESS_TIMEOUT, load_bench_script

check = load_bench_script("gpu_check")
ROOT = BENCH.parent


# ---- which device the tests run on ----------------------------------------------------------


def _never() -> bool:
    raise AssertionError("asked whether CUDA is there although the answer cannot depend on it")


@pytest.mark.parametrize(
    "env,cuda,want",
    [
        ({}, True, "cuda"),
        ({}, False, "cpu"),
        ({"QKV_TEST_DEVICE": "auto"}, True, "cuda"),
        ({"QKV_TEST_DEVICE": " CUDA "}, True, "cuda"),
        ({"QKV_TEST_DEVICE": "cpu"}, None, "cpu"),  # None: must not even ask
        ({"TRITON_INTERPRET": "1"}, None, "cpu"),  # the interpreter asked for explicitly
        ({"TRITON_INTERPRET": "0"}, True, "cuda"),
        ({"TRITON_INTERPRET": ""}, False, "cpu"),
    ],
)
def test_device_choice(env, cuda, want):
    assert device.choose(env, _never if cuda is None else (lambda: cuda)) == want


def test_device_choice_refuses_what_cannot_be_honoured():
    with pytest.raises(RuntimeError, match="QKV_TEST_DEVICE=cuda but torch sees no CUDA device"):
        device.choose({"QKV_TEST_DEVICE": "cuda"}, lambda: False)
    with pytest.raises(ValueError, match="unset TRITON_INTERPRET"):
        device.choose({"QKV_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "1"}, lambda: True)
    with pytest.raises(ValueError, match="choose one of auto, cpu, cuda"):
        device.choose({"QKV_TEST_DEVICE": "gpu"}, lambda: True)


def test_configure_sets_the_interpreter_to_match(monkeypatch):
    env = {"QKV_TEST_DEVICE": "cpu"}
    assert device.configure(env) == "cpu" and env["TRITON_INTERPRET"] == "1"
    monkeypatch.setattr(device, "_torch_sees_cuda", lambda: True)
    env = {"TRITON_INTERPRET": "0"}
    assert device.configure(env) == "cuda" and "TRITON_INTERPRET" not in env


def test_this_run_uses_the_interpreter_without_a_gpu():
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine")
    assert device.DEVICE == "cpu" and device.INTERPRETED and os.environ["TRITON_INTERPRET"] == "1"


def _device_test_files() -> set[str]:
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "device", "-p", "no:cacheprovider", "-o", "addopts=", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, env={**__import__("os").environ, "QKV_TEST_DEVICE": "cpu"},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return {line.split("::")[0] for line in res.stdout.splitlines() if "::" in line}


@pytest.mark.slow
def test_the_check_collects_every_device_test():
    files = _device_test_files()
    assert files, "no test is marked device"
    assert files <= set(check.DEVICE_TESTS), f"add {sorted(files - set(check.DEVICE_TESTS))} to DEVICE_TESTS in bench/gpu_check.py"


# ---- the check, end to end on a CPU ---------------------------------------------------------


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    res = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--workers", "1", "--out-dir", str(out / "results"), "--log-dir", str(out / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )  # fmt: skip
    print(res.stdout[-3000:], res.stderr[-3000:])
    return res, out


@pytest.mark.slow
def test_dry_run_passes_and_writes_the_reports(dry_run):
    res, out = dry_run
    assert res.returncode == 0, res.stderr[-3000:]
    summary = (out / "results" / "gpu_check_cpu-dry-run.md").read_text()
    assert "**Verdict: PASS**" in summary and "dry run on CPU" in summary
    m = re.search(r"kernel tests\*\*: tests (\d+) in \d+ s \(collected, not run\)", summary)
    assert m and int(m.group(1)) > 40, summary
    assert "ported FlashAttention suite**: tests 0 " in summary  # on a CPU its triton cases do not exist
    data = json.loads((out / "results" / "attention_gpu_cpu-dry-run.json").read_text())
    ids = [c["id"] for c in data["cases"]]
    sizes = [c["nq"] or c["n"] for c in data["cases"]]
    assert ids and sizes == sorted(sizes)  # --order size
    for c in data["cases"]:
        assert f"`{c['id']}`" in summary
    assert "| case | qkv fwd | auto fwd |" in summary and "✓" in summary and "✗" not in summary
    assert "**Goals: INCOMPLETE** — 0 pass, 0 fail" in summary  # a dry run measures nothing
    assert "## Autotune of the launch table" in summary and "dry run on CPU: times mean nothing" in summary
    assert "--order size" in data["runs"][0]["meta"]["command"]
    assert (out / "logs" / "gpu_check_bench.log").exists() and (out / "logs" / "gpu_check_device-tests.log").exists()
    assert "- **heavy device tests**: " in summary and "stats-d64-n64-causal" in summary  # the check's last step; the statistics cell


def test_without_a_gpu_the_real_check_refuses(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine")
    assert check.main(["--out-dir", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())


# ---- verdicts ------------------------------------------------------------------------------


def _bench_data(check_ok=True, status="ok"):
    mode = {"status": "ok", "ms": 1.0, "tflops": 400.0}
    qkv = {"status": status, "reason": "NaN or inf in the output"} if status != "ok" else {
        "status": "ok", "check": {"ok": check_ok, "err": 1e-3 if check_ok else 0.5, "bound": 8e-3, "base_err": 2e-3},
        "modes": {m: dict(mode) for m in ("fwd", "bwd", "fwd+bwd")}}  # fmt: skip
    peer = {"status": "ok", "check": {"ok": True, "err": 1e-3, "bound": 8e-3, "base_err": 2e-3},
            "modes": {m: dict(mode, tflops=500.0) for m in ("fwd", "bwd", "fwd+bwd")}}  # fmt: skip
    return {
        "runs": [{"meta": {"kernel_configs": {"64": {"fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}}}},
                  "ceilings": {"matmul_tflops": 800.0, "copy_gbps": 3000.0}}],
        "cases": [{"id": "dense-d64-n1024-full", "results": {"qkv": qkv, "sdpa-flash": peer}}],
        "not_run": ["dense-d64-n16384-full"],
    }  # fmt: skip


ENV = check.Environment("NVIDIA H100 80GB HBM3 (132 SMs, 79 GiB)", True, dict(python="3.12", torch="2.11", cuda="13.0", triton="3.6", numpy="2.5", git="abc"))


def _tests(**kw):
    return check.TestResult(**{"name": "kernel tests", "returncode": 0, "counts": {"tests": 10, "passed": 10}, **kw})


def test_summary_reads_the_results():
    tests = [_tests(seconds=50, counts={"tests": 10, "passed": 9, "skipped": 1}), _tests(name="ported", required=False, timed_out=True, returncode=None)]
    text, ok = check.summary(ENV, tests, check.BenchResult(returncode=0, data=_bench_data()), Path("a.md"), False, 300)
    print(text)
    assert ok and "**Verdict: PASS**" in text
    assert "| `dense-d64-n1024-full` | 400 (50%) | — | 500 sdpa-flash | 0.80× | — |" in text
    assert "Not run (budget): dense-d64-n16384-full" in text and "d64 fwd 128×64 w4 s3" in text
    assert "- **kernel tests**: tests 10, passed 9, skipped 1 in 50 s" in text
    assert "- **ported**: tests 10, passed 10 in 0 s — **cut at its time budget**" in text


@pytest.mark.parametrize(
    "tests_kw,bench_kw,problem",
    [
        ({"returncode": 1, "counts": {"tests": 3, "failed": 1}, "failures": ["t::x: boom"]}, {}, "kernel tests: 1 failed, 0 errors"),
        ({"timed_out": True, "returncode": None}, {}, "kernel tests: ran out of time after 10 tests"),
        ({"timed_out": True, "required": False, "counts": {"tests": 3, "errors": 1}}, {}, "kernel tests: 0 failed, 1 errors"),
        ({"counts": {"tests": 0}}, {}, "kernel tests: none ran (exit 0)"),
        ({"returncode": 4}, {}, "kernel tests: pytest exited 4"),
        ({}, {"data": _bench_data(check_ok=False)}, "qkv wrong on dense-d64-n1024-full: max error 5.000e-01"),
        ({}, {"data": _bench_data(status="nan")}, "qkv wrong on dense-d64-n1024-full: NaN"),
        ({}, {"data": {}, "returncode": 1}, "benchmark: no results (exit 1)"),
        ({}, {"returncode": 1}, "benchmark exited 1"),
    ],
)
def test_summary_fails_on_anything_wrong(tests_kw, bench_kw, problem):
    bench = check.BenchResult(**{"returncode": 0, "data": _bench_data(), **bench_kw})
    text, ok = check.summary(ENV, [_tests(**tests_kw)], bench, Path("a.md"), False, 300)
    assert not ok and "**Verdict: FAIL**" in text and problem in text, text


def test_junit_counts_and_failures(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="4">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="tests.b" name="test_err"><error message="fixture broke"/></testcase>'
        '<testcase classname="tests.b" name="test_skip"><skipped message="needs a GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts, failures = check.parse_junit(xml)
    assert counts == {"tests": 4, "failed": 1, "errors": 1, "skipped": 1, "passed": 1}
    assert failures == ["tests.a::test_bad: assert 1 == 2", "tests.b::test_err: fixture broke"]
    assert check.parse_junit(tmp_path / "missing.xml") == ({}, [])


def test_a_step_past_its_deadline_is_stopped_with_its_children(tmp_path):
    """SIGINT to the step (the benchmark saves its report on it), then SIGTERM and SIGKILL to its
    whole process group: the step and the child it started, both sleeping for an hour, are gone
    when run_step returns. Nothing here depends on how fast a busy machine starts them."""
    pids = tmp_path / "pids"
    script = ("import os, subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)']); "
              f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); print('started', flush=True); time.sleep(3600)")  # fmt: skip
    rc, timed_out, tail, _ = check.run_step([sys.executable, "-c", script], check.step_env({}), 3.0, tmp_path / "log")
    assert timed_out and rc is None
    if pids.exists():  # the step got as far as starting its child before the deadline
        assert "started" in tail
        for pid in map(int, pids.read_text().split()):
            assert _ends(pid), f"process {pid} outlived its step"
    rc, timed_out, tail, _ = check.run_step([sys.executable, "-c", "print('hi')"], check.step_env({}), 3600.0, tmp_path / "log")
    assert rc == 0 and not timed_out and tail == "hi\n"


def _ends(pid: int, patience_s: float = 600.0) -> bool:
    """Does ``pid`` end (gone, or a zombie awaiting its parent's wait)? A killed process closes
    its pipes a moment before it is gone, so this waits for the end, up to a limit that only
    bounds a failure."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.02)
    return False


def test_device_names_make_file_names():
    assert check.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert check.slug("NVIDIA H200") == "nvidia-h200"
    assert check.slug("???") == "device"


def _cell(kind, cid, n=4096, score=None, **rates):
    """A benchmark case whose implementations ran at these TFLOP/s (fwd and fwd+bwd alike);
    a decoding cell's rates are GB/s."""
    res = {}
    for name, rate in rates.items():
        mode = {"status": "ok", "ms": 1.0, "tflops": rate}
        if kind == "decode":
            mode["gbps"] = rate
        modes = {"fwd": mode} if kind == "decode" else {m: dict(mode) for m in ("fwd", "bwd", "fwd+bwd")}
        res[name.replace("_", "-")] = {"status": "ok", "check": {"ok": True, "err": 0, "bound": 1, "base_err": 0}, "modes": modes}
    return {"id": cid, "kind": kind, "n": n, "nq": 1 if kind == "decode" else 0, "score": score, "results": res}


def test_goals_are_judged_cell_by_cell():
    data = {
        "cases": [
            _cell("dense", "dense-d128-n4096-full", qkv=600, auto=700, sdpa_cudnn=700, flex=500),
            _cell("window", "window1024-d128-n4096", qkv=300, auto=280, flex=310),
            _cell("score", "sinks-d128-n4096-causal", score="sinks", qkv=100, qkv_plain=105, auto=100),
            _cell("decode", "decode-q1-kv8192-32x8-d128", qkv=4100, auto=4100, sdpa_flash=4400),
            _cell("dense", "dense-d128-n1024-causal", n=1024, qkv=100, auto=90, sdpa_cudnn=100),
            _cell("stats", "stats-d128-n4096-causal", qkv=1, qkv_plain=1),
        ],
        "not_run": ["dense-d128-n16384-full"],
        "overhead": {"overhead_us": 30.0, "fixed_us": 80.0, "n": 1024},
    }
    rows = {(g.goal, g.cell): g for g in check.goals(data, None, dry_run=False)}
    v = lambda goal, cell: rows[goal, cell].verdict  # noqa: E731
    assert v("auto ≥ 0.95× the best peer", "dense-d128-n4096-full fwd") == "PASS"
    assert v("qkv triton ≥ 1.0× compiled Flex", "dense-d128-n4096-full fwd") == "PASS"  # 600 ≥ 500
    assert v("dense forward ≥ 0.75× cuDNN (N ≥ 4096)", "dense-d128-n4096-full fwd") == "PASS"  # 0.86×
    assert v("qkv triton ≥ 1.0× compiled Flex", "window1024-d128-n4096 fwd") == "FAIL"  # 300 < 310
    assert v("auto ≥ 0.95× the best peer", "window1024-d128-n4096 fwd+bwd") == "FAIL"  # 280 / 310 = 0.90
    assert v("sinks cost ≤ 1.1× the call without", "sinks-d128-n4096-causal fwd") == "PASS"  # 1.05×
    assert ("auto ≥ 0.95× the best peer", "sinks-d128-n4096-causal fwd") not in rows  # no other engine has sinks
    assert v("decoding ≥ 4 TB/s", "decode-q1-kv8192-32x8-d128") == "PASS"
    assert v("auto ≥ 0.95× the best peer", "decode-q1-kv8192-32x8-d128 fwd") == "FAIL"  # 4100 / 4400 GB/s = 0.93
    assert v("auto ≥ 0.85× the best peer", "dense-d128-n1024-causal fwd") == "PASS"  # 0.90: short cells' forward
    assert v("auto ≥ 0.95× the best peer", "dense-d128-n1024-causal fwd+bwd") == "FAIL"
    assert v("statistics in one pass ≤ 1.0× the forward", "stats-d128-n4096-causal") == "PASS"  # equal times
    assert not any(cell.startswith("stats-") for goal, cell in rows if goal != "statistics in one pass ≤ 1.0× the forward")
    assert v("every goal of the cell", "dense-d128-n16384-full") == "unmeasured"
    assert v("per-call cost outside the kernels ≤ 50 µs", "wrapper − bare launch") == "PASS"
    assert v("per-call cost outside the kernels ≤ 50 µs", "2·causal − full, N = 1024") == "FAIL"
    lines, verdict = check.goal_lines(list(rows.values()))
    assert verdict == "FAIL" and lines[0].startswith("**Goals: FAIL**")
    assert check.goal_lines([check.Goal("g", "c", "1", "t", "PASS")])[1] == "PASS"
    assert check.goal_lines([check.Goal("g", "c", "1", "t", "PASS"), check.Goal("g", "d", "—", "t", "unmeasured")])[1] == "INCOMPLETE"
    assert all(g.verdict == "unmeasured" and g.value == "—" for g in check.goals(data, None, dry_run=True))


# ---- the budget and the split of the device tests ---------------------------------------------------


def test_step_slices_fit_seven_minutes_and_shrink_with_the_budget():
    full = check.step_slices(check.BUDGETS["total"], None, None, None)
    assert check.BUDGETS["total"] <= 7 * 60 and sum(full.values()) <= check.BUDGETS["total"] - 20  # a margin for starting steps
    half = check.step_slices(check.BUDGETS["total"] / 2, None, None, None)
    assert all(half[k] == pytest.approx(full[k] / 2, abs=0.1) for k in full)
    assert check.step_slices(100, 30, None, 50) == {"tests": 30.0, "autotune": round(check.BUDGETS["autotune"] * 100 / 420, 1), "bench": 50.0}
    assert check.step_slices(10_000, None, None, None) == full  # a longer window keeps the measured slices


def _junit(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="5">'
        '<testcase classname="tests.backends.test_triton" name="test_a" time="3.5"/>'
        '<testcase classname="tests.backends.test_triton" name="test_b" time="40.0"><failure message="boom"/></testcase>'
        '<testcase classname="tests.fuzz.test_fuzz" name="test_fuzz_triton[t0-t3]" time="12"/>'
        '<testcase classname="tests.ports.test_flash_attn_port" name="test_flash_attn_output[triton-x]" time="9"/>'
        '<testcase classname="tests.ports.test_flash_attn_port" name="test_flash_attn_causal[triton-y]" time="1"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    return xml


def test_one_run_is_reported_per_group(tmp_path):
    xml = _junit(tmp_path)
    ported = (check._module(check.PORTED_TESTS[0]),)
    assert check._module("tests/ports/test_flash_attn_port.py") == "tests.ports.test_flash_attn_port"
    counts, failures = check.parse_junit(xml, exclude=ported)
    assert counts == {"tests": 3, "failed": 1, "errors": 0, "skipped": 0, "passed": 2} and failures == ["tests.backends.test_triton::test_b: boom"]
    counts, failures = check.parse_junit(xml, ported[0])
    assert counts == {"tests": 2, "failed": 0, "errors": 0, "skipped": 1, "passed": 1} and not failures
    assert check.slowest(xml, 2, exclude=ported) == [(40.0, "test_triton::test_b"), (12.0, "test_fuzz::test_fuzz_triton[t0-t3]")]
    res = check.TestResult(name="kernel tests", seconds=50, returncode=1, counts=counts, slowest=check.slowest(xml, 1))
    assert res.slowest_line() == "slowest: `test_triton::test_b` 40 s"
    text, ok = check.summary(ENV, [res], check.BenchResult(returncode=0, data=_bench_data()), Path("a.md"), False, 300)
    assert "  - slowest: `test_triton::test_b` 40 s" in text


def test_the_run_splits_into_groups(tmp_path, monkeypatch):
    """run_tests: one pytest command with the marker, its JUnit XML read per group (a group with
    no modules takes what the others do not claim)."""
    seen = {}

    def fake_step(cmd, env, timeout, log):
        seen["cmd"] = cmd
        junit = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
        Path(junit).write_text(_junit(tmp_path).read_text())
        log.write_text("")
        return 1, False, "", 12.0

    monkeypatch.setattr(check, "run_step", fake_step)
    args = SimpleNamespace(log_dir=tmp_path, workers=4, dry_run=False)
    groups = check.quick_groups(dry_run=False)
    kernel, ported = check.run_tests(args, "device tests", check.DEVICE_TESTS, 100, groups, marker="device and not heavy")
    assert seen["cmd"][seen["cmd"].index("-m", 2) + 1] == "device and not heavy" and "-n" in seen["cmd"]
    assert "--durations=8" in seen["cmd"] and all(p in seen["cmd"] for p in check.DEVICE_TESTS)
    assert kernel.name == "kernel tests" and kernel.counts["tests"] == 3 and kernel.wrong == "kernel tests: 1 failed, 0 errors"
    assert ported.name == check.PORTED_NAME and ported.counts["tests"] == 2 and ported.wrong is None and ported.required
    assert "representative subset" in ported.line()


def test_work_stealing_where_xdist_has_it(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.6.1")
    assert check._xdist_args(16) == ["-n", "16", "--dist", "worksteal"]
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.1.0")
    assert check._xdist_args(16) == ["-n", "16"]


def test_heavy_tests_not_started_are_reported_not_failed():
    t = check.TestResult(name=check.HEAVY_NAME, required=False, note=check.HEAVY_NOTE, not_run="not run: 12 s left")
    assert t.wrong is None and t.line().startswith("not run: 12 s left (the ported suite's other triton cases")


def test_the_ported_grid_keeps_a_representative_subset_quick():
    """Every DEVICE_SUBSET-th triton case of each ported test stays in the check's first step, the
    rest are marked heavy; the CPU backends' cases are never heavy."""
    from ..ports import test_flash_attn_port as port

    full = {"backend": ["auto", "triton"], "dtype": port.DTYPES, "causal": [False, True], "local": port.LOCAL, "mha_type": port.MHA_TYPES}
    names, params = port._grid(full, {"d": port.OUTPUT_D})  # test_flash_attn_output's axes
    heavy = lambda p: any(m.name == "heavy" for m in p.marks)  # noqa: E731
    triton = [p for p in params if p.values[0] == "triton"]
    quick = [p for p in triton if not heavy(p)]
    assert not any(heavy(p) for p in params if p.values[0] == "auto")
    assert len(triton) == 72 and len(quick) == -(-len(triton) // port.DEVICE_SUBSET)
    for axis in range(1, 6):  # every full axis takes more than one value in the subset
        assert len({p.values[axis] for p in quick}) > 1, names.split(",")[axis]
