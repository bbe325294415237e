"""The documentation, checked: the site builds without a warning, and every example in it runs.

- The site (``mkdocs.yml``, ``docs/``) builds in strict mode with no warning and no network font.
- Every fenced ``python`` block of README.md and docs/**/*.md runs, page by page in one namespace
  per page (a later block may use an earlier block's names), in a temporary directory, from a
  fixed seed. ``pycon`` blocks (``>>>``) run as doctests: the output they show is compared.
- Every ``qkv`` command line of a ``console`` or ``bash`` block (``$ qkv ...``) runs through the
  installed command, in a temporary directory, and must succeed; the output lines a console
  block shows under a command must be lines of its real output.
- A ``python`` block titled with a file name (``title="context_parallel.py"``) is a script: it
  is written to that file and run by the page's own command line (``$ torchrun ... script.py``,
  run as ``python -m torch.distributed.run``).
- A block may opt out only with a reason in its title: ``title="not run: needs a GPU"``. Each one
  is reported as a skipped test.
- Every public name of the modules the API pages document (``::: qkv.module`` in docs/api/) has a
  docstring.
- Every relative link and image of README.md points at a file that exists.
"""

from __future__ import annotations

import doctest
import io
import logging
import os
import random
import re
import shlex
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from ..helpers import SUBPROCESS_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md"))
SEED = 0
NOT_RUN = "not run:"
SHELL_LANGS = ("console", "bash", "shell", "sh")
# what a page's command lines may run: the qkv command, and torchrun for the distributed page
COMMANDS = {
    "qkv": [sys.executable, "-m", "qkv"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}
# the commands run as a user's would: without the test suite's own switches (tests/device.py
# turns on Triton's interpreter on a machine without CUDA)
ENV = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "QKV_TEST_DEVICE")}
ENV.update(MPLBACKEND="Agg", QKV_NO_PROGRESS="1", NO_MKDOCS_2_WARNING="1")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_ATTR = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    title: str
    code: str

    @property
    def where(self) -> str:
        first = next((ln for ln in self.code.splitlines() if ln.strip()), "")
        return f"{self.page}:{self.line} ({first.strip()[:60]})"

    @property
    def not_run(self) -> Optional[str]:
        return self.title[len(NOT_RUN):].strip() if self.title.startswith(NOT_RUN) else None

    @property
    def script(self) -> Optional[str]:
        return self.title if self.lang == "python" and self.title.endswith(".py") else None


def blocks(page: str) -> list[Block]:
    """The fenced blocks of a page, in order (blocks nested in tabs or lists are dedented)."""
    found: list[Block] = []
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or "`" in m["info"] and m["fence"][0] == "`":
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        lang = info.split()[0].lstrip("{.").rstrip("}") if info else ""
        title = dict(_ATTR.findall(info)).get("title", "")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        found.append(Block(page, i + 1, lang, title, "\n".join(body) + "\n"))
        i = j + 1
    return found


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    argv: list[str]
    shown: list[str]  # the output lines the page shows under it

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def commands(page: str) -> list[Command]:
    """The runnable command lines of a page's shell blocks: ``$ qkv ...`` in a console block
    (followed by the output it shows), ``qkv ...`` or ``$ qkv ...`` in a bash block."""
    found: list[Command] = []
    for b in blocks(page):
        if b.lang not in SHELL_LANGS or b.not_run is not None:
            continue
        lines = b.code.splitlines()
        k = 0
        while k < len(lines):
            text = lines[k].strip()
            start = k
            prompt = text.startswith("$ ")
            command = text[2:] if prompt else text
            while command.endswith("\\") and k + 1 < len(lines):  # a continued line
                k += 1
                command = command[:-1] + " " + lines[k].strip()
            k += 1
            shown: list[str] = []
            if b.lang == "console" and prompt:
                while k < len(lines) and not lines[k].strip().startswith("$ "):
                    shown.append(lines[k])
                    k += 1
            words = shlex.split(command, comments=b.lang != "console") if (prompt or b.lang != "console") else []
            if words and words[0] in COMMANDS:
                argv = COMMANDS[words[0]] + words[1:]
                if words[0] == "torchrun" and "--standalone" not in argv:
                    argv.insert(3, "--standalone")
                found.append(Command(page, b.line + 1 + start, argv, shown))
    return found


def _seed() -> None:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)


def _doctest(block: Block, namespace: dict) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(block.code, namespace, block.where, str(ROOT / block.page), block.line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    runner.run(test, out=report.write, clear_globs=False)
    namespace.update(test.globs)  # a DocTest runs on a copy of the namespace: keep what it defined
    if runner.failures:
        raise AssertionError(f"the output shown differs from the real one:\n{report.getvalue()}")


def _runnable(page: str) -> list[Block]:
    return [b for b in blocks(page) if b.lang in ("python", "pycon") and b.not_run is None and b.script is None]


PYTHON_PAGES = [p for p in PAGES if _runnable(p)]
COMMAND_LINES = [c for p in PAGES for c in commands(p)]
NOT_RUN_BLOCKS = [b for p in PAGES for b in blocks(p) if b.not_run is not None]


@pytest.fixture
def _logging_kept():
    """Logging as it was before a page's examples (one may call ``logging.basicConfig``)."""
    root, handlers, levels = logging.getLogger(), logging.getLogger().handlers[:], {}
    for name in ("", "qkv"):
        levels[name] = logging.getLogger(name).level
    yield
    root.handlers[:] = handlers
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _logging_kept: None) -> None:
    """A page's python (and pycon) blocks, in order, in one namespace, in a temporary folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    _seed()
    namespace: dict = {"__name__": "__main__"}
    for block in _runnable(page):
        try:
            if block.lang == "pycon":
                _doctest(block, namespace)
            else:
                # blank lines first, so a traceback's line numbers are the page's own
                code = compile("\n" * block.line + block.code, str(ROOT / page), "exec")
                exec(code, namespace)
        except Exception as e:  # name the page and the block, with the traceback into it
            pytest.fail(f"{block.where}: {type(e).__name__}: {e}\n{traceback.format_exc()}", pytrace=False)


def _heavy(c: Command) -> bool:
    """A page's command that starts processes or loads the real model (seconds each): the README's
    run in the quick tier, the other pages' in the slow one."""
    tool = c.argv[2:5]  # (after "python -m"): the module and its first arguments
    return c.page != "README.md" and (tool[0] == "torch.distributed.run" or tool[1:2] == ["explain"] or "--model" in c.argv
                                      or tool[1:] == ["experiments", "run"])  # fmt: skip


