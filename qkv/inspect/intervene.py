"""Change what attention computes during a forward pass: ablate heads, patch activations.

Shape legend::

    B batch   H query heads   Hk key/value heads   Nq / Nk query / key length   Dh head dim

Edit points are named like capture points, ``<module path>.<point>``::

    q        (B, H, Nq, Dh)    after the head split (and rotary)
    k, v     (B, Hk, Nk, Dh)   after the head split (and rotary, and the KV cache)
    weights  (B, H, Nq, Nk)    softmax weights; editing them materialises them and multiplies by V
    output   (B, H, Nq, Dh)    each head's output, before the heads merge and the output projection

They exist on every :class:`qkv.nn.MultiHeadAttention` (so on :mod:`qkv.models`) and on the
attention modules of Hugging Face models loaded with ``attn_implementation="qkv"``
(:func:`qkv.hf.register`). "Layer" ``L`` means the ``L``-th attention module in
``model.named_modules()`` order (:func:`attention_modules` lists them).

Inside a ``with`` block only the named points change; outside it (and for every point not
named) the model computes exactly what it computed before, bit for bit::

    with qkv.inspect.ablate(model, heads=[(1, 3)]):          # zero layer 1 head 3
        ablated = model(ids)
    with qkv.inspect.patch(model, {"encoder.layers.0.self_attn.weights": lambda w: w.flip(-1)}):
        model(ids)
    effects = qkv.inspect.patching_effects(model, lambda: model(clean), lambda: model(corrupt), metric)
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .. import hooks
from ..hf import NAME, is_registered
from ..hooks import Edit, apply_edit, matches, point_name
from ..nn.attention import MultiHeadAttention

__all__ = [
    "EDIT_POINTS",
    "attention_modules",
    "patch",
    "ablate",
    "patch_from",
    "capture_outputs",
    "patching_effects",
    "PatchingEffects",
    "Editor",
]

EDIT_POINTS: tuple[str, ...] = ("q", "k", "v", "weights", "output")
"""The points :func:`patch` may edit: q, k, v after the head split, the weights (then multiplied by
V) and each head's output before W_O."""
HeadRef = Union[tuple[int, int], tuple[str, int]]


def _is_hf_attention(m: nn.Module) -> bool:
    # Hugging Face attention modules carry both; their forward calls the registered attention function
    return hasattr(m, "layer_idx") and hasattr(m, "is_causal") and not isinstance(m, MultiHeadAttention)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every attention module that can be edited, in ``named_modules()``
    order (index = the "layer" of :func:`ablate`): :class:`qkv.nn.MultiHeadAttention` modules,
    or for a Hugging Face model its attention modules."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    mods: list[tuple[str, nn.Module]] = [(p, m) for p, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if mods:
        return mods
    mods = [(p, m) for p, m in model.named_modules() if _is_hf_attention(m)]
    if not mods:
        raise ValueError(
            f"{type(model).__name__} has no qkv.nn.MultiHeadAttention and no Hugging Face attention module; "
            "interventions attach to those"
        )
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is not None:
        if impl != NAME or not is_registered():
            raise ValueError(
                f"this Hugging Face model runs attention with {impl!r}, so qkv cannot edit it; call "
                f"qkv.hf.register() and load it with attn_implementation={NAME!r} "
                f"(or model.set_attn_implementation({NAME!r}))"
            )
    return mods


class Editor:
    """The :mod:`qkv.hooks` editor of one attention module inside :func:`patch`: applies
    ``edits`` (point → edits, in order) to the module at ``path``."""

    def __init__(self, path: str, edits: dict[str, list[Edit]]) -> None:
        self.path, self.edits = path, edits

    def __call__(self, point: str, t: Tensor) -> Tensor:
        for e in self.edits.get(point, ()):
            t = apply_edit(e, t, point_name(self.path, point))
        return t


