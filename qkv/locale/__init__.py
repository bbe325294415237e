"""One message catalogue for every language qkv speaks: ``<lang>.json`` beside this module.

Each file maps dotted keys, named by area (``"render.scaled"``, ``"page.title"``), to text with
:meth:`str.format` placeholders (``"d_k = {d}, so every score is divided by {r}"``). Python reads
it through :func:`text`; the trace page gets one area as JSON through :func:`messages` and fills
the same ``{name}`` placeholders in its script. Adding a language is adding ``<lang>.json`` with
the same keys and the same placeholders (a language without plural endings may leave out the
plural suffix ``{s}``) and naming it in :data:`LANGUAGES`; ``tests/locale/test_locale.py`` checks both.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

__all__ = ["LANGUAGES", "LANGUAGE_NAMES", "Note", "check_lang", "text", "messages", "shorten", "word"]

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


class Note(str):
    """A message kept as data: a catalogue key and its values, created once where it arises and
    worded in any language by the catalogue (``note.text("zh")``). As a ``str`` it is the English
    wording, so it prints, compares and serialises as that sentence. A value that is itself a
    Note is worded in the same language; a tuple of them is joined by the list separator
    (``list.sep``)."""

    key: str
    values: dict[str, Any]

    def __new__(cls, key: str, /, **values: Any) -> "Note":
        made = super().__new__(cls, _worded(key, "en", values))
        made.key, made.values = key, values
        return made

    def __reduce__(self) -> tuple[Any, ...]:  # pickle (and copy) as the key and values, not the English text
        return (_note, (self.key, self.values))

    def text(self, lang: str) -> str:
        """This note in ``lang``."""
        return _worded(self.key, check_lang(lang), self.values)

    def with_key(self, key: str) -> "Note":
        """The same values under another message (a variant: ``note.repeated`` → ``note.repeated_target``)."""
        return Note(key, **self.values)


def _note(key: str, values: dict[str, Any]) -> Note:
    return Note(key, **values)


def _worded(key: str, lang: str, values: dict[str, Any]) -> str:
    def one(v: Any) -> Any:
        if isinstance(v, Note):
            return v.text(lang)
        if isinstance(v, tuple) and v and all(isinstance(x, Note) for x in v):
            return text("list.sep", lang).join(x.text(lang) for x in v)
        return v

    return text(key, lang, **{k: one(v) for k, v in values.items()})


def shorten(s: str, n: int = 10) -> str:
    """``s`` cut to ``n`` characters, the last one an ellipsis when anything was cut (labels, titles)."""
    return s if len(s) <= n else s[: n - 1] + "…"


def word(message: str, lang: str) -> str:
    """A :class:`Note` in ``lang``; any other string as it is (it has no key to be worded by)."""
    return message.text(lang) if isinstance(message, Note) else message
