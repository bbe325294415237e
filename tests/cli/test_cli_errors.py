"""User mistakes on the ``qkv`` command line: one clear message on stderr and exit code 2, never a traceback.

Paths, sizes and devices are checked when the arguments are parsed (before any model runs);
what only writing can find (``/dev/full``, ``/proc``) is caught when the file is written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.cli import main
from ..helpers import SUBPROCESS_TIMEOUT, bundled_model_dir
from .errors import error_line

ROOT = Path(__file__).resolve().parents[2]


def _needs_model():
    pytest.importorskip("matplotlib")
    bundled_model_dir()


# -- explain: output files, sizes, model directory --------------------------------------------


def test_explain_output_file_in_a_missing_directory(capsys, tmp_path):
    bad = tmp_path / "no" / "x.html"
    line = error_line(capsys, ["explain", "--html", str(bad)])
    assert line == f"qkv explain: error: argument --html: cannot write {bad}: directory {bad.parent} does not exist (create it first)"
    line = error_line(capsys, ["explain", "--png", str(tmp_path)])
    assert f"argument --png: cannot write {tmp_path}: it is a directory" in line
    (tmp_path / "file").write_text("")
    line = error_line(capsys, ["explain", "--png", str(tmp_path / "file" / "x.png")])
    assert f"cannot write {tmp_path / 'file' / 'x.png'}: {tmp_path / 'file'} is not a directory" in line


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "lots"])
def test_explain_max_map_mb_must_be_a_finite_size(capsys, value):
    line = error_line(capsys, ["explain", "--max-map-mb", value])
    assert line.startswith("qkv explain: error: argument --max-map-mb:") and "e.g. 50" in line


def test_explain_model_directory_that_is_not_one(capsys, tmp_path):
    line = error_line(capsys, ["explain", "--model", str(tmp_path / "nope")])
    assert f"argument --model: {tmp_path / 'nope'} does not exist" in line
    line = error_line(capsys, ["explain", "--model", str(tmp_path)])
    assert line.startswith(f"qkv explain: error: --model {tmp_path}: {tmp_path} is missing config.json")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("{not json")
    line = error_line(capsys, ["explain", "--model", str(tmp_path)])
    assert f"config.json at {tmp_path.resolve() / 'config.json'} is not valid JSON" in line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_explain_write_that_fails_after_the_run(capsys):
    _needs_model()
    line = error_line(capsys, ["explain", "--focus", "she", "--html", "/dev/full"])
    assert line == "qkv explain: error: cannot write --html /dev/full: No space left on device"
    if os.path.isdir("/proc"):  # writable-looking to root, yet no file can be made there
        line = error_line(capsys, ["explain", "--focus", "she", "--png", "/proc/qkv-x.png"])
        assert line.startswith("qkv explain: error: cannot write --png /proc/qkv-x.png: ")


# -- demo, experiments, trace ------------------------------------------------------------------


def test_demo_out_that_cannot_be_a_folder(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    line = error_line(capsys, ["demo", "--no-model", "--out", str(tmp_path / "file")])
    assert line == f"qkv demo: error: argument --out: cannot write into {tmp_path / 'file'}: it exists and is not a directory"
    line = error_line(capsys, ["demo", "--no-model", "--out", str(tmp_path / "file" / "sub")])
    assert f"cannot create {tmp_path / 'file' / 'sub'}: {tmp_path / 'file'} is not a directory" in line


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_demo_out_that_fails_when_written(capsys):
    _needs_model()
    line = error_line(capsys, ["demo", "--out", "/proc/qkv-demo"])
    assert line.startswith("qkv demo: error: cannot write --out /proc/qkv-demo: ")


def test_experiments_out_and_seed(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    line = error_line(capsys, ["experiments", "run", "scaling", "--quick", "--out", str(tmp_path / "file")])
    assert "argument --out: cannot write into" in line
    line = error_line(capsys, ["experiments", "run", "scaling", "--quick", "--out", str(tmp_path), "--seed", "-1"])
    assert "argument --seed: -1 is too small" in line
    line = error_line(capsys, ["experiments", "run", "scaling", "--quick", "--out", str(tmp_path), "--seed", str(2**32)])
    assert "argument --seed: 4294967296 is too large; use at most 4294967295" in line
    if os.path.isdir("/proc"):
        line = error_line(capsys, ["experiments", "run", "scaling", "--quick", "--out", "/proc/qkv-x"])
        assert line.startswith("qkv experiments: error: cannot write to --out /proc/qkv-x: ")


def test_trace_sizes_that_would_not_fit_on_a_screen(capsys):
    line = error_line(capsys, ["trace", "a b", "--d-model", "100000"])
    assert "argument --d-model: 100000 is too large; use at most 256" in line
    assert "argument --heads: 17 is too large" in error_line(capsys, ["trace", "a b", "--heads", "17"])


# -- info --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "2,8,abc,64"], "argument --shape: '2,8,abc,64' is not B,H,N,D"),
        (["--shape", "1,2,3"], "argument --shape: '1,2,3' is not a query shape; give 4 whole numbers"),
        (["--shape", "1,2,-3,4"], "is not a query shape"),
        (["--shape", "99999999999,99999999999,99999,99"], "would have more than 2**63 elements"),
        (["--kv-len", "-3"], "argument --kv-len: -3 is too small"),
        (["--kv-heads", "0"], "argument --kv-heads: 0 is too small"),
        (["--kv-heads", "3"], "8 is not a multiple of 3"),
        (["--window", "a,b"], "argument --window: 'a' is not a window size"),
        (["--window", "1,2,3"], "argument --window: '1,2,3' is not LEFT,RIGHT"),
        (["--dropout", "2"], "dropout_p=2.0 must be in [0, 1)"),
        (["--device", "gpu0"], "argument --device: 'gpu0' is not a device name"),
        (["--device", "cuda:99"], "argument --device: device 'cuda:99' is not available here"),
    ],
)
def test_info_bad_call_descriptions(capsys, argv, message):
    line = error_line(capsys, ["info", *argv])
    assert line.startswith("qkv info: error: ") and message in line


def test_info_cuda_without_cuda_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "qkv", "info", "--device", "cuda"], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=SUBPROCESS_TIMEOUT)
    print(r.stderr)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "qkv info: error: argument --device: device 'cuda' is not available here" in r.stderr


def test_info_zero_kv_length_is_a_call_not_the_default(capsys):
    assert main(["info", "--shape", "1,2,4,8", "--kv-len", "0"]) == 0
    assert "key (1, 2, 0, 8)" in capsys.readouterr().out
