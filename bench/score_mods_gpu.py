"""Score functions and sinks on a GPU: qkv's triton kernels next to compiled FlexAttention and
SDPA with the bias materialised as a dense float mask, forward and forward + backward, with
the memory each needs.

    python bench/score_mods_gpu.py [--n 4096] [--heads 16] [--dim 128] [--out-dir bench/results]

Cells (bf16, causal, B·N = 16k tokens): plain attention, softcap 30·tanh(s/30), ALiBi, T5
relative bias (32 buckets), sinks. TFLOP/s count 4·B·H·N²·D / 2 (causal) forward, 2.5× that
backward (FlashAttention's convention); times are ``triton.testing.do_bench`` medians. Every
output is checked against the float32 ``math`` backend on the first 256 query rows.
FlexAttention has no sinks (``n/a``); SDPA has no score function, so only the additive
biases (ALiBi, T5) run there, with their (H, N, N) mask built once outside the timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_gpu  # noqa: E402  (the benchmark script beside this one)

import qkv  # noqa: E402
from qkv.score_mods import ALiBi, RelativeBias, Softcap, alibi_slopes  # noqa: E402

KINDS = ("plain", "softcap", "alibi", "t5", "sinks")


def score_parts(kind: str, heads: int, device: str) -> dict[str, Any]:
    """The qkv arguments of a cell and the same function for FlexAttention / SDPA."""
    if kind == "softcap":
        return {"score_mod": Softcap(30.0)}
    if kind == "alibi":
        return {"score_mod": ALiBi(alibi_slopes(heads).to(device))}
    if kind == "t5":
        return {"score_mod": RelativeBias(torch.randn(32, heads, device=device) * 0.5, bidirectional=False)}
    if kind == "sinks":
        return {"sinks": torch.randn(heads, device=device)}
    return {}


def flex_score(kind: str, parts: dict[str, Any], n: int) -> Optional[Callable]:
    """FlexAttention's score_mod for a cell (built-ins follow the same contract), None for plain;
    raises for sinks, which FlexAttention has no argument for."""
    if kind == "sinks":
        raise attention_gpu.Unsupported("FlexAttention has no attention sinks")
    mod = parts.get("score_mod")
    if mod is None:
        return None
    if kind == "t5":  # FlexAttention traces the function: give it a gather it can compile
        rel = mod.kernel_form(mod.table.shape[1], n, n, "top_left", torch.float32).rel  # (H, 2N-1)
        return lambda score, b, h, q_idx, kv_idx: score + rel[h, kv_idx - q_idx + (n - 1)]
    return mod


def dense_bias(kind: str, parts: dict[str, Any], n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The score function as an (H, N, N) additive mask, causal −∞ included (SDPA's only way)."""
    mod = parts.get("score_mod")
    if kind not in ("alibi", "t5") or mod is None:
        raise attention_gpu.Unsupported("SDPA has no score function (only an additive bias)")
    h = mod.slopes.shape[0] if kind == "alibi" else mod.table.shape[1]
    i, j = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    bias = mod.bias(j - i, torch.arange(h, device=device)[:, None, None], torch.float32)  # (H, N, N)
    return bias.masked_fill(j > i, float("-inf")).to(dtype)


def run_cell(impl: str, kind: str, b: int, h: int, n: int, d: int, time_ms, device: str) -> dict[str, Any]:
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    parts = score_parts(kind, h, device)
    if impl == "qkv":
        fn = lambda: qkv.attention(q, k, v, is_causal=True, backend="triton", **parts)  # noqa: E731
    elif impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        mod = flex_score(kind, parts, n)
        block = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, n, n, device=device)
        flex = attention_gpu.compiled_flex()
        fn = lambda: flex(q, k, v, score_mod=mod, block_mask=block)  # noqa: E731
    elif kind == "plain":
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    else:
        mask = dense_bias(kind, parts, n, dtype, device)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ref = qkv.attention(q[:, :, :256].float(), k.float(), v.float(), is_causal="top_left", backend="math", **parts)
    err = float((out[:, :, :256].float() - ref).abs().max())
    fwd = time_ms(fn)

    def both():
        o = fn()
        o.backward(dout)

    total = time_ms(both, grad_to_none=[q, k, v])
    flops = 4 * b * h * n * n * d / 2
    return {
        "impl": impl, "kind": kind, "fwd_ms": fwd, "fwd_bwd_ms": total, "fwd_tflops": flops / fwd / 1e9,
        "fwd_bwd_tflops": 3.5 * flops / total / 1e9, "peak_mib": peak / 2**20, "max_err": err,
    }  # fmt: skip


def render(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# Score functions and sinks on {meta['device']}",
        "",
        f"{meta['when']} · torch {meta['torch']} · triton {meta['triton']} · git {meta['git']} · "
        f"B={meta['b']}, H={meta['h']}, N={meta['n']}, D={meta['d']}, bf16, causal",
        "",
        "Forward / forward+backward in ms (TFLOP/s), peak memory of one forward+backward, and the",
        "largest error against the float32 math backend on 256 query rows. `n/a`: the peer cannot",
        "express the cell.",
        "",
        "| cell | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | peak MiB | max err |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | {r['impl']} | n/a | | | | | {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['kind']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | {r['fwd_bwd_ms']:.3f} | "
            f"{r['fwd_bwd_tflops']:.0f} | {r['peak_mib']:.0f} | {r['max_err']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    time_ms = attention_gpu.gpu_timer(25, 100)
    b = max(1, args.tokens // args.n)
    rows = []
    for kind in KINDS:
        for impl in ("qkv", "flex", "sdpa"):
            try:
                r = run_cell(impl, kind, b, args.heads, args.n, args.dim, time_ms, "cuda")
            except Exception as e:  # noqa: BLE001 - a peer that cannot run the cell is reported, not fatal
                r = {"impl": impl, "kind": kind, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            print(json.dumps(r), flush=True)
            rows.append(r)
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    meta = {
        "device": torch.cuda.get_device_name(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__, "triton": triton.__version__, "git": attention_gpu.git_rev(),
        "b": b, "h": args.heads, "n": args.n, "d": args.dim,
    }  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"score_mods_gpu_{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = render(rows, meta)
    (args.out_dir / f"score_mods_gpu_{name}.md").write_text(text)
    print(text)
    bad = [r for r in rows if r["impl"] == "qkv" and ("error" in r or r["max_err"] > 0.05)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
