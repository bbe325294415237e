"""qkv.hf: qkv as a Hugging Face attention implementation, against attn_implementation="eager".

Tiny randomly initialised models built from configs: nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.masking_utils")

import qkv.hf  # noqa: E402

TOL = 1e-5  # float32, activations of order 1


@pytest.fixture(scope="module", autouse=True)
def _registered():
    qkv.hf.register()


def _pair(cls, config):
    """The same weights twice: eager attention and qkv (each model gets its own config copy)."""
    eager = cls._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    mine = cls._from_config(copy.deepcopy(config), attn_implementation="qkv").eval()
    mine.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager" and mine.config._attn_implementation == "qkv"
    return eager, mine


def _ids(b=3, n=13, vocab=97):
    return torch.randint(1, vocab, (b, n))


def _padding(b, n, lengths, side="right"):
    mask = torch.zeros(b, n, dtype=torch.long)
    for i, length in enumerate(lengths):
        if side == "right":
            mask[i, :length] = 1
        else:
            mask[i, n - length :] = 1
    return mask


def _compare(eager, mine, ids, mask, what):
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=mask).last_hidden_state
        got = mine(input_ids=ids, attention_mask=mask).last_hidden_state
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    err = float((got - ref).abs()[real].max())
    print(f"{what}: max err on real tokens {err:.2e}")
    assert torch.isfinite(got).all()
    assert err <= TOL * max(1.0, float(ref.abs().max()))
    return got, ref


def _bert_config(**kw):
    return transformers.BertConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96, **kw
    )


def _llama_config(**kw):
    base = dict(
        vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96,
    )
    base.update(kw)
    return transformers.LlamaConfig(**base)


def test_register_is_idempotent_and_named():
    assert qkv.hf.register() == "qkv" and qkv.hf.register() == "qkv"
    assert qkv.hf.is_registered()
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert AttentionInterface()["qkv"] is qkv.hf.attention_forward
    assert "qkv" in ALL_MASK_ATTENTION_FUNCTIONS  # else HF would pass no padding mask at all


def test_register_with_a_backend_runs_every_call_there(monkeypatch):
    """``register(name, backend=...)``: every call of a model under ``name`` reaches
    :func:`qkv.attention` with that backend, observed or not (T5 in float32 on chunked matches
    eager); an unknown backend is refused when registering."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert qkv.hf.register("qkv_chunked", backend="chunked") == "qkv_chunked"
    first = AttentionInterface()["qkv_chunked"]
    qkv.hf.register("qkv_chunked", backend="chunked")
    assert AttentionInterface()["qkv_chunked"] is first is not qkv.hf.attention_forward
    assert qkv.hf.is_registered("qkv_chunked") and "qkv_chunked" in ALL_MASK_ATTENTION_FUNCTIONS
    with pytest.raises(ValueError, match=r"backend='fast' is unknown; choose 'auto' or one of"):
        qkv.hf.register("qkv_fast", backend="fast")
    assert not qkv.hf.is_registered("qkv_fast")

    config = transformers.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, relative_attention_num_buckets=8)  # fmt: skip
    eager = transformers.T5Model._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    mine = transformers.T5Model._from_config(copy.deepcopy(config), attn_implementation="qkv_chunked").eval()
    mine.load_state_dict(eager.state_dict())
    ids = _ids(2, 9)
    inputs = dict(input_ids=ids, decoder_input_ids=ids[:, :5])
    backends = []
    attention = qkv.hf.attention
    monkeypatch.setattr(qkv.hf, "attention", lambda *a, **kw: backends.append(kw["backend"]) or attention(*a, **kw))
    with torch.no_grad():
        ref = eager(**inputs).last_hidden_state
        for observed in (False, True):  # the plain call, and the call through the hook points
            with qkv.hf.observe() if observed else contextlib.nullcontext():
                got = mine(**inputs).last_hidden_state
            assert float((got - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max()))
    assert backends == ["chunked"] * 12, backends  # 6 attention calls (encoder 2, decoder 4), twice


def test_bert_bidirectional_with_padding():
    eager, mine = _pair(transformers.BertModel, _bert_config())
    ids = _ids(4, 13)
    mask = _padding(4, 13, [13, 9, 4, 1])
    got, ref = _compare(eager, mine, ids, mask, "bert padded")
    # padded query positions attend to the real keys in both: equal everywhere
    assert float((got - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max()))
    _compare(eager, mine, ids, None, "bert unpadded")


