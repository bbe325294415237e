"""The studio's answers: each question the page asks, answered by the analysis that already
answers it for ``qkv explain``, ``qkv trace`` and :mod:`qkv.inspect`, packed as JSON-ready dicts.

=============  ===================================================================================
``analyze``    every layer × head map of a text (:func:`qkv.analysis.explain`), each head's
               statistics (:func:`qkv.inspect.attention_stats` on the model's own q and k,
               classified by :func:`qkv.inspect.head_summary`), the heads linking a focus token
               to a target
``head``       one head in the float64 glass box (:func:`qkv.glass.trace_model`; the toy model:
               :func:`qkv.glass.sentence_trace`) with its step-by-step story
``intervene``  knock heads out or patch them from a second text (:func:`qkv.inspect.ablate`,
               :func:`qkv.inspect.patch_from`): the output's change
               (:func:`qkv.analysis.ablation_effect`) and every map after it
``compare``    two texts head by head (:func:`qkv.analysis.compare`)
``tutorial``   the toy model's worked examples (:mod:`qkv.glass.toy`)
=============  ===================================================================================

Maps travel as base64 16-bit weights (:func:`qkv.viz.pages.encode_weights`), shapes beside them.
A model is used by one request at a time (a lock each): recording and editing hooks must not
see another request's forward pass.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..locale import Note, check_lang, messages, text
from ..viz.pages import encode_weights

__all__ = ["Studio", "StudioError", "LIMITS", "ModelSlot", "page_words"]

LIMITS = {"max_chars": 1000, "max_tokens": 128, "max_heads": 64}
"""What one request may ask: characters per text, word pieces per text (each view keeps
``L·H·N²`` weights), heads knocked out at once."""

TOY = "toy"
BUNDLED = "minilm"
TOY_WORDS = 16
"""Words the toy model reads (its matrices are printed in full)."""


class StudioError(ValueError):
    """A request the studio cannot answer: the words the page shows (a :class:`~qkv.locale.Note`,
    so in any language: :meth:`text`), an HTTP status, and ``model``: the id of a model that
    answers it instead, when there is one (the page offers it as one click)."""

    def __init__(self, message: Union[Note, str], status: int = 400, *, model: Optional[str] = None) -> None:
        super().__init__(str(message))
        self.message, self.status, self.model = message, status, model

    def text(self, lang: str) -> str:
        """The refusal in ``lang``."""
        return page_words(self.message, lang)


def page_words(message: Any, lang: str) -> str:
    """``message`` as the page says it in ``lang``: a :class:`~qkv.locale.Note` by its page
    wording (``studio.<key>`` when the catalogue has one: the command line's notes name its
    options, the page names its own controls), its nested notes likewise; any other string as it is."""
    if not isinstance(message, Note):
        return str(message)
    own = messages(lang, "studio.")

    def value(v: Any) -> Any:
        if isinstance(v, Note):
            return page_words(v, lang)
        if isinstance(v, tuple) and v and all(isinstance(x, Note) for x in v):
            return text("list.sep", lang).join(page_words(x, lang) for x in v)
        return v

    key = "studio." + message.key if message.key in own else message.key
    return text(key, lang, **{k: value(v) for k, v in message.values.items()})


@dataclass
class ModelSlot:
    """One model the server was started with: chosen by ``id``, loaded on first use, kept."""

    id: str
    name: str
    path: Optional[str]  # None: the bundled all-MiniLM-L6-v2 (or the toy model)
    kind: str = "encoder"  # "toy" | "encoder" | "decoder" (known once loaded)
    model: Any = None
    error: Optional[str] = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "kind": self.kind, "loaded": self.model is not None or self.id == TOY,
                "error": self.error}


def _bundled_installed() -> bool:
    try:
        from ..models import default_model_dir

        default_model_dir()
        return True
    except (ImportError, FileNotFoundError):
        return False


class Studio:
    """The models a studio serves and the questions it answers (see the module docstring).

    ``model_dirs``: local checkpoint directories (the architectures ``qkv explain --model``
    reads), each offered by an id made from its folder name. They come first, then the bundled
    all-MiniLM-L6-v2 when it is installed, then the toy glass-box model (the tutorial's, which
    reads at most 16 words); the first is :attr:`default`, the one the page opens on.
    """

    def __init__(self, model_dirs: Sequence[str] = (), *, bundled: Optional[bool] = None) -> None:
        toy = ModelSlot(TOY, "toy glass-box model", None, "toy")
        real = ModelSlot(BUNDLED, "all-MiniLM-L6-v2", None, "encoder") \
            if (bundled if bundled is not None else _bundled_installed()) else None
        taken = {TOY, BUNDLED}
        given: list[ModelSlot] = []
        for d in model_dirs:
            path = os.path.abspath(os.fspath(d))
            base = re.sub(r"[^a-z0-9]+", "-", os.path.basename(os.path.normpath(path)).lower()).strip("-") or "model"
            mid, n = base, 2
            while mid in taken:
                mid, n = f"{base}-{n}", n + 1
            taken.add(mid)
            given.append(ModelSlot(mid, os.path.basename(os.path.normpath(path)), path))
        self.slots: dict[str, ModelSlot] = {s.id: s for s in [*given, *([real] if real else []), toy]}

    # -- models ---------------------------------------------------------------------------------

    @property
    def default(self) -> str:
        """The id of the model the page opens on: the first one given, else the bundled one, else the toy."""
        return next(iter(self.slots))

    def models(self) -> list[dict[str, Any]]:
        """Every model offered, in order: id, name, kind, whether loaded, the load error if any."""
        return [s.describe() for s in self.slots.values()]

    def alternative(self, model_id: str) -> Optional[ModelSlot]:
        """A pretrained model other than ``model_id`` that has not failed to load (the bundled one
        first): what a refusal offers instead."""
        order = sorted(self.slots.values(), key=lambda s: s.id != BUNDLED)
        return next((s for s in order if s.id not in (TOY, model_id) and s.error is None), None)

    def slot(self, model_id: str) -> ModelSlot:
        """The model ``model_id`` (ids only: a request never names a file), loaded once."""
        if model_id not in self.slots:
            raise StudioError(Note("studio.err.unknown_model", model=repr(model_id), models=", ".join(self.slots)), 404)
        s = self.slots[model_id]
        if s.id == TOY or s.model is not None:
            return s
        with s.lock:
            if s.model is None and s.error is None:
                try:
                    from ..analysis import load_model

                    s.model = load_model(s.path)
                    s.kind = "decoder" if getattr(s.model, "is_decoder", False) else "encoder"
                except Exception as e:  # reported in the page; the server keeps serving the other models
                    s.error = f"{type(e).__name__}: {e}"
        if s.error is not None:
            other = self.alternative(s.id)
            raise StudioError(Note("studio.err.model_failed", name=s.name, error=s.error), 503,
                              model=other.id if other else None)
        return s

    # -- the questions --------------------------------------------------------------------------

    def analyze(self, model_id: str, text: str, *, pair: Optional[str] = None, focus: Optional[int] = None,
                target: Optional[int] = None, lang: str = "en") -> dict[str, Any]:
        """Every head's map and statistics for ``text`` (and ``pair``, a second text of a sentence pair)."""
        s = self._asked(model_id, lang, text=text, pair=pair)
        if s.kind == "toy":
            if pair is not None:
                raise self._toy_refusal("studio.err.toy_pair")
            return self._toy_analysis(text, focus)
        import torch

        from ..analysis import explain

        with s.lock:
            enc = self._check_length(s, text, pair)
            _check_index(focus, "focus", len(enc.ids))
            _check_index(target, "target", len(enc.ids))
            ex = explain(text, _index(focus), _index(target), model=s.model, model_path=s.path, pair=pair,
                         max_map_tokens=LIMITS["max_tokens"])
            assert ex.maps is not None  # within max_tokens: the maps are kept
            stats = _recorded_stats(s.model, _inputs(torch, enc), ex.tokens)
        return {
            "model": s.describe(), "tokens": ex.tokens, "segments": ex.segments,
            "layers": ex.num_layers, "heads": ex.num_heads,
            "maps": _maps(ex.maps), "stats": stats,
            "focus": ex.focus_index, "target": ex.target_index,
            "top_heads": [{"layer": l, "head": h, "weight": round(w, 4)} for l, h, w in ex.top_heads(8)],
            "notes": [page_words(n, lang) for n in ex.notes],
        }

    def head(self, model_id: str, text: str, *, layer: int, head: int, token: int = 0, pair: Optional[str] = None,
             lang: str = "en") -> dict[str, Any]:
        """One head in the float64 glass box (of ``text``, or of the sentence pair ``text``,
        ``pair``): every step's matrix and the story of query ``token``."""
        s = self._asked(model_id, lang, text=text, pair=pair)
        if s.kind == "toy":
            if pair is not None:
                raise self._toy_refusal("studio.err.toy_pair")
            t = _toy_trace(text, self._toy_refusal)
            _check_head(layer, head, 1, t.num_heads, Note("studio.toy_model"))
            _check_index(token, "token", t.n)
            one = t.heads[head] if t.heads else t
        else:
            if hasattr(s.model, "hf_tokenizer"):
                raise StudioError(Note("studio.err.glass_hf", name=s.name), 422)
            from ..glass import trace_model

            _check_head(layer, head, *_shape(s.model), s.name)
            with s.lock:
                enc = self._check_length(s, text, pair)
                _check_index(token, "token", len(enc.ids))
                try:
                    one = trace_model(text, s.model, layer=layer, head=head, max_tokens=LIMITS["max_tokens"], pair=pair)
                except (ValueError, NotImplementedError, TypeError) as e:
                    raise StudioError(Note("studio.err.analysis", message=str(e))) from None
        trace = one.to_dict()
        # the page shows X, Q, K, V and what follows; the projection matrices (3 · d_model · d_k
        # numbers, most of the answer) stay here, as qkv.glass.trace_model gives them in Python
        trace["params"] = {name: None for name in trace["params"]}
        return {"layer": layer, "head": head, "token": token, "trace": trace,
                "story": one.explain(lang, token=token), "scale": one.scale}

    def intervene(self, model_id: str, text: str, *, heads: Sequence[tuple[int, int]], mode: str = "zero",
                  source: Optional[str] = None, focus: Optional[int] = None, temperature: float = 1.0,
                  lang: str = "en") -> dict[str, Any]:
        """Knock ``heads`` out (``mode`` "zero" or "mean") or patch them from ``source``
        (``mode`` "patch"): the output's change and every head's map after it."""
        if mode not in ("zero", "mean", "patch"):
            raise StudioError(Note("studio.err.mode", mode=repr(mode)))
        if mode == "patch" and source is None:
            raise StudioError(Note("studio.err.patch_source"))
        if not heads:
            raise StudioError(Note("studio.err.no_heads"))
        if len(heads) > LIMITS["max_heads"]:
            raise StudioError(Note("studio.err.too_many_heads", n=len(heads), max=LIMITS["max_heads"]))
        s = self._asked(model_id, lang, text=text, source=source if mode == "patch" else None)
        if s.kind == "toy":
            raise self._toy_refusal("studio.err.toy_intervene")
        import torch

        from ..analysis import ablation_effect, explain
        from ..analysis.ablation import edited_module, final_states
        from ..analysis.compare import map_change
        from ..inspect import ablate, capture_outputs, patch_from

        L, H = _shape(s.model)
        for ref in heads:
            _check_head_pair(ref, L, H, s.name)
        chosen = sorted({(int(l), int(h)) for l, h in heads})
        with s.lock:
            enc = self._check_length(s, text, None)
            _check_index(focus, "focus", len(enc.ids))
            run = _inputs(torch, enc)
            module = edited_module(s.model)
            if mode == "patch":
                other = self._check_length(s, source or "", None)
                if len(other.ids) != len(enc.ids):
                    raise StudioError(Note("studio.err.patch_length", m=len(other.ids), n=len(enc.ids)))
                with capture_outputs(module) as got:
                    final_states(s.model, *_inputs(torch, other))

                def edit() -> Any:
                    return patch_from(module, got, chosen)
            else:
                def edit() -> Any:
                    return ablate(module, chosen, mode=mode)
            clean = explain(text, _index(focus), model=s.model, model_path=s.path, max_map_tokens=LIMITS["max_tokens"])
            with edit():
                after = explain(text, _index(focus), model=s.model, model_path=s.path, max_map_tokens=LIMITS["max_tokens"])
            effect = ablation_effect(s.model, run[0], run[1], chosen, focus_index=clean.focus_index, tokens=clean.tokens,
                                     mode=mode, token_type_ids=run[2], top=5, intervention=edit, temperature=temperature)
        assert clean.maps is not None and after.maps is not None
        out: dict[str, Any] = {"encoder": {"similarity": round(1.0 - effect.embedding_distance, 6)}} if effect.next_token is None \
            else {"decoder": {"temperature": temperature, "kl": round(effect.next_token["kl"], 6),
                              "clean": [{"token": t, "p": round(float(np.exp(p)), 6)} for t, p in effect.next_token["clean_top"]],
                              "changed": [{"token": t, "p": round(float(np.exp(p)), 6)} for t, p in effect.next_token["ablated_top"]]}}
        return {"heads": [list(h) for h in chosen], "mode": mode, "tokens": clean.tokens, "focus": clean.focus_index,
                "effect": effect.to_dict(), "output": out, "lines": _effect_lines(effect, lang),
                "maps": _maps(after.maps), "change": np.round(map_change(clean.maps, after.maps), 6).tolist()}

    def compare(self, model_id: str, text: str, other: str, *, focus: Optional[int] = None, lang: str = "en") -> dict[str, Any]:
        """``text`` and ``other`` head by head: both maps, the change per head, the aligned tokens."""
        s = self._asked(model_id, lang, text=text, other=other)
        if s.kind == "toy":
            raise self._toy_refusal("studio.err.toy_compare")
        from ..analysis import compare

        with s.lock:
            enc = self._check_length(s, text, None)
            self._check_length(s, other, None, "other")
            _check_index(focus, "focus", len(enc.ids))
            try:
                c = compare(text, other, _index(focus), model=s.model, model_path=s.path, max_map_tokens=LIMITS["max_tokens"])
            except ValueError as e:
                raise StudioError(Note("studio.err.analysis", message=str(e))) from None
        assert c.a.maps is not None and c.b.maps is not None
        worded = dataclasses.replace(c, notes=[page_words(n, lang) for n in c.notes])
        return {"a": {"tokens": c.a.tokens, "focus": c.a.focus_index, "maps": _maps(c.a.maps)},
                "b": {"tokens": c.b.tokens, "focus": c.b.focus_index, "maps": _maps(c.b.maps)},
                "layers": c.num_layers, "heads": c.num_heads, "alignment": [list(p) for p in c.pairs],
                "distance": np.round(c.distance, 6).tolist(), "top_changes": c.to_dict()["top_changes"],
                "notes": worded.notes, "report": worded.to_string(lang=lang)}

    def tutorial(self, lang: str = "en") -> dict[str, Any]:
        """The toy model's walk-through: the worked example (112 and 96), a causal mask, two heads."""
        check_lang(lang)
        from ..glass import sentence_trace, worked_example

        steps = [("worked", worked_example(), 0), ("causal", sentence_trace("Thinking Machines learn", causal=True), 2),
                 ("heads", sentence_trace("Thinking Machines learn", heads=2), 1)]
        return {"steps": [{"name": name, "trace": t.to_dict(), "story": t.explain(lang, token=token), "token": token,
                           "text": t.to_string(lang=lang)} for name, t, token in steps]}

    # -- helpers --------------------------------------------------------------------------------

    def _asked(self, model_id: str, lang: str, *, text: Any, **optional: Any) -> ModelSlot:
        """Every request's first checks: the language, ``text`` and each optional text given
        (None: not given), then the model (loaded once)."""
        check_lang(lang)
        _check_text(text, "text")
        for name, value in optional.items():
            if value is not None or name == "other":  # other: required
                _check_text(value, name)
        return self.slot(model_id)

    def _toy_refusal(self, key: str, **values: Any) -> StudioError:
        """The toy model cannot answer this: the refusal, offering the pretrained model that can."""
        other = self.alternative(TOY)
        if other is None:
            return StudioError(Note(key + "_alone", **values))
        return StudioError(Note(key, real=other.name, **values), model=other.id)

    def _toy_analysis(self, text: str, focus: Optional[int]) -> dict[str, Any]:
        t = _toy_trace(text, self._toy_refusal)
        _check_index(focus, "focus", t.n)
        heads = t.heads or [t]
        maps = np.stack([h.weights for h in heads])[None]  # (1, H, N, N)
        import torch

        from ..inspect import attention_stats

        q = torch.from_numpy(np.stack([h.q for h in heads]))[None]  # (1, H, N, d_k)
        k = torch.from_numpy(np.stack([h.k for h in heads]))[None]
        stats = _summary({"0": attention_stats(q, k, scale=t.scale, backend="torch")}, t.tokens)
        f = 0 if focus is None else focus
        return {"model": self.slots[TOY].describe(), "tokens": t.tokens, "segments": None, "layers": 1, "heads": len(heads),
                "maps": _maps(maps), "stats": stats,
                "focus": f, "target": int(np.argmax(maps[0, :, f].max(0))), "top_heads": [], "notes": []}

    def _check_length(self, s: ModelSlot, text: str, pair: Optional[str], name: str = "text") -> Any:
        """``text`` (and ``pair``) as the model's word pieces (:func:`qkv.analysis.explain.encode`),
        refused beyond ``LIMITS["max_tokens"]``."""
        from ..analysis.explain import encode

        enc = encode(s.model, text, pair)
        n = len(enc.ids)
        if n > LIMITS["max_tokens"]:
            raise StudioError(Note("studio.err.too_many_tokens", field=_field(name if pair is None else "pair_both"), n=n,
                                   max=LIMITS["max_tokens"]), 413)
        return enc