def _resolve(model: nn.Module, edits: Mapping[str, Edit]) -> dict[str, tuple[nn.Module, dict[str, list[Edit]]]]:
    """module path → (module, point → edits); glob keys allowed, each must match something."""
    mods = attention_modules(model)
    plan: dict[str, tuple[nn.Module, dict[str, list[Edit]]]] = {}
    for key, edit in edits.items():
        if not (isinstance(edit, Tensor) or callable(edit)):
            raise TypeError(f"the edit for {key!r} must be a tensor or a callable tensor -> tensor, got {type(edit).__name__}")
        hits = 0
        for path, m in mods:
            for point in EDIT_POINTS:
                if matches(key, path, point):
                    plan.setdefault(path, (m, {}))[1].setdefault(point, []).append(edit)
                    hits += 1
        if not hits:
            example = f"{mods[0][0]}.output" if mods[0][0] else "output"
            raise ValueError(
                f"edit point {key!r} matches nothing. Points are '<module path>.<point>' with point one of "
                f"{list(EDIT_POINTS)}, e.g. {example!r}; attention modules here: {[p or '<model>' for p, _ in mods][:6]}"
            )
    return plan


@contextmanager
def patch(model: nn.Module, edits: Mapping[str, Edit]) -> Iterator[None]:
    """Replace attention tensors during forward passes inside the ``with`` block.

    ``edits`` maps an edit point (``"encoder.layers.1.self_attn.output"``, globs such as
    ``"*.weights"`` allowed) to a tensor that broadcasts to the point's shape, or to a function
    ``f(tensor) -> tensor`` of the same shape (it receives a copy and may edit it in place and
    return it). Patches nest; the inner one applies after the outer one. Hooks are removed on
    exit, also when the forward pass raises.
    """
    if not isinstance(edits, Mapping):
        raise TypeError(f"edits must be a mapping from edit point to tensor or function, got {type(edits).__name__}")
    with ExitStack() as attached:  # every hook removed on exit, also when the forward pass raises
        for path, (m, point_edits) in _resolve(model, edits).items():
            attached.enter_context(hooks.add_editor(m, Editor(path, point_edits), points=point_edits))
        yield


def _heads_by_module(model: nn.Module, heads: Sequence[HeadRef]) -> dict[str, list[int]]:
    mods = attention_modules(model)
    paths = [p for p, _ in mods]
    out: dict[str, list[int]] = {}
    if isinstance(heads, tuple) and len(heads) == 2 and isinstance(heads[1], int):
        heads = [heads]  # a single (layer, head)
    for ref in heads:
        if not (isinstance(ref, (tuple, list)) and len(ref) == 2):
            raise ValueError(f"heads entries are (layer, head) or (module path, head) pairs, got {ref!r}")
        where, h = ref
        if isinstance(where, str):
            if where not in paths:
                raise ValueError(f"{where!r} is not an attention module; attention modules: {paths[:6]}")
            path = where
        elif isinstance(where, int) and not isinstance(where, bool):
            if not -len(paths) <= where < len(paths):
                raise ValueError(f"layer {where} is out of range: the model has {len(paths)} attention modules (0–{len(paths) - 1})")
            path = paths[where]
        else:
            raise TypeError(f"a head's layer must be an int or a module path, got {where!r}")
        m = dict(mods)[path]
        n_heads = getattr(m, "num_heads", None) or getattr(getattr(m, "config", None), "num_attention_heads", None)
        if not isinstance(h, int) or isinstance(h, bool) or (n_heads is not None and not 0 <= h < n_heads):
            raise ValueError(f"head {h!r} of {path!r} is out of range: it has {n_heads} heads (0–{(n_heads or 1) - 1})")
        out.setdefault(path, []).append(h)
    return out


