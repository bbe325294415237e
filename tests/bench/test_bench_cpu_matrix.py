"""The CPU benchmark matrix's logic (`bench/attention_matrix.py`): every contender of a cell
computes the same attention, rounds are counted as documented, and `--append` replaces cells
and keeps the report's header. Nothing here measures anything."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from ..helpers import load_bench_script

bench = load_bench_script("attention_matrix")
overhead = load_bench_script("auto_overhead")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", bench.KINDS + ["window_64"])
def test_every_contender_of_a_cell_computes_the_same_attention(kind):
    """SDPA's mask form, FlexAttention's block mask and qkv's arguments must describe one call,
    or the matrix compares different work (N = 256 so that windows, the bottom-right offset and
    128-blocks all bite)."""
    cell = bench.Cell(kind, 256, torch.float64, grad=False)
    out_auto = cell.fn("auto")()
    out_auto = out_auto[0] if isinstance(out_auto, tuple) else out_auto
    assert out_auto.shape == cell.q.shape and torch.isfinite(out_auto).all()
    out_chunked = cell.fn("chunked")()
    out_chunked = out_chunked[0] if isinstance(out_chunked, tuple) else out_chunked
    torch.testing.assert_close(out_chunked, out_auto, rtol=1e-10, atol=1e-10)
    sdpa = cell.fn("sdpa")
    if kind == "lse_grad":
        assert sdpa is None  # SDPA has no differentiable lse
    else:
        torch.testing.assert_close(sdpa(), out_auto, rtol=1e-10, atol=1e-10)
    # FlexAttention eagerly (the benchmark compiles it) with the cell's own block mask.
    flex = flex_attention(cell.q, cell.k, cell.v, block_mask=cell.block_mask, enable_gqa=kind == "gqa_8_2")
    torch.testing.assert_close(flex, out_auto, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["causal", "lse_grad", "key_padding"])
def test_a_gradient_cell_runs_forward_and_backward(kind):
    cell = bench.Cell(kind, 128, torch.float32, grad=True)
    cell.fn("auto")()
    grads = [t.grad.clone() for t in (cell.q, cell.k, cell.v)]
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    cell.fn("chunked")()  # each call starts from cleared gradients, so a rerun gives the same
    for t, g in zip((cell.q, cell.k, cell.v), grads):
        torch.testing.assert_close(t.grad, g, rtol=1e-5, atol=1e-6)


def test_rounds_count_a_slow_warm_up_as_the_first():
    calls: list[str] = []
    best = bench.time_cell({"slow": lambda: calls.append("slow"), "fast": lambda: calls.append("fast")}, 2, {"slow": 7.0})
    assert calls == ["fast", "fast", "slow"]  # the slow one is timed once more, in the second round
    assert best["slow"] < 7.0 and best["fast"] < 7.0
    assert bench.time_cell({"slow": lambda: None}, 1, {"slow": 7.0}) == {"slow": 7.0}


def test_rounds_rotate_which_contender_goes_first():
    """No contender always runs right after the same other one: the order turns each round."""
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    bench.time_cell(fns, 3)
    rounds = [calls[i : i + 3] for i in range(0, 9, 3)]
    assert rounds == [list("abc"), list("bca"), list("cab")]


def test_run_cell_reports_ratios_and_refusals(monkeypatch):
    monkeypatch.setattr(bench, "CONTENDERS", ["sdpa", "auto", "chunked"])  # no compile in the suite
    threads = torch.get_num_threads()
    try:
        row = bench.run_cell("lse_grad", 128, torch.float32, True, 1, 1)
    finally:
        torch.set_num_threads(threads)
    assert row["sdpa"] is None and row["auto"] > 0 and row["chunked"] > 0
    assert "auto_vs_best_peer" not in row  # no peer can run it
    row = bench.run_cell("causal", 128, torch.float32, False, threads, 2)
    assert row["auto_vs_best_peer"] == pytest.approx(row["auto"] / row["sdpa"])
    assert row["chunked_vs_sdpa"] == pytest.approx(row["chunked"] / row["sdpa"])
    assert "warm_up_timed" not in row


def test_append_replaces_cells_and_keeps_the_header(tmp_path, monkeypatch):
    def fake_cell(kind, n, dtype, grad, threads, rounds, contenders=bench.CONTENDERS):
        return {"kind": kind, "n": n, "nq": n, "dtype": str(dtype)[6:], "pass": "fwd+bwd" if grad else "fwd",
                "threads": threads, "sdpa": 2.0, "flex": None, "auto": 1.0 + n / 1e4, "chunked": 1.0}

    monkeypatch.setattr(bench, "run_cell", fake_cell)
    monkeypatch.setattr(bench, "gemm_peak", lambda threads: 1e11)  # 100 GFLOP/s, without timing a matmul
    out = tmp_path / "m"
    common = ["--dtypes", "float32", "--passes", "fwd", "--threads", "1", "--out", str(out)]
    bench.main(["--n", "64", "128", "--kinds", "plain", "causal", "--rounds", "3", "--note", "first grid", *common])
    first = json.loads(out.with_suffix(".json").read_text())
    assert len(first["rows"]) == 4 and first["meta"]["rounds"] == 3 and first["meta"]["note"] == "first grid"
    bench.main(["--n", "128", "256", "--kinds", "causal", "--rounds", "1", "--append", *common])
    second = json.loads(out.with_suffix(".json").read_text())
    cells = sorted((r["kind"], r["n"], r["rounds"]) for r in second["rows"])
    assert cells == [("causal", 64, 3), ("causal", 128, 1), ("causal", 256, 1), ("plain", 64, 3), ("plain", 128, 3)]
    assert second["meta"]["note"] == "first grid" and second["meta"]["rounds"] == 3
    md = out.with_suffix(".md").read_text()
    assert "first grid" in md
    rounds_of = {(r[0], r[1]): r[5] for r in ([c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| causal |"))}
    assert rounds_of == {("causal", "64"): "3", ("causal", "128"): "1", ("causal", "256"): "1"}
    # the dense cells' rate against the GEMM peak: causal N = 256 forward, 4·B·H·D per allowed pair in 1.0256 s
    pairs = 256 * 257 // 2
    rate = 4 * bench.B * bench.H * bench.D * pairs / (1.0 + 256 / 1e4)
    row = next(line for line in md.splitlines() if line.startswith("| causal | 256 |"))
    assert row.rstrip(" |").endswith(f"{rate / 1e9:.0f} ({100 * rate / 1e11:.0f}%)")


@pytest.mark.parametrize("kind", ["plain", "causal", "bottom_right"])
def test_overhead_parts_run_the_call_qkv_runs(kind):
    """bench/auto_overhead.py: its "kernel calls" compute what qkv.attention and SDPA compute,
    and a row reports every part."""
    fns = overhead.parts(kind, 256, torch.float64)
    want = fns["sdpa"]()
    torch.testing.assert_close(fns["auto"](), want, rtol=1e-12, atol=1e-12)
    got = fns["kernel_calls"]()
    torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, want, rtol=1e-12, atol=1e-12)
    threads = torch.get_num_threads()
    try:
        row = overhead.run(kind, 256, torch.float32, 1, 1)
    finally:
        torch.set_num_threads(threads)
    assert all(row[f] >= 0 for f in ("sdpa", "auto", "validate", "select", "guard", "guard_cold", "kernel_calls"))
    assert row["auto_vs_sdpa"] == pytest.approx(row["auto"] / row["sdpa"])


def test_decode_bench_cell_runs_qkv_and_sdpa_on_the_same_call():
    """bench/decode_cpu.py: a cell's qkv result equals SDPA's in float64 terms, and the report
    classifies cells against the machine's balance."""
    dec = load_bench_script("decode_cpu")
    cells = [dec.Cell(1, 700, 4, 2, 16, "float32", 1), dec.Cell(3, 700, 8, 2, 16, "bfloat16", 1, lse=True, padded=True)]
    rows = [dec.run_cell(c, rounds=1) for c in cells]
    assert rows[0]["max_abs_err"] < 1e-5 and rows[1]["max_abs_err"] < 2e-2  # bfloat16 output rounding
    assert rows[0]["kv_bytes"] == 2 * 2 * 700 * 16 * 4 and rows[1]["rows_per_group"] == 4 * 3
    md = dec.report(rows, {1: 1e10}, {1: 1e11})
    assert md.count("| Nq=") == 2 and "qkv ÷ SDPA over all 2 cells" in md
    assert len(dec.matrix(quick=False)) == 72 and all(c.nq <= 8 for c in dec.matrix(quick=False))


@pytest.mark.parametrize("cache, batch", [("dynamic", 1), ("static", 2)])
def test_generation_bench_gives_the_same_tokens_through_qkv_and_sdpa(cache, batch):
    """bench/generate_cpu.py: greedy decoding of its LLaMA through ``attn_implementation="qkv"``
    picks SDPA's tokens, with transformers' default cache and with a preallocated static cache
    and a ragged (padded) batch, where qkv's decoding kernel gets the mask as key padding."""
    pytest.importorskip("transformers")
    gen = load_bench_script("generate_cpu")
    import qkv.hf

    qkv.hf.register()
    tokens = {impl: gen.generate(gen.build(impl), 96, 4, cache, batch)[1] for impl in ("sdpa", "qkv")}
    assert tokens["qkv"] == tokens["sdpa"] and len(tokens["qkv"]) == 4 and len(tokens["qkv"][0]) == batch
