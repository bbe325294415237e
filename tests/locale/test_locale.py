"""The message catalogue: every language has the same keys and placeholders, and every key the
code names exists."""
import json
import re
import string
from pathlib import Path

import numpy as np
import pytest

from qkv.locale import LANGUAGES, check_lang, messages, text

ROOT = Path(__file__).resolve().parents[2]
LOCALE = ROOT / "qkv" / "locale"


def _load(lang: str) -> dict:
    return json.loads((LOCALE / f"{lang}.json").read_text(encoding="utf-8"))


def _placeholders(s: str) -> set:
    return {name for _, name, _, _ in string.Formatter().parse(s) if name is not None}


# values the code passes that the English sentence does not need but another language may name
_PASSED_UNUSED_IN_ENGLISH = {"story.alibi_still": {"me"}}


def test_every_language_has_a_file_and_nothing_else_does():
    assert sorted(p.stem for p in LOCALE.glob("*.json")) == sorted(LANGUAGES)


@pytest.mark.parametrize("lang", [lang for lang in LANGUAGES if lang != "en"])
def test_same_keys_and_placeholders_as_english(lang):
    en, other = _load("en"), _load(lang)
    assert set(other) == set(en)
    for key, value in en.items():
        want, got = _placeholders(value) | _PASSED_UNUSED_IN_ENGLISH.get(key, set()), _placeholders(other[key])
        # a language without plural endings may leave out the plural suffix {s}
        assert got == want or got == want - {"s"} or got == _placeholders(value), (key, want, got)


def test_text_fills_placeholders_and_names_missing_keys():
    assert text("render.scaled", "en", d=4, r="2.000") == "d_k = 4, so every score is divided by 2.000"
    assert text("render.scaled", "zh", d=4, r="2.000") == "d_k = 4，所以每个分数都除以 2.000"
    assert text("render.given", "en") == "{m} (given)"  # no values: stored text
    with pytest.raises(KeyError, match="render.nope"):
        text("render.nope", "en")


def test_check_lang_names_the_argument_and_the_choices():
    assert check_lang("zh") == "zh"
    with pytest.raises(ValueError, match=r"lang='fr'.*'en' \(English\) or 'zh' \(Chinese\)"):
        check_lang("fr")
    with pytest.raises(ValueError, match="lang='fr'"):
        messages("fr", "page.")


def _code_files():
    return [p for p in (ROOT / "qkv").rglob("*.py") if "locale" not in p.parts]


def test_every_key_named_in_code_exists():
    en = _load("en")
    named = set()
    for path in _code_files():
        src = path.read_text(encoding="utf-8")
        named |= set(re.findall(r"\btext\(\s*\"([a-z0-9_.]+)\"\s*[,)]", src))
        # a local say(key, ...) = text(PREFIX + key, ...): its keys are PREFIX + each say("key")
        for prefix in re.findall(r"\btext\(\s*\"([a-z0-9_.]+)\"\s*\+", src):
            named |= {prefix + key for key in re.findall(r"\bsay\(\"([a-z0-9_]+)\"", src)}
        for prefix in re.findall(r"\bmessages\(\s*\w+,\s*\"([a-z0-9_.]+)\"\)", src):
            assert any(k.startswith(prefix) for k in en), (path.name, prefix)
    js = (ROOT / "qkv" / "glass" / "templates" / "trace_page.js").read_text(encoding="utf-8")
    # whole keys only: t("e_" + name) builds its key at run time
    named |= {"page." + key for key in re.findall(r"\bt\(\"([A-Za-z0-9_]+)\"\s*[,)]", js)}
    missing = sorted(k for k in named if k not in en)
    assert not missing, missing


@pytest.mark.parametrize("module, prefix", [
    ("qkv.glass.render", "render."),
    ("qkv.glass.block", "block."),
    ("qkv.reference.linear", "linear."),
    ("qkv.glass.png", "trace_png."),
    ("qkv.viz.png", "png."),
])
def test_each_modules_words_are_looked_up_by_keys_the_catalogue_has(module, prefix):
    import importlib

    mod = importlib.import_module(module)
    src = Path(mod.__file__).read_text(encoding="utf-8")
    used = set(re.findall(r"\btx\[\"([A-Za-z0-9_]+)\"\]", src))
    table = messages("en", prefix)
    assert used and not used - set(table), sorted(used - set(table))


# modules that keep catalogue keys in tables or choose them by condition ("a" if x else "b")
_KEY_TABLES = ["qkv/analysis/explain.py", "qkv/analysis/compare.py", "qkv/analysis/ablation.py",
               "qkv/glass/story.py", "qkv/viz/compare.py"]


def test_keys_written_as_strings_exist():
    en = _load("en")
    named = set()
    for rel in _KEY_TABLES:
        src = (ROOT / rel).read_text(encoding="utf-8")
        keys = re.findall(r"\"((?:note|explain|compare|ablation|story)\.[a-z0-9_.]*[a-z0-9_])\"", src)
        named |= {k for k in keys if not k.endswith((".js", ".j2", ".css"))}  # file names are not keys
        # say("a" if x else "b") looks up "story." + each of them
        for first, second in re.findall(r"\bsay\(\s*\"([a-z0-9_]+)\"(?: if [^\n]* else \"([a-z0-9_]+)\")?", src):
            named |= {"story." + k for k in (first, second) if k}
    missing = sorted(k for k in named if k not in en)
    assert named and not missing, missing


