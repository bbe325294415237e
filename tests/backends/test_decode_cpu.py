"""The CPU decoding kernel (qkv/csrc/decode.c via qkv.backends.decode_cpu) against the float64
oracle, under the accuracy rule (docs/guarantees.md): a few query rows per head against a long
cache, every mask it takes, caches read in place (views, broadcast heads), bfloat16 and
float16 caches, sinks, and the exact merge of key parts."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.backends import decode_cpu, native
from qkv.call import validate
from qkv.reference import attention_ref

from ..helpers import LargestAllocation, SUBPROCESS_TIMEOUT, assert_within_rule, max_err

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native CPU kernels are not built")


def _cache(b: int, hk: int, nk: int, d: int, dtype: torch.dtype, layout: str, gen: torch.Generator) -> torch.Tensor:
    """(B, Hk, Nk, D) as a decoder holds it: contiguous, a view of a longer preallocated cache,
    or one batch entry broadcast to all (a shared prompt)."""
    if layout == "capacity":
        return torch.randn(b, hk, nk + 37, d, generator=gen, dtype=torch.float64).to(dtype)[:, :, :nk]
    if layout == "broadcast":
        return torch.randn(1, hk, nk, d, generator=gen, dtype=torch.float64).to(dtype).expand(b, -1, -1, -1)
    return torch.randn(b, hk, nk, d, generator=gen, dtype=torch.float64).to(dtype)


CASES = [  # b, hq, hk, nq, nk, d, masks
    (1, 8, 8, 1, 1500, 64, {}),
    (2, 8, 2, 1, 2100, 32, {"is_causal": "bottom_right"}),
    (2, 8, 2, 4, 2100, 40, {"is_causal": "bottom_right", "key_padding": "ragged"}),
    (2, 4, 4, 3, 1300, 48, {"is_causal": "bottom_right", "window": (100, 0)}),
    (3, 6, 2, 8, 4097, 16, {"key_padding": "holes"}),
    (1, 4, 1, 2, 700, 17, {"is_causal": "bottom_right", "window": (5, 0), "key_padding": "ragged"}),
    (2, 2, 2, 1, 9, 8, {}),  # fewer keys than a tile
]


def _kwargs(masks: dict, b: int, nk: int, gen: torch.Generator) -> dict:
    kw = {k: v for k, v in masks.items() if k != "key_padding"}
    pad = masks.get("key_padding")
    if pad == "ragged":
        lens = torch.randint(nk // 2, nk + 1, (b,), generator=gen)
        kw["key_padding_mask"] = torch.arange(nk)[None] < lens[:, None]
    elif pad == "holes":
        kw["key_padding_mask"] = torch.rand(b, nk, generator=gen) > 0.3
    return kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "capacity", "broadcast"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}/{c[2]}q{c[3]}k{c[4]}d{c[5]}-{'-'.join(c[6]) or 'plain'}")
def test_decode_matches_the_oracle(case, layout: str, sinks: bool, dtype: torch.dtype) -> None:
    b, hq, hk, nq, nk, d, masks = case
    gen = torch.Generator().manual_seed(nk * 31 + nq)
    q = torch.randn(b, hq, nq, d, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (_cache(b, hk, nk, d, dtype, layout, gen) for _ in range(2))
    kw = _kwargs(masks, b, nk, gen)
    if sinks:
        kw["sinks"] = torch.randn(hq, generator=gen)
    kw.update(enable_gqa=hq != hk, return_lse=True)
    call = validate(q, k, v, **kw)
    assert decode_cpu.can_decode(call), call.describe()
    out, lse = decode_cpu.decode_attention(call)
    ref, ref_lse = (torch.as_tensor(t) for t in attention_ref(q.double(), k.double(), v.double(), **kw))
    base, _ = qkv.attention(q, k, v, backend="math", **kw)  # torch in the input dtype: the rule's baseline
    assert out.dtype == dtype and out.shape == ref.shape and lse.dtype == torch.float32
    assert_within_rule(out, base, ref, dtype, what="out")
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    if finite.any():  # float32 arithmetic for every input dtype: a few float32 ulps of the largest lse
        assert max_err(lse[finite], ref_lse[finite]) <= 1e-6 * max(1.0, float(ref_lse[finite].abs().max()))  # rows with no key: lse −inf (or the sink), out 0


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parts_merge_exactly(threads: int) -> None:
    """A head's keys split over threads give the one-part answer within float32 rounding."""
    q, k, v = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 5000, 64), torch.randn(1, 2, 5000, 64)
    call = validate(q, k, v, return_lse=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert decode_cpu.parts_per_head(2, 5000, threads) == min(-(-2 * threads // 2), 5000 // 512)
        out, lse = decode_cpu.decode_attention(call)
    finally:
        torch.set_num_threads(before)
    ref, ref_lse = (torch.as_tensor(t) for t in attention_ref(q.double(), k.double(), v.double(), return_lse=True))
    assert max_err(out, ref) < 1e-6 and max_err(lse, ref_lse) < 1e-5


def test_rows_with_no_key_give_zero_and_the_sink() -> None:
    q, k, v = torch.randn(2, 4, 1, 32), torch.randn(2, 4, 600, 32), torch.randn(2, 4, 600, 32)
    pad = torch.ones(2, 600, dtype=torch.bool)
    pad[1] = False  # batch entry 1 has no real key
    s = torch.randn(4)
    out, lse = decode_cpu.decode_attention(validate(q, k, v, key_padding_mask=pad, sinks=s, return_lse=True))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.allclose(lse[1, :, 0], s)
    assert out[0].abs().sum() > 0


def test_nan_stays_in_its_rows() -> None:
    q, k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 800, 16), torch.randn(2, 2, 800, 16)
    k[0, 1, 123] = float("nan")
    out, _ = decode_cpu.decode_attention(validate(q, k, v, return_lse=True))
    assert out[0, 1].isnan().all() and not out[0, 0].isnan().any() and not out[1].isnan().any()


@pytest.mark.parametrize("change", ["grad", "attn_mask", "score_mod", "float64", "long_query", "dropout", "mixed_cache"])
def test_other_calls_take_other_kernels(change: str) -> None:
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 900, 16), torch.randn(1, 2, 900, 16)
    kw: dict = {}
    if change == "grad":
        q.requires_grad_(True)
    elif change == "attn_mask":
        kw["attn_mask"] = torch.ones(1, 900, dtype=torch.bool)
    elif change == "score_mod":
        kw["score_mod"] = qkv.score_mods.Softcap(30.0)
    elif change == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif change == "long_query":
        q = torch.randn(1, 2, decode_cpu.MAX_QUERY_ROWS + 1, 16)
    elif change == "dropout":
        kw["dropout_p"] = 0.1
    else:
        k, v = k.bfloat16(), v.bfloat16()
    try:
        call = validate(q, k, v, **kw)
    except (TypeError, ValueError):
        assert change == "mixed_cache"  # qkv asks for one dtype; nothing to decode
        return
    assert not decode_cpu.can_decode(call)


def test_bytes_read_counts_each_distinct_row_once() -> None:
    k = torch.randn(1, 8, 1000, 64, dtype=torch.bfloat16)
    call = validate(torch.randn(1, 32, 1, 64, dtype=torch.bfloat16), k, k, enable_gqa=True)
    assert decode_cpu.bytes_read(call) == 2 * 8 * 1000 * 64 * 2


@pytest.mark.parametrize("where", ["query", "key", "value", "padded_key", "padded_value", "before_window", "none",
                                   "none_padded", "none_window"])
def test_the_non_finite_rule_without_a_second_pass(where: str) -> None:
    """qkv's rule (qkv.nonfinite) holds through qkv.attention; the kernel's own check replaces
    guard's pass over the cache when it saw every key and value (the ones its band or padding
    skips are scanned for NaN and ±inf only) and found nothing non-finite, and hands over to
    guard otherwise."""
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 1000, 16), torch.randn(2, 2, 1000, 16)
    kw: dict = {"enable_gqa": True}
    if where in ("padded_key", "padded_value", "none_padded"):  # keys 900… never weighed
        pad = torch.ones(2, 1000, dtype=torch.bool)
        pad[:, 900:] = False
        kw["key_padding_mask"] = pad
    if where in ("before_window", "none_window"):  # keys before 800 never weighed
        kw.update(is_causal="bottom_right", window=(200, 0))
    if where == "query":
        q[1, 3, 0, 5] = float("inf")
    elif where == "key":
        k[0, 1, 700, 2] = float("nan")
    elif where == "value":
        v[1, 0, 10, 0] = float("-inf")
    elif where == "padded_key":
        k[0, 0, 999, 0] = float("nan")
    elif where == "padded_value":
        v[1, 1, 950, 15] = float("inf")
    elif where == "before_window":
        v[0, 1, 3, 7] = float("nan")
    out = qkv.attention(q, k, v, **kw)
    expected = qkv.nonfinite.nonfinite_rows(q, k, v)
    assert torch.equal(out.isnan().any(-1), expected)
    result = decode_cpu.decode_attention(validate(q, k, v, **kw))
    # the kernel vouches for finite inputs only; anything else goes to guard's full check
    assert isinstance(result, qkv.nonfinite.Checked) == where.startswith("none")


