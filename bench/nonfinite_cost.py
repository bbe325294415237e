"""What the non-finite rule (qkv.nonfinite) costs per call on a GPU: counted on the CPU, timed on the device.

    python bench/nonfinite_cost.py                  # CPU: ops, host syncs and bytes per call (meta tensors)
    python bench/nonfinite_cost.py --gpu            # CUDA: the rule's kernels timed against the engine, per cell

**Counted** (any machine): each call runs on meta tensors routed as on CUDA (the sdpa engine, its
kernel stubbed as one op forward and one backward), the rule's Triton launches recorded instead of
made, every aten op recorded by a dispatch mode. Per call: the tensor ops beside the engine (each a
kernel launch on a GPU), the host syncs, and the bytes the rule moves — for the torch form the sum
over its ops of the bytes they read and write; for the kernels, the bytes of the tensors each
launch reads (q, k, v once; the output too where the formula can make a row NaN) and its flag
words, with finite inputs (bad rows add their writes). Run it on an older tree with
``PYTHONPATH=<tree>`` for the "before" column.

**Timed** (:func:`time_rule`, which ``bench/gpu_check.py`` runs): per cell, the rule's kernels alone
(scan and poison; with gradients the flag words, the poison with its gradient flags and the
gradient fix) against SDPA's kernel for the same call, medians of ``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "as_strided", "detach", "alias",
        "_reshape_alias", "expand", "t", "transpose", "select", "slice", "unsqueeze", "squeeze", "permute", "reshape",
        "_unsafe_view", "unbind", "lift_fresh", "ENGINE", "ENGINE_BWD"}  # fmt: skip
SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose"}

# (name, B, Hq, Hk, Nq, Nk, D, kwargs): the benchmark's cells, bf16
CELLS = [
    ("causal N 1024", 4, 16, 16, 1024, 1024, 128, {"is_causal": True}),
    ("causal N 4096", 4, 16, 16, 4096, 4096, 128, {"is_causal": True}),
    ("full N 16384", 1, 16, 16, 16384, 16384, 128, {}),
    ("GQA 32/8, N 4096", 2, 32, 8, 4096, 4096, 128, {"is_causal": True, "enable_gqa": True}),
    ("decoding 1 × 32k, GQA 32/8", 8, 32, 8, 1, 32768, 128, {"enable_gqa": True}),
    ("float mask, N 1024", 4, 16, 16, 1024, 1024, 128, {"attn_mask": "float"}),
]


def _nbytes(x: Any) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


class _Counter(TorchDispatchMode):
    """Ops outside the stubbed engine, and the bytes each reads and writes."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.bytes = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.paused:
            self.ops.append(name)
            if name not in FREE:
                flat = list(args) + list((kwargs or {}).values()) + (list(out) if isinstance(out, (tuple, list)) else [out])
                self.bytes += sum(_nbytes(x) for x in flat)
        return out


def _stub_engine(rec: _Counter):
    class Engine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            rec.paused = True
            ctx.inputs = (q, k, v)
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            rec.paused = False
            rec.ops.append("ENGINE")
            return out

        @staticmethod
        def backward(ctx, dout):
            rec.paused = True
            grads = tuple(torch.empty_like(t) for t in ctx.inputs)
            rec.paused = False
            rec.ops.append("ENGINE_BWD")
            return grads

    return lambda q, k, v, *args, **kwargs: Engine.apply(q, k, v)


def _kernel_bytes(name: str, args: tuple, meta: dict) -> int:
    """Bytes a launch reads with finite inputs: its tensors' rows (scan), the output where it is
    read (poison), and the flag words each program reads first."""
    words = args[0]
    if name == "scan_kernel":
        return sum(_nbytes(t) for t in args[1:4]) + (_nbytes(args[4]) if args[4] is not args[1] else 0) + _nbytes(words)
    if name == "poison_kernel":
        return _nbytes(words) + (_nbytes(args[1]) if meta.get("READ_OUT") else 0)
    return _nbytes(words)


def count(cell: tuple, grad: bool) -> dict[str, Any]:
    """One call of ``cell`` (forward, and backward with ``grad``) on meta tensors, as on CUDA."""
    import qkv
    import qkv.functional  # noqa: F401  (before SDPA is stubbed: it probes torch's kernel once at import)
    from qkv.backends.sdpa import SdpaBackend

    try:
        nd = importlib.import_module("qkv.nonfinite_device")
    except ImportError:
        nd = None
    name, b, hq, hk, nq, nk, d, kw = cell
    kw = dict(kw)
    rec, launches = _Counter(), []
    saved = (SdpaBackend.DEVICES, SdpaBackend.extra_reasons, F.scaled_dot_product_attention)
    SdpaBackend.DEVICES = ("cpu", "cuda", "meta")
    SdpaBackend.extra_reasons = lambda self, call: []
    F.scaled_dot_product_attention = _stub_engine(rec)
    if nd is not None:
        saved_nd = (nd.KERNEL_DEVICES, nd.launch)
        nd.KERNEL_DEVICES = ("cuda", "meta")
        nd.launch = lambda kname, grid, *args, **meta: launches.append((kname, _kernel_bytes(kname, args, meta)))
    try:
        meta_t = lambda *s: torch.empty(*s, device="meta", dtype=torch.bfloat16, requires_grad=grad)  # noqa: E731
        q, k, v = meta_t(b, hq, nq, d), meta_t(b, hk, nk, d), meta_t(b, hk, nk, d)
        if kw.get("attn_mask") == "float":
            kw["attn_mask"] = meta_t(nq, nk)
        with rec:
            res = qkv.attention(q, k, v, backend="sdpa", **kw)
            out = res[0] if isinstance(res, tuple) else res
            if grad:
                torch.autograd.backward(out, torch.empty_like(out))
    finally:
        SdpaBackend.DEVICES, SdpaBackend.extra_reasons, F.scaled_dot_product_attention = saved
        if nd is not None:
            nd.KERNEL_DEVICES, nd.launch = saved_nd
    beside = [op for op in rec.ops if op not in FREE]
    return {
        "cell": name, "grad": grad, "kernels": len(beside) + len(launches), "aten": beside, "launches": [n for n, _ in launches],
        "syncs": sum(op in SYNCS for op in rec.ops), "bytes": rec.bytes + sum(nb for _, nb in launches),
        "inputs": sum(_nbytes(t) for t in (q, k, v)),
    }  # fmt: skip


