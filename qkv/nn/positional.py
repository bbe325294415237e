"""Positional information: the fixed sinusoid table and rotary embeddings (RoPE).

Shape legend::

    B batch   N sequence length   H heads   Dh head dim   d_model model width

* :func:`sinusoidal_table` / :class:`SinusoidalPositionalEncoding` — *Attention Is All You
  Need*, §3.5: ``PE[p, 2i] = sin(p / base^(2i/d))``, ``PE[p, 2i+1] = cos(p / base^(2i/d))``,
  added to the token embeddings.
* :class:`RotaryEmbedding` — RoFormer (Su et al., 2021): rotate each pair of query/key
  features by an angle proportional to the position, so that ``q_m · k_n`` depends on the
  positions only through ``m - n``. Applied to queries and keys after the heads are split.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ..call import accumulate_dtype

__all__ = ["sinusoidal_table", "SinusoidalPositionalEncoding", "RotaryEmbedding"]


def _angle_dtype(dtype: torch.dtype) -> torch.dtype:
    # Angles grow with the position; half precision would lose them, so use at least float32.
    return accumulate_dtype(dtype)


def sinusoidal_table(
    n: int,
    d_model: int,
    *,
    base: float = 10000.0,
    offset: int = 0,
    dtype: Optional[torch.dtype] = None,
    device: Optional[Union[torch.device, str]] = None,
) -> Tensor:
    """The ``(n, d_model)`` sinusoid table for positions ``offset .. offset + n - 1``.

    Even columns hold sines and odd columns cosines of ``p / base^(2i / d_model)``; an odd
    ``d_model`` simply ends on a sine column.
    """
    if n < 0 or d_model <= 0:
        raise ValueError(f"sinusoidal_table needs n >= 0 and d_model > 0, got n={n}, d_model={d_model}")
    dtype = dtype or torch.get_default_dtype()
    work = _angle_dtype(dtype)
    pos = torch.arange(offset, offset + n, dtype=work, device=device)[:, None]  # (n, 1)
    two_i = torch.arange(0, d_model, 2, dtype=work, device=device)  # (ceil(d/2),)
    inv_freq = torch.exp(two_i * (-math.log(base) / d_model))  # base^(-2i/d)
    angle = pos * inv_freq  # (n, ceil(d/2))
    table = torch.empty(n, d_model, dtype=work, device=device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.to(dtype)


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed sinusoid table to embeddings: ``(B, N, d_model) -> (B, N, d_model)``.

    The table for ``max_len`` positions is precomputed as a non-persistent buffer (it is not
    part of ``state_dict``; it is a function of ``d_model`` alone). Pass ``offset=`` when
    decoding incrementally so that token ``t`` gets position ``offset + t``.
    """

    pe: Tensor

    def __init__(
        self,
        d_model: int,
        max_len: int = 4096,
        dropout: float = 0.0,
        *,
        base: float = 10000.0,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len
        self.base = base
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "pe", sinusoidal_table(max_len, d_model, base=base, dtype=dtype, device=device), persistent=False
        )

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """``x`` (B, N, d_model) → ``dropout(x + PE[offset : offset + N])`` (B, N, d_model)."""
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"x has last dimension {x.shape[-1]} but this encoding was built for "
                f"d_model={self.d_model}; x must be (B, N, {self.d_model})"
            )
        n = x.shape[-2]
        if offset < 0 or offset + n > self.max_len:
            raise ValueError(
                f"positions {offset}..{offset + n - 1} exceed max_len={self.max_len}; "
                f"build SinusoidalPositionalEncoding with max_len >= {offset + n}"
            )
        pe = self.pe[offset : offset + n]  # (N, d_model)
        return self.dropout(x + pe.to(x.dtype))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}, base={self.base}"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) for queries and keys of shape ``(B, H, N, Dh)``.

    Feature pairs ``(x_a, x_b)`` are rotated by ``θ_i · p`` for a token at position ``p``, with
    ``θ_i = base^(-2i / rotary_dim)``. Pairing convention:

    * ``interleaved=False`` (default; GPT-NeoX / Llama / Hugging Face "rotate half"): feature
      ``i`` pairs with ``i + rotary_dim/2``.
    * ``interleaved=True`` (the RoFormer paper, GPT-J): feature ``2i`` pairs with ``2i + 1``.

    ``rotary_dim`` (default ``head_dim``) rotates only the first ``rotary_dim`` features and
    passes the rest through unchanged (partial rotary, as in GPT-NeoX).

    Positions: by default ``offset, offset + 1, ...``; pass ``positions`` (``(N,)`` or
    ``(B, N)`` integers) for anything else, e.g. left-padded batches.

    The module has no parameters or buffers; angles are computed on the fly in float32
    (float64 for float64 inputs) and the result is cast back to the input dtype.
    """

    def __init__(
        self, head_dim: int, base: float = 10000.0, *, rotary_dim: Optional[int] = None, interleaved: bool = False
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"rotary_dim={rotary_dim} must be even and in 1..head_dim={head_dim}; RoPE rotates "
                "features in pairs, so use an even head_dim (or an even rotary_dim <= head_dim)"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self.interleaved = interleaved

    def angles(
        self,
        n: int,
        *,
        offset: int = 0,
        positions: Optional[Tensor] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[Union[torch.device, str]] = None,
    ) -> Tensor:
        """Rotation angles ``θ_i · p``: ``(N, rotary_dim/2)``, or ``(B, N, rotary_dim/2)``."""
        work = _angle_dtype(dtype)
        if positions is None:
            pos = torch.arange(offset, offset + n, dtype=work, device=device)  # (N,)
        else:
            if positions.shape[-1] != n or positions.dim() not in (1, 2):
                raise ValueError(
                    f"positions has shape {tuple(positions.shape)}; it must be (N,) or (B, N) "
                    f"with N={n}, the sequence length of the queries/keys"
                )
            pos = positions.to(device=device, dtype=work)
        i = torch.arange(0, self.rotary_dim, 2, dtype=work, device=device)  # (rotary_dim/2,)
        inv_freq = self.base ** (-i / self.rotary_dim)
        return pos[..., None] * inv_freq  # (..., N, rotary_dim/2)

    def rotate(self, x: Tensor, *, offset: int = 0, positions: Optional[Tensor] = None) -> Tensor:
        """Apply RoPE to one tensor ``x`` (B, H, N, Dh) → (B, H, N, Dh)."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"the last dimension of x is {x.shape[-1]} but RotaryEmbedding was built for "
                f"head_dim={self.head_dim}; x must be (B, H, N, {self.head_dim})"
            )
        n = x.shape[-2]
        theta = self.angles(n, offset=offset, positions=positions, dtype=x.dtype, device=x.device)
        if theta.dim() == 3:
            theta = theta[:, None]  # (B, 1, N, R/2): same positions for every head
        cos, sin = theta.cos(), theta.sin()
        r = self.rotary_dim
        xr, rest = x[..., :r].to(cos.dtype), x[..., r:]
        if self.interleaved:
            a, b = xr[..., 0::2], xr[..., 1::2]  # (..., N, R/2) each
            out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)  # (..., N, R)
        else:
            a, b = xr[..., : r // 2], xr[..., r // 2 :]
            out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)  # (..., N, R)
        out = out.to(x.dtype)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)

    def forward(
        self, q: Tensor, k: Tensor, *, offset: int = 0, positions: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        """Rotate queries and keys at the same positions: ``(B, H, N, Dh)`` each.

        ``q`` and ``k`` may have different head counts (grouped-query attention).
        """
        return (
            self.rotate(q, offset=offset, positions=positions),
            self.rotate(k, offset=offset, positions=positions),
        )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, "
            f"interleaved={self.interleaved}"
        )
