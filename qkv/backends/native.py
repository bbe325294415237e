"""qkv's C kernels for the CPU (``qkv/csrc``), compiled on first use and loaded with ``ctypes``.

Some CPU work is a chain of elementwise torch operations over one tile, each a full pass
through memory; a C loop does the chain in one pass while the tile is in cache. The sources
are plain C (no torch headers, so a build takes about a second), compiled with the machine's
compiler (``$CC``, else ``cc``) for the machine it runs on (``-O3 -march=native``) and with
OpenMP, which links to the OpenMP runtime torch has already loaded, so the kernels share
torch's threads (``torch.get_num_threads()``). Builds are cached under
``$QKV_CACHE_DIR`` (default ``~/.cache/qkv``), keyed by the sources, flags, compiler and CPU.

Kernels that multiply cache-sized tiles call torch's own BLAS gemm (:func:`gemm`: MKL's
``sgemm_``/``dgemm_`` in libtorch_cpu), so qkv links no BLAS of its own.

Without a compiler, or with ``QKV_NATIVE=0``, :func:`library` returns None and callers use
their torch formulation; :func:`status` says why (``qkv info`` prints it).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("qkv")

SOURCES = ("stats_tile.c", "flash.c")  # compiled
HEADERS = ("stats_tile_impl.h", "flash_impl.h", "tile_impl.h", "vec.h")  # included by them
CSRC = Path(__file__).resolve().parent.parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11")

_reason: Optional[str] = None

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
# qkv_stats_tile_<float|double> (see csrc/stats_tile.c for the meaning of each argument)
_STATS_ARGS = [_ptr, _i64, _i64, _i64, _i64, _i64, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr,
               _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _int]  # fmt: skip
# qkv_attention_stats_<float|double> (see csrc/stats_tile_impl.h)
_FUSED_ARGS = [_ptr, _ptr, _ptr, *[_i64] * 6, _i64, _i64, _i64, _int, _int, _ptr, _i64, _i64, *[_ptr] * 9, _i64, _ptr,
               _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _int]  # fmt: skip
# qkv_flash_fwd_<float|double> and qkv_flash_bwd_<…> (see csrc/flash_impl.h); the scale factor c
# (and the backward's scale) are the element type
_MASK_ARGS = [_i64, _i64, _int, _int, _ptr, _i64, _i64, _ptr]  # band, key padding, key lengths
_FWD_ARGS = lambda c: [*[_ptr] * 3, *[_i64] * 6, *_MASK_ARGS, c, *[_ptr] * 3, _i64, _i64, _ptr, _int]  # noqa: E731
_BWD_ARGS = lambda c: [*[_ptr] * 9, *[_i64] * 6, *_MASK_ARGS, c, c, *[_ptr] * 3, _i64, _i64, _ptr, _int]  # noqa: E731


def _cpu_id() -> str:
    """The CPU's model and feature flags (``-march=native`` code is only valid on a CPU like it)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> Optional[str]:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str) -> Path:
    """Compile the sources into the cache (atomically: concurrent builders each write a
    temporary file and rename it) and return the library's path."""
    text = b"".join((CSRC / s).read_bytes() for s in SOURCES + HEADERS)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([text, " ".join(FLAGS).encode(), version.encode(), _cpu_id().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("QKV_CACHE_DIR") or Path.home() / ".cache" / "qkv")
    lib = cache / f"qkv_native_{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        # without OpenMP (Apple's clang, say) the kernels still build, and run on one thread
        for flags in (FLAGS, tuple(f for f in FLAGS if f != "-fopenmp")):
            cmd = [cc, *flags, *(str(CSRC / s) for s in SOURCES), "-o", tmp, "-lm"]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if res.returncode == 0:
                break
        else:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (then :func:`status` says why)."""
    global _reason
    if os.environ.get("QKV_NATIVE", "1") == "0":
        _reason = "disabled by QKV_NATIVE=0"
        return None
    cc = _compiler()
    if cc is None:
        _reason = "no C compiler found (set CC, or install gcc)"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _reason = f"build failed: {e}"
        log.warning("qkv: the native CPU kernels could not be built; using torch operations instead (%s)", e)
        return None
    for dt in ("float", "double"):
        fn = getattr(lib, f"qkv_stats_tile_{dt}")
        fn.argtypes, fn.restype = _STATS_ARGS, None
        fn = getattr(lib, f"qkv_attention_stats_{dt}")
        fn.argtypes, fn.restype = _FUSED_ARGS, _int
        c = ctypes.c_float if dt == "float" else ctypes.c_double
        for name, args in (("fwd", _FWD_ARGS(c)), ("bwd", _BWD_ARGS(c))):
            fn = getattr(lib, f"qkv_flash_{name}_{dt}")  # (attribute access caches the function object)
            fn.argtypes, fn.restype = args, _int
        fn = getattr(lib, f"qkv_gemm_check_{dt}")
        fn.argtypes, fn.restype = [_ptr], _int
    lib.qkv_exp2_float.argtypes, lib.qkv_exp2_float.restype = [_ptr, _ptr, _i64], None
    return lib


def gemm(dtype: torch.dtype) -> Optional[int]:
    """The address of the BLAS ``sgemm_``/``dgemm_`` that torch itself links, for kernels that
    multiply tiles small enough to stay in cache; None unless torch's BLAS is MKL (whose Fortran
    interface takes 32-bit integers; other BLAS builds may take 64-bit ones) and a small product
    through it comes out right. Without it those kernels are not used."""
    lib = library()
    return None if lib is None else _checked_gemm(dtype, lib)


@lru_cache(maxsize=None)
def _checked_gemm(dtype: torch.dtype, lib: ctypes.CDLL) -> Optional[int]:
    name = {torch.float32: "sgemm_", torch.float64: "dgemm_"}.get(dtype)
    if name is None or not torch.backends.mkl.is_available():
        return None
    libdir = Path(torch.__file__).resolve().parent / "lib"
    for path in [*sorted(libdir.glob("libtorch_cpu*")), None]:  # None: every library already loaded
        try:
            fn = getattr(ctypes.CDLL(None if path is None else str(path)), name)
        except (OSError, AttributeError):
            continue
        address = ctypes.cast(fn, ctypes.c_void_p).value
        check = getattr(lib, "qkv_gemm_check_float" if dtype == torch.float32 else "qkv_gemm_check_double")
        return address if check(address) == 1 else None
    return None


def exp2(x: torch.Tensor) -> torch.Tensor:
    """``2 ** x`` of a float32 CPU tensor by the kernels' own exponential (for tests)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native kernels are {status()}")
    x = x.to(torch.float32).contiguous()
    y = torch.empty_like(x)
    lib.qkv_exp2_float(ptr(x), ptr(y), x.numel())
    return y


def status() -> str:
    """One line for ``qkv info``: where the kernels come from, or why they are not used."""
    lib = library()
    if lib is None:
        return f"not used: {_reason}"
    blas = "torch's MKL" if gemm(torch.float32) is not None else "none found (tile loops in torch operations)"
    return f"built ({lib._name}); BLAS for cache-sized tiles: {blas}"


def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    """The data pointer of a contiguous CPU tensor (None for None)."""
    if t is None:
        return None
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"native kernels take contiguous CPU tensors, got strides {t.stride()} on {t.device}")
    return t.data_ptr()
