"""``qkv demo``: a guided walk-through of self-attention."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from ..extras import MissingExtra
from ..locale import LANGUAGES, messages
from ..glass.toy import SENTENCE, sentence_trace, worked_example
from .args import MODEL_SENTENCE, output_dir, shared_options, write_error

_TEXT = {lang: messages(lang, "cli.demo.") for lang in LANGUAGES}  # the tour's words (qkv/locale)


def _heading(title: str) -> str:
    from ..glass.render import width

    return f"{title}\n{'=' * width(title)}"


def _demo_sentence(args: argparse.Namespace) -> str:
    txt = _TEXT[args.lang]
    t = sentence_trace(SENTENCE)
    return "\n\n".join(
        [
            _heading(txt["one"].format(s=SENTENCE)),
            txt["one_intro"].format(d=t.d_model),
            t.to_string(precision=args.precision, lang=args.lang),
            t.explain(args.lang, precision=args.precision),
        ]
    )


def _demo_worked(args: argparse.Namespace) -> str:
    from ..glass.render import short

    txt = _TEXT[args.lang]
    t = worked_example()
    nums = dict(
        a=short(t.scores[0, 0]), b=short(t.scores[0, 1]), sa=short(t.scaled[0, 0]), sb=short(t.scaled[0, 1]),
        wa=short(t.weights[0, 0], args.precision), wb=short(t.weights[0, 1], args.precision),
        pct=short(100 * t.weights[0, 0], 1),
    )
    return "\n\n".join(
        [
            _heading(txt["two"]),
            txt["two_intro"],
            t.to_string(precision=args.precision, steps=("scores", "scaled", "weights"), lang=args.lang),
            txt["two_sum"].format(**nums),
        ]
    )


def _demo_heads(args: argparse.Namespace) -> str:
    txt = _TEXT[args.lang]
    sentence = "Thinking Machines learn"
    t = sentence_trace(sentence, heads=2, causal=True)
    return "\n\n".join(
        [
            _heading(txt["three"].format(s=sentence)),
            txt["three_intro"],
            t.to_string(precision=args.precision, steps=("masked", "weights", "concat", "projected"), lang=args.lang),
            t.explain(args.lang, token=1, precision=args.precision),
        ]
    )


_MODEL_TEXT = {lang: messages(lang, "cli.demo_model.") for lang in LANGUAGES}  # part 4's words


def _demo_model(args: argparse.Namespace) -> str:
    """Part 4: the real all-MiniLM-L6-v2 on a sentence; writes the heatmaps and the HTML report."""
    txt = _MODEL_TEXT[args.lang]
    heading = _heading(txt["heading"])
    if getattr(args, "no_model", False):
        return heading + "\n\n" + txt["skipped"]
    try:
        from ..analysis import explain
        from ..viz import save_html, save_png

        ex = explain(MODEL_SENTENCE, focus="she", target="alice")
    except (ImportError, RuntimeError, FileNotFoundError) as e:
        return "\n\n".join([heading, txt["missing"].format(e=str(e).rstrip(".")), _demo_toy_files(args)])
    out = os.path.abspath(args.out)
    layer, head, w = ex.top_heads(1)[0]
    try:
        os.makedirs(out, exist_ok=True)
        png = save_png(ex, os.path.join(out, "heatmap.png"), lang=args.lang)
        page = save_html(ex, os.path.join(out, "report.html"), lang=args.lang)
        files = txt["files"].format(png=png, page=page, layer=layer, head=head)
    except MissingExtra as e:  # installed without the viz extra: the text alone, and what to install
        files = f"({e})"
    except OSError as e:  # checked when parsed; this is what only trying finds (/proc, a full disk)
        raise write_error("--out", args.out, e) from None
    intro = txt["intro"].format(layers=ex.num_layers, heads=ex.num_heads, layer=layer, head=head, w=w)
    return "\n\n".join([heading, intro, ex.to_string(lang=args.lang), files,
                         txt["next"].format(layer=layer, head=head)])


def _demo_toy_files(args: argparse.Namespace) -> str:
    """Without the real model: part 3's two-head causal trace as ``trace.png`` and ``trace.html``
    in ``--out``, so the demo still leaves a figure and a page to open."""
    from ..glass.page import save_trace_page
    from ..glass.png import save_trace_png

    t = sentence_trace("Thinking Machines learn", heads=2, causal=True)
    out = os.path.abspath(args.out)
    try:
        os.makedirs(out, exist_ok=True)
        page = save_trace_page(t, os.path.join(out, "trace.html"), lang=args.lang, precision=args.precision, token=1)
        png = save_trace_png(t, os.path.join(out, "trace.png"), lang=args.lang, token=1)
    except MissingExtra as e:  # installed without the viz extra: no files, and what to install
        return f"({e})"
    except OSError as e:
        raise write_error("--out", args.out, e) from None
    return _MODEL_TEXT[args.lang]["toy_files"].format(png=png, page=page)


DEMO_PARTS: list[Callable[[argparse.Namespace], str]] = [_demo_sentence, _demo_worked, _demo_heads, _demo_model]
"""The demo's sections in order; each takes the parsed arguments and returns its text.
Append to this list to extend ``qkv demo`` (e.g. with a pretrained model)."""


def run(args: argparse.Namespace) -> int:
    for n, part in enumerate(DEMO_PARTS):
        if n:
            print("\n")
        print(part(args))
    return 0


def add_parser(sub: Any) -> None:
    """Add ``demo`` to the ``qkv`` command's subparsers."""
    p = sub.add_parser(
        "demo",
        help="a guided walk-through of self-attention",
        description="A short tour: a traced sentence, the tutorials' worked example, two heads with a causal mask, "
        "then a real pretrained model whose heatmaps and interactive report are written to --out.",
    )
    shared_options(p)
    p.add_argument("--out", metavar="DIR", type=output_dir, default="qkv-demo",
                   help="folder for the model part's PNG and HTML (default ./qkv-demo)")
    p.add_argument("--no-model", action="store_true", help="skip the pretrained model (no torch import)")
    p.set_defaults(run=run)
