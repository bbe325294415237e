"""qkv.models.load on broken, mismatched or garbage model files: errors that name the file and say what is wrong.

Each case is a temporary directory whose good files are symlinks to the bundled model, with
one file replaced; every check runs before a layer is built, so nothing here loads weights.
"""

from __future__ import annotations

import json
import resource

import pytest
import torch

from ..helpers import bundled_model_dir

MODEL_DIR = bundled_model_dir(module_level=True)
models = pytest.importorskip("qkv.models")

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "sentence_bert_config.json")
CONFIG = json.loads((MODEL_DIR / "config.json").read_text())


@pytest.fixture
def model_dir(tmp_path):
    """A model directory of symlinks to the bundled files (replace one to break it)."""
    for name in FILES:
        (tmp_path / name).symlink_to(MODEL_DIR / name)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").symlink_to(MODEL_DIR / "1_Pooling" / "config.json")
    return tmp_path


def _replace(d, name, data):
    (d / name).unlink()
    (d / name).write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return d / name


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"num_attention_heads": 0}, "num_attention_heads=0 must be a positive whole number"),
        ({"hidden_size": "384"}, "hidden_size='384' must be a positive whole number"),
        ({"num_hidden_layers": -1}, "num_hidden_layers=-1 must be a positive whole number"),
        ({"vocab_size": 3.5e4}, "vocab_size=35000.0 must be a positive whole number"),
        ({"hidden_size": 383}, "hidden_size=383 is not divisible by num_attention_heads=12"),
        ({"layer_norm_eps": "tiny"}, "layer_norm_eps='tiny' must be a small positive number"),
        ({"pad_token_id": 99999}, r"pad_token_id=99999 must be a token id in 0\.\.30521"),
        ({"hidden_act": ["gelu"]}, r"hidden_act=\['gelu'\] must be a string"),
    ],
)
def test_bad_config_values_name_the_file(model_dir, patch, message):
    path = _replace(model_dir, "config.json", {**CONFIG, **patch})
    with pytest.raises(ValueError, match=f"config.json at {path}: {message}"):
        models.load(model_dir)


def test_config_larger_than_the_weights_fails_before_allocating(model_dir):
    _replace(model_dir, "config.json", {**CONFIG, "intermediate_size": 250_000_000})  # 384 GB of layers
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(models.CheckpointMismatchError) as info:
        models.load(model_dir)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    msg = str(info.value)
    print(msg, f"\npeak memory grew by {grown_mb:.0f} MB")
    assert f"model.safetensors at {model_dir / 'model.safetensors'} does not match config.json at" in msg
    assert "encoder.layer.0.intermediate.dense.weight: (1536, 384) in the file, (250000000, 384) from config.json" in msg
    assert "\n  " in msg and isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert grown_mb < 50  # the header is read, not the weights (90 MB) nor the layers


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("config.json", b"{not json", r"config.json at {p} is not valid JSON: Expecting property name"),
        ("config.json", b"[1, 2]", r"config.json at {p} holds a JSON list, not an object"),
        ("config.json", b"\xff\xfe\x00", r"config.json at {p} is not text \(UTF-8\) JSON"),
        ("model.safetensors", b"garbage", r"model.safetensors at {p} is not a safetensors file \(.*header"),
        ("model.safetensors", b"", r"model.safetensors at {p} is not a safetensors file"),
        ("tokenizer.json", b"garbage", r"tokenizer.json at {p} is not a tokenizer the `tokenizers` package can read"),
        ("tokenizer_config.json", b"[1,", r"tokenizer_config.json at {p} is not valid JSON"),
        ("sentence_bert_config.json", b"7", r"sentence_bert_config.json at {p} holds a JSON int, not an object"),
        ("1_Pooling/config.json", b'{"pooling_mode_mean_tokens": "yes"}', r"config.json at {p}: .* must be true or false"),
    ],
)
def test_garbage_files_name_the_file(model_dir, name, data, message):
    path = _replace(model_dir, name, data)
    with pytest.raises(ValueError, match=message.format(p=path)):
        models.load(model_dir)


def test_truncated_weights_name_the_file(model_dir):
    path = _replace(model_dir, "model.safetensors", (MODEL_DIR / "model.safetensors").read_bytes()[:100_000])
    with pytest.raises(ValueError, match=f"model.safetensors at {path} "):
        models.load(model_dir)


def test_integer_weights_are_refused(model_dir):
    from safetensors.torch import save_file

    cfg = {**CONFIG, "num_hidden_layers": 1, "hidden_size": 4, "num_attention_heads": 2, "intermediate_size": 8,
           "vocab_size": 40000, "max_position_embeddings": 8}
    _replace(model_dir, "config.json", cfg)
    shapes = models.bert.expected_shapes(models.BertConfig.from_dict(cfg))
    state = {name: torch.zeros(shape, dtype=torch.int32 if "word" in name else torch.float32) for name, shape in shapes.items()}
    (model_dir / "model.safetensors").unlink()
    save_file(state, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"weights must be floating point; embeddings.word_embeddings.weight \(I32\)"):
        models.load(model_dir)


def test_tokenizer_of_a_bigger_vocabulary_is_refused(model_dir):
    from safetensors.torch import save_file

    cfg = {**CONFIG, "num_hidden_layers": 1, "hidden_size": 4, "num_attention_heads": 2, "intermediate_size": 8,
           "vocab_size": 100, "max_position_embeddings": 8}
    _replace(model_dir, "config.json", cfg)
    shapes = models.bert.expected_shapes(models.BertConfig.from_dict(cfg))
    (model_dir / "model.safetensors").unlink()
    save_file({n: torch.zeros(s) for n, s in shapes.items()}, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tokenizer.json at .* has 30522 tokens but config.json says vocab_size=100"):
        models.load(model_dir)


def test_expected_shapes_are_the_models_own():
    model = models.load()
    sd = model.state_dict()
    want = models.bert.expected_shapes(model.config)
    assert {src: tuple(sd[dst].shape) for src, dst in models.hf_weight_map(model.config).items()} == want


def test_bad_load_arguments(model_dir):
    with pytest.raises(TypeError, match="dtype=torch.int8 must be a floating torch dtype"):
        models.load(model_dir, dtype=torch.int8)
    with pytest.raises(ValueError, match="device='gpu0' is not a torch device"):
        models.load(model_dir, device="gpu0")


@torch.no_grad()
def test_forward_refuses_ids_outside_the_vocabulary():
    model = models.load()
    with pytest.raises(ValueError, match=r"input_ids holds ids from 0 to 40000 but the model has 30522 \(0 to 30521\)"):
        model(torch.tensor([[0, 40000]]))
    with pytest.raises(TypeError, match="input_ids must be integer token ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="token_type_ids holds ids from 0 to 2 but the model has 2"):
        model(torch.tensor([[101, 102]]), token_type_ids=torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match=r"token_type_ids has shape \(1, 3\) but input_ids has \(1, 2\)"):
        model(torch.tensor([[101, 102]]), token_type_ids=torch.zeros(1, 3, dtype=torch.long))
