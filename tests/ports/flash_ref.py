"""FlashAttention's test reference, ported to plain torch on the CPU.

Ported from Dao-AILab/flash-attention, ``tests/test_flash_attn.py`` (commit 0251105a), under its
BSD 3-Clause License: Copyright (c) 2022, the respective contributors, as shown by the AUTHORS
file of that project. All rights reserved. The logic is theirs (``attention_ref`` with
``upcast``/``reorder_ops``, ``construct_local_mask``, ``attn_bias_from_alibi_slopes``,
``generate_random_padding_mask``, ``generate_qkv`` and ``flash_attn.bert_padding``'s
``unpad_input``/``pad_input``); the code is rewritten without einops and differs on purpose:

- ``upcast=True`` computes in float64 and returns float64 (FlashAttention upcasts to float32 and
  rounds the result back to the input dtype). The house rule measures every error against an
  unrounded float64 oracle evaluated on the rounded inputs.
- A window side of ``-1`` is unbounded on either side, as in FlashAttention's kernels
  (``flash_api.cpp``: ``if (window_size_left >= 0 && window_size_right < 0) window_size_right =
  seqlen_k``). Their reference only handles ``(-1, right)``; ``(left, -1)`` would mask every key
  right of the diagonal. Their tests never draw a lone ``-1``; ours do.
- A query row with nothing to attend to (every key padded or outside its window, or a sequence
  with no keys) gets weights 0 and output 0 without a NaN entering the graph, so its gradient is
  0 too. FlashAttention's reference zeroes only rows emptied by the local mask.
- ``generate_random_padding_mask`` has an extra mode that draws sequences of length 0.

Layout, as in FlashAttention: q ``(B, Nq, H, D)``, k/v ``(B, Nk, Hk, D)``, padding masks
``(B, N)`` bool with True = a real token, attention weights ``(B, H, Nq, Nk)``. Causal and local
masks are aligned bottom-right to each sequence's *actual* lengths (the sums of the padding
masks): query row ``i`` sits at key position ``i + sk - sq``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

_NEG_INF = float("-inf")


def generate_random_padding_mask(max_seqlen: int, batch_size: int, mode: str = "random") -> torch.Tensor:
    """Right-padding mask ``(B, max_seqlen)``: each row keeps a random-length prefix.

    ``full``: no padding; ``random``: lengths in ``[max(1, max_seqlen - 20), max_seqlen]``;
    ``third``: lengths in ``[max_seqlen // 3, max_seqlen]``; ``empty`` (not in FlashAttention):
    lengths in ``[0, max_seqlen]`` with the first sequence of length 0.
    """
    if mode == "full":
        lengths = torch.full((batch_size, 1), max_seqlen)
    elif mode == "random":
        lengths = torch.randint(max(1, max_seqlen - 20), max_seqlen + 1, (batch_size, 1))
    elif mode == "third":
        lengths = torch.randint(max_seqlen // 3, max_seqlen + 1, (batch_size, 1))
    elif mode == "empty":
        lengths = torch.randint(0, max_seqlen + 1, (batch_size, 1))
        lengths[0] = 0
    else:
        raise ValueError(f"mode={mode!r}: choose 'full', 'random', 'third' or 'empty'")
    return torch.arange(max_seqlen).expand(batch_size, max_seqlen) < lengths


def unpad_input(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``x (B, N, ...)`` → packed rows ``(T, ...)``, their flat indices, ``cu_seqlens`` int32, max length."""
    seqlens = mask.sum(-1, dtype=torch.int32)
    indices = mask.flatten().nonzero().flatten()
    cu_seqlens = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return x.flatten(0, 1)[indices], indices, cu_seqlens, int(seqlens.max())


def pad_input(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: ``(T, ...)`` → ``(B, N, ...)`` with zeros at the padding."""
    out = x.new_zeros(batch * seqlen, *x.shape[1:]).index_copy(0, indices, x)
    return out.unflatten(0, (batch, seqlen))


@dataclass
class VarlenInputs:
    """What FlashAttention's ``generate_qkv`` returns, by name instead of a 13-tuple.

    The packed ``*_unpad`` tensors and the padded ``q, k, v`` are separate leaves that require
    grad; ``pad_q``/``pad_k`` scatter packed rows (outputs or gradients) back to ``(B, N, ...)``.
    """

    q_unpad: torch.Tensor
    k_unpad: torch.Tensor
    v_unpad: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pad_q: Callable[[torch.Tensor], torch.Tensor]
    pad_k: Callable[[torch.Tensor], torch.Tensor]


def generate_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_padding_mask: Optional[torch.Tensor] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
) -> VarlenInputs:
    """Pack padded ``q (B, Nq, H, D)``, ``k``/``v (B, Nk, Hk, D)`` for a varlen call."""
    b, sq = q.shape[:2]
    sk = k.shape[1]
    qpm = torch.ones(b, sq, dtype=torch.bool) if query_padding_mask is None else query_padding_mask
    kpm = torch.ones(b, sk, dtype=torch.bool) if key_padding_mask is None else key_padding_mask
    q_unpad, idx_q, cu_q, max_q = unpad_input(q, qpm)
    k_unpad, idx_k, cu_k, max_k = unpad_input(k, kpm)
    v_unpad = unpad_input(v, kpm)[0]
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    return VarlenInputs(
        leaf(q_unpad), leaf(k_unpad), leaf(v_unpad), cu_q, cu_k, max_q, max_k, leaf(q), leaf(k), leaf(v),
        pad_q=lambda t: pad_input(t, idx_q, b, sq),
        pad_k=lambda t: pad_input(t, idx_k, b, sk),
    )  # fmt: skip


def _lengths(mask: Optional[torch.Tensor], n: int):
    """Actual lengths, shaped to broadcast against ``(B, H, Nq, Nk)``, or the int ``n``."""
    return n if mask is None else mask.sum(-1).view(-1, 1, 1, 1)


def _key_columns(seqlen_k: int, key_leftpad: Optional[torch.Tensor]) -> torch.Tensor:
    """Key positions ``(Nk,)``; with left padding ``(B, 1, 1, Nk)``, shifted so the first real key is 0."""
    col = torch.arange(seqlen_k)
    if key_leftpad is None:
        return col
    pad = key_leftpad.view(-1, 1, 1, 1)
    return torch.where(col >= pad, col - pad, 2**32)  # padding on the left sits far to the right


def construct_local_mask(
    seqlen_q: int,
    seqlen_k: int,
    window_size: Sequence[int] = (-1, -1),
    query_padding_mask: Optional[torch.Tensor] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    key_leftpad: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """True where the window ``(left, right)`` (``-1``: unbounded) forbids a (query, key) pair.

    Query row ``i`` sits at key position ``i + sk - sq`` (bottom-right, per sequence) and sees keys
    ``[pos - left, pos + right]``. Shape ``(Nq, Nk)``, or ``(B, 1, Nq, Nk)`` with padding masks.
    """
    left, right = (int(w) for w in window_size)
    row = torch.arange(seqlen_q).view(-1, 1)
    col = _key_columns(seqlen_k, key_leftpad)
    pos = row + _lengths(key_padding_mask, seqlen_k) - _lengths(query_padding_mask, seqlen_q)
    masked = torch.zeros(torch.broadcast_shapes(pos.shape, col.shape), dtype=torch.bool)
    if right >= 0:
        masked = masked | (col > pos + right)
    if left >= 0:
        masked = masked | (col < pos - left)
    return masked


def attn_bias_from_alibi_slopes(
    slopes: torch.Tensor,
    seqlen_q: int,
    seqlen_k: int,
    query_padding_mask: Optional[torch.Tensor] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    causal: bool = False,
    key_leftpad: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """ALiBi as an additive float32 bias ``(B, H, Nq, Nk)`` (or broadcastable to it).

    ``-slope · |i + sk - sq - j|``; under a causal mask the row-constant part is dropped, as in
    FlashAttention (softmax does not see it): ``slope · (j - (Nk - 1))``.
    """
    slopes = slopes.float()[:, :, None, None]  # (B, H, 1, 1)
    if causal:
        return torch.arange(-seqlen_k + 1, 1, dtype=torch.float32) * slopes
    row = torch.arange(seqlen_q).view(-1, 1)
    col = _key_columns(seqlen_k, key_leftpad)
    pos = row + _lengths(key_padding_mask, seqlen_k) - _lengths(query_padding_mask, seqlen_q)
    return -slopes * (pos - col).abs().to(torch.float32)


def _repeat_heads(x: torch.Tensor, nheads: int) -> torch.Tensor:
    """``(B, N, Hk, D)`` → ``(B, N, H, D)``: query head ``h`` reads key/value head ``h // (H // Hk)``."""
    return x.repeat_interleave(nheads // x.shape[2], dim=2)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_padding_mask: Optional[torch.Tensor] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    attn_bias: Optional[torch.Tensor] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    upcast: bool = True,
    reorder_ops: bool = False,
    key_leftpad: Optional[torch.Tensor] = None,
    return_lse: bool = False,
):
    """Attention written out in torch: ``out (B, Nq, H, Dv)``, weights ``(B, H, Nq, Nk)`` (and lse).

    ``upcast``: compute in float64 and return float64 (the oracle); otherwise compute in the
    input dtype (the same-dtype baseline of the tolerance rule). ``reorder_ops``: scale k
    instead of q, a different rounding of the same math. ``causal`` is the window ``(left, 0)``.
    ``lse (B, H, Nq)``: natural-log log-sum-exp of each row's scores, ``-inf`` for empty rows.
    """
    if causal:
        window_size = (window_size[0], 0)
    dtype_out = torch.float64 if upcast else q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    k, v = _repeat_heads(k, q.shape[2]), _repeat_heads(v, q.shape[2])
    d = q.shape[-1]
    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(d))  # (B, H, Nq, Nk)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q / math.sqrt(d), k)
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], _NEG_INF)
    if any(int(w) >= 0 for w in window_size):
        local = construct_local_mask(seqlen_q, seqlen_k, window_size, query_padding_mask, key_padding_mask, key_leftpad)
        scores = scores.masked_fill(local, _NEG_INF)
    if attn_bias is not None:
        scores = scores + attn_bias  # a float32 bias promotes 16-bit scores, as in FlashAttention
    empty = torch.isneginf(scores).all(-1, keepdim=True)  # (B, H, Nq, 1): nothing to attend to
    safe = scores.masked_fill(empty, 0.0)  # no -inf - -inf = NaN, in the forward or the backward
    attention = torch.softmax(safe, dim=-1).masked_fill(empty, 0.0).to(v.dtype)
    if query_padding_mask is not None:
        attention = attention.masked_fill(~query_padding_mask[:, None, :, None], 0.0)
    out = torch.einsum("bhts,bshd->bthd", attention, v)  # (B, Nq, H, Dv)
    if query_padding_mask is not None:
        out = out.masked_fill(~query_padding_mask[:, :, None, None], 0.0)
    result = (out.to(dtype_out), attention.to(dtype_out))
    if return_lse:
        lse = torch.logsumexp(safe, dim=-1).masked_fill(empty.squeeze(-1), _NEG_INF)  # (B, H, Nq)
        result = (*result, lse.to(torch.float64 if upcast else lse.dtype))
    return result
