"""The glass box, widened: one whole encoder block of the original Transformer, step by step.

A post-LN encoder block ("Attention Is All You Need", §3.1), every intermediate kept::

    embeddings (N, d_model)   one row per token
    positional (N, d_model)   the sinusoid table PE (zeros with positional=False)
    x          (N, d_model)   embeddings + positional
    attention  Trace          multi-head self-attention of x with W_O; attention.projected (N, d_model)
    residual1  (N, d_model)   x + attention.projected
    norm1      (N, d_model)   LayerNorm(residual1) = γ₁·(residual1 − mean1)/std1 + β₁
    ffn_hidden (N, d_ff)      norm1·W1 + b1
    ffn_relu   (N, d_ff)      max(0, ffn_hidden)
    ffn_out    (N, d_model)   ffn_relu·W2 + b2
    residual2  (N, d_model)   norm1 + ffn_out
    output     (N, d_model)   LayerNorm(residual2) with γ₂, β₂, mean2, std2

``mean1, std1, mean2, std2`` are ``(N,)``: each row's mean and the divisor LayerNorm uses,
``std = √(var + eps)`` with the biased (1/d_model) variance, as ``torch.nn.LayerNorm`` does.
Weights follow the row-vector convention of the rest of the glass box: ``W1 (d_model, d_ff)``,
``W2 (d_ff, d_model)``, so a token's row is multiplied on the right.
"""

from __future__ import annotations

import html as _html
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..locale import LANGUAGES, check_lang, messages, text
from ..reference.attention import as_float64
from ..masks.rules import CausalArg
from .render import STYLE, Block, fmt, format_matrix, html_table, notebook_frame, short, vec
from .toy import toy_embeddings, toy_weights
from .serial import from_json, to_json
from .trace import Trace, trace

__all__ = ["BlockTrace", "trace_block", "toy_block_trace", "sinusoidal_positions", "layer_norm", "BLOCK_STEPS"]

BLOCK_STEPS: tuple[str, ...] = (
    "embeddings", "positional", "x", "residual1", "norm1", "ffn_hidden", "ffn_relu", "ffn_out", "residual2", "output",
)
"""Names of the block's own steps in the order they happen (the attention step sits after ``x``)."""

_PARAMS: tuple[str, ...] = ("w1", "b1", "w2", "b2", "gamma1", "beta1", "gamma2", "beta2")


