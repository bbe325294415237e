"""The triton backend's decoding kernels (qkv/backends/triton/decode.py) on the test device.

A call without gradients of a few query rows against a longer cache runs them with the
non-finite rule inside: the answer comes back as :class:`~qkv.nonfinite.Checked`, so nothing
reads K or V after them. Judged here: outputs and lse against the float64 oracle under the
tolerance rule (GQA, padding, windows, sinks, 16-bit and float32, head dims that do not fill a
tile, Dv ≠ D, several parts with a ragged last one), empty rows, the rule itself (a NaN or ±inf
anywhere in one key/value head's cache, a query row, a bias entry), and on the CPU, with the
launches stubbed, that the path issues no host sync and no tensor operation over K or V.

Through the interpreter the kernels split the keys into parts of 32 (two 16-key tiles) with up
to 8 programs, so these small caches already span several parts (``parts`` below).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..helpers import DEVICE, INTERPRETED, SUBPROCESS_TIMEOUT, assert_within_rule, make_qkv, max_err, on_cpu, on_device

pytest.importorskip("triton")

import qkv  # noqa: E402
from qkv.backends import dispatch, select  # noqa: E402
from qkv.backends.triton import backend as launch  # noqa: E402
from qkv.call import AttentionCall, validate  # noqa: E402
from qkv.nonfinite import Checked  # noqa: E402
from qkv.reference import attention_ref  # noqa: E402
from qkv.score_mods import ALiBi, RelativeBias, Softcap, alibi_slopes  # noqa: E402

from ..rounding_baseline import rounded_attention  # noqa: E402

# Triton 3.6's interpreter indexes with 1-element arrays, which NumPy 2 deprecates, and NumPy warns
# where the kernels compute with the NaN and inf these tests plant (all harmless)
pytestmark = [
    pytest.mark.device,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _parts(nk: int, jobs: int) -> int:
    """Parts the interpreter's launch splits ``nk`` keys into for ``jobs`` = B·Hk programs."""
    bn = launch.configs.INTERPRETER.BLOCK_N
    return launch.decode_parts(0, nk, jobs, bn, 1, 2 * bn)[0]


def _materialise(kw: dict, b: int, hq: int, nk: int) -> dict:
    kw = dict(kw)
    if kw.get("key_padding_mask") == "kp":
        kp = torch.rand(b, nk) > 0.3
        kp[-1, : nk // 2] = False  # the last entry's first half padded: parts with no key for it
        kw["key_padding_mask"] = kp
    if kw.get("sinks") is True:
        kw["sinks"] = torch.randn(hq)
    return kw


def _ref(q, k, v, kw):
    kw64 = {a: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for a, t in kw.items()}
    return attention_ref(q.double(), k.double(), v.double(), enable_gqa=True, return_lse=True, **kw64)


def _triton(q, k, v, kw):
    """(out, lse) of the triton backend on the test device, brought back to the CPU."""
    return on_cpu(qkv.attention(*on_device((q, k, v)), enable_gqa=True, return_lse=True, backend="triton", **on_device(kw)))


# (B, Hq, Hk, Nq, Nk, D, Dv, dtype, keywords)
CASES = {
    "mqa-bf16-d59": (1, 4, 1, 1, 70, 59, 59, BF16, {}),  # parts of 32, 32 and 6 keys
    "gqa-fp16-bottom-right": (1, 4, 2, 3, 90, 24, 16, F16, dict(is_causal="bottom_right")),
    "padding-fp32-dv": (2, 4, 2, 2, 77, 16, 24, F32, dict(key_padding_mask="kp")),
    "window-sinks-fp32": (1, 4, 2, 2, 100, 16, 16, F32, dict(is_causal="bottom_right", window=(30, 0), sinks=True)),
    "group-of-8-bf16": (1, 8, 1, 8, 40, 32, 32, BF16, dict(is_causal="bottom_right")),  # G·Nq = 64 rows in one tile
}


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_and_lse_within_the_rule(name):
    b, hq, hk, nq, nk, d, dv, dtype, kw = CASES[name]
    if INTERPRETED:  # (a GPU's parts are at least 256 keys: one here)
        assert _parts(nk, b * hk) > 1 or name == "group-of-8-bf16"
    q, k, v = make_qkv(b, hq, hk, nq, nk, d, dv, dtype=torch.float64)
    kw = _materialise(kw, b, hq, nk)
    q, k, v = (t.to(dtype) for t in (q, k, v))  # the oracle sees the rounded inputs
    ref_out, ref_lse = _ref(q, k, v, kw)
    out, lse = _triton(q, k, v, kw)
    if dtype == F32:
        base_out, base_lse = qkv.attention(q, k, v, enable_gqa=True, return_lse=True, backend="math", **kw)
    else:  # the kernels round P to 16 bits before P·V: so does the baseline
        base_out, base_lse = rounded_attention(q, k, v, enable_gqa=True, **kw)
    assert_within_rule(out, base_out, torch.from_numpy(ref_out), dtype, what=f"{name} out")
    assert_within_rule(lse, base_lse, torch.from_numpy(ref_lse), dtype, what=f"{name} lse")
    assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(ref_lse))


