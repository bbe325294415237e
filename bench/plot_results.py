"""The benchmark results as plots for the documentation: one line per engine against N.

    python bench/plot_results.py                 # every result file below → docs/images/bench_*.png
    python bench/plot_results.py --out /tmp/img  # elsewhere

Reads the committed JSON beside the tables (``bench/results/``) and draws what the tables say,
so a reader compares engines by looking:

- ``attention_gpu_<device>.json`` (``bench/attention_gpu.py``, the GPU check's benchmark) →
  ``bench_gpu_<device>.png``: TFLOP/s of bf16 attention against N, one panel per head dim and
  pass (forward, forward + backward), one colour per engine (qkv's triton kernels, ``auto``,
  SDPA's flash and cuDNN kernels, compiled FlexAttention), solid lines for full attention and
  dashed for causal, the device's measured matmul ceiling as a grey line; and, when the run has
  them, ``bench_gpu_<device>_decode.png``: GB/s of K and V per decoding cell against the copy
  rate.
- ``attention_cpu.json`` (``bench/attention_cpu.py``) → ``bench_cpu.png``: seconds per call
  against N on log axes, full and causal, each of qkv's backends beside torch's SDPA.

Nothing is measured here: a plot is only as good as the run it draws, whose machine, versions
and date are in the title.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
IMAGES = ROOT / "docs" / "images"
# one colour per engine, the same in every plot
COLORS = {
    "qkv": "#d62728", "auto": "#ff7f0e", "sdpa-flash": "#1f77b4", "sdpa-cudnn": "#2ca02c", "flex": "#9467bd",
    "sdpa-efficient": "#8c564b", "sdpa-math": "#7f7f7f", "chunked": "#d62728", "math": "#17becf", "sdpa": "#1f77b4",
}  # fmt: skip
LABELS = {"qkv": "qkv triton", "flex": "compiled Flex", "chunked": "qkv chunked", "math": "qkv math", "sdpa": "torch SDPA"}
GPU_ENGINES = ("qkv", "auto", "sdpa-flash", "sdpa-cudnn", "flex")
MODES = {"fwd": "forward", "fwd+bwd": "forward + backward"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rate(res: Optional[dict], mode: str, key: str = "tflops") -> Optional[float]:
    if res and res.get("status") == "ok" and res.get("modes", {}).get(mode, {}).get("status") == "ok":
        return res["modes"][mode].get(key)
    return None


def gpu_series(data: dict) -> dict[tuple[int, str, bool, str], list[tuple[int, float]]]:
    """``(head dim, mode, causal, engine) → [(N, TFLOP/s)]`` of the dense cases, N ascending."""
    out: dict[tuple[int, str, bool, str], list[tuple[int, float]]] = {}
    for c in data.get("cases", []):
        if c.get("kind") != "dense":
            continue
        for name in GPU_ENGINES:
            for mode in MODES:
                t = _rate(c["results"].get(name), mode)
                if t is not None:
                    out.setdefault((c["d"], mode, c["causal"], name), []).append((c["n"], t))
    return {k: sorted(v) for k, v in out.items()}


def _n_axis(ax, ns) -> None:
    """A log-2 axis of N labelled with the lengths measured."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ns))
    ax.set_xticklabels([f"{n // 1024}k" if n >= 1024 else str(n) for n in sorted(ns)])
    ax.minorticks_off()


def _title(meta: dict) -> str:
    dev = meta.get("device", "?").split(" (")[0]
    return f"{dev} · torch {meta.get('torch', '?')} · triton {meta.get('triton', '?')} · {meta.get('date', '?')} · git {meta.get('git', '?')}"