_FIELDS = {"text": "text", "pair": "second", "source": "second", "other": "second", "pair_both": "both"}


def _field(name: str) -> Note:
    """A request's text named as the page names it: "the text", "the second text"."""
    return Note(f"studio.field.{_FIELDS.get(name, 'text')}")


def _check_text(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise StudioError(Note("studio.err.text_type", field=_field(name), got=type(value).__name__))
    if not value.strip():
        raise StudioError(Note("studio.err.empty", field=_field(name)))
    if len(value) > LIMITS["max_chars"]:
        raise StudioError(Note("studio.err.too_many_chars", field=_field(name), n=len(value), max=LIMITS["max_chars"]), 413)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: JSON's "\ud800" decodes to one, no tokenizer reads it
        raise StudioError(Note("studio.err.unicode", field=_field(name), code=f"{ord(value[e.start]):04X}",
                               i=e.start)) from None


def _check_index(i: Optional[int], name: str, n: int) -> None:
    """``i`` (None: not chosen) must number one of the ``n`` tokens, counting from 0."""
    if i is not None and not (isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 <= i < n):
        raise StudioError(Note(f"studio.err.{name}", i=_shown(i), last=n - 1))


def _check_head(layer: Any, head: Any, layers: int, heads: int, name: str) -> None:
    for value, what, count in ((layer, "layer", layers), (head, "head", heads)):
        if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < count):
            raise StudioError(Note(f"studio.err.{what}", i=_shown(value), name=name, last=count - 1))


