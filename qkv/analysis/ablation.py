"""What knocking out heads does to a model's result: the analysis behind ``qkv explain --ablate``.

:func:`ablation_effect` runs the model twice on the same tokens, once as it is and once inside
:func:`qkv.inspect.ablate`, and compares the final hidden states token by token (cosine
distance), the sentence embedding (the mean of the final states, what all-MiniLM-L6-v2 returns),
and, for language models, the next-token distribution at the focus position (KL divergence and
the log-probability of the clean run's favourite). Both runs take the same code path, so every
difference comes from the ablated heads.

Shapes: ``N`` tokens, ``E`` hidden size, ``V`` vocabulary. Final states ``(N, E)``; logits ``(N, V)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import numpy as np

from ..locale import check_lang, text

__all__ = ["Ablation", "ablation_effect", "parse_head", "check_heads", "final_states", "edited_module"]


def parse_head(spec: str) -> tuple[int, int]:
    """``"1.3"`` (layer 1, head 3, both from 0) → ``(1, 3)``; anything else raises ValueError."""
    parts = spec.strip().replace(":", ".").split(".")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{spec!r} is not a head; write LAYER.HEAD counted from 0, e.g. 1.3")
    return int(parts[0]), int(parts[1])


def check_heads(heads: Sequence[tuple[int, int]], layers: int, num_heads: int) -> list[tuple[int, int]]:
    """The heads as a sorted list of unique ``(layer, head)``; one out of range raises ValueError."""
    out = []
    for ref in heads:
        if not (isinstance(ref, (tuple, list)) and len(ref) == 2
                and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in ref)):
            raise TypeError(f"ablate takes (layer, head) pairs of ints, got {ref!r}")
        layer, head = int(ref[0]), int(ref[1])
        if not (0 <= layer < layers and 0 <= head < num_heads):
            raise ValueError(f"ablate head {layer}.{head} is out of range: the model has layers 0 to {layers - 1} "
                             f"and heads 0 to {num_heads - 1} (--ablate LAYER.HEAD, e.g. --ablate {layers - 1}.0)")
        out.append((layer, head))
    if not out:
        raise ValueError("ablate got no heads; pass (layer, head) pairs, e.g. --ablate 1.3")
    return sorted(set(out))


def _cosine_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """1 − cos over the last axis, float64 (0 for two zero vectors)."""
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    dot = (a * b).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where((na > 0) & (nb > 0), dot / (na * nb), 1.0)
    return 1.0 - np.clip(cos, -1.0, 1.0)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@dataclass
class Ablation:
    """The effect of ablating ``heads`` on one input.

    ``token_distance (N,)``: cosine distance between each token's final state with and without
    the heads. ``embedding_distance``: the same for the mean of the final states. For a
    language model, ``next_token`` holds the next-token prediction at the focus position:
    ``kl`` (nats, clean ‖ ablated), ``clean_top`` / ``ablated_top`` (token, log-probability)
    lists, and ``delta_logprob`` of the clean run's top token (ablated − clean).
    """

    heads: list[tuple[int, int]]
    mode: str
    focus_index: int
    tokens: list[str]
    token_distance: np.ndarray  # (N,)
    embedding_distance: float
    next_token: Optional[dict[str, Any]] = None

    @property
    def focus_distance(self) -> float:
        return float(self.token_distance[self.focus_index])

    def others(self) -> tuple[float, float, int]:
        """Mean and max cosine distance over the other tokens, and the index of the max (−1 if none)."""
        rest = [i for i in range(len(self.token_distance)) if i != self.focus_index]
        if not rest:
            return 0.0, 0.0, -1
        d = self.token_distance[rest]
        return float(d.mean()), float(d.max()), rest[int(np.argmax(d))]

    @property
    def head_names(self) -> str:
        return ", ".join(f"L{layer} H{head}" for layer, head in self.heads)

    def to_dict(self, decimals: int = 6) -> dict[str, Any]:
        mean, mx, at = self.others()
        d: dict[str, Any] = {
            "heads": [{"layer": layer, "head": head} for layer, head in self.heads],
            "mode": self.mode,
            "focus_distance": round(self.focus_distance, decimals),
            "others_mean_distance": round(mean, decimals),
            "others_max_distance": round(mx, decimals),
            "others_max_index": at,
            "embedding_distance": round(self.embedding_distance, decimals),
            "token_distance": np.round(self.token_distance, decimals).tolist(),
        }
        if self.next_token is not None:
            nt = self.next_token
            d["next_token"] = {
                "position": nt["position"], "kl": round(nt["kl"], decimals),
                "delta_logprob": round(nt["delta_logprob"], decimals),
                "clean_top": [{"token": t, "logprob": round(p, decimals)} for t, p in nt["clean_top"]],
                "ablated_top": [{"token": t, "logprob": round(p, decimals)} for t, p in nt["ablated_top"]],
            }
        return d

    def to_lines(self, lang: str = "en") -> list[str]:
        """The report's section for the terminal, in ``lang`` (the catalogue's ``ablation.*`` messages)."""
        check_lang(lang)
        f = self.tokens[self.focus_index]
        mean, mx, at = self.others()
        mode = text(f"ablation.mode.{self.mode}", lang)
        out = [text("ablation.title", lang, heads=self.head_names, mode=mode),
               text("ablation.focus", lang, tok=f, d=self.focus_distance)]
        if at >= 0:
            out.append(text("ablation.others", lang, mean=mean, max=mx, tok=self.tokens[at], i=at))
        out.append(text("ablation.embedding", lang, d=self.embedding_distance))
        nt = self.next_token
        if nt is not None:
            top = lambda xs: ", ".join(f"{t} {np.exp(p):.3f}" for t, p in xs)  # noqa: E731
            out += [text("ablation.next", lang, tok=f, kl=nt["kl"], top=nt["clean_top"][0][0], delta=nt["delta_logprob"]),
                    text("ablation.clean", lang, tokens=top(nt["clean_top"])),
                    text("ablation.ablated", lang, tokens=top(nt["ablated_top"]))]
        return out


def edited_module(model: Any) -> Any:
    """The torch module whose attention :func:`qkv.inspect.ablate` edits."""
    return getattr(model, "model", None) if hasattr(model, "hf_tokenizer") else model


def final_states(model: Any, input_ids: Any, mask: Any, token_type_ids: Any = None) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """One sequence's final hidden states ``(N, E)`` and, for language models, logits ``(N, V)``."""
    import torch

    with torch.inference_mode():
        if hasattr(model, "hf_tokenizer"):
            return model.final(input_ids, mask, token_type_ids)
        out = model(input_ids, mask) if token_type_ids is None else model(input_ids, mask, token_type_ids)
        if isinstance(out, torch.Tensor):  # a module that returns its hidden states (B, N, E)
            hidden = out
        else:
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise ValueError("ablation needs the model's final hidden states (B, N, E): return them, or an "
                             "object with .last_hidden_state")
        return hidden[0].double().cpu().numpy(), None