def sinusoidal_positions(n: int, d_model: int, base: float = 10000.0) -> np.ndarray:
    """The ``(n, d_model)`` sinusoid table: even columns ``sin(p / base^(2i/d))``, odd columns ``cos``.

    The same table as :func:`qkv.nn.positional.sinusoidal_table`, in float64 without torch.
    """
    if n < 0 or d_model <= 0:
        raise ValueError(f"sinusoidal_positions needs n >= 0 and d_model > 0, got n={n}, d_model={d_model}")
    pos = np.arange(n, dtype=np.float64)[:, None]  # (n, 1)
    inv_freq = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * (-np.log(base) / d_model))  # (ceil(d/2),)
    angle = pos * inv_freq  # (n, ceil(d/2))
    table = np.empty((n, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angle)
    table[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return table


def layer_norm(a: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-wise LayerNorm of ``a (N, d)``: returns ``(γ·(a − mean)/std + β, mean (N,), std (N,))``."""
    mean = a.mean(axis=-1)  # (N,)
    std = np.sqrt(((a - mean[:, None]) ** 2).mean(axis=-1) + eps)  # (N,): biased variance, as torch
    return gamma * (a - mean[:, None]) / std[:, None] + beta, mean, std


@dataclass(eq=False)
class BlockTrace:
    """Every step of one post-LN Transformer encoder block, as float64 NumPy arrays.

    Build one with :func:`trace_block` or :func:`toy_block_trace`; the module docstring gives
    the shape of every field. ``attention`` is the full :class:`~qkv.glass.trace.Trace` of
    the multi-head self-attention inside the block (with its heads and W_O).
    """

    tokens: list[str]
    embeddings: np.ndarray
    positional: np.ndarray
    x: np.ndarray
    attention: Trace
    residual1: np.ndarray
    norm1: np.ndarray
    mean1: np.ndarray
    std1: np.ndarray
    ffn_hidden: np.ndarray
    ffn_relu: np.ndarray
    ffn_out: np.ndarray
    residual2: np.ndarray
    output: np.ndarray
    mean2: np.ndarray
    std2: np.ndarray
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray
    gamma1: np.ndarray
    beta1: np.ndarray
    gamma2: np.ndarray
    beta2: np.ndarray
    eps: float = 1e-5
    num_heads: int = 1

    # -- derived facts ------------------------------------------------------------------

    @property
    def n(self) -> int:
        """Number of tokens N."""
        return len(self.tokens)

    @property
    def d_model(self) -> int:
        return int(self.x.shape[1])

    @property
    def d_ff(self) -> int:
        return int(self.w1.shape[1])

    @property
    def normalized1(self) -> np.ndarray:
        """``(residual1 − mean1)/std1`` before γ₁, β₁: each row has mean 0 and std ≈ 1. (N, d_model)."""
        return (self.residual1 - self.mean1[:, None]) / self.std1[:, None]

    @property
    def normalized2(self) -> np.ndarray:
        """``(residual2 − mean2)/std2`` before γ₂, β₂. (N, d_model)."""
        return (self.residual2 - self.mean2[:, None]) / self.std2[:, None]

    @property
    def relu_off(self) -> np.ndarray:
        """How many of the d_ff hidden units ReLU set to zero, per token. (N,) int."""
        return (self.ffn_hidden <= 0).sum(axis=-1)

    def step(self, name: str) -> np.ndarray:
        """The array of block step ``name`` (one of :data:`BLOCK_STEPS`, or ``"attention"`` for its result)."""
        if name == "attention":
            return self.attention.result
        if name not in BLOCK_STEPS:
            raise KeyError(f"unknown step {name!r}; the steps are {', '.join(BLOCK_STEPS)}, attention")
        return getattr(self, name)

    # -- presentation -------------------------------------------------------------------

    def __repr__(self) -> str:
        def shape(a: np.ndarray) -> str:
            return "×".join(str(s) for s in a.shape)

        parts = ", ".join(f"{s}={shape(getattr(self, s))}" for s in BLOCK_STEPS)
        return (
            f"BlockTrace(tokens={self.tokens!r}, d_model={self.d_model}, d_ff={self.d_ff}, "
            f"num_heads={self.num_heads}, eps={self.eps:g}; {parts}, "
            f"attention.projected={shape(self.attention.result)})"
        )

    def blocks(self, precision: int = 3, lang: str = "en") -> list[Block]:
        """The block's own matrices in computation order (the attention part is one heading)."""
        tx = _text(lang)
        toks = list(self.tokens)
        dims = [str(i) for i in range(self.d_model)]
        ff = [str(i) for i in range(self.d_ff)]
        def stats(mean: np.ndarray, std: np.ndarray) -> str:
            return tx["sep"].join(f"{t} μ={fmt(m, precision)} σ={fmt(s, precision)}" for t, m, s in zip(toks, mean, std))

        relu = tx["sep"].join(f"{t} {int(k)}/{self.d_ff}" for t, k in zip(toks, self.relu_off))
        return [
            Block("embeddings", "E", tx["embeddings"], self.embeddings, toks, dims),
            Block("positional", "PE[p, 2i] = sin(p/10000^(2i/d)), PE[p, 2i+1] = cos(…)", tx["positional"],
                  self.positional, toks, dims),
            Block("x", "X = E + PE", tx["x"], self.x, toks, dims),
            Block("attention", "MultiHead(X) = concat(head₀ … head_{H−1})·W_O",
                  tx["attention"].format(h=self.num_heads), self.attention.result, toks, dims),
            Block("residual1", "residual1 = X + MultiHead(X)", tx["residual"], self.residual1, toks, dims),
            Block("norm1", "norm1 = γ₁·(residual1 − μ)/σ + β₁", tx["norm"], self.norm1, toks, dims,
                  footer=stats(self.mean1, self.std1)),
            Block("ffn_hidden", "hidden = norm1·W1 + b1", tx["hidden"], self.ffn_hidden, toks, ff),
            Block("ffn_relu", "relu = max(0, hidden)", tx["relu"], self.ffn_relu, toks, ff,
                  footer=tx["relu_off"].format(parts=relu)),
            Block("ffn_out", "ffn = relu·W2 + b2", tx["ffn"], self.ffn_out, toks, dims),
            Block("residual2", "residual2 = norm1 + ffn", tx["residual"], self.residual2, toks, dims),
            Block("output", "output = γ₂·(residual2 − μ)/σ + β₂", tx["output"], self.output, toks, dims,
                  footer=stats(self.mean2, self.std2)),
        ]

    def to_string(self, precision: int = 3, steps: Optional[Sequence[str]] = None, lang: str = "en") -> str:
        """Every step as a labelled, aligned matrix with its formula, for a terminal.

        ``steps`` limits the output to some of :data:`BLOCK_STEPS` plus ``"attention"`` (which
        prints the attention trace in full, every head); ``lang`` is "en" or "zh".
        """
        if isinstance(precision, bool) or not isinstance(precision, (int, np.integer)) or not 0 <= precision <= 15:
            raise ValueError(f"precision={precision!r} must be an int from 0 to 15 (digits after the point)")
        tx = _text(lang)
        if steps is not None:
            unknown = [s for s in steps if s not in BLOCK_STEPS + ("attention",)]
            if unknown:
                raise ValueError(f"steps has unknown names {unknown}; choose from {', '.join(BLOCK_STEPS)}, attention")
        lines = [tx["header"].format(n=self.n, d=self.d_model, h=self.num_heads, f=self.d_ff, eps=f"{self.eps:g}"),
                 tx["tokens"] + tx["sep"].join(self.tokens)]
        for b in self.blocks(precision, lang):
            if steps is not None and b.step not in steps:
                continue
            if b.step == "attention":
                lines += ["", f"--- {tx['attn_part']} ---"]
                lines += ["  " + s for s in self.attention.to_string(precision=precision, lang=lang).splitlines()]
                lines += [f"--- {tx['attn_end']} ---"]
            shape = "×".join(str(s) for s in b.array.shape)
            lines += ["", f"{b.title}   ({shape})   {b.note}"]
            lines += format_matrix(b.array, b.rows, b.cols, precision)
            if b.footer:
                lines.append("  " + b.footer)
        return "\n".join(lines)

    def explain(self, lang: str = "en", token: Union[int, str] = 0, precision: int = 3) -> str:
        """One token's way through the whole block, in English (``"en"``) or Chinese (``"zh"``),
        quoting this trace's numbers. ``token`` is a 0-based index or a token label."""
        _text(lang)
        i = _resolve(self.tokens, token)
        return _explain(self, i, precision, lang)

    def _repr_html_(self) -> str:
        """In a notebook: the interactive stepper page in a sandboxed iframe (see
        :meth:`Trace._repr_html_`); :meth:`to_html` gives the static tables."""
        return notebook_frame(self)

    def to_html(self, precision: int = 3, lang: str = "en") -> str:
        """Self-contained HTML tables of every step (no scripts, no external resources)."""
        tx = _text(lang)
        head = tx["header"].format(n=self.n, d=self.d_model, h=self.num_heads, f=self.d_ff, eps=f"{self.eps:g}")
        out = ['<div class="qkv-trace">', STYLE, f"<p><strong>{_html.escape(head)}</strong></p>"]
        for b in self.blocks(precision, lang):
            if b.step == "attention":
                out.append(f"<details><summary>{_html.escape(tx['attn_part'])}</summary>"
                           f"{self.attention.to_html(precision=precision, lang=lang)}</details>")
            out.append(html_table(b, precision))
        out.append("</div>")
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and floats, ready for ``json.dumps(..., allow_nan=False)``."""
        return {
            "schema_version": 1,
            "kind": "block",
            "tokens": list(self.tokens),
            "d_model": self.d_model,
            "d_ff": self.d_ff,
            "num_heads": self.num_heads,
            "eps": float(self.eps),
            "steps": {name: to_json(getattr(self, name)) for name in BLOCK_STEPS},
            "stats": {name: to_json(getattr(self, name)) for name in ("mean1", "std1", "mean2", "std2")},
            "params": {name: to_json(getattr(self, name)) for name in _PARAMS},
            "attention": self.attention.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BlockTrace":
        """Rebuild a block trace from :meth:`to_dict` output (after a JSON round trip, too)."""
        if d.get("kind", "block") != "block":
            raise ValueError(f"this dict is a {d.get('kind')!r} trace, not a block; use Trace.from_dict for it")
        arrays = {name: from_json(d["steps"][name]) for name in BLOCK_STEPS}
        arrays.update({name: from_json(d["stats"][name]) for name in ("mean1", "std1", "mean2", "std2")})
        arrays.update({name: from_json(d["params"][name]) for name in _PARAMS})
        return cls(tokens=list(d["tokens"]), attention=Trace.from_dict(d["attention"]), eps=float(d["eps"]),
                   num_heads=int(d["num_heads"]), **arrays)  # type: ignore[arg-type]


# -- construction ---------------------------------------------------------------------------


def _matrix(a: Any, name: str, shape: tuple[Optional[int], ...], legend: str) -> np.ndarray:
    arr = as_float64(a, name)
    if arr.ndim != len(shape) or any(want is not None and got != want for got, want in zip(arr.shape, shape)):
        want = "(" + ", ".join("?" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name} must have shape {legend} = {want}, got {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty; expected shape {legend}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or infinite values; every entry must be a finite number")
    return arr


def trace_block(
    x_embeddings: Any,
    *,
    w_q: Any,
    w_k: Any,
    w_v: Any,
    w_o: Any,
    num_heads: int,
    w1: Any,
    b1: Any,
    w2: Any,
    b2: Any,
    gamma1: Any,
    beta1: Any,
    gamma2: Any,
    beta2: Any,
    eps: float = 1e-5,
    is_causal: CausalArg = False,
    tokens: Optional[Sequence[str]] = None,
    positional: bool = True,
) -> BlockTrace:
    """Run one post-LN encoder block on ``x_embeddings (N, d_model)`` in float64, keeping every step.

    Shapes: ``w_q, w_k (d_model, H·d_k)``, ``w_v (d_model, H·d_v)``, ``w_o (H·d_v, d_model)``,
    ``w1 (d_model, d_ff)``, ``b1 (d_ff,)``, ``w2 (d_ff, d_model)``, ``b2, gamma1, beta1, gamma2,
    beta2 (d_model,)``. ``positional=True`` adds the sinusoid table to the embeddings first;
    pass False when they already carry positions. ``is_causal`` masks later tokens in attention.
    """
    emb = _matrix(x_embeddings, "x_embeddings", (None, None), "(N, d_model)")
    n, d = emb.shape
    if w_o is None:
        raise ValueError("w_o is required: the block adds the attention result back onto X, so W_O must map "
                         "the concatenated heads to d_model columns (shape (num_heads·d_v, d_model))")
    w1_a = _matrix(w1, "w1", (d, None), "(d_model, d_ff)")
    d_ff = w1_a.shape[1]
    b1_a = _matrix(b1, "b1", (d_ff,), "(d_ff,)")
    w2_a = _matrix(w2, "w2", (d_ff, d), "(d_ff, d_model)")
    vecs = {name: _matrix(v, name, (d,), "(d_model,)") for name, v in
            (("b2", b2), ("gamma1", gamma1), ("beta1", beta1), ("gamma2", gamma2), ("beta2", beta2))}
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating)) or not eps > 0:
        raise ValueError(f"eps={eps!r} must be a positive number (LayerNorm divides by √(var + eps))")
    if not isinstance(positional, (bool, np.bool_)):
        raise TypeError(f"positional must be True or False, got {positional!r}")

    pe = sinusoidal_positions(n, d) if positional else np.zeros((n, d))  # (N, d_model)
    x = emb + pe  # (N, d_model)
    att = trace(x, w_q, w_k, w_v, w_o=w_o, num_heads=num_heads, is_causal=is_causal, tokens=tokens)
    if att.result.shape[1] != d:
        raise ValueError(f"w_o has {att.result.shape[1]} columns but the residual needs d_model={d}; "
                         "w_o must be (num_heads·d_v, d_model)")
    residual1 = x + att.result  # (N, d_model)
    norm1, mean1, std1 = layer_norm(residual1, vecs["gamma1"], vecs["beta1"], float(eps))
    hidden = norm1 @ w1_a + b1_a  # (N, d_ff)
    relu = np.maximum(hidden, 0.0)
    ffn_out = relu @ w2_a + vecs["b2"]  # (N, d_model)
    residual2 = norm1 + ffn_out
    out, mean2, std2 = layer_norm(residual2, vecs["gamma2"], vecs["beta2"], float(eps))
    return BlockTrace(
        tokens=list(att.tokens), embeddings=emb, positional=pe, x=x, attention=att,
        residual1=residual1, norm1=norm1, mean1=mean1, std1=std1,
        ffn_hidden=hidden, ffn_relu=relu, ffn_out=ffn_out, residual2=residual2,
        output=out, mean2=mean2, std2=std2,
        w1=w1_a, b1=b1_a, w2=w2_a, b2=vecs["b2"], gamma1=vecs["gamma1"], beta1=vecs["beta1"],
        gamma2=vecs["gamma2"], beta2=vecs["beta2"], eps=float(eps), num_heads=att.num_heads,
    )


def toy_block_trace(
    tokens: Union[str, Sequence[str]],
    *,
    d_model: int = 4,
    d_k: int = 3,
    heads: int = 2,
    d_ff: int = 8,
    causal: bool = False,
    seed: int = 0,
) -> BlockTrace:
    """A whole encoder block on small seeded one-decimal numbers a learner can follow by hand.

    ``tokens`` is a list of words or a sentence (split on whitespace). Embeddings depend on
    ``(seed, word)`` only; every weight comes from ``seed``. γ and β are near 1 and 0 but not
    exactly, so their effect shows in the numbers.
    """
    if isinstance(tokens, str):
        tokens = tokens.split()
    tokens = [str(t) for t in tokens]
    if not tokens:
        raise ValueError('tokens is empty; pass some words, e.g. toy_block_trace("Thinking Machines")')
    for name, v in (("d_model", d_model), ("d_k", d_k), ("heads", heads), ("d_ff", d_ff)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")
    emb = toy_embeddings(tokens, d_model, seed)  # (N, d_model)
    rng = np.random.default_rng([seed, 7])  # its own stream: the attention weights differ from sentence_trace's
    width = heads * d_k
    w_q, w_k, w_v = (toy_weights(rng, d_model, width) for _ in range(3))
    w_o = toy_weights(rng, width, d_model)
    w1 = toy_weights(rng, d_model, d_ff)
    b1 = toy_weights(rng, 1, d_ff)[0] / 2
    w2 = toy_weights(rng, d_ff, d_model)
    b2 = toy_weights(rng, 1, d_model)[0] / 2
    def near(center: float) -> np.ndarray:
        return (center + rng.normal(scale=0.15, size=d_model)).round(1)

    return trace_block(emb, w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o, num_heads=heads, w1=w1, b1=b1.round(2), w2=w2,
                       b2=b2.round(2), gamma1=near(1.0), beta1=near(0.0), gamma2=near(1.0), beta2=near(0.0),
                       is_causal=causal, tokens=tokens)


# -- words ----------------------------------------------------------------------------------

_TEXT: dict[str, dict[str, str]] = {lang: messages(lang, "block.") for lang in LANGUAGES}
"""This module's words in each language, from the catalogue (``qkv/locale/<lang>.json``, keys ``block.*``)."""


def _text(lang: str) -> dict[str, str]:
    return _TEXT[check_lang(lang)]


def _resolve(tokens: Sequence[str], token: Union[int, str]) -> int:
    n = len(tokens)
    if isinstance(token, str):
        if token not in tokens:
            raise ValueError(f"token={token!r} is not one of this trace's tokens {list(tokens)}")
        return list(tokens).index(token)
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not -n <= token < n:
        raise ValueError(f"token={token!r} must be a token label or an index from {-n} to {n - 1}")
    return int(token) % n


def _heads(b: BlockTrace) -> list[Trace]:
    return [b.attention] if b.attention.num_heads == 1 else list(b.attention.heads)


def _explain(b: BlockTrace, i: int, p: int, lang: str) -> str:
    """Token ``i``'s way through the block in ``lang``, numbers to ``p`` decimals."""
    def say(key: str, **values: object) -> str:
        return text("block.explain." + key, lang, **values)

    def n(v: float) -> str:
        return short(float(v), p)

    def v(a: np.ndarray) -> str:
        return vec(a, p)

    me = say("quote", tok=b.tokens[i])
    off = int(b.relu_off[i])
    lines = [say("title", me=me, i=i, n=b.n), ""]
    if np.any(b.positional):
        lines.append(say("position", me=me, e=v(b.embeddings[i]), i=i, pe=v(b.positional[i]), x=v(b.x[i])))
    else:
        lines.append(say("embedding", me=me, x=v(b.x[i])))
    parts = []
    for h, t in enumerate(_heads(b)):
        j = int(t.top_keys[i])
        label = say("head", h=h) if b.num_heads > 1 else say("single_head")
        if j < 0:
            parts.append(say("sees_none", label=label))
        else:
            who = say("itself") if j == i else say("quote", tok=b.tokens[j])
            parts.append(say("looks", label=label, who=who, w=n(t.weights[i, j])))
    lines.append(say("attention", me=me, parts=say("part_sep").join(parts), out=v(b.attention.result[i])))
    lines.append(say("residual", r=v(b.residual1[i])))
    lines.append(say("norm", d=b.d_model, mean=n(b.mean1[i]), std=n(b.std1[i]), z=v(b.normalized1[i]), y=v(b.norm1[i])))
    lines.append(say("ffn", f=b.d_ff, hidden=v(b.ffn_hidden[i]), off=off, s="" if off == 1 else "s", on=b.d_ff - off,
                     out=v(b.ffn_out[i])))
    lines.append(say("again", r=v(b.residual2[i]), mean=n(b.mean2[i]), std=n(b.std2[i]), me=me, y=v(b.output[i])))
    lines += ["", say("closing")]
    return "\n".join(lines)
