"""qkv explain --model DIR for Hugging Face checkpoints (GPT-2, LLaMA, Qwen2): tiny models built
from configs and saved with a tokenizer, maps checked against attn_implementation="eager"."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from qkv.cli import main  # noqa: E402
from qkv.analysis import explain  # noqa: E402

TEXT = "the trophy did not fit in the suitcase because it was too big"
WORDS = ["[UNK]", "[PAD]"] + sorted(set(TEXT.split()))


def _save(kind: str, path) -> None:
    torch.manual_seed(0)
    common = dict(vocab_size=len(WORDS), bos_token_id=None, eos_token_id=None, pad_token_id=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "gpt2":
            cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)
            model = transformers.GPT2LMHeadModel(cfg)
        elif kind == "llama":
            cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=64, max_position_embeddings=64, **common)
            model = transformers.LlamaForCausalLM(cfg)
        else:
            cfg = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                           intermediate_size=64, max_position_embeddings=64, **common)
            model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    _save(request.param, path)
    return request.param, path


def _eager_maps(path) -> np.ndarray:
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    ids = torch.tensor([[WORDS.index(w) for w in TEXT.split()]])
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions
    return torch.stack([a[0] for a in att]).numpy()  # (L, H, N, N)


def test_maps_match_eager_attention(checkpoint):
    kind, path = checkpoint
    ex = explain(TEXT, focus="it", model_path=str(path))
    want = _eager_maps(path)
    assert ex.tokens == TEXT.split()
    assert ex.maps.shape == want.shape == (2, 4, 13, 13)
    assert np.abs(ex.maps - want).max() < 1e-5
    assert np.allclose(np.triu(ex.maps, 1), 0.0)  # a decoder: causal maps
    assert ex.model_name == path.name
    assert ex.tokens[ex.focus_index] == "it"


def test_cli_json_png_html(checkpoint, tmp_path, capsys, monkeypatch):
    import qkv.models

    kind, path = checkpoint
    qkv.models.clear_loaded()  # load the checkpoint afresh in this test
    png, page = tmp_path / "m.png", tmp_path / "m.html"
    assert main(["explain", TEXT, "--model", str(path), "--focus", "it", "--json", "--png", str(png), "--html", str(page)]) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert "Loading weights" not in captured.err  # no progress bar between the command and its report
    assert transformers.utils.logging.is_progress_bar_enabled()  # and the user's setting is back
    assert d["tokens"] == TEXT.split() and d["focus"]["token"] == "it" and d["model"] == path.name
    assert d["num_layers"] == 2 and d["num_heads"] == 4
    assert d["target"]["index"] < d["focus"]["index"]  # causal: the focus only reaches earlier tokens
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "http://" not in page.read_text() and "https://" not in page.read_text()


def _out_proj(model, kind: str, layer: int):
    """The projection that merges the heads (its input is the concatenated head outputs)."""
    if kind == "gpt2":
        return model.transformer.h[layer].attn.c_proj
    return model.model.layers[layer].self_attn.o_proj


def test_ablate_next_token_matches_eager_with_zeroed_columns(checkpoint):
    """--ablate on a decoder LM: the next-token change equals an eager model whose head's slice of
    the output projection's input is zeroed by hand."""
    kind, path = checkpoint
    ex = explain(TEXT, focus="it", model_path=str(path), ablate=[(1, 2)])
    eager = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids = torch.tensor([[WORDS.index(w) for w in TEXT.split()]])
    dh = eager.config.hidden_size // eager.config.num_attention_heads

    def run():
        with torch.no_grad():
            out = eager(ids, output_hidden_states=True)
        return out.hidden_states[-1][0].double().numpy(), torch.log_softmax(out.logits[0].double(), -1).numpy()

    clean_h, clean_lp = run()
    hook = _out_proj(eager, kind, 1).register_forward_pre_hook(
        lambda m, args: (torch.cat([args[0][..., :2 * dh], torch.zeros_like(args[0][..., 2 * dh:3 * dh]),
                                    args[0][..., 3 * dh:]], -1),))
    try:
        hit_h, hit_lp = run()
    finally:
        hook.remove()
    f = ex.focus_index
    cos = (clean_h * hit_h).sum(-1) / (np.linalg.norm(clean_h, axis=-1) * np.linalg.norm(hit_h, axis=-1))
    ab = ex.ablation
    assert np.abs(ab.token_distance - (1 - cos)).max() < 1e-5
    nt = ab.next_token
    p, q = clean_lp[f], hit_lp[f]
    assert nt["position"] == f
    assert abs(nt["kl"] - float((np.exp(p) * (p - q)).sum())) < 1e-5
    best = int(np.argmax(p))
    assert nt["clean_top"][0][0] == WORDS[best]
    assert abs(nt["delta_logprob"] - (q[best] - p[best])) < 1e-5
    assert "next-token prediction" in "\n".join(ab.to_lines())


def test_pair_with_a_decoder_tokenizer(checkpoint):
    kind, path = checkpoint
    ex = explain("the trophy did not fit", focus="it", model_path=str(path), pair="it was too big")
    assert ex.tokens == "the trophy did not fit it was too big".split()
    assert ex.segments == [0] * 5 + [1] * 4 and ex.pair_start == 5
    assert ex.tokens[ex.target_index] in "the trophy did not fit".split()
    assert ex.focus_index == 5


def test_compare_with_a_decoder(checkpoint):
    from qkv.analysis import compare

    kind, path = checkpoint
    other = TEXT.replace("big", "fit")  # one word changed, same length
    c = compare(TEXT, other, focus="it", model_path=str(path))
    assert c.a.tokens == TEXT.split() and c.b.tokens == other.split()
    assert len(c.pairs) == len(c.a.tokens) - 1
    f = c.a.focus_index  # "it" comes before the changed last word: a causal row cannot see the change
    assert f < c.a.tokens.index("big")
    assert np.abs(c.distance).max() < 1e-6
