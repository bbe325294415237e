"""Multi-head linear attention: the projections of :class:`MultiHeadAttention`, the core of
:func:`qkv.linear_attention`."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ..linear import FeatureMap, LinearAttentionState, linear_attention
from .attention import MultiHeadAttention, check_inputs

__all__ = ["LinearAttention"]


class LinearAttention(nn.Module):
    """Multi-head attention whose softmax kernel is replaced by a feature map (O(N) in length).

    Same parameters and shapes as :class:`MultiHeadAttention` (``q_proj``, ``k_proj``,
    ``v_proj``, ``out_proj``; inputs and output ``(B, N, E)``), so weights move between the two
    with ``load_state_dict`` (or :meth:`from_attention`). ``feature_map``, ``num_features``,
    ``eps`` and ``seed`` are those of :func:`qkv.linear_attention`. (It is not a
    :class:`MultiHeadAttention`: there are no softmax weights to capture.)
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        feature_map: FeatureMap = "elu",
        num_features: Optional[int] = None,
        eps: float = 1e-6,
        seed: int = 0,
        num_kv_heads: Optional[int] = None,
        bias: bool = True,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        # the same checks and parameters as softmax attention, so state dicts are interchangeable
        shape = MultiHeadAttention(d_model, num_heads, num_kv_heads=num_kv_heads, bias=bias, kdim=kdim, vdim=vdim, device="meta")
        for name in ("d_model", "num_heads", "num_kv_heads", "head_dim", "kdim", "vdim"):
            setattr(self, name, getattr(shape, name))
        factory = {"device": device, "dtype": dtype}
        kv_width = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, kv_width, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.feature_map, self.num_features, self.eps, self.seed = feature_map, num_features, eps, seed
        # fail at construction, not at the first forward pass
        probe = torch.zeros(1, 1, self.head_dim)
        linear_attention(probe, probe, probe, feature_map=feature_map, num_features=num_features, eps=eps, seed=seed)

    @classmethod
    def from_attention(cls, m: MultiHeadAttention, **kw: object) -> "LinearAttention":
        """A linear-attention module with ``m``'s projection weights (keywords as the constructor)."""
        p = m.q_proj.weight
        new = cls(m.d_model, m.num_heads, num_kv_heads=m.num_kv_heads, bias=m.q_proj.bias is not None,
                  kdim=m.kdim, vdim=m.vdim, device=p.device, dtype=p.dtype, **kw)
        new.load_state_dict(m.state_dict())
        return new

    def extra_repr(self) -> str:
        fm = self.feature_map if isinstance(self.feature_map, str) else getattr(self.feature_map, "__name__", "callable")
        return f"d_model={self.d_model}, num_heads={self.num_heads}, feature_map={fm!r}"

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        *,
        key_padding_mask: Optional[Tensor] = None,
        is_causal: bool = False,
        state: Optional[LinearAttentionState] = None,
        return_state: bool = False,
    ) -> Tuple[Tensor, Optional[LinearAttentionState]]:
        """Attend from ``query`` (B, Nq, E) to ``key``/``value`` (B, Nk, ·); self-attention without them.

        ``key_padding_mask`` bool (B, Nk), True = real key. ``is_causal`` needs Nq == Nk; for
        decoding pass ``state`` (from an earlier call with ``return_state=True``) and one new
        position at a time. Returns ``(out (B, Nq, E), new state or None)``.
        """
        self_attention = key is None and value is None
        if key is None and value is not None:
            raise ValueError("value was given without key; pass key too (or neither for self-attention)")
        key = query if key is None else key
        value = key if value is None else value
        check_inputs(query, key, value, self.d_model, self.kdim, self.vdim, self_attention)
        if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool or key_padding_mask.shape != key.shape[:2]):
            raise ValueError(
                f"key_padding_mask must be bool (B, Nk) = {tuple(key.shape[:2])} with True = real key, got "
                f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            )
        b, nq, _ = query.shape
        nk = key.shape[1]
        h, hk, dh = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(query).view(b, nq, h, dh).transpose(1, 2)  # (B, H, Nq, Dh)
        k = self.k_proj(key).view(b, nk, hk, dh).transpose(1, 2)  # (B, Hk, Nk, Dh)
        v = self.v_proj(value).view(b, nk, hk, dh).transpose(1, 2)
        if hk != h:  # grouped heads: each key/value head serves h // hk query heads
            k, v = (t.repeat_interleave(h // hk, dim=1) for t in (k, v))  # (B, H, Nk, Dh)
        kp = None if key_padding_mask is None else key_padding_mask[:, None, :]  # (B, 1, Nk)
        res = linear_attention(
            q, k, v, feature_map=self.feature_map, is_causal=is_causal, num_features=self.num_features,
            eps=self.eps, seed=self.seed, key_padding_mask=kp, state=state, return_state=return_state,
        )  # fmt: skip
        out, new_state = res if return_state else (res, None)
        out = out.transpose(1, 2).reshape(b, nq, h * dh)  # (B, Nq, E)
        return self.out_proj(out), new_state
