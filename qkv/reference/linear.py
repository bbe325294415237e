"""Linear attention written out with its N × N matrix, in NumPy float64: the oracle of
:func:`qkv.linear_attention` and the glass box of why it is linear.

Softmax attention weighs key j for query i by ``exp(q_i·k_j / √d)``. Linear attention replaces
that kernel by a dot product of feature maps, ``φ(q_i)·φ(k_j)``, so that

    out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / (Σ_j φ(q_i)·φ(k_j) + eps)
          = φ(q_i) (Σ_j φ(k_j) v_jᵀ) / (φ(q_i)·Σ_j φ(k_j) + eps)

and the bracket (a ``(F, Dv)`` state) is shared by every query: O(N) instead of O(N²).

Feature maps (F features from head dim D)::

    "elu"    φ(x) = elu(x) + 1                        F = D   (Katharopoulos et al., 2020)
    "relu"   φ(x) = max(x, 0)                         F = D
    "favor"  φ(x) = exp(W x̃ - |x̃|²/2) / √m, x̃ = x·s^½  F = m   (Performer's FAVOR+: positive
             random features with E[φ(q)·φ(k)] = exp(s·q·k), W (m, D) orthogonal random rows)

Shapes: ``q (..., Nq, D)``, ``k (..., Nk, D)``, ``v (..., Nk, Dv)`` → ``(..., Nq, Dv)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np

from ..locale import LANGUAGES, messages
from .attention import as_float64

__all__ = ["FEATURE_MAPS", "favor_projection", "feature_map_ref", "linear_attention_ref", "LinearSteps", "linear_steps"]

FEATURE_MAPS = ("elu", "relu", "favor")


def favor_projection(d: int, m: int, seed: int = 0) -> np.ndarray:
    """FAVOR+'s random projection ``W (m, d)``: blocks of ``d`` orthogonal rows (QR of a Gaussian
    matrix), each row rescaled to the length of a Gaussian vector, so ``E[w wᵀ] = I`` as for
    plain Gaussian rows but with lower variance. Deterministic in ``seed``."""
    if d < 1 or m < 1:
        raise ValueError(f"favor_projection needs d >= 1 and m >= 1, got d={d}, m={m}")
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(-(-m // d)):
        qmat, _ = np.linalg.qr(rng.standard_normal((d, d)))
        blocks.append(qmat.T)  # rows orthonormal
    w = np.concatenate(blocks)[:m]
    norms = np.linalg.norm(rng.standard_normal((m, d)), axis=1)
    return w * norms[:, None]


def feature_map_ref(
    x: Any, feature_map: Union[str, Callable[[np.ndarray], np.ndarray]] = "elu",
    projection: Optional[np.ndarray] = None, scale: Optional[float] = None,
) -> np.ndarray:
    """φ(x) for rows ``x (..., N, D)`` → ``(..., N, F)`` (see the module docstring).

    ``favor`` needs ``projection (m, D)`` (:func:`favor_projection`); ``scale`` defaults to 1/√D,
    so that φ(q)·φ(k) estimates softmax attention's ``exp(q·k/√D)``."""
    x = as_float64(x, "x")
    if callable(feature_map):
        return as_float64(feature_map(x), "feature_map(x)")
    if feature_map == "elu":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if feature_map == "relu":
        return np.maximum(x, 0.0)
    if feature_map == "favor":
        if projection is None:
            raise ValueError("feature_map='favor' needs projection=favor_projection(d, m, seed)")
        d = x.shape[-1]
        xs = x * np.sqrt(1.0 / np.sqrt(d) if scale is None else scale)  # x̃: q̃·k̃ = scale · q·k
        m = projection.shape[0]
        return np.exp(xs @ projection.T - 0.5 * (xs**2).sum(-1, keepdims=True)) / np.sqrt(m)
    raise ValueError(f"feature_map={feature_map!r} is unknown; use one of {FEATURE_MAPS} or a callable")


_TEXT: dict[str, dict[str, str]] = {lang: messages(lang, "linear.") for lang in LANGUAGES}
"""This module's words in each language, from the catalogue (``qkv/locale/<lang>.json``, keys ``linear.*``)."""


