"""Two sentences through the same model, side by side: the analysis behind ``qkv explain --compare``.

:func:`compare` explains both texts with the same focus word, aligns their tokens (``difflib``
on the token strings, so "The trophy ... it was too big" and "The trophy ... it was too small"
match everywhere but the changed word), and measures, per head, how far the focus token's
attention moved: the total variation distance between its two rows, where a token present in
only one text counts as an outcome of its own::

    TV = ½ (Σ_matched |a_i − b_j| + Σ_unmatched a_i + Σ_unmatched b_j)   ∈ [0, 1]

0: the head attends identically; 1: it attends to entirely different tokens. A word that
changed between the texts usually dominates that number, so ``shared (L, H)`` also gives the
distance between the two rows restricted to the aligned tokens and renormalised: how the head
redistributes its attention among the words both texts have. The difference maps (B − A) are
taken on the aligned tokens.

Shapes: ``L`` layers, ``H`` heads, ``Na`` / ``Nb`` tokens of the two texts; ``distance (L, H)``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..locale import Note, check_lang, shorten, text, word
from .explain import Explanation, encode, explain
from .loading import load_model

__all__ = ["Comparison", "compare", "align_tokens", "map_change"]


def align_tokens(a: list[str], b: list[str]) -> list[tuple[int, int]]:
    """``(i, j)`` pairs of equal tokens in order (the longest matching blocks, difflib)."""
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return [(blk.a + k, blk.b + k) for blk in sm.get_matching_blocks() for k in range(blk.size)]


_UNKNOWN = frozenset({"[UNK]", "<unk>"})


def _keys(enc: Any, text: str) -> list[str]:
    """What alignment compares: the token, or for an unknown token also the text it stands for
    (two [UNK]s match only when they hide the same characters)."""
    if enc.offsets is None:
        return list(enc.tokens)
    return [f"{t}\x00{text[a:b]}" if t in _UNKNOWN else t for t, (a, b) in zip(enc.tokens, enc.offsets, strict=True)]


def _listed(tokens: list[str], lang: str, most: int = 20) -> str:
    """Tokens for a report line in ``lang``: at most ``most``, then how many more."""
    if not tokens:
        return text("compare.none", lang)
    more = len(tokens) - most
    tail = "" if more <= 0 else text("compare.more", lang, more=more)
    return " ".join(tokens[:most]) + tail


def _shared_tv(a: np.ndarray, b: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
    """Total variation between the rows restricted to the aligned tokens, each renormalised to 1."""
    if not pairs:
        return np.zeros(a.shape[:-1])
    ra = a[..., [i for i, _ in pairs]].astype(np.float64)
    rb = b[..., [j for _, j in pairs]].astype(np.float64)
    ra = ra / np.maximum(ra.sum(-1, keepdims=True), 1e-30)
    rb = rb / np.maximum(rb.sum(-1, keepdims=True), 1e-30)
    return 0.5 * np.abs(ra - rb).sum(-1)


def _tv(a: np.ndarray, b: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
    """Total variation between rows ``a (..., Na)`` and ``b (..., Nb)`` under the alignment."""
    ia = [i for i, _ in pairs]
    ib = [j for _, j in pairs]
    a, b = a.astype(np.float64), b.astype(np.float64)
    matched = np.abs(a[..., ia] - b[..., ib]).sum(-1)
    return 0.5 * (matched + (a.sum(-1) - a[..., ia].sum(-1)) + (b.sum(-1) - b[..., ib].sum(-1)))


def map_change(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """How far each head's attention moved between two runs on the same tokens: the total
    variation between each query row's weights, averaged over the rows. ``(L, H, N, N)`` maps
    → ``(L, H)`` in [0, 1] (0: the same map; 1: every row moved all its weight)."""
    if before.shape != after.shape:
        raise ValueError(f"maps of shapes {before.shape} and {after.shape} cannot be compared row by row")
    n = before.shape[-1]
    return _tv(before, after, [(i, i) for i in range(n)]).mean(-1)


@dataclass
class Comparison:
    """The same focus word in two texts: ``a`` and ``b`` are their explanations, ``pairs`` the
    aligned tokens, ``distance (L, H)`` the total variation between the focus rows per head."""

    a: Explanation
    b: Explanation
    pairs: list[tuple[int, int]]
    distance: np.ndarray  # (L, H)
    notes: list[str]
    shared: np.ndarray  # (L, H): the same on the aligned tokens only, renormalised

    @property
    def num_layers(self) -> int:
        return self.a.num_layers

    @property
    def num_heads(self) -> int:
        return self.a.num_heads

    def top_changes(self, k: int = 5, shared: bool = False) -> list[tuple[int, int, float]]:
        """``(layer, head, distance)`` of the ``k`` heads whose focus row moved most (``shared``:
        measured on the aligned tokens only)."""
        d = self.shared if shared else self.distance
        order = np.argsort(-d, axis=None, kind="stable")[:k]
        return [(int(i // self.num_heads), int(i % self.num_heads), float(d.flat[i])) for i in order]

    def moved(self, layer: int, head: int) -> tuple[tuple[int, float], tuple[int, float]]:
        """``((i in a, loss), (j in b, gain))``: the token of ``a`` that lost most weight and the
        token of ``b`` that gained most (unmatched tokens lose or gain all of theirs)."""
        ra = self.a.focus_weights[layer, head].astype(np.float64)
        rb = self.b.focus_weights[layer, head].astype(np.float64)
        to_b = dict(self.pairs)
        to_a = {j: i for i, j in self.pairs}
        loss = [ra[i] - (rb[to_b[i]] if i in to_b else 0.0) for i in range(len(ra))]
        gain = [rb[j] - (ra[to_a[j]] if j in to_a else 0.0) for j in range(len(rb))]
        i, j = int(np.argmax(loss)), int(np.argmax(gain))
        return (i, float(loss[i])), (j, float(gain[j]))

    def select(self, layer: Optional[int] = None, head: Optional[int] = None) -> tuple[int, int]:
        """``(layer, head)`` to show in full: each one not given is the most-changed head's."""
        best_l, best_h, _ = self.top_changes(1)[0]
        return self.a.select(best_l if layer is None else layer, best_h if head is None else head)

    def difference(self, layer: int, head: int) -> tuple[np.ndarray, list[int], list[int]]:
        """``(B − A)`` of one head's maps on the aligned tokens ``(M, M)``, with their indices in a and b."""
        if self.a.maps is None or self.b.maps is None:
            raise ValueError("the maps were not kept (the texts are too long); only focus rows are compared")
        ia = [i for i, _ in self.pairs]
        ib = [j for _, j in self.pairs]
        return (self.b.maps[layer, head][np.ix_(ib, ib)].astype(np.float64)
                - self.a.maps[layer, head][np.ix_(ia, ia)].astype(np.float64)), ia, ib

    def to_dict(self, decimals: int = 4) -> dict[str, Any]:
        r = lambda v: round(float(v), decimals)  # noqa: E731
        out = []
        for l, h, d in self.top_changes(10):
            (i, lost), (j, won) = self.moved(l, h)
            out.append({"layer": l, "head": h, "distance": r(d), "lost": {"index": i, "token": self.a.tokens[i], "weight": r(lost)},
                        "gained": {"index": j, "token": self.b.tokens[j], "weight": r(won)}})
        return {
            "a": self.a.to_dict(decimals), "b": self.b.to_dict(decimals),
            "alignment": [[i, j] for i, j in self.pairs],
            "distance": np.round(self.distance, decimals).tolist(),
            "shared_distance": np.round(self.shared, decimals).tolist(),
            "top_changes": out,
            "top_shared_changes": [{"layer": l, "head": h, "distance": r(d)} for l, h, d in self.top_changes(10, shared=True)],
            "notes": list(self.notes),
        }

    def to_string(self, top: int = 5, lang: str = "en") -> str:
        """The terminal report in ``lang`` ("en" or "zh"; the catalogue's ``compare.*`` messages)."""
        check_lang(lang)
        a, b = self.a, self.b
        fa, fb = a.tokens[a.focus_index], b.tokens[b.focus_index]
        only_a = _listed([a.tokens[i] for i in range(len(a.tokens)) if i not in dict(self.pairs)], lang)
        only_b = _listed([b.tokens[j] for j in range(len(b.tokens)) if j not in {j for _, j in self.pairs}], lang)
        out = [text("compare.model", lang, model=a.model_name, L=a.num_layers, H=a.num_heads),
               text("compare.a", lang, text=shorten(a.text, 300)), text("compare.b", lang, text=shorten(b.text, 300)),
               text("compare.focus", lang, fa=fa, ia=a.focus_index, fb=fb, ib=b.focus_index, n=len(self.pairs),
                    only_a=only_a, only_b=only_b)]
        out += [text("explain.note", lang, note=word(n, lang)) for n in self.notes]
        out += ["", text("compare.moved_heads", lang, tok=fa)]
        for l, h, d in self.top_changes(top):
            (i, lost), (j, won) = self.moved(l, h)
            ta = a.tokens[int(np.argmax(a.focus_weights[l, h]))]
            tb = b.tokens[int(np.argmax(b.focus_weights[l, h]))]
            out.append(text("compare.moved_head", lang, l=l, h=h, d=d, ta=ta, tb=tb,
                            lost_tok=a.tokens[i], lost=lost, won_tok=b.tokens[j], won=won))
        out.append("")
        out.append(text("compare.shared_heads", lang))
        ia = dict(self.pairs)
        for l, h, d in self.top_changes(top, shared=True):
            ra, rb = a.focus_weights[l, h], b.focus_weights[l, h]
            shared_top = lambda r, idx: max(idx, key=lambda i: r[i])  # noqa: E731
            ta = a.tokens[shared_top(ra, list(ia))]
            tb = b.tokens[shared_top(rb, list(ia.values()))]
            out.append(text("compare.shared_head", lang, l=l, h=h, d=d, ta=ta, tb=tb))
        mean = float(self.distance.mean())
        out.append("")
        out.append(text("compare.mean", lang, mean=mean))
        return "\n".join(out)

    def _repr_html_(self) -> str:
        """The comparison page (distance grid, both maps, B − A), for notebooks, in an iframe."""
        # upward, lazily: a notebook convenience; viz draws, analysis computes
        from ..viz.compare import render_compare_html
        from ..viz.pages import iframe

        return iframe(render_compare_html(self), 900)

    def __repr__(self) -> str:
        l, h, d = self.top_changes(1)[0]
        return f"Comparison(model={self.a.model_name!r}, tokens={len(self.a.tokens)}/{len(self.b.tokens)}, top=L{l} H{h} {d:.3f})"


