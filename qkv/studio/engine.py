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

import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..locale import check_lang, word
from ..viz.pages import encode_weights

__all__ = ["Studio", "StudioError", "LIMITS", "ModelSlot"]

LIMITS = {"max_chars": 1000, "max_tokens": 128, "max_heads": 64}
"""What one request may ask: characters per text, word pieces per text (each view keeps
``L·H·N²`` weights), heads knocked out at once."""

TOY = "toy"
BUNDLED = "minilm"


class StudioError(ValueError):
    """A request the studio cannot answer, with the words the page shows and an HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


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
    reads), each offered by an id made from its folder name; the toy glass-box model and, when
    installed, the bundled all-MiniLM-L6-v2 come first.
    """

    def __init__(self, model_dirs: Sequence[str] = (), *, bundled: Optional[bool] = None) -> None:
        self.slots: dict[str, ModelSlot] = {TOY: ModelSlot(TOY, "toy glass-box model", None, "toy")}
        if bundled if bundled is not None else _bundled_installed():
            self.slots[BUNDLED] = ModelSlot(BUNDLED, "all-MiniLM-L6-v2", None, "encoder")
        for d in model_dirs:
            path = os.path.abspath(os.fspath(d))
            base = re.sub(r"[^a-z0-9]+", "-", os.path.basename(os.path.normpath(path)).lower()).strip("-") or "model"
            mid, n = base, 2
            while mid in self.slots:
                mid, n = f"{base}-{n}", n + 1
            self.slots[mid] = ModelSlot(mid, os.path.basename(os.path.normpath(path)), path)

    # -- models ---------------------------------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        """Every model offered, in order: id, name, kind, whether loaded, the load error if any."""
        return [s.describe() for s in self.slots.values()]

    def slot(self, model_id: str) -> ModelSlot:
        """The model ``model_id`` (ids only: a request never names a file), loaded once."""
        if model_id not in self.slots:
            raise StudioError(f"model {model_id!r} is not one of this studio's models ({', '.join(self.slots)})", 404)
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
            raise StudioError(f"model {s.name!r} could not be loaded: {s.error}", 503)
        return s

    # -- the questions --------------------------------------------------------------------------

    def analyze(self, model_id: str, text: str, *, pair: Optional[str] = None, focus: Optional[int] = None,
                target: Optional[int] = None, lang: str = "en") -> dict[str, Any]:
        """Every head's map and statistics for ``text`` (and ``pair``, a second text of a sentence pair)."""
        s = self._asked(model_id, lang, text=text, pair=pair)
        if s.kind == "toy":
            return self._toy_analysis(text, focus)
        import torch

        from ..analysis import explain

        with s.lock:
            enc = self._check_length(s, text, pair)
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
            "notes": [word(n, lang) for n in ex.notes],
        }

    def head(self, model_id: str, text: str, *, layer: int, head: int, token: int = 0, pair: Optional[str] = None,
             lang: str = "en") -> dict[str, Any]:
        """One head in the float64 glass box (of ``text``, or of the sentence pair ``text``,
        ``pair``): every step's matrix and the story of query ``token``."""
        s = self._asked(model_id, lang, text=text, pair=pair)
        if s.kind == "toy":
            if pair is not None:
                raise StudioError("the toy model reads one text; clear the second text or pick a pretrained model")
            t = _toy_trace(text)
            if not 0 <= layer < 1 or not 0 <= head < t.num_heads:
                raise StudioError(f"the toy model has 1 layer and {t.num_heads} heads; layer={layer}, head={head} is not one")
            one = t.heads[head] if t.heads else t
        else:
            if hasattr(s.model, "hf_tokenizer"):
                raise StudioError(f"the glass box traces the BERT-style models qkv rebuilds (qkv.models); {s.name} runs "
                                  "through transformers: its maps, statistics and interventions work, one head's "
                                  "step-by-step numbers do not", 422)
            from ..glass import trace_model

            with s.lock:
                self._check_length(s, text, pair)
                try:
                    one = trace_model(text, s.model, layer=layer, head=head, max_tokens=LIMITS["max_tokens"], pair=pair)
                except (ValueError, NotImplementedError, TypeError) as e:
                    raise StudioError(str(e)) from None
        if not -one.n <= token < one.n:
            raise StudioError(f"token={token} is not a token index of this text (0 to {one.n - 1})")
        trace = one.to_dict()
        # the page shows X, Q, K, V and what follows; the projection matrices (3 · d_model · d_k
        # numbers, most of the answer) stay here, as qkv.glass.trace_model gives them in Python
        trace["params"] = {name: None for name in trace["params"]}
        return {"layer": layer, "head": head, "token": token % one.n, "trace": trace,
                "story": one.explain(lang, token=token % one.n), "scale": one.scale}

    def intervene(self, model_id: str, text: str, *, heads: Sequence[tuple[int, int]], mode: str = "zero",
                  source: Optional[str] = None, focus: Optional[int] = None, temperature: float = 1.0,
                  lang: str = "en") -> dict[str, Any]:
        """Knock ``heads`` out (``mode`` "zero" or "mean") or patch them from ``source``
        (``mode`` "patch"): the output's change and every head's map after it."""
        if mode not in ("zero", "mean", "patch"):
            raise StudioError(f"mode={mode!r} is not an intervention; use 'zero', 'mean' or 'patch'")
        if mode == "patch" and source is None:
            raise StudioError("mode='patch' needs source: the text whose head outputs are patched in")
        if len(heads) > LIMITS["max_heads"]:
            raise StudioError(f"{len(heads)} heads at once; the studio knocks out at most {LIMITS['max_heads']}")
        s = self._asked(model_id, lang, text=text, source=source if mode == "patch" else None)
        if s.kind == "toy":
            raise StudioError("the toy model has no output to change; pick a pretrained model to intervene")
        import torch

        from ..analysis import ablation_effect, check_heads, explain
        from ..analysis.ablation import edited_module, final_states
        from ..analysis.compare import map_change
        from ..inspect import ablate, capture_outputs, patch_from

        with s.lock:
            enc = self._check_length(s, text, None)
            try:
                chosen = check_heads([tuple(h) for h in heads], *_shape(s.model))
            except ValueError as e:
                raise StudioError(str(e)) from None
            run = _inputs(torch, enc)
            module = edited_module(s.model)
            if mode == "patch":
                other = self._check_length(s, source or "", None)
                if len(other.ids) != len(enc.ids):
                    raise StudioError(f"patching needs texts of the same length: source has {len(other.ids)} "
                                      f"word pieces, text has {len(enc.ids)}")
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
                "effect": effect.to_dict(), "output": out, "lines": effect.to_lines(lang),
                "maps": _maps(after.maps), "change": np.round(map_change(clean.maps, after.maps), 6).tolist()}

    def compare(self, model_id: str, text: str, other: str, *, focus: Optional[int] = None, lang: str = "en") -> dict[str, Any]:
        """``text`` and ``other`` head by head: both maps, the change per head, the aligned tokens."""
        _check_text(other, "other")  # required (the optional texts below may be None)
        s = self._asked(model_id, lang, text=text)
        if s.kind == "toy":
            raise StudioError("comparing runs a pretrained model; pick one other than the toy model")
        from ..analysis import compare

        with s.lock:
            self._check_length(s, text, None)
            self._check_length(s, other, None)
            try:
                c = compare(text, other, _index(focus), model=s.model, model_path=s.path, max_map_tokens=LIMITS["max_tokens"])
            except ValueError as e:
                raise StudioError(str(e)) from None
        assert c.a.maps is not None and c.b.maps is not None
        return {"a": {"tokens": c.a.tokens, "focus": c.a.focus_index, "maps": _maps(c.a.maps)},
                "b": {"tokens": c.b.tokens, "focus": c.b.focus_index, "maps": _maps(c.b.maps)},
                "layers": c.num_layers, "heads": c.num_heads, "alignment": [list(p) for p in c.pairs],
                "distance": np.round(c.distance, 6).tolist(), "top_changes": c.to_dict()["top_changes"],
                "report": c.to_string(lang=lang)}

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
            if value is not None:
                _check_text(value, name)
        return self.slot(model_id)

    def _toy_analysis(self, text: str, focus: Optional[int]) -> dict[str, Any]:
        t = _toy_trace(text)
        heads = t.heads or [t]
        maps = np.stack([h.weights for h in heads])[None]  # (1, H, N, N)
        import torch

        from ..inspect import attention_stats

        q = torch.from_numpy(np.stack([h.q for h in heads]))[None]  # (1, H, N, d_k)
        k = torch.from_numpy(np.stack([h.k for h in heads]))[None]
        stats = _summary({"0": attention_stats(q, k, scale=t.scale, backend="torch")}, t.tokens)
        f = 0 if focus is None else focus
        if not -t.n <= f < t.n:
            raise StudioError(f"focus={focus} is not a token index of this text (0 to {t.n - 1})")
        return {"model": self.slots[TOY].describe(), "tokens": t.tokens, "segments": None, "layers": 1, "heads": len(heads),
                "maps": _maps(maps), "stats": stats,
                "focus": f % t.n, "target": int(np.argmax(maps[0, :, f % t.n].max(0))), "top_heads": [], "notes": []}

    def _check_length(self, s: ModelSlot, text: str, pair: Optional[str]) -> Any:
        """``text`` (and ``pair``) as the model's word pieces (:func:`qkv.analysis.explain.encode`),
        refused beyond ``LIMITS["max_tokens"]``."""
        from ..analysis.explain import encode

        enc = encode(s.model, text, pair)
        n = len(enc.ids)
        if n > LIMITS["max_tokens"]:
            raise StudioError(f"the text has {n} word pieces; the studio shows at most {LIMITS['max_tokens']} "
                              "(every view keeps layers × heads × N² weights): shorten it", 413)
        return enc


def _check_text(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise StudioError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise StudioError(f"{name} is empty: type a sentence")
    if len(value) > LIMITS["max_chars"]:
        raise StudioError(f"{name} has {len(value)} characters; the studio reads at most {LIMITS['max_chars']}: shorten it", 413)


def _index(i: Optional[int]) -> Optional[str]:
    """A token index as :func:`qkv.analysis.explain`'s focus/target spelling (``"#3"``)."""
    return None if i is None else f"#{int(i)}"


def _toy_trace(text: str) -> Any:
    from ..glass import sentence_trace, split_words

    words = split_words(text)
    if len(words) > 16:
        raise StudioError(f"the toy model reads at most 16 words (its matrices are printed in full); this text has {len(words)}")
    return sentence_trace(text, heads=2)


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
