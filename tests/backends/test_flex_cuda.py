"""The ``flex`` engine on a GPU (run by the GPU check; skipped without CUDA): what it does there
beyond the CPU — gradients (into q, k, v and into the tensors a score function reads) and the
lse — within the rule against the float64 oracle, and ``auto`` routing to it.

Candidates run on CUDA; the oracle and the same-dtype math baseline on the CPU (tests/device.py).
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.backends import BACKENDS, auto_order
from qkv.call import validate
from qkv.score_mods import ALiBi, alibi_slopes

from ..helpers import DEVICE, assert_within_rule, make_qkv

pytestmark = [pytest.mark.device, pytest.mark.skipif(DEVICE != "cuda", reason="the flex engine's GPU path needs CUDA")]
FLEX = BACKENDS["flex"]


def _leaves(*ts: torch.Tensor, device: str = "cpu") -> list[torch.Tensor]:
    return [t.detach().to(device).requires_grad_() for t in ts]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["window", "padding_gqa", "python_score", "alibi", "mask_mod"])
def test_forward_backward_and_lse_within_the_rule(case, dtype):
    q, k, v = make_qkv(2, 4, 2 if case == "padding_gqa" else 4, 200, 200, 64, dtype=dtype, seed=11)
    bias = torch.randn(4, 399, dtype=torch.float32, generator=torch.Generator().manual_seed(12)) * 0.3
    kp = torch.rand(2, 200, generator=torch.Generator().manual_seed(13)) > 0.3
    slopes = alibi_slopes(4)

    def kwargs(dev: str, params: list[torch.Tensor]) -> dict:
        if case == "window":
            return dict(is_causal="bottom_right", window=(64, 0))
        if case == "padding_gqa":
            return dict(key_padding_mask=kp.to(dev), enable_gqa=True)
        if case == "python_score":
            table = params[0]
            return dict(is_causal=True, score_mod=lambda s, b, h, i, j: s + table[h, j - i + 199])
        if case == "alibi":
            return dict(is_causal=True, score_mod=ALiBi(params[0]))
        return dict(mask_mod=lambda b, h, i, j: (i // 50) == (j // 50))

    extra = [bias] if case == "python_score" else [slopes] if case == "alibi" else []
    dout = torch.randn(2, 4, 200, 64, generator=torch.Generator().manual_seed(14))
    results = {}
    for name, dev, cast in (("flex", "cuda", dtype), ("math", "cpu", dtype), ("ref", "cpu", torch.float64)):
        leaves = _leaves(*(t.to(cast) for t in (q, k, v)), device=dev)
        params = _leaves(*extra, device=dev)
        backend = "flex" if name == "flex" else "math"
        out = qkv.attention(*leaves, backend=backend, **kwargs(dev, params))
        grads = torch.autograd.grad(out, [*leaves, *params], dout.to(dev, out.dtype))
        with torch.no_grad():
            _, lse = qkv.attention(*(t.detach() for t in leaves), backend=backend, return_lse=True, **kwargs(dev, params))
        results[name] = [out, lse, *grads]
    for i, what in enumerate(["out", "lse", "dq", "dk", "dv", "dparam"][: len(results["ref"])]):
        got, base, ref = (results[n][i].detach().cpu() for n in ("flex", "math", "ref"))
        if what == "lse":
            assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), "empty rows: lse -inf"
            finite = torch.isfinite(ref)
            got, base, ref = got[finite], base[finite], ref[finite]
        assert_within_rule(got, base, ref, dtype, factor=2.0 if what in ("out", "lse") else 3.0, what=f"{case} {what}")


def test_auto_routes_windows_and_functions_to_flex_and_sinks_to_triton():
    q, k, v = make_qkv(1, 4, 4, 256, 256, 64, dtype=torch.bfloat16)
    q, k, v = (t.to("cuda") for t in (q, k, v))
    assert auto_order(validate(q, k, v, window=(32, 0)))[0] is FLEX
    assert auto_order(validate(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5))[0] is FLEX
    assert auto_order(validate(q, k, v, is_causal=True))[0].NAME == "sdpa"
    assert auto_order(validate(q, k, v, sinks=torch.zeros(4, device="cuda")))[0].NAME == "triton"