@pytest.mark.parametrize(
    "command", [pytest.param(c, marks=pytest.mark.slow) if _heavy(c) else c for c in COMMAND_LINES],
    ids=[c.where for c in COMMAND_LINES],
)
def test_command_lines_run(command: Command, tmp_path: Path) -> None:
    """A page's ``qkv`` (or ``torchrun``) command line succeeds, and prints what the page shows."""
    for b in blocks(command.page):  # the page's named scripts, for a command that runs one
        if b.script:
            (tmp_path / b.script).write_text(b.code, encoding="utf-8")
    done = subprocess.run(command.argv, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{command.where}: {shlex.join(command.argv)} exited {done.returncode}:\n{output[-3000:]}"
    real = {ln.strip() for ln in output.splitlines()}
    missing = [ln for ln in command.shown if ln.strip() and ln.strip() not in ("…", "...") and ln.strip() not in real]
    assert not missing, f"{command.where}: lines shown that the command does not print:\n" + "\n".join(missing)


def test_every_script_is_run() -> None:
    """A named script block is run by a command line of its page (else it would go untested)."""
    for page in PAGES:
        run = {arg for c in commands(page) for arg in c.argv}
        for b in blocks(page):
            assert b.script is None or b.script in run, f"{b.where}: no command line of {page} runs {b.script}"


@pytest.mark.parametrize("block", NOT_RUN_BLOCKS or [None], ids=[b.where for b in NOT_RUN_BLOCKS] or ["none"])
def test_blocks_not_run(block: Optional[Block]) -> None:
    """Blocks that opt out of running, each reported with its reason (keep them rare)."""
    assert len(NOT_RUN_BLOCKS) <= 3, f"{len(NOT_RUN_BLOCKS)} blocks opt out of running: {[b.where for b in NOT_RUN_BLOCKS]}"
    if block is None:
        return
    assert block.not_run, f"{block.where}: a block that is not run must say why (title=\"not run: <reason>\")"
    pytest.skip(f"{block.where}: not run: {block.not_run}")


def test_site_builds_strict(tmp_path: Path) -> None:
    """``make docs``'s build: strict, no warning at all, and fonts from no CDN (the site opens offline)."""
    pytest.importorskip("mkdocs")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "WARNING" not in output, output
    pages = list(site.rglob("*.html"))
    assert (site / "index.html").is_file() and len(pages) > 20
    for html in pages:
        text = html.read_text(encoding="utf-8")
        assert "fonts.googleapis.com" not in text and "fonts.gstatic.com" not in text, f"{html.name} loads a web font"


def _api_identifiers() -> list[str]:
    found = []
    for page in sorted((DOCS / "api").glob("*.md")):
        found += re.findall(r"^::: (\S+)", page.read_text(encoding="utf-8"), flags=re.M)
    return found


# Public constants that have no docstring yet (a string literal after the assignment); every
# other public name must have one. An entry can go once its docstring exists.
UNDOCUMENTED_CONSTANTS: set[str] = set()


def _public_names() -> list[str]:
    griffe = pytest.importorskip("griffe")
    package = griffe.load("qkv", search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)
    names = []
    for identifier in _api_identifiers():
        obj = package[identifier.removeprefix("qkv.")]
        if obj.is_module:
            names += [f"{identifier}.{n if isinstance(n, str) else n.name}" for n in (obj.exports or ())]
        else:
            names.append(identifier)
    return names


def test_api_pages_document_the_packages() -> None:
    """The API pages cover the public modules (each with an ``__all__``)."""
    documented = {i for i in _api_identifiers()}
    for module in ("qkv.varlen", "qkv.nn", "qkv.glass", "qkv.reference", "qkv.masks", "qkv.sparse", "qkv.score_mods",
                   "qkv.inspect", "qkv.analysis", "qkv.viz", "qkv.models", "qkv.hf", "qkv.distributed", "qkv.linear"):
        assert module in documented, f"no API page documents {module} (add '::: {module}' to a page in docs/api/)"
    assert "qkv.functional.attention" in documented


def test_public_names_have_docstrings() -> None:
    """Every name in the ``__all__`` of a documented module has a docstring (the API pages render it)."""
    griffe = pytest.importorskip("griffe")
    package = griffe.load("qkv", search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)
    missing = []
    for name in _public_names():
        obj = package[name.removeprefix("qkv.")]
        if obj.docstring is None or not obj.docstring.value.strip():
            missing.append(name)
    assert sorted(set(missing) - UNDOCUMENTED_CONSTANTS) == [], f"public names without a docstring: {missing}"


def test_readme_links_exist() -> None:
    """README.md's relative links and images point at files of the repository."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"
