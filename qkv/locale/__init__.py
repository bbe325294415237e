"""One message catalogue for every language qkv speaks: ``<lang>.json`` beside this module.

Each file maps dotted keys, named by area (``"render.scaled"``, ``"page.title"``), to text with
:meth:`str.format` placeholders (``"d_k = {d}, so every score is divided by {r}"``). Python reads
it through :func:`text`; the trace page gets one area as JSON through :func:`messages` and fills
the same ``{name}`` placeholders in its script. Adding a language is adding ``<lang>.json`` with
the same keys and the same placeholders (a language without plural endings may leave out the
plural suffix ``{s}``) and naming it in :data:`LANGUAGES`; ``tests/reference/test_locale.py`` checks both.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

__all__ = ["LANGUAGES", "LANGUAGE_NAMES", "check_lang", "text", "messages"]

LANGUAGES: tuple[str, ...] = ("en", "zh")
"""The languages with a catalogue file, English first (the default everywhere)."""

LANGUAGE_NAMES: dict[str, str] = {"en": "English", "zh": "Chinese"}
"""Each language's name in English, for error messages."""

_HERE = Path(__file__).resolve().parent


def check_lang(lang: str) -> str:
    """``lang`` itself when it is one of :data:`LANGUAGES`; otherwise ValueError naming ``lang=``
    and the choices."""
    if lang not in LANGUAGES:
        choices = " or ".join(f"{code!r} ({LANGUAGE_NAMES[code]})" for code in LANGUAGES)
        raise ValueError(f"lang={lang!r} is not available; use {choices}")
    return lang


@functools.lru_cache(maxsize=None)
def _catalogue(lang: str) -> dict[str, str]:
    with open(_HERE / f"{check_lang(lang)}.json", encoding="utf-8") as f:
        loaded: dict[str, str] = json.load(f)
    return loaded


def text(key: str, lang: str, **values: object) -> str:
    """The message ``key`` in ``lang``, its ``{name}`` placeholders filled from ``values``
    (none given: the text as stored, braces and all). KeyError for a key the catalogue lacks."""
    messages_ = _catalogue(lang)
    if key not in messages_:
        raise KeyError(f"no message {key!r} in the {lang!r} catalogue (qkv/locale/{lang}.json)")
    return messages_[key].format(**values) if values else messages_[key]


def messages(lang: str, prefix: str) -> dict[str, str]:
    """Every message in ``lang`` whose key starts with ``prefix`` (e.g. ``"page."``), keyed by the
    rest of the key, unformatted: the table a module or page fills itself."""
    return {key[len(prefix):]: value for key, value in _catalogue(lang).items() if key.startswith(prefix)}
