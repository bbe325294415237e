"""The GPU benchmark script's logic, on CPU: FLOP counting, case generation, masks, guards and
the report. `bench/attention_gpu.py --dry-run` runs the whole script with tiny shapes, with
qkv's chunked backend standing in for triton; nothing here measures anything."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings

import pytest
import torch

import qkv

from ..helpers import BENCH, SUBPROCESS_TIMEOUT, load_bench_script

SCRIPT = BENCH / "attention_gpu.py"
bench = load_bench_script("attention_gpu")


def tables(md: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(nearest heading above, header cells, body rows) of every Markdown table."""
    out, heading, lines = [], "", md.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("| ") and i + 1 < len(lines) and "---" in lines[i + 1]:
            header = [c.strip() for c in line.strip("|").split("|")]
            i += 2
            rows = []
            while i < len(lines) and lines[i].startswith("| "):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            out.append((heading, header, rows))
            continue
        i += 1
    return out


# ---- FLOPs --------------------------------------------------------------------------------


def test_flops_follow_the_documented_formula():
    b, h, n, d = 1, 16, 16384, 128
    f = bench.attention_flops(b, h, n, d)
    assert f["fwd"] == 4 * b * h * n * n * d
    assert f["bwd"] == 2.5 * f["fwd"]
    assert f["fwd+bwd"] == 3.5 * f["fwd"]
    c = bench.attention_flops(b, h, n, d, causal=True)
    assert c["fwd"] == f["fwd"] / 2 and c["bwd"] == 2.5 * c["fwd"] and c["fwd+bwd"] == 3.5 * c["fwd"]
    # the FlashAttention grid keeps the work per call constant in N at fixed tokens: B·N = 16384
    assert bench.attention_flops(32, 16, 512, 128)["fwd"] * 32 == f["fwd"]
    case = bench.Case("gqa", 2, 32, 8, 4096, 128, True)
    assert case.flops()["fwd"] == 4 * 2 * 32 * 4096 * 4096 * 128 / 2  # query heads count, not kv heads


@pytest.mark.parametrize("n,w", [(1, 0), (5, 0), (7, 3), (64, 16), (64, 63), (64, 200), (100, 99)])
def test_window_pairs_are_the_exact_band_count(n, w):
    i = torch.arange(n)
    diff = i[:, None] - i[None, :]
    assert bench.attended_pairs(n, True, w) == int(((diff >= 0) & (diff <= w)).sum())
    case = bench.Case("window", 1, 1, 1, n, 8, True, w)
    assert bool((bench.dense_mask(case, "cpu") == ((diff >= 0) & (diff <= w))).all())


# ---- cases --------------------------------------------------------------------------------


def test_full_grid_is_the_flashattention_grid():
    cases = bench.build_cases(bench.GRIDS["full"])
    dense = [c for c in cases if c.kind == "dense"]
    assert len(dense) == 6 * 3 * 2
    for c in dense:
        assert c.batch * c.n == 16384 and c.hq * c.d == 2048 and c.hkv == c.hq
    assert {c.n for c in dense} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {(c.hq, c.hkv) for c in cases if c.kind == "gqa"} == {(32, 8), (32, 4)}
    assert {c.window for c in cases if c.kind == "window"} == {256, 1024}
    assert all(c.causal and c.d == 128 for c in cases if c.kind not in ("dense", "decode"))
    assert {c.score for c in cases if c.kind == "score"} == {"softcap", "alibi", "t5", "sinks"}
    dec = [c for c in cases if c.kind == "decode"]
    assert dec and all(c.nq <= 8 and c.n >= 8192 and not c.causal and c.modes == ("fwd",) for c in dec)
    stats = [c for c in cases if c.kind == "stats"]
    assert [c.id for c in stats] == ["stats-d128-n4096-causal", "stats-d128-n16384-causal"]
    assert all(c.modes == ("fwd",) and c.batch * c.n == 16384 for c in stats)
    assert len({c.id for c in cases}) == len(cases)