def test_empty_cache_rows_give_zero_and_minus_inf():
    q, k, v = make_qkv(2, 4, 2, 2, 70, 16)
    kp = torch.rand(2, 70) > 0.5
    kp[1] = False  # entry 1: every key padded
    out, lse = _triton(q, k, v, dict(key_padding_mask=kp))
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()
    sinks = torch.randn(4)
    out, lse = _triton(q, k, v, dict(key_padding_mask=kp, sinks=sinks))  # only the sink: lse is the sink
    assert (out[1] == 0).all() and torch.equal(lse[1], sinks[:, None].expand(4, 2))


# ---- the non-finite rule, inside the kernels -------------------------------------------------------


def _rule_pattern(q, k, v, kw):
    """(out, lse) of the math backend on the CPU: the rule as every backend applies it."""
    return qkv.attention(q, k, v, enable_gqa=True, return_lse=True, backend="math", **kw)


def _same_nan_rows(got, want, tol=1e-5):
    """NaN exactly where the rule puts it; elsewhere the same numbers (``tol``: 16-bit P rounding)."""
    for a, b in zip(got, want):
        assert torch.equal(torch.isnan(a), torch.isnan(b)), (torch.isnan(a).nonzero(), torch.isnan(b).nonzero())
        both = ~torch.isnan(b)
        assert max_err(a[both], b[both]) < tol


# where a non-finite entry sits: tensor, index (q (B=2, Hq=6, Nq=2, D); k, v (B, Hk=3, Nk=80, D)),
# value; each in its own (batch, key/value head), so every one must show on its own
POISON = (
    ("k", (1, 1, 3, 5), float("nan")),  # a padded key, outside every row's window too
    ("v", (0, 0, 2, 0), float("inf")),  # a value outside the window
    ("k", (1, 0, 79, 2), float("-inf")),  # the last key, in the last part
    ("q", (0, 2, 1, 7), float("nan")),  # one query row of group (0, 1)...
    ("q", (0, 3, 0, 0), float("inf")),  # ...and another
)  # groups (0, 2) and (1, 2) stay clean


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_bad_entries_make_only_their_rows_nan(dtype):
    """The rule the math backend applies after its kernel, here from inside the decoding kernels:
    a key or value of one (batch, key/value head) — masked, outside the band, in any part —
    makes that group's rows NaN (output and lse); a query entry only its own row."""
    q, k, v = make_qkv(2, 6, 3, 2, 80, 16, dtype=dtype)
    kp = torch.ones(2, 80, dtype=torch.bool)
    kp[1, :10] = False
    kw = dict(key_padding_mask=kp, is_causal="bottom_right", window=(40, 0))  # keys 0–39 outside every row's window
    tensors = dict(q=q, k=k, v=v)
    for name, idx, value in POISON:
        tensors[name][idx] = value
    got = _triton(tensors["q"], tensors["k"], tensors["v"], kw)
    want = _rule_pattern(tensors["q"], tensors["k"], tensors["v"], kw)
    rows = torch.isnan(got[1])  # (B, Hq, Nq)
    assert rows[1, 2:4].all() and rows[0, :2].all() and rows[1, :2].all()  # the poisoned groups
    assert rows[0, 2, 1] and rows[0, 3, 0] and not rows[0, 2, 0] and not rows[0, 3, 1]  # the query rows alone
    assert not rows[:, 4:].any()  # the clean groups
    _same_nan_rows(got, want, 1e-5 if dtype == F32 else 2e-2)


def test_a_bad_bias_entry_makes_its_heads_rows_nan():
    """A relative-bias table entry that only masked keys reach still makes its query head's rows
    NaN (the kernels read the bias at every key); the other heads stay exact."""
    q, k, v = make_qkv(1, 4, 2, 2, 64, 16)
    table = torch.randn(8, 4)
    table[7, 1] = float("nan")  # head 1, the farthest bucket: keys 12 and more to the left, outside the window

    def kw(device):
        mod = RelativeBias(table.to(device), bidirectional=False, max_distance=16)
        return dict(score_mod=mod, is_causal="bottom_right", window=(8, 0))

    got = on_cpu(qkv.attention(*on_device((q, k, v)), enable_gqa=True, return_lse=True, backend="triton", **kw(DEVICE)))
    want = _rule_pattern(q, k, v, kw("cpu"))
    assert torch.isnan(got[0][0, 1]).all() and not torch.isnan(got[0][0, 0]).any()
    _same_nan_rows(got, want)