def test_the_pages_words_are_in_the_catalogue():
    """The explain and compare pages: every t.name of their templates, every label their scripts
    say(), and the comparison figure's words."""
    templates = ROOT / "qkv" / "viz" / "templates"
    page, js = messages("en", "explain_page."), messages("en", "explain_page.js.")
    used = set(re.findall(r"\bt\.([a-z_]+)", (templates / "explain.html.j2").read_text(encoding="utf-8")))
    assert used and not used - set(page), sorted(used - set(page))
    script = (templates / "explain.js").read_text(encoding="utf-8")
    said = set(re.findall(r"\bsay\('([a-z_]+)'", script)) | set(re.findall(r"\bT\.([a-z_]+)\b(?!\()", script)) - {"length"}
    assert said and not said - set(js), sorted(said - set(js))
    compare_page = messages("en", "compare_page.")
    used = set(re.findall(r"\bt\.([a-z_]+)", (templates / "compare.html.j2").read_text(encoding="utf-8")))
    assert used and not used - set(compare_page), sorted(used - set(compare_page))
    said = set(re.findall(r"\bsay\('([a-z_]+)'", (templates / "compare.js").read_text(encoding="utf-8")))
    assert said and not said - set(compare_page), sorted(said - set(compare_page))
    src = (ROOT / "qkv" / "viz" / "compare.py").read_text(encoding="utf-8")
    words = set(messages("en", "compare_png.")) | set(compare_page) | {"cols"}
    used = set(re.findall(r"\btx\[\"([a-z_]+)\"\]", src))
    assert used and not used - words, sorted(used - words)


def test_a_note_is_data_worded_by_the_catalogue():
    """A Note is its key and values (no English to parse back): as a str it is the English text;
    .text(lang) words it, nested notes and lists of notes included; it pickles as key and values."""
    import json
    import pickle

    from qkv.locale import Note, word

    rest = (Note("note.rest.itself", t="she"), Note("note.rest.special"))
    note = Note("note.target", t="Alice", f="she", rest=rest)
    assert note == 'target: "Alice", the content token "she" gives most attention to in any head, leaving out "she" ' \
        "itself, special tokens (name one with --target, or target= in Python)"
    assert "“she”本身、特殊词元" in note.text("zh") and "“Alice”" in note.text("zh")
    about_b = Note("note.in_b", note=Note("note.repeated", w="it", n=2))
    assert about_b.text("zh") == "B 中：" + Note("note.repeated", w="it", n=2).text("zh")
    back = pickle.loads(pickle.dumps(about_b))
    assert isinstance(back, Note) and back.key == "note.in_b" and back.text("zh") == about_b.text("zh")
    assert json.loads(json.dumps([note])) == [str(note)]
    assert word("a plain sentence", "zh") == "a plain sentence" and word(note, "en") == note
    with pytest.raises(KeyError, match="no message 'note.nope'"):
        Note("note.nope")


def test_every_note_the_code_makes_has_its_message():
    """Each Note("key", ...) written in qkv's source (and each key a note may switch to) is in the
    catalogue: a note's wording has one home, and none is made without one."""
    from qkv.analysis.explain import _TARGET_VARIANTS

    made = set()
    for path in (ROOT / "qkv").rglob("*.py"):
        made |= set(re.findall(r'\bNote\("([a-z_.]+)"', path.read_text(encoding="utf-8")))
    made |= set(_TARGET_VARIANTS.values())
    assert len(made) > 15, sorted(made)
    for key in sorted(made):
        text(key, "en"), text(key, "zh")  # KeyError names a missing one


def test_rewording_a_note_is_one_catalogue_entry_per_language(monkeypatch):
    """A note's wording lives only in the catalogue: change the entry and every view that shows
    the note — the text report in English and Chinese, the HTML page, its JSON — says the new words,
    with nothing else touched."""
    import qkv.locale as locale
    from qkv.analysis import explain_attentions
    from qkv.viz import render_html

    for lang, words in (("en", "NEW-EN target {t} for {f}{rest}"), ("zh", "新措辞：{t}（{f}）{rest}")):
        monkeypatch.setitem(locale._catalogue(lang), "note.target", words)  # the one place a note's words live
    rng = np.random.default_rng(0)
    tokens = ["[CLS]", "alice", "met", "bob", "she", "smiled", "[SEP]"]
    ex = explain_attentions([rng.dirichlet(np.ones(7), size=(2, 7)) for _ in range(2)], tokens, focus="she")
    (note,) = ex.notes
    assert note.key == "note.target" and str(note).startswith("NEW-EN target met for she")
    assert "NEW-EN target met for she" in ex.to_string(lang="en")
    assert "新措辞：met（she）" in ex.to_string(lang="zh")
    assert "新措辞：met（she）" in render_html(ex, lang="zh") and "NEW-EN target met" in render_html(ex, lang="en")
    assert ex.to_dict()["notes"][0].startswith("NEW-EN target met")