def test_filters_split_the_grid():
    grid = bench.GRIDS["full"]
    sel = bench.build_cases(grid, headdims=[128], seqlens=[2048, 4096], kinds=["dense"])
    assert [c.id for c in sel] == [f"dense-d128-n{n}-{t}" for n in (2048, 4096) for t in ("full", "causal")]
    assert bench.build_cases(grid, headdims=[64], kinds=["window", "gqa"]) == []  # the extras are head dim 128
    extras = bench.build_cases(grid, kinds=["window", "gqa"], seqlens=[8192])
    assert len(extras) == 4 and all(c.n == 8192 for c in extras)
    assert [c.id for c in bench.build_cases(grid, only="d256-n16384-causal")] == ["dense-d256-n16384-causal"]
    every = {c.id for c in bench.build_cases(grid)}  # the documented chunks cover the grid once
    chunks = [bench.build_cases(grid, headdims=[d], kinds=["dense"]) for d in (64, 128, 256)]
    chunks.append(bench.build_cases(grid, kinds=["window", "gqa", "score", "decode", "stats"]))
    assert sorted(c.id for ch in chunks for c in ch) == sorted(every)


def test_flex_mask_means_what_qkv_window_means():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    case = bench.Case("window", 1, 2, 2, 96, 16, True, 20)
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    block_mask = create_block_mask(bench.flex_mask_mod(case), None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": eager flex is what we want here
        flex = flex_attention(q, k, v, block_mask=block_mask)  # CPU forward without grad
    ours = qkv.attention(q, k, v, window=(20, 0), backend="math")
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bench.dense_mask(case, "cpu"))
    torch.testing.assert_close(flex, ours, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sdpa, ours, atol=1e-5, rtol=1e-5)
    assert bench.flex_mask_mod(bench.Case("dense", 1, 1, 1, 8, 8, False)) is None


# ---- the dry run, end to end --------------------------------------------------------------


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "r.md"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--qkv-backend", "chunked", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
    )
    print(res.stdout[-3000:], res.stderr[-3000:])
    assert res.returncode == 0, res.stderr
    return out, out.read_text(), json.loads(out.with_suffix(".json").read_text())


@pytest.mark.slow  # the dry run takes 9 s; CI's slow tier runs it
def test_dry_run_report_has_every_table_and_column(dry_run):
    _, md, data = dry_run
    assert "dry run on CPU" in md and "Ceilings measured in this run" in md
    found = tables(md)
    grid = bench.GRIDS["dry"]
    for d in grid.headdims:
        heads = grid.hidden // d
        section = f"Head dim {d} · {heads} heads · hidden {grid.hidden} · {grid.tokens} tokens per batch"
        assert f"## {section}" in md
    titles = [h for h, _, _ in found]
    # dense per head dim, window, gqa, score functions: three modes; decoding: forward only
    assert titles.count("backward") == titles.count("forward + backward") == len(grid.headdims) + 3
    assert titles.count("forward") == len(grid.headdims) + 4
    for heading, header, rows in found[: -1 if "what" in found[-1][1] else None]:
        if heading not in ("forward", "backward", "forward + backward"):
            continue
        mode = {"forward": "fwd", "backward": "bwd", "forward + backward": "fwd+bwd"}[heading]
        assert header[:2] == ["N", "batch"] and f"GFLOP {mode}" in header and "qkv chunked" in header and "auto" in header
        assert header[-2 if mode == "fwd" else -1].startswith("qkv ÷ ")
        assert ("qkv check" in header) == (mode == "fwd")
        if "window" in header:
            assert "flex" in header and not any(h.startswith("sdpa") for h in header)
        elif "score" in header:
            assert {"flex", "qkv-plain"} <= set(header) and not any(h.startswith("sdpa") for h in header)
        else:
            assert {"sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flex"} <= set(header)
        assert rows
    assert "## Per-call cost outside the kernels" in md and "| bare kernel launch (arguments prepared once) | unmeasured |" in md
    (heading, header, rows), = [t for t in found if t[0].startswith("Attention statistics in one pass")]
    assert header == ["N", "batch", "forward ms", "statistics ms", "statistics ÷ forward", "lse check"]
    assert [r[0] for r in rows] == [str(n) for n in grid.stats_seqlens] and all(r[4].endswith("×") and r[5].startswith("✓") for r in rows)


