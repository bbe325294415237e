"""Score functions and sinks on the CPU: what a built-in costs next to the same call without it,
beside SDPA with the bias materialised as a dense float mask and compiled FlexAttention.

    python bench/score_mods_cpu.py            # N = 1024 and 4096, writes bench/results/score_mods_cpu.md and .json
    python bench/score_mods_cpu.py --quick    # N = 256 and 1024, fewer rounds (a smoke run)

Cells (float32, causal, batch 1 × 8 heads, head dim 64, one thread): softcap 30·tanh(s/30),
ALiBi (the paper's slopes), T5 relative bias (32 buckets, causal, learnable table) and sinks
(one learnable logit per head), each forward only and forward + backward. Contenders, timed in
the same run and interleaved round by round:

- ``plain``: ``qkv.attention(q, k, v, is_causal=True)``, the peer of every ratio; auto runs it on
  torch's fused kernel without gradients and on the chunked backend's C loops with them;
- ``qkv``: the same call with ``score_mod=`` or ``sinks=`` (auto: the chunked backend's C loops);
- ``sdpa``: ``F.scaled_dot_product_attention`` with the bias as an (H, N, N) float mask, causal
  −∞ folded in, built once outside the timing (so its table gets no gradient); a softcap or a
  sink has no such form (``n/a``);
- ``flex``: ``flex_attention`` under ``torch.compile`` with a causal block mask (compile time
  reported apart); it has no sinks.

Times are medians over rounds of the process's CPU time (``time.process_time``): on one thread
the same as wall time on an idle machine, and not inflated by other jobs on a shared one. qkv's
ratio to plain is the median of the rounds' ratios, the two calls timed back to back in each
round (drift in the machine's state between rounds cancels). Every contender's output is
checked against qkv's. Peak memory: the growth of peak resident memory
(VmHWM) over one call at N = 4096 in a fresh process, after a warm-up call of the same shape
(peak reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import cpu_name, proc_status_kib  # noqa: E402
import qkv  # noqa: E402
from qkv.score_mods import ALiBi, RelativeBias, Softcap, alibi_slopes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
H, D = 8, 64
KINDS = ("softcap", "alibi", "t5", "sinks")
CONTENDERS = ("plain", "qkv", "sdpa", "flex")
TARGET = 1.2  # a built-in may cost at most this much over the call without it


class Unsupported(Exception):
    """The contender cannot express the cell; the message is the reason shown in the report."""


def inputs(n: int, grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(n)
    return tuple(torch.randn(1, H, n, D, generator=g).requires_grad_(grad) for _ in range(3))


def features(kind: str, grad: bool) -> dict[str, Any]:
    """qkv's arguments for a cell: the learnable tensors (T5 table, sinks) require grad in
    forward + backward cells; ALiBi's slopes are fixed, as in the models that use them."""
    g = torch.Generator().manual_seed(1)
    if kind == "softcap":
        return {"score_mod": Softcap(30.0)}
    if kind == "alibi":
        return {"score_mod": ALiBi(alibi_slopes(H))}
    if kind == "t5":
        return {"score_mod": RelativeBias((torch.randn(32, H, generator=g) * 0.5).requires_grad_(grad), bidirectional=False)}
    if kind == "sinks":
        return {"sinks": torch.randn(H, generator=g).requires_grad_(grad)}
    raise ValueError(kind)


def offset_bias(kind: str, parts: dict[str, Any], n: int) -> torch.Tensor:
    """The additive bias by offset, (H, 2N − 1) at j − i + N − 1 (what the kernels read)."""
    if kind not in ("alibi", "t5"):
        raise Unsupported("SDPA has no score function, only an additive mask" if kind == "softcap" else "SDPA has no sink logit")
    return parts["score_mod"].kernel_form(H, n, n, "top_left", torch.float32).rel.detach()


def dense_bias(kind: str, parts: dict[str, Any], n: int) -> torch.Tensor:
    """The score function as an (H, N, N) float mask with causal −∞: SDPA's only way to take it."""
    rel = offset_bias(kind, parts, n)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return rel[:, j - i + n - 1].masked_fill(j > i, float("-inf"))


_FLEX: Optional[Callable] = None


