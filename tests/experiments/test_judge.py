"""The experiments' verdict logic, fed synthetic timings: nothing here reads a clock.

A timed verdict must not flip with a 10% difference or with the machine's load: noisy-equal
timings are "not shown", a clear effect holds, and only a clear contradiction "did not hold".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qkv.experiments import cost, linear, parallel, sparse
from qkv.experiments import Result
from qkv.experiments.judge import (
    FAILED, HELD, NOT_SHOWN, Timings, combine, decide, decide_ratio, time_interleaved,
)
from qkv.experiments.report import to_html, to_markdown


def _steady(t: float, rounds: int = 6, jitter: float = 0.02) -> list:
    """A case's samples: its true time plus load that only ever adds (up to ``jitter``)."""
    return [t * (1 + jitter * ((3 * r) % rounds) / rounds) for r in range(rounds)]


# -- the generic rules ---------------------------------------------------------------------------

def test_decide_three_ways_and_band_inside_the_failure_band() -> None:
    band, wide = (1.4, 3.2), (1.2, 3.6)
    assert decide(2.0, 0.1, band, wide) == HELD
    assert decide(1.35, 0.02, band, wide) == NOT_SHOWN  # outside the band, inside the margin
    assert decide(1.5, 0.2, band, wide) == NOT_SHOWN  # inside, but the noise reaches out of it
    assert decide(1.0, 0.1, band, wide) == FAILED
    assert decide(3.9, 0.1, band, wide) == FAILED
    assert decide(1.1, 0.2, band, wide) == NOT_SHOWN  # below the failure band, but not by more than the noise
    assert decide(float("nan"), 0.0, band, wide) == NOT_SHOWN
    assert decide(2.0, float("inf"), band, wide) == NOT_SHOWN
    with pytest.raises(ValueError, match="fails_outside"):
        decide(2.0, 0.1, (1.0, 3.0), (1.5, 2.5))


def test_decide_ratio_needs_the_margin_beyond_the_noise() -> None:
    assert decide_ratio(1.10, 0.01, 1.0) == NOT_SHOWN  # a 10% effect never decides
    assert decide_ratio(0.90, 0.01, 1.0) == NOT_SHOWN  # nor a 10% contradiction
    assert decide_ratio(1.40, 0.01, 1.0) == HELD
    assert decide_ratio(1.40, 0.30, 1.0) == NOT_SHOWN  # clear effect, but noisier than the margin left
    assert decide_ratio(0.60, 0.01, 1.0) == FAILED
    assert decide_ratio(14.0, 0.5, 2.0) == HELD
    assert decide_ratio(2.0, 2.5, 1.0) == NOT_SHOWN  # noise as large as the value decides nothing
    assert decide_ratio(0.0, 0.0, 1.0) == NOT_SHOWN


def test_combine() -> None:
    assert combine([HELD, HELD]) == HELD
    assert combine([HELD, NOT_SHOWN]) == NOT_SHOWN
    assert combine([NOT_SHOWN, FAILED, HELD]) == FAILED
    assert combine([]) == HELD
    with pytest.raises(ValueError, match="unknown state"):
        combine(["maybe"])


def test_timings_best_and_noise_from_the_halves() -> None:
    t = Timings({"a": [3.0, 1.0, 2.0, 1.5], "b": [2.0, 2.0, 2.2, 2.1]})
    assert t.best() == {"a": 1.0, "b": 2.0}
    assert t.halves() == ({"a": 1.0, "b": 2.0}, {"a": 1.5, "b": 2.1})
    value, noise = t.value(lambda m: m["b"] / m["a"])
    assert value == 2.0 and noise == pytest.approx(2.0 - 2.1 / 1.5)


def test_time_interleaved_warms_up_then_alternates_the_cases() -> None:
    calls, ticks = [], iter(range(1000))
    samples = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3,
                               clock=lambda: float(next(ticks)))
    assert calls == ["a", "b"] + ["a", "b"] * 3  # one warm-up each, then rounds of every case
    assert samples == {"a": [1.0] * 3, "b": [1.0] * 3}
    with pytest.raises(ValueError, match="repeats=1"):
        time_interleaved({"a": lambda: None}, 1)


# -- each timed experiment's rule ------------------------------------------------------------------

def _parallel(attn: tuple, rnn: tuple) -> Timings:
    """(time at n = 8, at n = 128) for attention and for both RNNs."""
    samples = {}
    for name, (lo, hi) in {"attention": attn, "GRU": rnn, "LSTM": rnn}.items():
        samples[(name, 8)], samples[(name, 128)] = _steady(lo), _steady(hi)
    return Timings(samples)


def test_parallel_time_growth() -> None:
    # the latency-bound regime: attention's time flat, the step-by-step RNN's ∝ n
    state, grow, ratio = parallel.judge_time(_parallel((0.5e-3, 0.55e-3), (0.5e-3, 7.5e-3)), 8, 128)
    assert state == HELD and grow["GRU"][0] == pytest.approx(15.0) and ratio["LSTM"][0] > 10
    # noisy-equal growth (what a fused kernel at n = 32 looks like): not shown, not "did not hold"
    assert parallel.judge_time(_parallel((0.41e-3, 1.6e-3), (0.45e-3, 1.7e-3)), 8, 128)[0] == NOT_SHOWN
    # attention's time growing clearly faster than the RNN's contradicts the claim
    assert parallel.judge_time(_parallel((0.3e-3, 6e-3), (0.5e-3, 2e-3)), 8, 128)[0] == FAILED