@pytest.mark.slow  # the dry run takes 9 s; CI's slow tier runs it
def test_dry_run_flops_in_report_and_json_follow_the_formula(dry_run):
    _, md, data = dry_run
    by_key: dict = {}
    for c in data["cases"]:
        if c["kind"] == "decode":  # nq rows against n keys, no mask
            expect = {m: f * 4 * c["batch"] * c["hq"] * c["d"] * c["nq"] * c["n"] for m, f in bench.FLOP_FACTOR.items()}
        else:
            expect = bench.attention_flops(c["batch"], c["hq"], c["n"], c["d"], c["causal"], c["window"])
        assert c["flops"] == expect
        by_key.setdefault((c["nq"] or c["n"], c["batch"]), []).append(expect)
    checked = 0
    for heading, header, rows in tables(md):
        if heading not in ("forward", "backward", "forward + backward"):
            continue
        mode = {"forward": "fwd", "backward": "bwd", "forward + backward": "fwd+bwd"}[heading]
        col = header.index(f"GFLOP {mode}")
        for row in rows:
            cands = by_key[(int(row[0]), int(row[1]))]
            gflop = float(row[col])
            assert any(abs(f[mode] / 1e9 - gflop) <= 1e-4 * gflop for f in cands), (heading, row)
            checked += 1
    assert checked == sum(0 if c["kind"] == "stats" else 1 if c["kind"] == "decode" else 3 for c in data["cases"])
    # and one row computed by hand: dense, head dim 64, N = 32, causal
    h = bench.GRIDS["dry"].hidden // 64
    b = bench.GRIDS["dry"].tokens // 32
    assert f"| 32 | {b} | yes | {4 * b * h * 32 * 32 * 64 / 2 / 1e9:.5g} |" in md


@pytest.mark.slow  # the dry run takes 9 s; CI's slow tier runs it
def test_dry_run_measures_qkv_and_peers_and_explains_skips(dry_run):
    _, md, data = dry_run
    for c in data["cases"]:
        for name in ("qkv",) if c["kind"] == "stats" else ("qkv", "auto"):
            r = c["results"][name]
            assert r["status"] == "ok" and r["check"]["ok"], (c["id"], name, r)
            modes = ("fwd",) if c["kind"] in ("decode", "stats") else bench.MODES
            assert set(r["modes"]) == set(modes) and all(r["modes"][m]["tflops"] > 0 for m in modes)
            assert r["modes"]["fwd"]["tflops"] == pytest.approx(c["flops"]["fwd"] / r["modes"]["fwd"]["ms"] / 1e9)
        if c["kind"] == "decode":
            fwd = c["results"]["qkv"]["modes"]["fwd"]
            assert fwd["gbps"] == pytest.approx(2 * c["batch"] * c["hkv"] * c["n"] * c["d"] * 2 / fwd["ms"] / 1e6)
        if c["kind"] not in ("window", "score", "stats"):
            assert c["results"]["sdpa-flash"]["status"] == "ok"  # torch's CPU flash kernel
        if c["kind"] in ("score", "stats"):
            assert c["results"]["qkv-plain"]["status"] == "ok"
        if c["kind"] == "stats":  # no peer computes the statistics: qkv's own forward is the yardstick
            assert set(c["results"]) == {"qkv", "qkv-plain"} and bench.stats_ratio(c) > 0
        else:
            assert c["results"]["flex"]["status"] == "skip"
    assert "## Reasons" in md and "`sdpa-cudnn`: needs CUDA (dry run on CPU)" in md
    assert re.search(r"`sdpa-math`: not run above N = \d+", md)
    assert "| ✓ " in md and "| ✗ " not in md and "Not run" not in md
    assert not data["not_run"]


# ---- guards, budget, merge (in process) ---------------------------------------------------


