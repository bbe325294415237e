"""A griffe extension for the API pages: qkv's docstrings are prose in a light reStructuredText
style, and the pages render them as Markdown. Three things differ, and are rewritten before
rendering (the source is not changed):

- roles (``:func:`qkv.attention```, ``:class:`~qkv.glass.Trace```, ``:mod:`.trace```) become
  code that links to the object's entry when an API page documents it (an optional
  cross-reference: no warning when it does not);
- a paragraph ending in ``::`` (an rST literal block follows) ends in ``:``, since the indented
  block after it is already a code block in Markdown;
- doctest lines (``>>>`` and their ``...`` continuations and output) become a ``pycon`` block,
  where Markdown would read ``>>>`` as nested quotes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`(~?)([^`<>]+?)`")


def _identifier(obj: griffe.Object, name: str) -> str:
    """The full dotted path ``name`` means inside ``obj``'s docstring (best effort)."""
    if name.startswith("qkv.") or name == "qkv":
        return name
    module = obj if obj.is_module else obj.module
    if name.startswith("."):
        dots = len(name) - len(name.lstrip("."))
        parts = module.path.split(".")
        if not module.is_init_module:
            parts = parts[:-1]
        parts = parts[: len(parts) - (dots - 1)] if dots > 1 else parts
        return ".".join(parts + [name[dots:]])
    head, _, rest = name.partition(".")
    scope = obj if (obj.is_module or obj.is_class) else (obj.parent or module)
    try:
        found = scope.resolve(head)
    except Exception:  # an unknown name stays as written: the reference is optional
        return name
    return f"{found}.{rest}" if rest else found


def _role(obj: griffe.Object, match: re.Match[str]) -> str:
    short, name = match.group(1) == "~", match.group(2).strip()
    shown = name.lstrip(".").split(".")[-1] if short else name.lstrip(".")
    return f'<autoref identifier="{_identifier(obj, name)}" optional><code>{shown}</code></autoref>'


def _doctests(text: str) -> str:
    """Fence every run of doctest lines (from ``>>>`` to the next blank line)."""
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith(">>>"):
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
                i += 1
            if out and out[-1].strip():
                out.append("")
            out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```", ""]
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def _literal_blocks(text: str) -> str:
    text = re.sub(r"(?m)^[ \t]*::[ \t]*$", "", text)  # a lone "::" line introduces the block
    return re.sub(r"(?m)(\S)::[ \t]*$", r"\1:", text)


def markdown(obj: griffe.Object, text: str) -> str:
    text = _doctests(text)
    text = _literal_blocks(text)
    return _ROLE.sub(lambda m: _role(obj, m), text)


class RstToMarkdown(griffe.Extension):
    """Rewrite every docstring of the loaded packages for Markdown (see the module docstring)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj, obj.docstring.value)
