"""The glass box: one self-attention pass with every intermediate matrix kept and named.

Shapes (N tokens, H heads, d_k / d_v per head)::

    x        (N, d_model)          the input, one row per token
    q, k     (N, H·d_k)            Q = X·W_Q (+ b_Q), K = X·W_K (+ b_K)
    v        (N, H·d_v)            V = X·W_V (+ b_V)
    scores   (N, N)   | (H, N, N)  Q·Kᵀ
    scaled   (N, N)   | (H, N, N)  scores / √d_k
    modified (N, N)   | (H, N, N)  score_mod(scaled), or None without a score function
    masked   (N, N)   | (H, N, N)  modified (or scaled) + mask (−∞ where a key is hidden), or None
    weights  (N, N)   | (H, N, N)  row softmax (with a sink in each denominator when sinks are given)
    output   (N, d_v) | (H, N, d_v) weights·V
    concat   (N, H·d_v)            the head outputs side by side (H > 1 only)
    projected (N, d_model_out)     concat·W_O (only when W_O is given)

With one head the per-step arrays are plain matrices; with several heads they carry a leading
head axis and ``heads[h]`` is a single-head :class:`Trace` of head ``h`` alone.

Masks follow :func:`qkv.reference.attention_ref`: a boolean ``attn_mask`` is True where a query
may attend; a float one is added to the scaled scores; a row with nothing left to attend to
gets all-zero weights and a zero output.

A score function (``score_mod``, FlexAttention's ``fn(score, batch, head, q_idx, kv_idx)``, see
:mod:`qkv.score_mods`) rewrites the scaled scores before the masks; the trace keeps its output
as ``modified`` and a plain description of it as ``score_mod`` (the callable itself is not kept,
so a trace stays plain data). ``sinks`` ``(H,)`` are logits that join each row's softmax
denominator with no value: the weights of a row then sum to 1 − :attr:`Trace.sink_share`.
Evaluating a score function imports torch (in :mod:`qkv.reference.attention`, the oracle's own
evaluation); a trace without one never does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..reference.attention import as_float64, combined_mask, score_mod64, softmax_rows, with_sinks
from .story import explain
from ..masks.rules import CausalArg, parse_causal
from .render import notebook_frame, trace_to_html, trace_to_string
from .serial import from_json, to_json

__all__ = ["Trace", "trace", "remasked", "SCHEMA_VERSION", "STEPS"]

SCHEMA_VERSION = 2
"""Version of the :meth:`Trace.to_dict` layout; readers accept older dicts and dicts without it.

