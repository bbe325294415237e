"""CPU benchmark matrix: ``qkv.attention`` against torch SDPA and compiled FlexAttention,
measured side by side in one run, for every kind of call qkv accepts.

    python bench/attention_matrix.py                      # the default grid, writes bench/results/attention_matrix.md
    python bench/attention_matrix.py --n 1024 --threads 1 --dtypes float32 --passes fwd   # one slice

Each cell times the same call four ways, interleaved round by round so that drift on a shared
machine hits every contender alike (best of the rounds, after a warm-up call):

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` given the cheapest form of
  the call it accepts: ``is_causal``, a ``CausalBias`` for bottom-right causality, a broadcast
  ``(B, 1, 1, Nk)`` mask for key padding, ``enable_gqa``, and a dense mask only where nothing
  cheaper exists (sliding windows, block-sparse masks). It has no differentiable lse.
- ``flex``: ``torch.compile(flex_attention)`` with a ``BlockMask`` built once per shape (its
  construction and the compilation are not timed; the first-call latency is reported apart).
- ``auto`` and ``chunked``: ``qkv.attention`` with the call's own arguments.

Forward+backward cells time ``out.backward(dout)`` after the forward (and ``lse`` gradients
for the return_lse kind). FLOPs are not reported: the kinds skip different amounts of work.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import cpu_name, gemm_peak, time_cell  # noqa: E402
import qkv  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ["plain", "causal", "causal_bottom_right", "window_128", "window_512", "key_padding", "gqa_8_2", "block_sparse_10", "lse_grad"]
CONTENDERS = ["sdpa", "flex", "auto", "chunked"]
B, H, D = 1, 8, 64
BLOCK = 128  # block size of the block-sparse layout (FlexAttention's default block)
SLOW_CALL_S = 5.0  # a warm-up call longer than this counts as the first timed round (see time_cell)


def _kind(name: str) -> str:
    """A kind for ``--kinds``: one of KINDS, or ``window_W`` for a causal window of any width W."""
    if name in KINDS or (name.startswith("window_") and name[7:].isdigit() and int(name[7:]) > 0):
        return name
    raise argparse.ArgumentTypeError(f"unknown kind {name!r}: choose from {KINDS} or window_W for another width W")


def _kind_order(kind: str) -> tuple[int, int]:
    """Report order: the default kinds in KINDS order, other windows among the windows by width."""
    if kind.startswith("window_"):
        return KINDS.index("window_128"), int(kind[7:])
    return KINDS.index(kind), 0


torch._dynamo.config.cache_size_limit = 512  # one compiled FlexAttention per shape and mask
_flex = torch.compile(flex_attention, dynamic=False)


def _block_sparse_mask(n: int, density: float, seed: int = 0) -> torch.Tensor:
    """A bool (n, n) mask of 128 × 128 blocks kept at ``density`` (the diagonal blocks always,
    so that no row is empty)."""
    nb = -(-n // BLOCK)
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(nb, nb, generator=g) < density
    keep |= torch.eye(nb, dtype=torch.bool)
    return keep.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :n].contiguous()


class Cell:
    """The inputs and the four callables of one (kind, N, dtype) cell."""

    def __init__(self, kind: str, n: int, dtype: torch.dtype, grad: bool) -> None:
        g = torch.Generator().manual_seed(n)
        b, hk, nq = B, H, n
        if kind == "key_padding":
            b = 2
        if kind == "gqa_8_2":
            hk = 2
        if kind == "causal_bottom_right":
            nq = n // 4
        mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
        self.q, self.k, self.v = mk(b, H, nq, D), mk(b, hk, n, D), mk(b, hk, n, D)
        self.kind, self.n, self.nq, self.b, self.grad = kind, n, nq, b, grad
        self.qkv_kw: dict = {}
        self.sdpa_kw: dict = {}
        mask_mod: Optional[Callable] = None
        if kind == "causal":
            self.qkv_kw = {"is_causal": True}
            self.sdpa_kw = {"is_causal": True}
            mask_mod = lambda b, h, i, j: j <= i  # noqa: E731
        elif kind == "causal_bottom_right":
            off = n - nq
            self.qkv_kw = {"is_causal": "bottom_right"}
            self.sdpa_kw = {"attn_mask": causal_lower_right(nq, n)}
            mask_mod = lambda b, h, i, j: j <= i + off  # noqa: E731
        elif kind.startswith("window_"):
            w = int(kind.split("_")[1])
            self.qkv_kw = {"is_causal": True, "window": (w, 0)}
            i = torch.arange(n)
            self.sdpa_kw = {"attn_mask": (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= w)}
            mask_mod = lambda b, h, i, j: (j <= i) & (i - j <= w)  # noqa: E731
        elif kind == "key_padding":
            lengths = torch.tensor([n, int(0.4 * n)])  # one full sequence, one 60% padding
            kp = torch.arange(n)[None, :] < lengths[:, None]
            self.qkv_kw = {"key_padding_mask": kp}
            self.sdpa_kw = {"attn_mask": kp[:, None, None, :]}
            mask_mod = lambda b, h, i, j: j < lengths[b]  # noqa: E731
        elif kind == "gqa_8_2":
            self.qkv_kw = {"is_causal": True, "enable_gqa": True}
            self.sdpa_kw = {"is_causal": True, "enable_gqa": True}
            mask_mod = lambda b, h, i, j: j <= i  # noqa: E731
        elif kind == "block_sparse_10":
            dense = _block_sparse_mask(n, 0.10)
            self.qkv_kw = {"attn_mask": dense}
            self.sdpa_kw = {"attn_mask": dense}
            mask_mod = lambda b, h, i, j: dense[i, j]  # noqa: E731
        elif kind == "lse_grad":
            self.qkv_kw = {"is_causal": True, "return_lse": True}
            mask_mod = lambda b, h, i, j: j <= i  # noqa: E731
        self.block_mask = None if mask_mod is None else create_block_mask(mask_mod, self.b if kind == "key_padding" else None, None, nq, n, device="cpu")
        self.dout = torch.randn(b, H, nq, D, generator=g).to(dtype)
        self.dlse = torch.randn(b, H, nq, generator=g)

    def _loss(self, res) -> Optional[torch.Tensor]:
        if not self.grad:
            return None
        out, lse = res if isinstance(res, tuple) else (res, None)
        loss = (out.float() * self.dout.float()).sum()
        if lse is not None:
            loss = loss + (lse.float() * self.dlse).sum()
        return loss

    def fn(self, contender: str) -> Optional[Callable[[], object]]:
        q, k, v = self.q, self.k, self.v
        if contender == "sdpa":
            if self.kind == "lse_grad":
                return None  # SDPA's lse is not differentiable (and not public)
            call = lambda: F.scaled_dot_product_attention(q, k, v, **self.sdpa_kw)  # noqa: E731
        elif contender == "flex":
            kw = {"block_mask": self.block_mask, "enable_gqa": self.kind == "gqa_8_2"}
            if self.kind == "lse_grad":
                kw["return_lse"] = True
            call = lambda: _flex(q, k, v, **kw)  # noqa: E731
        else:
            call = lambda: qkv.attention(q, k, v, backend=contender, **self.qkv_kw)  # noqa: E731
        if not self.grad:
            return call

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            self._loss(call()).backward()

        return fwd_bwd


def run_cell(kind: str, n: int, dtype: torch.dtype, grad: bool, threads: int, rounds: int,
             contenders: tuple[str, ...] = tuple(CONTENDERS)) -> dict:
    torch.set_num_threads(threads)
    cell = Cell(kind, n, dtype, grad)
    row: dict = {"kind": kind, "n": n, "nq": cell.nq, "dtype": str(dtype).replace("torch.", ""), "pass": "fwd+bwd" if grad else "fwd", "threads": threads}
    fns: dict[str, Callable[[], object]] = {}
    warm: dict[str, float] = {}
    for name in CONTENDERS:
        fn = cell.fn(name) if name in contenders else None
        if fn is None:
            row[name] = None
            continue
        try:
            t0 = time.perf_counter()
            fn()  # the warm-up call; flex compiles here
            first = time.perf_counter() - t0
            if name == "flex":
                row["flex_first_call_s"] = first
            elif first > SLOW_CALL_S:
                warm[name] = first
            fns[name] = fn
        except Exception as e:  # e.g. FlexAttention has no CPU backward
            row[name] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    row.update(time_cell(fns, rounds, warm))
    if warm:
        row["warm_up_timed"] = sorted(warm)
    peers = [row[p] for p in ("sdpa", "flex") if row.get(p)]
    if peers and row.get("auto"):
        row["auto_vs_best_peer"] = row["auto"] / min(peers)
    if row.get("sdpa") and row.get("chunked"):
        row["chunked_vs_sdpa"] = row["chunked"] / row["sdpa"]
    return row


DENSE = ("plain", "causal", "causal_bottom_right", "gqa_8_2")  # the cells that compute every allowed pair


def flops(row: dict) -> Optional[float]:
    """FLOPs of a dense cell, FlashAttention's convention: 4·B·H·D per allowed (query, key) pair
    forward (QKᵀ and PV), 2.5× that backward; causal cells count the pairs the mask allows."""
    if row["kind"] not in DENSE:
        return None
    n, nq = row["n"], row.get("nq", row["n"])
    if row["kind"] == "plain":
        pairs = nq * n
    else:  # causal, aligned so that the last query sees the last key
        pairs = nq * (n - nq) + nq * (nq + 1) // 2
    fwd = 4 * B * H * D * pairs
    return fwd * (3.5 if row["pass"] == "fwd+bwd" else 1.0)


def _rate(row: dict, peak: dict) -> str:
    f, t = flops(row), row.get("auto")
    p = peak.get(str(row["threads"])) if row["dtype"] == "float32" else None
    if f is None or not t or not p:
        return "—"
    return f"{f / t / 1e9:.0f} ({100 * f / t / p:.0f}%)"


def _fmt(t: Optional[float]) -> str:
    return "—" if t is None else f"{t * 1e3:.1f}"


def write_report(meta: dict, rows: list[dict], path: Path) -> None:
    lines = [
        "# qkv CPU benchmark matrix",
        "",
        f"{meta['date']} · {meta['cpu']} ({meta['cores']} cores) · torch {meta['torch']} · Python {meta['python']}",
        "",
        *([meta["note"], ""] if meta.get("note") else []),
        f"Times in ms, best of each row's interleaved rounds after a warm-up call (a warm-up call over {SLOW_CALL_S:g} s counts as the first round); B = {B} (2 for key padding), H = {H}, D = {D}. "
        "`auto ÷ best` is qkv auto's time over the faster of SDPA and compiled Flex (below 1: qkv is faster); "
        "`chunked ÷ sdpa` compares the path that never holds N × N with SDPA. `—`: the contender cannot run the call "
        "(SDPA has no differentiable lse; FlexAttention has no CPU backward).",
        "",
        "Kinds: plain; causal; causal_bottom_right (Nq = N/4, Nk = N); window_w (causal, w keys back); key_padding "
        "(B = 2, lengths N and 0.4 N); gqa_8_2 (causal, 8 query heads on 2 key/value heads); block_sparse_10 "
        "(bool mask of 128 × 128 blocks at 10% density); lse_grad (causal with return_lse and gradients through it).",
        "",
        "`auto GFLOP/s` (dense float32 cells): qkv auto's rate, FlashAttention's convention (4·B·H·D per allowed "
        "(query, key) pair forward, 2.5× that backward; causal cells count the pairs the mask allows), and its share of "
        "the float32 GEMM peak measured on this machine ("
        + ", ".join(f"{t} thread{'s' if t != '1' else ''}: {v / 1e9:.0f} GFLOP/s" for t, v in sorted(meta.get("gemm_flops", {}).items()))
        + ").",
        "",
        "| kind | N | dtype | pass | threads | rounds | sdpa | flex | qkv auto | qkv chunked | auto ÷ best | chunked ÷ sdpa | auto GFLOP/s (% of peak) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = lambda r: (r["threads"], r["dtype"] != "float32", r["n"], r["pass"], _kind_order(r["kind"]))  # noqa: E731
    for r in sorted(rows, key=order):
        ab = r.get("auto_vs_best_peer")
        cs = r.get("chunked_vs_sdpa")
        lines.append(
            f"| {r['kind']} | {r['n']} | {r['dtype']} | {r['pass']} | {r['threads']} | {r.get('rounds', meta['rounds'])} | {_fmt(r.get('sdpa'))} | {_fmt(r.get('flex'))} | "
            f"{_fmt(r.get('auto'))} | {_fmt(r.get('chunked'))} | {'—' if ab is None else f'{ab:.2f}'} | {'—' if cs is None else f'{cs:.2f}'} | "
            f"{_rate(r, meta.get('gemm_flops', {}))} |"
        )
    firsts = [r["flex_first_call_s"] for r in rows if "flex_first_call_s" in r]
    if firsts:
        lines += ["", f"FlexAttention's first call per shape (compilation) took {min(firsts):.1f}–{max(firsts):.1f} s; qkv has no compile step."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--kinds", nargs="+", default=KINDS, type=_kind, metavar="KIND", help=f"{', '.join(KINDS)}, or window_W")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS),
                    help="time only these (e.g. auto chunked, to compare two versions of qkv)")
    ap.add_argument("--out", default=str(RESULTS / "attention_matrix"), help="path without suffix for .md and .json")
    ap.add_argument("--append", action="store_true", help="add to (or replace cells of) the rows already in OUT.json")
    ap.add_argument("--note", default="", help="a line for the report's header (what was re-measured when, and why)")
    ap.add_argument("--report-only", action="store_true",
                    help="measure the GEMM peak and rewrite OUT.md from OUT.json, timing no cell")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        data = json.loads(out.with_suffix(".json").read_text())
        data["meta"]["gemm_flops"] = {str(t): gemm_peak(t) for t in sorted({r["threads"] for r in data["rows"]})}
        out.with_suffix(".json").write_text(json.dumps(data, indent=1))
        write_report(data["meta"], data["rows"], out.with_suffix(".md"))
        return
    old = json.loads(out.with_suffix(".json").read_text()) if args.append and out.with_suffix(".json").exists() else {}
    rows: list[dict] = old.get("rows", [])
    for threads in dict.fromkeys(args.threads):
        for dtype in args.dtypes:
            for n in args.n:
                for p in args.passes:
                    for kind in args.kinds:
                        row = run_cell(kind, n, getattr(torch, dtype), p == "fwd+bwd", threads, args.rounds, tuple(args.contenders))
                        row["rounds"] = args.rounds
                        same = ("kind", "n", "dtype", "pass", "threads")
                        rows = [r for r in rows if any(r[f] != row[f] for f in same)] + [row]  # a rerun replaces its cell
                        print(json.dumps(row), flush=True)
    meta = {
        "date": dt.date.today().isoformat(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        # An appended run keeps the report's header (edit it with --note) and its rounds wording,
        # which then covers cells measured with different round counts; each row keeps its own.
        "rounds": old.get("meta", {}).get("rounds", args.rounds),
        "note": args.note or old.get("meta", {}).get("note", ""),
        "gemm_flops": {str(t): gemm_peak(t) for t in dict.fromkeys(args.threads)},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_report(meta, rows, out.with_suffix(".md"))


if __name__ == "__main__":
    main()
