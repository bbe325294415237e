"""qkv.inspect with score functions and sinks: maps, statistics and captured Hugging Face calls
give the weights qkv.attention uses (the float64 math path and oracle), with masks and GQA."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from ..helpers import bundled_model_dir
import torch

import qkv
from qkv.inspect import (
    Recording,
    attention_map,
    attention_scores,
    attention_stats,
    attention_with_stats,
    head_summary,
    observed_map,
    observed_stats,
)
from qkv.backends import stats_native
from qkv.inspect.capture import Recorder
from qkv.reference.attention import attention_ref
from qkv.score_mods import ALiBi, Softcap
from qkv.score_mods.alibi import alibi_slopes

from ..helpers import make_qkv, on_device
from .test_maps import mask_cases
from .test_stats import check, offset_of, ref_stats

f64 = torch.float64
B, HQ, HK, NQ, NK, D = 2, 4, 2, 19, 26, 8  # GQA: two query heads per key/value head
KPOS, REL, TOPK = (0, 5, -1), (-2, -1, 0, 3), 4


def _score_mods():
    table = torch.randn(HQ, NQ + NK - 1, dtype=f64)

    def table_bias(score, b, h, q_idx, kv_idx):  # a closure over a bias table, as attention-gym writes them
        return score + table[h, q_idx - kv_idx + NK - 1]

    return {"softcap": Softcap(2.0), "alibi": ALiBi(alibi_slopes(HQ)), "callable": table_bias, "none": None}


def _sinks():
    s = torch.randn(HQ, dtype=f64) + 1.0
    s[1] = float("-inf")  # a head without a sink
    return s


def _inputs():
    q, k, v = make_qkv(B, HQ, HK, NQ, NK, D, dtype=f64)
    return q * 2.0, k, v  # sharper weights: the softcap bites, the top-k means something


def _reference(q, k, v, sm, sk, kw):
    """Weights (qkv.attention_weights, math backend), the oracle's lse and output, and the sink
    share of every row, as NumPy float64."""
    w = qkv.attention_weights(q, k, enable_gqa=True, score_mod=sm, sinks=sk, **kw).numpy()
    out, lse = attention_ref(q, k, v, enable_gqa=True, score_mod=sm, sinks=sk, return_lse=True, **kw)
    share = None
    if sk is not None:
        s = sk.numpy()[:, None]
        with np.errstate(invalid="ignore"):
            share = np.where(np.isneginf(s) | np.isneginf(lse), 0.0, np.exp(s - lse))
    return w, lse, out, share


def _ref_stats(w, lse, share, kw):
    with np.errstate(divide="ignore"):
        s = np.where(w > 0, np.log(w), -np.inf)  # the order of the scores, and which keys are allowed
    ref = ref_stats(w, s, NQ, NK, offset_of(kw, NQ, NK), TOPK, tuple(p % NK for p in KPOS), REL)
    if share is not None:  # the sink is one more outcome of the row's distribution
        with np.errstate(divide="ignore", invalid="ignore"):
            ref["entropy"] = ref["entropy"] - np.where(share > 0, share * np.log(share), 0.0)
    return ref


# every kind of mask source once (the band, padding with an empty batch entry, bool and float masks)
STATS_MASKS = ("bottom_right", "causal_window", "padding", "bool_mask", "padding_causal_float")
CASES = [(sm, sk) for sm in ("softcap", "alibi", "callable", "none") for sk in (False, True) if (sm, sk) != ("none", False)]


@pytest.mark.parametrize("sm, sk", CASES, ids=[f"{a}{'-sinks' if b else ''}" for a, b in CASES])
def test_maps_and_scores_equal_attention_weights(sm, sk):
    q, k, v = _inputs()
    mod, sinks = _score_mods()[sm], (_sinks() if sk else None)
    for name, kw in mask_cases(B, HQ, NQ, NK):
        w, lse_ref, _, _ = _reference(q, k, v, mod, sinks, kw)
        args = dict(enable_gqa=True, score_mod=mod, sinks=sinks, **kw)
        got = attention_map(q, k, block=8, **args)  # the lse from a fused pass
        np.testing.assert_allclose(got.numpy(), w, atol=1e-12, rtol=0, err_msg=name)
        # chosen heads and rows from qkv.attention's own lse (checked: the rows sum to 1 - the sink's share)
        _, lse = qkv.attention(q, k, v, return_lse=True, **args)
        heads, rows = [3, 0], [NQ - 1, 0, 7]
        got = attention_map(q, k, lse=lse, heads=heads, rows=rows, **args)
        np.testing.assert_allclose(got.numpy(), w[:, heads][:, :, rows], atol=1e-12, rtol=0, err_msg=name)
        # the scores are the modified ones: with the oracle's lse they give the weights
        s = attention_scores(q, k, block=8, **args).numpy()
        with np.errstate(invalid="ignore"):
            from_scores = np.where(np.isneginf(s), 0.0, np.exp(s - lse_ref[..., None]))
        np.testing.assert_allclose(from_scores, w, atol=1e-12, rtol=0, err_msg=name)


@pytest.mark.parametrize("formulation", ["native", "torch"])
@pytest.mark.parametrize("sm, sk", CASES, ids=[f"{a}{'-sinks' if b else ''}" for a, b in CASES])
def test_stats_equal_those_of_attention_weights(monkeypatch, sm, sk, formulation):
    if formulation == "torch":
        monkeypatch.setattr(stats_native, "tile_kernel", lambda q: None)
    q, k, v = _inputs()
    mod, sinks = _score_mods()[sm], (_sinks() if sk else None)
    for name, kw in mask_cases(B, HQ, NQ, NK):
        if name not in STATS_MASKS:
            continue
        w, lse_ref, out_ref, share = _reference(q, k, v, mod, sinks, kw)
        ref = _ref_stats(w, lse_ref, share, kw)
        args = dict(enable_gqa=True, score_mod=mod, sinks=sinks, topk=TOPK, key_positions=KPOS, relative_positions=REL,
                    block_q=8, block_k=16, **kw)  # fmt: skip  (small tiles: the online pass rescales)
        _, lse = qkv.attention(q, k, v, return_lse=True, enable_gqa=True, score_mod=mod, sinks=sinks, **kw)
        one_pass = attention_stats(q, k, **args)
        given = attention_stats(q, k, lse=lse, **args)
        out, fused = attention_with_stats(q, k, v, **args)
        np.testing.assert_allclose(out.numpy(), out_ref, atol=1e-12, rtol=0, err_msg=name)
        for label, st in (("one pass", one_pass), ("given lse", given), ("with output", fused)):
            check(st, ref, f"{name} {label}", tol=1e-10)
            if st is not given:
                np.testing.assert_allclose(st.lse.numpy(), lse_ref, atol=1e-12, rtol=0, err_msg=f"{name} {label}")
            if sinks is None:
                assert st.sink_share is None
            else:
                np.testing.assert_allclose(st.sink_share.numpy(), share, atol=1e-12, rtol=0, err_msg=f"{name} {label}")


def test_float32_statistics_with_a_score_function_and_sinks_are_close_to_float64():
    q, k, v = _inputs()
    sinks = _sinks()
    args = dict(enable_gqa=True, score_mod=Softcap(2.0), is_causal=True, topk=TOPK, key_positions=KPOS, relative_positions=REL)
    want = attention_stats(q, k, sinks=sinks, **args)
    got = attention_stats(q.float(), k.float(), sinks=sinks.float(), **args)
    for f in ("entropy", "max_weight", "topk_weights", "mean_distance", "key_weights", "relative_weights", "lse", "sink_share"):
        err = (getattr(got, f).double() - getattr(want, f)).abs().max().item()
        assert err < 2e-5, (f, err)
    assert torch.equal(got.n_keys, want.n_keys)


def test_a_score_function_that_masks_keys_counts_them_out():
    q, k, v = _inputs()

    def drop_odd_keys(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx % 2 == 1, float("-inf"), score)

    w = qkv.attention_weights(q, k, enable_gqa=True, score_mod=drop_odd_keys).numpy()
    for native in (True, False):
        with pytest.MonkeyPatch.context() as m:
            if not native:
                m.setattr(stats_native, "tile_kernel", lambda q: None)
            st = attention_stats(q, k, enable_gqa=True, score_mod=drop_odd_keys, block_k=16)
        assert (st.n_keys == (NK + 1) // 2).all()
        np.testing.assert_allclose(st.max_weight.numpy(), w.max(-1), atol=1e-12, rtol=0)


def test_an_lse_without_the_sinks_is_refused():
    q, k, v = _inputs()
    sinks = torch.full((HQ,), 2.0, dtype=f64)
    _, lse = qkv.attention(q, k, v, return_lse=True, enable_gqa=True)  # no sinks: rows of the sinked call sum past 1
    with pytest.raises(ValueError, match="sinks"):
        attention_map(q, k, lse=lse, enable_gqa=True, sinks=sinks)
    with pytest.raises(ValueError, match="sinks"):
        attention_stats(q, k, lse=lse, enable_gqa=True, sinks=sinks)


def test_sink_share_in_the_summaries():
    q, k, v = _inputs()
    sinks = torch.tensor([12.0, float("-inf"), 0.0, 0.0], dtype=f64)  # head 0 gives nearly all to its sink
    st = attention_stats(q, k, enable_gqa=True, sinks=sinks, is_causal=True)
    per_head = st.sink_share.mean((0, 2))
    assert per_head[0] > 0.99 and per_head[1] == 0.0
    assert "sink" in st.to_string().splitlines()[1] and "sink_share" in st.to_dict()
    ne = st.normalized_entropy
    assert bool(((ne >= 0) & (ne <= 1 + 1e-12)).all())
    table = head_summary(st)
    row0 = next(r for r in table if r["head"] == 0)
    assert row0["kind"] == "sink-logit" and row0["sink_share"] > 0.99
    assert "sink_share" in table.to_string() and "sink_share" in table._repr_html_()
    assert "sink_share" not in head_summary(attention_stats(q, k, enable_gqa=True))[0]


def test_a_recording_hook_passes_the_calls_score_function_and_sinks_on():
    q, k, v = _inputs()
    mod, sinks = Softcap(2.0), _sinks()
    masks = dict(attn_mask=None, is_causal=True, window=None, key_padding_mask=None, score_mod=mod, sinks=sinks)
    w = qkv.attention_weights(q, k, enable_gqa=True, **masks)
    opts = dict(stats=False, rows=None, heads=None, topk=TOPK, key_positions=(0,), relative_positions=(-1, 0), reuse_lse=False)
    rec = Recording()
    hook = Recorder("", {"weights", "scores", "lse"}, rec, opts)
    hook("lse", None, query=q, key=k, enable_gqa=True, **masks)  # no lse from the model: the hook finds it
    assert torch.allclose(rec["weights"], w, atol=1e-12, rtol=0)
    _, lse = qkv.attention(q, k, v, return_lse=True, enable_gqa=True, **masks)
    assert torch.allclose(rec["lse"], lse, atol=1e-12, rtol=0)
    rec = Recording()
    Recorder("", {"weights"}, rec, dict(opts, stats=True))("lse", lse, query=q, key=k, enable_gqa=True, **masks)
    assert rec.stats[""].sink_share is not None
    assert torch.allclose(rec.stats[""].max_weight, w.amax(-1), atol=1e-12, rtol=0)


@pytest.mark.device
def test_triton_statistics_take_sinks_and_refuse_score_functions():
    pytest.importorskip("triton")
    q, k, _ = make_qkv(2, 4, 2, 37, 45, 16, dtype=torch.float32)
    q = q * 2
    sinks = torch.tensor([1.0, float("-inf"), 3.0, -1.0])
    args = dict(enable_gqa=True, is_causal="bottom_right", topk=3, key_positions=(0, -1), relative_positions=(-1, 0))
    got = attention_stats(on_device(q), on_device(k), sinks=on_device(sinks), backend="triton", **args)
    want = attention_stats(q.double(), k.double(), sinks=sinks.double(), **args)
    assert got.meta.get("backend") == "triton"
    for f in ("entropy", "max_weight", "topk_weights", "mean_distance", "key_weights", "relative_weights", "lse", "sink_share"):
        err = (getattr(got, f).double().cpu() - getattr(want, f)).abs().max().item()
        assert err < 2e-4 * max(1.0, getattr(want, f).abs().max().item()), (f, err)
    with pytest.raises(ValueError, match="score function"):
        attention_stats(on_device(q), on_device(k), score_mod=Softcap(2.0), backend="triton", **args)


# ---------------------------------------------------------------------------- Hugging Face models
def _hf_fields_landed() -> bool:
    try:
        from qkv.hf import HFAttentionCall
    except ImportError:
        return False
    names = {f.name for f in dataclasses.fields(HFAttentionCall)}
    return {"score_mod", "sinks"} <= names


needs_hf_fields = pytest.mark.skipif(not _hf_fields_landed(), reason="qkv.hf.HFAttentionCall has no score_mod/sinks fields yet")


def _hf_pair(cls, cfg, dtype):
    """(qkv model, eager model) with the same weights."""
    import qkv.hf

    qkv.hf.register()
    model = cls._from_config(copy.deepcopy(cfg), attn_implementation="qkv").to(dtype).eval()
    eager = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").to(dtype).eval()
    return model, eager


def _captured(model, eager, ids, mask):
    import qkv.hf

    calls = []
    with torch.no_grad(), qkv.hf.observe(calls.append):
        model(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(calls) == len(ref) > 0
    return calls, ref


@needs_hf_fields
def test_gemma2_softcapped_maps_equal_eager_attentions():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma2Config(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_logit_softcapping=2.0, query_pre_attn_scalar=8,
    )  # fmt: skip
    model, eager = _hf_pair(transformers.Gemma2ForCausalLM, cfg, f64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20.0)  # scores near the cap, where softcapping changes the weights
    eager.load_state_dict(model.state_dict())
    ids = torch.randint(0, 99, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding: every query row still sees a key
    calls, ref = _captured(model, eager, ids, mask)
    for layer, (c, r) in enumerate(zip(calls, ref)):
        assert isinstance(c.score_mod, Softcap) and c.sinks is None
        got = observed_map(c)  # (B, H, N, N)
        # eager's softmax runs in float32
        np.testing.assert_allclose(got.numpy(), r.numpy(), atol=1e-6, rtol=0, err_msg=f"layer {layer}")
        without = attention_map(c.query, c.key, lse=None, attn_mask=c.attn_mask, is_causal=c.is_causal, window=c.window,
                                scale=c.scale, enable_gqa=True)  # fmt: skip
        assert (without - r).abs().max() > 1e-4  # a missing softcap would fail the 1e-6 check above by 100× or more
        st = observed_stats(c, topk=2)
        rn = r.numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            ent = -np.where(rn > 0, rn * np.log(rn), 0.0).sum(-1)
        np.testing.assert_allclose(st.entropy.numpy(), ent, atol=1e-5, rtol=0)
        np.testing.assert_allclose(st.max_weight.numpy(), rn.max(-1), atol=1e-6, rtol=0)


@needs_hf_fields
def test_gpt_oss_sink_maps_and_shares_equal_eager_attentions():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("this transformers has no GPT-OSS")
    cfg = transformers.GptOssConfig(
        vocab_size=99, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
    )  # fmt: skip
    model, eager = _hf_pair(transformers.GptOssForCausalLM, cfg, torch.float32)  # its experts take no float64
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 4.0]))
    eager.load_state_dict(model.state_dict())
    ids = torch.randint(0, 99, (2, 11))
    calls, ref = _captured(model, eager, ids, torch.ones_like(ids))
    for layer, (c, r) in enumerate(zip(calls, ref)):
        assert c.sinks is not None and c.sinks.shape == (4,)
        np.testing.assert_allclose(observed_map(c).numpy(), r.numpy(), atol=2e-6, rtol=0, err_msg=f"layer {layer}")
        st = observed_stats(c)
        np.testing.assert_allclose(st.sink_share.numpy(), 1.0 - r.sum(-1).numpy(), atol=2e-6, rtol=0)
        np.testing.assert_allclose(st.max_weight.numpy(), r.amax(-1).numpy(), atol=2e-6, rtol=0)
        assert 0.0 < float(st.sink_share.min()) and float(st.sink_share.max()) < 1.0


def test_the_glass_box_refuses_a_head_with_a_score_function(monkeypatch):
    bundled_model_dir()
    from qkv import models
    from qkv.glass import trace_model

    model = models.load()  # its own copy: a layer is changed below
    monkeypatch.setattr(model.encoder.layers[1].self_attn, "score_mod", Softcap(5.0), raising=False)
    with pytest.raises(NotImplementedError, match="score function"):
        trace_model("she said", model, layer=1, head=0)
    assert isinstance(trace_model("she said", model, layer=0, head=0).weights, np.ndarray)



def test_a_sink_far_above_the_keys_keeps_float64_exact():
    """A row whose sink outweighs its keys by e^22: the lse is the sink's plus e^-22 of it, which
    a softplus that turns linear past 20 would drop (2.9e-10 off in float64)."""
    q, k, v = (torch.randn(1, 1, 3, 8, dtype=torch.float64) for _ in range(3))
    keys_lse = qkv.attention_ref(q, k, v, return_lse=True)[1]
    sinks = torch.tensor([float(keys_lse.max()) + 22.0], dtype=torch.float64)
    ref_out, ref_lse = qkv.attention_ref(q, k, v, sinks=sinks, return_lse=True)
    out, st = qkv.inspect.attention_with_stats(q, k, v, sinks=sinks)
    assert float((st.lse - torch.as_tensor(ref_lse)).abs().max()) < 1e-13
    assert float((out - torch.as_tensor(ref_out)).abs().max()) < 1e-13
