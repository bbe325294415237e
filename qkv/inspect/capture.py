"""Record what the attention modules of a model compute, by name, during a forward pass.

Shape legend::

    B batch   H query heads   Hk key/value heads   Nq / Nk query / key length   Dh head dim
    h len(heads)   r len(rows)

Every :class:`qkv.nn.MultiHeadAttention` has capture points, named ``<module path>.<point>``
(``encoder.layers.3.self_attn.q``)::

    q        (B, H, Nq, Dh)    after the head split (and rotary embedding)
    k, v     (B, Hk, Nk, Dh)   after the head split (and rotary, and the KV cache)
    scores   (B, h, r, Nk)     scaled, masked scores (-inf where masked)
    weights  (B, h, r, Nk)     softmax weights, exp(scores - lse), recomputed tile by tile
    lse      (B, H, Nq)        log-sum-exp of each query row, from the fused attention call
    output   (B, H, Nq, Dh)    attention output, before the heads merge and ``out_proj``

``scores``/``weights`` never take the materialising path: a fused pass gives the lse, and the
maps are rebuilt from it for the chosen ``heads`` and ``rows`` only. With
``stats=True`` they are not kept at all; :func:`qkv.inspect.attention_stats` summarises every
row instead, in ``O(N · topk)`` memory — for long inputs.

A call's ``score_mod`` and ``sinks`` (when the module passes them with its masks) go to every
map and statistic, so ``scores``/``weights``/``lse`` are the ones the model uses.
:func:`observed_map` and :func:`observed_stats` do the same for the calls a
:func:`qkv.hf.observe` observer receives from Hugging Face models running on qkv.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .. import hooks
from ..call import validate_qk
from ..hf import HFAttentionCall, observe
from ..hooks import matches, point_name
from ..nn.attention import MultiHeadAttention
from .maps import BLOCK, Index, attention_map, attention_scores, fused_lse
from .stats import AttentionStats, attention_stats, attention_with_stats

__all__ = ["POINTS", "Recording", "Recorder", "record", "record_stats", "observed_arguments", "observed_map", "observed_stats"]

POINTS: tuple[str, ...] = ("q", "k", "v", "scores", "weights", "lse", "output")
"""The capture points of every attention module, the last part of a :func:`record` pattern."""
_MAPS = ("scores", "weights")


class Recording(Mapping[str, torch.Tensor]):
    """What :func:`record` captured: ``recording["encoder.layers.3.self_attn.weights"]`` → tensor.

    ``stats`` maps a module path (``"encoder.layers.3.self_attn"``) to its
    :class:`~qkv.inspect.AttentionStats` when recording with ``stats=True``; ``calls`` counts the
    forward calls seen per module (a later call overwrites an earlier one's tensors).
    """

    def __init__(self) -> None:
        self._data: dict[str, torch.Tensor] = {}
        self.stats: dict[str, AttentionStats] = {}
        self.calls: dict[str, int] = {}
        self.modules: list[str] = []

    def __getitem__(self, path: str) -> torch.Tensor:
        try:
            return self._data[path]
        except KeyError:
            have = ", ".join(sorted(self._data)[:6]) or "nothing (did the model run inside the `with` block?)"
            raise KeyError(f"{path!r} was not recorded; recorded: {have}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested lists, for JSON: ``{path: values, ..., "stats": {module: {...}}}``."""
        out: dict[str, Any] = {path: t.tolist() for path, t in self._data.items()}
        if self.stats:
            out["stats"] = {path: st.to_dict() for path, st in self.stats.items()}
        return out

    def to_string(self) -> str:
        lines = [f"Recording of {len(self.modules)} attention module(s)"]
        lines += [f"  {path}: {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for path, t in self._data.items()]
        lines += [f"  {path} stats: {tuple(st.shape)}" for path, st in self.stats.items()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{p}</td><td>{tuple(t.shape)}</td></tr>" for p, t in self._data.items())
        rows += "".join(f"<tr><td>{p} (stats)</td><td>{tuple(st.shape)}</td></tr>" for p, st in self.stats.items())
        return f"<table><tr><th>capture point</th><th>shape</th></tr>{rows}</table>"

    def __repr__(self) -> str:
        return f"Recording({len(self._data)} tensors, stats for {len(self.stats)} modules, {len(self.modules)} modules attached)"


class Recorder:
    """The :mod:`qkv.hooks` observer of one module while a :func:`record` is active: stores the
    ``wanted`` points of the module at ``path`` into ``rec`` (``opts``: :func:`record`'s options)."""

    def __init__(self, path: str, wanted: set[str], rec: Recording, opts: dict[str, Any]) -> None:
        self.path, self.wanted, self.rec, self.opts = path, wanted, rec, opts
        self.stats = opts["stats"] and bool(wanted & set(_MAPS))
        # Asking the model's own call for the lse saves a pass but may route it to another
        # backend (rounding-level changes), so it is opt-in: by default the model runs untouched.
        self.wants_lse = opts["reuse_lse"] and ("lse" in wanted or "weights" in wanted or self.stats)
        self._fused: Optional[AttentionStats] = None  # statistics that attend() computed for the current call

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **call: Any) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Run the module's attention call itself, or decline (None).

        Recording statistics with ``reuse_lse=True`` on the CPU (no gradient, no nested
        recording: :class:`qkv.hooks.Site` asks only a module's sole ``lse`` observer), the
        output, the lse and the statistics come from one tiled pass
        (:func:`~qkv.inspect.attention_with_stats`), so the statistics do not repeat the score
        matmul. Like ``reuse_lse`` itself this changes the call's rounding, not its result.
        """
        o = self.opts
        if not (self.stats and o["reuse_lse"]) or q.device.type != "cpu":
            return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return None
        out, st = attention_with_stats(
            q, k, v, topk=o["topk"], key_positions=o["key_positions"], relative_positions=o["relative_positions"], **call
        )
        self._fused = st
        return out, st.lse

    def _name(self, point: str) -> str:
        return point_name(self.path, point)

    def _store(self, point: str, t: torch.Tensor) -> None:
        self.rec._data[self._name(point)] = t.detach().clone()  # clone: cache buffers are overwritten later

    def __call__(self, name: str, tensor: Optional[torch.Tensor], **ctx: Any) -> None:
        if name == "q":
            self.rec.calls[self.path] = self.rec.calls.get(self.path, 0) + 1
        if name == "lse":
            with torch.no_grad():
                self._attention(tensor, **ctx)
        elif name in self.wanted and tensor is not None:
            self._store(name, tensor)

    def _attention(self, lse: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor, **masks: Any) -> None:
        o = self.opts
        if self.stats and self._fused is not None:  # attend() ran this call and kept its statistics
            self.rec.stats[self.path], self._fused = self._fused, None
            if "lse" in self.wanted:
                self._store("lse", lse)
            return
        if self.stats:
            # without the model's own lse the statistics find it in their single pass (stats.lse)
            st = attention_stats(
                query, key, lse=lse, topk=o["topk"], key_positions=o["key_positions"],
                relative_positions=o["relative_positions"], check_lse=False, **masks,
            )  # fmt: skip
            self.rec.stats[self.path] = st
            if "lse" in self.wanted:
                self._store("lse", lse if lse is not None else st.lse)
            return
        need_lse = "lse" in self.wanted or "weights" in self.wanted
        if lse is None and need_lse:  # not asked of the model's call (reuse_lse=False), or it could not give one
            m = masks
            call = validate_qk(query, key, m["attn_mask"], m["is_causal"], None, m["enable_gqa"], m["window"], m["key_padding_mask"],
                               score_mod=m.get("score_mod"), sinks=m.get("sinks"))  # fmt: skip
            lse = fused_lse(call)
        if "lse" in self.wanted and lse is not None:
            self._store("lse", lse)
        if "weights" in self.wanted:
            # check_lse=False: the lse is this call's own, and a hook must not raise inside the model
            self.rec._data[self._name("weights")] = attention_map(
                query, key, heads=o["heads"], rows=o["rows"], lse=lse, check_lse=False, **masks
            )
        if "scores" in self.wanted:
            self.rec._data[self._name("scores")] = attention_scores(query, key, heads=o["heads"], rows=o["rows"], **masks)


def observed_arguments(call: Any) -> dict[str, Any]:
    """The attention arguments of an observed call (a :class:`qkv.hf.HFAttentionCall`: its
    mask, causal rule, window, scale, GQA, score function and sinks) for the map and
    statistics functions; ``lse`` not included."""
    return dict(
        attn_mask=call.attn_mask, is_causal=call.is_causal, window=call.window, scale=call.scale,
        enable_gqa=call.query.shape[-3] != call.key.shape[-3],
        # (calls recorded before HFAttentionCall carried them have neither)
        score_mod=getattr(call, "score_mod", None), sinks=getattr(call, "sinks", None),
    )  # fmt: skip


def observed_map(call: Any, *, heads: Index = None, rows: Index = None, block: int = BLOCK) -> torch.Tensor:
    """The weights ``(B, h, r, Nk)`` the model used in an observed call (a
    :class:`qkv.hf.HFAttentionCall`), rebuilt tile by tile from its lse by
    :func:`~qkv.inspect.attention_map` with every argument of the call::

        with qkv.hf.observe(lambda c: maps.append(qkv.inspect.observed_map(c, rows=[-1]))):
            model(**inputs)
    """
    # check_lse=False: the lse is the call's own, and an observer must not raise inside the model
    return attention_map(call.query, call.key, heads=heads, rows=rows, lse=call.lse, block=block, check_lse=False,
                         **observed_arguments(call))  # fmt: skip


def observed_stats(
    call: Any, *, topk: int = 5, key_positions: Sequence[int] = (0,), relative_positions: Sequence[int] = (-1, 0)
) -> AttentionStats:
    """:func:`~qkv.inspect.attention_stats` of an observed call (a :class:`qkv.hf.HFAttentionCall`),
    from its lse and with every argument of the call."""
    return attention_stats(
        call.query, call.key, lse=call.lse, topk=topk, key_positions=key_positions,
        relative_positions=relative_positions, check_lse=False, **observed_arguments(call),
    )  # fmt: skip


def _plan(model: nn.Module, patterns: Sequence[str]) -> dict[str, tuple[MultiHeadAttention, set[str]]]:
    """module path → (module, the points the patterns select); errors name what does exist."""
    mods = [(path, m) for path, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if not mods:
        raise ValueError(
            f"{type(model).__name__} contains no qkv.nn.MultiHeadAttention; record() attaches to those modules only"
        )
    plan: dict[str, tuple[MultiHeadAttention, set[str]]] = {}
    used = set()
    for path, m in mods:
        wanted = set()
        for point in POINTS:
            # the model itself: its points are plain names, and "*.weights" should still select them
            for pat in patterns:
                if matches(pat, path, point):
                    wanted.add(point)
                    used.add(pat)
        if wanted:
            plan[path] = (m, wanted)
    unused = [p for p in patterns if p not in used]
    if unused:
        example = f"{mods[0][0]}.weights" if mods[0][0] else "weights"
        raise ValueError(
            f"capture pattern(s) {unused} match no capture point. Points are '<module path>.<point>' with point one "
            f"of {list(POINTS)}, e.g. {example!r} or '*.q'; attention modules here: {[p or '<model>' for p, _ in mods][:8]}"
        )
    return plan


@contextmanager
def record(
    model: nn.Module,
    points: Union[str, Sequence[str]] = "*.weights",
    *,
    stats: bool = False,
    rows: Index = None,
    heads: Index = None,
    topk: int = 5,
    key_positions: Sequence[int] = (0,),
    relative_positions: Sequence[int] = (-1, 0),
    reuse_lse: bool = False,
) -> Iterator[Recording]:
    """Attach to every :class:`qkv.nn.MultiHeadAttention` under ``model`` whose points match, and record.

    ``points`` are glob patterns over ``<module path>.<point>`` (``"encoder.layers.*.self_attn.q"``,
    ``"layers.3.self_attn.weights"``, ``"*"`` for everything); the points are listed in this
    module's docstring (``POINTS``). ``rows``/``heads`` restrict ``scores``/``weights`` maps
    ``(B, h, r, Nk)``. With ``stats=True`` the maps are replaced by
    :class:`~qkv.inspect.AttentionStats` in ``recording.stats[module path]`` (``topk``,
    ``key_positions``, ``relative_positions`` as in :func:`~qkv.inspect.attention_stats`).

    Recording does not change what the model computes: its outputs stay bit-identical, and the
    lse that ``weights``/``lse``/``stats`` need comes from a separate fused pass over the captured
    q and k. ``reuse_lse=True`` asks the model's own attention call for it instead (one pass
    fewer; the call may then run on another backend, so outputs may differ by rounding); with
    ``stats=True`` as well, CPU calls without gradients then run through
    :func:`~qkv.inspect.attention_with_stats`, which gives the output, the lse and the
    statistics in a single pass over the scores.
    The hooks are removed on exit, also when the forward pass raises::

        with qkv.inspect.record(model, ["encoder.layers.*.self_attn.weights"], rows=[-1]) as rec:
            model(x)
        rec["encoder.layers.3.self_attn.weights"]  # (B, H, 1, N)
    """
    patterns = [points] if isinstance(points, str) else list(points)
    plan = _plan(model, patterns)
    rec = Recording()
    rec.modules = list(plan)
    opts = dict(
        stats=stats, rows=rows, heads=heads, topk=topk, key_positions=tuple(key_positions),
        relative_positions=tuple(relative_positions), reuse_lse=reuse_lse,
    )  # fmt: skip
    with ExitStack() as attached:  # every hook removed on exit, also when the forward pass raises
        for path, (m, wanted) in plan.items():
            r = Recorder(path, wanted, rec, opts)
            attached.enter_context(hooks.add_observer(m, r, wants_lse=r.wants_lse, attend=r.attend))
        yield rec


@contextmanager
def record_stats(
    *, topk: int = 5, key_positions: Sequence[int] = (0,), relative_positions: Sequence[int] = (-1, 0)
) -> Iterator[list[AttentionStats]]:
    """Streaming attention statistics of every layer of a Hugging Face model running on qkv.

    Yields a list that receives one :class:`AttentionStats` per attention call, in call order
    (``stats.layer_idx`` is set when the model numbers its layers). Computed from each call's
    q, k and log-sum-exp tile by tile (:func:`qkv.hf.observe`), so no N×N map is ever built —
    what ``output_attentions=True`` cannot offer on long inputs.
    """
    collected: list[AttentionStats] = []

    def on_call(c: HFAttentionCall) -> None:
        st = attention_stats(
            c.query, c.key, lse=c.lse, attn_mask=c.attn_mask, is_causal=c.is_causal, window=c.window,
            scale=c.scale, enable_gqa=c.query.shape[1] != c.key.shape[1], topk=topk,
            key_positions=key_positions, relative_positions=relative_positions, score_mod=c.score_mod, sinks=c.sinks,
        )  # fmt: skip
        st.layer_idx = c.layer_idx
        collected.append(st)

    with observe(on_call):
        yield collected
