"""The ``qkv`` command: trace, demo, --version (``qkv info`` is tested with qkv.info)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qkv.cli import main, sentence_trace
from ..helpers import SUBPROCESS_TIMEOUT, bundled_model_dir

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONIOENCODING"] = "utf-8"
    return env


def test_trace_prints_every_step_then_the_story(capsys):
    assert main(["trace", "Thinking Machines"]) == 0
    out = capsys.readouterr().out
    for text in ("X ", "Q = X·W_Q", "K = X·W_K", "V = X·W_V", "scores = Q·Kᵀ", "scaled = scores / √d_k",
                 "weights = softmax", "output = weights·V", "each row sums to 1 ✓",
                 'How self-attention rewrites "Thinking"', "attends most to"):
        assert text in out
    assert out.index("scores = Q·Kᵀ") < out.index("How self-attention")


def test_trace_numbers_are_the_traced_ones(capsys):
    main(["trace", "Thinking Machines", "--seed", "3", "--precision", "2"])
    out = capsys.readouterr().out
    t = sentence_trace("Thinking Machines", seed=3)
    assert f"{t.weights[0, 0]:.2f}" in out and f"{t.scores[1, 0]:.2f}" in out
    assert np.array_equal(t.x, t.x.round(1))  # readable inputs


def test_trace_options(capsys):
    assert main(["trace", "the cat sat", "--heads", "2", "--d-k", "2", "--d-model", "5", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "Head 1 of heads 0–1" in out and "masked₀ = scaled₀ + mask" in out and "projected = concat·W_O" in out
    assert "-inf" in out and "d_model = 5" in out


def test_trace_chinese(capsys):
    assert main(["trace", "Thinking Machines", "--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert "自注意力" in out and "查询" in out and "缩放" in out and "最关注" in out


def test_trace_json(capsys):
    assert main(["trace", "Thinking Machines", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tokens"] == ["Thinking", "Machines"] and d["d_k"] == 3 and d["num_heads"] == 1
    assert np.allclose(np.sum(d["steps"]["weights"], axis=1), 1.0)


def test_repeated_words_share_an_embedding():
    t = sentence_trace("the cat saw the dog", seed=7)
    np.testing.assert_array_equal(t.x[0], t.x[3])
    assert not np.array_equal(t.x[0], t.x[1])


def test_bad_arguments_exit_with_2(capsys):
    assert main(["trace", "   "]) == 2
    assert "sentence is empty" in capsys.readouterr().err
    assert main(["trace", "a b", "--heads", "0"]) == 2
    assert "too small" in capsys.readouterr().err
    assert main(["trace", "a b", "--lang", "fr"]) == 2
    assert main([]) == 2


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("qkv ")


def test_demo_walks_through(capsys):
    assert main(["demo", "--no-model"]) == 0  # the glass-box part alone; the model part is tested in tests/viz
    out = capsys.readouterr().out
    assert 'Self-attention on "Thinking Machines"' in out
    assert "112" in out and "96" in out and "14" in out and "12" in out
    assert "softmax([14, 12]) = [0.881, 0.119]" in out
    assert "Two heads and a causal mask" in out and "Head 1 of heads 0–1" in out and "-inf" in out


def test_demo_chinese(capsys):
    assert main(["demo", "--lang", "zh", "--no-model"]) == 0
    out = capsys.readouterr().out
    assert "教程中的数值例子" in out and "因果掩码" in out


def test_demo_can_be_extended(capsys, monkeypatch):
    from qkv.cli import demo  # the demo command reads its own list; qkv.cli.DEMO_PARTS is the same object

    monkeypatch.setattr(demo, "DEMO_PARTS", demo.DEMO_PARTS + [lambda args: "5. Another part"])
    assert main(["demo", "--no-model"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("5. Another part")


def test_python_m_qkv_trace_json():
    r = subprocess.run(
        [sys.executable, "-m", "qkv", "trace", "Thinking Machines", "--json"],
        capture_output=True, text=True, encoding="utf-8", cwd=ROOT, env=_env(), timeout=SUBPROCESS_TIMEOUT,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tokens"] == ["Thinking", "Machines"]
    assert d["steps"]["masked"] is None and len(d["steps"]["weights"]) == 2


def test_trace_and_glass_box_demo_do_not_import_torch():
    code = (
        "import sys, io, contextlib; import qkv; before = 'torch' in sys.modules\n"
        "from qkv.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['trace', 'a b']); main(['demo', '--no-model'])\n"
        "print(before, 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=SUBPROCESS_TIMEOUT)
    assert r.returncode == 0, r.stderr
    before, after = r.stdout.split()
    if before == "True":
        pytest.skip("the qkv package itself imports torch")
    assert after == "False"


def test_demo_chinese_model_part(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    bundled_model_dir()
    assert main(["demo", "--lang", "zh", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    part = out[out.index("4. 真实模型"):]
    assert "all-MiniLM-L6-v2 有 6 层，每层 12 个注意力头" in part and "已写入：" in part
    assert "qkv trace --model --token she --layer 1 --head 3 --lang zh" in part
    for english in ("Wrote", "has 6 layers", "Where ", "Heads that link", "open in a browser"):
        assert english not in part
    assert (tmp_path / "heatmap.png").is_file() and "<html" in (tmp_path / "report.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_demo_without_the_model_says_what_to_install_and_still_writes_files(capsys, tmp_path, monkeypatch, lang):
    """Installed without the models extra: the real-model part names the pip command, and the
    toy model's figure and page are written instead."""
    import importlib.util

    import qkv.analysis
    import qkv.models

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == qkv.models.BUNDLED_PACKAGE else find_spec(name, *a))

    def missing(*a, **k):  # the model is loaded once per process, so ask where it lives, as a first load does
        qkv.models.default_model_dir()

    monkeypatch.setattr(qkv.analysis, "explain", missing)
    assert main(["demo", "--lang", lang, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pip install 'qkv[models]'" in out and str(tmp_path / "trace.html") in out
    page = (tmp_path / "trace.html").read_text(encoding="utf-8")
    assert "<html" in page.lower() and "Thinking" in page
    assert (tmp_path / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
