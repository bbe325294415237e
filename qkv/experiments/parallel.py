"""All positions at once: the sequential steps of self-attention against a GRU and an LSTM.

The claim is about dependence, so it is first measured as a count: the longest chain of dependent
torch operations in one forward pass (:func:`sequential_steps`), for attention and for the
recurrences written as they are defined, one cell call per position. Counts are exact, so this
part cannot depend on the machine's load. Time is measured second, where the claim says it shows:
with one sequence of width 64, each step's arithmetic is small next to the fixed cost of a
dependent operation (an operator call here, a kernel launch on a GPU), so time follows the number
of sequential steps. The times are interleaved, the minimum of several rounds, and judged with a
margin beyond their noise (:mod:`qkv.experiments.judge`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List

from ._common import (
    Progress, Result, flop_count, fmt, label_lengths, pyplot, save_figure, seed_all, sequential_steps, write_csv,
)
from .judge import FAILED, HELD, Timings, combine, cores, decide_ratio, load_average, time_interleaved

NAME = "parallel"
TITLE = "All positions at once: attention's sequential steps do not grow with n, an RNN's do"
CLAIM = (
    "Self-attention computes all n positions at once: the longest chain of dependent operations in its forward "
    "pass (its sequential steps) is the same for every n, while a GRU or LSTM takes n dependent steps, one per "
    "position (O(1) against O(n)), although attention does more arithmetic (O(n²·d + n·d²) against O(n·d²)). So "
    "where each step's arithmetic is small next to what the hardware does at once, as on a GPU, attention's time "
    "grows far more slowly with n than the RNN's."
)
RNNS = ("GRU", "LSTM")
GROWTH_AT_LEAST = 2.0  # the RNN's time must grow at least twice as much as attention's over the measured n


def _models(d: int) -> Dict[str, Any]:
    """The compared forward passes, each a function of x (B, N, d) → (B, N, d)."""
    import torch
    from torch import nn

    from ..nn import MultiHeadAttention

    attn = MultiHeadAttention(d, 4).eval()
    gru_cell, lstm_cell = nn.GRUCell(d, d).eval(), nn.LSTMCell(d, d).eval()
    gru, lstm = nn.GRU(d, d, batch_first=True).eval(), nn.LSTM(d, d, batch_first=True).eval()

    def gru_steps(x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], d)  # (B, d)
        outs = []
        for t in range(x.shape[1]):  # one dependent step per position
            h = gru_cell(x[:, t], h)
            outs.append(h)
        return torch.stack(outs, 1)  # (B, N, d)

    def lstm_steps(x: torch.Tensor) -> torch.Tensor:
        h = c = x.new_zeros(x.shape[0], d)  # (B, d)
        outs = []
        for t in range(x.shape[1]):
            h, c = lstm_cell(x[:, t], (h, c))
            outs.append(h)
        return torch.stack(outs, 1)  # (B, N, d)

    return {
        "attention": lambda x: attn(x)[0],  # the path qkv picks (auto)
        "attention (math)": lambda x: attn(x, backend="math")[0],  # every operation visible to the counters
        "GRU": gru_steps,
        "LSTM": lstm_steps,
        "torch GRU": lambda x: gru(x)[0],
        "torch LSTM": lambda x: lstm(x)[0],  # oneDNN on a CPU: all n steps inside one call
    }


def _counts(models: Dict[str, Any], ns: List[int], b: int, d: int, gen: Any) -> tuple[dict, dict]:
    """Sequential steps and matrix-product FLOPs of attention (math path) and the two recurrences, per n."""
    import torch

    steps: dict = {"attention": [], "GRU": [], "LSTM": []}
    flops: dict = {k: [] for k in steps}
    source = {"attention": "attention (math)", "GRU": "GRU", "LSTM": "LSTM"}
    with torch.no_grad():
        for n in ns:
            x = torch.randn(b, n, d, generator=gen)  # (B, N, d)
            for name, model in source.items():
                steps[name].append(sequential_steps(lambda: models[model](x)))
                flops[name].append(flop_count(lambda: models[model](x)))
    return steps, flops


def judge_steps(ns: List[int], steps: dict) -> tuple[bool, dict]:
    """Attention's steps the same at every n; each RNN's a fixed number per position (exact)."""
    per_position = {}
    for k in RNNS:
        slopes = {(steps[k][i + 1] - steps[k][i]) / (ns[i + 1] - ns[i]) for i in range(len(ns) - 1)}
        per_position[k] = slopes.pop() if len(slopes) == 1 else None
    ok = len(set(steps["attention"])) == 1 and all(p is not None and p >= 1 for p in per_position.values())
    return ok, per_position


def judge_time(timings: Timings, lo: int, hi: int) -> tuple[str, dict, dict]:
    """The timed part's verdict from interleaved samples keyed ``(model, n)``: each RNN's time growth
    from n = ``lo`` to ``hi`` over attention's, at least :data:`GROWTH_AT_LEAST` beyond the noise and
    the margin. Returns ``(state, growth, ratio)``, the last two as ``name → (value, noise)``."""

    def growth(k: str):
        return lambda t: t[(k, hi)] / t[(k, lo)]

    models = sorted({k for k, _ in timings.samples})
    grow = {k: timings.value(growth(k)) for k in models}
    ratio, states = {}, []
    for k in RNNS:
        ratio[k] = timings.value(lambda t, k=k: growth(k)(t) / growth("attention")(t))
        states.append(decide_ratio(*ratio[k], GROWTH_AT_LEAST))
    return combine(states), grow, ratio


def _figure(out: Path, ns_count: List[int], steps: dict, ns_time: List[int], best: dict) -> None:
    """parallel.png: sequential steps against n, and time against n."""
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {"attention": "C0", "GRU": "C3", "LSTM": "C2", "torch GRU": "C3", "torch LSTM": "C2"}
    for name in ("attention", "GRU", "LSTM"):
        ax[0].loglog(ns_count, steps[name], "o-", color=colors[name], label=name if name == "attention" else f"{name}, one cell call per position")
    ax[0].set(xlabel="sequence length n (positions)", ylabel="sequential steps (dependent operations, counted)",
              title="Longest chain of dependent operations (exact)")
    for name in ("attention", "GRU", "LSTM", "torch GRU", "torch LSTM"):
        ax[1].loglog(ns_time, [1e3 * best[(name, n)] for n in ns_time], "o-" if "torch" not in name else "s--",
                     color=colors[name], label=name.replace("torch ", "torch nn.") if "torch" in name else name)
    ax[1].set(xlabel="sequence length n (positions)", ylabel="forward CPU time, 1 thread, min of rounds (ms)",
              title="Time where a step's arithmetic is small (batch 1, width 64)")
    label_lengths([ax[0]], ns_count)
    label_lengths([ax[1]], ns_time)
    save_figure(fig, out / "parallel.png")


def _setup_text(b: int, d: int, ns_count: List[int], ns_time: List[int], repeats: int) -> str:
    """How the claim was tested, and the verdict's rule."""
    return (
        f"`qkv.nn.MultiHeadAttention` (4 heads) against a GRU and an LSTM written as their definition, one "
        f"`torch.nn.GRUCell` / `LSTMCell` call per position; width {d}, batch {b}, float32, forward under "
        "`torch.no_grad()`. Sequential steps: the longest chain of dependent torch operations, counted through a "
        "TorchDispatchMode (attention on its math path, so that every operation is seen), and matrix-product FLOPs "
        f"counted by torch's FlopCounterMode, at n = {', '.join(map(str, ns_count))}: exact, the same on any machine. "
        f"Time: attention on the path qkv picks, the two step-by-step RNNs, and torch's own `nn.GRU` and "
        f"`nn.LSTM` for comparison, at n = {', '.join(map(str, ns_time))}; one intra-op thread, the thread's CPU time, "
        f"{repeats} interleaved rounds after a warm-up, the minimum of each. Verdict: attention's steps equal at every "
        "n and each RNN's a fixed number per position (exact); and each RNN's time growth from the smallest to the "
        f"largest n at least {GROWTH_AT_LEAST:g}× attention's, beyond the noise (how far the ratio moves between the "
        "first and the second half of the rounds) and a 25% margin. A timed ratio inside that margin is \"not shown "
        "on this machine\", with its numbers; only a ratio clearly below 1 (attention's time growing faster) would "
        "contradict the claim."
    )


