"""Bad input gets a clear error that names the argument and says how to fix it."""

from __future__ import annotations

import pytest
import torch

import qkv


def qkv_(*shapes, dtype=torch.float32):
    return [torch.randn(*s, dtype=dtype) for s in shapes]


CASES = [
    ("too few dims", lambda: qkv.attention(*qkv_((16,), (16,), (16,))), ValueError, "at least 2 dims"),
    ("head dim", lambda: qkv.attention(*qkv_((1, 2, 8, 16), (1, 2, 8, 12), (1, 2, 8, 12))), ValueError, "key head dim is 12 but query head dim is 16"),
    ("value length", lambda: qkv.attention(*qkv_((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 9, 16))), ValueError, "value has 9 positions but key has 8"),
    ("heads not multiple", lambda: qkv.attention(*qkv_((1, 6, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16)), enable_gqa=True), ValueError, "6 is not a multiple of 4"),
    ("heads without gqa", lambda: qkv.attention(*qkv_((1, 8, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))), ValueError, "pass enable_gqa=True"),
    ("value heads", lambda: qkv.attention(*qkv_((1, 4, 8, 16), (1, 4, 8, 16), (1, 2, 8, 16))), ValueError, "value has 2 heads but key has 4"),
    ("batch", lambda: qkv.attention(*qkv_((2, 4, 8, 16), (3, 4, 8, 16), (3, 4, 8, 16))), ValueError, "do not broadcast"),
    ("dtype mismatch", lambda: qkv.attention(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).half(), torch.randn(1, 2, 4, 8)), TypeError, r"key.to\(query.dtype\)"),
    ("integer input", lambda: qkv.attention(torch.ones(1, 2, 4, 8, dtype=torch.long), torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8)), TypeError, "floating point"),
    ("not a tensor", lambda: qkv.attention([[1.0]], torch.ones(1, 1), torch.ones(1, 1)), TypeError, "torch.as_tensor"),
    ("mask shape", lambda: qkv.attention(*qkv_((2, 4, 8, 16), (2, 4, 10, 16), (2, 4, 10, 16)), attn_mask=torch.ones(8, 8, dtype=torch.bool)), ValueError, r"\(query_len, key_len\) = \(8, 10\)"),
    ("mask dtype", lambda: qkv.attention(*qkv_((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), attn_mask=torch.ones(4, 4, dtype=torch.long)), TypeError, "bool mask"),
    ("padding float", lambda: qkv.attention(*qkv_((2, 2, 4, 8), (2, 2, 4, 8), (2, 2, 4, 8)), key_padding_mask=torch.ones(2, 4)), TypeError, "True = a real key"),
    ("padding shape", lambda: qkv.attention(*qkv_((2, 2, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8)), key_padding_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, r"\(batch, key_len\) = \(2, 5\)"),
    ("padding without a key dim", lambda: qkv.attention(*qkv_((2, 2, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8)), key_padding_mask=torch.tensor(True)), ValueError, r"key_padding_mask of shape \(\) should be \(batch, key_len\)"),
    ("mask_mod returning a number", lambda: qkv.attention(*qkv_((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), mask_mod=lambda b, h, i, j: 1), TypeError, "mask_mod returned int; it must return a bool tensor"),
    ("window", lambda: qkv.attention(*qkv_((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), window=(-2, 2)), ValueError, "non-negative"),
    ("window pair", lambda: qkv.attention(*qkv_((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), window=(1, 2, 3)), ValueError, "pair"),
    ("causal string", lambda: qkv.attention(*qkv_((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), is_causal="lower"), ValueError, "bottom_right"),
    ("dropout", lambda: qkv.attention(*qkv_((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), dropout_p=1.5), ValueError, r"dropout_p=1.5 must be in \[0, 1\)"),
    ("scale", lambda: qkv.attention(*qkv_((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), scale=float("nan")), ValueError, "finite"),
    ("backend name", lambda: qkv.attention(*qkv_((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), backend="flash"), ValueError, "backend='flash' is unknown"),
]


@pytest.mark.parametrize("name,fn,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(name, fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_device_mismatch_names_the_argument():
    meta = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises(ValueError, match=r"key is on meta but query is on cpu; move it with key.to\(query.device\)"):
        qkv.attention(torch.randn(1, 2, 4, 8), meta, torch.randn(1, 2, 4, 8))


def test_reference_rejects_mismatched_heads():
    from qkv.reference import attention_ref

    with pytest.raises(ValueError, match="enable_gqa=True"):
        attention_ref(*qkv_((1, 4, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8)))


# ---- matrices that cannot fit: refused before allocating, naming the matrix and what avoids it ----

N_HUGE = 100_000  # 37 GiB of float32 scores per head: more than any machine these tests run on has free


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda q: qkv.attention(q, q, q, backend="math"), r"score matrix backend='math'.*100000 × 100000.*'chunked'"),
        (lambda q: qkv.attention_weights(q, q), r"weight matrix qkv.attention_weights.*attention_map.*attention_stats"),
        (lambda q: qkv.attention(q, q, q, backend="sdpa", window=(8, 0)), r"dense mask.*window.*tile by tile"),
    ],
    ids=["math", "attention_weights", "sdpa_window"],
)
def test_a_matrix_that_cannot_fit_is_refused_before_allocating(call, match, monkeypatch) -> None:
    from qkv import allocation

    monkeypatch.setattr(allocation, "free_bytes", lambda device: 8 * 2**30)  # the same answer on every machine
    q = torch.randn(1, 1, N_HUGE, 8)
    with pytest.raises(MemoryError, match=match):
        call(q)
    assert qkv.attention(q[:, :, :4096], q, q, window=(8, 0)).shape == (1, 1, 4096, 8)  # the suggested path runs


def test_integer_inputs_to_multi_head_attention_are_named() -> None:
    with pytest.raises(TypeError, match=r"query must be a floating-point tensor.*int64.*Embedding"):
        qkv.nn.MultiHeadAttention(16, 2)(torch.ones(1, 4, 16, dtype=torch.long))


@pytest.mark.parametrize("x, match", [([["a", "b"], ["c", "d"]], r"x must hold numbers, got text"),
                                      ([[1, 2], [3]], r"x must be a rectangular array")])
def test_trace_of_non_numbers_names_the_argument(x, match) -> None:
    import numpy as np

    with pytest.raises((TypeError, ValueError), match=match):
        qkv.trace(x, np.eye(2), np.eye(2), np.eye(2))
