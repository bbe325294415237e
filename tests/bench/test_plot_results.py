"""The benchmark plots of the documentation (``bench/plot_results.py``): drawn from the committed
JSON, one line per engine, and every one of them shown on the benchmarks page."""

from __future__ import annotations

import re

import pytest

from ..helpers import BENCH, load_bench_script

pytest.importorskip("matplotlib")
plots = load_bench_script("plot_results")
ROOT = BENCH.parent


def _case(d, n, causal, **tflops):
    res = {name.replace("_", "-"): {"status": "ok", "modes": {m: {"status": "ok", "tflops": t} for m in ("fwd", "fwd+bwd")}}
           for name, t in tflops.items()}  # fmt: skip
    return {"kind": "dense", "d": d, "n": n, "causal": causal, "results": res}


def test_series_are_one_line_per_engine_against_n():
    data = {"cases": [_case(64, 4096, False, qkv=2, sdpa_cudnn=4), _case(64, 1024, False, qkv=1, sdpa_cudnn=3),
                      _case(64, 1024, True, qkv=0.5), {"kind": "decode", "results": {}}]}  # fmt: skip
    data["cases"][0]["results"]["flex"] = {"status": "error", "reason": "no"}  # a refused cell draws no point
    s = plots.gpu_series(data)
    assert s[64, "fwd", False, "qkv"] == [(1024, 1), (4096, 2)] and s[64, "fwd+bwd", False, "sdpa-cudnn"] == [(1024, 3), (4096, 4)]
    assert s[64, "fwd", True, "qkv"] == [(1024, 0.5)] and not any(k[3] == "flex" for k in s)


def test_every_committed_result_is_drawn_and_shown_on_the_benchmarks_page(tmp_path):
    written = plots.plot_all(ROOT / "bench" / "results", tmp_path)
    names = {p.name for p in written}
    gpu = {p.stem.replace("attention_gpu_", "bench_gpu_") + ".png" for p in (ROOT / "bench" / "results").glob("attention_gpu_*.json")}
    assert gpu <= names and "bench_cpu.png" in names
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    shown = set(re.findall(r"\]\(images/(bench_[^)]+\.png)\)", page))
    assert names == shown, f"drawn but not shown: {names - shown}; shown but not drawn: {shown - names}"
    missing = [n for n in shown if not (ROOT / "docs" / "images" / n).exists()]
    assert not missing, f"run python bench/plot_results.py to draw {missing}"