def compiled_flex() -> Callable:
    """One compiled flex_attention. Every cell's score function and shape compiles anew, so
    dynamo's recompile cap is lifted: past it flex_attention runs uncompiled, 10× slower."""
    global _FLEX
    if _FLEX is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 4096))
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def reset_flex() -> None:
    global _FLEX
    import torch._dynamo

    torch._dynamo.reset()
    _FLEX = None


def flex_score(kind: str, parts: dict[str, Any], n: int) -> Callable:
    if kind == "sinks":
        raise Unsupported("flex_attention has no sinks")
    if kind == "softcap":
        return lambda score, b, h, q_idx, kv_idx: 30.0 * torch.tanh(score / 30.0)
    if kind == "alibi":
        slopes = parts["score_mod"].slopes
        return lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)
    rel = offset_bias(kind, parts, n)  # T5's buckets gathered once: the form a compiled kernel can read
    return lambda score, b, h, q_idx, kv_idx: score + rel[h, kv_idx - q_idx + (n - 1)]


def contender(name: str, kind: str, n: int, grad: bool) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor], int]:
    """A call returning the output, the tensors whose gradients it produces, and the bytes of what
    was built for it beforehand (SDPA's dense mask)."""
    q, k, v = inputs(n, grad)
    parts = features(kind, grad)
    learn = [q, k, v] if grad else []
    if name == "plain":
        return (lambda: qkv.attention(q, k, v, is_causal=True)), learn, 0
    if name == "qkv":
        learn += [t for t in (*getattr(parts.get("score_mod"), "tensors", lambda: ())(), parts.get("sinks")) if t is not None and t.requires_grad]
        return (lambda: qkv.attention(q, k, v, is_causal=True, **parts)), learn, 0
    if name == "sdpa":
        mask = dense_bias(kind, parts, n)
        return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)), learn, mask.nbytes
    from torch.nn.attention.flex_attention import create_block_mask

    mod = flex_score(kind, parts, n)
    block = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device="cpu")
    flex = compiled_flex()
    return (lambda: flex(q, k, v, score_mod=mod, block_mask=block)), learn, 0


