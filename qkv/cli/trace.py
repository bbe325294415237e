"""``qkv trace``: every step of self-attention on a sentence, a real head, or a whole block."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from ..locale import LANGUAGES, text
from ..glass.toy import SENTENCE, sentence_trace
from .args import (
    MODEL_SENTENCE, WROTE, UsageError, cap, int_at_least, output_file, shared_options, sink_list, write_error,
)

# -- the glass box on a sentence ------------------------------------------------------------


TRACE_STEPS: tuple[str, ...] = (
    "x", "q", "k", "v", "scores", "scaled", "modified", "masked", "weights", "output", "concat", "projected",
)
"""Step names ``qkv trace --steps`` accepts for an attention trace (a block adds its own, see --help)."""

_TOY_FLAGS = (("d_model", "--d-model"), ("d_k", "--d-k"), ("heads", "--heads"), ("seed", "--seed"))

_COUNTING = {lang: text("cli.counting", lang) for lang in LANGUAGES}
_COUNTING_MODEL = {lang: text("cli.counting_model", lang) for lang in LANGUAGES}


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
        from ..glass.model import MAX_TOKENS, resolve_model, trace_model
    except ImportError as e:
        raise UsageError(f"--model needs torch and qkv.models ({e})") from None
    try:
        model, name = resolve_model(args.model or None)
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
        from ..analysis import explain

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


def run(args: argparse.Namespace) -> int:
    _check_trace_flags(args)
    text = _trace_text(args)
    if args.block:
        from ..glass.block import BLOCK_STEPS, toy_block_trace
        from ..glass.tokens import split_words

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
        print(WROTE[args.lang].format(kind=kind, path=path))
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
        from ..score_mods import ALiBi, Softcap, alibi_slopes
    except ImportError as e:
        raise UsageError(f"{flag} needs torch, which score functions are written in ({e}); pip install torch") from None
    if args.softcap is not None:
        return Softcap(args.softcap), sinks
    # an encoder sees both sides, so distance counts both ways; a causal decoder (BLOOM) only looks back
    return ALiBi(alibi_slopes(heads), symmetric=not args.causal), sinks


def _linear_steps(t: Any, feature_map: str, seed: int) -> Any:
    """Linear attention on the first head's own q, k, v (a model trace's head, or a toy trace's head 0)."""
    from ..reference.linear import favor_projection, linear_steps

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
                from ..glass.page import save_trace_page

                written = save_trace_page(t, path, lang=args.lang, precision=args.precision, token=token)
            else:
                from ..glass.png import save_trace_png

                written = save_trace_png(t, path, lang=args.lang, token=token)
        except OSError as e:  # checked when parsed; this is what only trying finds (/dev/full, /proc)
            raise write_error(flag, path, e) from None
        files.append((flag[2:].upper(), written))
    return files


def add_parser(sub: Any) -> None:
    """Add ``trace`` to the ``qkv`` command's subparsers."""
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
    shared_options(p)
    p.add_argument("--token", metavar="WORD|INDEX",
                   help="the token the explanation follows: its index (from 0) or the token itself "
                   "(default: token 0; with --model the word qkv explain would focus on)")
    p.add_argument("--steps", metavar="NAMES",
                   help="print only these steps, a comma list, e.g. scores,weights (attention: "
                   + ", ".join(TRACE_STEPS) + "; --block: its own steps and attention)")
    p.add_argument("--json", action="store_true", help="print the trace as JSON only (rounded with --precision when given)")
    p.add_argument("--html", metavar="FILE", type=output_file, help="write an interactive page of the trace")
    p.add_argument("--png", metavar="FILE", type=output_file, help="write a picture of the trace")
    p.add_argument("--model", metavar="DIR", nargs="?", const="", default=None,
                   help="trace one real head of a BERT model: the bundled all-MiniLM-L6-v2, or DIR "
                   "(write TEXT before --model, which would otherwise take TEXT as DIR)")
    p.add_argument("--layer", type=int_at_least(0), help="with --model: the layer, from 0 (default: the layer of "
                   "the head qkv explain would show for this text and --token)")
    p.add_argument("--head", type=int_at_least(0), help="with --model: the head, from 0 (default: the head qkv "
                   "explain would show for this text and --token)")
    p.add_argument("--max-tokens", type=int_at_least(1, 512), default=None,
                   help="with --model: refuse texts longer than this many word pieces (default 64)")
    p.add_argument("--block", action="store_true", help="trace a whole toy encoder block (qkv.glass.block)")
    p.add_argument("--linear", choices=("elu", "relu", "favor"), default=None,
                   help="also show linear attention (these feature maps) on the first head's Q, K, V, beside softmax")
    # trace prints every number: wider matrices are unreadable, and --d-model 1000000 would take gigabytes
    big = "; trace prints every number (qkv info sizes real calls)"
    p.add_argument("--d-model", type=int_at_least(1, 256, big), default=None, help="toy embedding width (default 4)")
    p.add_argument("--d-k", type=int_at_least(1, 256, big), default=None, help="toy query/key/value width per head (default 3)")
    p.add_argument("--heads", type=int_at_least(1, 16, big), default=None,
                   help="number of toy attention heads (default 1; 2 with --block)")
    p.add_argument("--d-ff", type=int_at_least(1, 256, big), default=None, help="with --block: feed-forward width (default 8)")
    p.add_argument("--causal", action="store_true", help="hide later tokens from earlier ones (toy traces)")
    p.add_argument("--softcap", metavar="C", type=cap, default=None,
                   help="toy traces: a score function step, C·tanh(s/C), squashing every scaled score into (-C, C) "
                   "(Gemma 2); needs torch")
    p.add_argument("--alibi", action="store_true",
                   help="toy traces: a score function step, ALiBi's distance penalty with slopes alibi_slopes(heads) "
                   "(-m·|j - i|; m·(j - i) with --causal); needs torch")
    p.add_argument("--sinks", metavar="V[,V...]", type=sink_list, default=None,
                   help="toy traces: sink logits in each row's softmax denominator, one for every head or one per head "
                   "(the weights then sum to less than 1)")
    p.add_argument("--seed", type=int_at_least(0), default=None, help="random seed for toy embeddings and weights (default 0)")
    p.set_defaults(run=run)
