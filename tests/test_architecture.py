"""The package's shape, checked from its source: layers, import circles, private names, long functions.

The layers, low to high (a module imports only its own layer or lower ones; docs/architecture.md
describes the same tree):

    0  nonfinite (+ _device, _kernels),    rules and mechanisms every layer may use
       overflow, allocation,
       devices, locale, hooks,
       elementwise, extras
    1  call, masks, sparse, score_mods,    the validated call, its mask and score types, and the
       sinks, reference                    float64 oracle
    2  backends                            the kernels
    3  functional, varlen, linear          the public attention functions
    4  nn, models, distributed             modules, bundled models, many devices
    5  hf, inspect                         transformers integration, looking inside attention
    6  analysis                            running models for an answer
    7  viz                                 views: draw results, never run models
    8  glass                               the glass box: traces, their story, page and figure
    9  experiments, info, studio, cli      the things a command line drives

A function-level import may reach up a layer only with a comment just above it saying why
(a notebook's ``_repr_html_`` drawing with a view, say): such an import runs at call time, so it
makes no circle at import time, and the comment keeps it deliberate.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qkv"
MAX_LINES = 80
KEPT_WHOLE = "Kept whole"  # a long function's docstring says why, after these words

LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("qkv.nonfinite", "qkv.nonfinite_device", "qkv.nonfinite_kernels", "qkv.overflow", "qkv.allocation", "qkv.devices",
         "qkv.locale", "qkv.hooks", "qkv.elementwise", "qkv.extras")),
    (1, ("qkv.call", "qkv.masks", "qkv.sparse", "qkv.score_mods", "qkv.sinks", "qkv.reference")),
    (2, ("qkv.backends",)),
    (3, ("qkv.functional", "qkv.varlen", "qkv.linear")),
    (4, ("qkv.nn", "qkv.models", "qkv.distributed")),
    (5, ("qkv.hf", "qkv.inspect")),
    (6, ("qkv.analysis",)),
    (7, ("qkv.viz",)),
    (8, ("qkv.glass",)),
    (9, ("qkv.experiments", "qkv.info", "qkv.studio", "qkv.cli", "qkv.__main__")),
]


def layer_of(module: str) -> int:
    """The layer of a module: its longest matching prefix in LAYERS (``qkv`` itself re-exports, top)."""
    best, length = 10, -1
    for layer, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > length:
                best, length = layer, len(p)
    return best


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module
    name: str  # the imported name ("" for a plain module import)
    line: int
    lazy: bool  # inside a function
    commented: bool  # a comment on the line above or on the line itself


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _target(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[Import]:
    path = MODULES[module]
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    out: list[Import] = []

    def commented(n: int) -> bool:  # on the import's line or one of the three above it
        return "#" in lines[n - 1] or any(ln.strip().startswith("#") for ln in lines[max(0, n - 4) : n - 1])

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # names for type checkers only: never imported at run time
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                target = _target(module, child)
                if target == "qkv" or target.startswith("qkv."):
                    for alias in child.names:
                        full = f"{target}.{alias.name}"
                        sub = full in MODULES
                        out.append(Import(module, full if sub else target, "" if sub else alias.name,
                                          child.lineno, lazy, commented(child.lineno)))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("qkv"):
                        out.append(Import(module, alias.name, "", child.lineno, lazy, commented(child.lineno)))
            visit(child, inner)

    visit(tree, False)
    return out


IMPORTS = [imp for m in sorted(MODULES) for imp in _imports(m)]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative enough for ~150 nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def _is_parent(a: str, b: str) -> bool:
    """A package importing its own submodule (or a submodule its package's __init__) is how packages
    re-export; that edge is not a dependency between layers."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_no_import_circle_at_import_time() -> None:
    edges: dict[str, set[str]] = {}
    for imp in IMPORTS:
        if not imp.lazy and imp.target in MODULES and imp.target != imp.source and not _is_parent(imp.source, imp.target):
            edges.setdefault(imp.source, set()).add(imp.target)
    assert _cycles(edges) == []


def test_no_import_runs_up_the_layers() -> None:
    up = [f"{i.source}:{i.line} imports {i.target} (layer {layer_of(i.source)} → {layer_of(i.target)})"
          for i in IMPORTS
          if i.target in MODULES and not _is_parent(i.source, i.target) and layer_of(i.target) > layer_of(i.source)
          and not (i.lazy and i.commented) and i.source != "qkv"]
    assert up == [], "\n".join(up)


def test_no_module_imports_another_modules_private_name() -> None:
    private = [f"{i.source}:{i.line} imports {i.name} from {i.target}" for i in IMPORTS
               if i.name.startswith("_") and not i.name.startswith("__")]
    assert private == [], "\n".join(private)


def test_no_module_reaches_into_another_modules_private_attributes() -> None:
    """``other_module._name`` (reading or writing another module's private global) is as private
    as importing it."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        imported_modules = {alias.asname or alias.name.split(".")[-1]
                            for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                            for alias in node.names
                            if (alias.name if isinstance(node, ast.Import) else f"{_target(module, node)}.{alias.name}")
                            in MODULES}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported_modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{module}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert found == [], "\n".join(found)


def _long_functions() -> list[tuple[str, int, bool]]:
    out = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_LINES:
                    doc = ast.get_docstring(node) or ""
                    out.append((f"{module}.{node.name} ({length} lines)", length, KEPT_WHOLE in doc))
    return out


def test_long_functions_say_why_they_are_kept_whole() -> None:
    unexplained = [name for name, _, explained in _long_functions() if not explained]
    assert unexplained == [], f"over {MAX_LINES} lines without '{KEPT_WHOLE}: <why>' in the docstring:\n" + "\n".join(unexplained)


def test_every_module_is_placed() -> None:
    unplaced = [m for m in MODULES if m != "qkv" and layer_of(m) == 10]
    assert unplaced == [], f"add these to LAYERS: {unplaced}"
