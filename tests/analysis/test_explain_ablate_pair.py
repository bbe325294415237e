"""qkv explain --ablate and --pair on the bundled model, each checked against an independent
computation: ablation against zeroing the head's columns of W_O by hand, pairs against the
tokenizer's own pair encoding fed to the model with its segment ids."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from qkv.cli import main
from qkv.analysis import explain
from qkv.viz import save_html
from qkv.analysis.ablation import parse_head

from ..browser import browser  # noqa: F401  (the headless Chromium driver, module scope)

models = pytest.importorskip("qkv.models")

TROPHY = "The trophy didn't fit in the suitcase because it was too big."


@pytest.fixture(scope="module")
def model(bundled_model):
    return bundled_model


def _ids(model, text, pair=None):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(model.tokenizer.to_str())
    tok.no_padding()
    tok.no_truncation()
    enc = tok.encode(text) if pair is None else tok.encode(text, pair)
    return torch.tensor([enc.ids]), torch.tensor([enc.type_ids]), enc


def _final(model, ids, types=None) -> np.ndarray:
    with torch.inference_mode():
        return model(ids, torch.ones_like(ids), types).last_hidden_state[0].double().numpy()


def _cos_dist(a, b):
    return 1 - (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("heads", [[(1, 3)], [(2, 1), (2, 8), (5, 0)]])
def test_zero_ablation_equals_zeroing_wo_columns(model, heads):
    ex = explain(TROPHY, focus="it", model=model, ablate=heads)
    ids, _, _ = _ids(model, TROPHY)
    clean = _final(model, ids)
    by_hand = copy.deepcopy(model)
    dh = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer, head in heads:  # the head's output only ever reaches W_O through these columns
            by_hand.encoder.layers[layer].self_attn.out_proj.weight[:, head * dh:(head + 1) * dh] = 0
    hit = _final(by_hand, ids)
    want = _cos_dist(clean, hit)
    ab = ex.ablation
    assert ab.heads == sorted(heads) and ab.mode == "zero"
    assert np.abs(ab.token_distance - want).max() < 1e-6
    assert abs(ab.focus_distance - want[ex.focus_index]) < 1e-6
    assert abs(ab.embedding_distance - _cos_dist(clean.mean(0), hit.mean(0))) < 1e-6
    assert ab.focus_distance > 1e-4  # the heads do something
    mean, mx, at = ab.others()
    others = np.delete(want, ex.focus_index)
    assert abs(mean - others.mean()) < 1e-6 and abs(mx - others.max()) < 1e-6 and at != ex.focus_index


def test_mean_ablation_replaces_the_head_output_by_its_mean(model):
    ex = explain(TROPHY, focus="it", model=model, ablate=[(2, 1)], ablate_mode="mean")
    ids, _, _ = _ids(model, TROPHY)
    attn = model.encoder.layers[2].self_attn
    dh = model.config.hidden_size // model.config.num_attention_heads
    outs = {}

    def grab(m, args, out):  # the merged heads entering W_O: (1, N, E)
        outs["x"] = args[0].detach().clone()

    h = attn.out_proj.register_forward_hook(grab)
    try:
        clean = _final(model, ids)
    finally:
        h.remove()
    x = outs["x"].clone()  # a normal tensor, out of inference mode
    x[..., dh:2 * dh] = x[..., dh:2 * dh].mean(dim=1, keepdim=True)  # head 1's mean output over the positions
    pre = attn.out_proj.register_forward_pre_hook(lambda m, args: (x,))
    try:
        hit = _final(model, ids)
    finally:
        pre.remove()
    assert np.abs(ex.ablation.token_distance - _cos_dist(clean, hit)).max() < 1e-6
    assert ex.ablation.mode == "mean"


def test_ablation_leaves_the_model_untouched(model):
    ids, _, _ = _ids(model, TROPHY)
    before = _final(model, ids)
    explain(TROPHY, focus="it", model=model, ablate=[(0, 0), (5, 11)])
    assert np.array_equal(_final(model, ids), before)


def test_pair_is_the_tokenizers_pair_with_segment_ids(model):
    a, b = "The trophy didn't fit in the suitcase.", "It was too big."
    ex = explain(a, focus="it", model=model, pair=b)
    ids, types, enc = _ids(model, a, b)
    assert ex.tokens == enc.tokens and ex.segments == list(enc.sequence_ids)
    assert ex.text == a and ex.pair == b
    start = ex.pair_start
    assert ex.tokens[start - 1] == "[SEP]" and ex.segments[start] == 1 and types[0, start] == 1
    assert ex.segments[ex.focus_index] == 1 and ex.tokens[ex.focus_index] == "it"  # found in the second text
    with torch.inference_mode():
        att = model(ids, torch.ones_like(ids), types, output_attentions=True).attentions
    want = torch.stack([w[0] for w in att]).numpy()  # (L, H, N, N)
    assert np.abs(ex.maps - want).max() < 1e-5
    other = ex.other_segment()
    assert other == [i for i, s in enumerate(enc.sequence_ids) if s == 0]
    assert ex.target_index in other  # the default target comes from the other sentence
    want_pair = want[:, :, ex.focus_index][:, :, other].sum(-1)
    assert np.abs(ex.stats["pair_weight"] - want_pair).max() < 1e-5
    l, h, w = ex.top_pair_heads(1)[0]
    assert abs(w - want_pair.max()) < 1e-5 and want_pair[l, h] == want_pair.max()
    # segment ids matter: the same tokens read as one segment attend differently
    with torch.inference_mode():
        one = model(ids, torch.ones_like(ids), output_attentions=True).attentions
    assert np.abs(torch.stack([w[0] for w in one]).numpy() - want).max() > 1e-3


def test_pair_focus_in_first_text_and_target_given(model):
    ex = explain("Alice wrote the code.", focus="Alice", target="she", model=model, pair="Later she fixed it.")
    assert ex.segments[ex.focus_index] == 0 and ex.tokens[ex.target_index] == "she"
    assert ex.segments[ex.target_index] == 1
    assert "‖ " in ex.to_string() and "other text of the pair" in ex.to_string()
    assert "句对" in ex.to_string(lang="zh")


def test_cli_ablate_json(capsys):
    pytest.importorskip("qkv.models")
    assert main(["explain", TROPHY, "--focus", "it", "--ablate", "2.1", "--ablate", "2.8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    ab = d["ablation"]
    assert ab["heads"] == [{"layer": 2, "head": 1}, {"layer": 2, "head": 8}] and ab["mode"] == "zero"
    assert len(ab["token_distance"]) == len(d["tokens"])
    assert ab["focus_distance"] == ab["token_distance"][d["focus"]["index"]] > 0


def test_cli_ablate_text_and_pair(capsys):
    assert main(["explain", "The trophy didn't fit in the suitcase.", "--pair", "It was too big.", "--focus", "it",
                 "--ablate", "3.1", "--ablate-mode", "mean"]) == 0
    out = capsys.readouterr().out
    assert "‖ " in out and "Ablating L3 H1 (mean-ablated)" in out and "sentence embedding" in out


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return int(e.code)


@pytest.mark.parametrize("spec, words", [
    ("9.0", ["--ablate", "layers 0 to 5"]),
    ("0.12", ["--ablate", "heads 0 to 11"]),
])
def test_cli_ablate_out_of_range(capsys, spec, words):
    assert _exit_code(["explain", TROPHY, "--ablate", spec]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words)


@pytest.mark.parametrize("spec", ["1", "a.b", "1.2.3", "-1.0", ""])
def test_bad_head_spec(capsys, spec):
    with pytest.raises(ValueError, match="LAYER.HEAD"):
        parse_head(spec)
    assert _exit_code(["explain", TROPHY, "--ablate", spec]) == 2
    assert "--ablate" in capsys.readouterr().err


def test_library_bad_arguments(model):
    with pytest.raises(ValueError, match="ablate_mode"):
        explain(TROPHY, model=model, ablate=[(0, 0)], ablate_mode="half")
    with pytest.raises(TypeError, match="pairs of ints"):
        explain(TROPHY, model=model, ablate=[(0, 1.5)])
    with pytest.raises(ValueError, match="no heads"):
        explain(TROPHY, model=model, ablate=[])
    with pytest.raises(ValueError, match="pair is empty"):
        explain(TROPHY, model=model, pair="  ")
    with pytest.raises(TypeError, match="pair must be a string"):
        explain(TROPHY, model=model, pair=["It was big."])


def test_cli_lang_zh_report_and_page(tmp_path, capsys):
    page = tmp_path / "r.html"
    assert main(["explain", "The trophy didn't fit in the suitcase.", "--pair", "It was too big.", "--focus", "it",
                 "--ablate", "3.1", "--lang", "zh", "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "消融 L3 H1（置零）之后" in out and "句对中另一句" in out and "目标：“trophy”" in out
    assert '<html lang="zh' in page.read_text()


def test_long_pairs_shorten_the_longer_text_first(model):
    from qkv.analysis.explain import longest_first

    seg = [None] + [0] * 6 + [None] + [1] * 3 + [None]
    keep = longest_first(seg, 9)  # 3 specials + 6 texts tokens: 3 of each
    assert [seg[i] for i in keep] == [None, 0, 0, 0, None, 1, 1, 1, None] and keep[:4] == [0, 1, 2, 3]
    assert longest_first(seg, 100) == list(range(len(seg)))
    long_a = " ".join(["The trophy did not fit."] * 150)
    ex = explain(long_a, focus="it", model=model, pair="It was too big.")
    assert len(ex.tokens) == 512 and ex.tokens[-1] == "[SEP]"
    assert ex.segments.count(1) == 5 and ex.tokens[ex.pair_start:ex.pair_start + 5] == ["it", "was", "too", "big", "."]
    assert any(n.startswith("the pair has") for n in ex.notes)
    assert "pair_weight" in ex.stats and ex.segments[ex.focus_index] == 1


def test_report_page_shows_the_ablation(browser, model, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    ex = explain(TROPHY, focus="it", model=model, ablate=[(3, 1), (4, 3)])
    path = tmp_path / "ablated.html"
    save_html(ex, path)
    browser.get(path.as_uri())
    assert browser.find_element(By.ID, "ablation").is_displayed()
    assert browser.find_element(By.ID, "ablation-title").text == "Ablating L3 H1, L4 H3 (zeroed)"
    assert f"{ex.ablation.focus_distance:.4f}" in browser.find_element(By.ID, "ablation-summary").text
    browser.find_element(By.ID, "ablation-more").click()
    rows = browser.find_elements(By.CSS_SELECTOR, "#ablation-table tr")
    assert len(rows) == len(ex.tokens)
    shown = [float(r.find_elements(By.TAG_NAME, "td")[1].text) for r in rows]
    assert np.abs(np.array(shown) - ex.ablation.token_distance).max() < 6e-5
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    plain = tmp_path / "plain.html"
    save_html(explain(TROPHY, focus="it", model=model), plain)
    browser.get(plain.as_uri())
    assert not browser.find_element(By.ID, "ablation").is_displayed()


def test_ablation_effect_on_a_module_returning_hidden_states():
    from torch import nn

    from qkv.nn import TransformerEncoder, TransformerEncoderLayer
    from qkv.analysis.ablation import ablation_effect

    class Tiny(nn.Module):  # ids (B, N) -> hidden states (B, N, 16)
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 16)
            self.enc = TransformerEncoder(TransformerEncoderLayer(16, 4, 32, dropout=0.0), 2)

        def forward(self, ids, mask=None):
            return self.enc(self.emb(ids))

    torch.manual_seed(0)
    m = Tiny().eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    ab = ablation_effect(m, ids, torch.ones_like(ids), [(1, 2)], focus_index=2, tokens=list("abcde"))
    hand = copy.deepcopy(m)
    with torch.no_grad():
        hand.enc.layers[1].self_attn.out_proj.weight[:, 8:12] = 0
        clean, hit = m(ids)[0].double().numpy(), hand(ids)[0].double().numpy()
    assert np.abs(ab.token_distance - _cos_dist(clean, hit)).max() < 1e-6 and ab.next_token is None
    with pytest.raises(ValueError, match="final hidden states"):
        ablation_effect(lambda ids, mask: (None,), ids, None, [(0, 0)], focus_index=0, tokens=["x"])


def test_pair_boundary_in_page_and_figure(browser, model, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    from qkv.viz.png import figure

    ex = explain("The trophy didn't fit in the suitcase.", focus="it", model=model, pair="It was too big.")
    start = ex.pair_start
    fig = figure(ex)
    big = fig.axes[-2]  # the focused head's map (the last axes is its colorbar)
    edge = [start - 0.5] * 2
    assert len(big.lines) == 2  # a vertical and a horizontal line where the second text begins
    assert any(list(ln.get_xdata()) == edge for ln in big.lines) and any(list(ln.get_ydata()) == edge for ln in big.lines)
    import matplotlib.pyplot as plt

    plt.close(fig)
    path = tmp_path / "pair.html"
    save_html(ex, path)
    browser.get(path.as_uri())
    starts = browser.find_elements(By.CSS_SELECTOR, ".tok.seg-start")
    assert [e.get_attribute("id") for e in starts] == [f"q-{start}", f"k-{start}"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#right .tok.seg-b")) == ex.segments.count(1)
    assert "‖ It was too big." in browser.find_element(By.CSS_SELECTOR, "p.text").text
