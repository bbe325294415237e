"""qkv's C kernels for the CPU (``qkv/csrc``), compiled on first use and loaded with ``ctypes``.

Some CPU work is a chain of elementwise torch operations over one tile, each a full pass
through memory; a C loop does the chain in one pass while the tile is in cache. The sources
are plain C (no torch headers; they compile in parallel, in a few seconds), compiled with the
machine's compiler (``$CC``, else ``cc``) for the machine it runs on (``-O3 -march=native``) and with
OpenMP, which links to the OpenMP runtime torch has already loaded, so the kernels share
torch's threads (``torch.get_num_threads()``). Builds are cached under
``$QKV_CACHE_DIR`` (default ``~/.cache/qkv``), keyed by the sources, flags, compiler and CPU;
``$QKV_NATIVE_CFLAGS`` adds flags (the tests' sanitizer build).

Kernels that multiply cache-sized tiles call torch's own BLAS gemm (:func:`gemm`: MKL's
``sgemm_``/``dgemm_`` in libtorch_cpu), so qkv links no BLAS of its own.

Without a compiler, or with ``QKV_NATIVE=0``, :func:`library` returns None and callers use
their torch formulation; :func:`status` says why (``qkv info`` prints it).

A cached library is loaded only when the SHA-256 written beside it at build time matches its
bytes and its ELF headers point inside the file (:func:`elf_fits`), so a truncated copy (a full
disk, a killed build, even with its checksum rewritten to match) or a foreign file is rebuilt,
never mapped (a truncated ELF kills the process with SIGBUS); one that lacks a kernel is rebuilt once.

The C code trusts its arguments, so every size, bound and pointer offset is made safe here,
in Python, before a call: :func:`tile_sizes` (per-thread tile buffers), :func:`band_args`
(window bounds), :func:`clamp_positions` (relative positions), :func:`gemm_fits` (BLAS takes
32-bit integers) and :func:`matrices` (shared, broadcast K/V read in place, not copied).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("qkv")

SOURCES = ("stats_tile.c", "flash.c", "decode.c")  # compiled
HEADERS = ("stats_tile_impl.h", "flash_impl.h", "tile_impl.h", "vec.h", "parallel.h")  # included by them
CSRC = Path(__file__).resolve().parent.parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11")

_reason: Optional[str] = None  # why the kernels are not used
_path: Optional[str] = None  # the library loaded (its canonical path in the cache)

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
# qkv_stats_tile_<float|double> (see csrc/stats_tile.c for the meaning of each argument)
_STATS_ARGS = [_ptr, _i64, _i64, _i64, _i64, _i64, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr,
               _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _int]  # fmt: skip
# qkv_attention_stats_<float|double> (see csrc/stats_tile_impl.h)
_FUSED_ARGS = [_ptr, _ptr, _ptr, _ptr, _ptr, *[_i64] * 6, _i64, _i64, _i64, _int, _int, _ptr, _i64, _i64, *[_ptr] * 9, _i64, _ptr,
               _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _int]  # fmt: skip
# qkv_flash_fwd_<float|double> and qkv_flash_bwd_<…> (see csrc/flash_impl.h); the scale factor c,
# the scale and the softcap are the element type
_MASK_ARGS = [_i64, _i64, _int, _int, _ptr, _i64, _i64, _ptr]  # band, key padding, key lengths
_FWD_ARGS = lambda c: [*[_ptr] * 5, *[_i64] * 6, *_MASK_ARGS, c, _int, c, c, _ptr, _i64, *[_ptr] * 3, _i64, _i64, _ptr, _int]  # noqa: E731
_BWD_ARGS = lambda c: [*[_ptr] * 11, *[_i64] * 6, *_MASK_ARGS, c, _int, c, _ptr, _i64, _ptr, c, *[_ptr] * 3, _i64, _i64, _ptr, _int]  # noqa: E731


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


def extra_flags() -> tuple[str, ...]:
    """Compiler flags added from ``$QKV_NATIVE_CFLAGS`` (part of the cache key), e.g. the
    sanitizers the tests build with: ``-fsanitize=address,undefined``."""
    return tuple(shlex.split(os.environ.get("QKV_NATIVE_CFLAGS", "")))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checksum_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def verified(lib: Path) -> bool:
    """Does ``lib`` hold exactly the bytes its build recorded beside it, and do they make a whole
    ELF file (:func:`elf_fits`: a checksum rewritten to match a truncated copy vouches for it)?"""
    try:
        return _checksum_path(lib).read_text().strip() == _digest(lib) and elf_fits(lib)
    except OSError:
        return False


# ELF header fields (offset, size) by class: 1 = 32-bit, 2 = 64-bit (the System V ABI's tables)
_ELF_HEADER = {
    1: {"size": 52, "phoff": (0x1C, 4), "shoff": (0x20, 4), "phentsize": (0x2A, 2), "phnum": (0x2C, 2),
        "shentsize": (0x2E, 2), "shnum": (0x30, 2), "p_offset": (4, 4), "p_filesz": (16, 4),
        "sh_type": (4, 4), "sh_offset": (16, 4), "sh_size": (20, 4)},
    2: {"size": 64, "phoff": (0x20, 8), "shoff": (0x28, 8), "phentsize": (0x36, 2), "phnum": (0x38, 2),
        "shentsize": (0x3A, 2), "shnum": (0x3C, 2), "p_offset": (8, 8), "p_filesz": (32, 8),
        "sh_type": (4, 4), "sh_offset": (24, 8), "sh_size": (32, 8)},
}  # fmt: skip
_SHT_NOBITS = 8  # a section that takes no bytes of the file (.bss)


def elf_fits(lib: Path) -> bool:
    """Does every part the ELF headers of ``lib`` point to lie inside the file: the program and
    section header tables, each segment's bytes (``p_offset + p_filesz``) and each section's?
    The loader maps those ranges, and touching one past the end of the file raises SIGBUS,
    which no Python code can catch. A file that is not ELF passes where libraries are not ELF
    (macOS), and fails elsewhere."""
    try:
        data = lib.read_bytes()
    except OSError:
        return False
    if data[:4] != b"\x7fELF":
        return not sys.platform.startswith("linux")
    layout = _ELF_HEADER.get(data[4]) if len(data) > 5 and data[5] in (1, 2) else None
    if layout is None or len(data) < layout["size"]:
        return False
    order = "little" if data[5] == 1 else "big"

    def field(at: int, name: str) -> int:
        offset, size = layout[name]
        return int.from_bytes(data[at + offset : at + offset + size], order)

    size = len(data)
    phoff, phnum, phentsize = field(0, "phoff"), field(0, "phnum"), field(0, "phentsize")
    shoff, shnum, shentsize = field(0, "shoff"), field(0, "shnum"), field(0, "shentsize")
    if phoff + phnum * phentsize > size or (shoff and shoff + shnum * shentsize > size):
        return False
    for i in range(phnum):
        at = phoff + i * phentsize
        if field(at, "p_offset") + field(at, "p_filesz") > size:
            return False
    for i in range(shnum if shoff else 0):
        at = shoff + i * shentsize
        if field(at, "sh_type") != _SHT_NOBITS and field(at, "sh_offset") + field(at, "sh_size") > size:
            return False
    return True


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(cc: str, rebuild: bool = False) -> Path:
    """The library's path in the cache, compiled first unless a verified build is there
    (``rebuild``: compile anyway). Atomic: concurrent builders each write a temporary file
    and rename it; the checksum is written after the library, so a reader that finds the
    library without it rebuilds rather than trusts it."""
    text = b"".join((CSRC / s).read_bytes() for s in SOURCES + HEADERS)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    all_flags = (*FLAGS, *extra_flags())
    key = hashlib.sha256(b"\0".join([text, " ".join(all_flags).encode(), version.encode(), _cpu_id().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("QKV_CACHE_DIR") or Path.home() / ".cache" / "qkv")
    lib = cache / f"qkv_native_{key}.so"
    if not rebuild and verified(lib):
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        # without OpenMP (Apple's clang, say) the kernels still build, and run on one thread
        for flags in (all_flags, tuple(f for f in all_flags if f != "-fopenmp")):
            failed = _compile(cc, flags, tmp)
            if failed is None:
                break
        else:
            raise RuntimeError(failed)
        digest = _digest(Path(tmp))
        os.replace(tmp, lib)
        _write_atomically(_checksum_path(lib), digest.encode())
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _compile(cc: str, flags: tuple[str, ...], out: str) -> Optional[str]:
    """Compile every source to an object, all at once (the build takes as long as its longest
    source, not their sum), and link them into ``out``; None, or what failed. No time limit:
    a compiler does not hang, and a busy machine's build that gave up would leave the user
    on the slower torch formulation for no reason."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as objects:
        compile_flags = [f for f in flags if f != "-shared"]
        jobs = []
        for src in SOURCES:
            cmd = [cc, *compile_flags, "-c", str(CSRC / src), "-o", os.path.join(objects, src + ".o")]
            jobs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
        for cmd, job in jobs:
            _, err = job.communicate()
            if job.returncode != 0:
                for _, other in jobs:
                    other.wait()
                return f"{' '.join(cmd)} failed:\n{err.strip()[-2000:]}"
        cmd = [cc, *flags, *(os.path.join(objects, src + ".o") for src in SOURCES), "-o", out, "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        return None if res.returncode == 0 else f"{' '.join(cmd)} failed:\n{res.stderr.strip()[-2000:]}"


def _bind(lib: ctypes.CDLL) -> None:
    """Declare every kernel's argument and result types (AttributeError if one is missing)."""
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
    for name in ("qkv_exp2_float", "qkv_tanh_float"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [_ptr, _ptr, _i64], None


def _load_fresh(path: Path) -> ctypes.CDLL:
    """Load ``path`` under a name of its own: the dynamic loader hands back the handle it
    already has for a name it has opened, even after the file was rebuilt."""
    link = path.with_name(f"{path.stem}.{os.getpid()}.so")
    try:
        os.link(path, link)
    except OSError:  # a file system without hard links
        shutil.copyfile(path, link)
    try:
        return ctypes.CDLL(str(link))
    finally:
        link.unlink()


@lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (then :func:`status` says why)."""
    global _reason, _path
    if os.environ.get("QKV_NATIVE", "1") == "0":
        _reason = "disabled by QKV_NATIVE=0"
        return None
    cc = _compiler()
    if cc is None:
        _reason = "no C compiler found (set CC, or install gcc)"
        return None
    problem, opened = "", False
    for rebuild in (False, True):  # a verified file that still fails to load or bind is rebuilt once
        try:
            path = _build(cc, rebuild)
            lib = _load_fresh(path) if opened else ctypes.CDLL(str(path))
            opened = True
            _bind(lib)
            _path = str(path)
            return lib
        except (RuntimeError, subprocess.SubprocessError) as e:  # the compiler failed
            problem = f"build failed: {e}"
            break
        except (OSError, AttributeError) as e:  # not a loadable library, or one without every kernel
            problem = f"the built library does not load ({type(e).__name__}: {e})"
    _reason = problem
    log.warning("qkv: the native CPU kernels are not used; using torch operations instead (%s)", problem)
    return None


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


def _elementwise(name: str, x: torch.Tensor) -> torch.Tensor:
    """``qkv_<name>_float`` of the kernels on a float32 copy of ``x`` (for tests)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native kernels are {status()}")
    x = x.to(torch.float32).contiguous()
    y = torch.empty_like(x)
    getattr(lib, f"qkv_{name}_float")(ptr(x), ptr(y), x.numel())
    return y


def exp2(x: torch.Tensor) -> torch.Tensor:
    """``2 ** x`` of a float32 CPU tensor by the kernels' own exponential (for tests)."""
    return _elementwise("exp2", x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """``tanh(x)`` of a float32 CPU tensor by the kernels' own (softcapped scores; for tests)."""
    return _elementwise("tanh", x)


def library_path() -> Optional[Path]:
    """The file the loaded kernels came from (in the cache), or None when they are not used."""
    return None if library() is None or _path is None else Path(_path)


def status() -> str:
    """One line for ``qkv info``: where the kernels come from, or why they are not used."""
    lib = library()
    if lib is None:
        return f"not used: {_reason}"
    blas = "torch's MKL" if gemm(torch.float32) is not None else "none found (tile loops in torch operations)"
    return f"built ({_path}); BLAS for cache-sized tiles: {blas}"


# ---- making arguments safe for C -----------------------------------------------------------

INT_MAX = 2**31 - 1  # BLAS (MKL's LP64 interface) takes 32-bit integers
MAX_TILE = 1 << 24  # elements of one per-thread score tile (64 MiB of float32)


def gemm_fits(*dims: int) -> bool:
    """Can BLAS take these dimensions (and leading dimensions)? Larger ones stay in torch."""
    return all(0 <= int(x) <= INT_MAX for x in dims)


def tile_sizes(rows: int, keys: int, nq: int, nk: int) -> tuple[int, int]:
    """Tile sizes the kernels can allocate: each at least 1 and at most what there is, and
    ``rows · keys`` at most :data:`MAX_TILE` (a product that wrapped, or a huge one, would
    give malloc a tiny or impossible size). User values are checked before
    (:func:`qkv.backends.tiles.check_tile_size`)."""
    rows = max(1, min(int(rows), nq))
    keys = max(1, min(int(keys), nk))
    if rows * keys > MAX_TILE:
        keys = max(1, MAX_TILE // rows)
        rows = min(rows, MAX_TILE // keys)
    return rows, keys


def band_args(lo: Optional[int], hi: Optional[int], nq: int, nk: int) -> list[int]:
    """``[lo, hi, has_lo, has_hi]`` for the kernels' band ``lo ≤ j − i ≤ hi`` (offsets resolved),
    each bound clamped to ``[−nq − 1, nk + 1]``: ``j − i`` only spans ``[−(nq − 1), nk − 1]``, so
    the band means the same, and C's ``q0 + lo`` cannot overflow (nor ctypes wrap a bound ≥ 2⁶³)."""
    clamp = lambda x: max(-nq - 1, min(nk + 1, int(x)))  # noqa: E731
    return [0 if lo is None else clamp(lo), 0 if hi is None else clamp(hi), int(lo is not None), int(hi is not None)]


def clamp_positions(offsets: tuple[int, ...], nq: int, nk: int) -> tuple[int, ...]:
    """Relative key offsets clamped to ``±(nq + nk)``: beyond that no query row has such a key
    (its weight is 0 either way), and C's ``pos + offset`` cannot overflow."""
    lim = nq + nk
    return tuple(max(-lim, min(lim, int(r))) for r in offsets)


def matrices(t: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``t (B, H, 1, N, D)`` for the kernels: a tensor holding each distinct ``(N, D)`` matrix
    once, contiguous, and the element offset of matrix ``j = b·H + h`` in it (int64, ``(B·H,)``),
    or None when that offset is simply ``j·N·D``. Dimensions broadcast with stride 0 (K/V shared
    across a batch: a common prefix, beam search) are read in place, not copied to full size."""
    if t.is_contiguous():
        return t, None
    base = t
    for dim in (0, 1):
        if t.shape[dim] > 1 and t.stride(dim) == 0:
            base = base.narrow(dim, 0, 1)
    base = base.contiguous()
    if base.numel() == t.numel():
        return base, None
    b, h = t.shape[:2]
    sb = 0 if base.shape[0] == 1 else base.stride(0)
    sh = 0 if base.shape[1] == 1 else base.stride(1)
    offsets = (torch.arange(b, dtype=torch.int64)[:, None] * sb + torch.arange(h, dtype=torch.int64)[None, :] * sh).reshape(-1)
    return base, offsets


def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    """The data pointer of a contiguous CPU tensor (None for None)."""
    if t is None:
        return None
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"native kernels take contiguous CPU tensors, got strides {t.stride()} on {t.device}")
    return t.data_ptr()
