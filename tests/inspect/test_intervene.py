"""Interventions (ablate, patch, patch_from, patching_effects), each checked against a computation
that does not use them: zeroed output-projection columns, hand-built attention, eager HF models."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import qkv.hooks

from qkv.inspect import ablate, attention_modules, capture_outputs, patch, patch_from, patching_effects, record
from qkv.nn import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer

f64 = torch.float64


class Model(nn.Module):
    def __init__(self, layers: int = 2, heads: int = 4, kv: int = 4) -> None:
        super().__init__()
        self.encoder = TransformerEncoder(TransformerEncoderLayer(32, heads, 64, dropout=0.0, num_kv_heads=kv, dtype=f64), layers)

    def forward(self, x, **kw):
        return self.encoder(x, **kw)


def _model(seed: int = 0, **kw) -> Model:
    torch.manual_seed(seed)
    return Model(**kw).eval()


def _without_head(model: nn.Module, path: str, h: int) -> nn.Module:
    """A copy whose output projection ignores head ``h`` of module ``path``: what zeroing its output means."""
    other = copy.deepcopy(model)
    mha = other.get_submodule(path)
    dh = mha.head_dim
    with torch.no_grad():
        mha.out_proj.weight[:, h * dh : (h + 1) * dh] = 0
    return other


def test_zero_ablation_equals_a_model_without_the_heads_and_leaves_it_unchanged():
    model = _model()
    x = torch.randn(2, 13, 32, dtype=f64)
    before = model(x, is_causal=True)
    paths = [p for p, _ in attention_modules(model)]
    assert paths == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    with ablate(model, heads=[(1, 2), (0, 3)]):
        got = model(x, is_causal=True)
    want = _without_head(_without_head(model, paths[1], 2), paths[0], 3)(x, is_causal=True)
    assert (got - want).abs().max() < 1e-12
    assert not torch.equal(got, before)
    assert torch.equal(model(x, is_causal=True), before)  # outside the block: bit-identical
    assert all(not qkv.hooks.registered(m) for _, m in attention_modules(model))


def test_mean_ablation_replaces_a_head_by_its_average_output():
    torch.manual_seed(1)
    mha = MultiHeadAttention(16, 4, dtype=f64).eval()
    x = torch.randn(3, 7, 16, dtype=f64)
    # independent: the head outputs by hand, the mean of head 1 over batch and positions
    q, k, v = (p(x).view(3, 7, 4, 4).transpose(1, 2) for p in (mha.q_proj, mha.k_proj, mha.v_proj))
    heads = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v  # (B, H, N, Dh)
    heads[:, 1] = heads[:, 1].mean(dim=(0, 1), keepdim=True)
    want = mha.out_proj(heads.transpose(1, 2).reshape(3, 7, 16))
    with ablate(mha, heads=[(0, 1)], mode="mean"):
        got, _ = mha(x)
    assert (got - want).abs().max() < 1e-12


def test_patched_weights_are_used_and_returned():
    torch.manual_seed(2)
    mha = MultiHeadAttention(16, 2, dtype=f64).eval()
    x = torch.randn(2, 5, 16, dtype=f64)
    uniform = torch.full((2, 2, 5, 5), 0.2, dtype=f64)
    with patch(mha, {"weights": uniform}):
        got, w = mha(x, need_weights=True, average_attn_weights=False)
    v = mha.v_proj(x).view(2, 5, 2, 8).transpose(1, 2)  # (B, H, N, Dh)
    want = mha.out_proj(v.mean(2, keepdim=True).expand(-1, -1, 5, -1).transpose(1, 2).reshape(2, 5, 16))
    assert (got - want).abs().max() < 1e-12
    assert torch.equal(w, uniform)
    with patch(mha, {"weights": lambda w: w}):  # materialising without changing: same numbers
        same, none = mha(x)
    assert none is None and (same - mha(x)[0]).abs().max() < 1e-12


def test_edits_on_q_k_v_and_globs_and_nesting():
    model = _model(3)
    x = torch.randn(1, 9, 32, dtype=f64)
    with record(model, "*.q") as rec:
        with patch(model, {"*.q": lambda q: q * 0}):
            model(x)
    assert all(rec[f"encoder.layers.{i}.self_attn.q"].abs().max() == 0 for i in range(2))  # capture sees the edit
    with patch(model, {"encoder.layers.0.self_attn.output": lambda o: o * 2}):
        with patch(model, {"encoder.layers.0.self_attn.output": lambda o: o + 1}):
            with capture_outputs(model) as got:
                model(x)
    with capture_outputs(model) as plain:
        model(x)
    want = plain["encoder.layers.0.self_attn"] * 2 + 1
    assert (got["encoder.layers.0.self_attn"] - want).abs().max() < 1e-12


def test_patch_from_the_same_run_changes_nothing_and_from_another_restores_the_head():
    model = _model(4)
    clean, corrupt = torch.randn(2, 1, 11, 32, dtype=f64)
    with capture_outputs(model) as src:
        model(clean)
    with patch_from(model, src, heads=[(l, h) for l in range(2) for h in range(4)]):
        again = model(clean)
    assert torch.equal(again, model(clean))
    with capture_outputs(model) as bad:
        model(corrupt)
    with patch_from(model, src, heads=[(1, 3)]):
        with capture_outputs(model) as patched:
            model(corrupt)
    o = patched["encoder.layers.1.self_attn"]
    assert torch.equal(o[:, 3], src["encoder.layers.1.self_attn"][:, 3])
    assert torch.equal(o[:, :3], bad["encoder.layers.1.self_attn"][:, :3])
    with record(model, "*.output") as rec:  # a Recording works as the source too
        model(clean)
    with patch_from(model, rec, heads=[("encoder.layers.0.self_attn", 0)]):
        model(corrupt)


def test_patching_effects_find_the_only_head_that_matters():
    torch.manual_seed(5)
    mha = MultiHeadAttention(16, 4, dtype=f64).eval()
    with torch.no_grad():
        mha.out_proj.weight[:, 4:] = 0  # only head 0 reaches the output
    clean, corrupt = torch.randn(2, 1, 6, 16, dtype=f64)
    target = mha(clean)[0]

    def metric(out):
        return -(out[0] - target).pow(2).sum()

    res = patching_effects(mha, lambda: mha(clean)[0], lambda: mha(corrupt)[0], metric)
    assert res.effects.shape == (1, 4)
    assert abs(float(res.effects[0, 0]) - 1.0) < 1e-12
    assert res.effects[0, 1:].abs().max() < 1e-12
    assert res.top(1)[0][:2] == (0, 0)
    assert "h0" in res.to_string() and res.to_dict()["modules"] == [""]


def test_bad_arguments_say_what_to_do():
    model = _model(6)
    x = torch.randn(1, 4, 32, dtype=f64)
    with pytest.raises(ValueError, match="matches nothing"):
        with patch(model, {"encoder.layers.9.self_attn.output": torch.zeros(1)}):
            pass
    with pytest.raises(ValueError, match="layer 5 is out of range"):
        with ablate(model, heads=[(5, 0)]):
            pass
    with pytest.raises(ValueError, match="head 4 .* out of range"):
        with ablate(model, heads=[(0, 4)]):
            pass
    with pytest.raises(ValueError, match="mode='max'"):
        with ablate(model, heads=[(0, 0)], mode="max"):
            pass
    with pytest.raises(ValueError, match="returned None"):
        with patch(model, {"*.output": lambda o: None}):
            model(x)
    with pytest.raises(ValueError, match="does not broadcast"):
        with patch(model, {"encoder.layers.0.self_attn.output": torch.zeros(3, 3)}):
            model(x)
    assert all(not qkv.hooks.registered(m) for _, m in attention_modules(model))  # removed after the error
    with pytest.raises(ValueError, match="no qkv.nn.MultiHeadAttention"):
        attention_modules(nn.Linear(2, 2))


# ---- Hugging Face models running on qkv -----------------------------------------------------

transformers = pytest.importorskip("transformers")


def _hf(kind: str):
    import qkv.hf

    qkv.hf.register()
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "gpt2":
            cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, bos_token_id=0, eos_token_id=0)
            model = transformers.GPT2LMHeadModel(cfg)
        else:
            cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=64, vocab_size=50, bos_token_id=0, eos_token_id=0)
            model = transformers.LlamaForCausalLM(cfg)
    model = model.to(f64).eval()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    model.set_attn_implementation("qkv")
    return model, eager


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_zero_ablation_equals_an_eager_model_without_the_head(kind):
    model, eager = _hf(kind)
    ids = torch.randint(0, 50, (2, 10))
    before = model(ids).logits
    with ablate(model, heads=[(1, 2)]):
        got = model(ids).logits
    attn = dict(attention_modules(model))
    path = list(attn)[1]
    m = eager.get_submodule(path)
    dh = 32 // 4
    with torch.no_grad():
        if kind == "gpt2":  # Conv1D: weight (in, out), rows are the merged heads
            m.c_proj.weight[2 * dh : 3 * dh] = 0
        else:
            m.o_proj.weight[:, 2 * dh : 3 * dh] = 0
    # LLaMA's eager softmax runs in float32 (5e-8 from qkv's float64 even without an ablation)
    assert (got - eager(ids).logits).abs().max() < 1e-6 < (got - before).abs().max()
    assert torch.equal(model(ids).logits, before)


def test_hf_needs_the_qkv_attention():
    model, eager = _hf("gpt2")
    with pytest.raises(ValueError, match="attn_implementation='qkv'"):
        with ablate(eager, heads=[(0, 0)]):
            pass


def test_patching_effects_warn_about_a_tiny_gap_and_render_in_notebooks():
    """A clean-minus-corrupted gap of 0.0064 makes "25% restored" noise: the text and the
    notebook table say so; a real gap gives no warning."""
    from qkv.inspect.intervene import PatchingEffects

    tiny = PatchingEffects(torch.tensor([[0.25, 0.1], [float("nan"), -0.3]]), torch.zeros(2, 2), 1.0064, 1.0, ["a", "b"])
    assert tiny.gap_is_small and "differ by only 0.0064" in tiny.to_string()
    html = tiny._repr_html_()
    assert "<table>" in html and "differ by only 0.0064" in html and html.count("<tr>") == 3
    real = PatchingEffects(torch.tensor([[0.25, 0.1]]), torch.zeros(1, 2), 3.0, 1.0, ["a"])
    assert real.warning() is None and "warning" not in real.to_string() and "warning" not in real._repr_html_()
