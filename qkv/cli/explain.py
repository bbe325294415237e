"""``qkv explain``: what a pretrained model's heads do with one word (``--compare``, ``--ablate``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from .args import (
    MODEL_SENTENCE, WROTE, UsageError, existing_dir, int_at_least, megabytes, output_file, write_error,
)

def run(args: argparse.Namespace) -> int:
    if args.compare is not None:
        return _cmd_compare(args)
    try:
        from ..analysis import explain
        from ..viz import save_html, save_png
        from ..analysis.explain import MAX_MAP_BYTES

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
            raise write_error(flag, path, e) from None
        except ImportError as e:
            print(f"qkv explain: cannot write {flag} {path}: {e}", file=sys.stderr)  # names the extra to install
            return 1
    if args.json:
        d = result.to_dict()
        d["selected"] = {"layer": layer, "head": head}
        d["files"] = files
        print(json.dumps(d, allow_nan=False, ensure_ascii=False))
        return 0
    print(text())
    for kind, path in files.items():
        print(WROTE[args.lang].format(kind=kind.upper(), path=path) + f"  (L{layer} H{head})")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    """qkv explain TEXT --compare TEXT2: the same focus word in two texts, head by head."""
    for flag, given in (("--pair", args.pair is not None), ("--ablate", bool(args.ablate))):
        if given:
            raise UsageError(f"--compare and {flag} cannot be combined; run them one at a time")
    try:
        from ..analysis.compare import compare
        from ..viz.compare import save_compare_html, save_compare_png
        from ..analysis.explain import MAX_MAP_BYTES

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
    from ..analysis.ablation import parse_head

    try:
        return parse_head(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub: Any) -> None:
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
    p.add_argument("--layer", type=int_at_least(0), help="layer of the head shown in full (default: the top head's)")
    p.add_argument("--head", type=int_at_least(0), help="head shown in full in --png/--html (default: the top head)")
    p.add_argument("--top", type=int_at_least(1), default=1, help="tokens shown per head in the table (default 1)")
    p.add_argument("--png", metavar="FILE", type=output_file, help="write heatmaps: every head, and the focused head in full")
    p.add_argument("--html", metavar="FILE", type=output_file, help="write a self-contained interactive page (works offline)")
    p.add_argument("--json", action="store_true", help="print the results as JSON only")
    p.add_argument("--model", metavar="DIR", type=existing_dir,
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
    p.add_argument("--max-map-tokens", type=int_at_least(1), default=512,
                   help="beyond this many tokens keep statistics, not full maps (default 512)")
    p.add_argument("--max-map-mb", type=megabytes, default=None,
                   help="beyond this many MB of float32 maps keep statistics, not full maps (default 50; 0: always)")
    p.set_defaults(run=run)
