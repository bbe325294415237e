"""The C sources (qkv/csrc) build warning-free in every configuration they meet, and a library
built without OpenMP and for baseline x86-64 computes correct attention.

Configurations, each with ``-Wall -Wextra -Werror``: native.py's own flags (``-march=native``
with OpenMP); without ``-fopenmp`` (native.py's fallback for a compiler without OpenMP: the
pragmas compile away, one thread); ``-march=x86-64`` (no AVX: the generic vector code, whose
vectors GCC warns change the calling convention); and strict C11. Each source is compiled with
``-c``: the warnings that need the optimiser come with code generation, and a link adds none.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.backends import native
from qkv.reference import attention_ref
from qkv.score_mods import ALiBi, Softcap, alibi_slopes

from ..helpers import SUBPROCESS_TIMEOUT, assert_within_rule, make_qkv

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine().lower() in ("x86_64", "amd64")
STRICT = ("-Wall", "-Wextra", "-Werror")


def _compiler() -> str:
    cc = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def _flags(variant: str) -> list[str]:
    """native.FLAGS changed as ``variant`` says, with the warnings that fail the build."""
    flags = list(native.FLAGS)
    if variant == "no_openmp":
        return [f for f in flags if f != "-fopenmp"] + list(STRICT)
    if variant == "x86_64":
        if not X86:
            pytest.skip("baseline x86-64 is an x86 target")
        return ["-march=x86-64" if f == "-march=native" else f for f in flags] + list(STRICT)
    if variant == "c11":
        return [f for f in flags if not f.startswith("-std=")] + ["-std=c11", "-Wall", "-Werror=implicit-function-declaration", "-Werror"]
    return flags + list(STRICT)


@pytest.mark.slow  # four builds of 10-20 s each (setup builds the library anyway); CI's slow tier runs them
@pytest.mark.parametrize("variant", ["native_flags", "no_openmp", "x86_64", "c11"])
def test_sources_build_without_warnings(tmp_path, variant):
    cc, flags = _compiler(), _flags(variant)
    for source in native.SOURCES:
        cmd = [cc, *flags, "-c", str(native.CSRC / source), "-o", str(tmp_path / f"{source}.o")]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
        assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr[-4000:]}"


# ---- a library without OpenMP, for baseline x86-64, at work ------------------------------------


def check_kernels() -> None:
    """Every C entry point on small calls, against the float64 oracle by the rule (math the
    baseline): decoding (float32, bfloat16 and float16 caches, parts merged, sinks), the tile
    loops forward and backward (float32 with softcap, float64 with ALiBi), the statistics
    kernels against the torch formulation. Run by the test below in a process whose library
    was built with ``QKV_NATIVE_CFLAGS``."""
    lib = native.library_path()
    assert lib is not None and Path(os.environ["QKV_CACHE_DIR"]) in lib.parents, native.status()
    if "-fno-openmp" in native.extra_flags():
        assert b"GOMP_" not in lib.read_bytes(), "built without OpenMP, yet it calls the OpenMP runtime"
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # decoding: 1100 keys in parts
        q, k, v = make_qkv(1, 4, 1, 2, 1100, 40, dtype=dtype, seed=11)
        kw = dict(enable_gqa=True, sinks=torch.tensor([0.5, -1.0, 3e38, float("-inf")]), return_lse=True)
        ref = attention_ref(q.double(), k.double(), v.double(), **{**kw, "sinks": kw["sinks"].double()})
        got, base = (qkv.attention(q, k, v, backend=b, **kw) for b in ("chunked", "math"))
        assert_within_rule(got[0], base[0], ref[0], dtype, what=f"decode out {dtype}")
    for dtype, mod in ((torch.float32, Softcap(5.0)), (torch.float64, ALiBi(alibi_slopes(4)))):  # the tile loops
        q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 4, 2, 37, 45, 24, dtype=dtype, seed=12))
        kw = dict(enable_gqa=True, is_causal="bottom_right", score_mod=mod)
        ref = attention_ref(*(t.detach().double() for t in (q, k, v)), **kw)
        runs = []
        for backend in ("chunked", "math"):
            out = qkv.attention(q, k, v, backend=backend, **kw)
            runs.append((out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))))
        q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        grads64 = torch.autograd.grad(qkv.attention(q64, k64, v64, backend="math", **kw).square().sum(), (q64, k64, v64))
        assert_within_rule(runs[0][0], runs[1][0], ref, dtype, what=f"tiles out {dtype}")
        for name, c, b, r in zip("qkv", runs[0][1:], runs[1][1:], grads64):
            assert_within_rule(c, b, r, dtype, factor=3.0, what=f"tiles d{name} {dtype}")
    q, k, _ = make_qkv(1, 2, 2, 40, 70, 16, seed=13)
    stats = qkv.inspect.attention_stats(q, k, is_causal=True)
    with_c = native.library
    native.library = lambda: None  # the torch formulation of the same statistics
    try:
        want = qkv.inspect.attention_stats(q, k, is_causal=True)
    finally:
        native.library = with_c
    for name in ("lse", "entropy", "max_weight"):
        assert torch.allclose(getattr(stats, name), getattr(want, name), atol=1e-5), name
    print("kernels ok")


@pytest.mark.slow
def test_a_library_without_openmp_for_baseline_x86_64_computes_correctly(tmp_path):
    """One fresh process: the library built with native.FLAGS less OpenMP (``-fno-openmp``) and,
    on x86, for baseline x86-64, then :func:`check_kernels`."""
    _compiler()
    flags = "-fno-openmp" + (" -march=x86-64" if X86 else "")
    env = {**os.environ, "QKV_CACHE_DIR": str(tmp_path), "QKV_NATIVE_CFLAGS": flags}
    code = "from tests.backends.test_csrc_builds import check_kernels; check_kernels()"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert res.returncode == 0 and "kernels ok" in res.stdout, res.stdout[-3000:] + res.stderr[-4000:]