@pytest.mark.parametrize("side", ["right", "left", "none"])
def test_llama_causal_gqa(side):
    eager, mine = _pair(transformers.LlamaModel, _llama_config())
    assert mine.layers[0].self_attn.num_key_value_groups == 2
    ids = _ids(3, 13)
    mask = None if side == "none" else _padding(3, 13, [13, 8, 3], side)
    with qkv.hf.observe() as calls:
        _compare(eager, mine, ids, mask, f"llama {side}")
    assert len(calls) == 3
    for call in calls:
        assert call.key.shape[1] == 2 and call.query.shape[1] == 4  # K/V not repeated
        if side == "none":  # HF passes no mask: qkv gets is_causal, nothing materialised
            assert call.attn_mask is None and call.is_causal
        else:
            assert call.attn_mask.dtype == torch.bool and not call.is_causal


def test_multi_query_attention():
    eager, mine = _pair(transformers.LlamaModel, _llama_config(num_key_value_heads=1))
    _compare(eager, mine, _ids(2, 9), _padding(2, 9, [9, 5]), "llama MQA")


def test_mistral_sliding_window():
    cfg = transformers.MistralConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, sliding_window=4,
    )
    eager, mine = _pair(transformers.MistralModel, cfg)
    ids = _ids(3, 15)
    got, _ = _compare(eager, mine, ids, _padding(3, 15, [15, 10, 6]), "mistral window=4 padded")
    _compare(eager, mine, ids, None, "mistral window=4")
    # the window matters here: without it the outputs differ clearly
    wide = copy.deepcopy(cfg)
    wide.sliding_window = None
    _, full = _pair(transformers.MistralModel, wide)
    full.load_state_dict(mine.state_dict())
    with torch.no_grad():
        unwindowed = full(input_ids=ids, attention_mask=_padding(3, 15, [15, 10, 6])).last_hidden_state
    assert float((unwindowed - got)[0].abs().max()) > 1e-3


def test_qwen2_mixed_sliding_and_full_layers():
    cfg = transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, use_sliding_window=True, sliding_window=3, max_window_layers=1,
    )
    eager, mine = _pair(transformers.Qwen2Model, cfg)
    _compare(eager, mine, _ids(2, 11), _padding(2, 11, [11, 7]), "qwen2 mixed layers")


def test_decoding_with_kv_cache_matches_eager():
    """Prefill a left-padded batch, then decode fixed tokens one at a time through the KV cache."""
    cfg = _llama_config()
    eager = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    mine = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="qkv").eval()
    mine.load_state_dict(eager.state_dict())
    ids = _ids(2, 7)
    steps = _ids(2, 4)  # the tokens fed while decoding (the same for both models)
    errs = []
    with qkv.hf.observe() as calls:
        for pad in (_padding(2, 7, [7, 4], side="left"), None):
            caches = [transformers.DynamicCache(), transformers.DynamicCache()]
            mask = pad
            logits = []
            with torch.no_grad():
                for step in range(steps.shape[1] + 1):
                    x = ids if step == 0 else steps[:, step - 1 : step]
                    if pad is not None and step > 0:
                        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
                    pair = [m(input_ids=x, attention_mask=mask, past_key_values=c, use_cache=True).logits[:, -1]
                            for m, c in zip((eager, mine), caches, strict=True)]
                    logits.append(pair)
            errs.append(max(float((a - b).abs().max()) for a, b in logits))
    print(f"decoding: max logit err (left-padded, unpadded) {errs[0]:.2e}, {errs[1]:.2e}")
    assert max(errs) <= 1e-4
    decoding = [c for c in calls if c.query.shape[2] == 1]
    assert decoding and all(c.key.shape[2] > 1 for c in decoding)  # one query, every cached key
    assert any(c.attn_mask is None and not c.is_causal for c in decoding)  # HF's unpadded decode: no mask