def step(fn: Callable[[], torch.Tensor], learn: list[torch.Tensor], dout: Optional[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """One timed call: the forward, and with ``dout`` the backward into ``learn``."""
    if dout is None:
        return fn

    def both() -> torch.Tensor:
        for t in learn:
            t.grad = None
        out = fn()
        out.backward(dout)
        return out

    return both


def run_cell(kind: str, n: int, grad: bool, rounds: int) -> dict[str, Any]:
    row: dict[str, Any] = {"kind": kind, "n": n, "pass": "forward+backward" if grad else "forward"}
    calls, outs = {}, {}
    for name in CONTENDERS:  # flex with gradients too: reported n/a with the reason where it fails
        try:
            fn, learn, _ = contender(name, kind, n, grad)
            dout = torch.randn(1, H, n, D, generator=torch.Generator().manual_seed(2)) if grad else None
            call = step(fn, learn, dout)
            t0 = time.perf_counter()
            with torch.set_grad_enabled(grad):
                outs[name] = call().detach()
            if name == "flex":
                row["flex_first_call_s"] = time.perf_counter() - t0  # compilation, mostly
            calls[name] = call
        except Exception as e:  # noqa: BLE001 - a contender that cannot run the cell is reported, not fatal
            row[f"{name}_na"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
            if name == "flex" and not isinstance(e, Unsupported):
                reset_flex()  # after a failed compile dynamo leaves flex_attention uncompiled, 8× slower
    for name, out in outs.items():
        if name in ("sdpa", "flex") and "qkv" in outs:
            row[f"{name}_max_diff"] = float((out - outs["qkv"]).abs().max())
    samples: dict[str, list[float]] = {name: [] for name in calls}
    peers = [name for name in calls if name not in ("plain", "qkv")]
    with torch.set_grad_enabled(grad):
        for r in range(rounds):
            # qkv and its plain call back to back (in turns first), so that each round's ratio
            # sees one machine state; the peers after them, in turns too
            pair = [name for name in ("plain", "qkv")[:: 1 if r % 2 == 0 else -1] if name in calls]
            for name in pair + peers[r % max(1, len(peers)) :] + peers[: r % max(1, len(peers))]:
                t0 = time.process_time()
                calls[name]()
                samples[name].append(time.process_time() - t0)
    for name, ts in samples.items():
        row[f"{name}_s"] = statistics.median(ts)
    if "qkv" in samples and "plain" in samples:
        row["ratio"] = statistics.median(a / b for a, b in zip(samples["qkv"], samples["plain"]))
    row["backend"] = qkv_backend(kind, n, grad)
    print(json.dumps(row), flush=True)
    return row


def qkv_backend(kind: str, n: int, grad: bool) -> str:
    """The backends auto picks for the plain and the scored call."""
    from qkv.backends import select
    from qkv.call import validate

    q, k, v = inputs(n, grad)
    names = []
    for parts in ({}, features(kind, grad)):
        call = validate(q, k, v, is_causal=True, **parts)
        with torch.set_grad_enabled(grad):
            names.append(select(call).NAME)
    return " / ".join(names)


# ---- memory -------------------------------------------------------------------------------


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)
        return True
    except OSError:
        return False


def memory_child(name: str, kind: str, n: int, grad: bool) -> None:
    torch.set_num_threads(1)
    fn, learn, held = contender(name, kind, n, grad)
    dout = torch.randn(1, H, n, D) if grad else None
    call = step(fn, learn, dout)
    with torch.set_grad_enabled(grad):
        call()  # warm-up: lazy imports, the compiled kernel, allocator caches
        for t in learn:
            t.grad = None
        gc.collect()
        exact = _reset_peak()
        before = proc_status_kib("VmRSS")
        out = call()
        peak = proc_status_kib("VmHWM")
    print(json.dumps({"extra_bytes": (peak - before) * 1024, "held_bytes": held, "peak_reset": exact, "out_sum": float(out.detach().sum())}))


def memory_grid(n: int) -> list[dict]:
    rows = []
    cases = [(name, kind) for kind in KINDS for name in CONTENDERS if not (name == "plain" and kind != KINDS[0])]
    for grad in (False, True):
        for name, kind in cases:
            res = subprocess.run(
                [sys.executable, __file__, "--memory-child", name, kind, str(n), str(int(grad))],
                capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            row = {"contender": name, "kind": "—" if name == "plain" else kind, "n": n, "pass": "forward+backward" if grad else "forward"}
            if res.returncode == 0:
                row.update(json.loads(res.stdout.strip().splitlines()[-1]))
            else:
                last = (res.stderr.strip().splitlines() or ["failed"])[-1]
                row["na"] = last[:160]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ---- report -------------------------------------------------------------------------------

LABEL = {"softcap": "softcap 30·tanh(s/30)", "alibi": "ALiBi", "t5": "T5 relative bias", "sinks": "sinks"}


def _ms(row: dict, name: str) -> str:
    if f"{name}_s" in row:
        t = row[f"{name}_s"] * 1e3
        return f"{t:.1f}" if t >= 10 else f"{t:.2f}"
    return "n/a"


def _vs_plain(row: dict, name: str) -> str:
    return f"{row[f'{name}_s'] / row['plain_s']:.2f}" if f"{name}_s" in row and "plain_s" in row else "—"


def write_report(meta: dict, rows: list[dict], mem: list[dict], path: Path) -> None:
    lines = [
        "# Score functions and sinks on the CPU",
        "",
        f"{meta['date']} · {meta['cpu']} · {meta['threads']} thread · torch {meta['torch']} · Python {meta['python']} · git {meta['git']}",
        "",
        f"float32, causal, batch 1 × {H} heads, head dim {D}. Median CPU time (ms) over {meta['rounds']} interleaved rounds "
        f"({meta['rounds_4096']} at N = 4096). `× plain`: time over qkv's same call without the score function or "
        f"sinks, measured in the same run; for qkv (bold, target ≤ {TARGET}×) the median of the rounds' ratios, the two "
        "calls timed back to back in each round. `sdpa`: "
        "the bias as an (H, N, N) float mask built outside the timing; `flex`: compiled flex_attention with a causal "
        "block mask. `n/a`: the contender cannot express the cell (reasons below the table).",
        "",
        "| N | pass | cell | qkv plain ms | qkv ms | × plain | SDPA dense ms | × plain | flex ms | × plain | auto runs (plain / qkv) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    reasons: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        for name in ("sdpa", "flex"):
            if f"{name}_na" in r:
                cells = reasons.setdefault((name, r[f"{name}_na"]), [])
                if LABEL[r["kind"]] + f" ({r['pass']})" not in cells:
                    cells.append(LABEL[r["kind"]] + f" ({r['pass']})")
        ratio = f"**{r['ratio']:.2f}**" if "ratio" in r else "—"
        lines.append(
            f"| {r['n']} | {r['pass']} | {LABEL[r['kind']]} | {_ms(r, 'plain')} | {_ms(r, 'qkv')} | {ratio} | "
            f"{_ms(r, 'sdpa')} | {_vs_plain(r, 'sdpa')} | {_ms(r, 'flex')} | {_vs_plain(r, 'flex')} | {r['backend']} |"
        )
    lines.append("")
    for label, kinds in (("built-in score functions", ("softcap", "alibi", "t5")), ("sinks", ("sinks",))):
        for p in ("forward", "forward+backward"):
            sel = [r["ratio"] for r in rows if "ratio" in r and r["kind"] in kinds and r["pass"] == p]
            if sel:
                lines.append(f"- qkv with {label}, {p}: {min(sel):.2f}–{max(sel):.2f}× plain (target ≤ {TARGET}×)")
    if reasons:
        lines += ["", "Not run:", ""]
        for (name, why), cells in reasons.items():
            lines.append(f"- {name}: {', '.join(cells)}: {why}")
    diffs = [r[f"{n}_max_diff"] for r in rows for n in ("sdpa", "flex") if f"{n}_max_diff" in r]
    if diffs:
        lines += ["", f"Every peer computes the same function: the largest |Δ| between a peer's output and qkv's is {max(diffs):.1e}."]
    flex_compile = [r["flex_first_call_s"] for r in rows if "flex_first_call_s" in r]
    if flex_compile:
        lines += [f"flex_attention's first call per cell (compilation) took {min(flex_compile):.1f}–{max(flex_compile):.1f} s."]
    if mem:
        n = mem[0]["n"]
        lines += [
            "",
            f"Peak memory at N = {n}, MiB: `call` is the growth of peak resident memory over one call in a fresh process "
            f"(after a warm-up call of the same shape); `mask` is SDPA's dense bias, built before the call. For scale: "
            f"q, k, v take {3 * H * n * D * 4 / 2**20:.0f} MiB, the N × N float32 scores of all {H} heads {H * n * n * 4 / 2**20:.0f} MiB.",
            "",
            "| contender | cell | forward: call | forward: call + mask | forward+backward: call | forward+backward: call + mask |",
            "|---|---|---:|---:|---:|---:|",
        ]
        by: dict[tuple[str, str], dict[str, dict]] = {}
        for m in mem:
            by.setdefault((m["contender"], m["kind"]), {})[m["pass"]] = m
        for (name, kind), passes in by.items():
            if not any("extra_bytes" in m for m in passes.values()):
                continue  # cannot express the cell (see above)
            cells = []
            for p in ("forward", "forward+backward"):
                m = passes.get(p, {})
                if "extra_bytes" in m:
                    cells += [f"{m['extra_bytes'] / 2**20:.1f}", f"{(m['extra_bytes'] + m['held_bytes']) / 2**20:.1f}"]
                else:
                    cells += ["n/a", "n/a"]
            label = "(no score function)" if name == "plain" else LABEL.get(kind, kind)
            lines.append(f"| {name} | {label} | {' | '.join(cells)} |")
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "time": rows, "memory": mem}, indent=1))
    print(f"wrote {path}")


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "?"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-child":
        name, kind, n, grad = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
        memory_child(name, kind, n, grad)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "score_mods_cpu.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ns, rounds, rounds_big = ([256, 1024], 5, 3) if args.quick else ([1024, 4096], 21, 11)
    meta = {
        "date": dt.date.today().isoformat(), "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "git": git_rev(), "rounds": rounds, "rounds_4096": rounds_big,
    }  # fmt: skip
    rows = []
    for n in ns:
        for grad in (False, True):
            for kind in KINDS:
                rows.append(run_cell(kind, n, grad, rounds if n < 4096 else rounds_big))
    mem = [] if args.no_memory else memory_grid(ns[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_report(meta, rows, mem, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