def test_parallel_steps_verdict_is_exact() -> None:
    ns = [8, 32, 128]
    ok, per = parallel.judge_steps(ns, {"attention": [35] * 3, "GRU": [82, 322, 1282], "LSTM": [66, 258, 1026]})
    assert ok and per == {"GRU": 10, "LSTM": 8}
    assert not parallel.judge_steps(ns, {"attention": [35, 36, 35], "GRU": [82, 322, 1282], "LSTM": [66, 258, 1026]})[0]
    assert not parallel.judge_steps(ns, {"attention": [35] * 3, "GRU": [82, 90, 100], "LSTM": [66, 258, 1026]})[0]


def _linear(exact: list, lin: list, ns: list) -> Timings:
    samples = {}
    for name, ts in (("exact", exact), ("linear", lin)):
        for n, t in zip(ns, ts):
            samples[(name, n)] = _steady(t)
    return Timings(samples)


def test_linear_time_growth_and_crossover() -> None:
    ns = [256, 512, 1024, 2048]
    state, gap, faster, speed = linear.judge_time(_linear([1.0, 3.0, 10.0, 40.0], [5.0, 10.0, 20.0, 40.0 / 2], ns), ns)
    assert state == HELD and faster and speed[0] == pytest.approx(2.0)
    # equal growth and equal time at the top: neither the growth nor the crossover is shown
    state, _, faster, _ = linear.judge_time(_linear([1.0, 2.0, 4.0, 8.0], [1.0, 2.0, 4.0, 8.4], ns), ns)
    assert state == NOT_SHOWN and not faster
    # linear attention's time growing clearly faster than exact attention's contradicts the claim
    assert linear.judge_time(_linear([1.0, 2.0, 4.0, 8.0], [1.0, 4.0, 16.0, 64.0], ns), ns)[0] == FAILED


def test_cost_time_exponents() -> None:
    ns = [256, 512, 1024, 2048]

    def timings(exp_math: float, exp_chunked: float) -> Timings:
        return Timings({(k, n): _steady((n / 256) ** e) for k, e in (("math", exp_math), ("chunked", exp_chunked))
                        for n in ns})

    assert cost.judge_time(timings(2.5, 1.9), ns)[0] == HELD
    assert cost.judge_time(timings(2.0, 1.33), ns)[0] == NOT_SHOWN  # just below the band
    assert cost.judge_time(timings(2.0, 1.0), ns)[0] == FAILED  # linear time would contradict N²
    state, timed = cost.judge_time(timings(3.4, 1.9), ns)
    assert state == NOT_SHOWN and timed["math"][0] == pytest.approx(3.4, abs=0.02)


def test_sparse_time_against_density() -> None:
    names, dens = ["0.05", "0.25", "0.50"], [0.117, 0.328, 0.566]

    def timings(rel: list) -> Timings:
        samples = {(2048, "dense"): _steady(1.0)}
        samples.update({(2048, nm): _steady(r) for nm, r in zip(names, rel)})
        return Timings(samples)

    assert sparse.judge_time(timings([0.3, 0.65, 1.0]), 2048, names, dens, quick=True)[0] == HELD
    assert sparse.judge_time(timings([0.55, 0.8, 1.0]), 2048, names, dens, quick=True)[0] == NOT_SHOWN
    assert sparse.judge_time(timings([1.5, 1.8, 2.0]), 2048, names, dens, quick=True)[0] == FAILED
    state, states, _, slope = sparse.judge_time(timings([0.117, 0.328, 0.566]), 2048, names, dens, quick=False)
    assert state == HELD and states == {"speedup": HELD, "slope": HELD} and slope[0] == pytest.approx(1.0)


# -- what the user reads -------------------------------------------------------------------------

def _result(**kw) -> Result:
    return Result("parallel", "T", "C", "S", "R", **kw)


def test_verdict_words_state_and_json(tmp_path: Path) -> None:
    noisy = _result(held=True, within_noise=["the time growth: attention 1.10×, GRU 1.05×"])
    assert noisy.state == NOT_SHOWN
    assert noisy.verdict == "not shown on this machine (the time growth: attention 1.10×, GRU 1.05×)"
    assert noisy.verdict_in("zh") == "在这台机器上未显示（the time growth: attention 1.10×, GRU 1.05×）"
    both = _result(held=True, within_noise=["x"], not_shown=["y"], quick=True)
    assert both.verdict == "not shown on this machine (x); not shown in quick mode (needs y; run without --quick)"
    assert _result(held=False, within_noise=["x"]).state == FAILED  # a contradicted part outranks the rest
    assert _result(held=True).verdict == "held" and _result(held=False).verdict == "DID NOT HOLD"
    noisy.save(tmp_path)
    saved = json.loads((tmp_path / "parallel.json").read_text(encoding="utf-8"))
    assert saved["state"] == NOT_SHOWN and saved["verdict"] == noisy.verdict
    assert Result.load(tmp_path / "parallel.json").within_noise == noisy.within_noise


def test_report_names_the_three_verdicts_in_both_languages(tmp_path: Path) -> None:
    results = [_result(held=True), _result(held=True, within_noise=["ratio 1.05 ± 0.02"]), _result(held=False)]
    md = to_markdown(results)
    assert "| [T](#parallel) | held |" in md and "not shown on this machine (ratio 1.05 ± 0.02)" in md and "DID NOT HOLD" in md
    assert "NOT hold" not in md.replace("DID NOT HOLD", "")
    page = to_html(results, tmp_path, "zh")
    assert 'lang="zh"' in page and "自注意力的实验" in page and "在这台机器上未显示" in page
    assert page.count('class="skip"') == 2 and page.count('class="bad"') == 2
