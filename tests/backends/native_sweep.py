"""A seeded sweep of calls through every C entry point, for the sanitizer build.

    QKV_NATIVE_CFLAGS="-fsanitize=address,undefined" LD_PRELOAD=$(cc -print-file-name=libasan.so) \
        python -m tests.backends.native_sweep --seed 1 --calls 300

Each call runs on the C kernels (``qkv/csrc``: the flash forward and backward of the chunked
backend, the fused statistics pass, the per-tile statistics kernel, the exponential) and on the
torch formulation (``QKV_NATIVE=0`` semantics: :func:`torch_path`), and the two must agree; its
last rows also run through the decoding kernel with a float32, bfloat16 or float16 cache,
against the float64 math backend;
the sanitizers (ASan, UBSan) watch every C access. Shapes are drawn to hit the edges: empty
sizes, head dims 1–257 with dv ≠ d, GQA/MQA, Nq ≠ Nk, both causal alignments, windows with −1
and huge sides, key padding with fully padded rows, broadcast (stride-0) K/V, 1–3 threads, and
the built-in score functions (softcap, ALiBi, relative bias, with gradients into their tensors).
Prints one line per failure and exits 1 if any; the sanitizers abort the process themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

import qkv
from qkv.backends import native
from qkv.inspect import attention_stats, attention_with_stats


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Calls inside take the torch formulation: the C kernels look unavailable."""
    saved = native.library
    native.library = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        native.library = saved  # type: ignore[assignment]


def draw(rng: np.random.Generator) -> dict[str, Any]:
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    hk = pick([1, 1, 2, 3])
    return {
        "b": pick([1, 2, 3]),
        "hk": hk,
        "g": pick([1, 1, 2, 4]),
        "nq": pick([0, 1, 2, 5, 17, 33, 70]),
        "nk": pick([0, 1, 3, 16, 17, 40, 97]),
        "d": pick([1, 3, 8, 16, 33, 64, 67, 129, 257]),
        "dv": pick([None, None, 1, 5, 24]),
        "dtype": pick([torch.float32, torch.float32, torch.float64]),
        "causal": pick([False, True, "bottom_right"]),
        "window": pick([None, None, (3, 1), (-1, 2), (5, 0), (sys.maxsize, 4), (2, 2**64)]),
        "padding": pick([None, None, "random", "empty_rows"]),
        "broadcast": bool(rng.random() < 0.3),
        "threads": pick([1, 2, 3]),
        "block": pick([None, None, (1, 1), (7, 5), (2**40, 2**40)]),
        "topk": pick([0, 1, 3, 8]),
        "score": pick([None, None, "softcap", "alibi", "relative", "softcap+alibi"]),
        "cache": pick([torch.float32, torch.bfloat16, torch.float16]),
    }


def tensors(c: dict[str, Any], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    b, hk, g, nq, nk, d = c["b"], c["hk"], c["g"], c["nq"], c["nk"], c["d"]
    dv = c["dv"] or d
    q = torch.randn(b, hk * g, nq, d, generator=gen, dtype=c["dtype"])
    kb = 1 if c["broadcast"] else b
    k = torch.randn(kb, hk, nk, d, generator=gen, dtype=c["dtype"]).expand(b, hk, nk, d)
    v = torch.randn(kb, hk, nk, dv, generator=gen, dtype=c["dtype"]).expand(b, hk, nk, dv)
    return q, k, v


def kwargs(c: dict[str, Any], gen: torch.Generator) -> dict[str, Any]:
    kw: dict[str, Any] = {"enable_gqa": True}
    if c["causal"]:
        kw["is_causal"] = c["causal"]
    if c["window"] is not None:
        kw["window"] = c["window"]
    if c["padding"] is not None and c["nk"]:
        kp = torch.rand(c["b"], c["nk"], generator=gen) > 0.3
        if c["padding"] == "empty_rows":
            kp[0] = False  # a sequence of padding only: every row empty
        kw["key_padding_mask"] = kp
    return kw


def score_mod(c: dict[str, Any], gen: torch.Generator) -> Optional[Callable[[], tuple[Any, list[torch.Tensor]]]]:
    """A maker of the drawn built-in score function and its learnable tensors (fresh leaves each
    time, the same values), or None."""
    from qkv.score_mods import ALiBi, RelativeBias, ScoreMod, Softcap

    kind, hq = c["score"], c["hk"] * c["g"]
    if kind is None:
        return None
    slopes = torch.rand(hq, generator=gen, dtype=c["dtype"])
    table = torch.randn(8, hq, generator=gen, dtype=c["dtype"])
    cap = float(1 + 9 * torch.rand((), generator=gen))

    def make() -> tuple[Any, list[torch.Tensor]]:
        if kind == "softcap":
            return Softcap(cap), []
        if kind == "relative":
            t = table.clone().requires_grad_(True)
            return RelativeBias(t, bidirectional=True, max_distance=20), [t]
        s = slopes.clone().requires_grad_(True)
        alibi = ALiBi(s, alignment="bottom_right" if c["causal"] == "bottom_right" else None)
        if kind == "alibi":
            return alibi, [s]

        class Capped(ScoreMod):  # softcap, then ALiBi's bias: both parts of one kernel form
            softcap, alignment = cap, alibi.alignment

            def bias(self, rel, head, dtype):
                return alibi.bias(rel, head, dtype)

            def tensors(self):
                return (s,)

        return Capped(), [s]

    return make


# Output tolerance per dtype, relative to the largest entry: sums in other orders (float32) or
# the output's own rounding (16-bit).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> str:
    if a.shape != b.shape:
        return f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    tol = TOLERANCE.get(b.dtype, 2e-5)  # counts and indices: exact, far below this
    a, b = a.double(), b.double()
    both = torch.isneginf(a) & torch.isneginf(b)
    diff = torch.where(both, 0.0, (a - b).abs())
    if torch.isnan(a).ne(torch.isnan(b)).any():
        return f"{what}: NaN in different places"
    diff = diff.nan_to_num(0.0)
    scale = max(1.0, float(b.abs().nan_to_num(0.0, 0.0, 0.0).max())) if b.numel() else 1.0
    if diff.numel() and float(diff.max()) > tol * scale:
        return f"{what}: off by {float(diff.max()):.3g}"
    return ""


def attention_calls(q, k, v, kw: dict[str, Any], block, score=None) -> dict[str, torch.Tensor]:
    """Forward (out, lse) and gradients through the chunked backend (the C flash kernels); with
    ``score`` (see :func:`score_mod`), of its tensors too."""
    from qkv.backends import BACKENDS
    from qkv.backends.chunked import ChunkedBackend

    saved = BACKENDS["chunked"]
    BACKENDS["chunked"] = ChunkedBackend(*(block or (None, None)))
    mod, params = score() if score is not None else (None, [])
    try:
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)] + params
        out, lse = qkv.attention(*leaves[:3], return_lse=True, backend="chunked", score_mod=mod, **kw)
        loss = out.double().sum() + torch.where(torch.isfinite(lse), lse, 0).double().sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else (None,) * len(leaves)
    finally:
        BACKENDS["chunked"] = saved
    res = {"out": out.detach(), "lse": lse.detach()}
    res.update({f"d{n}": g for n, g in zip(["q", "k", "v"] + [f"score{i}" for i in range(len(params))], grads) if g is not None})
    return res


