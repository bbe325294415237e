"""Runnable experiments that test claims about self-attention with measured numbers.

Each experiment is a module with ``NAME``, ``TITLE``, ``CLAIM`` and
``run(out: Path, quick: bool = False, seed: int = 0) -> Result``; it writes PNG figures and a CSV
into ``out`` and returns a :class:`Result` whose verdict is computed from its numbers: held, not
shown (with what it needs, or the numbers that stayed within this machine's noise), or did not
hold (:mod:`qkv.experiments.judge`: counts where the claim is a count, timings with a margin).
``qkv experiments run NAME --out DIR`` runs one (or ``all``) and writes ``report.md`` and a
self-contained ``report.html`` next to them (:mod:`qkv.experiments.report`).

Experiments in the registry: ``scaling``, ``masking``, ``cost``, ``cross_attention``,
``parallel``, ``path_length``, ``heads``, ``tied_qk``, ``sparse``, ``linear`` (see ``EXPERIMENTS``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Optional

from ..extras import require
from ..locale import check_lang
from ._common import Result, single_thread

# name → module path, in priority order; modules are imported only when run, so `list` stays light
_MODULES: Dict[str, str] = {
    "scaling": "qkv.experiments.scaling",
    "masking": "qkv.experiments.masking",
    "cost": "qkv.experiments.cost",
    "cross_attention": "qkv.experiments.cross_attention",
    "parallel": "qkv.experiments.parallel",
    "path_length": "qkv.experiments.path_length",
    "heads": "qkv.experiments.heads",
    "tied_qk": "qkv.experiments.tied_qk",
    "sparse": "qkv.experiments.sparse",
    "linear": "qkv.experiments.linear",
}
EXPERIMENTS: List[str] = list(_MODULES)


def get(name: str) -> ModuleType:
    """The module of experiment ``name``; raises ``KeyError`` naming the known ones."""
    if name not in _MODULES:
        raise KeyError(f"no experiment named {name!r}; choose one of {', '.join(EXPERIMENTS)} or 'all'")
    return importlib.import_module(_MODULES[name])


def run(name: str, out: Path, quick: bool = False, seed: int = 0) -> Result:
    """Run one experiment into folder ``out`` (created if missing) on one torch thread."""
    module = get(name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with single_thread():
        result = module.run(out, quick=quick, seed=seed)
    result.quick = quick
    result.save(out)
    return result


def run_many(names: List[str], out: Path, quick: bool = False, seed: int = 0,
             progress: Optional[object] = None, lang: str = "en") -> List[Result]:
    """Run several experiments, then write ``report.md`` / ``report.html`` into ``out`` (its frame
    and verdicts in ``lang``).

    The report covers every experiment whose ``<name>.json`` is in ``out``, in registry order, so
    experiments run one at a time into the same folder add up to one report.
    """
    from .report import write_report

    check_lang(lang)  # before minutes of work, not after
    for package in ("matplotlib", "jinja2", "markdown_it", "tqdm"):  # before minutes of work, not after
        require(package, "qkv experiments", "experiments")
    results = []
    for name in names:
        if progress is not None:
            progress(name)  # type: ignore[operator]
        results.append(run(name, out, quick=quick, seed=seed))
    write_report(load_results(Path(out)), Path(out), lang)
    return results


def load_results(out: Path) -> List[Result]:
    """The results saved in ``out`` (``<name>.json``), in registry order."""
    found = []
    for name in EXPERIMENTS:
        path = Path(out) / f"{name}.json"
        if path.exists():
            found.append(Result.load(path))
    return found


__all__ = ["EXPERIMENTS", "Result", "get", "load_results", "run", "run_many"]
