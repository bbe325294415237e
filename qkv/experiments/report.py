"""The experiments' report: Markdown with linked figures, and HTML with the figures embedded.

The HTML needs nothing outside itself (figures are base64 PNGs, styles inline), so it can be
mailed or opened offline. One Markdown renderer (markdown-it) and one way to make HTML (jinja2,
``templates/report.html.j2``).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import List, Sequence

from ..extras import require
from ..locale import messages
from ._common import Result
from .judge import FAILED, HELD


def _words(lang: str) -> dict:
    return messages(lang, "experiments.report.")


def _verdict(r: Result, lang: str) -> str:
    # words, not emoji: a machine without an emoji font draws those as empty boxes
    return r.verdict_in(lang)


def _cls(r: Result) -> str:
    return {HELD: "ok", FAILED: "bad"}.get(r.state, "skip")


def _mode(results: Sequence[Result], lang: str) -> str:
    modes = {bool(getattr(r, "quick", False)) for r in results}
    w = _words(lang)
    if modes == {True}:
        return w["mode_quick"]
    if modes == {False}:
        return w["mode_full"]
    return w["mode_mixed"]


def to_markdown(results: Sequence[Result], lang: str = "en") -> str:
    """The report as Markdown (figures and CSVs linked beside it), its frame and verdicts in ``lang``."""
    w = _words(lang)
    lines = [f"# {w['head']}", "", w["generated"].format(mode=_mode(results, lang)), "", w["rule"],
             "", f"| {w['experiment']} | {w['verdict_col']} |", "|---|---|"]
    lines += [f"| [{r.title}](#{r.name}){w['quick_mark'] if getattr(r, 'quick', False) else ''} | {_verdict(r, lang)} |"
              for r in results]
    for r in results:
        lines += ["", f'<a id="{r.name}"></a>', f"## {r.title} (`{r.name}`)", "",
                  f"**{w['claim']}** {r.claim}", "", f"**{w['setup']}** {r.setup}", "", f"**{w['result']}** {r.result}", "",
                  f"**{w['verdict']}** {_verdict(r, lang)}{w['stop']}", ""]
        lines += [f"![{r.title}: {f}]({f})" for f in r.figures]
        if r.csv:
            lines += ["", f"{w['numbers']} [`{r.csv}`]({r.csv}){w['stop']}"]
    return "\n".join(lines) + "\n"


def to_html(results: Sequence[Result], out: Path, lang: str = "en") -> str:
    """The report as one self-contained page: the sections' Markdown rendered by markdown-it, the
    page by the jinja2 template beside this module, the figures embedded as base64 PNGs."""
    jinja2 = require("jinja2", "the experiments' report", "experiments")
    Markup = require("markupsafe", "the experiments' report", "experiments").Markup
    inline = require("markdown_it", "the experiments' report", "experiments").MarkdownIt("commonmark", {"html": False}).renderInline  # the sections use `code` and **bold** inside sentences
    sections = [
        {
            "name": r.name, "title": r.title, "cls": _cls(r), "verdict": _verdict(r, lang),
            "claim": Markup(inline(r.claim)), "setup": Markup(inline(r.setup)), "result": Markup(inline(r.result)),
            "figures": [{"name": f, "data": base64.b64encode((out / f).read_bytes()).decode("ascii")} for f in r.figures],
            "csv": r.csv,
        }
        for r in results
    ]
    env = jinja2.Environment(loader=jinja2.PackageLoader("qkv.experiments", "templates"),
                             autoescape=jinja2.select_autoescape(["j2"]))
    w = _words(lang)
    return env.get_template("report.html.j2").render(
        lang=lang, w=w, generated=Markup(inline(w["generated"].format(mode=_mode(results, lang)))), sections=sections)


def write_report(results: List[Result], out: Path, lang: str = "en") -> List[Path]:
    """Write ``report.md`` and ``report.html`` into ``out`` (frame and verdicts in ``lang``); returns their paths."""
    md, page = out / "report.md", out / "report.html"
    md.write_text(to_markdown(results, lang), encoding="utf-8")
    page.write_text(to_html(results, out, lang), encoding="utf-8")
    return [md, page]


__all__ = ["to_markdown", "to_html", "write_report"]