2 added the ``modified`` step, ``score_mod``, ``sinks`` and ``sink_share``."""

STEPS: tuple[str, ...] = ("x", "q", "k", "v", "scores", "scaled", "modified", "masked", "weights", "output")
"""Names of the per-pass steps, in the order they happen."""


@dataclass(eq=False)
class Trace:
    """Every step of one self-attention pass, as float64 NumPy arrays.

    Build one with :func:`trace` (from X and the weight matrices) or :meth:`Trace.from_qkv`
    (from Q, K, V directly). See the module docstring for the shape of each step.
    """

    tokens: list[str]
    x: Optional[np.ndarray]
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scores: np.ndarray
    scaled: np.ndarray
    masked: Optional[np.ndarray]
    weights: np.ndarray
    output: np.ndarray
    lse: np.ndarray
    d_k: int
    d_v: int
    num_heads: int = 1
    is_causal: CausalArg = False
    mask_kinds: tuple[str, ...] = ()
    heads: list["Trace"] = field(default_factory=list)
    concat: Optional[np.ndarray] = None
    projected: Optional[np.ndarray] = None
    w_q: Optional[np.ndarray] = None
    w_k: Optional[np.ndarray] = None
    w_v: Optional[np.ndarray] = None
    w_o: Optional[np.ndarray] = None
    head: Optional[int] = None  # which head this is, for the per-head traces
    b_q: Optional[np.ndarray] = None  # (H·d_k,) biases of the projections, None when there are none
    b_k: Optional[np.ndarray] = None
    b_v: Optional[np.ndarray] = None
    meta: dict[str, Any] = field(default_factory=dict)  # where the numbers came from, e.g. {"model": ..., "layer": 1}
    modified: Optional[np.ndarray] = None  # score_mod(scaled), (N, N) | (H, N, N); None without a score function
    # The score function as plain data: {"kind": "softcap" | "alibi" | "relative_bias" | "score_mod" |
    # "function", "text": its describe() or name, and its numbers ("cap", "slopes", ...)}.
    score_mod: Optional[dict[str, Any]] = None
    sinks: Optional[np.ndarray] = None  # one sink logit per head of this trace, (H,) (a head's own trace: (1,))

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_qkv(
        cls,
        q: Any,
        k: Any,
        v: Any,
        *,
        is_causal: CausalArg = False,
        attn_mask: Any = None,
        tokens: Optional[Sequence[str]] = None,
        score_mod: Any = None,
        sinks: Any = None,
    ) -> "Trace":
        """Trace attention starting from given matrices ``q, k (N, d_k)`` and ``v (N, d_v)``.

        Use this to check a hand calculation: the steps from ``scores`` on are filled in,
        ``x`` and the weight matrices are None. ``score_mod`` and ``sinks`` (one logit) are
        those of :func:`trace`, for one head (head index 0).
        """
        q = _matrix(q, "q", "(N, d_k): one query row per token")
        k = _matrix(k, "k", "(N, d_k): one key row per token")
        v = _matrix(v, "v", "(N, d_v): one value row per token")
        n = q.shape[0]
        if k.shape[0] != n or v.shape[0] != n:
            raise ValueError(
                f"q, k, v have {n}, {k.shape[0]}, {v.shape[0]} rows; Trace.from_qkv traces "
                "self-attention, where every token has one query, one key and one value row"
            )
        if k.shape[1] != q.shape[1]:
            raise ValueError(
                f"q has {q.shape[1]} columns but k has {k.shape[1]}; a query is compared with "
                "a key by a dot product, so both must have the same length d_k"
            )
        labels = _tokens(tokens, n, "q")
        allowed, bias, kinds = _masks(n, attn_mask, is_causal)
        fn, info = _score_fn(score_mod, 1)
        modified = None if fn is None else _modified(fn, [q], [k])[0]
        return _single_head(labels, None, q, k, v, allowed, bias, kinds, is_causal,
                            modified=modified, score_info=info, sinks=_sinks(sinks, 1))

    # -- derived facts ------------------------------------------------------------------

    @property
    def n(self) -> int:
        """Number of tokens N."""
        return len(self.tokens)

    @property
    def d_model(self) -> Optional[int]:
        """Width of the input rows, or None when the trace started from Q, K, V."""
        return None if self.x is None else int(self.x.shape[1])

    @property
    def scale(self) -> float:
        """The factor the scores are multiplied by: 1/√d_k."""
        return 1.0 / float(np.sqrt(self.d_k))

    @property
    def row_sums(self) -> np.ndarray:
        """Sum of each weights row: 1 (1 − :attr:`sink_share` with sinks), or 0 for a query whose
        every key is masked. (N,) | (H, N)."""
        return self.weights.sum(axis=-1)

    @property
    def sink_share(self) -> np.ndarray:
        """The part of each row's attention its head's sink absorbed, exp(sink − lse): 0 without
        sinks, 1 for a row whose every key is masked. (N,) | (H, N)."""
        if self.sinks is None:
            return np.zeros_like(self.lse)
        s = self.sinks.reshape(-1, 1) if self.lse.ndim == 2 else self.sinks.reshape(())
        with np.errstate(invalid="ignore", over="ignore"):
            return np.where(np.isneginf(s), 0.0, np.exp(s - self.lse))

    @property
    def top_keys(self) -> np.ndarray:
        """Index of the key each query attends to most; −1 for a fully masked row. (N,) | (H, N)."""
        top = self.weights.argmax(axis=-1)
        return np.where(self.row_sums > 0, top, -1)

    @property
    def result(self) -> np.ndarray:
        """The layer's final answer: ``projected`` if W_O was given, else ``concat`` or ``output``."""
        if self.projected is not None:
            return self.projected
        if self.concat is not None:
            return self.concat
        return self.output

    def attends_most(self) -> list[tuple[str, Optional[str], float]]:
        """(query token, key token it weighs most or None, that weight), one per query row.

        Single head only; use ``heads[h].attends_most()`` for a multi-head trace.
        """
        if self.num_heads > 1:
            raise ValueError("attends_most() is per head; call it on trace.heads[h]")
        out: list[tuple[str, Optional[str], float]] = []
        for i, j in enumerate(self.top_keys):
            key = None if j < 0 else self.tokens[int(j)]
            out.append((self.tokens[i], key, float(self.weights[i, j]) if j >= 0 else 0.0))
        return out

    def step(self, name: str) -> Optional[np.ndarray]:
        """The array stored for step ``name`` (one of :data:`STEPS`, ``concat``, ``projected``;
        ``modified`` and ``masked`` are None when the trace has no score function or no mask)."""
        if name not in STEPS + ("concat", "projected"):
            raise KeyError(f"unknown step {name!r}; the steps are {', '.join(STEPS)}, concat, projected")
        return getattr(self, name)

    # -- presentation -------------------------------------------------------------------

    def __repr__(self) -> str:
        def shape(a: Optional[np.ndarray]) -> str:
            return "None" if a is None else "×".join(str(s) for s in a.shape)

        names = list(STEPS)
        if self.num_heads > 1:
            names.append("concat")
        if self.projected is not None:
            names.append("projected")
        parts = ", ".join(f"{s}={shape(getattr(self, s))}" for s in names)
        head = "" if self.head is None else f", head={self.head}"
        return (
            f"Trace(tokens={self.tokens!r}, d_k={self.d_k}, d_v={self.d_v}, "
            f"num_heads={self.num_heads}{head}, is_causal={self.is_causal!r}; {parts})"
        )

    def to_string(self, precision: int = 3, steps: Optional[Sequence[str]] = None, lang: str = "en") -> str:
        """Every step as labelled, aligned matrices with its formula, for a terminal.

        ``steps`` limits the output to some step names (e.g. ``("scores", "weights")``);
        ``lang`` ("en" or "zh") is the language of the notes beside each formula.
        """
        return trace_to_string(self, precision=precision, steps=steps, lang=lang)

    def explain(self, lang: str = "en", *, token: Union[int, str] = 0, precision: int = 3) -> str:
        """A step-by-step narrative in English (``"en"``) or Chinese (``"zh"``) quoting this
        trace's numbers for one query token (index or label; the first token by default)."""
        return explain(self, lang=lang, token=token, precision=precision)

    def _repr_html_(self) -> str:
        """In a notebook: the interactive stepper page (``qkv trace --html``) in a sandboxed
        iframe, self-contained and offline; :meth:`to_html` gives the static tables."""
        return notebook_frame(self)

    def to_html(self, precision: int = 3, lang: str = "en") -> str:
        """Self-contained HTML tables (no scripts, no external resources)."""
        return trace_to_html(self, precision=precision, lang=lang)

    def to_dict(self, precision: Optional[int] = None) -> dict[str, Any]:
        """Plain lists and floats, ready for ``json.dumps(..., allow_nan=False)``.

        Masked (−∞) entries become ``None`` (JSON ``null``); :meth:`from_dict` reverses this.
        ``precision`` rounds every float of the steps to that many decimals (None keeps full
        float64); the score function's description keeps its own numbers exact.
        The dict carries ``"schema_version"`` (:data:`SCHEMA_VERSION`) and ``"kind": "attention"``.
        """
        if precision is not None and (
            isinstance(precision, bool) or not isinstance(precision, (int, np.integer)) or not 0 <= precision <= 15
        ):
            raise ValueError(f"precision={precision!r} must be None or an int from 0 to 15 (decimals kept)")

        def js(a: Optional[np.ndarray]) -> Any:
            return to_json(a, precision)

        d: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "kind": "attention",
            "meta": _plain(self.meta),
            "tokens": list(self.tokens),
            "d_k": self.d_k,
            "d_v": self.d_v,
            "num_heads": self.num_heads,
            "is_causal": self.is_causal,
            "mask": list(self.mask_kinds),
            "head": self.head,
            "steps": {name: js(getattr(self, name)) for name in STEPS + ("lse",)},
            "score_mod": None if self.score_mod is None else _plain(self.score_mod),
            "sinks": js(self.sinks),
            "row_sums": js(self.row_sums),
            "sink_share": None if self.sinks is None else js(self.sink_share),
            "top_keys": self.top_keys.tolist(),
            "concat": js(self.concat),
            "projected": js(self.projected),
            "params": {n: js(getattr(self, n)) for n in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v")},
            "heads": [h.to_dict(precision) for h in self.heads],
        }
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trace":
        """Rebuild a trace from :meth:`to_dict` output (after a JSON round trip, too).

        Dicts written before ``schema_version``, ``meta``, the biases, or the score function and
        sinks (schema 1) existed are read as well.
        """
        if not isinstance(d, dict):
            raise TypeError(f"Trace.from_dict needs the dict that Trace.to_dict() returns, got {type(d).__name__}")
        version = d.get("schema_version", SCHEMA_VERSION)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ValueError(
                f"schema_version={version!r} is newer than this qkv reads ({SCHEMA_VERSION}); upgrade qkv"
            )
        if d.get("kind", "attention") != "attention":
            raise ValueError(
                f"kind={d.get('kind')!r}: this is not an attention trace; a block trace is read by "
                "qkv.glass.block"
            )
        steps = {name: from_json(d["steps"].get(name)) for name in STEPS + ("lse",)}
        params = d.get("params") or {}
        mats = {n: from_json(params.get(n)) for n in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v")}
        return cls(
            tokens=list(d["tokens"]),
            d_k=int(d["d_k"]),
            d_v=int(d["d_v"]),
            num_heads=int(d["num_heads"]),
            is_causal=d["is_causal"],
            mask_kinds=tuple(d["mask"]),
            head=d.get("head"),
            heads=[cls.from_dict(h) for h in d.get("heads", [])],
            concat=from_json(d.get("concat")),
            projected=from_json(d.get("projected")),
            meta=dict(d.get("meta") or {}),
            score_mod=None if d.get("score_mod") is None else dict(d["score_mod"]),
            sinks=from_json(d.get("sinks")),
            **steps,  # type: ignore[arg-type]
            **mats,
        )


def trace(
    x: Any,
    w_q: Any,
    w_k: Any,
    w_v: Any,
    *,
    w_o: Any = None,
    b_q: Any = None,
    b_k: Any = None,
    b_v: Any = None,
    num_heads: int = 1,
    is_causal: CausalArg = False,
    attn_mask: Any = None,
    tokens: Optional[Sequence[str]] = None,
    meta: Optional[dict[str, Any]] = None,
    score_mod: Any = None,
    sinks: Any = None,
) -> Trace:
    """Run self-attention on ``x`` in float64 and keep every intermediate step.

    Shapes: ``x (N, d_model)``, ``w_q, w_k (d_model, H·d_k)``, ``w_v (d_model, H·d_v)``,
    ``b_q, b_k (H·d_k,)``, ``b_v (H·d_v,)`` (optional biases: Q = X·W_Q + b_Q, as in a real
    model's linear layers), ``w_o (H·d_v, d_model_out)`` (optional), ``attn_mask (N, N)``
    boolean (True = may attend) or float (added to the scaled scores). NumPy arrays, torch
    tensors or nested lists. ``tokens`` labels the rows (default ``t1 … tN``); ``meta`` records
    where the numbers came from (kept in :attr:`Trace.meta` and the JSON).

    ``score_mod`` is a score function as in :func:`qkv.attention` (a :mod:`qkv.score_mods`
    built-in such as ``Softcap(30)`` or ``ALiBi(alibi_slopes(H))``, or any
    ``fn(score, batch, head, q_idx, kv_idx)``); head h of the trace is head h of the call, so
    per-head slopes and table columns apply per head. ``sinks`` are sink logits, ``(H,)`` or one
    number for every head. Both follow :func:`qkv.reference.attention_ref` exactly.
    """
    x = _matrix(x, "x", "(N, d_model): one row per token")
    n = x.shape[0]
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads={num_heads!r} must be a positive int (1 for single-head attention)")
    num_heads = int(num_heads)
    mats = _weights(x.shape[1], w_q, w_k, w_v, num_heads)
    d_k = mats["w_q"].shape[1] // num_heads
    d_v = mats["w_v"].shape[1] // num_heads
    biases = {
        name: None if given is None else _bias(given, name, w, mats[w].shape[1])
        for name, given, w in (("b_q", b_q, "w_q"), ("b_k", b_k, "w_k"), ("b_v", b_v, "w_v"))
    }
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict such as {{'model': 'all-MiniLM-L6-v2', 'layer': 1}}, got {type(meta).__name__}")
    w_o_arr = None if w_o is None else _out_weight(w_o, num_heads, d_v)
    labels = _tokens(tokens, n, "x")
    allowed, bias, kinds = _masks(n, attn_mask, is_causal)
    fn, info = _score_fn(score_mod, num_heads)
    sink_arr = _sinks(sinks, num_heads)

    q, k, v = _project(x, mats, biases)  # step 1: (N, H·d_k), (N, H·d_k), (N, H·d_v)
    qs = [q[:, h * d_k : (h + 1) * d_k] for h in range(num_heads)]  # head h owns a contiguous block of columns
    ks = [k[:, h * d_k : (h + 1) * d_k] for h in range(num_heads)]
    modified = None if fn is None else _modified(fn, qs, ks)  # (H, N, N): head h sees head index h
    heads = [
        _single_head(
            labels, x, qs[h], ks[h], v[:, h * d_v : (h + 1) * d_v], allowed, bias, kinds, is_causal,
            head=h if num_heads > 1 else None,
            score_info=info,
            modified=None if modified is None else modified[h],
            sinks=None if sink_arr is None else sink_arr[h : h + 1],
        )
        for h in range(num_heads)
    ]
    params = dict(w_q=mats["w_q"], w_k=mats["w_k"], w_v=mats["w_v"], w_o=w_o_arr, **biases)
    if num_heads == 1:
        t = heads[0]
        t.q, t.k, t.v = q, k, v
        t.w_q, t.w_k, t.w_v, t.w_o = params["w_q"], params["w_k"], params["w_v"], w_o_arr
        t.b_q, t.b_k, t.b_v = biases["b_q"], biases["b_k"], biases["b_v"]
        t.meta = dict(meta or {})
        if w_o_arr is not None:
            t.projected = t.output @ w_o_arr  # (N, d_model_out)
        return t
    return _stacked(heads, x, q, k, v, params, is_causal=is_causal, meta=meta, score_info=info, sinks=sink_arr)


# -- private machinery ----------------------------------------------------------------------


def _weights(d_model: int, w_q: Any, w_k: Any, w_v: Any, num_heads: int) -> dict[str, np.ndarray]:
    """W_Q, W_K, W_V as float64 matrices, checked against ``d_model`` and ``num_heads``."""
    mats: dict[str, np.ndarray] = {}
    for name, given, what in (("w_q", w_q, "d_k"), ("w_k", w_k, "d_k"), ("w_v", w_v, "d_v")):
        w = _matrix(given, name, f"(d_model, {what}·num_heads)")
        if w.shape[0] != d_model:
            raise ValueError(
                f"{name} has {w.shape[0]} rows but x has d_model={d_model} columns; "
                f"{name} must be (d_model, {what}·num_heads) so that x·{name} is defined"
            )
        if w.shape[1] % num_heads:
            lo = num_heads * (w.shape[1] // num_heads)
            near = f"{lo} or {lo + num_heads}" if lo else str(num_heads)
            raise ValueError(
                f"{name} has {w.shape[1]} columns, which does not split evenly into "
                f"num_heads={num_heads}; give it {what}·num_heads columns (e.g. {near})"
            )
        mats[name] = w
    if mats["w_k"].shape[1] != mats["w_q"].shape[1]:
        raise ValueError(
            f"w_q has {mats['w_q'].shape[1]} columns but w_k has {mats['w_k'].shape[1]}; queries "
            "and keys meet in a dot product, so both must be (d_model, d_k·num_heads)"
        )
    return mats


def _out_weight(w_o: Any, num_heads: int, d_v: int) -> np.ndarray:
    """W_O (H·d_v, d_model_out) as a float64 matrix, checked against the concatenated heads."""
    w_o_arr = _matrix(w_o, "w_o", "(num_heads·d_v, d_model_out)")
    if w_o_arr.shape[0] != num_heads * d_v:
        raise ValueError(
            f"w_o has {w_o_arr.shape[0]} rows but the concatenated heads have "
            f"num_heads·d_v = {num_heads}·{d_v} = {num_heads * d_v} columns; "
            "w_o must be (num_heads·d_v, d_model_out)"
        )
    return w_o_arr


def _project(
    x: np.ndarray, mats: dict[str, np.ndarray], biases: dict[str, Optional[np.ndarray]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step *project*: Q = X·W_Q (+ b_Q), likewise K and V; (N, H·d_k), (N, H·d_k), (N, H·d_v)."""
    q = x @ mats["w_q"]
    k = x @ mats["w_k"]
    v = x @ mats["w_v"]
    if biases["b_q"] is not None:
        q = q + biases["b_q"]  # (N, H·d_k) + (H·d_k,): the same bias for every token
    if biases["b_k"] is not None:
        k = k + biases["b_k"]
    if biases["b_v"] is not None:
        v = v + biases["b_v"]
    return q, k, v


def _stacked(
    heads: list[Trace],
    x: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    params: dict[str, Optional[np.ndarray]],
    *,
    is_causal: CausalArg,
    meta: Optional[dict[str, Any]],
    score_info: Optional[dict[str, Any]],
    sinks: Optional[np.ndarray],
) -> Trace:
    """The multi-head trace: each step stacked over heads (H, N, ·), heads concatenated (N, H·d_v)
    and, with W_O, projected (N, d_model_out)."""
    concat = np.concatenate([h.output for h in heads], axis=-1)  # (N, H·d_v)
    w_o_arr = params["w_o"]

    def stack(name: str) -> np.ndarray:
        return np.stack([getattr(h, name) for h in heads])  # (H, N, ·)

    first = heads[0]
    return Trace(
        tokens=first.tokens,
        x=x,
        q=q,
        k=k,
        v=v,
        scores=stack("scores"),
        scaled=stack("scaled"),
        modified=None if first.modified is None else stack("modified"),
        score_mod=score_info,
        sinks=sinks,
        masked=None if first.masked is None else stack("masked"),
        weights=stack("weights"),
        output=stack("output"),
        lse=stack("lse"),
        d_k=first.d_k,
        d_v=first.d_v,
        num_heads=len(heads),
        is_causal=is_causal,
        mask_kinds=first.mask_kinds,
        heads=heads,
        concat=concat,
        projected=None if w_o_arr is None else concat @ w_o_arr,  # (N, d_model_out)
        w_q=params["w_q"],
        w_k=params["w_k"],
        w_v=params["w_v"],
        w_o=w_o_arr,
        b_q=params["b_q"],
        b_k=params["b_k"],
        b_v=params["b_v"],
        meta=dict(meta or {}),
    )


def _single_head(
    tokens: list[str],
    x: Optional[np.ndarray],
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    allowed: Optional[np.ndarray],
    bias: Optional[np.ndarray],
    kinds: tuple[str, ...],
    is_causal: CausalArg,
    head: Optional[int] = None,
    *,
    score_info: Optional[dict[str, Any]] = None,
    modified: Optional[np.ndarray] = None,
    sinks: Optional[np.ndarray] = None,
) -> Trace:
    """One head's steps; ``modified`` is the score function's output on this head's scaled
    scores (see :func:`_modified`), ``sinks`` this head's (1,) sink logit."""
    d_k = q.shape[1]
    scores = q @ k.T  # (N, N)
    scaled = scores / np.sqrt(d_k)
    before_mask = scaled if modified is None else modified
    masked = None
    if bias is not None or allowed is not None:
        masked = before_mask if bias is None else before_mask + bias
        if allowed is not None:
            masked = np.where(allowed, masked, -np.inf)
    weights, lse = softmax_rows(before_mask if masked is None else masked)
    if sinks is not None:
        weights, lse = with_sinks(weights, lse, sinks)
    return Trace(
        tokens=tokens,
        x=x,
        q=q,
        k=k,
        v=v,
        scores=scores,
        scaled=scaled,
        masked=masked,
        weights=weights,
        output=weights @ v,  # (N, d_v)
        lse=lse,
        d_k=d_k,
        d_v=v.shape[1],
        is_causal=is_causal,
        mask_kinds=kinds,
        head=head,
        modified=modified,
        score_mod=None if score_info is None else dict(score_info),
        sinks=sinks,
    )


def remasked(t: Trace, is_causal: CausalArg, attn_mask: Any = None) -> Trace:
    """Single-head trace ``t`` under other masks, reusing its scores, its score function's output
    and its sink (for N × N self-attention the score function does not depend on the mask)."""
    allowed, bias, kinds = _masks(t.n, attn_mask, is_causal)
    return _single_head(list(t.tokens), None, t.q, t.k, t.v, allowed, bias, kinds, is_causal, head=t.head,
                        modified=t.modified, score_info=t.score_mod, sinks=t.sinks)


def _score_fn(score_mod: Any, num_heads: int) -> tuple[Any, Optional[dict[str, Any]]]:
    """``score_mod`` checked against the call (a TypeError or ValueError that says what is wrong)
    and described as plain data; torch is imported only when there is one."""
    if score_mod is None:
        return None, None
    try:
        from ..score_mods import ALiBi, RelativeBias, Softcap
        from ..score_mods.base import ScoreMod, check_score_mod
    except ImportError as e:
        raise ImportError(f"score_mod= needs torch, which score functions are written in ({e})") from None
    fn = check_score_mod(score_mod)
    if not isinstance(fn, ScoreMod):
        name = _fn_name(fn)
        return fn, {"kind": "function", "name": name, "text": name}
    fn.check_heads(num_heads)
    kind = ("softcap" if isinstance(fn, Softcap) else "alibi" if isinstance(fn, ALiBi)
            else "relative_bias" if isinstance(fn, RelativeBias) else "score_mod")
    info: dict[str, Any] = {"kind": kind, "name": type(fn).__name__, "text": fn.describe()}
    if fn.softcap is not None:
        info["cap"] = float(fn.softcap)
    if isinstance(fn, ALiBi):
        info["slopes"] = [float(m) for m in fn.slopes.detach().double().cpu().tolist()]
        info["symmetric"] = fn.symmetric
    if isinstance(fn, RelativeBias):
        info.update(buckets=int(fn.table.shape[0]), bidirectional=fn.bidirectional, max_distance=fn.max_distance)
    return fn, info


def _fn_name(fn: Any) -> str:
    """What to call a user's score function: its name, a partial's function, or its class."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "score_mod" if name == "<lambda>" else str(name)


def _modified(fn: Any, qs: Sequence[np.ndarray], ks: Sequence[np.ndarray]) -> np.ndarray:
    """``fn`` on every head's scaled scores at once, ``(H, N, N)``, through the oracle's own
    evaluation: batch 0, query head h, query row i at position i and key j at j (self-attention,
    so every alignment agrees)."""
    scaled = np.stack([q @ k.T / np.sqrt(q.shape[1]) for q, k in zip(qs, ks)])  # as _single_head computes them
    try:
        out = np.array(score_mod64(fn, scaled, "top_left"), dtype=np.float64)  # owned, not a broadcast view
    except RuntimeError as e:  # a result that cannot broadcast to the scores
        raise ValueError(f"score_mod must return one score per (batch, head, query, key) of shape {scaled.shape}: {e}") from None
    if np.isnan(out).any() or np.isposinf(out).any():
        raise ValueError("score_mod returned NaN or +inf; return finite scores, or -inf to hide a key")
    return out


def _sinks(sinks: Any, num_heads: int) -> Optional[np.ndarray]:
    """Sink logits as ``(num_heads,)`` float64 (one number serves every head), or None."""
    if sinks is None:
        return None
    arr = as_float64(sinks, "sinks")
    if arr.ndim == 0:
        arr = np.full(num_heads, float(arr))
    if arr.ndim != 1 or arr.shape[0] != num_heads:
        raise ValueError(
            f"sinks has shape {tuple(arr.shape)} but the trace has {num_heads} head{'s' if num_heads != 1 else ''}; "
            f"give one sink logit per head ({num_heads},) or one number for every head"
        )
    if np.isnan(arr).any() or np.isposinf(arr).any():
        raise ValueError("sinks contains NaN or +inf; a sink is a finite logit (-inf: no sink for that head)")
    return arr.copy()


def _matrix(a: Any, name: str, expected: str) -> np.ndarray:
    arr = as_float64(a, name)
    if arr.ndim != 2:
        hint = f" (for a single row use {name}.reshape(1, -1))" if arr.ndim == 1 else ""
        raise ValueError(f"{name} must be a 2-D matrix {expected}, got shape {tuple(arr.shape)}{hint}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty matrix {expected}, got shape {tuple(arr.shape)}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or infinite values; every entry must be a finite number")
    return arr


def _bias(a: Any, name: str, weight: str, width: int) -> np.ndarray:
    arr = as_float64(a, name)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]  # a (1, width) row is the same bias
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a vector ({width},) added to every row of x·{weight}, got shape {tuple(arr.shape)}")
    if arr.shape[0] != width:
        raise ValueError(
            f"{name} has {arr.shape[0]} entries but {weight} has {width} columns; {name} adds one number "
            f"to each column of x·{weight}, so give it exactly {width}"
        )
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or infinite values; every entry must be a finite number")
    return arr


def _plain(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with NumPy scalars turned into Python ones, so json.dumps accepts it."""
    return {str(k): (v.item() if isinstance(v, np.generic) else v) for k, v in meta.items()}


def _tokens(tokens: Optional[Sequence[str]], n: int, source: str) -> list[str]:
    if tokens is None:
        return [f"t{i + 1}" for i in range(n)]
    if isinstance(tokens, str):
        raise TypeError(f"tokens must be a list of strings, not one string; try tokens={tokens!r}.split()")
    labels = [str(t) for t in tokens]
    if len(labels) != n:
        raise ValueError(
            f"tokens has {len(labels)} entries but {source} has N={n} rows; "
            "pass exactly one label per token"
        )
    return labels


def _masks(
    n: int, attn_mask: Any, is_causal: CausalArg
) -> tuple[Optional[np.ndarray], Optional[np.ndarray], tuple[str, ...]]:
    """Validate the mask arguments and fold them into (allowed, bias, human-readable kinds)."""
    causal, _ = parse_causal(is_causal)  # validates the value early, with its own message
    kinds: list[str] = []
    if causal:
        kinds.append("causal")
    if attn_mask is not None:
        if hasattr(attn_mask, "detach") and hasattr(attn_mask, "cpu"):
            attn_mask = attn_mask.detach().cpu().numpy()
        attn_mask = np.asarray(attn_mask)  # nested lists of bools must stay boolean
        if attn_mask.shape != (n, n):
            raise ValueError(
                f"attn_mask has shape {tuple(attn_mask.shape)} but the scores are (N, N) = ({n}, {n}); "
                "pass one entry per (query, key) pair"
            )
        if attn_mask.dtype == bool:
            kinds.append("bool")
        else:
            attn_mask = as_float64(attn_mask, "attn_mask")
            if np.isnan(attn_mask).any() or (attn_mask == np.inf).any():
                raise ValueError("attn_mask contains NaN or +inf; use -inf to hide a key, finite values to bias it")
            kinds.append("float")
    allowed, bias = combined_mask(n, n, attn_mask=attn_mask, is_causal=is_causal)
    return allowed, bias, tuple(kinds)
