"""Rank and classify attention heads from streaming statistics.

Each head gets four scores in [0, 1], averaged over the batch and the query rows for which
the score is defined:

    previous   mean weight on the key just before the query (relative position -1)
    sink       mean weight on key 0 (the first token, where many heads park attention)
    broad      mean entropy / log(number of allowed keys): 1 = uniform over what it may see
    self       mean weight on the query's own position (relative position 0)
    sink_share mean share of each row's attention its sink logit takes (only for calls with
               ``sinks``, e.g. GPT-OSS: there the weights on keys sum to 1 - sink_share)

The kind is the highest score's name (``previous-token``, ``first-token``, ``broad``,
``self``, ``sink-logit``); the table is ranked by that score, most clear-cut heads first.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .stats import AttentionStats

__all__ = ["HeadSummary", "head_summary"]

KINDS = {"previous": "previous-token", "sink": "first-token", "broad": "broad", "self": "self", "sink_share": "sink-logit"}


class HeadSummary(list):
    """A ranked list of dicts, one per (module, head): ``module``, ``head``, ``kind``, ``score``,
    the four scores ``previous``/``sink``/``broad``/``self`` (and ``sink_share`` for calls with
    sinks), ``entropy`` (nats), ``max_weight``, ``mean_distance`` and, when tokens were given,
    ``top_token`` (the key token most often attended most)."""

    COLUMNS = ("module", "head", "kind", "score", "previous", "sink", "broad", "self", "entropy", "mean_distance")

    def to_dict(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self]

    def to_string(self, limit: Optional[int] = None) -> str:
        cols = list(self.COLUMNS) + [c for c in ("sink_share", "top_token") if self and c in self[0]]
        rows = [[_fmt(r.get(c, "")) for c in cols] for r in self[:limit]]
        widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
        line = lambda cells: "  ".join(str(x).rjust(w) for x, w in zip(cells, widths))  # noqa: E731
        return "\n".join([line(cols)] + [line(r) for r in rows])

    def _repr_html_(self) -> str:
        cols = [c for c in (*self.COLUMNS, "sink_share") if (not self and c != "sink_share") or (self and c in self[0])]
        head = "".join(f"<th>{c}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in self)
        return f"<table><tr>{head}</tr>{body}</table>"

    def __repr__(self) -> str:
        return f"HeadSummary({len(self)} heads)\n{self.to_string(limit=10)}"


def _fmt(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def _mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over batch and rows of ``x`` (B, H, N) where ``valid``; per head (H,)."""
    v = valid.to(torch.float64)
    return (x.double() * v).sum((0, 2)) / v.sum((0, 2)).clamp(min=1)


def _heads(st: AttentionStats, module: str, tokens: Optional[Sequence[str]]) -> list[dict[str, Any]]:
    shape = st.shape
    flat = lambda t: t.reshape(-1, shape[-2], shape[-1], *t.shape[len(shape):]) if len(shape) >= 2 else t.reshape(1, 1, *t.shape)  # noqa: E731
    n_keys = flat(st.n_keys)
    nq = n_keys.shape[-1]
    pos = torch.arange(nq) + st.query_offset  # key position of each query row
    live = n_keys > 0

    def rel(r: int) -> Optional[torch.Tensor]:
        if r not in st.relative_positions:
            return None
        j = pos + r
        ok = live & ((j >= 0) & (j < st.meta.get("nk", nq + st.query_offset)))  # rows where that key exists
        return _mean(flat(st.relative_weights)[..., st.relative_positions.index(r)], ok)

    scores = {
        "previous": rel(-1),
        "sink": _mean(flat(st.key_weights)[..., st.key_positions.index(0)], live) if 0 in st.key_positions else None,
        "broad": _mean(flat(st.normalized_entropy), n_keys > 1),
        "self": rel(0),
        # every row counts: one that sees no key gives its sink everything
        "sink_share": None if st.sink_share is None else _mean(flat(st.sink_share), torch.ones_like(live)),
    }
    scores = {k: v for k, v in scores.items() if v is not None}
    ent, mw, dist = (_mean(flat(getattr(st, f)), live) for f in ("entropy", "max_weight", "mean_distance"))
    top1 = flat(st.topk_indices)[..., 0] if st.topk_indices.shape[-1] else None
    out = []
    for h in range(n_keys.shape[1]):
        row: dict[str, Any] = {"module": module, "head": h}
        vals = {k: float(v[h]) for k, v in scores.items()}
        best = max(vals, key=vals.get)
        row.update(kind=KINDS[best], score=vals[best], **vals)
        row.update(entropy=float(ent[h]), max_weight=float(mw[h]), mean_distance=float(dist[h]))
        if tokens is not None and top1 is not None:
            idx = top1[:, h][top1[:, h] >= 0]
            row["top_token"] = tokens[int(idx.mode().values)] if idx.numel() else ""
        out.append(row)
    return out


def head_summary(
    source: Union[AttentionStats, Mapping[str, AttentionStats], Any], tokens: Optional[Sequence[str]] = None
) -> HeadSummary:
    """Classify and rank every head of a recording (``record(..., stats=True)``) or of stats.

    ``source`` is a :class:`~qkv.inspect.Recording` with ``.stats``, a dict module path →
    :class:`~qkv.inspect.AttentionStats`, or one ``AttentionStats`` (module ``""``). Stats
    computed with ``key_positions`` including 0 and ``relative_positions`` including -1 and 0
    (the defaults) give all four scores. ``tokens`` (one string per key) adds each head's
    most attended token.
    """
    if isinstance(source, AttentionStats):
        items = {"": source}
    elif hasattr(source, "stats") and isinstance(source.stats, Mapping):
        items = dict(source.stats)
        if not items:
            raise ValueError("this recording holds no statistics; record with qkv.inspect.record(model, ..., stats=True)")
    elif isinstance(source, Mapping):
        items = dict(source)
    else:
        raise TypeError(f"head_summary needs AttentionStats, a dict of them, or a Recording; got {type(source).__name__}")
    for module, st in items.items():
        if not isinstance(st, AttentionStats):
            raise TypeError(f"head_summary: {module!r} maps to {type(st).__name__}, not AttentionStats")
        nk = st.meta.get("nk")
        if tokens is not None and nk is not None and len(tokens) != nk:
            raise ValueError(
                f"tokens has {len(tokens)} strings but {module or 'the stats'} attend over {nk} keys; "
                "pass one token per key position (the tokens the model read)"
            )
    rows = [r for module, st in items.items() for r in _heads(st, module, tokens)]
    rows.sort(key=lambda r: -r["score"])
    return HeadSummary(rows)