def _check_head_pair(ref: Any, layers: int, heads: int, name: str) -> None:
    ok = isinstance(ref, (tuple, list)) and len(ref) == 2 and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in ref)
    if not ok or not (0 <= ref[0] < layers and 0 <= ref[1] < heads):
        shown = f"L{_shown(ref[0])} H{_shown(ref[1])}" if ok else _shown(ref)
        raise StudioError(Note("studio.err.head_pair", head=shown, name=name, layers=layers - 1, heads=heads - 1))


def _shown(value: Any) -> str:
    """A requested value as a refusal quotes it: at most 24 characters (10**20 stays readable)."""
    s = str(value)
    return s if len(s) <= 24 else s[:21] + "…"


def _index(i: Optional[int]) -> Optional[str]:
    """A token index as :func:`qkv.analysis.explain`'s focus/target spelling (``"#3"``)."""
    return None if i is None else f"#{int(i)}"


def _toy_trace(text: str, refuse: Any) -> Any:
    from ..glass import sentence_trace, split_words

    words = split_words(text)
    if len(words) > TOY_WORDS:
        raise refuse("studio.err.toy_words", n=len(words), max=TOY_WORDS)
    return sentence_trace(text, heads=2)


def _effect_lines(effect: Any, lang: str) -> list[str]:
    """An intervention's effect in the page's words (the command line's report names ``--ablate``
    modes; the page says what its own controls did)."""
    def say(key: str, **values: Any) -> str:
        return text("studio.line." + key, lang, **values)

    heads = text("list.sep", lang).join(text("studio.head_name", lang, l=l, h=h) for l, h in effect.heads)
    mean, mx, at = effect.others()
    out = [say(f"title_{effect.mode}", heads=heads),
           say("focus", tok=effect.tokens[effect.focus_index], d=f"{effect.focus_distance:.4f}")]
    if at >= 0:
        out.append(say("others", mean=f"{mean:.4f}", max=f"{mx:.4f}", tok=effect.tokens[at], i=at))
    out.append(say("embedding", d=f"{effect.embedding_distance:.4f}"))
    nt = effect.next_token
    if nt is not None:
        top = lambda xs: text("list.sep", lang).join(f"{t} {np.exp(p):.3f}" for t, p in xs)  # noqa: E731
        out += [say("next", tok=effect.tokens[effect.focus_index], kl=f"{nt['kl']:.4f}", top=nt["clean_top"][0][0],
                    delta=f"{nt['delta_logprob']:+.4f}"),
                say("before", tokens=top(nt["clean_top"])), say("after", tokens=top(nt["ablated_top"]))]
    return out


