"""trace_model: one real head of all-MiniLM-L6-v2 in the float64 glass box, equal to the model's own maps."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
models = pytest.importorskip("qkv.models")

from qkv.glass import trace_model
from qkv.inspect import attention_map, record  # noqa: E402
from qkv.glass import Trace  # noqa: E402

SENTENCE = (
    "Alice is an outstanding software engineer; she led the development of the company's core "
    "recommendation system."
)


@pytest.fixture(scope="module")
def model(bundled_model):
    return bundled_model


@pytest.fixture(scope="module")
def model64(model):
    """The same weights in float64: the model's own maps then carry no float32 rounding to compare against."""
    return models.load(dtype=torch.float64)


def _model_maps(model, text: str, layer: int) -> tuple[list[str], np.ndarray]:
    """The model's own weights of every head of ``layer``, rebuilt by qkv.inspect.attention_map."""
    from qkv.glass.model import encode_text

    ids, tokens, _ = encode_text(model, text)
    input_ids = torch.tensor([ids])  # (1, N)
    with torch.no_grad(), record(model, ["*.q", "*.k"]) as rec:
        model(input_ids, torch.ones_like(input_ids))
    name = rec.modules[layer]
    maps = attention_map(rec[f"{name}.q"], rec[f"{name}.k"])  # (1, H, N, N)
    return tokens, maps[0].double().numpy()


@pytest.mark.parametrize("layer, head", [(0, 0), (1, 3), (5, 11)])
def test_weights_equal_the_models_attention_map(model64, layer, head):
    model = model64
    t = trace_model(SENTENCE, model, layer=layer, head=head)
    tokens, maps = _model_maps(model, SENTENCE, layer)
    assert t.tokens == tokens and tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    err = np.abs(t.weights - maps[head]).max()
    print(f"layer {layer} head {head}: max |trace - attention_map| = {err:.2e}")
    assert err < 1e-6
    assert t.x.dtype == np.float64 and t.x.shape == (len(tokens), 384)
    assert (t.d_k, t.d_v, t.w_q.shape, t.b_q.shape) == (32, 32, (384, 32), (32,))
    assert t.meta == {"model": "all-MiniLM-L6-v2", "layer": layer, "head": head, "source": "model", "d_model": 384}
    # the glass box's own arithmetic: Q = X·W_Q + b_Q with that head's columns of the layer
    attn = model.encoder.layers[layer].self_attn
    wq = attn.q_proj.weight.detach().double().numpy()[head * 32 : (head + 1) * 32]  # (32, 384)
    np.testing.assert_allclose(t.q, t.x @ wq.T + attn.q_proj.bias.detach().double().numpy()[head * 32 : (head + 1) * 32])


def test_float32_model_matches_up_to_its_rounding(model):
    """The bundled float32 model: its q and k are rounded to float32, the trace's are not (≈1e-6 apart)."""
    t = trace_model(SENTENCE, model, layer=1, head=3)
    _, maps = _model_maps(model, SENTENCE, 1)
    err = np.abs(t.weights - maps[3]).max()
    print(f"float32 model, layer 1 head 3: max |trace - attention_map| = {err:.2e}")
    assert err < 1e-5


def test_she_looks_at_alice_in_the_head_explain_picks(model):
    from qkv.analysis import explain

    ex = explain(SENTENCE, focus="she", target="alice", model=model)
    layer, head = ex.select()
    top_layer, top_head, w = ex.top_heads(1)[0]  # the head linking "she" to "alice" most, and that weight
    t = trace_model(SENTENCE, model, layer=layer, head=head)
    she, alice = t.tokens.index("she"), t.tokens.index("alice")
    print(f"L{layer} H{head}: she -> alice {t.weights[she, alice]:.3f}")
    assert t.top_keys[she] == alice
    assert (top_layer, top_head) == (layer, head)
    assert t.weights[she, alice] == pytest.approx(w, abs=1e-5)
    assert 0.7 < t.weights[she, alice] < 0.8
    assert '"she" attends most to "alice"' in t.explain(token="she")


def test_model_trace_prints_summarised_and_round_trips(model):
    t = trace_model("我爱机器学习", model, layer=0, head=0)
    # the model's vocabulary knows some characters and not others ([UNK]); one word piece per character
    assert len(t.tokens) == 8 and t.tokens[0] == "[CLS]" and t.tokens[1] == "我" and t.tokens[-1] == "[SEP]"
    text = t.to_string()
    assert max(len(line) for line in text.splitlines()) < 140 and "‖row‖" in text
    assert "model: all-MiniLM-L6-v2, layer 0, head 0" in text
    back = Trace.from_dict(json.loads(json.dumps(t.to_dict(), allow_nan=False)))
    np.testing.assert_array_equal(back.weights, t.weights)
    assert back.meta["layer"] == 0 and back.b_v is not None


def test_model_given_as_a_directory(model):
    t = trace_model("a b", str(models.default_model_dir()), layer=2, head=1)
    assert t.meta["model"] == "all-MiniLM-L6-v2" and t.tokens == ["[CLS]", "a", "b", "[SEP]"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(layer=6, head=0), ValueError, r"layer=6 is out of range: all-MiniLM-L6-v2 has 6 layers, counted from 0; use 0 to 5"),
        (dict(layer=0, head=12), ValueError, r"head=12 is out of range: .* use 0 to 11"),
        (dict(layer=-1, head=0), ValueError, r"layer=-1 is out of range"),
        (dict(layer=True, head=0), TypeError, r"layer must be an int from 0 to 5"),
        (dict(layer=0, head=0, max_tokens=5), ValueError, r"text has \d+ word pieces .* limit is 5 \(max_tokens=5"),
    ],
)
def test_bad_arguments_name_themselves(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        trace_model(SENTENCE, model, **kwargs)


def test_bad_text_and_model(model, tmp_path):
    with pytest.raises(ValueError, match="text is empty"):
        trace_model("  ", model, layer=0, head=0)
    with pytest.raises(TypeError, match="model must be None"):
        trace_model("a", 42, layer=0, head=0)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        trace_model("a", str(tmp_path / "nope"), layer=0, head=0)