def test_observer_sees_every_layer_with_lse():
    _, mine = _pair(transformers.LlamaModel, _llama_config())
    ids, mask = _ids(2, 10), _padding(2, 10, [10, 6])
    seen = []
    remove = qkv.hf.add_observer(seen.append)
    try:
        assert len(qkv.hf.observers()) == 1
        with torch.no_grad():
            mine(input_ids=ids, attention_mask=mask)
    finally:
        remove()
    assert qkv.hf.observers() == ()
    assert [c.layer_idx for c in seen] == [0, 1, 2]
    assert all(c.module is layer.self_attn for c, layer in zip(seen, mine.layers, strict=True))
    c = seen[1]
    b, h, nq, d = c.query.shape
    assert c.output.shape == (b, h, nq, d) and c.lse.shape == (b, h, nq)
    # the lse is the log-sum-exp of the masked, scaled scores
    k = c.key.repeat_interleave(h // c.key.shape[1], dim=1)  # (B, H, Nk, D)
    scores = (c.query @ k.transpose(-1, -2)) * c.scale  # (B, H, Nq, Nk)
    scores = scores.masked_fill(~c.attn_mask, float("-inf"))
    expected = torch.logsumexp(scores, dim=-1)
    real = mask.bool()[:, None, :].expand(b, h, nq)
    assert float((c.lse - expected).abs()[real].max()) <= 1e-5
    with torch.no_grad():
        mine(input_ids=ids, attention_mask=mask)
    assert len(seen) == 3  # removed observers are not called
    qkv.hf.add_observer(seen.append)
    qkv.hf.remove_observer(seen.append)  # a fresh bound method removes the same observer
    assert qkv.hf.observers() == ()


def test_observe_context_manager_removes_on_error():
    _, mine = _pair(transformers.BertModel, _bert_config())
    got = []
    with pytest.raises(RuntimeError, match="boom"):
        with qkv.hf.observe(got.append):
            with torch.no_grad():
                mine(input_ids=_ids(1, 5))
            raise RuntimeError("boom")
    assert len(got) == 3 and qkv.hf.observers() == ()
    with pytest.raises(TypeError, match="callable"):
        qkv.hf.add_observer(42)


class _Module(torch.nn.Module):
    def __init__(self, groups=1, is_causal=True):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = is_causal


def _eager(q, k, v, add_mask, scale):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale + add_mask
    return (s.softmax(-1) @ v).transpose(1, 2)  # (B, N, H, D)


def test_function_masks_float_bool_none_and_window():
    b, h, hk, n, d = 2, 4, 2, 9, 8
    q, k, v = torch.randn(b, h, n, d), torch.randn(b, hk, n, d), torch.randn(b, hk, n, d)
    scale = 1 / math.sqrt(d)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = (j <= i)[None, None]  # (1, 1, N, N)
    windowed = causal & (i - j < 3)
    neg = torch.finfo(torch.float32).min
    for allowed, kw in ((causal, {}), (windowed, {"sliding_window": 3})):
        ref = _eager(q, k, v, torch.zeros(1, 1, n, n).masked_fill(~allowed, neg), scale)
        # no mask: causality (and the window) come from the module and the kwargs
        out, w = qkv.hf.attention_forward(_Module(2), q, k, v, None, scaling=scale, **kw)
        assert w is None and out.shape == (b, n, h, d)
        assert float((out - ref).abs().max()) <= TOL
        # bool mask and HF's additive float mask give the same answer
        for mask in (allowed.expand(b, 1, n, n), torch.zeros(b, 1, n, n).masked_fill(~allowed, neg)):
            out, _ = qkv.hf.attention_forward(_Module(2, is_causal=False), q, k, v, mask, scaling=scale)
            assert float((out - ref).abs().max()) <= TOL
    # one decoding query sees every key (HF's convention), even on a causal module
    out, _ = qkv.hf.attention_forward(_Module(2), q[:, :, -1:], k, v, None, scaling=scale)
    assert float((out - _eager(q[:, :, -1:], k, v, torch.zeros(1), scale)).abs().max()) <= TOL
    # weights on request
    out, w = qkv.hf.attention_forward(_Module(2), q, k, v, None, scaling=scale, output_attentions=True)
    assert w.shape == (b, h, n, n) and torch.allclose(w.sum(-1), torch.ones(b, h, n))
    assert (w.masked_select(~causal.expand_as(w)) == 0).all()


def _eager_with(q, k, v, scale, softcap=None, sinks=None):
    """HF's eager arithmetic for Gemma 2's softcap and GPT-OSS's sinks (causal, no padding)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    w = s.softmax(-1)[..., :n]
    return (w @ v).transpose(1, 2), w


class _WeightsEditor:
    """An intervention that edits nothing: the weights path must give the normal output."""

    def __init__(self):
        self.seen = []

    def __call__(self, point, t):
        self.seen.append(point)
        return t


def test_softcap_and_sinks_map_to_score_mod_and_sinks():
    b, h, hk, n, d = 2, 4, 2, 7, 8
    q, k, v = torch.randn(b, h, n, d) * 3, torch.randn(b, hk, n, d) * 3, torch.randn(b, hk, n, d)
    sinks = torch.randn(h) * 2
    scale = 1 / math.sqrt(d)
    module = _Module(2)
    for kw, ref_kw in (({"softcap": 2.0}, {"softcap": 2.0}), ({"s_aux": sinks}, {"sinks": sinks}),
                       ({"softcap": 2.0, "s_aux": sinks}, {"softcap": 2.0, "sinks": sinks})):  # fmt: skip
        ref, ref_w = _eager_with(q, k, v, scale, **ref_kw)
        plain, _ = qkv.hf.attention_forward(module, q, k, v, None, scaling=scale)
        assert float((plain - ref).abs().max()) > 1e-2, f"{kw}: the test inputs do not exercise it"
        with qkv.hf.observe() as calls:
            out, w = qkv.hf.attention_forward(module, q, k, v, None, scaling=scale, output_attentions=True, **kw)
        assert float((out - ref).abs().max()) <= TOL, kw
        assert float((w - ref_w).abs().max()) <= TOL, f"{kw}: output_attentions weights"
        (call,) = calls
        assert (call.score_mod is not None) == ("softcap" in kw) and (call.sinks is not None) == ("s_aux" in kw)
        if "softcap" in kw:
            assert isinstance(call.score_mod, qkv.score_mods.Softcap) and call.score_mod.softcap == 2.0
            assert "softcap" in repr(call)
        if "s_aux" in kw:
            assert call.sinks is sinks
            # the recorded lse includes the sinks: exp(s - lse) are the weights the model used
            sc = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * scale
            if "softcap" in kw:
                sc = torch.tanh(sc / 2.0) * 2.0
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            rebuilt = torch.exp(sc - call.lse[..., None]).masked_fill(~causal, 0)
            assert float((rebuilt - ref_w).abs().max()) <= TOL
        # the weight-editing path applies them too
        editor = _WeightsEditor()
        with qkv.hooks.add_editor(module, editor):
            edited, _ = qkv.hf.attention_forward(module, q, k, v, None, scaling=scale, **kw)
        assert not qkv.hooks.registered(module)
        assert "weights" in editor.seen and float((edited - ref).abs().max()) <= TOL, f"{kw}: weights path"
    # sinks get their gradient like the rest
    s = sinks.clone().requires_grad_(True)
    out, _ = qkv.hf.attention_forward(module, q, k, v, None, scaling=scale, s_aux=s)
    out.sum().backward()
    s_ref = sinks.clone().requires_grad_(True)
    _eager_with(q, k, v, scale, sinks=s_ref)[0].sum().backward()
    assert float((s.grad - s_ref.grad).abs().max()) <= 1e-4


def test_unsupported_kwargs_fail_clearly():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"s_aux=.*\(2,\)"):
        qkv.hf.attention_forward(_Module(), q, q, q, None, s_aux=torch.zeros(1, 2, 3, 1))
    with pytest.raises(ValueError, match="finite positive"):
        qkv.hf.attention_forward(_Module(), q, q, q, None, softcap=-1.0)
    for name in ("indices", "block_indices", "sinks"):  # silently ignoring them would change the answer
        with pytest.raises(NotImplementedError, match=f"{name}=.*_Module.*'eager'"):
            qkv.hf.attention_forward(_Module(), q, q, q, None, **{name: torch.zeros(1, 3, 2, dtype=torch.int32)})


def test_models_that_never_call_the_interface_are_refused():
    """The reported case: XGLM accepted "qkv", made no call to it and ran its own attention."""
    cfg = transformers.XGLMConfig(vocab_size=99, d_model=32, num_layers=2, attention_heads=4, ffn_dim=37)
    with pytest.raises(qkv.hf.UnsupportedModelError, match=r"XGLMForCausalLM .*never call .*'eager' or 'sdpa'"):
        transformers.XGLMForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="qkv")
    transformers.XGLMForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="eager")  # unaffected
    # Falcon raised a bare KeyError while building its layers
    falcon = transformers.FalconConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(qkv.hf.UnsupportedModelError, match="FalconForCausalLM.*ALiBi"):
        transformers.FalconForCausalLM._from_config(falcon, attn_implementation="qkv")


def test_a_module_computing_its_own_attention_is_refused_when_switching():
    model = transformers.LlamaModel._from_config(_llama_config(), attn_implementation="eager")
    assert qkv.hf.unsupported_reason(model) is None
    model.pool = torch.nn.MultiheadAttention(64, 4, batch_first=True)  # e.g. an attention pooling head
    assert "pool (MultiheadAttention)" in qkv.hf.unsupported_reason(model)
    with pytest.raises(qkv.hf.UnsupportedModelError, match="LlamaModel.*pool"):
        model.set_attn_implementation("qkv")
    del model.pool
    model.set_attn_implementation("qkv")
    assert model.config._attn_implementation == "qkv"


def test_register_installs_the_checks_once():
    from transformers import PreTrainedModel

    before = (PreTrainedModel.get_correct_attn_implementation, PreTrainedModel.post_init)
    qkv.hf.register()
    assert (PreTrainedModel.get_correct_attn_implementation, PreTrainedModel.post_init) == before
    assert PreTrainedModel.get_correct_attn_implementation._qkv_checks


def test_record_stats_matches_output_attentions():
    """Streaming statistics of a HF model on qkv equal those of the eager attention maps."""
    eager, mine = _pair(transformers.LlamaModel, _llama_config())
    ids, mask = _ids(2, 10), _padding(2, 10, [10, 6])
    with torch.no_grad(), qkv.inspect.record_stats(topk=3) as stats:
        mine(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        maps = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert [s.layer_idx for s in stats] == [0, 1, 2]
    for st, w in zip(stats, maps, strict=True):  # w: (B, H, N, N) eager weights
        real = mask.bool()[:, None, :].expand(w.shape[:3])  # rows of real query tokens
        p = w.double()
        entropy = -(p * torch.log(torch.where(p > 0, p, torch.ones_like(p)))).sum(-1)
        assert float((st.entropy.double() - entropy).abs()[real].max()) < 1e-4
        assert float((st.max_weight.double() - p.amax(-1)).abs()[real].max()) < 1e-5
        assert torch.equal(st.topk_indices[..., 0][real], p.argmax(-1)[real])


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_record_stats_with_softcap_or_sinks(arch):
    """Statistics describe the weights the model uses (softcapped; sinks in the denominator)."""
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, sliding_window=4)  # fmt: skip
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(**common, attn_logit_softcapping=2.0, query_pre_attn_scalar=8)
        cls = transformers.Gemma2Model
    else:
        cfg = transformers.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.GptOssModel
    eager, mine = _pair(cls, cfg)
    with torch.no_grad():
        for m in (eager, mine):
            for layer in m.layers:  # sharper attention and sinks that matter
                layer.self_attn.scaling *= 16
                if hasattr(layer.self_attn, "sinks"):
                    layer.self_attn.sinks.copy_(torch.linspace(-2, 2, 4))
    ids, mask = _ids(2, 10), _padding(2, 10, [10, 6])
    with torch.no_grad(), qkv.inspect.record_stats(topk=3) as stats:
        mine(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        maps = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    for st, w in zip(stats, maps, strict=True):
        real = mask.bool()[:, None, :].expand(w.shape[:3])
        assert float((st.max_weight.double() - w.double().amax(-1)).abs()[real].max()) < 1e-5
        assert torch.equal(st.topk_indices[..., 0][real], w.argmax(-1)[real])


def test_padded_decoding_runs_on_the_decoding_kernel(monkeypatch):
    """generate()-style decoding of a left-padded batch: HF passes the padding as a broadcast bool
    mask, which qkv takes as key padding, so each one-token step runs the CPU decoding kernel
    (and gives eager's logits)."""
    from qkv.backends import chunked, decode_cpu

    if not decode_cpu.decode_shape(1, 8, torch.float32):
        pytest.skip("the native CPU kernels are not built")
    used = []
    real = chunked.decode_attention
    monkeypatch.setattr(chunked, "decode_attention", lambda call: used.append(call.key_padding_mask) or real(call))
    eager, mine = _pair(transformers.LlamaForCausalLM, _llama_config())
    ids, mask = _ids(2, 7), _padding(2, 7, [7, 4], side="left")
    caches = [transformers.DynamicCache(), transformers.DynamicCache()]
    with torch.no_grad():
        for m, c in zip((eager, mine), caches):
            m(input_ids=ids, attention_mask=mask, past_key_values=c, use_cache=True)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        step = _ids(2, 1)
        a, b = (m(input_ids=step, attention_mask=mask, past_key_values=c, use_cache=True).logits[:, -1]
                for m, c in zip((eager, mine), caches))  # fmt: skip
    assert len(used) == 3  # one call per layer, each with the padding as key padding
    assert all(kp is not None and not bool(kp[1, :3].any()) for kp in used)
    assert float((a - b).abs().max()) <= 1e-4
