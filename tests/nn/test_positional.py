"""Sinusoidal table and rotary embeddings against the formulas, computed independently."""

import math

import numpy as np
import pytest
import torch

from qkv.nn import RotaryEmbedding, SinusoidalPositionalEncoding, sinusoidal_table


@pytest.mark.parametrize("d_model", [1, 6, 7, 64])
def test_sinusoidal_table_matches_formula(d_model):
    n = 50
    got = sinusoidal_table(n, d_model, dtype=torch.float64).numpy()
    want = np.zeros((n, d_model))
    for p in range(n):
        for c in range(d_model):
            i = c // 2
            angle = p / 10000 ** (2 * i / d_model)
            want[p, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_sinusoidal_table_offset_is_a_slice():
    full = sinusoidal_table(40, 16, dtype=torch.float64)
    part = sinusoidal_table(10, 16, offset=30, dtype=torch.float64)
    torch.testing.assert_close(part, full[30:], rtol=0, atol=1e-12)


def test_sinusoidal_module_adds_table_with_offset():
    pe = SinusoidalPositionalEncoding(12, max_len=64, dtype=torch.float64)
    x = torch.randn(3, 9, 12, dtype=torch.float64)
    torch.testing.assert_close(pe(x), x + sinusoidal_table(9, 12, dtype=torch.float64))
    torch.testing.assert_close(pe(x[:, 4:], offset=4), pe(x)[:, 4:])
    assert "pe" not in pe.state_dict()  # a pure function of d_model, not a weight


def test_sinusoidal_module_errors():
    pe = SinusoidalPositionalEncoding(8, max_len=10)
    with pytest.raises(ValueError, match="max_len"):
        pe(torch.randn(1, 6, 8), offset=5)
    with pytest.raises(ValueError, match="d_model=8"):
        pe(torch.randn(1, 3, 9))


def test_sinusoidal_dropout_only_in_training():
    pe = SinusoidalPositionalEncoding(8, max_len=16, dropout=0.5)
    x = torch.randn(4, 16, 8)
    pe.eval()
    torch.testing.assert_close(pe(x), pe(x))
    pe.train()
    assert (pe(x) == 0).any()


def _rope_complex(x, positions, base, interleaved):
    """Independent RoPE: pairs of features as complex numbers times e^{i·θ·p}."""
    d = x.shape[-1]
    if interleaved:
        pairs = x.reshape(*x.shape[:-1], d // 2, 2)
    else:
        pairs = torch.stack((x[..., : d // 2], x[..., d // 2 :]), dim=-1)
    z = torch.view_as_complex(pairs.contiguous())  # (..., N, d/2)
    theta = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    rot = torch.polar(torch.ones_like(theta), positions.double()[:, None] * theta)  # (N, d/2)
    out = torch.view_as_real(z * rot)  # (..., N, d/2, 2)
    if interleaved:
        return out.flatten(-2)
    return torch.cat((out[..., 0], out[..., 1]), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_matches_complex_rotation(interleaved):
    rope = RotaryEmbedding(10, base=500.0, interleaved=interleaved)
    x = torch.randn(2, 3, 7, 10, dtype=torch.float64)
    got = rope.rotate(x, offset=5)
    want = _rope_complex(x, torch.arange(5, 12), 500.0, interleaved)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_rope_preserves_norms_and_position_zero_is_identity():
    rope = RotaryEmbedding(16)
    x = torch.randn(2, 4, 33, 16, dtype=torch.float64)
    y = rope.rotate(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    torch.testing.assert_close(y[..., 0, :], x[..., 0, :], rtol=0, atol=0)
    assert not torch.allclose(y[..., 1:, :], x[..., 1:, :])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_dot_product_depends_only_on_relative_position(interleaved):
    rope = RotaryEmbedding(8, interleaved=interleaved)
    q = torch.randn(8, dtype=torch.float64).expand(1, 1, 1, 8)
    k = torch.randn(8, dtype=torch.float64).expand(1, 1, 1, 8)

    def score(m, n):
        qm = rope.rotate(q, positions=torch.tensor([m]))
        kn = rope.rotate(k, positions=torch.tensor([n]))
        return (qm * kn).sum().item()

    for m, n in [(0, 0), (3, 1), (10, 4), (2, 9)]:
        for shift in (1, 7, 100):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-10)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-6)


def test_rope_positions_per_batch_row_and_forward_pair():
    rope = RotaryEmbedding(6)
    q = torch.randn(2, 4, 5, 6, dtype=torch.float64)
    k = torch.randn(2, 1, 5, 6, dtype=torch.float64)  # fewer heads, as in multi-query attention
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    rq, rk = rope(q, k, positions=pos)
    torch.testing.assert_close(rq[0], rope.rotate(q[:1])[0])
    torch.testing.assert_close(rq[1], rope.rotate(q[1:], offset=7)[0])
    torch.testing.assert_close(rk[1], rope.rotate(k[1:], offset=7)[0])


def test_rope_partial_rotary_dim():
    rope = RotaryEmbedding(12, rotary_dim=4)
    x = torch.randn(1, 2, 6, 12, dtype=torch.float64)
    y = rope.rotate(x, offset=3)
    torch.testing.assert_close(y[..., 4:], x[..., 4:], rtol=0, atol=0)
    torch.testing.assert_close(y[..., :4], RotaryEmbedding(4).rotate(x[..., :4], offset=3))


def test_rope_low_precision_keeps_dtype_and_accuracy():
    rope = RotaryEmbedding(16)
    x = torch.randn(1, 2, 64, 16)
    y16 = rope.rotate(x.to(torch.bfloat16), offset=2000)
    assert y16.dtype == torch.bfloat16
    ref = rope.rotate(x.double(), offset=2000)
    assert (y16.double() - ref).abs().max() < 0.05


def test_rope_errors():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match="head_dim=8"):
        rope.rotate(torch.randn(1, 1, 3, 6))
    with pytest.raises(ValueError, match="positions"):
        rope.rotate(torch.randn(1, 1, 3, 8), positions=torch.arange(4))
