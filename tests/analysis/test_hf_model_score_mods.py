"""The maps ``qkv explain --model`` draws for a transformers model are the weights the model
uses: with Gemma 2's softcapping they equal eager attention's ``output_attentions``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def test_gemma2_maps_carry_the_softcap():
    import qkv.hf
    from qkv.analysis.hf_model import HFExplainModel

    qkv.hf.register()
    cfg = transformers.Gemma2Config(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_logit_softcapping=2.0, query_pre_attn_scalar=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM._from_config(cfg, attn_implementation="qkv").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20.0)  # large scores: the cap changes the weights
    ids = torch.randint(0, 99, (1, 10))
    maps = HFExplainModel(model, None, "tiny-gemma2")(ids).attentions
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids, output_attentions=True).attentions
    assert len(maps) == len(eager) == 2
    for ours, theirs in zip(maps, eager):
        torch.testing.assert_close(ours, theirs.float(), atol=2e-6, rtol=1e-5)
