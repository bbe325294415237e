"""Type checkers see qkv's real signatures (qkv/__init__.py resolves names lazily at run time).

mypy and basedpyright check two small files, not the package: ``typing/user_code.py`` (typical
calls, strict; no error allowed) and ``typing/bad_calls.py`` (each line marked ``# error`` must
be reported, and nothing else).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import SUBPROCESS_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
USER = Path(__file__).parent / "typing" / "user_code.py"
BAD = Path(__file__).parent / "typing" / "bad_calls.py"


def expected_lines() -> set[int]:
    lines = BAD.read_text().splitlines()
    return {i for i, line in enumerate(lines, 1) if re.search(r"#\s*error:", line)}


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)


def mypy_errors(path: Path) -> tuple[set[int], str]:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    # silent imports: qkv's own pre-existing errors are not this test's; the cache (kept in
    # .mypy_cache) makes every run after the first fast, torch being most of the work
    res = run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
               "--show-error-codes", "--cache-dir", str(ROOT / ".mypy_cache"), str(path)])  # fmt: skip
    assert res.returncode in (0, 1), res.stdout + res.stderr
    pattern = re.compile(rf"^\S*{re.escape(path.name)}:(\d+): error:", re.M)  # path as mypy prints it
    return {int(m) for m in pattern.findall(res.stdout)}, res.stdout


def basedpyright_errors(path: Path) -> tuple[set[int], str]:
    exe = shutil.which("basedpyright", path=str(Path(sys.executable).parent)) or shutil.which("basedpyright")
    if exe is None:
        pytest.skip("basedpyright is not installed (pip install basedpyright)")
    res = run([exe, "--outputjson", "--pythonpath", sys.executable, str(path)])
    try:
        report = json.loads(res.stdout)
    except json.JSONDecodeError:  # e.g. its bundled node could not start
        pytest.skip(f"basedpyright could not run: {(res.stdout + res.stderr)[-500:]}")
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    lines = {d["range"]["start"]["line"] + 1 for d in errors}  # 0-based in the JSON
    return lines, "\n".join(f"{d['range']['start']['line'] + 1}: {d['message']}" for d in errors)


CHECKERS = {"mypy": mypy_errors, "basedpyright": basedpyright_errors}
# mypy takes several times basedpyright's time on the same files: the slow tier runs it
CHECKER_PARAMS = [pytest.param("mypy", marks=pytest.mark.slow), "basedpyright"]


@pytest.mark.parametrize("checker", CHECKER_PARAMS)
def test_user_code_type_checks(checker: str) -> None:
    lines, output = CHECKERS[checker](USER)
    assert not lines, f"{checker} rejects correct calls:\n{output}"


@pytest.mark.parametrize("checker", CHECKER_PARAMS)
def test_wrong_calls_are_reported(checker: str) -> None:
    lines, output = CHECKERS[checker](BAD)
    expected = expected_lines()
    assert len(expected) >= 7
    assert expected <= lines, f"{checker} misses the errors on lines {sorted(expected - lines)}:\n{output}"
    assert lines <= expected, f"{checker} reports unexpected errors on lines {sorted(lines - expected)}:\n{output}"