def _ctx():
    return bench.Context("cpu", "chunked", 1 << 20, dry_run=True)


def _recorder(tmp_path, cases):
    meta = {"date": "today", "device": "CPU", "torch": "x", "cuda": "none", "cudnn": "none", "triton": "x", "python": "x",
            "git": "?", "qkv_backend": "chunked", "dtype": "bfloat16", "dry_run": True, "command": "test"}  # fmt: skip
    rec = bench.Recorder(tmp_path / "r.md", meta, cases)
    rec.data["runs"][0]["ceilings"] = {"matmul_n": 1, "matmul_tflops": 1.0, "copy_bytes": 1, "copy_gbps": 1.0}
    return rec


def test_oom_refusal_and_nan_become_cells_and_the_run_goes_on(tmp_path, monkeypatch):
    def oom(case, ctx):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    def refuses(case, ctx):
        def run(q, k, v):
            raise RuntimeError("No available kernel. Aborting execution.")

        return run

    def nan(case, ctx):
        return lambda q, k, v: torch.full_like(q, float("nan"))

    peers = {
        "qkv": bench.Peer(nan, bench.KINDS),
        "sdpa-flash": bench.Peer(oom, ("dense",)),
        "sdpa-math": bench.Peer(refuses, ("dense",)),
        "sdpa-efficient": bench.PEERS["sdpa-math"],
    }
    monkeypatch.setattr(bench, "PEERS", peers)
    cases = [bench.Case("dense", 1, 2, 2, 16, 8, True)]
    rec = _recorder(tmp_path, cases)
    bench.run_cases(cases, list(peers), _ctx(), rec, bench.Budget(0), bench.cpu_timer)
    res = rec.data["cases"][0]["results"]
    assert res["qkv"]["status"] == "nan" and rec.qkv_failures
    assert res["sdpa-flash"]["status"] == "oom"
    assert res["sdpa-math"]["status"] == "error" and "No available kernel" in res["sdpa-math"]["reason"]
    assert res["sdpa-efficient"]["status"] == "ok"  # the cell after the failures still ran
    md = (tmp_path / "r.md").read_text()
    assert "## ⚠ Correctness" in md and "NaN!" in md and "OOM" in md and "n/a [1]" in md
    assert "1. `sdpa-math`: RuntimeError: No available kernel" in md


def test_budget_stops_new_cells_and_the_report_lists_what_is_left(tmp_path):
    cases = bench.build_cases(bench.GRIDS["dry"], kinds=["dense"])
    rec = _recorder(tmp_path / "cut", cases)
    bench.run_cases(cases, list(bench.PEERS), _ctx(), rec, bench.Budget(1e-6), bench.cpu_timer)
    rec.save()
    md = (tmp_path / "cut" / "r.md").read_text()
    assert rec.data["not_run"] == [c.id for c in cases] and not rec.data["cases"]
    assert f"## Not run ({len(cases)} cases" in md and "--only '^(" + "|".join(c.id for c in cases) + ")$'" in md
    # a second run of one case, merged after the cut one: that case is done, the rest still listed
    rest = _recorder(tmp_path / "rest", cases[:1])
    bench.run_cases(cases[:1], ["qkv"], _ctx(), rest, bench.Budget(0), bench.cpu_timer)
    rest.save()
    merged = bench.merge([tmp_path / "cut" / "r.json", tmp_path / "rest" / "r.json"])
    assert merged["not_run"] == [c.id for c in cases[1:]] and len(merged["runs"]) == 2
    assert [(c["id"], c["run"]) for c in merged["cases"]] == [(cases[0].id, 1)]
    assert "Run 2:" in bench.render_report(merged)


def test_cli_lists_cases_and_rejects_unknown_names(capsys):
    assert bench.main(["--list", "--quick", "--kinds", "dense"]) == 0
    assert capsys.readouterr().out.split() == [c.id for c in bench.build_cases(bench.GRIDS["quick"], kinds=["dense"])]
    with pytest.raises(SystemExit):
        bench.parse_args(["--impls", "qkv,nope"])