def test_a_float_mask_nan_gives_a_nan_lse():
    """A float mask is part of the scores: its NaN where a row looks makes that row NaN, lse too
    (the formula decides); one where the row does not look changes nothing."""
    q, k, v = make_qkv(1, 2, 1, 2, 50, 16)
    mask = torch.randn(1, 1, 2, 50)
    mask[0, 0, 1, 45] = float("nan")  # row 1 sees key 45
    mask[0, 0, 0, 49] = float("nan")  # row 0 does not see key 49 (bottom-right causal)
    kw = dict(attn_mask=mask, is_causal="bottom_right")
    got = _triton(q, k, v, kw)
    want = _rule_pattern(q, k, v, kw)
    assert torch.isnan(got[1][..., 1]).all() and torch.isfinite(got[1][..., 0]).all()
    _same_nan_rows(got, want)


def test_score_functions_and_sinks_against_the_oracle():
    q, k, v = make_qkv(1, 4, 2, 3, 70, 16)
    slopes = alibi_slopes(4)
    for kw in (dict(score_mod=ALiBi, is_causal="bottom_right", sinks=torch.randn(4)),
               dict(score_mod=Softcap(2.0), key_padding_mask=torch.rand(1, 70) > 0.4)):  # fmt: skip
        if kw["score_mod"] is ALiBi:  # the slopes on the query's device
            out, lse = _triton(q, k, v, dict(kw, score_mod=ALiBi(slopes.to(DEVICE))))
            kw["score_mod"] = ALiBi(slopes)
        else:
            out, lse = _triton(q, k, v, kw)
        ref_out, ref_lse = _ref(q, k, v, kw)
        assert max_err(out, ref_out) < 1e-5 and max_err(lse, ref_lse) < 1e-5


# ---- what the path costs outside its kernels ------------------------------------------------------

SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose"}
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "as_strided", "detach", "alias",
        "_reshape_alias", "expand", "t", "transpose", "select", "slice", "unsqueeze", "squeeze", "permute", "reshape",
        "_unsafe_view", "unbind", "lift_fresh"}  # fmt: skip


class _Recorder(TorchDispatchMode):
    """Every aten op and the storages of the tensors it takes."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, set[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen = set()
        for a in [*args, *(kwargs or {}).values()]:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor):
                    seen.add(t.untyped_storage().data_ptr())
        self.ops.append((func.overloadpacket.__name__, seen))
        return func(*args, **(kwargs or {}))


class _Stub:
    """A kernel that launches nothing; ``fill``: the merge's output set to 1 instead (so the overflow
    check after it sees a plain result, not uninitialised memory)."""

    def __init__(self):
        self.grids = []
        self.fill = False

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.grids.append(grid)
            if self.fill:
                args[4].fill_(1.0)  # out

        return run


@pytest.fixture
def stubbed(monkeypatch):
    stubs = {name: _Stub() for name in ("decode_kernel", "decode_merge_kernel", "fwd_kernel")}
    for name, stub in stubs.items():
        monkeypatch.setattr(launch.D if name.startswith("decode") else launch.K, name, stub)
    return stubs


CALLS = {
    "plain": dict(),
    "padding-causal": dict(key_padding_mask=torch.rand(2, 300) > 0.2, is_causal="bottom_right"),
    "window-sinks": dict(window=(64, 0), is_causal="bottom_right", sinks=torch.randn(8)),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_the_kernel_path_issues_no_sync_and_no_op_over_k_or_v(stubbed, name):
    """A decoding call without gradients, the two launches stubbed: the backend's path allocates
    and takes views, nothing else (on a GPU every other op is a kernel launch), reads nothing back
    to the host, and returns Checked; through ``qkv.attention`` no op touches K or V (the rule's
    reductions, a second pass over the cache, are gone: the kernels apply it)."""
    q, k, v = on_device(make_qkv(2, 8, 2, 1, 300, 64, dtype=BF16))
    kw = on_device(CALLS[name])
    call = validate(q, k, v, enable_gqa=True, return_lse=True, **kw)
    with _Recorder() as rec:
        res = launch.TritonBackendImpl.forward(None, call)
    assert isinstance(res, Checked)
    assert stubbed["decode_kernel"].grids and stubbed["decode_merge_kernel"].grids and not stubbed["fwd_kernel"].grids
    ops = [op for op, _ in rec.ops]
    assert [op for op in ops if op in SYNCS] == [], ops
    assert [op for op in ops if op not in FREE] == [], ops
    kv = {k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()}
    stubbed["decode_merge_kernel"].fill = True
    with _Recorder() as rec:
        qkv.attention(q, k, v, enable_gqa=True, backend="triton", **kw)
    touching = [op for op, storages in rec.ops if storages & kv and op not in FREE]
    assert touching == [], touching


def test_the_grid_fills_the_gpu_and_the_parts_are_whole_tiles():
    """The H200 benchmark's shape (B 8, 8 key/value heads, 32k keys; 132 SMs): at least
    DECODE_PROGRAMS_PER_SM programs per SM, each part whole 64-key tiles; a short cache is not cut
    below MIN_DECODE_PART keys; the interpreter's rule gives several parts for the tests."""
    parts, per = launch.decode_parts(0, 32768, 64, 64, 132, launch.MIN_DECODE_PART)
    assert parts * 64 >= launch.DECODE_PROGRAMS_PER_SM * 132 and per % 64 == 0 and parts * per >= 32768
    parts, per = launch.decode_parts(0, 1024, 64, 64, 132, launch.MIN_DECODE_PART)
    assert per >= launch.MIN_DECODE_PART and parts == 4
    assert launch.decode_parts(0, 70, 1, 16, 1, 32) == (3, 32)


