"""``qkv trace --softcap C | --alibi`` and ``--sinks V[,V...]``: the score function's step and the
sinks in every output, and bad values refused with the option's name."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from qkv.cli import main
from qkv.glass.toy import sentence_trace

torch = pytest.importorskip("torch")

from qkv.score_mods import ALiBi, Softcap, alibi_slopes  # noqa: E402
from .errors import error_line


def test_softcap_prints_the_step_with_the_trace_numbers(capsys):
    assert main(["trace", "the cat sat", "--softcap", "1", "--steps", "scaled,modified", "--token", "cat"]) == 0
    out = capsys.readouterr().out
    t = sentence_trace("the cat sat", score_mod=Softcap(1.0))
    assert "score function: softcap 1·tanh(s/1)" in out and "modified = 1·tanh(scaled / 1)" in out
    block = out[out.index("modified = 1·tanh"):].splitlines()
    row = block[3].split()  # title, column labels, "the", "cat"
    assert row[0] == "cat" and [float(v) for v in row[1:]] == [round(float(v), 3) for v in t.modified[1]]
    assert out.index("scaled = scores / √d_k") < out.index("modified = 1·tanh")
    assert "4. Score function. softcap 1·tanh(s/1) squashes every score smoothly into (−1, 1)" in out
    assert main(["trace", "the cat sat", "--softcap", "2.5", "--lang", "zh"]) == 0
    zh = capsys.readouterr().out
    assert "打分函数：softcap 2.5·tanh(s/2.5)" in zh and "4. 打分函数。" in zh


def test_alibi_takes_the_slopes_of_the_head_count_and_follows_causal(capsys):
    assert main(["trace", "the cat sat", "--alibi", "--heads", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["score_mod"]["kind"] == "alibi" and d["score_mod"]["symmetric"] is True
    assert d["score_mod"]["slopes"] == alibi_slopes(2).double().tolist()
    t = sentence_trace("the cat sat", heads=2, score_mod=ALiBi(alibi_slopes(2), symmetric=True))
    np.testing.assert_allclose(d["steps"]["modified"], t.modified, rtol=1e-15)
    assert main(["trace", "the cat sat", "--alibi", "--causal", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["score_mod"]["symmetric"] is False and d["score_mod"]["slopes"] == [2.0 ** -8]
    assert main(["trace", "the cat sat", "--alibi", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "modified₁ = scaled₁ − m₁·|j − i|" in out and "Farther keys are penalised by slope·distance" in out


def test_sinks_one_for_every_head_or_one_per_head(capsys):
    assert main(["trace", "the cat sat", "--heads", "2", "--sinks", "0.5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["sinks"] == [0.5, 0.5] and d["score_mod"] is None and d["steps"]["modified"] is None
    assert main(["trace", "the cat sat", "--heads", "2", "--sinks", "0.5,-1", "--token", "1"]) == 0
    out = capsys.readouterr().out
    t = sentence_trace("the cat sat", heads=2, sinks=[0.5, -1.0])
    assert "sinks: 0.5 -1" in out and "sink₁ = -1.000" in out and "each row plus its sink's share sums to 1 ✓" in out
    pct = re.search(r"the sink absorbs ([\d.]+)% of row 1's attention", out)
    assert pct and float(pct.group(1)) == pytest.approx(100 * t.heads[0].sink_share[1], abs=0.05)


def test_the_page_and_the_picture_carry_the_step(capsys, tmp_path):
    page = tmp_path / "t.html"
    assert main(["trace", "the cat sat", "--softcap", "1", "--sinks", "0.5", "--html", str(page)]) == 0
    capsys.readouterr()
    data = re.search(r'id="qkv-trace-data">(.*?)</script>', page.read_text(encoding="utf-8"), re.S).group(1)
    d = json.loads(data)
    assert "modified" in d["steps"] and d["score_mod"]["cap"] == 1.0 and d["sinks"] == [0.5]
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert main(["trace", "the cat sat", "--alibi", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--softcap", "0"], "argument --softcap: 0 is not a cap"),
        (["--softcap", "-3"], "argument --softcap: -3 is not a cap"),
        (["--softcap", "inf"], "argument --softcap: inf is not a cap"),
        (["--softcap", "thirty"], "argument --softcap: 'thirty' is not a number"),
        (["--sinks", "1,x"], "argument --sinks: 'x' is not a number"),
        (["--sinks", "nan"], "argument --sinks: nan is not a sink logit"),
        (["--sinks", "1,,2"], "argument --sinks: '1,,2' is not a list of sink logits"),
        (["--sinks", "1,2,3", "--heads", "2"], "--sinks has 3 values but the trace has 2 heads"),
        (["--sinks", "1,2"], "--sinks has 2 values but the trace has 1 head;"),
        (["--softcap", "30", "--alibi"], "--softcap and --alibi are both score functions"),
        (["--alibi", "--model"], "--alibi changes the toy attention trace; --model traces a real head"),
        (["--sinks", "1", "--softcap", "5", "--block"], "--softcap, --sinks change the toy attention trace; --block"),
    ],
)
def test_bad_values_name_the_option(capsys, argv, words):
    assert words in error_line(capsys, ["trace", "the cat sat", *argv])