def _shape(model: Any) -> tuple[int, int]:
    cfg = model.config
    return int(cfg.num_hidden_layers), int(cfg.num_attention_heads)


def _inputs(torch: Any, enc: Any) -> tuple[Any, Any, Any]:
    ids = torch.tensor([enc.ids], dtype=torch.long)  # (1, N)
    types = None if enc.type_ids is None else torch.tensor([enc.type_ids], dtype=torch.long)
    return ids, torch.ones_like(ids), types


def _maps(maps: np.ndarray) -> dict[str, Any]:
    """``(L, H, Nq, Nk)`` weights as the pages carry them: 16-bit base64 and the shape."""
    return {"shape": list(maps.shape), "data": encode_weights(np.asarray(maps, dtype=np.float64))}


def _recorded_stats(model: Any, run: tuple[Any, Any, Any], tokens: Sequence[str]) -> list[dict[str, Any]]:
    """Each head's statistics over every query row, recorded from the model's own attention calls
    (:func:`qkv.inspect.record` for qkv.nn models, :func:`qkv.inspect.record_stats` for Hugging
    Face ones: tile by tile, no map rebuilt) and classified by :func:`qkv.inspect.head_summary`."""
    import torch

    from ..analysis.ablation import edited_module, final_states
    from ..inspect import record, record_stats

    ids, mask, types = run
    with torch.inference_mode():
        if hasattr(model, "hf_tokenizer"):
            with record_stats() as calls:
                final_states(model, ids, mask, types)
            per_layer = {str(i): st for i, st in enumerate(calls)}
        else:
            with record(edited_module(model), "*.weights", stats=True, reuse_lse=True) as rec:
                final_states(model, ids, mask, types)
            per_layer = {str(i): rec.stats[m] for i, m in enumerate(rec.modules)}
    return _summary(per_layer, tokens)


def _summary(per_layer: dict[str, Any], tokens: Sequence[str]) -> list[dict[str, Any]]:
    """:func:`qkv.inspect.head_summary` of ``{"<layer>": AttentionStats}`` as the page's rows, by layer and head."""
    from ..inspect import head_summary

    rows = []
    for r in head_summary(per_layer, tokens=list(tokens)):
        rows.append({"layer": int(r["module"]), "head": int(r["head"]), "kind": r["kind"],
                     **{k: round(float(r[k]), 4) for k in ("score", "entropy", "mean_distance", "sink", "previous", "self", "broad")},
                     "top_token": r.get("top_token")})
    rows.sort(key=lambda r: (r["layer"], r["head"]))
    return rows
