"""A step-by-step narrative of a :class:`~qkv.reference.trace.Trace`, in English or Chinese.

The story follows one query token through the steps and quotes this trace's own numbers,
so a reader can redo every step by hand and check it. Tokens and heads are counted from 0.
When d_k is wider than :data:`~qkv.reference.render.WIDE_COLS` (a real model's 32 or 64), the
dot product with the most-attended key is quoted by its largest terms plus the sum of the rest,
and the weighted sum of many tokens by its largest terms, each with the exact total.
A score function gets a step of its own between the scaling and the mask, and a sink's share of
the row is told in the softmax step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import numpy as np

from ..locale import LANGUAGES, check_lang
from .render import WIDE_COLS, root, short, vec

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["explain", "LANGUAGES"]



def explain(t: "Trace", lang: str = "en", token: Union[int, str] = 0, precision: int = 3) -> str:
    """Narrate how query ``token`` (index or label) is turned into its output, quoting numbers."""
    check_lang(lang)
    i = _resolve(t, token)
    return (_En if lang == "en" else _Zh)(t, i, precision).text()


def _resolve(t: "Trace", token: Union[int, str]) -> int:
    if isinstance(token, str):
        if token not in t.tokens:
            raise ValueError(f"token={token!r} is not one of this trace's tokens {t.tokens}")
        return t.tokens.index(token)
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not -t.n <= token < t.n:
        raise ValueError(f"token={token!r} must be a token label or an index from {-t.n} to {t.n - 1}")
    return int(token) % t.n


class _Story:
    """Collects the facts of one query row; subclasses phrase them in one language."""

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

    def text(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError


def _join(items: list[str], last: str) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + last + items[-1]


class _En(_Story):
    def q(self, j: int) -> str:
        return f'"{self.tok(j)}"'

    def text(self) -> str:
        t, i, h = self.t, self.i, self.head
        me = self.q(i)
        lines = [f"How self-attention rewrites {me} (token {i} of tokens 0–{t.n - 1})", ""]
        if t.num_heads > 1:
            lines += [
                f"This layer has {t.num_heads} heads. Q and K have {t.num_heads}·d_k = {t.q.shape[1]} columns "
                f"and V has {t.v.shape[1]}; each head takes its own block of d_k = {t.d_k} columns "
                f"and runs steps 2–{self.numbering(h)['sum']} on it. Here is head 0:",
                "",
            ]
        lines += self.steps(h)
        lines += ["", self.verdict(h)]
        if t.num_heads > 1:
            lines += ["", "The other heads repeat the same steps on their own columns:"]
            for k, hk in enumerate(t.heads[1:], start=1):
                lines.append(f"  head {k}: " + self.verdict(hk, short_form=True))
            lines += [
                "",
                f"Placing the {t.num_heads} head outputs side by side gives {me} the row "
                f"{self.v(t.concat[i])} (length {t.concat.shape[1]}).",
            ]
        if t.projected is not None:
            src = "that row" if t.num_heads > 1 else "the output"
            lines.append(f"Multiplying {src} by W_O gives the layer's final vector for {me}: {self.v(t.projected[i])}.")
        lines += ["", "Every token at a glance (the key each query weighs most):"]
        lines += self.glance()
        return "\n".join(lines)

    def steps(self, h: "Trace") -> list[str]:
        t, i = self.t, self.i
        me = self.q(i)
        out = []
        if t.x is None:
            out.append(f"1. Query, key, value. Q, K and V were given directly; the query of {me} is "
                       f"q = {self.v(h.q[i])}.")
        elif t.num_heads > 1:
            out.append(f"1. Query, key, value. The embedding of {me}, x = {self.v(t.x[i])}, is multiplied by W_Q, W_K "
                       f"and W_V; head 0's share of {me}'s query is q = {self.v(h.q[i])}, of its key "
                       f"k = {self.v(h.k[i])}, of its value v = {self.v(h.v[i])}.")
        else:
            plus = ", and the biases b_Q, b_K, b_V are added" if self.biased() else ""
            out.append(f"1. Query, key, value. The embedding of {me}, x = {self.v(t.x[i])}, is multiplied by "
                       f"W_Q, W_K and W_V{plus}. That gives its query q = {self.v(h.q[i])} (what it is looking for), "
                       f"its key k = {self.v(h.k[i])} (what it can be found by) and its value "
                       f"v = {self.v(h.v[i])} (what it hands on). Every token gets its q, k and v the same way.")
        dots = [f"q·k({self.tok(j)}) = {self.n(h.scores[i, j])}" for j in range(t.n)]
        out.append(f"2. Dot products. The query of {me} is compared with the key of every token: "
                   f"{_join(dots, ' and ')}. The larger the dot product, the better that key matches the query.")
        j_top = int(h.top_keys[i])
        if h.d_k > WIDE_COLS and j_top >= 0:
            terms, rest, rest_sum, total = self.dot_terms(h, j_top)
            out[-1] += (f" Each is a sum of d_k = {h.d_k} products; for {self.q(j_top)} the largest are "
                        f"{_join(terms, ' and ')}, the other {rest} add up to {self.n(rest_sum)}, "
                        f"and the total is {self.n(total)}.")
        out.append(f"3. Scaling. Each score is divided by √d_k = {root(t.d_k, self.p)}, giving "
                   f"{_join([self.n(s) for s in h.scaled[i]], ' and ')}. Without this the scores grow with "
                   "d_k, and the softmax would pile nearly all weight on one key and learn slowly.")
        num = self.numbering(h)
        if h.modified is not None:
            out.append(f"{num['mod']}. Score function. " + self.modified(h))
        hidden, bias = self.hidden(h), self.bias(h)
        if h.masked is not None:
            parts = []
            if hidden:
                names = _join([self.q(j) for j in hidden], " and ")
                why = (f"{'it comes' if len(hidden) == 1 else 'they come'} after {me} and a causal mask "
                       "forbids looking ahead" if "causal" in h.mask_kinds and all(j > i for j in hidden)
                       else "the mask hides " + ("it" if len(hidden) == 1 else "them"))
                one = len(hidden) == 1
                parts.append(f"The score{'' if one else 's'} for {names} become{'s' if one else ''} -inf because "
                             f"{why}, so {'it' if one else 'they'} will get weight 0.")
            for j, d in bias:
                parts.append(f"The mask adds {self.n(d)} to the score for {self.q(j)}, "
                             f"making it {self.n(h.masked[i, j])}.")
            if not parts:
                parts.append(f"Nothing is hidden from {me}, so its row is unchanged.")
            out.append(f"{num['mask']}. Mask. " + " ".join(parts))
        j_top, w_top = self.focus(h)
        s, w = num["softmax"], num["sum"]
        if j_top < 0:
            gone = " A sink gets the whole row, but it has no value to hand on." if h.sinks is not None else ""
            out.append(f"{s}. Softmax. Every key is hidden from {me}, so there is nothing to weigh: all its "
                       f"weights are 0 (the row sums to 0, not 1).{gone}")
            out.append(f"{w}. Weighted sum. With no weights, the output of {me} is the zero vector "
                       f"{self.v(h.output[i])}.")
            return out
        ws = [f"{self.n(h.weights[i, j])} for {self.q(j)}" for j in range(t.n)]
        out.append(f"{s}. Softmax. Exponentiate the row and divide by its total: the weights are "
                   f"{_join(ws, ' and ')}; together they add up to {self.n(h.weights[i].sum())}.")
        if h.sinks is not None:
            logit, share = self.sink(h)
            out[-1] += (f" They fall short of 1 because this head has a sink: a logit {self.n(logit)} with no value that "
                        f"joins the total as exp({self.n(logit)}), so the sink absorbs {self.pct(share)}% of row {i}'s "
                        f"attention (1 − {self.n(h.weights[i].sum())} = {self.n(share)}) and hands nothing on.")
        order, rest = self.weight_terms(h)
        terms = [f"{self.n(h.weights[i, j])}·v({self.tok(j)})" for j in order]
        if rest:
            terms.append(f"the other {rest} tokens' weighted values (weight {self.n(h.weights[i].sum() - h.weights[i, order].sum())})")
        out.append(f"{w}. Weighted sum. The new vector of {me} is {' + '.join(terms)} = {self.v(h.output[i])}.")
        return out

    def verdict(self, h: "Trace", short_form: bool = False) -> str:
        me = self.q(self.i)
        j, wt = self.focus(h)
        if j < 0:
            return f"{me} could see no token, so its output is zero."
        target = "itself" if j == self.i else self.q(j)
        s = f"{me} attends most to {target} (weight {self.n(wt)})"
        if short_form:
            return s + "."
        row = h.weights[self.i][h.weights[self.i] > 0]
        if wt >= 0.9:
            s += ", so its new vector is almost a copy of " + ("its own value" if j == self.i else "that token's value")
        elif len(row) > 1 and row.max() - row.min() < 0.1:
            s += ", but it spreads its attention almost evenly over what it may see"
        if h.sinks is not None and self.sink(h)[1] > wt:
            s += f"; the sink absorbs even more ({self.pct(self.sink(h)[1])}%), so the output is shrunk towards zero"
        return "In short: " + s + "."

    def modified(self, h: "Trace") -> str:
        """What the score function did to query i's row, in plain words and this trace's numbers."""
        i, me = self.i, self.q(self.i)
        info = h.score_mod or {}
        kind, text = info.get("kind"), info.get("text", "")
        mod = h.modified
        assert mod is not None
        after = f"The scores of {me} become {_join([self.n(s) for s in mod[i]], ' and ')}."
        moved = self.changes(h)
        if kind == "softcap" and "cap" in info:
            c = self.n(info["cap"])
            big = ""
            if moved:
                j, _ = moved[0]
                big = (f" The score that moves most is {self.q(j)}'s: {self.n(h.scaled[i, j])} becomes "
                       f"{self.n(mod[i, j])}.")
            return (f"{text} squashes every score smoothly into (−{c}, {c}): scores much smaller than {c} "
                    f"barely move and large ones flatten out near ±{c}, so no single key can run away with the "
                    f"softmax. {after}{big}")
        if kind == "alibi" and info.get("slopes"):
            m = self.slope(h)
            rule = ("a key d positions away, on either side, loses m·d" if info.get("symmetric") else
                    "a key d positions before the query loses m·d (one d positions after it gains m·d; a causal "
                    "mask usually hides those)")
            ds = [f"{self.q(j)} {'loses' if d < 0 else 'gains'} {self.n(abs(d))} ({abs(j - i)} away)"
                  for j, d in sorted(moved)]
            what = f" For {me}: {_join(ds, ' and ')}." if ds else ""
            head = "this head's" if h.head is None else f"head {h.head}'s"
            return (f"{text}. Farther keys are penalised by slope·distance: with {head} slope m = "
                    f"{short(m, max(self.p, 4))}, {rule}.{what} {after} Nearby tokens are favoured without any "
                    "position embedding.")
        if kind == "relative_bias":
            ds = [f"{self.n(d)} for {self.q(j)}" for j, d in sorted(moved)]
            return (f"{text}. A learned number, looked up by how far each key is from the query, is added: "
                    f"{_join(ds, ' and ') or 'nothing for this row'}. {after}")
        name = info.get("name", text) if kind == "function" else text
        return (f"{name} is called on every scaled score (score, batch, head, query index, key index) and "
                f"returns a new one. {after}")

    # The one-line-per-head summary; the Chinese story swaps these words and punctuation.
    GLANCE_HEAD, GLANCE_NOTHING, GLANCE_PAIR, GLANCE_SEP = "  head {k}: ", "nothing", "{tok} ({w})", ", "

    def weight_terms(self, h: "Trace") -> tuple[list[int], int]:
        """Keys quoted in the weighted sum (all of them, or the heaviest few of many) and how many are left."""
        n = h.n
        if n <= WIDE_COLS:
            return list(range(n)), 0
        top = sorted(np.argsort(-h.weights[self.i], kind="stable")[: self.TOP_TERMS + 1].tolist())
        return top, n - len(top)

    def glance(self) -> list[str]:
        out = []
        for k, h in enumerate(self.head_list()):
            pre = self.GLANCE_HEAD.format(k=k) if self.t.num_heads > 1 else "  "
            items = []
            for i, j in enumerate(h.top_keys):
                seen = self.GLANCE_NOTHING if j < 0 else self.GLANCE_PAIR.format(tok=self.tok(int(j)), w=self.n(h.weights[i, j]))
                items.append(f"{self.tok(i)} → {seen}")
            out.append(pre + self.GLANCE_SEP.join(items))
        return out

    def head_list(self) -> list["Trace"]:
        return [self.t] if self.t.num_heads == 1 else list(self.t.heads)


class _Zh(_En):
    def q(self, j: int) -> str:
        return f"“{self.tok(j)}”"

    def text(self) -> str:
        t, i, h = self.t, self.i, self.head
        me = self.q(i)
        lines = [f"自注意力如何重新计算{me}的表示（词元 {i}，编号 0–{t.n - 1}）", ""]
        if t.num_heads > 1:
            lines += [
                f"这一层有 {t.num_heads} 个注意力头。Q 和 K 共有 {t.num_heads}·d_k = {t.q.shape[1]} 列，"
                f"V 有 {t.v.shape[1]} 列；每个头取自己的一段（d_k = {t.d_k} 列），独立完成第 2–{self.numbering(h)['sum']} 步。"
                "下面以头 0 为例：",
                "",
            ]
        lines += self.steps(h)
        lines += ["", self.verdict(h)]
        if t.num_heads > 1:
            lines += ["", "其余的头在各自的列上重复同样的步骤："]
            for k, hk in enumerate(t.heads[1:], start=1):
                lines.append(f"  头 {k}：" + self.verdict(hk, short_form=True))
            lines += ["", f"把 {t.num_heads} 个头的输出并排拼接，{me}得到一行 {self.v(t.concat[i])}"
                          f"（长度 {t.concat.shape[1]}）。"]
        if t.projected is not None:
            src = "这一行" if t.num_heads > 1 else "输出"
            lines.append(f"再把{src}乘以 W_O，就得到{me}在这一层的最终向量：{self.v(t.projected[i])}。")
        lines += ["", "所有词元一览（每个查询权重最大的键）："]
        lines += self.glance()
        return "\n".join(lines)

    def steps(self, h: "Trace") -> list[str]:
        t, i = self.t, self.i
        me = self.q(i)
        out = []
        if t.x is None:
            out.append(f"1. 查询、键、值。Q、K、V 是直接给定的；{me}的查询向量 q = {self.v(h.q[i])}。")
        elif t.num_heads > 1:
            out.append(f"1. 查询、键、值。{me}的嵌入向量 x = {self.v(t.x[i])} 分别乘以 W_Q、W_K、W_V；"
                       f"其中属于头 0 的部分是：查询 q = {self.v(h.q[i])}，键 k = {self.v(h.k[i])}，"
                       f"值 v = {self.v(h.v[i])}。")
        else:
            plus = "，再加上偏置 b_Q、b_K、b_V" if self.biased() else ""
            out.append(f"1. 查询、键、值。{me}的嵌入向量 x = {self.v(t.x[i])} 分别乘以 W_Q、W_K、W_V{plus}，"
                       f"得到它的查询向量 q = {self.v(h.q[i])}（它想找什么）、键向量 k = {self.v(h.k[i])}"
                       f"（别人凭什么找到它）和值向量 v = {self.v(h.v[i])}（它能提供的内容）。"
                       "每个词元都用同样的方式得到自己的 q、k、v。")
        dots = [f"q·k({self.tok(j)}) = {self.n(h.scores[i, j])}" for j in range(t.n)]
        out.append(f"2. 点积打分。用{me}的查询向量和每个词元的键向量做点积：{'，'.join(dots)}。"
                   "点积越大，说明这个键与查询越匹配。")
        j_top = int(h.top_keys[i])
        if h.d_k > WIDE_COLS and j_top >= 0:
            terms, rest, rest_sum, total = self.dot_terms(h, j_top)
            out[-1] += (f"每个点积都是 d_k = {h.d_k} 个乘积之和；与{self.q(j_top)}的点积中最大的几项是 "
                        f"{'，'.join(terms)}，其余 {rest} 项之和为 {self.n(rest_sum)}，总和为 {self.n(total)}。")
        out.append(f"3. 缩放。每个分数都除以 √d_k = {root(t.d_k, self.p)}，得到 {'、'.join(self.n(s) for s in h.scaled[i])}。"
                   "如果不缩放，分数会随 d_k 增大而变大，softmax 会把几乎全部权重压到一个键上，梯度也会变得很小。")
        num = self.numbering(h)
        if h.modified is not None:
            out.append(f"{num['mod']}. 打分函数。" + self.modified(h))
        hidden, bias = self.hidden(h), self.bias(h)
        if h.masked is not None:
            parts = []
            if hidden:
                names = "、".join(self.q(j) for j in hidden)
                if "causal" in h.mask_kinds and all(j > i for j in hidden):
                    these = "它的分数" if len(hidden) == 1 else "这些分数"
                    parts.append(f"{names}位于{me}之后，因果掩码不允许提前看到后面的词元，"
                                 f"所以{these}被设为 -inf，权重将为 0")
                else:
                    parts.append(f"掩码屏蔽了{names}，对应的分数被设为 -inf，权重将为 0")
            for j, d in bias:
                parts.append(f"掩码给{self.q(j)}的分数加上 {self.n(d)}，变为 {self.n(h.masked[i, j])}")
            if not parts:
                parts.append(f"{me}没有被屏蔽的键，这一行保持不变")
            out.append(f"{num['mask']}. 掩码。" + "；".join(parts) + "。")
        s, w = num["softmax"], num["sum"]
        j_top, _ = self.focus(h)
        if j_top < 0:
            gone = "汇聚项（sink）拿走了整行，但它没有值可以提供。" if h.sinks is not None else ""
            out.append(f"{s}. Softmax 归一化。{me}的所有键都被屏蔽了，没有可以分配的权重：这一行全是 0（行和为 0，而不是 1）。{gone}")
            out.append(f"{w}. 加权求和。没有权重，{me}的输出就是零向量 {self.v(h.output[i])}。")
            return out
        ws = [f"{self.q(j)}得到 {self.n(h.weights[i, j])}" for j in range(t.n)]
        out.append(f"{s}. Softmax 归一化。对这一行取指数再除以总和：{'，'.join(ws)}，"
                   f"加起来等于 {self.n(h.weights[i].sum())}。")
        if h.sinks is not None:
            logit, share = self.sink(h)
            out[-1] += (f"之所以不到 1，是因为这个头有一个汇聚项（sink）：一个没有值的 logit {self.n(logit)}，"
                        f"它以 exp({self.n(logit)}) 加进分母，所以汇聚项吸收了第 {i} 行 {self.pct(share)}% 的注意力"
                        f"（1 − {self.n(h.weights[i].sum())} = {self.n(share)}），却什么也不传递。")
        order, rest = self.weight_terms(h)
        terms = [f"{self.n(h.weights[i, j])}·v({self.tok(j)})" for j in order]
        if rest:
            terms.append(f"其余 {rest} 个词元的加权值（权重合计 {self.n(h.weights[i].sum() - h.weights[i, order].sum())}）")
        out.append(f"{w}. 加权求和。{me}的新向量 = {' + '.join(terms)} = {self.v(h.output[i])}。")
        return out

    def verdict(self, h: "Trace", short_form: bool = False) -> str:
        me = self.q(self.i)
        j, wt = self.focus(h)
        if j < 0:
            return f"{me}看不到任何词元，所以输出为零。"
        target = "它自己" if j == self.i else self.q(j)
        s = f"{me}最关注{target}（权重 {self.n(wt)}）"
        if short_form:
            return s + "。"
        row = h.weights[self.i][h.weights[self.i] > 0]
        if wt >= 0.9:
            s += "，它的新向量几乎就是" + ("它自己的值向量" if j == self.i else "那个词元的值向量")
        elif len(row) > 1 and row.max() - row.min() < 0.1:
            s += "，不过它的注意力在能看到的词元之间分布得相当均匀"
        if h.sinks is not None and self.sink(h)[1] > wt:
            s += f"；汇聚项吸收的更多（{self.pct(self.sink(h)[1])}%），所以输出被整体缩小，向零靠拢"
        return "总结：" + s + "。"

    def modified(self, h: "Trace") -> str:
        i, me = self.i, self.q(self.i)
        info = h.score_mod or {}
        kind, text = info.get("kind"), info.get("text", "")
        mod = h.modified
        assert mod is not None
        after = f"于是{me}的分数变为 {'、'.join(self.n(s) for s in mod[i])}。"
        moved = self.changes(h)
        if kind == "softcap" and "cap" in info:
            c = self.n(info["cap"])
            big = ""
            if moved:
                j, _ = moved[0]
                big = f"变化最大的是{self.q(j)}的分数：{self.n(h.scaled[i, j])} 变成 {self.n(mod[i, j])}。"
            return (f"{text} 把每个分数都平滑地压进 (−{c}, {c})：远小于 {c} 的分数几乎不变，大的分数在 ±{c} 附近变平，"
                    f"这样没有哪个键能独占 softmax；{after}{big}")
        if kind == "alibi" and info.get("slopes"):
            m = self.slope(h)
            rule = ("无论在前还是在后，相隔 d 个位置的键都减去 m·d" if info.get("symmetric") else
                    "查询之前相隔 d 个位置的键减去 m·d（之后的键反而加上 m·d，通常被因果掩码遮住）")
            ds = [f"{self.q(j)}{'减去' if d < 0 else '加上'} {self.n(abs(d))}（相隔 {abs(j - i)}）" for j, d in sorted(moved)]
            what = ("：" + "，".join(ds)) if ds else ""
            head = "这个头" if h.head is None else f"头 {h.head} "
            return (f"{text}。距离越远的键被罚得越多，罚分 = 斜率 × 距离：{head}的斜率 m = {short(m, max(self.p, 4))}，"
                    f"{rule}。对{me}来说{what}；{after}"
                    "这样不需要位置编码，也会偏向附近的词元。")
        if kind == "relative_bias":
            ds = [f"{self.q(j)}加上 {self.n(d)}" for j, d in sorted(moved)]
            return (f"{text}。按每个键与查询的距离查表，加上一个学到的数：{'，'.join(ds) or '这一行没有变化'}；{after}")
        name = info.get("name", text) if kind == "function" else text
        return f"{name} 作用在每个缩放后的分数上（参数：分数、批次、头、查询位置、键位置），返回新的分数；{after}"

    GLANCE_HEAD, GLANCE_NOTHING, GLANCE_PAIR, GLANCE_SEP = "  头 {k}：", "（无）", "{tok}（{w}）", "，"

