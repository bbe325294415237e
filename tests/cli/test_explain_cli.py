"""``qkv explain`` and the model part of ``qkv demo`` on the real all-MiniLM-L6-v2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ..helpers import SUBPROCESS_TIMEOUT, bundled_model_dir

pytest.importorskip("matplotlib", reason="qkv explain --png needs matplotlib: pip install matplotlib")
bundled_model_dir(module_level=True)

from qkv.cli import MODEL_SENTENCE, main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result():
    """One JSON run (the model loads once per process and is reused by the other tests)."""
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["explain", MODEL_SENTENCE, "--focus", "she", "--json"]) == 0
    return json.loads(buf.getvalue())


def test_json_has_tokens_heads_and_stats(result):
    d = result
    assert d["tokens"][:3] == ["[CLS]", "alice", "is"] and d["tokens"][-1] == "[SEP]" and len(d["tokens"]) == 22
    assert d["num_layers"] == 6 and d["num_heads"] == 12 and d["mode"] == "maps"
    assert d["focus"]["token"] == "she" and d["focus"]["index"] == 8
    assert len(d["heads"]) == 6 and all(len(row) == 12 for row in d["heads"])
    for row in d["heads"]:
        for cell in row:
            assert abs(sum(cell["focus_weights"]) - 1) < 1e-2 and len(cell["focus_weights"]) == 22
            assert 0 <= cell["entropy"] <= np.log(22) + 1e-6 and 0 < cell["max_weight"] <= 1
    assert d["selected"] == {"layer": d["top_heads"][0]["layer"], "head": d["top_heads"][0]["head"]}


def test_she_is_linked_to_alice(result):
    # Measured on all-MiniLM-L6-v2 (same numbers from Hugging Face's BertModel): layer 1, head 3
    # sends 0.754 of "she"'s attention to "alice", its largest weight on any content token;
    # layer 5, head 4 follows with 0.733.
    d = result
    assert d["target"]["token"] == "alice" and not d["target"]["given"]  # chosen by weight, not told
    top = d["top_heads"][0]
    assert (top["layer"], top["head"]) == (1, 3) and top["weight"] == pytest.approx(0.754, abs=0.01)
    assert (d["top_heads"][1]["layer"], d["top_heads"][1]["head"]) == (5, 4)
    assert d["heads"][1][3]["top_tokens"][0]["token"] == "alice"
    linking = [(c["layer"], c["head"]) for row in d["heads"] for c in row if c["top_tokens"][0]["token"] == "alice"]
    assert len(linking) >= 5  # several heads, in several layers, make "alice" their top token for "she"


def test_python_m_qkv_explain_prints_json_only():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONIOENCODING="utf-8")
    r = subprocess.run([sys.executable, "-m", "qkv", "explain", MODEL_SENTENCE, "--focus", "she", "--json"],
                       capture_output=True, text=True, encoding="utf-8", cwd=ROOT, env=env, timeout=SUBPROCESS_TIMEOUT)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)  # nothing but the JSON on stdout
    assert d["focus"]["token"] == "she" and d["target"]["token"] == "alice"


def test_terminal_report(capsys, tmp_path):
    png, page = tmp_path / "m.png", tmp_path / "r.html"
    assert main(["explain", MODEL_SENTENCE, "--focus", "She", "--target", "alice", "--png", str(png), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "0:[CLS] 1:alice" in out and "8:she" in out
    assert 'Heads that link "she" most strongly to "alice"' in out and "L1 H3  weight 0.75" in out
    assert "entropy" in out and "[CLS]" in out
    assert f"Wrote PNG: {png}" in out and f"Wrote HTML: {page}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = page.read_text(encoding="utf-8")
    assert "alice" in text and "https://" not in text


def test_target_layer_head_and_subwords(capsys):
    assert main(["explain", "Zylphoria met Alice; she smiled at Zylphoria.", "--focus", "zylphoria",
                 "--target", "alice", "--layer", "2", "--head", "5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["focus"]["matches"] == [1, 2, 3, 4] and d["focus"]["token"] == "z"
    assert any("split into 4 tokens" in n for n in d["notes"]) and any("occurs 2 times" in n for n in d["notes"])
    assert d["target"]["token"] == "alice" and d["target"]["given"] and d["selected"] == {"layer": 2, "head": 5}


def test_bad_focus_and_head_exit_with_2(capsys):
    assert main(["explain", MODEL_SENTENCE, "--focus", "bob"]) == 2
    assert '"bob" is not in the text' in capsys.readouterr().err
    assert main(["explain", MODEL_SENTENCE, "--focus", "she", "--head", "12"]) == 2
    assert "out of range" in capsys.readouterr().err


def test_long_input_switches_to_statistics(capsys, tmp_path):
    long = " ".join([MODEL_SENTENCE] * 30)  # 602 tokens: truncated to the model's 512, then 75 MB of maps
    assert main(["explain", long, "--focus", "she", "--png", str(tmp_path / "s.png"), "--html", str(tmp_path / "s.html")]) == 0
    out = capsys.readouterr().out
    assert "showing statistics" in out and "reads at most 512" in out and "512 tokens" in out
    assert (tmp_path / "s.png").stat().st_size > 10_000 and (tmp_path / "s.html").stat().st_size > 10_000
    assert main(["explain", MODEL_SENTENCE, "--focus", "she", "--json", "--max-map-tokens", "10"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mode"] == "stats" and any("statistics" in n for n in d["notes"])
    assert any("qkv.inspect.record" in n for n in d["notes"])  # streamed: no N x N map built
    assert d["top_heads"][0]["layer"] == 1 and d["top_heads"][0]["head"] == 3  # the same answer without maps


def test_demo_writes_the_report(capsys, tmp_path):
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "4. A real model" in out and str(tmp_path / "demo" / "heatmap.png") in out
    assert (tmp_path / "demo" / "heatmap.png").is_file() and (tmp_path / "demo" / "report.html").is_file()
    assert out.index("Two heads and a causal mask") < out.index("4. A real model")


def test_demo_without_the_model_does_not_import_torch():
    code = (
        "import sys, io, contextlib\nfrom qkv.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as f:\n    main(['demo', '--no-model'])\n"
        "print('torch' in sys.modules, 'skipped: --no-model' in f.getvalue())"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=SUBPROCESS_TIMEOUT)
    assert r.returncode == 0, r.stderr
    if "import torch" in (ROOT / "qkv" / "__init__.py").read_text():
        pytest.skip("the qkv package itself imports torch")
    assert r.stdout.split() == ["False", "True"]
