"""qkv.hooks on qkv.nn.MultiHeadAttention: registration, order, removal, and the unhooked path."""

from __future__ import annotations

import pytest
import torch

from qkv import hooks
from qkv.nn import MultiHeadAttention

f64 = torch.float64


def _mha() -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(16, 4, num_kv_heads=2, dtype=f64).eval()


def test_editors_then_observers_in_registration_order_and_removed_on_exit():
    m, x = _mha(), torch.randn(2, 5, 16, dtype=f64)
    plain, _ = m(x)
    seen: list[tuple[str, str]] = []

    def editor(tag: str):
        def fn(point: str, t: torch.Tensor) -> torch.Tensor:
            seen.append((tag, point))
            return t * 2 if tag == "outer" else t

        return fn

    with hooks.add_editor(m, editor("outer"), points=("output",)), hooks.add_editor(m, editor("inner"), points=("output",)):
        with hooks.add_observer(m, lambda p, t, **ctx: seen.append(("observer", p)), points=("output",)):
            doubled, _ = m(x)
    assert seen == [("outer", "output"), ("inner", "output"), ("observer", "output")]
    assert hooks.registered(m) == () and hooks.site(m) is None
    assert torch.equal(m(x)[0], plain)
    # out_proj is affine: doubling the heads' output doubles out - bias
    assert torch.allclose(doubled - m.out_proj.bias, 2 * (plain - m.out_proj.bias))


def test_a_raising_forward_leaves_no_hook():
    m, x = _mha(), torch.randn(1, 3, 16, dtype=f64)

    def boom(point: str, t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with hooks.add_editor(m, boom, points=("q",)):
            m(x)
    assert hooks.registered(m) == ()


def test_weights_editor_takes_the_materialising_path_and_keeps_the_output():
    m, x = _mha(), torch.randn(2, 6, 16, dtype=f64)
    plain, _ = m(x, is_causal=True)
    with hooks.add_editor(m, lambda p, w: w, points=("weights",)) as handle:
        assert hooks.site(m).edits("weights")
        same, _ = m(x, is_causal=True)
    handle.remove()  # a second removal is harmless
    assert torch.allclose(same, plain, atol=1e-12)


def test_every_and_unknown_points():
    m, x = _mha(), torch.randn(1, 3, 16, dtype=f64)
    got: list[str] = []
    with hooks.add_observer(hooks.EVERY, lambda p, t, **ctx: got.append(p), points=("q", "output")):
        m(x)
    assert got == ["q", "output"]
    with pytest.raises(ValueError, match="unknown hook point"):
        hooks.add_observer(m, print, points=("scores",))
    assert hooks.registered(m) == ()


def test_point_names_and_matching():
    assert hooks.point_name("layers.0.attn", "q") == "layers.0.attn.q" and hooks.point_name("", "q") == "q"
    assert hooks.matches("*.weights", "", "weights") and hooks.matches("layers.*.attn.q", "layers.3.attn", "q")
    assert not hooks.matches("*.q", "layers.3.attn", "k")
