"""attention_with_stats: the attention output and the statistics from one tiled pass; and
record(stats=True, reuse_lse=True) running the model's attention through it."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.inspect import AttentionStats, attention_stats, attention_with_stats, record
from qkv.inspect import stats as stats_mod
from qkv.backends import stats_native

from ..helpers import assert_within_rule, make_qkv, max_err
from .test_capture import Model
from .test_maps import mask_cases

f64 = torch.float64
SHAPES = [(2, 4, 4, 37, 37), (2, 6, 2, 19, 45), (1, 2, 1, 40, 23)]  # b, hq, hk, nq, nk: GQA, MQA, Nq != Nk


def _torch_formulation(monkeypatch):
    monkeypatch.setattr(stats_native, "tile_kernel", lambda q: None)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_output_and_statistics_every_mask(monkeypatch, shape, native):
    if not native:
        _torch_formulation(monkeypatch)
    b, hq, hk, nq, nk = shape
    for dtype in (f64, torch.float32):
        q, k, v = make_qkv(b, hq, hk, nq, nk, 16, dv=12, dtype=dtype)
        for name, kw in mask_cases(b, hq, nq, nk):
            if "attn_mask" in kw and kw["attn_mask"].is_floating_point():
                kw = {**kw, "attn_mask": kw["attn_mask"].to(dtype)}
            gqa = hq != hk
            out, st = attention_with_stats(q, k, v, enable_gqa=gqa, topk=3, block_q=16, block_k=16, **kw)
            ref, ref_lse = qkv.attention_ref(q.double(), k.double(), v.double(), enable_gqa=gqa, return_lse=True, **kw)
            base, base_lse = qkv.attention(q, k, v, enable_gqa=gqa, return_lse=True, backend="math", **kw)
            assert out.dtype == dtype and out.shape == base.shape and st.lse.shape == base_lse.shape
            assert_within_rule(out, base, torch.as_tensor(ref), dtype, what=f"{name} {dtype} out")
            assert torch.equal(torch.isneginf(st.lse), torch.isneginf(base_lse)), name
            assert_within_rule(st.lse.nan_to_num(neginf=0.0), base_lse.nan_to_num(neginf=0.0),
                               torch.as_tensor(ref_lse).nan_to_num(neginf=0.0), dtype, what=f"{name} {dtype} lse")  # fmt: skip
            alone = attention_stats(q, k, enable_gqa=gqa, topk=3, block_q=16, block_k=16, **kw)
            for field in AttentionStats.ARRAYS + ("lse",):  # the same pass: the same numbers
                assert torch.equal(getattr(st, field), getattr(alone, field)), (name, field)


def test_16_bit_inputs_and_default_tiles():
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = make_qkv(1, 4, 2, 300, 300, 32, dtype=dtype)
        out, st = attention_with_stats(q, k, v, is_causal=True, enable_gqa=True)
        want, lse = qkv.attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
        ref = qkv.attention_ref(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
        assert out.dtype == dtype and st.lse.dtype == torch.float32
        assert_within_rule(out, want, torch.as_tensor(ref), dtype, what=str(dtype))
        assert max_err(st.lse, lse) < 1e-4


def test_non_finite_inputs_make_their_rows_nan():
    q, k, v = make_qkv(1, 2, 2, 10, 12, 8)
    q[0, 0, 3, 1] = float("inf")
    v[0, 1, 5, 0] = float("nan")
    out, st = attention_with_stats(q, k, v)
    want = qkv.attention(q, k, v)
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    bad = torch.zeros(1, 2, 10, dtype=torch.bool)
    bad[0, 0, 3] = True
    bad[0, 1] = True  # every row of head 1 reads the NaN value
    assert torch.equal(torch.isnan(st.lse), bad) and torch.equal(torch.isnan(st.entropy), bad)
    assert (st.topk_indices[bad] == -1).all() and not torch.isnan(st.max_weight[~bad]).any()


def test_bad_arguments_name_the_problem():
    q, k, v = make_qkv(1, 2, 2, 10, 12, 8)
    with pytest.raises(ValueError, match="value"):
        attention_with_stats(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="topk"):
        attention_with_stats(q, k, v, topk=-1)
    q4, k4, v4 = make_qkv(1, 4, 4, 10, 12, 8)
    with pytest.raises(ValueError, match="heads"):
        attention_with_stats(q4, k4[:, :3], v4[:, :3], enable_gqa=True)


def test_record_runs_the_models_attention_through_the_statistics_pass(monkeypatch):
    torch.manual_seed(0)
    model = Model(layers=2).eval()
    x = torch.randn(2, 30, 32, dtype=f64)
    kp = torch.ones(2, 30, dtype=torch.bool)
    kp[1, 20:] = False
    plain = model(x, is_causal=True, key_padding_mask=kp)
    calls = []
    real = stats_mod.attention_with_stats

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr("qkv.inspect.capture.attention_with_stats", counting)
    with torch.no_grad(), record(model, ["*.weights", "*.q", "*.k", "*.lse"], stats=True, reuse_lse=True, topk=3) as rec:
        out = model(x, is_causal=True, key_padding_mask=kp)
    assert len(calls) == 2  # one pass per layer: output, lse and statistics together
    assert (out - plain).abs().max() < 1e-12
    for layer in range(2):
        path = f"encoder.layers.{layer}.self_attn"
        q, k = rec[f"{path}.q"], rec[f"{path}.k"]
        want = attention_stats(q, k, is_causal=True, key_padding_mask=kp, enable_gqa=True, topk=3)
        for field in AttentionStats.ARRAYS + ("lse",):
            assert torch.allclose(getattr(rec.stats[path], field).double(), getattr(want, field).double(), atol=1e-12), field
        assert torch.allclose(rec[f"{path}.lse"], want.lse, atol=1e-12)
    # without reuse_lse the model runs untouched; where gradients flow the recorder declines to run it
    calls.clear()
    with record(model, "*.weights", stats=True) as rec2:
        assert torch.equal(model(x, is_causal=True, key_padding_mask=kp), plain)
    xg = x.clone().requires_grad_()
    with record(model, "*.weights", stats=True, reuse_lse=True) as rec3:
        model(xg, is_causal=True, key_padding_mask=kp).sum().backward()
    assert calls == [] and len(rec2.stats) == len(rec3.stats) == 2 and xg.grad is not None