def stats_calls(q, k, v, kw: dict[str, Any], c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The fused statistics pass (with and without the output) and, through an attn_mask, the
    per-tile kernel."""
    block = dict(zip(("block_q", "block_k"), c["block"])) if c["block"] else {}
    args = dict(topk=c["topk"], key_positions=(0, -1) if c["nk"] else (), relative_positions=(-1, 0, 2**63 - 1), **block)
    res: dict[str, torch.Tensor] = {}
    s = attention_stats(q, k, **kw, **args)
    res.update({f"stats.{f}": getattr(s, f) for f in ("lse", "entropy", "max_weight", "topk_weights", "n_keys", "relative_weights")})
    out, s2 = attention_with_stats(q, k, v, **kw, **args)
    res["with_stats.out"], res["with_stats.entropy"] = out, s2.entropy
    if c["nq"] and c["nk"]:
        mask = torch.rand(c["nq"], c["nk"], generator=torch.Generator().manual_seed(c["nq"] * 131 + c["nk"])) > 0.4
        kwm = {n: x for n, x in kw.items() if n not in ("window",)}
        s3 = attention_stats(q, k, attn_mask=mask, **kwm, **args)
        res["masked.entropy"], res["masked.lse"] = s3.entropy, s3.lse
    return res


def decode_calls(q, k, v, kw: dict[str, Any], c: dict[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The decoding kernel (csrc/decode.c): the last Nq ≤ 8 query rows against the keys, with the
    drawn cache dtype and masks and no gradient, each output paired with the float64 math
    backend's answer in the output's dtype. Empty when the shapes are not decoding ones."""
    m = min(c["nq"], 8, c["nk"] - 1)
    if m < 1:
        return {}
    dt = c["cache"]
    qd, kd, vd = q[:, :, -m:].detach().to(dt), k.detach().to(dt), v.detach().to(dt)
    with torch.no_grad():
        out, lse = qkv.attention(qd, kd, vd, return_lse=True, backend="chunked", **kw)
        ref, ref_lse = qkv.attention(qd.double(), kd.double(), vd.double(), return_lse=True, backend="math", **kw)
    return {"decode.out": (out, ref.to(dt)), "decode.lse": (lse, ref_lse.to(lse.dtype))}


def run(seed: int, calls: int, verbose: bool = False) -> list[str]:
    rng = np.random.default_rng(seed)
    failures = []
    lib = native.library()
    if lib is None:
        return [f"the native kernels are not built: {native.status()}"]
    x = torch.linspace(-125, 127, 1001, dtype=torch.float32)  # the range where it is accurate (vec.h)
    if close(native.exp2(x), torch.exp2(x.double()).float(), "exp2"):
        failures.append("exp2 disagrees with torch")
    for i in range(calls):
        c = draw(rng)
        gen = torch.Generator().manual_seed(seed * 100003 + i)
        q, k, v = tensors(c, gen)
        kw = kwargs(c, gen)
        score = score_mod(c, gen)
        torch.set_num_threads(c["threads"])
        got = {**attention_calls(q, k, v, kw, c["block"], score), **stats_calls(q, k, v, kw, c)}
        with torch_path():
            want = {**attention_calls(q, k, v, kw, c["block"], score), **stats_calls(q, k, v, kw, c)}
        for name in want:
            msg = close(got[name], want[name], name)
            if msg:
                failures.append(f"call {i} {c}: {msg}")
        for name, (a, b) in decode_calls(q, k, v, kw, c).items():
            msg = close(a, b, name)
            if msg:
                failures.append(f"call {i} {c}: {msg}")
        if verbose:
            print(i, c, flush=True)
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    failures = run(args.seed, args.calls, args.verbose)
    print("\n".join(failures) or f"{args.calls} calls, C and torch agree", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
