"""``qkv trace``: stdin, --token, --steps, --json --precision, --html/--png wiring, --model, --block, flag mistakes."""

from __future__ import annotations

import io
import json
import sys
import types

import numpy as np
import pytest

from qkv import cli
from qkv.cli import main
from qkv.glass.toy import sentence_trace
from ..helpers import bundled_model_dir
from .errors import error_line


def _needs_model():
    pytest.importorskip("torch")
    bundled_model_dir()


# -- the toy trace ---------------------------------------------------------------------------


def test_counting_convention_is_stated_once_at_the_top(capsys):
    assert main(["trace", "the cat sat", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "Counting: tokens and heads are numbered from 0 (as in --token, --head and the JSON)."
    assert out.count("numbered from 0") == 1 and "Head 0 of heads 0–1" in out and "Head 2" not in out
    assert main(["trace", "the cat sat", "--lang", "zh"]) == 0
    assert capsys.readouterr().out.startswith("编号约定：词元和注意力头都从 0 开始编号")


def test_text_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("我爱机器学习\n"))
    assert main(["trace", "-", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tokens"] == ["我", "爱", "机", "器", "学", "习"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    assert "standard input was empty" in error_line(capsys, ["trace", "-"])


def test_token_by_word_or_index(capsys):
    assert main(["trace", "Thinking Machines", "--token", "Machines"]) == 0
    by_word = capsys.readouterr().out
    assert 'How self-attention rewrites "Machines" (token 1 of tokens 0–1)' in by_word
    assert main(["trace", "Thinking Machines", "--token", "1"]) == 0
    assert capsys.readouterr().out == by_word
    assert main(["trace", "Thinking Machines", "--token", "-2"]) == 0
    assert 'rewrites "Thinking" (token 0' in capsys.readouterr().out


def test_token_not_found_lists_the_tokens(capsys):
    line = error_line(capsys, ["trace", "Thinking Machines", "--token", "Bob"])
    assert line == ("qkv trace: error: --token 'Bob' is not one of the tokens: 0:Thinking 1:Machines; "
                    "pass a token or its index (from 0)")
    line = error_line(capsys, ["trace", "Thinking Machines", "--token", "2"])
    assert "--token 2 is out of range: there are 2 tokens, 0 to 1: 0:Thinking 1:Machines" in line


def test_steps(capsys):
    assert main(["trace", "a b c", "--steps", "scores, weights"]) == 0
    out = capsys.readouterr().out
    assert "scores = Q·Kᵀ" in out and "weights = softmax" in out
    assert "Q = X·W_Q" not in out and "output = weights·V" not in out
    line = error_line(capsys, ["trace", "a b", "--steps", "scores,logits"])
    assert "--steps: unknown step name(s) logits; use a comma list of x, q, k, v, scores" in line
    assert "--steps" in error_line(capsys, ["trace", "a b", "--steps", ","])


def test_json_precision_and_schema(capsys):
    assert main(["trace", "Thinking Machines", "--json", "--precision", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    t = sentence_trace("Thinking Machines")
    assert d["schema_version"] == 2 and d["kind"] == "attention" and d["meta"] == {}
    assert d["steps"]["weights"][0][1] == round(float(t.weights[0, 1]), 2)
    assert all(v == round(v, 2) for row in d["steps"]["scores"] for v in row)
    assert main(["trace", "Thinking Machines", "--json"]) == 0  # no --precision: full float64
    assert json.loads(capsys.readouterr().out)["steps"]["weights"][0][1] == float(t.weights[0, 1])


# -- --html and --png: the page and picture modules, imported when asked for ----------------------


def _stand_in(monkeypatch, module: str, func: str, calls: list):
    def save(trace, path, **kw):
        calls.append((func, trace, path, kw))
        with open(path, "w", encoding="utf-8") as f:
            f.write("x")
        return str(path)

    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{func: save}))


def test_html_and_png_are_handed_the_trace(capsys, monkeypatch, tmp_path):
    calls: list = []
    _stand_in(monkeypatch, "qkv.glass.page", "save_trace_page", calls)
    _stand_in(monkeypatch, "qkv.glass.png", "save_trace_png", calls)
    html, png = tmp_path / "t.html", tmp_path / "t.png"
    assert main(["trace", "Thinking Machines", "--html", str(html), "--png", str(png), "--lang", "zh",
                 "--precision", "2", "--token", "Machines"]) == 0
    out = capsys.readouterr().out
    (f1, t1, p1, kw1), (f2, t2, p2, kw2) = calls
    assert (f1, p1, kw1) == ("save_trace_page", str(html), {"lang": "zh", "precision": 2, "token": 1})
    assert (f2, p2, kw2) == ("save_trace_png", str(png), {"lang": "zh", "token": 1})
    assert t1 is t2 and t1.tokens == ["Thinking", "Machines"]
    assert f"已写入 HTML：{html}" in out and f"已写入 PNG：{png}" in out


def test_html_into_a_missing_directory_is_refused_before_any_work(capsys, tmp_path):
    bad = tmp_path / "no" / "t.html"
    line = error_line(capsys, ["trace", "a b", "--html", str(bad)])
    assert f"argument --html: cannot write {bad}: directory {bad.parent} does not exist" in line


def test_real_png_of_a_toy_trace(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("qkv.glass.png")
    png = tmp_path / "t.png"
    assert main(["trace", "Thinking Machines", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Wrote PNG: {png}" in capsys.readouterr().out


def test_real_html_page_of_a_toy_trace(capsys, tmp_path):
    pytest.importorskip("qkv.glass.page")
    page = tmp_path / "t.html"
    assert main(["trace", "Thinking Machines", "--html", str(page), "--token", "1"]) == 0
    text = page.read_text(encoding="utf-8")
    assert "Machines" in text and "<script" in text.lower()


# -- --block ------------------------------------------------------------------------------------


def test_block(capsys, tmp_path):
    pytest.importorskip("qkv.glass.block")
    from qkv.glass.block import toy_block_trace

    assert main(["trace", "the cat sat", "--block", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    b = toy_block_trace(["the", "cat", "sat"], seed=2)
    assert out.startswith("Counting:") and b.to_string() in out and b.explain() in out
    assert main(["trace", "the cat sat", "--block", "--json", "--precision", "3", "--seed", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "block" and d["attention"]["kind"] == "attention"
    assert d["steps"]["output"][0][0] == round(float(b.output[0, 0]), 3)
    assert main(["trace", "我爱你", "--block", "--steps", "norm1", "--token", "爱", "--d-ff", "4"]) == 0
    out = capsys.readouterr().out
    only = toy_block_trace(["我", "爱", "你"], d_ff=4).to_string(steps=("norm1",))
    assert only in out and "norm1 = " in only and "hidden = norm1·W1" not in only
    assert toy_block_trace(["我", "爱", "你"], d_ff=4).explain(token=1) in out
    assert "--steps: unknown step name(s) scores" in error_line(capsys, ["trace", "a b", "--block", "--steps", "scores"])


# -- flag combinations ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, match",
    [
        (["trace", "a b", "--layer", "1"], "--layer picks a head of a real model; add --model"),
        (["trace", "a b", "--head", "1"], "--head picks a head of a real model; add --model"),
        (["trace", "a b", "--max-tokens", "9"], "--max-tokens limits a --model trace"),
        (["trace", "a b", "--model", "--block"], "--block traces a toy encoder block"),
        (["trace", "a b", "--model", "--heads", "2", "--causal"], "--heads, --causal set the toy numbers"),
        (["trace", "a b", "--d-ff", "4"], "--d-ff is the width of a block's feed-forward layer; add --block"),
        (["trace", "a b", "--json", "--steps", "scores"], "--steps chooses what the terminal view prints"),
    ],
)
def test_bad_flag_combinations(capsys, argv, match):
    line = error_line(capsys, argv)
    assert line.startswith("qkv trace: error: ") and match in line


# -- --model: a real head ------------------------------------------------------------------------


def test_model_defaults_to_the_head_explain_picks(capsys):
    _needs_model()
    from qkv.analysis import explain

    assert main(["trace", "--model", "--token", "she", "--steps", "weights"]) == 0
    out = capsys.readouterr().out
    layer, head = explain(cli.MODEL_SENTENCE, focus="she").select()
    assert out.splitlines()[0].startswith("Counting: tokens, layers and heads are numbered from 0")
    assert f"model: all-MiniLM-L6-v2, layer {layer}, head {head}" in out
    assert 'In short: "she" attends most to "alice" (weight 0.75' in out
    assert "the largest are q[" in out  # d_k = 32: the dot product is quoted by its largest terms


def test_model_layer_head_json_and_files(capsys, monkeypatch, tmp_path):
    _needs_model()
    calls: list = []
    _stand_in(monkeypatch, "qkv.glass.png", "save_trace_png", calls)
    png = tmp_path / "m.png"
    assert main(["trace", "Alice said she would come", "--model", "--layer", "2", "--head", "4", "--json",
                 "--precision", "4", "--png", str(png), "--token", "she"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["meta"] == {"model": "all-MiniLM-L6-v2", "layer": 2, "head": 4, "source": "model", "d_model": 384}
    assert d["tokens"][0] == "[CLS]" and d["d_k"] == 32 and len(d["params"]["b_q"]) == 32
    assert np.allclose(np.sum(d["steps"]["weights"], axis=1), 1.0, atol=1e-3)
    (_, t, path, kw), = calls
    assert path == str(png) and kw == {"lang": "en", "token": t.tokens.index("she")} and t.meta["layer"] == 2


def test_model_errors_name_the_flag(capsys, tmp_path):
    _needs_model()
    assert "--layer 6 is out of range: all-MiniLM-L6-v2 has 6 layers per model, counted from 0; use 0 to 5" in error_line(
        capsys, ["trace", "a b", "--model", "--layer", "6", "--head", "0"])
    assert "--head 12 is out of range" in error_line(capsys, ["trace", "a b", "--model", "--layer", "0", "--head", "12"])
    assert "(--max-tokens)" in error_line(capsys, ["trace", "a b c d e", "--model", "--layer", "0", "--head", "0",
                                               "--max-tokens", "3"])
    assert "--token 'bob' is not one of the tokens: 0:[CLS] 1:a 2:b 3:[SEP]" in error_line(
        capsys, ["trace", "a b", "--model", "--layer", "0", "--head", "0", "--token", "bob"])
    assert f"--model {tmp_path}" in error_line(capsys, ["trace", "a b", "--model", str(tmp_path)])