def count_table(rows: list[dict]) -> list[str]:
    lines = ["| cell | gradients | kernels beside the engine | host syncs | bytes the rule moves | ÷ bytes of q, k, v |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['cell']} | {'yes' if r['grad'] else 'no'} | {r['kernels']} | {r['syncs']} | "
                     f"{r['bytes'] / 1e6:.1f} MB | {r['bytes'] / r['inputs']:.2f} |")  # fmt: skip
    return lines


# ---- timed on a GPU ---------------------------------------------------------------------------

TIMED = [("causal N 1024", 4, 16, 1024, 128, True), ("causal N 4096", 4, 16, 4096, 128, True), ("full N 16384", 1, 16, 16384, 128, False)]


def time_rule(seconds: float = 30.0, cells: list[tuple] = TIMED, device: str = "cuda", timer=None) -> dict[str, Any]:
    """Per cell (bf16), medians in µs: SDPA's forward and forward+backward, the rule's kernels
    for a call without gradients (scan + poison) and with them (flag words, scan, poison with
    gradient flags, gradient fix), and ``auto``'s forward; cells beyond ``seconds`` are left out.
    ``timer(fn) -> µs`` replaces ``do_bench`` (a CPU test runs each function once through
    Triton's interpreter with it)."""
    if device == "cuda" and not torch.cuda.is_available():
        return {"error": "no CUDA device", "rows": []}
    if timer is None:
        import triton.testing

        timer = lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=5, rep=20)  # noqa: E731
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0, rows = time.monotonic(), []
    try:
        _time_cells(cells, seconds, device, dtype, timer, rows, t0)
    except Exception as e:  # a report with what ran, and why the rest did not
        return {"rows": rows, "error": f"{type(e).__name__}: {e}"}
    return {"rows": rows, "device": torch.cuda.get_device_name() if device == "cuda" else device}


def _time_cells(cells, seconds, device, dtype, timer, rows, t0) -> None:
    import qkv
    from qkv import nonfinite_device as nd

    for name, b, h, n, d, causal in cells:
        if time.monotonic() - t0 > seconds:
            break
        q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        dout = torch.randn_like(out)
        us = timer
        plain = out.detach()
        grads = {"query": q.detach().clone(), "key": k.detach().clone(), "value": v.detach().clone()}

        def rule_fwd():
            nd.Rule(q.detach(), k.detach(), v.detach()).finish(plain, None, bias=None, read_out=False)

        def rule_grad():
            r = nd.Rule(q.detach(), k.detach(), v.detach(), {"query": q, "key": k, "value": v})
            r.finish(plain, None, bias=None, read_out=False)
            r.fix_gradients(grads)

        def sdpa_fb():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(o, (q, k, v), dout)

        def auto_fwd():
            with torch.no_grad():
                qkv.attention(q, k, v, is_causal=causal)

        row = {"cell": name}
        with torch.no_grad():
            row["sdpa_fwd"] = us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        row["sdpa_fwd_bwd"] = us(sdpa_fb)
        row["rule_fwd"] = us(rule_fwd)
        row["rule_fwd_bwd"] = us(rule_grad)
        row["auto_fwd"] = us(auto_fwd)
        rows.append(row)
        del q, k, v, out, dout, plain, grads


def render(data: Optional[dict]) -> list[str]:
    """The report's section (``unmeasured`` where nothing ran)."""
    lines = ["", "## The non-finite rule's cost (issue 44: ≤ 5% of the engine at N ≥ 4096, ≤ 10% at N = 1024)", "",
             "Medians (µs, bf16, `do_bench`): the rule's kernels alone against SDPA's kernel for the same call; "
             "`auto` runs SDPA and the rule.", "",
             "| cell | SDPA fwd | rule fwd | share | SDPA fwd+bwd | rule fwd+bwd | share | auto fwd |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    rows = (data or {}).get("rows") or []
    if not rows:
        return lines + [f"| {c[0]} | unmeasured | unmeasured | | unmeasured | unmeasured | | unmeasured |" for c in TIMED] + (
            ["", f"Not measured: {data['error']}"] if data and data.get("error") else [])  # fmt: skip
    for r in rows:
        lines.append(f"| {r['cell']} | {r['sdpa_fwd']:.1f} | {r['rule_fwd']:.1f} | {r['rule_fwd'] / r['sdpa_fwd']:.1%} | "
                     f"{r['sdpa_fwd_bwd']:.1f} | {r['rule_fwd_bwd']:.1f} | {r['rule_fwd_bwd'] / r['sdpa_fwd_bwd']:.1%} | {r['auto_fwd']:.1f} |")  # fmt: skip
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="time the kernels on CUDA (else count on the CPU)")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args(argv)
    if args.gpu:
        data = time_rule()
        print("\n".join(render(data)))
    else:
        data = [count(c, g) for c in CELLS for g in (False, True) if not (g and c[4] == 1)]
        print("\n".join(count_table(data)))
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