@dataclass
class LinearSteps:
    """Every step of linear attention for one head (float64): the N × N form and the linear form
    side by side. ``kernel`` ``(Nq, Nk)`` = φ(Q)φ(K)ᵀ (masked), ``state`` ``(F, Dv)`` = φ(K)ᵀV,
    ``normaliser`` ``(F,)`` = Σ_j φ(k_j) (non-causal; causal rows each have their own prefix)."""

    phi_q: np.ndarray
    phi_k: np.ndarray
    kernel: np.ndarray
    numerator: np.ndarray
    denominator: np.ndarray
    output: np.ndarray
    state: np.ndarray
    normaliser: np.ndarray
    q: Optional[np.ndarray] = None
    k: Optional[np.ndarray] = None
    v: Optional[np.ndarray] = None
    feature_map: str = "elu"
    is_causal: bool = False

    @property
    def weights(self) -> np.ndarray:
        """The weights linear attention implies: each kernel row over its sum (+ eps ignored)."""
        s = self.kernel.sum(-1, keepdims=True)
        return np.divide(self.kernel, s, out=np.zeros_like(self.kernel), where=s > 0)

    def softmax_weights(self) -> Optional[np.ndarray]:
        """Softmax attention's weights on the same q, k (scale 1/√D, same mask), to compare."""
        if self.q is None or self.k is None:
            return None
        s = self.q @ np.swapaxes(self.k, -1, -2) / np.sqrt(self.q.shape[-1])
        if self.is_causal:
            s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        return w / w.sum(-1, keepdims=True)

    def to_string(self, precision: int = 3, lang: str = "en", tokens: Optional[list[str]] = None) -> str:
        """Every step as labelled matrices (single head, 2-D inputs), softmax's weights beside."""
        # the glass box's text renderer, a layer up: imported when asked, since qkv.linear loads
        # this module for its feature maps and must not pull in the renderers
        from ..glass.render import format_matrix, summary_note

        if lang not in _TEXT:
            raise ValueError(f"lang={lang!r} is not available; use 'en' or 'zh'")
        if self.phi_q.ndim != 2:
            raise ValueError("to_string shows one head: build the steps from 2-D q, k, v (N, D)")
        tx = _TEXT[lang]
        n, f = self.phi_q.shape
        dv = self.state.shape[-1]
        rows = tokens or [f"t{i}" for i in range(n)]
        keys = tokens or [f"t{j}" for j in range(self.phi_k.shape[0])]
        fcols = [f"f{i}" for i in range(f)]
        fm = self.feature_map if isinstance(self.feature_map, str) else "custom"
        out = [tx["title"].format(fm=fm, n=n, f=f, mask=tx["causal" if self.is_causal else "full"]), ""]

        def block(title: str, a: np.ndarray, r: list[str], c: list[str], features: bool = False) -> None:
            a = np.atleast_2d(a)
            note = summary_note(a.shape, features, lang)  # wide feature matrices: first/last columns and ‖row‖
            out.extend([title, *format_matrix(a, r, c, precision, features=features), *([f"  {note}"] if note else []), ""])

        block(tx["phi_q"].format(f=f), self.phi_q, rows, fcols, True)
        block(tx["phi_k"].format(f=f), self.phi_k, keys, fcols, True)
        block(tx["state"].format(f=f, dv=dv), self.state, fcols, [f"v{i}" for i in range(dv)], True)
        block(tx["norm"].format(f=f), self.normaliser[None], ["z"], fcols, True)
        if self.is_causal:
            out.extend([tx["causal_state"], ""])
        block(tx["out"], self.output, rows, [f"o{i}" for i in range(dv)], True)
        block(tx["kernel"], self.kernel, rows, keys)
        block(tx["weights"], self.weights, rows, keys)
        soft = self.softmax_weights()
        if soft is not None:
            block(tx["softmax"], soft, rows, keys)
        out.append(tx["cost"])
        return "\n".join(out)


def linear_steps(
    q: Any, k: Any, v: Any, feature_map: Union[str, Callable[[np.ndarray], np.ndarray]] = "elu", *,
    is_causal: bool = False, eps: float = 1e-6, projection: Optional[np.ndarray] = None,
    scale: Optional[float] = None, key_padding_mask: Any = None,
) -> LinearSteps:
    """Linear attention through the explicit ``(Nq, Nk)`` kernel matrix; see :class:`LinearSteps`."""
    q, k, v = as_float64(q, "q"), as_float64(k, "k"), as_float64(v, "v")
    fq = feature_map_ref(q, feature_map, projection, scale)  # (..., Nq, F)
    fk = feature_map_ref(k, feature_map, projection, scale)  # (..., Nk, F)
    if key_padding_mask is not None:
        fk = fk * np.asarray(key_padding_mask, dtype=bool)[..., :, None]  # padded keys weigh nothing
    kern = fq @ np.swapaxes(fk, -1, -2)  # (..., Nq, Nk)
    if is_causal:
        nq, nk = kern.shape[-2:]
        kern = kern * np.tril(np.ones((nq, nk)))
    num = kern @ v  # (..., Nq, Dv)
    den = kern.sum(-1)  # (..., Nq)
    return LinearSteps(fq, fk, kern, num, den, num / (den[..., None] + eps), np.swapaxes(fk, -1, -2) @ v, fk.sum(-2),
                       q, k, v, feature_map if isinstance(feature_map, str) else "custom", bool(is_causal))


def linear_attention_ref(q: Any, k: Any, v: Any, feature_map: Union[str, Callable[[np.ndarray], np.ndarray]] = "elu",
                         **kw: Any) -> np.ndarray:
    """The output of :func:`linear_steps` (keywords as there)."""
    return linear_steps(q, k, v, feature_map, **kw).output
