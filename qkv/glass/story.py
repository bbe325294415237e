"""A step-by-step narrative of a :class:`~qkv.glass.trace.Trace`, in English or Chinese.

The story follows one query token through the steps and quotes this trace's own numbers,
so a reader can redo every step by hand and check it. Tokens and heads are counted from 0.
When d_k is wider than :data:`~qkv.glass.render.WIDE_COLS` (a real model's 32 or 64), the
dot product with the most-attended key is quoted by its largest terms plus the sum of the rest,
and the weighted sum of many tokens by its largest terms, each with the exact total.
A score function gets a step of its own between the scaling and the mask, and a sink's share of
the row is told in the softmax step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import numpy as np

from ..locale import LANGUAGES, check_lang, text
from .render import WIDE_COLS, root, short, vec

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["explain", "LANGUAGES"]


def explain(t: "Trace", lang: str = "en", token: Union[int, str] = 0, precision: int = 3) -> str:
    """Narrate how query ``token`` (index or label) is turned into its output, quoting numbers."""
    check_lang(lang)
    i = _resolve(t, token)
    return _Story(t, i, precision, lang).text()


def _resolve(t: "Trace", token: Union[int, str]) -> int:
    if isinstance(token, str):
        if token not in t.tokens:
            raise ValueError(f"token={token!r} is not one of this trace's tokens {t.tokens}")
        return t.tokens.index(token)
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not -t.n <= token < t.n:
        raise ValueError(f"token={token!r} must be a token label or an index from {-t.n} to {t.n - 1}")
    return int(token) % t.n


class _Facts:
    """The facts of one query row, in numbers; :class:`_Story` tells them."""

    def __init__(self, t: "Trace", i: int, precision: int) -> None:
        self.t, self.i, self.p = t, i, precision
        self.head = t if t.num_heads == 1 else t.heads[0]

    def n(self, v: float) -> str:
        return short(float(v), self.p)

    def v(self, a: np.ndarray) -> str:
        return vec(a, self.p)

    def tok(self, j: int) -> str:
        return self.t.tokens[j]

    def hidden(self, h: "Trace") -> list[int]:
        """Keys that query i may not see in head h."""
        if h.masked is None:
            return []
        return [j for j in range(h.n) if np.isneginf(h.masked[self.i, j])]

    def bias(self, h: "Trace") -> list[tuple[int, float]]:
        """(key, value added) for the visible keys a float mask shifted."""
        if h.masked is None or "float" not in h.mask_kinds:
            return []
        base = h.scaled if h.modified is None else h.modified
        out = []
        for j in range(h.n):
            if np.isfinite(h.masked[self.i, j]):
                d = h.masked[self.i, j] - base[self.i, j]
                if abs(d) > 1e-12:
                    out.append((j, float(d)))
        return out

    TOP_TERMS = 4  # products quoted from a long dot product, weighted terms from a long sum

    def dot_terms(self, h: "Trace", j: int) -> tuple[list[str], int, float, float]:
        """The largest products of q_i·k_j as "q[d]·k[d]" texts, how many are left, their sum, the total."""
        q, k = h.q[self.i], h.k[j]
        prod = q * k  # (d_k,)
        top = np.argsort(-np.abs(prod), kind="stable")[: self.TOP_TERMS]
        def paren(x: float) -> str:
            return f"({self.n(x)})" if self.n(x).startswith("-") else self.n(x)

        terms = [f"q[{d}]·k[{d}] = {paren(q[d])}·{paren(k[d])}" for d in top]
        return terms, len(prod) - len(top), float(prod.sum() - prod[top].sum()), float(prod.sum())

    def biased(self) -> bool:
        return any(getattr(self.t, n) is not None for n in ("b_q", "b_k", "b_v"))

    def numbering(self, h: "Trace") -> dict[str, int]:
        """Step numbers after the scaling (3): the score function and the mask only when present."""
        k, out = 4, {}
        for name, present in (("mod", h.modified is not None), ("mask", h.masked is not None), ("softmax", True),
                              ("sum", True)):
            if present:
                out[name] = k
                k += 1
        return out

    def changes(self, h: "Trace") -> list[tuple[int, float]]:
        """(key, modified − scaled) for query i's keys the score function moved, largest first."""
        assert h.modified is not None
        d = h.modified[self.i] - h.scaled[self.i]
        order = np.argsort(-np.abs(d), kind="stable")
        return [(int(j), float(d[j])) for j in order if np.isfinite(d[j]) and abs(d[j]) > 1e-12]

    def slope(self, h: "Trace") -> float:
        info = h.score_mod or {}
        return float(info["slopes"][0 if h.head is None else h.head])

    def sink(self, h: "Trace") -> tuple[float, float]:
        """(this head's sink logit, the share of query i's attention it absorbed)."""
        assert h.sinks is not None
        return float(h.sinks[0]), float(h.sink_share[self.i])

    def pct(self, x: float) -> str:
        return short(100 * x, 1)

    def focus(self, h: "Trace") -> tuple[int, float]:
        j = int(h.top_keys[self.i])
        return j, (float(h.weights[self.i, j]) if j >= 0 else 0.0)


