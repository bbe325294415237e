"""record(): capture points of qkv.nn modules; head_summary() on synthetic heads of known kind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qkv
from qkv.inspect import POINTS, AttentionStats, attention_stats, head_summary, record
from qkv.nn import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer

f64 = torch.float64


class Model(nn.Module):
    def __init__(self, layers: int = 3, heads: int = 4, kv: int = 2) -> None:
        super().__init__()
        self.encoder = TransformerEncoder(TransformerEncoderLayer(32, heads, 64, dropout=0.0, num_kv_heads=kv, dtype=f64), layers)

    def forward(self, x, **kw):
        return self.encoder(x, **kw)


def attached(model):
    return [p for p, m in model.named_modules() if isinstance(m, MultiHeadAttention) and qkv.hooks.registered(m)]


def test_every_point_is_exact_and_the_output_unchanged():
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(2, 21, 32, dtype=f64)
    kp = torch.ones(2, 21, dtype=torch.bool)
    kp[1, 15:] = False
    plain = model(x, is_causal=True, key_padding_mask=kp)
    with record(model, "*") as rec:
        out = model(x, is_causal=True, key_padding_mask=kp)
    assert torch.equal(out, plain)  # recording changes nothing the model computes
    assert attached(model) == []
    assert rec.modules == [f"encoder.layers.{i}.self_attn" for i in range(3)]
    assert sorted(rec) == sorted(f"{m}.{p}" for m in rec.modules for p in POINTS)
    with record(model, "*", reuse_lse=True) as reused:  # one pass fewer; the call may change backend
        out2 = model(x, is_causal=True, key_padding_mask=kp)
    assert (out2 - plain).abs().max() < 1e-12
    for path in rec:
        assert torch.allclose(rec[path], reused[path], atol=1e-12, equal_nan=True), path
    base = "encoder.layers.1.self_attn"
    q, k, v = rec[f"{base}.q"], rec[f"{base}.k"], rec[f"{base}.v"]
    assert q.shape == (2, 4, 21, 8) and k.shape == v.shape == (2, 2, 21, 8)
    masks = dict(is_causal=True, key_padding_mask=kp, enable_gqa=True)
    o_ref, lse_ref = qkv.attention_ref(q, k, v, return_lse=True, **masks)
    assert np.abs(rec[f"{base}.output"].numpy() - o_ref).max() < 1e-12
    assert np.abs(rec[f"{base}.lse"].numpy() - lse_ref).max() < 1e-12
    w = rec[f"{base}.weights"]
    assert w.shape == (2, 4, 21, 21)
    assert (w - qkv.attention_weights(q, k, **masks)).abs().max() < 1e-12
    s = rec[f"{base}.scores"]
    assert torch.equal(torch.isneginf(s), w == 0) and torch.allclose(torch.softmax(s, -1), w, atol=1e-12)


def test_globs_rows_and_heads():
    model = Model().eval()
    x = torch.randn(1, 30, 32, dtype=f64)
    with record(model, ["encoder.layers.*.self_attn.q", "encoder.layers.2.self_attn.weights"], rows=[-1, 0], heads=[3]) as rec:
        model(x)
    assert sorted(rec) == [f"encoder.layers.{i}.self_attn.q" for i in range(3)] + ["encoder.layers.2.self_attn.weights"]
    q = rec["encoder.layers.2.self_attn.q"]
    w = rec["encoder.layers.2.self_attn.weights"]
    assert w.shape == (1, 1, 2, 30) and rec.calls["encoder.layers.2.self_attn"] == 1
    assert "weights" in rec.to_string() and "Recording" in repr(rec) and "<table>" in rec._repr_html_()
    with pytest.raises(KeyError, match="was not recorded"):
        rec["encoder.layers.0.self_attn.k"]
    assert set(rec.to_dict()) == set(rec)
    assert q.shape == (1, 4, 30, 8)


def test_stats_mode_keeps_only_statistics():
    model = Model(layers=2).eval()
    x = torch.randn(2, 40, 32, dtype=f64)
    with record(model, ["*.weights", "*.q", "*.k"], stats=True, topk=3) as rec:
        model(x, is_causal=True)
    assert sorted(rec.stats) == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert not any(p.endswith(".weights") for p in rec)
    st = rec.stats["encoder.layers.1.self_attn"]
    q, k = rec["encoder.layers.1.self_attn.q"], rec["encoder.layers.1.self_attn.k"]
    want = attention_stats(q, k, is_causal=True, enable_gqa=True, topk=3)
    for field in AttentionStats.ARRAYS:
        assert torch.allclose(getattr(st, field).double(), getattr(want, field).double(), atol=1e-12), field
    assert "stats" in rec.to_dict()
    assert len(head_summary(rec)) == 8


def test_detaches_on_exception_and_nests():
    model = Model(layers=2).eval()
    x = torch.randn(1, 5, 32, dtype=f64)
    with pytest.raises(RuntimeError, match="boom"):
        with record(model, "*.q"):
            raise RuntimeError("boom")
    assert attached(model) == []
    with record(model, "*.q") as outer:
        with record(model, "encoder.layers.0.self_attn.weights") as inner:
            model(x)
        assert len(attached(model)) == 2  # the outer recording's hooks are back
    assert attached(model) == []
    assert len(outer) == 2 and list(inner) == ["encoder.layers.0.self_attn.weights"]


def test_bad_patterns_say_what_exists():
    model = Model(layers=1)
    with pytest.raises(ValueError, match=r"encoder\.layers\.0\.self_attn\.weights"):
        with record(model, "layers.0.self_attn.weights"):
            pass
    with pytest.raises(ValueError, match="no qkv.nn.MultiHeadAttention"):
        with record(nn.Linear(2, 2)):
            pass


def test_need_weights_and_dropout_paths_still_record_exact_weights():
    torch.manual_seed(1)
    m = MultiHeadAttention(24, 4, num_kv_heads=1, dtype=f64).eval()
    x = torch.randn(2, 9, 24, dtype=f64)
    with record(m, ["weights", "lse"]) as rec:
        _, w = m(x, need_weights=True, average_attn_weights=False, is_causal=True)
    assert torch.allclose(rec["weights"], w, atol=1e-12) and rec["lse"].shape == (2, 4, 9)
    with record(m) as default:  # default points "*.weights" select the model's own module too
        m(x)
    assert list(default) == ["weights"]
    m.dropout = 0.5
    m.train()
    with record(m, "weights") as rec:
        m(x, is_causal=True)
    assert torch.allclose(rec["weights"].sum(-1), torch.ones((), dtype=f64), atol=1e-12)  # pre-dropout weights


# ---- head_summary on synthetic heads ------------------------------------------------------


def synthetic_heads(n: int = 48):
    """q (1, 4, n, n), k (1, 1, n, n): one-hot keys; each query head points at a chosen key.

    head 0 looks at the previous token, head 1 at token 0, head 2 everywhere, head 3 at itself.
    """
    eye = torch.eye(n, dtype=f64)
    k = eye[None, None]  # key j = e_j
    sharp = 12.0
    prev = torch.cat([eye[:1], eye[:-1]]) * sharp  # query i -> e_{i-1} (row 0 -> e_0)
    first = eye[:1].expand(n, n) * sharp
    broad = 1e-3 * torch.randn(n, n, dtype=f64)
    self_ = eye * sharp
    q = torch.stack([prev, first, broad, self_])[None]
    return q, k


def test_head_summary_classifies_synthetic_heads():
    q, k = synthetic_heads()
    st = attention_stats(q, k, is_causal=True, enable_gqa=True, scale=1.0)
    table = head_summary(st)
    kinds = {r["head"]: r["kind"] for r in table}
    assert kinds == {0: "previous-token", 1: "first-token", 2: "broad", 3: "self"}
    assert [r["score"] for r in table] == sorted((r["score"] for r in table), reverse=True)
    assert all(r["score"] > 0.9 for r in table)
    text = table.to_string()
    assert "previous-token" in text and "first-token" in text and "<table>" in table._repr_html_()
    tokens = [f"t{i}" for i in range(q.shape[-2])]
    with_tokens = head_summary({"toy": st}, tokens=tokens)
    assert next(r for r in with_tokens if r["head"] == 1)["top_token"] == "t0"
    assert with_tokens.to_dict()[0]["module"] == "toy"


@pytest.mark.parametrize("reuse_lse", [False, True])
def test_recording_a_model_that_makes_nan_records_nan(reuse_lse):
    m = MultiHeadAttention(8, 2, dtype=f64).eval()
    x = torch.randn(1, 5, 8, dtype=f64)
    x[0, 2] = float("nan")
    with record(m, ["weights", "lse"], reuse_lse=reuse_lse) as rec:
        m(x, is_causal=True)  # a hook never raises inside the model's forward
    assert rec["weights"][0, :, 2].isnan().all() and rec["lse"][0, :, 2].isnan().all()
    with record(m, "*.weights", stats=True, reuse_lse=reuse_lse) as rec:
        m(x, is_causal=True)
    assert rec.stats[""].entropy[0, :, 2].isnan().all()


def test_head_summary_refuses_tokens_of_another_length():
    q, k = synthetic_heads(8)
    st = attention_stats(q, k, is_causal=True, enable_gqa=True)
    with pytest.raises(ValueError, match="tokens has 7 strings but toy attend over 8 keys"):
        head_summary({"toy": st}, tokens=[f"t{i}" for i in range(7)])
    with pytest.raises(TypeError, match="'toy' maps to dict, not AttentionStats"):
        head_summary({"toy": st.to_dict()})


def test_head_summary_needs_stats():
    model = Model(layers=1).eval()
    with record(model, "*.q") as rec:
        model(torch.randn(1, 4, 32, dtype=f64))
    with pytest.raises(ValueError, match="stats=True"):
        head_summary(rec)


def test_decoding_with_a_cache_records_the_last_step():
    from qkv.nn import KVCache

    torch.manual_seed(2)
    m = MultiHeadAttention(16, 2, dtype=f64).eval()
    x = torch.randn(1, 7, 16, dtype=f64)
    cache = KVCache()
    with record(m, ["weights", "k"], reuse_lse=True) as rec:
        m(x[:, :5], cache=cache, is_causal=True)
        m(x[:, 5:], cache=cache, is_causal=True)  # 2 new queries see all 7 keys (bottom-right causal)
    assert rec.calls[""] == 2 and rec["k"].shape == (1, 2, 7, 8)
    w = rec["weights"]
    assert w.shape == (1, 2, 2, 7) and (w[:, :, 0, 6] == 0).all() and (w[:, :, 1, 6] > 0).all()
    _, full = m(x, is_causal=True, need_weights=True, average_attn_weights=False)  # (B, H, 7, 7)
    assert torch.allclose(w, full[:, :, 5:], atol=1e-12)
