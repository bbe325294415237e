"""Key/value cache for incremental (token-by-token) decoding.

Shape legend::

    B batch   Hk key/value heads   N cached positions   Dh head dim   Dv value head dim

A :class:`KVCache` belongs to one attention layer. It holds that layer's *projected* keys
``(B, Hk, N, Dh)`` and values ``(B, Hk, N, Dv)`` (after rotary embedding, if any) plus,
optionally, a key padding mask ``(B, N)`` (True = may attend). A decoder keeps one cache per
layer; :meth:`KVCache.for_layers` builds the list.

Storage is preallocated when ``max_len`` is given (appending past it is an error) and
otherwise grows by doubling, so appending one token at a time costs amortised O(1) copies.
When the new keys/values require gradients (decoding under autograd), each step builds new
tensors instead of writing in place, so the backward pass through earlier steps stays valid.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    """Projected keys and values of one attention layer, appended step by step.

    >>> cache = KVCache(max_len=16)
    >>> k = v = torch.randn(2, 4, 3, 8)          # (B, Hk, N, Dh): a 3-token prompt
    >>> keys, values, kpm = cache.update(k, v)
    >>> cache.length, tuple(keys.shape)
    (3, (2, 4, 3, 8))
    """

    def __init__(self, max_len: Optional[int] = None) -> None:
        if max_len is not None and max_len <= 0:
            raise ValueError(f"max_len={max_len} must be a positive int, or None to grow as needed")
        self.max_len = max_len
        self._k: Optional[Tensor] = None  # (B, Hk, capacity, Dh)
        self._v: Optional[Tensor] = None  # (B, Hk, capacity, Dv)
        self._mask: Optional[Tensor] = None  # (B, capacity) bool, only once a mask was given
        self._len = 0

    @classmethod
    def for_layers(cls, num_layers: int, max_len: Optional[int] = None) -> List["KVCache"]:
        """One empty cache per layer."""
        return [cls(max_len) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Number of cached positions N."""
        return self._len

    def __len__(self) -> int:
        return self._len

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[-2]

    @property
    def keys(self) -> Optional[Tensor]:
        """Cached keys ``(B, Hk, N, Dh)`` (a view), or None while empty."""
        return None if self._k is None else self._k[..., : self._len, :]

    @property
    def values(self) -> Optional[Tensor]:
        """Cached values ``(B, Hk, N, Dv)`` (a view), or None while empty."""
        return None if self._v is None else self._v[..., : self._len, :]

    @property
    def key_padding_mask(self) -> Optional[Tensor]:
        """Cached key padding mask ``(B, N)`` (True = may attend), or None if never given."""
        return None if self._mask is None else self._mask[:, : self._len]

    def reset(self) -> None:
        """Forget every cached position (storage is kept for reuse)."""
        self._len = 0
        self._mask = None

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (e.g. surviving beams): new row ``b`` is old row ``index[b]``."""
        if self._k is None:
            return
        self._k = self._k.index_select(0, index)
        self._v = self._v.index_select(0, index)  # type: ignore[union-attr]
        if self._mask is not None:
            self._mask = self._mask.index_select(0, index)

    def _allocate(self, k: Tensor, v: Tensor, needed: int) -> None:
        b, h = k.shape[0], k.shape[1]
        if self.max_len is not None:
            cap = self.max_len
        else:
            cap = max(needed, 2 * self.capacity, 16)
        new_k = k.new_empty(b, h, cap, k.shape[-1])  # (B, Hk, cap, Dh)
        new_v = v.new_empty(b, h, cap, v.shape[-1])  # (B, Hk, cap, Dv)
        if self._len:
            new_k[..., : self._len, :] = self.keys
            new_v[..., : self._len, :] = self.values
        self._k, self._v = new_k, new_v
        if self._mask is not None:
            new_m = torch.ones(b, cap, dtype=torch.bool, device=k.device)
            new_m[:, : self._len] = self._mask[:, : self._len]
            self._mask = new_m

    def _check(self, k: Tensor, v: Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError(
                f"KVCache.update expects k (B, Hk, N, Dh) and v (B, Hk, N, Dv); got shapes "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on (B, Hk, N)")
        if self._k is not None and self._len:
            want_k = (self._k.shape[0], self._k.shape[1], self._k.shape[3])
            got_k = (k.shape[0], k.shape[1], k.shape[3])
            if want_k != got_k or v.shape[3] != self._v.shape[3]:  # type: ignore[union-attr]
                raise ValueError(
                    f"new keys have (B, Hk, Dh) = {got_k} but the cache holds {want_k}; call "
                    "cache.reset() before decoding a different batch, or use one cache per layer"
                )

    def _check_mask(self, kpm: Tensor, b: int, n: int, total: int) -> None:
        if kpm.dtype != torch.bool:
            raise TypeError(
                f"key_padding_mask must be bool (True = may attend), got {kpm.dtype}; "
                "to convert a torch.nn.MultiheadAttention mask (True = ignore) use ~mask"
            )
        if kpm.shape not in ((b, n), (b, total)):
            raise ValueError(
                f"key_padding_mask has shape {tuple(kpm.shape)}; with {self._len} cached and {n} new "
                f"positions it must be ({b}, {n}) for the new keys or ({b}, {total}) for all keys"
            )

    def update(
        self, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Append ``k`` (B, Hk, n, Dh) and ``v`` (B, Hk, n, Dv); return everything cached.

        ``key_padding_mask`` (bool, True = may attend) covers either the ``n`` new positions
        ``(B, n)`` or all ``N = length + n`` positions ``(B, N)`` (it then replaces the stored
        mask). Positions appended without a mask count as attendable.

        Returns ``(keys (B, Hk, N, Dh), values (B, Hk, N, Dv), mask (B, N) or None)``.
        """
        self._check(k, v)
        n = k.shape[-2]
        total = self._len + n
        if key_padding_mask is not None:
            self._check_mask(key_padding_mask, k.shape[0], n, total)
        if self.max_len is not None and total > self.max_len:
            raise ValueError(
                f"KVCache is full: {self._len} cached + {n} new positions > max_len={self.max_len}; "
                "build the cache with a larger max_len (or max_len=None to grow on demand)"
            )
        fresh = self._k is None or self._len == 0
        if fresh and self._k is not None:
            same = (
                self._k.shape[0] == k.shape[0]
                and self._k.shape[1] == k.shape[1]
                and self._k.shape[3] == k.shape[3]
                and self._v.shape[3] == v.shape[3]  # type: ignore[union-attr]
                and self._k.dtype == k.dtype
                and self._k.device == k.device
            )
            if not same:  # reset, then reused for a different batch or layer shape
                self._k = self._v = None
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            # Writing in place into storage that earlier steps' graphs saved would break their
            # backward pass, so under autograd build new tensors instead.
            self._k = k if fresh else torch.cat((self.keys, k), dim=-2)  # type: ignore[arg-type]
            self._v = v if fresh else torch.cat((self.values, v), dim=-2)  # type: ignore[arg-type]
            if self._mask is not None:
                self._mask = self._mask[:, : self._len].clone()
                self._mask = torch.cat((self._mask, self._mask.new_ones(k.shape[0], n)), dim=1)
        else:
            if self._k is None or total > self.capacity:
                self._allocate(k, v, total)
            assert self._k is not None and self._v is not None
            self._k[..., self._len : total, :] = k
            self._v[..., self._len : total, :] = v

        if key_padding_mask is not None:
            kpm = key_padding_mask
            b = k.shape[0]
            if self._mask is None:
                self._mask = torch.ones(b, self.capacity, dtype=torch.bool, device=k.device)
            if kpm.shape[1] == total:
                self._mask[:, :total] = kpm
            else:
                self._mask[:, self._len : total] = kpm
        elif self._mask is not None:
            self._mask[:, self._len : total] = True

        self._len = total
        return self.keys, self.values, self.key_padding_mask  # type: ignore[return-value]

    def __repr__(self) -> str:
        if self._k is None or not self._len:
            return f"KVCache(length=0, max_len={self.max_len})"
        b, h, _, d = self._k.shape
        return (
            f"KVCache(length={self._len}, max_len={self.max_len}, batch={b}, kv_heads={h}, "
            f"head_dim={d}, dtype={self._k.dtype}, masked={self._mask is not None})"
        )
