"""What a pretrained model's heads do with one token: the analysis behind ``qkv explain``.

:func:`explain` runs a model (by default :func:`qkv.models.load`, all-MiniLM-L6-v2) on a text,
finds the focus word among the subword tokens, and reports, for every layer and head, where that
token's attention goes, which heads link it most strongly to a target word, and per-head
statistics. The result, an :class:`Explanation`, explains itself (``to_string()`` for a terminal,
``to_dict()`` for JSON) and feeds the renderers in :mod:`qkv.viz.png` and :mod:`qkv.viz.html`.

Shapes: ``L`` layers, ``H`` heads, ``N`` tokens. ``maps (L, H, N, N)`` row = query, column = key;
``focus_weights (L, H, N)`` is the focus token's row of every map.

Long inputs: the maps hold ``L·H·N²`` numbers. Beyond ``max_map_tokens`` tokens or ``max_map_bytes``
bytes of maps, no map is built: :func:`qkv.inspect.record` streams the focus token's rows and
per-row statistics tile by tile (for models without :class:`qkv.nn.MultiHeadAttention`, the
materialised maps are reduced layer by layer and dropped), and the explanation says so. Text
beyond the model's positions is truncated.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..locale import Note, check_lang, shorten, text, word
from .loading import load_model

__all__ = ["Explanation", "explain", "explain_attentions", "explain_cross_attention", "match_word", "zh_note", "encode", "Encoded", "longest_first", "SENTENCE", "MAX_MAP_TOKENS", "MAX_MAP_BYTES"]

SENTENCE = (
    "Alice is an outstanding software engineer; she led the development of the company's core "
    "recommendation system."
)
MAX_MAP_TOKENS = 512
MAX_MAP_BYTES = 50_000_000  # float32 maps of all heads beyond this: statistics only
SPECIAL = frozenset({  # BERT's, RoBERTa's and the common decoders' begin/end/padding tokens
    "[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]", "<s>", "</s>", "<pad>", "<unk>", "<mask>", "<bos>", "<eos>",
    "<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>",
})


def _is_content(token: str) -> bool:
    return token not in SPECIAL and any(c.isalnum() for c in token)


def _surface(token: str) -> str:
    return token[2:] if token.startswith("##") else token


# -- word -> subword tokens ---------------------------------------------------------------------


def match_word(
    word: str, text: str, tokens: Sequence[str], offsets: Optional[Sequence[tuple[int, int]]] = None
) -> tuple[list[int], list[Note]]:
    """Token indices that make up ``word`` in ``text``, and notes on how they were found.

    Tried in order: the word as a whole word in the text (case-insensitive), mapped to tokens by
    character offsets; the word as a substring of the text; the word equal to a token (``[CLS]``);
    the word as a run of subword tokens after lower-casing (for tokenizers without offsets);
    a token index written ``#5``. Returns every token of the first occurrence; the caller picks
    the first and says so when there are several.
    """
    notes: list[Note] = []
    w = word.strip()
    if not w:
        raise ValueError("the word to look for is empty; pass a word of the text, e.g. --focus she")
    if re.fullmatch(r"#\d+", w):
        i = int(w[1:])
        if i >= len(tokens):
            raise ValueError(f"token index {i} is out of range; the text has {len(tokens)} tokens (0 to {len(tokens) - 1})")
        return [i], notes
    if offsets is not None:
        spans = [m.span() for m in re.finditer(rf"(?<!\w){re.escape(w)}(?!\w)", text, flags=re.IGNORECASE)]
        if not spans:
            spans = [m.span() for m in re.finditer(re.escape(w), text, flags=re.IGNORECASE)]
            if spans:
                notes.append(Note("note.inside_word", w=w))
        for start, end in spans:
            idx = [i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start and tokens[i] not in SPECIAL]
            if idx:
                if len(spans) > 1:
                    notes.append(Note("note.repeated", w=w, n=len(spans)))
                return idx, notes
    low = w.lower()
    exact = [i for i, t in enumerate(tokens) if t.lower() == low or (t not in SPECIAL and _surface(t).lower() == low)]
    if exact:
        if len(exact) > 1:
            notes.append(Note("note.tokens", w=w, n=len(exact)))
        return exact[:1], notes
    for i in range(len(tokens)):  # a run of subwords spelling the word
        s = ""
        for j in range(i, len(tokens)):
            s += _surface(tokens[j]).lower()
            if s == low.replace(" ", ""):
                return list(range(i, j + 1)), notes
            if not low.replace(" ", "").startswith(s):
                break
    shown = " ".join(t for t in tokens if t not in SPECIAL)
    raise ValueError(f'"{w}" is not in the text; its tokens are: {shown}')


# -- the result ---------------------------------------------------------------------------------


@dataclass
class Explanation:
    """Where one token's attention goes in every head of a model.

    ``focus_weights (L, H, N)``: the focus token's attention row per layer and head.
    ``maps (L, H, N, N)`` or ``None`` in statistics mode. ``stats``: per-head numbers (lists
    ``[L][H]``): ``entropy`` (nats) and ``max_weight`` of the focus row, ``first_weight`` (on the
    first token, [CLS]), ``last_weight`` (on the last, [SEP]), and ``mean_entropy`` over all
    query rows (only when the maps were seen). ``top_heads``: heads sorted by the weight from the
    focus token to the target.

    Cross-attention (``key_tokens`` set, :func:`explain_cross_attention`): ``tokens`` are the
    queries (decoder side), ``key_tokens`` the ``Nk`` tokens attended to (encoder side); rows
    run over keys, so ``focus_weights (L, H, Nk)``, ``maps (L, H, N, Nk)``, and the target and
    top tokens index ``key_tokens``.
    """

    text: str
    tokens: list[str]
    focus_index: int
    focus_matches: list[int]
    target_index: int
    target_given: bool
    focus_weights: np.ndarray  # (L, H, N)
    stats: dict[str, np.ndarray]  # name -> (L, H)
    maps: Optional[np.ndarray] = None  # (L, H, N, N)
    model_name: str = "model"
    notes: list[str] = field(default_factory=list)
    focus_word: str = ""
    target_word: str = ""
    vectors: Optional[np.ndarray] = None  # (L, 2, H, N, Dh): each head's query and key vectors (neuron view)
    scale: Optional[float] = None  # the factor q·k is multiplied by (1/√Dh)
    pair: str = ""  # the second text of a sentence pair ("" for one text)
    segments: Optional[list[Optional[int]]] = None  # per token: 0 first text, 1 second, None special
    ablation: Optional[Any] = None  # qkv.analysis.ablation.Ablation, when heads were ablated
    key_tokens: Optional[list[str]] = None  # cross-attention: the tokens attended to (maps (L, H, N, Nk))

    @property
    def keys(self) -> list[str]:
        """The tokens attended to: ``key_tokens`` for cross-attention, else ``tokens``."""
        return self.tokens if self.key_tokens is None else self.key_tokens

    @property
    def pair_start(self) -> Optional[int]:
        """Index of the first token of the second text, or None for a single text."""
        if self.segments is None:
            return None
        return next((i for i, s in enumerate(self.segments) if s == 1), None)

    def other_segment(self) -> list[int]:
        """Tokens of the text the focus token is not in (empty for a single text)."""
        if self.segments is None:
            return []
        mine = self.segments[self.focus_index]
        return [i for i, s in enumerate(self.segments) if s is not None and s != mine]

    def score_terms(self, layer: int, head: int, query: int, key: int) -> np.ndarray:
        """q_d · k_d for every dimension d of one head (Dh,): their sum times ``scale`` is the
        scaled score, the softmax of those scores over keys is the map. Needs ``vectors``."""
        if self.vectors is None:
            raise ValueError("this explanation kept no query/key vectors (too many tokens, or a model qkv cannot record)")
        q, k = self.vectors[layer, 0, head, query], self.vectors[layer, 1, head, key]
        return q.astype(np.float64) * k.astype(np.float64)

    @property
    def num_layers(self) -> int:
        return int(self.focus_weights.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.focus_weights.shape[1])

    @property
    def mode(self) -> str:
        return "maps" if self.maps is not None else "stats"

    def top_heads(self, k: int = 5) -> list[tuple[int, int, float]]:
        """``(layer, head, weight)`` of the ``k`` heads that send most weight from focus to target."""
        w = self.focus_weights[:, :, self.target_index]  # (L, H)
        order = np.argsort(-w, axis=None, kind="stable")[:k]
        return [(int(i // self.num_heads), int(i % self.num_heads), float(w.flat[i])) for i in order]

    def top_tokens(self, layer: int, head: int, k: int = 3, content_only: bool = False) -> list[tuple[int, float]]:
        """``(token index, weight)`` of the ``k`` tokens the focus token attends to most in one head."""
        row = self.focus_weights[layer, head]
        order = np.argsort(-row, kind="stable")
        if content_only:
            mine = self.focus_matches if self.key_tokens is None else []
            order = [i for i in order if _is_content(self.keys[i]) and i not in mine]
        return [(int(i), float(row[i])) for i in order[:k]]

    @property
    def best_head(self) -> tuple[int, int]:
        layer, head, _ = self.top_heads(1)[0]
        return layer, head

    def select(self, layer: Optional[int] = None, head: Optional[int] = None) -> tuple[int, int]:
        """``(layer, head)`` to show in full: each one not given is the best head's; out of range raises."""
        best_layer, best_head = self.best_head
        layer = best_layer if layer is None else layer
        head = best_head if head is None else head
        for name, v in (("layer", layer), ("head", head)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if not (0 <= layer < self.num_layers and 0 <= head < self.num_heads):
            raise ValueError(f"layer {layer}, head {head} is out of range; the model has layers "
                             f"0 to {self.num_layers - 1} and heads 0 to {self.num_heads - 1}")
        return int(layer), int(head)

    def __repr__(self) -> str:
        return (
            f"Explanation(model={self.model_name!r}, tokens={len(self.tokens)}, layers={self.num_layers}, "
            f"heads={self.num_heads}, focus={self.tokens[self.focus_index]!r}@{self.focus_index}, "
            f"target={self.keys[self.target_index]!r}@{self.target_index}, mode={self.mode!r})"
        )

    def _repr_html_(self) -> str:
        """The interactive report, for notebooks (an iframe holding the self-contained page)."""
        # upward, lazily: a notebook convenience; viz draws, analysis computes
        from ..viz.html import render_html
        from ..viz.pages import iframe

        return iframe(render_html(self), 820)

    def to_dict(self, decimals: int = 4) -> dict[str, Any]:
        """Plain JSON-ready data: tokens, focus rows, top heads, statistics (layers/heads 0-based)."""

        def r(a: np.ndarray) -> Any:
            return np.round(a.astype(np.float64), decimals).tolist()

        return {
            "model": self.model_name,
            "text": self.text,
            "tokens": list(self.tokens),
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "mode": self.mode,
            "notes": list(self.notes),
            **({"pair": self.pair, "segments": list(self.segments)} if self.segments is not None else {}),
            **({"ablation": self.ablation.to_dict()} if self.ablation is not None else {}),
            "focus": {"word": self.focus_word, "index": self.focus_index, "token": self.tokens[self.focus_index],
                      "matches": list(self.focus_matches)},
            **({"key_tokens": list(self.key_tokens)} if self.key_tokens is not None else {}),
            "target": {"word": self.target_word, "index": self.target_index, "token": self.keys[self.target_index],
                       "given": self.target_given},
            "top_heads": [{"layer": l, "head": h, "weight": round(w, decimals)} for l, h, w in self.top_heads(10)],
            "heads": [
                [
                    {
                        "layer": l,
                        "head": h,
                        "focus_weights": r(self.focus_weights[l, h]),
                        "top_tokens": [{"index": i, "token": self.keys[i], "weight": round(w, decimals)}
                                       for i, w in self.top_tokens(l, h, 3)],
                        "target_weight": round(float(self.focus_weights[l, h, self.target_index]), decimals),
                        **{name: round(float(v[l, h]), decimals) for name, v in self.stats.items()},
                    }
                    for h in range(self.num_heads)
                ]
                for l in range(self.num_layers)
            ],
        }

    def to_string(self, top: int = 1, lang: str = "en") -> str:
        """The terminal report: tokens, a layer × head table of top tokens, top heads, statistics.

        ``lang`` is "en" (English) or "zh" (Chinese, notes included); the words are the
        catalogue's ``explain.*`` messages.
        """
        check_lang(lang)
        toks, f, t, keys = self.tokens, self.focus_index, self.target_index, self.keys
        out = [text("explain.model", lang, model=self.model_name, L=self.num_layers, H=self.num_heads, n=len(toks))]
        out.append(text("explain.tokens", lang, tokens=self._token_line()))
        out.append(text("explain.focus", lang, tok=toks[f], i=f)
                   + (text("explain.focus_word", lang, word=self.focus_word) if self.focus_word else ""))
        out += [text("explain.note", lang, note=word(n, lang)) for n in self.notes]
        out.append("")
        out.append(text("explain.looks_most", lang, tok=toks[f], top=top))
        out += self._top_token_grid(top)
        out.append("")
        how = "" if self.target_given else text(
            "explain.target_how_pair" if self.other_segment() else "explain.target_how", lang)
        out.append(text("explain.link_heads", lang, tok=toks[f], target=keys[t], how=how))
        for l, h, w in self.top_heads(5):
            tops = self.top_tokens(l, h, 1)[0]
            out.append(text("explain.link_head", lang, l=l, h=h, w=w, top=keys[tops[0]], top_w=tops[1]))
        out.append("")
        out += self._stats_lines(lang)
        if "pair_weight" in self.stats:
            out.append("")
            out.append(text("explain.pair_heads", lang, tok=toks[f], span=self._other_span(lang)))
            out += [f"  L{l} H{h}  {w:.3f}" for l, h, w in self.top_pair_heads(5)]
        if self.ablation is not None:
            out += [""] + self.ablation.to_lines(lang)
        return "\n".join(out)

    def _top_token_grid(self, top: int) -> list[str]:
        """Each head's top ``top`` tokens and weights: heads in rows, layers in columns, as many
        layers side by side as fit 112 characters."""
        keys = self.keys
        cell = [[", ".join(f"{shorten(keys[i])} {w:.2f}" for i, w in self.top_tokens(l, h, top))
                 for l in range(self.num_layers)] for h in range(self.num_heads)]
        width = max(len(c) for row in cell for c in row)
        per_line = max(1, 112 // (width + 2))
        out = []
        for start in range(0, self.num_layers, per_line):
            ls = range(start, min(self.num_layers, start + per_line))
            out.append("       " + "  ".join(f"L{l}".ljust(width) for l in ls).rstrip())
            for h in range(self.num_heads):
                out.append(f"  H{h:<3} " + "  ".join(cell[h][l].ljust(width) for l in ls).rstrip())
        return out

    def _stats_lines(self, lang: str) -> list[str]:
        """Entropy, max weight and weight on the first token of the focus row in every head, six
        layers side by side, and where the weight parks on average."""
        st, keys, tok = self.stats, self.keys, self.tokens[self.focus_index]
        out = [text("explain.stats", lang, tok=tok, n=len(keys), uniform=math.log(len(keys)), first=keys[0])]
        head_cell = text("explain.stats_columns", lang, first=shorten(keys[0], 5))
        for start in range(0, self.num_layers, 6):
            ls = range(start, min(self.num_layers, start + 6))
            # 15: the cell's width on screen (a CJK column head is narrower in characters, as wide in columns)
            out.append("       " + "   ".join(f"L{l}".ljust(15) for l in ls).rstrip())
            out.append("       " + "   ".join(head_cell for _ in ls))
            for h in range(self.num_heads):
                out.append(f"  H{h:<3} " + "   ".join(
                    f"{st['entropy'][l, h]:4.2f} {st['max_weight'][l, h]:4.2f} {st['first_weight'][l, h]:5.2f}" for l in ls))
        out.append(text("explain.parked", lang, first=float(np.mean(st["first_weight"])), first_tok=keys[0],
                        last=float(np.mean(st["last_weight"])), last_tok=keys[-1]))
        return out

    def top_pair_heads(self, k: int = 5) -> list[tuple[int, int, float]]:
        """``(layer, head, weight)`` of the heads that send the focus token's attention across the pair most."""
        w = self.stats.get("pair_weight")
        if w is None:
            return []
        order = np.argsort(-w, axis=None, kind="stable")[:k]
        return [(int(i // self.num_heads), int(i % self.num_heads), float(w.flat[i])) for i in order]

    def _other_span(self, lang: str = "en") -> str:
        other = self.other_segment()
        return text("explain.span", lang, first=other[0], last=other[-1]) if other else text("explain.span_none", lang)

    def _token_line(self) -> str:
        start = self.pair_start
        return " ".join(("‖ " if i == start else "") + f"{i}:{tok}" for i, tok in enumerate(self.tokens))


# The notes explain() records are qkv.locale.Note values: a message key and its values, created
# where they arise and worded in any language by the catalogue (note.*); as strings, English.
# A note about the target is the same message's "_target" variant where the catalogue has one.
_TARGET_VARIANTS = {"note.repeated": "note.repeated_target", "note.tokens": "note.tokens_target"}


def zh_note(note: str) -> str:
    """The Chinese wording of one of the notes :func:`explain` writes (other strings stay as they are)."""
    return word(note, "zh")


# -- running a model ----------------------------------------------------------------------------


def _row_stats(w: np.ndarray) -> dict[str, np.ndarray]:
    """Statistics of attention rows ``w (..., N)`` over the last axis."""
    p = np.clip(w.astype(np.float64), 1e-30, None)
    return {
        "entropy": -(w * np.log(p)).sum(-1),
        "max_weight": w.max(-1),
        "first_weight": w[..., 0],
        "last_weight": w[..., -1],
    }


def _pick_target(tokens: Sequence[str], focus_weights: np.ndarray, exclude: Sequence[int]) -> int:
    """The content token with the largest weight from the focus token in any head, leaving out
    ``exclude`` (the focus itself and its previous token: self and previous-token heads put
    ~1.0 there whatever the sentence means)."""
    cand = [j for j, t in enumerate(tokens) if _is_content(t) and j not in exclude]
    if not cand:
        cand = [j for j in range(len(tokens)) if j not in exclude] or [0]
    best = focus_weights[:, :, cand].max(axis=(0, 1))  # (len(cand),)
    return cand[int(np.argmax(best))]


def _resolve_focus(focus: Optional[str], text: str, tokens: list[str],
                   offsets: Optional[Sequence[tuple[int, int]]]) -> tuple[list[int], list[Note]]:
    if focus is None:
        content = [i for i, t in enumerate(tokens) if _is_content(t)]
        f_idx = [content[0] if content else 0]
        return f_idx, [Note("note.no_focus", t=tokens[f_idx[0]])]
    f_idx, notes = match_word(focus, text, tokens, offsets)
    if len(f_idx) > 1:
        notes.append(Note("note.split", w=focus, n=len(f_idx), parts=" ".join(tokens[i] for i in f_idx), t=tokens[f_idx[0]]))
    return f_idx, notes


def _build(
    text: str, tokens: list[str], f_idx: list[int], fw: np.ndarray, mean_entropy: Optional[np.ndarray],
    maps: Optional[np.ndarray],
    *, focus: Optional[str], target: Optional[str], offsets: Optional[Sequence[tuple[int, int]]], model_name: str,
    notes: list[str], segments: Optional[list[Optional[int]]] = None, key_tokens: Optional[list[str]] = None,
) -> Explanation:
    """The explanation from the focus rows ``fw (L, H, N)`` and each head's mean row entropy ``(L, H)``.

    With ``segments`` (a sentence pair), the statistics gain ``pair_weight``, the focus row's
    weight on the other text, and the default target comes from the other text. With
    ``key_tokens`` (cross-attention) the rows run over those tokens and the target is one of them.
    """
    stats = {k: np.asarray(v) for k, v in _row_stats(fw).items()}
    if mean_entropy is not None:
        stats["mean_entropy"] = np.asarray(mean_entropy, dtype=np.float64)
    other: list[int] = []
    if segments is not None:
        mine = segments[f_idx[0]]
        other = [i for i, sg in enumerate(segments) if sg is not None and sg != mine]
        stats["pair_weight"] = fw[:, :, other].astype(np.float64).sum(-1) if other else np.zeros(fw.shape[:2])
    keys = tokens if key_tokens is None else key_tokens
    if target is not None:
        key_text = text if key_tokens is None else " ".join(key_tokens)
        t_list, more = match_word(target, key_text, keys, offsets if key_tokens is None else None)
        notes += [m.with_key(_TARGET_VARIANTS[m.key]) if m.key in _TARGET_VARIANTS else m for m in more]
        if len(t_list) > 1:
            notes.append(Note("note.split_target", w=target, n=len(t_list), t=keys[t_list[0]]))
        t_idx = t_list[0]
    elif key_tokens is not None:
        t_idx = _pick_target(keys, fw, [])
        notes.append(Note("note.target_cross", t=keys[t_idx], f=tokens[f_idx[0]]))
    elif other:
        t_idx = _pick_target(tokens, fw, [j for j in range(len(tokens)) if j not in other])
        notes.append(Note("note.target_pair", t=tokens[t_idx], f=tokens[f_idx[0]]))
    else:
        prev = f_idx[0] - 1
        skip = list(f_idx) + ([prev] if prev >= 0 and _is_content(tokens[prev]) else [])
        t_idx = _pick_target(tokens, fw, skip)
        left_out = (Note("note.rest.itself", t=tokens[f_idx[0]]), Note("note.rest.special"),
                    *([Note("note.rest.previous", t=tokens[prev])] if prev in skip else []))  # fmt: skip
        notes.append(Note("note.target", t=tokens[t_idx], f=tokens[f_idx[0]], rest=left_out))
    return Explanation(
        text=text, tokens=tokens, focus_index=f_idx[0], focus_matches=list(f_idx), target_index=t_idx,
        target_given=target is not None, focus_weights=fw, stats=stats, maps=maps, model_name=model_name,
        notes=notes, focus_word=focus or "", target_word=target or "", segments=segments, key_tokens=key_tokens,
    )


def _reduce(attentions: Sequence[Any], f: int, n: int, keep_maps: bool) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """Focus rows ``(L, H, Nk)``, mean row entropy ``(L, H)`` and, with ``keep_maps``, the maps, layer by layer
    (``n``: the number of keys, the tokens themselves for self-attention)."""
    rows, full, mean_ent = [], [], []
    for a in attentions:
        a = a.detach().float().cpu().numpy() if hasattr(a, "detach") else np.asarray(a, dtype=np.float32)
        if a.ndim == 4:
            a = a[0]  # (H, N, N)
        if a.shape[-1] != n:
            raise ValueError(f"attention maps have {a.shape[-1]} keys but there are {n} tokens")
        rows.append(a[:, f, :])  # (H, N)
        mean_ent.append(_row_stats(a)["entropy"].mean(-1))  # (H,)
        if keep_maps:
            full.append(a.astype(np.float32))
    return np.stack(rows).astype(np.float32), np.stack(mean_ent), (np.stack(full) if keep_maps else None)


def explain_attentions(
    attentions: Sequence[Any],
    tokens: Sequence[str],
    *,
    focus: Optional[str] = None,
    target: Optional[str] = None,
    text: Optional[str] = None,
    offsets: Optional[Sequence[tuple[int, int]]] = None,
    keep_maps: bool = True,
    model_name: str = "model",
    notes: Sequence[str] = (),
) -> Explanation:
    """Build an :class:`Explanation` from attention maps already computed.

    ``attentions``: L arrays or tensors ``(H, N, N)`` or ``(1, H, N, N)`` (one sequence). Each is
    reduced to the focus row and statistics at once; the maps are kept only with ``keep_maps``.
    """
    tokens = list(tokens)
    text = " ".join(tokens) if text is None else text
    f_idx, more = _resolve_focus(focus, text, tokens, offsets)
    fw, mean_ent, maps = _reduce(attentions, f_idx[0], len(tokens), keep_maps)
    return _build(text, tokens, f_idx, fw, mean_ent, maps, focus=focus, target=target, offsets=offsets,
                  model_name=model_name, notes=list(notes) + more)


MAX_VECTOR_TOKENS = 64  # query/key vectors (the neuron view) are kept up to this many tokens


def _vectors(pairs: Sequence[tuple[Any, Any]], heads: int) -> np.ndarray:
    """Per layer (q (1, H, N, Dh), k (1, Hk, N, Dh)) → (L, 2, H, N, Dh) float32 (shared key heads repeated)."""
    out = []
    for q, k in pairs:
        q, k = q[0].float().cpu(), k[0].float().cpu()
        if k.shape[0] != q.shape[0]:
            k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        out.append(np.stack([q.numpy(), k.numpy()]))
    return np.stack(out).astype(np.float32)


def _stats_run(model: Any, run: tuple[Any, ...], f: int) -> Optional[np.ndarray]:
    """The focus token's rows ``(L, H, N)`` without any ``N × N`` map, or None if it cannot record.

    :func:`qkv.inspect.record` rebuilds just that row of every head tile by tile from the fused
    pass's log-sum-exp (``reuse_lse``: the model's own call provides it, one pass fewer). All-rows
    statistics (``attention_stats``) would cost several times the forward pass on a CPU, so the
    mean row entropy is left out in this mode. None when the model has no
    :class:`qkv.nn.MultiHeadAttention` to record from (the caller then reduces materialised maps).
    """
    if hasattr(model, "hf_tokenizer"):  # a Hugging Face checkpoint: maps are reduced layer by layer
        return None
    try:
        from qkv.inspect import record
    except ImportError:
        return None
    try:
        with record(model, "*.weights", rows=[f], reuse_lse=True) as rows:
            model(*run)  # (input_ids, mask[, token_type_ids])
    except (ValueError, TypeError):  # not a qkv.nn model
        return None
    if not rows.modules:
        return None
    fw = np.stack([rows[f"{m}.weights" if m else "weights"][0, :, 0].float().cpu().numpy() for m in rows.modules])
    return fw.astype(np.float32)  # (L, H, N)


@dataclass
class Encoded:
    ids: list[int]
    tokens: list[str]
    offsets: Optional[list[tuple[int, int]]]  # into the text, or for a pair into text + "\n" + pair
    type_ids: Optional[list[int]] = None  # segment ids the model is given (pairs only)
    segments: Optional[list[Optional[int]]] = None  # 0 / 1 per token, None for special tokens (pairs only)

    def cut(self, keep: list[int]) -> "Encoded":
        pick = lambda xs: None if xs is None else [xs[i] for i in keep]  # noqa: E731
        return Encoded(pick(self.ids), pick(self.tokens), pick(self.offsets), pick(self.type_ids), pick(self.segments))


def _pair_offsets(offsets: Sequence[Any], sequence_ids: Sequence[Optional[int]], shift: int) -> list[tuple[int, int]]:
    """Offsets of a pair's tokens in ``text + "\n" + pair``: the second text's move by ``shift``."""
    return [(a + shift, b + shift) if sid == 1 and b > a else (int(a), int(b))
            for (a, b), sid in zip(offsets, sequence_ids, strict=True)]


def encode(model: Any, text: str, pair: Optional[str] = None) -> Encoded:
    """Token ids, strings and character offsets (None when unknown), with no padding or truncation;
    for a sentence pair also the segment ids (the tokenizer's own pair template, e.g. [CLS] A [SEP] B [SEP])."""
    if hasattr(model, "hf_tokenizer"):  # a Hugging Face checkpoint (qkv.analysis.hf_model)
        if pair is None:
            return Encoded(*model.encode(text))
        ids, tokens, offsets, type_ids, seq = model.encode_pair(text, pair)
        return Encoded(ids, tokens, None if offsets is None else _pair_offsets(offsets, seq, len(text) + 1), type_ids, seq)
    tok = getattr(model, "tokenizer", None)
    if tok is not None and hasattr(tok, "to_str"):  # a Hugging Face `tokenizers.Tokenizer`
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tok.to_str())  # a copy: the model's own keeps its padding and truncation
        tok.no_padding()
        tok.no_truncation()
        enc = tok.encode(text) if pair is None else tok.encode(text, pair)
        offsets = [tuple(o) for o in enc.offsets]
        if pair is None:
            return Encoded(list(enc.ids), list(enc.tokens), offsets)
        seq = list(enc.sequence_ids)
        return Encoded(list(enc.ids), list(enc.tokens), _pair_offsets(offsets, seq, len(text) + 1), list(enc.type_ids), seq)
    if pair is not None:
        raise ValueError("this model's tokenizer cannot encode a sentence pair; use a tokenizers.Tokenizer (--pair)")
    ids_t, mask_t = model.tokenize([text])  # (1, N) each
    ids = [int(i) for i, m in zip(ids_t[0].tolist(), mask_t[0].tolist(), strict=True) if m]
    name = getattr(tok, "id_to_token", None)
    return Encoded(ids, [str(name(i)) if name else str(i) for i in ids], None)


def longest_first(segments: Sequence[Optional[int]], limit: int) -> list[int]:
    """Token indices to keep so a pair fits ``limit``: special tokens stay, and each text loses
    tokens from its end, the longer one first (the tokenizers' "longest_first" strategy)."""
    count = {s: sum(x == s for x in segments) for s in (0, 1)}
    budget = limit - sum(x is None for x in segments)
    while count[0] + count[1] > max(budget, 0):
        count[0 if count[0] >= count[1] else 1] -= 1
    seen = {0: 0, 1: 0}
    keep = []
    for i, x in enumerate(segments):
        if x is None:
            keep.append(i)
        elif seen[x] < count[x]:
            seen[x] += 1
            keep.append(i)
    return keep


def _max_positions(model: Any) -> int:
    for owner in (model, getattr(model, "config", None)):
        for name in ("max_position_embeddings", "max_positions", "max_len"):
            v = getattr(owner, name, None) if owner is not None else None
            if isinstance(v, int) and v > 0:
                return v
    return 512


def explain(
    text: str = SENTENCE,
    focus: Optional[str] = None,
    target: Optional[str] = None,
    *,
    model: Any = None,
    model_path: Optional[str] = None,
    pair: Optional[str] = None,
    ablate: Optional[Sequence[tuple[int, int]]] = None,
    ablate_mode: str = "zero",
    max_map_tokens: int = MAX_MAP_TOKENS,
    max_map_bytes: int = MAX_MAP_BYTES,
) -> Explanation:
    """Run ``model`` (default: :func:`qkv.models.load`) on ``text`` and explain the focus token.

    ``pair``: a second text, encoded with ``text`` as a sentence pair (the tokenizer's template,
    e.g. ``[CLS] text [SEP] pair [SEP]``, with segment ids); the focus word is looked for in
    ``text`` first, then in ``pair``, and the default target comes from the other text.
    ``ablate``: ``[(layer, head), ...]`` (0-based) to knock out with :func:`qkv.inspect.ablate`
    (``ablate_mode`` "zero" or "mean"); the result's ``ablation`` says how the final states and,
    for language models, the next-token prediction change.

    Beyond ``max_map_tokens`` tokens or ``max_map_bytes`` of float32 maps (``L·H·N²·4``) the maps
    are dropped and only statistics kept; text longer than the model's positions is truncated.
    """
    import torch

    _check_arguments(text, pair, ablate_mode, max_map_tokens, max_map_bytes)
    if model is None:
        model = load_model(model_path)
    notes: list[str] = []
    enc = _fit_positions(encode(model, text, pair), _max_positions(model), notes)
    ids, tokens, offsets = enc.ids, enc.tokens, enc.offsets
    n = len(ids)
    layers = int(getattr(getattr(model, "config", None), "num_hidden_layers", 0) or getattr(model, "num_layers", 0) or 6)
    heads = int(getattr(getattr(model, "config", None), "num_attention_heads", 0) or getattr(model, "num_heads", 0) or 12)
    if ablate is not None:
        from .ablation import check_heads

        ablate = check_heads(ablate, layers, heads)  # before the run: a wrong head costs no forward pass
    size = layers * heads * n * n * 4
    keep = n <= max_map_tokens and size <= max_map_bytes
    if not keep:
        notes.append(Note("note.stats_mode", n=n, mb=f"{size / 1e6:.0f}", lt=max_map_tokens, lb=f"{max_map_bytes / 1e6:.0f}"))
    both = text if pair is None else text + "\n" + pair  # the offsets of a pair point into this
    f_idx, more = _resolve_focus(focus, both, tokens, offsets)  # before the run: a typo costs no forward pass
    notes += more
    name = os.path.basename(os.path.normpath(model_path)) if model_path else "all-MiniLM-L6-v2"
    input_ids = torch.tensor([ids], dtype=torch.long)  # (1, N)
    mask = torch.ones_like(input_ids)  # (1, N)
    types = None if enc.type_ids is None else torch.tensor([enc.type_ids], dtype=torch.long)  # (1, N)
    run = (input_ids, mask) if types is None else (input_ids, mask, types)
    fw, mean_ent, maps, pairs = _run(model, run, f_idx[0], n, keep, notes)
    ex = _build(both, tokens, f_idx, fw, mean_ent, maps, focus=focus, target=target, offsets=offsets,
                model_name=name, notes=notes, segments=enc.segments)
    ex.text, ex.pair = text, pair or ""
    if pairs and len(pairs) == ex.num_layers:
        ex.vectors = _vectors(pairs, ex.num_heads)
        ex.scale = float(ex.vectors.shape[-1]) ** -0.5
    if ablate is not None:
        from .ablation import ablation_effect

        ex.ablation = ablation_effect(model, input_ids, mask, ablate, focus_index=ex.focus_index, tokens=tokens,
                                      mode=ablate_mode, token_type_ids=types)
    return ex


def _check_arguments(text: Any, pair: Any, ablate_mode: str, max_map_tokens: float, max_map_bytes: float) -> None:
    """Step 1 of :func:`explain`: every argument checked before a model is loaded."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    if pair is not None and not isinstance(pair, str):
        raise TypeError(f"pair must be a string (the second sentence), got {type(pair).__name__}")
    if pair is not None and not pair.strip():
        raise ValueError("pair is empty; pass the second sentence of the pair, e.g. --pair 'It was too big.'")
    if ablate_mode not in ("zero", "mean"):
        raise ValueError(f"ablate_mode={ablate_mode!r} is not available; use 'zero' or 'mean' (--ablate-mode)")
    for name, limit in (("max_map_tokens", max_map_tokens), ("max_map_bytes", max_map_bytes)):
        if not limit >= 0:  # also NaN, which every comparison would quietly treat as "too big"
            raise ValueError(f"{name}={limit!r} must be >= 0 (math.inf: no limit)")
    if not text.strip():
        raise ValueError('the text is empty; pass a sentence, e.g. qkv explain "Alice said she ..." --focus she')


def _fit_positions(enc: Encoded, limit: int, notes: list[str]) -> Encoded:
    """Step 2 of :func:`explain`: the tokens cut to the model's ``limit`` positions (a pair
    shortens its longer text first), saying so in ``notes``."""
    if len(enc.ids) > limit and enc.segments is not None:
        keep = longest_first(enc.segments, limit)
        notes.append(Note("note.pair_cut", n=len(enc.ids), m=limit, a=sum(enc.segments[i] == 0 for i in keep),
                          b=sum(enc.segments[i] == 1 for i in keep)))  # fmt: skip
        return enc.cut(keep)
    if len(enc.ids) > limit:
        notes.append(Note("note.text_cut", n=len(enc.ids), m=limit, k=limit - 1, t=enc.tokens[-1]))
        return enc.cut(list(range(limit - 1)) + [len(enc.ids) - 1])
    return enc


def _run(model: Any, run: tuple[Any, ...], f: int, n: int, keep: bool, notes: list[str],
         ) -> tuple[np.ndarray, Optional[np.ndarray], Optional[np.ndarray], Optional[list[tuple[Any, Any]]]]:
    """Step 3 of :func:`explain`: the forward pass. Returns the focus rows ``(L, H, N)``, the mean
    row entropy ``(L, H)`` and maps ``(L, H, N, N)`` (None in statistics mode), and each layer's
    (q, k) for the neuron view (None when not recorded)."""
    import torch

    with torch.inference_mode():
        streamed = None if keep else _stats_run(model, run, f)
        if streamed is not None:
            notes.append(Note("note.recorded"))
            return streamed, None, None, None
        pairs: Optional[list[tuple[Any, Any]]] = None
        if n <= MAX_VECTOR_TOKENS and not hasattr(model, "hf_tokenizer"):
            try:
                from qkv.inspect import record

                with record(model, ["*.q", "*.k"]) as rec:
                    result = model(*run, output_attentions=True)
                pairs = [(rec[f"{m}.q" if m else "q"], rec[f"{m}.k" if m else "k"]) for m in rec.modules]
            except (ImportError, ValueError, TypeError, AttributeError):  # not a qkv.nn model
                result = model(*run, output_attentions=True)
        else:
            result = model(*run, output_attentions=True)
            if n <= MAX_VECTOR_TOKENS:
                pairs = getattr(result, "vectors", None)
        attentions = getattr(result, "attentions", None)
        if attentions is None and isinstance(result, (tuple, list)):
            attentions = result[-1]
        fw, mean_ent, maps = _reduce(attentions, f, n, keep)
    return fw, mean_ent, maps, pairs


def explain_cross_attention(
    model: Any,
    run: Any,
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    *,
    focus: Optional[str] = None,
    target: Optional[str] = None,
    modules: str = "*cross_attn",
    model_name: str = "model",
) -> Explanation:
    """Explain the cross-attention of an encoder–decoder built from :mod:`qkv.nn` (e.g.
    :class:`qkv.nn.Transformer`): where one decoder token reads in the source.

    ``run()`` runs ``model`` on one pair of sequences (batch 1); every attention module whose
    path matches ``modules`` is recorded (its weights ``(1, H, N, Nk)``, one per decoder layer)
    with :func:`qkv.inspect.record`. ``query_tokens`` name the ``N`` decoder positions,
    ``key_tokens`` the ``Nk`` source positions. ``focus`` is a decoder token (word or ``#i``),
    ``target`` a source token (default: the one the focus reads most in any head). The result
    renders like any explanation: ``to_string()``, :func:`qkv.viz.save_png`,
    :func:`qkv.viz.save_html` (queries on the left, source tokens on the right).
    """
    from qkv.inspect import record

    queries, keys = [str(t) for t in query_tokens], [str(t) for t in key_tokens]
    with record(model, f"{modules}.weights") as rec:
        run()
    recorded = set(rec)
    called = [m for m in rec.modules if f"{m}.weights" in recorded]
    if not called:
        raise ValueError(f"run() called no attention module matching modules={modules!r}; it must run the "
                         "model's decoder (e.g. lambda: model(src, tgt))")
    maps = []
    for m in called:
        w = rec[f"{m}.weights"]  # (1, H, N, Nk)
        if w.dim() != 4 or w.shape[0] != 1 or tuple(w.shape[2:]) != (len(queries), len(keys)):
            raise ValueError(f"{m} attended with weights of shape {tuple(w.shape)}, but there are {len(queries)} "
                             f"query_tokens and {len(keys)} key_tokens (run one pair of sequences, batch 1)")
        maps.append(w[0])  # (H, N, Nk)
    q_text = " ".join(queries)
    f_idx, notes = _resolve_focus(focus, q_text, queries, None)
    fw, mean_ent, full = _reduce(maps, f_idx[0], len(keys), keep_maps=True)  # (L, H, Nk), (L, H), (L, H, N, Nk)
    return _build(q_text, queries, f_idx, fw, mean_ent, full, focus=focus, target=target, offsets=None,
                  model_name=model_name, notes=notes, key_tokens=keys)