def test_a_nan_query_row_with_no_key_is_still_nan() -> None:
    q, k, v = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 900, 16), torch.randn(1, 2, 900, 16)
    q[0, 1, 0, 3] = float("nan")  # row 0 of a bottom-right window (0, 0) sees key 898 only...
    pad = torch.ones(1, 900, dtype=torch.bool)
    pad[0, 898] = False  # ...which is padding: the row is empty, and its NaN never meets a score
    out = qkv.attention(q, k, v, is_causal="bottom_right", window=(0, 0), key_padding_mask=pad)
    assert out[0, 1, 0].isnan().all() and not out[0, 0].isnan().any() and not out[0, 1, 1].isnan().any()


def test_a_broadcast_bool_mask_is_key_padding_and_decodes() -> None:
    """transformers passes padding while generating as a bool (B, 1, 1, Nk) attn_mask: the call
    takes it as key padding (joined with any key_padding_mask) and runs the decoding kernel."""
    q, k, v = torch.randn(2, 8, 1, 32), torch.randn(2, 2, 900, 32), torch.randn(2, 2, 900, 32)
    mask = torch.ones(2, 1, 1, 900, dtype=torch.bool)
    mask[1, ..., 600:] = False
    extra = torch.rand(2, 900) > 0.1
    call = validate(q, k, v, attn_mask=mask, key_padding_mask=extra, enable_gqa=True)
    assert call.attn_mask is None and torch.equal(call.key_padding_mask, mask[:, 0, 0] & extra)
    assert decode_cpu.can_decode(call)
    out = qkv.attention(q, k, v, attn_mask=mask, key_padding_mask=extra, enable_gqa=True)
    ref = torch.as_tensor(attention_ref(q.double(), k.double(), v.double(), attn_mask=mask, key_padding_mask=extra,
                                        enable_gqa=True))  # fmt: skip
    assert max_err(out, ref) < 1e-6
    per_row = torch.ones(2, 1, 3, 900, dtype=torch.bool)  # differs by query row: stays a mask
    assert validate(torch.randn(2, 8, 3, 32), k, v, attn_mask=per_row, enable_gqa=True).attn_mask is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cache_is_read_where_it_lies(dtype: torch.dtype) -> None:
    """A view into a preallocated cache and a bfloat16 cache are read in place: no allocation
    anywhere near the cache's size (what the README promises)."""
    cache = torch.randn(1, 2, 4096 + 512, 64).to(dtype)  # capacity 4608, 4096 filled
    k = v = cache[:, :, :4096]
    q = torch.randn(1, 8, 1, 64).to(dtype)
    with LargestAllocation(storage_bytes=True) as big:
        out = qkv.attention(q, k, v, enable_gqa=True)
    assert big.biggest < k.numel() * k.element_size() / 16, big.biggest
    ref = torch.as_tensor(attention_ref(q.double(), k.double(), v.double(), enable_gqa=True))
    assert max_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 compiler flag")
def test_bfloat16_caches_without_the_dot_product_instruction(tmp_path) -> None:
    """A processor without AVX-512 BF16 converts K to float32 instead (the portable path): the
    oracle cases, run against a build made without that instruction."""
    env = {**os.environ, "QKV_CACHE_DIR": str(tmp_path), "QKV_NATIVE_CFLAGS": "-mno-avx512bf16"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-n", "0", "-k", "oracle and bfloat16"]
    res = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert res.returncode == 0 and "42 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