def run(out: Path, quick: bool = False, seed: int = 0) -> Result:
    import torch

    t_start = time.perf_counter()
    seed_all(seed)
    b, d = 1, 64
    ns_count = [8, 32, 128] if quick else [8, 16, 32, 64, 128, 256, 512]
    ns_time = [8, 32, 128] if quick else [8, 16, 32, 64, 128]
    repeats = 15  # a round is ~50 ms: many rounds make each minimum, and so the noise estimate, steady
    models = _models(d)
    timed = ("attention", "GRU", "LSTM", "torch GRU", "torch LSTM")
    bar = Progress(1 + repeats, "parallel")
    gen = torch.Generator().manual_seed(seed)

    steps, flops = _counts(models, ns_count, b, d, gen)
    steps_ok, per_position = judge_steps(ns_count, steps)
    bar.step("counted")

    xs = {n: torch.randn(b, n, d, generator=gen) for n in ns_time}  # (B, N, d)
    load_before = load_average()
    with torch.no_grad():
        samples = time_interleaved({(k, n): (lambda k=k, n=n: models[k](xs[n])) for k in timed for n in ns_time},
                                   repeats, between=lambda: bar.step("timing"))
    load_after = load_average()
    timings = Timings(samples)
    best = timings.best()
    lo, hi = ns_time[0], ns_time[-1]
    time_verdict, grow, time_ratio = judge_time(timings, lo, hi)
    held = bool(steps_ok and time_verdict != FAILED)
    within_noise = []
    if time_verdict != HELD and held:
        within_noise.append(
            f"the time growth: from n = {lo} to {hi} attention's time grew {grow['attention'][0]:.2f}×, the GRU's "
            f"{grow['GRU'][0]:.2f}× and the LSTM's {grow['LSTM'][0]:.2f}× (±{max(v[1] for v in grow.values()):.2f}); "
            f"the claim needs the RNNs' growth above {GROWTH_AT_LEAST * 1.25:.1f}× attention's beyond that noise")

    _figure(out, ns_count, steps, ns_time, best)
    rows: List[List[Any]] = [["sequential_steps", k, n, s] for k in steps for n, s in zip(ns_count, steps[k])]
    rows += [["matmul_flops", k, n, f] for k in flops for n, f in zip(ns_count, flops[k])]
    rows += [["time_s_min", k, n, best[(k, n)]] for k in timed for n in ns_time]
    rows += [["time_s_round_" + str(r), k, n, samples[(k, n)][r]] for k in timed for n in ns_time for r in range(repeats)]
    write_csv(out / "parallel.csv", ["measure", "model", "n", "value"], rows)

    def per_step_us(k: str) -> float:
        return 1e6 * (best[(k, hi)] - best[(k, lo)]) / (hi - lo)

    load = f"load average {fmt(load_before)} → {fmt(load_after)} on {cores()} cores" if load_before is not None else f"{cores()} cores"
    result = (
        f"Sequential steps (counted): attention {steps['attention'][0]} at every n = {ns_count[0]}…{ns_count[-1]}; "
        + ", ".join(f"{k} {steps[k][0]} → {steps[k][-1]} ({fmt(per_position[k]) if per_position[k] else 'not'} per position)"
                    for k in RNNS)
        + f". Matrix-product FLOPs at n = {ns_count[-1]}: attention {fmt(flops['attention'][-1])}, GRU "
        f"{fmt(flops['GRU'][-1])}, LSTM {fmt(flops['LSTM'][-1])} (attention does "
        f"{flops['attention'][-1] / flops['GRU'][-1]:.1f}× the GRU's arithmetic). Time from n = {lo} to {hi} ({load}): "
        f"attention {1e3 * best[('attention', lo)]:.3f} → {1e3 * best[('attention', hi)]:.3f} ms "
        f"(×{grow['attention'][0]:.2f}), GRU {1e3 * best[('GRU', lo)]:.2f} → {1e3 * best[('GRU', hi)]:.2f} ms "
        f"(×{grow['GRU'][0]:.2f}), LSTM {1e3 * best[('LSTM', lo)]:.2f} → {1e3 * best[('LSTM', hi)]:.2f} ms "
        f"(×{grow['LSTM'][0]:.2f}): the RNNs' growth is {time_ratio['GRU'][0]:.1f}× and {time_ratio['LSTM'][0]:.1f}× "
        f"attention's (noise ±{time_ratio['GRU'][1]:.1f} and ±{time_ratio['LSTM'][1]:.1f}). torch's own layers, for "
        f"comparison: nn.GRU ×{grow['torch GRU'][0]:.2f} ({per_step_us('torch GRU'):.1f} µs per step), nn.LSTM "
        f"×{grow['torch LSTM'][0]:.2f} ({per_step_us('torch LSTM'):.1f} µs per step: oneDNN runs all n steps inside "
        "one call, so on a CPU a step costs only its arithmetic)."
    )
    setup = _setup_text(b, d, ns_count, ns_time, repeats)
    metrics = {"ns_count": ns_count, "sequential_steps": steps, "steps_per_position": per_position,
               "matmul_flops": flops, "steps_ok": steps_ok, "ns_time": ns_time,
               "time_min_s": {k: [best[(k, n)] for n in ns_time] for k in timed},
               "time_growth": {k: list(v) for k, v in grow.items()},
               "growth_ratio": {k: list(v) for k, v in time_ratio.items()},
               "time_verdict": time_verdict, "load_average": [load_before, load_after], "cores": cores()}
    return Result(NAME, TITLE, CLAIM, setup, result, held, metrics, ["parallel.png"], "parallel.csv",
                  time.perf_counter() - t_start, within_noise=within_noise)