def plot_gpu(data: dict, out: Path) -> Optional[Path]:
    """The dense cells of one GPU run: TFLOP/s against N (None when the run has none)."""
    series = gpu_series(data)
    if not series:
        return None
    plt = _pyplot()
    dims = sorted({d for d, *_ in series})
    fig, axes = plt.subplots(len(dims), len(MODES), figsize=(11, 3.6 * len(dims)), squeeze=False, sharex=True)
    run = data["runs"][0]
    ceiling = (run.get("ceilings") or {}).get("matmul_tflops")
    for row, d in enumerate(dims):
        for col, mode in enumerate(MODES):
            ax = axes[row][col]
            for name in GPU_ENGINES:
                for causal in (False, True):
                    pts = series.get((d, mode, causal, name))
                    if pts:
                        ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", ms=3, color=COLORS[name],
                                ls="--" if causal else "-", label=LABELS.get(name, name) if not causal else None)  # fmt: skip
            if ceiling:
                ax.axhline(ceiling, color="#999999", lw=0.8, ls=":")
                ax.annotate(f"bf16 matmul {ceiling:.0f}", (0.01, ceiling), xycoords=("axes fraction", "data"), va="bottom",
                            fontsize=7, color="#777777")  # fmt: skip
            _n_axis(ax, {n for key, pts in series.items() if key[0] == d for n, _ in pts})
            ax.set_ylim(bottom=0, top=(ceiling or ax.get_ylim()[1]) * 1.08)
            ax.set_title(f"head dim {d} · {MODES[mode]}", fontsize=10)
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            if row == len(dims) - 1:
                ax.set_xlabel("N (tokens per sequence; batch × N = 16384)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles += [plt.Line2D([], [], color="black", ls="-"), plt.Line2D([], [], color="black", ls="--")]
    labels += ["full", "causal"]
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle("Attention, bf16: " + _title(run["meta"]), fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_decode(data: dict, out: Path) -> Optional[Path]:
    """The decoding cells of one GPU run: GB/s of K and V per engine (None when there are none)."""
    cells = [c for c in data.get("cases", []) if c.get("kind") == "decode"]
    if not cells:
        return None
    plt = _pyplot()
    run = data["runs"][0]
    copy = (run.get("ceilings") or {}).get("copy_gbps")
    names = [n for n in GPU_ENGINES if any(_rate(c["results"].get(n), "fwd", "gbps") for c in cells)]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        vals = [_rate(c["results"].get(name), "fwd", "gbps") or 0.0 for c in cells]
        ax.bar([j + i * width for j in range(len(cells))], vals, width, color=COLORS[name], label=LABELS.get(name, name))
    if copy:
        ax.axhline(copy, color="#999999", lw=0.8, ls=":")
        ax.annotate(f"device copy {copy:.0f} GB/s", (0.01, copy), xycoords=("axes fraction", "data"), va="bottom", fontsize=7, color="#777777")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))])
    ax.set_xticklabels([f"{c['nq']} row{'s' if c['nq'] > 1 else ''} · {c['n'] // 1024}k keys · {c['hq']}/{c['hkv']} heads" for c in cells], fontsize=8)
    ax.set_ylabel("GB/s of K and V")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    fig.suptitle("Decoding, bf16: " + _title(run["meta"]), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_cpu(data: dict, out: Path) -> Optional[Path]:
    """``attention_cpu.json``: seconds per call against N for each backend and SDPA."""
    rows = data.get("time") or []
    if not rows:
        return None
    plt = _pyplot()
    engines = [k for k in ("auto", "chunked", "math") if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        pts = sorted((r for r in rows if r["causal"] == causal), key=lambda r: r["n"])
        for name in engines:
            got = [(r["n"], r[name]) for r in pts if r.get(name) is not None]
            ax.plot([n for n, _ in got], [t for _, t in got], marker="o", ms=3, color=COLORS[name], label=LABELS.get(name, name))
        peer = [(r["n"], r.get("chunked_peer") or r.get("auto_peer")) for r in pts]
        peer = [(n, t) for n, t in peer if t is not None]
        ax.plot([n for n, _ in peer], [t for _, t in peer], marker="o", ms=3, color=COLORS["sdpa"], ls="--", label="torch SDPA")
        _n_axis(ax, {r["n"] for r in pts})
        ax.set_yscale("log")
        ax.set_title("causal" if causal else "full", fontsize=10)
        ax.set_xlabel("N")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("seconds per call")
    axes[0].legend(fontsize=8, frameon=False)
    m = data.get("meta", {})
    fig.suptitle(f"Attention on a CPU, float32, batch {m.get('b', '?')} × {m.get('h', '?')} heads, head dim {m.get('d', '?')}: "
                 f"{m.get('cpu', '?')} · {m.get('threads', '?')} threads · torch {m.get('torch', '?')} · {m.get('date', '?')}", fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_all(results: Path = RESULTS, out_dir: Path = IMAGES) -> list[Path]:
    """Every plot the result files allow; the paths written."""
    written = []
    for path in sorted(results.glob("attention_gpu_*.json")):
        data = json.loads(path.read_text())
        stem = path.stem.replace("attention_gpu_", "bench_gpu_")
        written += [p for p in (plot_gpu(data, out_dir / f"{stem}.png"), plot_decode(data, out_dir / f"{stem}_decode.png")) if p]
    cpu = results / "attention_cpu.json"
    if cpu.exists():
        written += [p for p in (plot_cpu(json.loads(cpu.read_text()), out_dir / "bench_cpu.png"),) if p]
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the JSON results are (default bench/results)")
    ap.add_argument("--out", type=Path, default=IMAGES, help="where the PNGs go (default docs/images)")
    args = ap.parse_args(argv)
    for p in plot_all(args.results, args.out):
        print("wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
