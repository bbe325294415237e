"""The triton statistics kernel on the test device (the GPU, or Triton's CPU interpreter; see
tests/device.py), against the torch pass on the CPU (float64 inputs are not taken by the
kernels, so float32 and the accuracy of float32 sums)."""

from __future__ import annotations

import pytest
import torch

from ..helpers import make_qkv, on_device

pytest.importorskip("triton")

from qkv.inspect import attention_stats  # noqa: E402

pytestmark = [pytest.mark.device, pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")]
FIELDS = ("entropy", "max_weight", "topk_weights", "mean_distance", "key_weights", "relative_weights", "lse")


@pytest.mark.parametrize(
    "case",
    # the interpreter takes ~5 s a case on a CPU: one in the quick tier, the rest in the slow one
    # (a GPU check runs them all)
    ["empty_rows"]
    + [pytest.param(c, marks=pytest.mark.slow) for c in ("plain", "causal", "bottom_right_window", "padding_gqa", "bool_mask", "float_mask")],
)
def test_triton_stats_match_the_torch_pass(case):
    b, hq, hk, nq, nk, d = 2, 4, 4, 37, 45, 16
    kw: dict = {}
    if case == "causal":
        nk = nq
        kw["is_causal"] = True
    elif case == "bottom_right_window":
        kw.update(is_causal="bottom_right", window=(9, 0))
    elif case == "padding_gqa":
        hk = 2
        kw.update(enable_gqa=True, key_padding_mask=torch.arange(nk)[None] < torch.tensor([[nk], [20]]))
    elif case == "bool_mask":
        kw["attn_mask"] = torch.rand(b, 1, nq, nk) > 0.5
    elif case == "float_mask":
        kw["attn_mask"] = torch.randn(nq, nk)
    elif case == "empty_rows":
        m = torch.rand(nq, nk) > 0.6
        m[3] = False
        kw["attn_mask"] = m
    q, k, _ = make_qkv(b, hq, hk, nq, nk, d, dtype=torch.float32)
    q = q * 2
    args = dict(topk=3, key_positions=(0, -1), relative_positions=(-1, 0, 2), **kw)
    got = attention_stats(on_device(q), on_device(k), backend="triton", **on_device(args))
    want = attention_stats(q.double(), k.double(), **{n: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                                                     for n, v in args.items()})
    assert got.meta.get("backend") == "triton"
    assert torch.equal(got.n_keys.cpu(), want.n_keys)
    assert torch.equal(torch.isneginf(got.lse.cpu()), torch.isneginf(want.lse))
    for f in FIELDS:
        a, c = getattr(got, f).double().cpu(), getattr(want, f).double()
        a, c = a.nan_to_num(neginf=0.0), c.nan_to_num(neginf=0.0)
        err = (a - c).abs().max().item() if a.numel() else 0.0
        print(f"{case:>20} {f:>17} max err {err:.2e}")
        assert err < 2e-4 * max(1.0, c.abs().max().item()), (case, f, err)
    # indices: equal wherever the weights are not (numerically) tied
    gap = (want.topk_weights[..., :-1] - want.topk_weights[..., 1:]).abs().min(-1).values > 1e-4
    assert torch.equal(got.topk_indices.cpu()[gap], want.topk_indices[gap])


def test_triton_stats_refuse_what_they_cannot_run():
    q = torch.randn(1, 1, 4, 300)
    with pytest.raises(ValueError, match="backend='triton' cannot"):
        attention_stats(q, q, backend="triton")
    with pytest.raises(ValueError, match="backend='cuda'"):
        attention_stats(q, q, backend="cuda")