def _join(items: list[str], sep: str, last: str) -> str:
    """``a, b and c``: ``sep`` between the items, ``last`` before the final one."""
    if len(items) <= 1:
        return "".join(items)
    return sep.join(items[:-1]) + last + items[-1]


class _Story(_Facts):
    """The story of one query row in one language: every sentence is a catalogue message
    (``story.*``), so the code path is the same for every language."""

    def __init__(self, t: "Trace", i: int, precision: int, lang: str) -> None:
        super().__init__(t, i, precision)
        self.lang = lang

    def say(self, key: str, **values: object) -> str:
        return text("story." + key, self.lang, **values)

    def listed(self, items: list[str]) -> str:
        """Items of a sentence's list ("a, b and c")."""
        return _join(items, self.say("list_sep"), self.say("list_last"))

    def enum(self, items: list[str]) -> str:
        """Numbers or names in a row ("1, 2 and 3"; Chinese separates them with 、)."""
        return _join(items, self.say("enum_sep"), self.say("enum_last"))

    def q(self, j: int) -> str:
        return self.say("quote", tok=self.tok(j))

    def text(self) -> str:
        t, i, h = self.t, self.i, self.head
        me = self.q(i)
        lines = [self.say("title", me=me, i=i, last=t.n - 1), ""]
        if t.num_heads > 1:
            lines += [self.say("heads", H=t.num_heads, qk=t.q.shape[1], v=t.v.shape[1], d_k=t.d_k,
                               last_step=self.numbering(h)["sum"]), ""]
        lines += self.steps(h)
        lines += ["", self.verdict(h)]
        if t.num_heads > 1:
            lines += ["", self.say("other_heads")]
            for k, hk in enumerate(t.heads[1:], start=1):
                lines.append(self.say("other_head", k=k, verdict=self.verdict(hk, short_form=True)))
            assert t.concat is not None  # a multi-head trace keeps the heads' outputs side by side
            lines += ["", self.say("concat", H=t.num_heads, me=me, row=self.v(t.concat[i]), n=t.concat.shape[1])]
        if t.projected is not None:
            key = "projected_row" if t.num_heads > 1 else "projected"
            lines.append(self.say(key, me=me, row=self.v(t.projected[i])))
        lines += ["", self.say("glance")]
        lines += self.glance()
        return "\n".join(lines)

    def steps(self, h: "Trace") -> list[str]:
        """The numbered steps for query i in head h: projections, dot products, scaling, the
        score function and the mask when present, softmax, weighted sum."""
        out = [self.projections(h)] + self.scoring(h)
        num = self.numbering(h)
        if h.modified is not None:
            out.append(self.say("score_fn", step=num["mod"], what=self.modified(h)))
        if h.masked is not None:
            out.append(self.say("mask", step=num["mask"], parts=self.say("mask_sep").join(self.mask_parts(h))))
        return out + self.weighing(h, num["softmax"], num["sum"])

    def projections(self, h: "Trace") -> str:
        """Step 1: where query i's q, k and v come from."""
        t, i = self.t, self.i
        me = self.q(i)
        if t.x is None:
            return self.say("qkv_given", me=me, q=self.v(h.q[i]))
        vectors = {"me": me, "x": self.v(t.x[i]), "q": self.v(h.q[i]), "k": self.v(h.k[i]), "v": self.v(h.v[i])}
        if t.num_heads > 1:
            return self.say("qkv_heads", **vectors)
        return self.say("qkv_biased" if self.biased() else "qkv", **vectors)

    def scoring(self, h: "Trace") -> list[str]:
        """Steps 2 and 3: the dot products (a wide one by its largest terms) and the scaling."""
        t, i = self.t, self.i
        dots = [f"q·k({self.tok(j)}) = {self.n(h.scores[i, j])}" for j in range(t.n)]
        out = [self.say("dots", me=self.q(i), dots=self.listed(dots))]
        j_top = int(h.top_keys[i])
        if h.d_k > WIDE_COLS and j_top >= 0:
            terms, rest, rest_sum, total = self.dot_terms(h, j_top)
            out[-1] += self.say("dot_terms", d_k=h.d_k, other=self.q(j_top), terms=self.listed(terms), rest=rest,
                                rest_sum=self.n(rest_sum), total=self.n(total))
        out.append(self.say("scaling", root=root(t.d_k, self.p), scores=self.enum([self.n(s) for s in h.scaled[i]])))
        return out

    def mask_parts(self, h: "Trace") -> list[str]:
        """The mask step's sentences: the keys it hides, the scores it shifts, or that it did nothing."""
        i, me = self.i, self.q(self.i)
        assert h.masked is not None  # called only for a masked head
        hidden, parts = self.hidden(h), []
        if hidden:
            causal = "causal" in h.mask_kinds and all(j > i for j in hidden)
            key = ("hidden_causal" if causal else "hidden") + ("_one" if len(hidden) == 1 else "_many")
            parts.append(self.say(key, names=self.enum([self.q(j) for j in hidden]), me=me))
        for j, d in self.bias(h):
            parts.append(self.say("mask_adds", d=self.n(d), other=self.q(j), s=self.n(h.masked[i, j])))
        return parts or [self.say("mask_nothing", me=me)]

    def weighing(self, h: "Trace", s: int, w: int) -> list[str]:
        """Steps ``s`` and ``w``: the softmax (and a sink's share) and the weighted sum of values."""
        t, i, me = self.t, self.i, self.q(self.i)
        j_top, _ = self.focus(h)
        if j_top < 0:
            return [self.say("softmax_empty_sink" if h.sinks is not None else "softmax_empty", step=s, me=me),
                    self.say("sum_empty", step=w, me=me, out=self.v(h.output[i]))]
        ws = [self.say("weight_of", w=self.n(h.weights[i, j]), other=self.q(j)) for j in range(t.n)]
        out = [self.say("softmax", step=s, weights=self.listed(ws), total=self.n(h.weights[i].sum()))]
        if h.sinks is not None:
            logit, share = self.sink(h)
            out[-1] += self.say("sink", logit=self.n(logit), pct=self.pct(share), i=i,
                                total=self.n(h.weights[i].sum()), share=self.n(share))
        order, rest = self.weight_terms(h)
        terms = [f"{self.n(h.weights[i, j])}·v({self.tok(j)})" for j in order]
        if rest:
            terms.append(self.say("other_terms", rest=rest, w=self.n(h.weights[i].sum() - h.weights[i, order].sum())))
        out.append(self.say("sum", step=w, me=me, terms=" + ".join(terms), out=self.v(h.output[i])))
        return out

    def verdict(self, h: "Trace", short_form: bool = False) -> str:
        me = self.q(self.i)
        j, wt = self.focus(h)
        if j < 0:
            return self.say("sees_nothing", me=me)
        if j == self.i:
            s = self.say("attends_self", me=me, w=self.n(wt))
        else:
            s = self.say("attends", me=me, target=self.q(j), w=self.n(wt))
        if short_form:
            return self.say("verdict_short", verdict=s)
        row = h.weights[self.i][h.weights[self.i] > 0]
        if wt >= 0.9:
            s = self.say("copy_self" if j == self.i else "copy_other", verdict=s)
        elif len(row) > 1 and row.max() - row.min() < 0.1:
            s = self.say("even", verdict=s)
        if h.sinks is not None and self.sink(h)[1] > wt:
            s = self.say("sink_more", verdict=s, pct=self.pct(self.sink(h)[1]))
        return self.say("in_short", verdict=s)

    def modified(self, h: "Trace") -> str:
        """What the score function did to query i's row, in plain words and this trace's numbers."""
        i, me = self.i, self.q(self.i)
        info = h.score_mod or {}
        kind, fn = info.get("kind"), info.get("text", "")
        mod = h.modified
        assert mod is not None
        after = self.say("after", me=me, scores=self.enum([self.n(s) for s in mod[i]]))
        moved = self.changes(h)
        if kind == "softcap" and "cap" in info:
            big = ""
            if moved:
                j, _ = moved[0]
                big = self.say("softcap_big", other=self.q(j), a=self.n(h.scaled[i, j]), b=self.n(mod[i, j]))
            return self.say("softcap", fn=fn, c=self.n(info["cap"]), after=after, big=big)
        if kind == "alibi" and info.get("slopes"):
            rule = self.say("alibi_rule_symmetric" if info.get("symmetric") else "alibi_rule")
            ds = [self.say("alibi_loses" if d < 0 else "alibi_gains", other=self.q(j), d=self.n(abs(d)), dist=abs(j - i))
                  for j, d in sorted(moved)]
            head = self.say("alibi_this_head") if h.head is None else self.say("alibi_head", h=h.head)
            return self.say("alibi" if ds else "alibi_still", fn=fn, head=head, m=short(self.slope(h), max(self.p, 4)),
                            rule=rule, me=me, moves=self.listed(ds), after=after)
        if kind == "relative_bias":
            ds = [self.say("relative_item", d=self.n(d), other=self.q(j)) for j, d in sorted(moved)]
            return self.say("relative", fn=fn, moves=self.listed(ds) or self.say("relative_none"), after=after)
        name = info.get("name", fn) if kind == "function" else fn
        return self.say("function", fn=name, after=after)

    def weight_terms(self, h: "Trace") -> tuple[list[int], int]:
        """Keys quoted in the weighted sum (all of them, or the heaviest few of many) and how many are left."""
        n = h.n
        if n <= WIDE_COLS:
            return list(range(n)), 0
        top = sorted(np.argsort(-h.weights[self.i], kind="stable")[: self.TOP_TERMS + 1].tolist())
        return top, n - len(top)

    def glance(self) -> list[str]:
        """One line per head: every query and the key it weighs most."""
        out = []
        for k, h in enumerate(self.head_list()):
            pre = self.say("glance_head", k=k) if self.t.num_heads > 1 else "  "
            items = []
            for i, j in enumerate(h.top_keys):
                seen = (self.say("glance_nothing") if j < 0
                        else self.say("glance_pair", tok=self.tok(int(j)), w=self.n(h.weights[i, j])))
                items.append(f"{self.tok(i)} → {seen}")
            out.append(pre + self.say("glance_sep").join(items))
        return out

    def head_list(self) -> list["Trace"]:
        return [self.t] if self.t.num_heads == 1 else list(self.t.heads)