def ablation_effect(
    model: Any, input_ids: Any, mask: Any, heads: Sequence[tuple[int, int]], *, focus_index: int,
    tokens: Sequence[str], mode: str = "zero", token_type_ids: Any = None, top: int = 3,
    intervention: Optional[Callable[[], ContextManager[Any]]] = None, temperature: float = 1.0,
) -> Ablation:
    """Compare the model's result on ``input_ids (1, N)`` with and without ``heads`` (see :class:`Ablation`).

    ``intervention``: a function returning the context the changed run happens in, instead of
    :func:`qkv.inspect.ablate` of ``heads`` (e.g. :func:`qkv.inspect.patch_from` another
    input; ``mode`` then names it). ``temperature`` divides the logits before the next-token
    distribution is taken (1: the model's own).
    """
    from qkv.inspect import ablate

    if intervention is None and mode not in ("zero", "mean"):
        raise ValueError(f"ablate mode {mode!r} is not available; use 'zero' or 'mean' (--ablate-mode)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature={temperature!r} must be a positive finite number (1: the model's own distribution)")
    clean, clean_logits = final_states(model, input_ids, mask, token_type_ids)
    with ablate(edited_module(model), heads=list(heads), mode=mode) if intervention is None else intervention():
        hit, hit_logits = final_states(model, input_ids, mask, token_type_ids)
    nt = None
    if clean_logits is not None and hit_logits is not None:
        p = _log_softmax(clean_logits[focus_index] / temperature)  # (V,)
        q = _log_softmax(hit_logits[focus_index] / temperature)  # (V,)
        name = model.token_name
        best = int(np.argmax(p))
        nt = {
            "position": focus_index,
            "kl": float(max(0.0, (np.exp(p) * (p - q)).sum())),
            "delta_logprob": float(q[best] - p[best]),
            "clean_top": [(name(int(i)), float(p[i])) for i in np.argsort(-p, kind="stable")[:top]],
            "ablated_top": [(name(int(i)), float(q[i])) for i in np.argsort(-q, kind="stable")[:top]],
        }
    return Ablation(
        heads=list(heads), mode=mode, focus_index=focus_index, tokens=list(tokens),
        token_distance=_cosine_distance(clean, hit), embedding_distance=float(_cosine_distance(clean.mean(0), hit.mean(0))),
        next_token=nt,
    )