@contextmanager
def ablate(model: nn.Module, heads: Sequence[HeadRef], mode: str = "zero") -> Iterator[None]:
    """Knock out attention heads inside the ``with`` block.

    ``heads``: ``[(layer, head), ...]`` (0-based; layer = index in :func:`attention_modules`)
    or ``(module path, head)`` pairs. ``mode="zero"`` sets the head's output (B, H, Nq, Dh) to 0;
    ``mode="mean"`` replaces every position's output by the head's mean output over the batch
    and the positions of the same forward pass (the head keeps its average contribution but no
    longer depends on which token attends where).
    """
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode={mode!r} is not an ablation; use 'zero' or 'mean'")
    edits: dict[str, Edit] = {}
    for path, hs in _heads_by_module(model, heads).items():
        idx = sorted(set(hs))

        def knock(out: Tensor, idx: list[int] = idx) -> Tensor:  # (B, H, Nq, Dh)
            if mode == "zero":
                out[:, idx] = 0
            else:
                out[:, idx] = out[:, idx].mean(dim=(0, 2), keepdim=True).expand_as(out[:, idx])
            return out

        edits[point_name(path, "output")] = knock
    with patch(model, edits):
        yield


@contextmanager
def capture_outputs(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Record every attention module's head outputs ``(B, H, Nq, Dh)`` by module path (the
    source for :func:`patch_from`); works on qkv.nn and Hugging Face (``"qkv"``) models alike."""
    got: dict[str, Tensor] = {}
    edits: dict[str, Edit] = {}
    for path, _ in attention_modules(model):
        def keep(out: Tensor, path: str = path) -> Tensor:
            got[path] = out.detach().clone()
            return out

        edits[point_name(path, "output")] = keep
    with patch(model, edits):
        yield got


def _source_output(source: Mapping[str, Tensor], path: str) -> Tensor:
    for key in (path, point_name(path, "output")):
        if key in source:
            return source[key]
    raise KeyError(f"no recorded output for {path!r}: record it with capture_outputs(model) or record(model, '*.output')")


@contextmanager
def patch_from(model: nn.Module, source: Mapping[str, Tensor], heads: Sequence[HeadRef]) -> Iterator[None]:
    """Activation patching: inside the block, the listed heads output what they output in
    another run. ``source`` maps module paths (or ``"<path>.output"``, as a
    :class:`~qkv.inspect.Recording` of ``"*.output"`` does) to ``(B, H, Nq, Dh)`` outputs from
    :func:`capture_outputs`; the patched run must have the same shapes."""
    edits: dict[str, Edit] = {}
    for path, hs in _heads_by_module(model, heads).items():
        src = _source_output(source, path)
        idx = sorted(set(hs))

        def put(out: Tensor, src: Tensor = src, idx: list[int] = idx, path: str = path) -> Tensor:
            if src.shape != out.shape:
                raise ValueError(
                    f"the source output of {path!r} has shape {tuple(src.shape)} but this run's is "
                    f"{tuple(out.shape)}; patch between inputs of the same length"
                )
            out[:, idx] = src[:, idx].to(out)
            return out

        edits[point_name(path, "output")] = put
    with patch(model, edits):
        yield


@dataclass
class PatchingEffects:
    """Per-head effect of patching clean activations into a corrupted run.

    ``effects[L, h] = (metric(patched) - metric(corrupted)) / (metric(clean) - metric(corrupted))``:
    1 means this head alone restores the clean behaviour, 0 that it changes nothing.
    ``raw[L, h]`` is ``metric(patched)``. Shapes ``(layers, heads)``.
    """

    effects: Tensor
    raw: Tensor
    clean: float
    corrupted: float
    modules: list[str]

    def top(self, k: int = 5) -> list[tuple[int, int, float]]:
        """The ``k`` heads with the largest effect: ``(layer, head, effect)``."""
        flat = self.effects.flatten()
        order = torch.argsort(flat.nan_to_num(float("-inf")), descending=True)[:k]
        h = self.effects.shape[1]
        return [(int(i) // h, int(i) % h, float(flat[i])) for i in order]

    # A clean-minus-corrupted gap below this share of the metric's size makes every effect a
    # ratio of two small differences: noise, however large the percentages look.
    SMALL_GAP = 0.01

    @property
    def gap(self) -> float:
        """``metric(clean) - metric(corrupted)``: what the effects are shares of."""
        return self.clean - self.corrupted

    @property
    def gap_is_small(self) -> bool:
        return abs(self.gap) < self.SMALL_GAP * max(1.0, abs(self.clean), abs(self.corrupted))

    def warning(self) -> Optional[str]:
        """Why the effects should not be trusted, or None."""
        if not self.gap_is_small:
            return None
        return (
            f"warning: clean and corrupted differ by only {self.gap:.3g}; every effect is a share of that "
            "small difference, so choose inputs or a metric that the corruption changes more"
        )

    def to_string(self, precision: int = 2) -> str:
        h = self.effects.shape[1]
        lines = [
            f"metric: clean {self.clean:.4g}, corrupted {self.corrupted:.4g}; effect = share of the difference a head restores",
            "layer " + " ".join(f"{f'h{j}':>{precision + 4}}" for j in range(h)),
        ]
        for i, row in enumerate(self.effects.tolist()):
            lines.append(f"{i:>5} " + " ".join(f"{v:>{precision + 4}.{precision}f}" for v in row))
        if self.warning():
            lines.append(str(self.warning()))
        return "\n".join(lines)

    def _repr_html_(self, precision: int = 2) -> str:
        """A table for notebooks: one row per layer, one column per head, shaded by effect."""
        from html import escape

        def cell(v: float) -> str:
            a = 0.0 if v != v else max(-1.0, min(1.0, v))
            color = f"rgba(34,139,34,{a:.2f})" if a >= 0 else f"rgba(178,34,34,{-a:.2f})"
            return f'<td style="background:{color};text-align:right">{v:.{precision}f}</td>'

        heads = "".join(f"<th>h{j}</th>" for j in range(self.effects.shape[1]))
        rows = "".join(f"<tr><th>{i}</th>{''.join(cell(v) for v in row)}</tr>" for i, row in enumerate(self.effects.tolist()))
        note = f"<p><b>{escape(str(self.warning()))}</b></p>" if self.warning() else ""
        return (
            f"<div><p>metric: clean {self.clean:.4g}, corrupted {self.corrupted:.4g}; effect = share of the "
            f"difference a head restores (1 = all of it)</p>{note}<table><tr><th>layer</th>{heads}</tr>{rows}</table></div>"
        )

    def __repr__(self) -> str:
        return f"PatchingEffects({tuple(self.effects.shape)}, clean={self.clean:.4g}, corrupted={self.corrupted:.4g})"

    def to_dict(self) -> dict[str, Any]:
        return {"effects": self.effects.tolist(), "raw": self.raw.tolist(), "clean": self.clean,
                "corrupted": self.corrupted, "modules": list(self.modules)}


def patching_effects(
    model: nn.Module,
    clean: Callable[[], Any],
    corrupted: Callable[[], Any],
    metric: Callable[[Any], Union[float, Tensor]],
) -> PatchingEffects:
    """Patch each head's clean output into the corrupted run, one head at a time, and measure.

    ``clean`` and ``corrupted`` run the model (e.g. ``lambda: model(clean_ids)``); ``metric``
    turns a run's result into a number (e.g. the logit difference of the right and wrong
    answer). Runs ``2 + layers × heads`` forward passes under ``torch.no_grad()``.
    """
    mods = attention_modules(model)
    with torch.no_grad():
        with capture_outputs(model) as src:
            m_clean = float(metric(clean()))
        m_corrupt = float(metric(corrupted()))
        n_heads = max(int(src[p].shape[1]) for p, _ in mods if p in src) if src else 0
        raw = torch.full((len(mods), n_heads), float("nan"), dtype=torch.float64)
        for i, (path, _) in enumerate(mods):
            if path not in src:  # a module the clean run never called
                continue
            for h in range(src[path].shape[1]):
                with patch_from(model, src, heads=[(path, h)]):
                    raw[i, h] = float(metric(corrupted()))
    denom = m_clean - m_corrupt
    effects = (raw - m_corrupt) / denom if denom != 0 else torch.full_like(raw, float("nan"))
    return PatchingEffects(effects, raw, m_clean, m_corrupt, [p for p, _ in mods])