def compare(
    text: str, other: str, focus: Optional[str] = None, target: Optional[str] = None, *,
    model: Any = None, model_path: Optional[str] = None, **kwargs: Any,
) -> Comparison:
    """Explain ``text`` and ``other`` with the same focus word and compare every head.

    The focus (and the target) of ``other`` is the token aligned with the one chosen in ``text``;
    when the word itself changed between the texts, it is looked for in ``other`` by name.
    ``kwargs`` go to :func:`qkv.analysis.explain` (``max_map_tokens``, ``max_map_bytes``).
    """
    if not isinstance(other, str):
        raise TypeError(f"other must be a string (the text to compare with), got {type(other).__name__}")
    if not other.strip():
        raise ValueError("the second text is empty; pass the sentence to compare with, e.g. --compare 'It was too small.'")
    if model is None:
        model = load_model(model_path)
    a = explain(text, focus, target, model=model, model_path=model_path, **kwargs)
    enc_b = encode(model, other)
    tokens_b = enc_b.tokens
    enc_a = encode(model, text)
    keys_a = _keys(enc_a, text) if enc_a.tokens == a.tokens else a.tokens  # (a truncated text: tokens only)
    pairs = align_tokens(keys_a, _keys(enc_b, other))
    to_b = dict(pairs)
    notes: list[str] = []

    def counterpart(i: int, word: Optional[str], what: str) -> Optional[str]:
        if i in to_b:
            return f"#{to_b[i]}"
        key = f"note.{what}_{'elsewhere' if word else 'b_choice'}"
        notes.append(Note(key, t=a.tokens[i], w=word) if word else Note(key, t=a.tokens[i]))
        return word

    fb = counterpart(a.focus_index, focus, "focus")
    tb = counterpart(a.target_index, target, "target")
    try:
        b = explain(other, fb, tb, model=model, model_path=model_path, **kwargs)
    except ValueError as e:
        raise ValueError(f"in the second text (--compare): {e}") from None
    b.focus_word, b.target_word = a.focus_word, a.target_word
    # how B's words were found (a word matched inside another, a truncation), not its target choice
    notes += [Note("note.in_b", note=n) for n in b.notes if n not in a.notes and not n.startswith("target: ")]
    if b.tokens != tokens_b:  # truncated to the model's positions: align what it read
        pairs = align_tokens(a.tokens, b.tokens)
    dist = _tv(a.focus_weights, b.focus_weights, pairs)  # (L, H)
    return Comparison(a, b, pairs, dist, notes, _shared_tv(a.focus_weights, b.focus_weights, pairs))
