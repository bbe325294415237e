"""The C kernels (qkv/csrc) take nothing from Python they could overflow, loop on or misread:
sizes and bounds are made safe in qkv.backends.native before every ctypes call, and a damaged
cached library is rebuilt rather than loaded. The sanitizer job builds them with
AddressSanitizer and UndefinedBehaviorSanitizer and sweeps every C entry point
(tests/backends/native_sweep.py); tests/backends/test_csrc_builds.py builds them warning-free."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.backends import chunked_native, native
from qkv.backends.chunked import ChunkedBackend
from qkv.inspect import attention_stats, attention_with_stats

from .. import seeds
from ..helpers import LargestAllocation, make_qkv, max_err

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")


def _torch_path(monkeypatch) -> None:
    monkeypatch.setattr(native, "library", lambda: None)


def _grads(q, k, v, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = qkv.attention(*leaves, return_lse=True, backend="chunked", **kw)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    return out.detach(), lse.detach(), *(t.grad for t in leaves)


# ---- sizes and bounds from the user ----------------------------------------------------------


def test_huge_statistics_block_sizes_are_clamped_not_overflowed():
    q = torch.randn(1, 2, 64, 16)
    want = attention_stats(q, q)
    for kw in ({"block_k": 2**62}, {"block_q": 2**62, "block_k": 2**62}, {"block_q": 2**40}):
        got = attention_stats(q, q, **kw)
        assert max_err(got.entropy, want.entropy) < 1e-5 and max_err(got.lse, want.lse) < 1e-5
        out, s = attention_with_stats(q, q, q, **kw)
        assert max_err(s.lse, want.lse) < 1e-5 and out.isfinite().all()
    assert native.tile_sizes(2**62, 2**62, 10**6, 10**6)[0] * native.tile_sizes(2**62, 2**62, 10**6, 10**6)[1] <= native.MAX_TILE


@pytest.mark.parametrize("value", [-1, 0, 2.5, True, "64"])
def test_nonpositive_or_odd_block_sizes_are_refused_by_name(value):
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 5, 8)
    with pytest.raises(ValueError, match="block_q=.*positive integer"):
        attention_stats(q, k, block_q=value)
    with pytest.raises(ValueError, match="block_k=.*positive integer"):
        attention_with_stats(q, k, k, block_k=value)
    with pytest.raises(ValueError, match="block_k=.*positive integer"):
        ChunkedBackend(block_k=value)


@pytest.mark.parametrize("window", [(5, sys.maxsize), (sys.maxsize, 5), (2**64, 0), (0, 2**64), (2**100, 2**100)])
def test_huge_window_sides_mean_unbounded_on_every_path(window):
    q, k, v = make_qkv(1, 2, 2, 40, 40, 16, dtype=torch.float64)
    want = _grads(q, k, v, window=window)  # float64: the C loops too
    ref = qkv.attention(q, k, v, window=window, backend="math")
    assert max_err(want[0], ref) < 1e-12
    q32, k32, v32 = (t.float() for t in (q, k, v))
    got = _grads(q32, k32, v32, window=window)
    for a, b in zip(got, want):
        assert max_err(a, b) < 1e-5
    out, s = attention_with_stats(q32, k32, v32, window=window)
    assert max_err(out, ref) < 1e-5 and max_err(s.lse, want[1]) < 1e-5
    assert torch.equal(attention_stats(q32, k32, window=window).n_keys, s.n_keys)


def test_relative_positions_past_int64_range_weigh_nothing():
    q = torch.randn(1, 1, 6, 8)
    s = attention_stats(q, q, relative_positions=(2**63 - 1, -(2**63), 0))
    assert (s.relative_weights[..., :2] == 0).all() and (s.relative_weights[..., 2] > 0).all()


def test_head_dims_past_blas_integers_stay_in_torch(monkeypatch):
    """BLAS takes 32-bit integers: a head dim past them would be silently wrong in C. Lowered
    limit here (a real one needs 8 GB per row)."""
    q, k, v = make_qkv(1, 2, 2, 9, 11, 16, dv=8)
    want = _grads(q, k, v, is_causal=True)
    monkeypatch.setattr(native, "INT_MAX", 12)
    assert chunked_native._sizes(*(t.unsqueeze(2) for t in (q, k, v)), 4, 4) is None
    got = _grads(q, k, v, is_causal=True)
    for a, b in zip(got, want):
        assert max_err(a, b) < 1e-5
    s = attention_stats(q, k, is_causal=True)
    assert s.lse.isfinite().all()


def test_no_value_columns_with_a_mask_on_the_statistics_path():
    q = torch.randn(1, 2, 8, 16)
    mask = torch.rand(8, 8) > 0.3
    out, s = attention_with_stats(q, q, q[..., :0], attn_mask=mask)
    assert out.shape == (1, 2, 8, 0)
    assert max_err(s.entropy, attention_stats(q, q, attn_mask=mask).entropy) < 1e-6


@pytest.mark.parametrize("d,dv", [(0, 8), (8, 0), (0, 0)])
def test_zero_head_dims_take_the_torch_formulation(d, dv):
    q, k, v = make_qkv(2, 2, 1, 5, 7, max(d, 1), dv=max(dv, 1))
    q, k, v = q[..., :d], k[..., :d], v[..., :dv]
    grouped = (q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2))
    assert chunked_native._sizes(*grouped, 4, 4) is None
    got = _grads(q, k, v, is_causal=True)
    ref = qkv.attention(q.double(), k.double(), v.double(), is_causal=True, backend="math")
    assert max_err(got[0], ref) < 1e-6 and all(g.isfinite().all() for g in got[2:])


# ---- broadcast K/V ---------------------------------------------------------------------------


def test_broadcast_keys_and_values_are_read_in_place(monkeypatch):
    """Shared K/V (a common prefix, beam search): the C path reads the one matrix each batch
    entry shares instead of copying it to full size."""
    q = torch.randn(64, 1, 16, 64, requires_grad=True)
    kb, vb = torch.randn(1, 1, 1024, 64), torch.randn(1, 1, 1024, 64)
    k, v = kb.expand(64, 1, 1024, 64), vb.expand(64, 1, 1024, 64)
    base, offsets = native.matrices(k.unsqueeze(2))
    assert base.numel() == kb.numel() and offsets is not None and (offsets == 0).all()

    def forward():
        with LargestAllocation(storage_bytes=True) as big:
            out = qkv.attention(q, k, v, backend="chunked", is_causal="bottom_right")
        return out, big.biggest

    got, c_largest = forward()
    _torch_path(monkeypatch)
    want, torch_largest = forward()
    assert max_err(got, want) < 1e-5
    full = k.numel() * k.element_size()
    print(f"largest new storage: C path {c_largest} bytes, torch {torch_largest}; K at full size {full}")
    assert c_largest <= 1.2 * torch_largest and c_largest < full / 8


def test_matrices_offsets_address_each_head():
    t = torch.randn(1, 3, 1, 5, 4).expand(2, 3, 1, 5, 4)  # batch broadcast, heads distinct
    base, off = native.matrices(t)
    assert base.shape == (1, 3, 1, 5, 4) and off.tolist() == [0, 20, 40, 0, 20, 40]
    flat = base.reshape(-1)
    for j in range(6):
        assert torch.equal(flat[off[j] : off[j] + 20].view(5, 4), t[j // 3, j % 3, 0])
    c = torch.randn(2, 3, 1, 5, 4)
    assert native.matrices(c) == (c, None)
    s = torch.randn(2, 3, 1, 4, 5).transpose(-1, -2)  # not contiguous, nothing shared: a plain copy
    base, off = native.matrices(s)
    assert off is None and base.is_contiguous() and torch.equal(base, s)


# ---- non-finite inputs: one rule for the C loops and the torch formulation ----------------------


def _nan_pattern(monkeypatch, torch_path: bool, q, k, v, **kw):
    if torch_path:
        _torch_path(monkeypatch)
    try:
        return [torch.isnan(t) for t in _grads(q, k, v, **kw)]
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("case", ["padded_inf_value", "inf_query_row", "nan_key"])
def test_nonfinite_gradients_follow_one_rule(monkeypatch, case):
    q, k, v = make_qkv(2, 2, 2, 6, 6, 8)
    kw: dict = {"is_causal": True}
    if case == "padded_inf_value":  # every key of batch 0 padded, and -inf in one of its values
        v[0, 0, 3, 0] = -float("inf")
        kp = torch.ones(2, 6, dtype=torch.bool)
        kp[0] = False
        kw["key_padding_mask"] = kp
    elif case == "inf_query_row":
        q[1, 1, 2, 5] = float("inf")
    else:
        k[0, 1, 4, 0] = float("nan")
    c = _nan_pattern(monkeypatch, False, q, k, v, **kw)
    t = _nan_pattern(monkeypatch, True, q, k, v, **kw)
    for a, b in zip(c, t):
        assert torch.equal(a, b)
    bad_head = {"padded_inf_value": (0, 0), "inf_query_row": (1, 1), "nan_key": (0, 1)}[case]
    dq_nan, dk_nan = c[2], c[3]
    assert dk_nan[bad_head].all() and dk_nan.sum() == dk_nan[bad_head].numel()
    assert not dq_nan[1 - bad_head[0]].any()
    if case == "inf_query_row":  # the row's own dq is the formula's: NaN or not as its ±inf scores fall
        assert not dq_nan[bad_head][[0, 1, 3, 4, 5]].any()
    else:
        assert dq_nan[bad_head].any()


def test_nonfinite_gradients_agree_on_adversarial_calls(monkeypatch):
    """400 calls (fixed seeds 0..399): a NaN or ±inf in q, k or v, with and without key padding
    (a fully padded sequence included) and causal masks; the C loops and the torch formulation
    give the same NaN pattern in every gradient (42 of these disagreed without the rule)."""
    differ = []
    for s in range(400):
        gen = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(2, 2, 5, 8, generator=gen) for _ in range(3))
        [q, k, v, v, k][s % 5][0, 1, s % 5, s % 8] = [float("nan"), float("inf"), float("-inf")][s % 3]
        kw: dict = {"is_causal": s % 3 == 0}
        if s % 4 == 1:
            kw["key_padding_mask"] = torch.rand(2, 5, generator=gen) > 0.4
        elif s % 4 == 2:
            kw["key_padding_mask"] = torch.ones(2, 5, dtype=torch.bool)
            kw["key_padding_mask"][0] = False
        c = _nan_pattern(monkeypatch, False, q, k, v, **kw)
        t = _nan_pattern(monkeypatch, True, q, k, v, **kw)
        if any(not torch.equal(a, b) for a, b in zip(c, t)):
            differ.append(s)
    assert not differ, f"seeds {differ}"


def test_nonfinite_statistics_count_the_keys_the_masks_allow(monkeypatch):
    q, k = torch.randn(2, 2, 9, 8), torch.randn(2, 2, 12, 8)
    q[0, 1, 2, 0] = float("-inf")
    k[1, 0, 5, 3] = float("inf")
    kw = {"key_padding_mask": torch.rand(2, 12) > 0.3, "is_causal": "bottom_right"}
    for mask in (None, torch.rand(9, 12) > 0.4, torch.randn(9, 12).masked_fill(torch.rand(9, 12) > 0.6, float("-inf"))):
        got = attention_stats(q, k, attn_mask=mask, **kw).n_keys
        finite = attention_stats(torch.randn_like(q), torch.randn_like(k), attn_mask=mask, **kw).n_keys
        assert torch.equal(got, finite)  # the values never decide n_keys
        with monkeypatch.context() as m:
            _torch_path(m)
            assert torch.equal(attention_stats(q, k, attn_mask=mask, **kw).n_keys, got)


# ---- the cached library ---------------------------------------------------------------------


def _fresh_process(cache: Path, code: str = "") -> subprocess.CompletedProcess:
    script = "from qkv.backends import native; print(native.status()); " + code
    env = {**os.environ, "QKV_CACHE_DIR": str(cache)}
    # no time limit: a build on a busy machine takes what it takes
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)


def _cached(cache: Path) -> Path:
    """A cache holding a verified copy of this process's library (the key does not depend on
    the folder), as a first use would leave it: each test then pays for one rebuild only."""
    lib = native.library_path()
    assert lib is not None
    cache.mkdir(parents=True, exist_ok=True)
    for src in (lib, lib.with_name(lib.name + ".sha256")):
        shutil.copyfile(src, cache / src.name)
    assert native.verified(cache / lib.name)
    return cache / lib.name


# the quick tier keeps the rewritten-checksum case below; these rebuild the library (16 s each)
@pytest.mark.parametrize("size", [0, 1000, 40000])
@pytest.mark.slow
def test_a_truncated_cached_library_is_rebuilt_not_loaded(tmp_path, size):
    lib = _cached(tmp_path)
    good = lib.read_bytes()
    lib.write_bytes(good[:size])  # a full disk, a killed copy: loading it would raise SIGBUS
    res = _fresh_process(tmp_path, "import torch, qkv; print(qkv.attention(*[torch.randn(1,1,4,8, requires_grad=True)]*3).sum())")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("built (") and native.verified(lib) and lib.read_bytes() == good


# each rebuilds the library; 40000 bytes end inside its code, whose mapping then raises SIGBUS, and
# one byte less leaves only the section headers short (the loader would map every segment whole)
@pytest.mark.parametrize("size", [40000, -1])
@pytest.mark.slow  # (test_elf_fits_reads_the_headers_of_real_libraries is the quick tier's check)
def test_a_truncated_library_whose_checksum_was_rewritten_is_rebuilt_not_loaded(tmp_path, size):
    """The checksum vouches for the truncated bytes, so only the ELF headers tell: their tables
    and segments point past the end of the file, where mapping them raises SIGBUS (a crash of the
    process, which is why the load runs in a process of its own)."""
    lib = _cached(tmp_path)
    good = lib.read_bytes()
    lib.write_bytes(good[:size])
    (tmp_path / (lib.name + ".sha256")).write_text(hashlib.sha256(lib.read_bytes()).hexdigest())
    assert not native.elf_fits(lib)
    res = _fresh_process(tmp_path, "import torch, qkv; print(qkv.attention(*[torch.randn(1,1,4,8, requires_grad=True)]*3).sum())")
    assert res.returncode == 0, f"exit {res.returncode} (-7 is SIGBUS): {res.stderr[-2000:]}"
    assert res.stdout.startswith("built ("), res.stdout
    assert native.verified(lib) and lib.read_bytes() == good


def test_elf_fits_reads_the_headers_of_real_libraries(tmp_path):
    lib = native.library_path()
    assert lib is not None and native.elf_fits(lib)
    good = lib.read_bytes()
    for size in (0, 4, 63, 64, len(good) // 2, len(good) - 1):
        part = tmp_path / f"part{size}.so"
        part.write_bytes(good[:size])
        assert not native.elf_fits(part), size
    torch_lib = Path(torch.__file__).parent / "lib"
    for other in sorted(torch_lib.glob("libtorch*.so"))[:3]:  # ELF files qkv did not build
        assert native.elf_fits(other), other
    text = tmp_path / "text.so"
    text.write_bytes(b"not a library")
    assert native.elf_fits(text) is (not sys.platform.startswith("linux"))


@pytest.mark.slow  # builds the library twice (16 s on two cores): the CI's slow tier runs it
def test_a_foreign_library_is_rebuilt_and_one_without_kernels_is_skipped(tmp_path):
    lib = _cached(tmp_path)
    cc = shutil.which(os.environ.get("CC") or "cc") or "gcc"
    src = tmp_path / "empty.c"
    src.write_text("int qkv_nothing(void) { return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)  # a valid ELF, no kernels
    res = _fresh_process(tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("built (") and native.verified(lib)
    # the same foreign file with a checksum that vouches for it: loaded, found wanting, rebuilt
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    (tmp_path / (lib.name + ".sha256")).write_text(hashlib.sha256(lib.read_bytes()).hexdigest())
    res = _fresh_process(tmp_path, "from qkv.info import report; print(report())")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("built ("), res.stdout  # rebuilt, and loaded under a fresh name
    assert "Native CPU kernels (qkv/csrc): built (" in res.stdout and native.verified(lib)


# ---- the sources themselves -----------------------------------------------------------------


def _compiler() -> str:
    cc = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


# ---- the sanitizer job ----------------------------------------------------------------------

# -O1, as the sanitizers' own documentation advises: every check is kept, and the build takes a
# fifth of -O3's time (the flags come after native.FLAGS, so this -O wins)
SANITIZE = "-O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"


def _sanitizer_env(cache: Path) -> dict[str, str]:
    cc = _compiler()
    runtime = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not runtime or not os.path.isabs(runtime) or not os.path.exists(runtime):
        pytest.skip("no AddressSanitizer runtime for this compiler")
    return {**os.environ, "QKV_CACHE_DIR": str(cache), "QKV_NATIVE_CFLAGS": SANITIZE, "LD_PRELOAD": runtime,
            "ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}  # fmt: skip


def _python(env: dict[str, str], code: list[str]) -> subprocess.CompletedProcess:
    # no time limit: a sanitized build and sweep on a busy machine take what they take
    return subprocess.run([sys.executable, *code], cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.slow  # two sanitizer builds and a sweep (about a minute): the CI's slow tier runs it
def test_the_sanitizers_report_a_planted_overflow_and_nothing_in_a_sweep(tmp_path, request):
    """One sanitized build, two runs: a bad access planted in the kernels must be reported (else
    the sweep proves nothing), then a seeded sweep through every C entry point must report none."""
    env = _sanitizer_env(tmp_path)
    built = _python(env, ["-c", "from qkv.backends import native; print(native.status())"])
    assert built.returncode == 0 and built.stdout.startswith("built ("), f"the sanitized build: {built.stdout}{built.stderr[-3000:]}"

    plant = ("import torch; from qkv.backends import native; x = torch.randn(100); y = torch.empty(100); "
             "native.library().qkv_exp2_float(native.ptr(x), native.ptr(y), 108)")  # fmt: skip
    res = _python(env, ["-c", plant])
    assert res.returncode != 0 and "AddressSanitizer" in res.stderr, f"the planted overflow went unreported: {res.stderr[-2000:]}"

    seed = seeds.derive(request.node.nodeid) % 65536
    print(f"sweep seed {seed} (python -m tests.backends.native_sweep --seed {seed})")
    res = _python(env, ["-m", "tests.backends.native_sweep", "--seed", str(seed), "--calls", "250"])
    print(res.stdout[-3000:])
    assert "AddressSanitizer" not in res.stderr and "runtime error" not in res.stderr, res.stderr[-4000:]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "250 calls, C and torch agree" in res.stdout