def _cuda_route(call: AttentionCall) -> dispatch.Route:
    """The deciding row of auto's table for ``call`` as if its tensors were on a GPU."""
    return dispatch.route(call, dispatch.Shape.of(call)._replace(device="cuda"))


def test_auto_runs_decoding_on_triton_on_a_gpu():
    q, k, v = make_qkv(2, 8, 2, 1, 300, 64, dtype=BF16)
    for kw in (dict(), dict(key_padding_mask=torch.rand(2, 300) > 0.2, is_causal="bottom_right"), dict(score_mod=Softcap(30.0))):
        row = _cuda_route(validate(q, k, v, enable_gqa=True, **kw))
        assert row.order[:2] == ("triton", "sdpa") and "decoding kernels" in row.why
    q9 = make_qkv(2, 8, 2, 9, 300, 64, dtype=BF16)[0]  # 9 rows: the tiled kernels' call
    assert "decoding kernels" not in _cuda_route(validate(q9, k, v, enable_gqa=True)).why
    qg = q.clone().requires_grad_()  # gradients: the rule runs after the kernels anyway
    assert "decoding kernels" not in _cuda_route(validate(qg, k, v, enable_gqa=True)).why
    q16 = make_qkv(1, 128, 1, 1, 300, 64, dtype=BF16)[0]  # a group of 128 rows does not fit one tile
    assert "decoding kernels" not in _cuda_route(validate(q16, k[:1, :1], v[:1, :1], enable_gqa=True)).why
    assert select(validate(q, k, v, enable_gqa=True)).NAME != "triton"  # on a CPU auto never picks it


_PIPELINE_SCRIPT = r"""
import triton
from qkv.backends.triton import configs, decode
from qkv.backends.triton.lowering import INF_BITS_OF, compile_kernel

off = dict(BOTTOM_RIGHT=False, HAS_LO=False, HAS_HI=False, HAS_KP=False, HAS_MASK=False, MASK_BOOL=False, FP32_DOT="tf32",
           UPCAST=False, CHECK=True)
for dt, d, flags in (("bf16", 128, {}), ("fp16", 64, dict(HAS_KP=True, HAS_HI=True, BOTTOM_RIGHT=True)), ("fp32", 128, {})):
    cfg = configs.lookup("sm90", d, d, 4 if dt == "fp32" else 2, "decode", "any")
    consts = dict(off, **flags, BLOCK_M=16, BLOCK_N=cfg.BLOCK_N, BLOCK_D=d, BLOCK_DV=d, EVEN_D=True, EVEN_DV=True, INF_BITS=INF_BITS_OF[dt])
    ptx = compile_kernel(decode.decode_kernel, dt, consts, cfg, "u8", 90, aligned=True).asm["ptx"]
    assert "cp.async" in ptx, (dt, d, "loads not pipelined")
print("ok")
"""


@pytest.mark.slow
def test_decoding_loads_pipeline_on_hopper():
    """Compiled for sm_90 as a launch on contiguous inputs specialises it (Triton ships ptxas, no GPU
    needed), the decoding kernel's K and V loads go through ``cp.async`` into a multi-stage
    pipeline, the non-finite check included: what lets a memory-bound kernel keep enough bytes in
    flight. (Without the alignment a real launch sees, Triton would issue scalar loads.)"""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _PIPELINE_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT)  # fmt: skip
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
