"""Multi-head attention as a module: projections around :func:`qkv.attention`.

Shape legend::

    B batch        Nq query length      Nk key length (all cached keys when decoding)
    H query heads  Hk key/value heads   Dh head dim = d_model / H
    E d_model      Ek kdim              Ev vdim

Conventions that differ from ``torch.nn.MultiheadAttention``:

* inputs are always batch-first, ``(B, N, E)``;
* boolean masks are True where a query **may attend** (``key_padding_mask`` included; a
  torch padding mask converts with ``~mask``);
* a 3-D ``attn_mask`` is ``(B, Nq, Nk)`` (torch uses ``(B·H, Nq, Nk)``);
* grouped-query / multi-query attention: ``num_kv_heads < num_heads`` shrinks the key and
  value projections; query head ``h`` reads key/value head ``h // (H / Hk)``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .. import hooks
from ..call import BackendName
from ..functional import attention, attention_weights
from ..masks.rules import IsCausal
from ..score_mods.base import ScoreFn, ScoreMod, check_score_mod
from ..sparse import BlockSparseMask
from .cache import KVCache
from .positional import RotaryEmbedding

__all__ = ["MultiHeadAttention"]

CausalArg = IsCausal


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_inputs(query: Tensor, key: Tensor, value: Tensor, d_model: int, kdim: int, vdim: int,
                 self_attention: bool) -> None:
    """Batch-first ``(B, N, width)`` float query, key and value of one batch, with a value per key;
    each mistake named with its fix (for every module that takes them as MultiHeadAttention does)."""
    for name, x, width, width_name in (
        ("query", query, d_model, "d_model"),
        ("key", key, kdim, "kdim"),
        ("value", value, vdim, "vdim"),
    ):
        if x.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D (B, N, {width}) batch-first, got shape {tuple(x.shape)}; "
                f"add a batch dimension with {name}.unsqueeze(0), or, for sequence-first "
                f"(N, B, E) inputs as in torch.nn.MultiheadAttention, use {name}.transpose(0, 1)"
            )
        if not x.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor (B, N, {width}), got {x.dtype}; token ids go through "
                f"an embedding first (torch.nn.Embedding), numbers can be converted with {name}.float()"
            )
        if x.shape[-1] != width:
            hint = (
                "; for self-attention with kdim/vdim != d_model pass key and value explicitly"
                if self_attention and name != "query"
                else ""
            )
            raise ValueError(
                f"{name} has last dimension {x.shape[-1]} but this module expects "
                f"{width_name}={width}{hint}"
            )
    if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
        raise ValueError(
            f"batch sizes differ: query {query.shape[0]}, key {key.shape[0]}, value {value.shape[0]}; "
            "query, key and value must hold the same batch of sequences (lengths may differ)"
        )
    if key.shape[1] != value.shape[1]:
        raise ValueError(
            f"key has {key.shape[1]} positions but value has {value.shape[1]}; each key needs a value"
        )


class MultiHeadAttention(nn.Module):
    """Multi-head (optionally grouped-query) attention, batch-first.

    Args:
        d_model: model width E; the query input and the output are ``(B, N, E)``.
        num_heads: query heads H; ``d_model`` must be divisible by it.
        num_kv_heads: key/value heads Hk (default H). ``Hk < H`` is grouped-query attention,
            ``Hk = 1`` multi-query attention; H must be a multiple of Hk.
        bias: add biases to the four projections.
        dropout: dropout on the attention weights, active in training mode only.
        kdim: feature size of the key input (default ``d_model``).
        vdim: feature size of the value input (default ``d_model``).
        score_mod: a score function for every call (:mod:`qkv.score_mods`, e.g. ``Softcap(50.0)``
            or ``ALiBi(alibi_slopes(H))``, or ``fn(score, batch, head, q_idx, kv_idx)``); a
            built-in's tensors that are ``nn.Parameter`` become this module's parameters.
        sinks: learn one attention-sink logit per query head (``self.sinks``, (H,), zeros at
            init), joining every row's softmax denominator (:mod:`qkv.sinks`).

    Parameters: ``q_proj`` (E → E), ``k_proj`` (Ek → Hk·Dh), ``v_proj`` (Ev → Hk·Dh),
    ``out_proj`` (E → E).

    Hook points (:mod:`qkv.hooks`; set by :func:`qkv.inspect.record`, :func:`qkv.inspect.patch`
    and friends; none registered costs one dictionary lookup): ``"q"`` (B, H, Nq, Dh),
    ``"k"``/``"v"`` (B, Hk, Nk, Dh) after the head split, rotary and cache, ``"weights"``
    (B, H, Nq, Nk) (edits only: they are then materialised and multiplied by V), ``"lse"``
    (B, H, Nq) or None with the attention call's query, key and mask arguments as context, and
    ``"output"`` (B, H, Nq, Dh) before the heads merge. Edits apply before observers, so a
    recording inside a patch sees the patched tensors.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: Optional[int] = None,
        bias: bool = True,
        dropout: float = 0.0,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        score_mod: Optional[Union[ScoreMod, ScoreFn]] = None,
        sinks: bool = False,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        if num_heads <= 0 or d_model <= 0:
            raise ValueError(f"d_model={d_model} and num_heads={num_heads} must be positive")
        if d_model % num_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by num_heads={num_heads}; each head gets "
                f"d_model / num_heads features, so pick num_heads from {_divisors(d_model)}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; each "
                f"key/value head serves a whole group of query heads, so pick num_kv_heads "
                f"from {_divisors(num_heads)}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout} must be in [0, 1)")
        factory = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = d_model // num_heads
        self.kdim = d_model if kdim is None else kdim
        self.vdim = d_model if vdim is None else vdim
        self.dropout = dropout
        kv_width = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, kv_width, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.score_mod = check_score_mod(score_mod)
        if isinstance(score_mod, ScoreMod):
            score_mod.check_heads(num_heads)
            for i, t in enumerate(score_mod.tensors()):
                if isinstance(t, nn.Parameter):
                    self.register_parameter(f"score_mod_{i}", t)
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None

    # ----------------------------------------------------------------------------- checks
    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor, self_attention: bool) -> None:
        check_inputs(query, key, value, self.d_model, self.kdim, self.vdim, self_attention)

    def _head_mask(
        self, attn_mask: Union[Tensor, BlockSparseMask], b: int, nq: int, nk: int, device: torch.device
    ) -> Union[Tensor, BlockSparseMask]:
        """attn_mask (Nq, Nk) | (B, Nq, Nk) | (B, H, Nq, Nk) → broadcastable to (B, H, Nq, Nk).

        A :class:`BlockSparseMask` with a 2-D or 4-D layout goes to :func:`qkv.attention` as it
        is (it carries its block layout there); a 3-D layout means ``(B, Nq, Nk)`` here but
        ``(H, Nq, Nk)`` to :func:`qkv.attention`, so it is densified and read as this module reads masks.
        """
        if isinstance(attn_mask, BlockSparseMask):
            if attn_mask.layout.dim() != 3:
                self._check_mask_shape((*attn_mask.layout.shape[:-2], *attn_mask.shape), b, nq, nk)
                return attn_mask
            attn_mask = attn_mask.to_dense(device)  # (B, Nq, Nk): what the layout means
        self._check_mask_shape(tuple(attn_mask.shape), b, nq, nk)
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(
                f"attn_mask must be bool (True = may attend) or float (added to the scores), got {attn_mask.dtype}"
            )
        return attn_mask.unsqueeze(1) if attn_mask.dim() == 3 else attn_mask  # (B, 1, Nq, Nk)

    def _check_mask_shape(self, given: Tuple[int, ...], b: int, nq: int, nk: int) -> None:
        shape = (given[0], 1, *given[1:]) if len(given) == 3 else given
        ok = len(shape) in (2, 4) and shape[-2:] == (nq, nk)
        if ok and len(shape) == 4:
            ok = shape[0] in (1, b) and shape[1] in (1, self.num_heads)
        if not ok:
            raise ValueError(
                f"attn_mask has shape {given}; expected (Nq, Nk), (B, Nq, Nk) or "
                f"(B, H, Nq, Nk) with B={b}, H={self.num_heads}, Nq={nq}, Nk={nk} "
                "(Nk counts cached keys too). Note: a torch.nn.MultiheadAttention (B*H, Nq, Nk) mask "
                f"must be reshaped to (B, H, Nq, Nk)"
            )

    # ---------------------------------------------------------------------------- forward
    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        *,
        attn_mask: Optional[Union[Tensor, BlockSparseMask]] = None,
        key_padding_mask: Optional[Tensor] = None,
        is_causal: CausalArg = False,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        cache: Optional[KVCache] = None,
        rotary: Optional[RotaryEmbedding] = None,
        positions: Optional[Tensor] = None,
        window: Optional[Tuple[Optional[int], Optional[int]]] = None,
        backend: BackendName = "auto",
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Attend from ``query`` (B, Nq, E) to ``key`` (B, Nk, Ek) / ``value`` (B, Nk, Ev).

        Self-attention when ``key`` and ``value`` are None; ``value`` defaults to ``key``.

        Args:
            attn_mask: bool (True = may attend) or float (added to scaled scores), shaped
                ``(Nq, Nk)``, ``(B, Nq, Nk)`` or ``(B, H, Nq, Nk)``.
            key_padding_mask: bool ``(B, Nk)``, True = real key, False = padding.
            is_causal: False, True (query i sees keys 0..i) or ``"bottom_right"``. With a
                ``cache``, True means ``"bottom_right"``: the new queries follow the cache.
            need_weights: also return the attention weights (computed on the materialising
                path, with the pre-dropout probabilities returned), averaged over heads to
                ``(B, Nq, Nk)`` unless ``average_attn_weights=False`` → ``(B, H, Nq, Nk)``.
            cache: a :class:`KVCache`; new keys/values are appended and the queries attend
                to every cached position. ``key_padding_mask`` may cover the new keys
                ``(B, n)`` or all ``(B, N)`` keys; ``attn_mask`` must span all N keys.
            rotary: a :class:`RotaryEmbedding` applied to queries and new keys after the
                head split, at positions ``cache.length, cache.length + 1, ...`` (0-based
                without a cache) unless ``positions`` ((N,) or (B, N)) says otherwise.
            window: sliding window ``(left, right)``, aligned like ``is_causal`` (so with a
                cache, pass ``is_causal=True`` too: ``window=(w, 0)`` is causal local attention).
            backend: passed to :func:`qkv.attention`.

        Returns:
            ``(out (B, Nq, E), weights or None)``.
        """
        key, value = self._check_call(query, key, value, key_padding_mask)
        b, nq, _ = query.shape
        past = 0 if cache is None else cache.length

        # 1. project, 2. split heads: (B, N, heads·Dh) -> (B, heads, N, Dh), rotate
        q, k, v = self._project(query, key, value, rotary, positions, past)
        nk = past + k.shape[2]  # every key the queries will see
        if attn_mask is not None:  # checked before the cache is touched, so a bad call changes nothing
            attn_mask = self._head_mask(attn_mask, b, nq, nk, query.device)
        if cache is not None:
            k, v, key_padding_mask = cache.update(k, v, key_padding_mask)  # (B, Hk, Nk, Dh) each
            if is_causal is True:
                is_causal = "bottom_right"
        elif key_padding_mask is not None and key_padding_mask.shape != (b, nk):
            raise ValueError(
                f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected (B, Nk) = ({b}, {nk})"
            )
        masks: dict[str, Any] = dict(attn_mask=attn_mask, is_causal=is_causal, window=window, key_padding_mask=key_padding_mask)
        if self.score_mod is not None:
            masks["score_mod"] = self.score_mod
        if self.sinks is not None:
            masks["sinks"] = self.sinks

        # 3. attention: (B, H, Nq, Dh) x (B, Hk, Nk, Dh) -> (B, H, Nq, Dh), through the hook points
        out, weights = self._attend(q, k, v, masks, need_weights, backend)

        # 4. merge heads: (B, H, Nq, Dh) -> (B, Nq, H·Dh)
        out = out.transpose(1, 2).reshape(b, nq, self.d_model)  # (B, Nq, E)

        # 5. output projection
        out = self.out_proj(out)  # (B, Nq, E)

        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, Nq, Nk)
        return out, weights

    def _check_call(
        self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor], key_padding_mask: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor]:
        """The key and value to use (self-attention when both are None), after the input checks."""
        self_attention = key is None and value is None
        if key is None and value is not None:
            raise ValueError("value was given without key; pass key too (or neither for self-attention)")
        if key is None:
            key = query
        if value is None:
            value = key
        self._check_inputs(query, key, value, self_attention)
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"key_padding_mask must be bool with True = may attend, got {key_padding_mask.dtype}; "
                "a torch.nn.MultiheadAttention mask (True = ignore) converts with ~mask"
            )
        return key, value

    def _project(
        self, query: Tensor, key: Tensor, value: Tensor, rotary: Optional[RotaryEmbedding],
        positions: Optional[Tensor], past: int,
    ) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Steps 1 and 2: project, split heads, rotate → q (B, H, Nq, Dh), k/v (B, Hk, n, Dh)."""
        b, nq, _ = query.shape
        h, hk, dh = self.num_heads, self.num_kv_heads, self.head_dim
        n = key.shape[1]  # new keys: Nk without a cache
        q = self.q_proj(query).view(b, nq, h, dh).transpose(1, 2)  # (B, Nq, H·Dh) -> (B, H, Nq, Dh)
        k = self.k_proj(key).view(b, n, hk, dh).transpose(1, 2)  # (B, n, Hk·Dh) -> (B, Hk, n, Dh)
        v = self.v_proj(value).view(b, n, hk, dh).transpose(1, 2)  # (B, n, Hk·Dh) -> (B, Hk, n, Dh)
        if rotary is not None:
            if positions is not None and n != nq:
                raise ValueError(
                    "positions= applies to queries and keys alike, so it needs as many new keys as "
                    f"queries; got {nq} queries and {n} keys"
                )
            q = rotary.rotate(q, offset=past, positions=positions)  # (B, H, Nq, Dh)
            k = rotary.rotate(k, offset=past, positions=positions)  # (B, Hk, n, Dh)
        elif positions is not None:
            raise ValueError("positions= only has an effect together with rotary=")
        return q, k, v

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, masks: dict[str, Any], need_weights: bool, backend: BackendName
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Step 3 with its hook points (:mod:`qkv.hooks`): edits first, then observers, so a
        recording inside a patch sees the patched tensors → ``(out (B, H, Nq, Dh), weights
        (B, H, Nq, Nk) when need_weights, else None)``."""
        gqa = self.num_kv_heads != self.num_heads
        dropout_p = self.dropout if self.training else 0.0
        hp = hooks.site(self)
        if hp is None:  # nothing hooks this module: the plain call
            if need_weights:
                w = attention_weights(q, k, enable_gqa=gqa, **masks)  # (B, H, Nq, Nk)
                return hooks.attend_weights(w, v, dropout_p), w
            return attention(q, k, v, dropout_p=dropout_p, enable_gqa=gqa, backend=backend, **masks), None
        q, k, v = hp.edit("q", q), hp.edit("k", k), hp.edit("v", v)
        for name, t in (("q", q), ("k", k), ("v", v)):
            hp.observe(name, t)
        lse: Optional[Tensor] = None
        weights: Optional[Tensor] = None
        if need_weights or hp.edits("weights"):  # the materialising path
            weights = attention_weights(q, k, enable_gqa=gqa, **masks)  # (B, H, Nq, Nk)
            weights = hp.edit("weights", weights)
            out = hooks.attend_weights(weights, v, dropout_p)  # (B, H, Nq, Dh)
        else:
            # an observer may run the call itself (output, lse and statistics in one pass)
            res: Any = hp.attend(q, k, v, enable_gqa=gqa, **masks) if backend == "auto" and dropout_p == 0.0 else None
            if res is None:
                # no backend returns the lse together with dropout; the observer then computes it itself
                want_lse = hp.wants_lse and not (self.training and self.dropout > 0)
                res = attention(q, k, v, dropout_p=dropout_p, enable_gqa=gqa, return_lse=want_lse, backend=backend, **masks)
            out, lse = res if isinstance(res, tuple) else (res, None)  # (B, H, Nq, Dh), (B, H, Nq)
        hp.observe("lse", lse, query=q, key=k, enable_gqa=gqa, **masks)
        out = hp.edit("output", out)
        hp.observe("output", out)
        return out, weights if need_weights else None

    # ------------------------------------------------------------------------ conversion
    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> "MultiHeadAttention":
        """Copy a ``torch.nn.MultiheadAttention`` into a new :class:`MultiHeadAttention`.

        The result computes the same function, but with qkv conventions:

        * it is always batch-first: inputs ``(B, N, E)`` whatever ``m.batch_first`` was
          (transpose sequence-first inputs with ``x.transpose(0, 1)``);
        * ``key_padding_mask`` is True = **attend** (pass ``~torch_mask``), and boolean
          ``attn_mask`` likewise (pass ``~torch_mask``; float masks carry over unchanged);
        * a 3-D ``attn_mask`` is ``(B, Nq, Nk)``, not torch's ``(B·H, Nq, Nk)``.

        ``add_bias_kv`` and ``add_zero_attn`` are not supported.
        """
        if m.bias_k is not None or m.bias_v is not None:
            raise ValueError("from_torch: add_bias_kv=True is not supported by MultiHeadAttention")
        if m.add_zero_attn:
            raise ValueError("from_torch: add_zero_attn=True is not supported by MultiHeadAttention")
        ref = m.out_proj.weight
        has_bias = m.in_proj_bias is not None
        if has_bias != (m.out_proj.bias is not None):
            raise ValueError("from_torch: input and output projections must both have biases or neither")
        new = cls(
            m.embed_dim,
            m.num_heads,
            bias=has_bias,
            dropout=float(m.dropout),
            kdim=m.kdim,
            vdim=m.vdim,
            device=ref.device,
            dtype=ref.dtype,
        )
        e = m.embed_dim
        with torch.no_grad():
            if m.in_proj_weight is not None:
                wq, wk, wv = m.in_proj_weight.split(e, dim=0)  # (E, E) each
            else:
                wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
            new.q_proj.weight.copy_(wq)
            new.k_proj.weight.copy_(wk)
            new.v_proj.weight.copy_(wv)
            new.out_proj.weight.copy_(m.out_proj.weight)
            if has_bias:
                bq, bk, bv = m.in_proj_bias.split(e)
                new.q_proj.bias.copy_(bq)
                new.k_proj.bias.copy_(bk)
                new.v_proj.bias.copy_(bv)
                new.out_proj.bias.copy_(m.out_proj.bias)
        new.train(m.training)
        return new

    def extra_repr(self) -> str:
        s = f"d_model={self.d_model}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if self.kdim != self.d_model or self.vdim != self.d_model:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.dropout:
            s += f", dropout={self.dropout}"
        return s
