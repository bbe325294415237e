"""``sdpa``: torch's own ``scaled_dot_product_attention`` kernels, where their semantics match.

Masks SDPA has no argument for (sliding window, key padding, bottom-right causal alignment)
are folded into one ``attn_mask``; that mask is ``Nq × Nk``, so ``auto`` prefers ``chunked``
for such calls once the matrix is large. ``return_lse`` uses torch's CPU flash kernel, whose
log-sum-exp is not differentiable, so it is offered only when no gradient is needed.

Its CPU backward recomputes the weights from a float32 log-sum-exp, whose rounding scales
every weight of a row: where one key takes most of a row's weight, float32 gradients miss
qkv's accuracy rule (dV up to 30×; measured beside the row that moves it last in
:data:`.dispatch.ROUTES`). Named explicitly it
still runs such calls, as torch would (but for 16-bit inputs, shared key/value heads, and scores
so large that the recomputed weights drift to inf, which it refuses); ``auto`` sends gradients
on the CPU to ``chunked``.

qkv defines a query row with nothing to attend to as output 0. Torch's kernels agree on
recent versions; :func:`empty_rows_are_zero` checks this once per device type and the
backend declines calls with possibly-empty rows where torch would give NaN.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..call import AttentionCall
from ..masks.tiles import additive_mask, dense_sdpa_mask
from ..overflow import score_bound
from .base import Backend, follow_rule
from .flash_cpu import lse_misses_rule
from .math import MathBackend


_EMPTY_ROWS_ZERO: dict[str, bool] = {}


def empty_rows_are_zero(device_type: str) -> bool:
    """Does torch SDPA on this device type give 0 (not NaN) for fully masked rows and Nk = 0?"""
    known = _EMPTY_ROWS_ZERO.get(device_type)
    if known is None:
        q = torch.ones(1, 1, 2, 8, device=device_type)
        mask = torch.tensor([[True, True], [False, False]], device=device_type)
        rows = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)[0, 0, 1]
        none = F.scaled_dot_product_attention(q, q[:, :, :0], q[:, :, :0])
        known = bool((rows == 0).all()) and bool((none == 0).all())
        _EMPTY_ROWS_ZERO[device_type] = known
    return known


RECOMPUTE_DRIFT_LIMIT = 1 / 128
"""Largest ``D · eps · score bound`` for which torch's CPU backward stays within the accuracy
rule. Measured on N(0,1) float32 inputs, D = 80, 97 keys and 5 queries, with the scale swept: at
0.0087 dV's error is 1.0e-5, at 0.0131 it is 3.0e-5, and at 0.0162 it is 5.0e-5 to 6.5e-5,
past the rule's 4.5e-5. So 1/128 ≈ 0.0078 leaves twice the margin."""


def backward_recompute_drifts(call: AttentionCall) -> bool:
    """Could torch's CPU backward recompute this call's weights wrongly? It takes each weight as
    ``exp(score - lse)`` with the score computed again, in another order than the forward's: the
    two roundings differ by up to about ``D · eps`` times the scores' bound (:func:`qkv.overflow.score_bound`).
    A weight is then off by that much relative to itself, which the gradients carry beyond the
    accuracy rule from :data:`RECOMPUTE_DRIFT_LIMIT` on. Once it reaches 1, a weight can be e
    times too large, or inf where it passes ~88, and the gradients then hold NaN. Measured: float32
    NaN from scale 1e10 on N(0,1) inputs, float64 from 1e20, garbage dQ from 1e6."""
    bound = score_bound(call.query, call.key, call.scale)
    return bound is not None and call.d * torch.finfo(call.dtype).eps * bound >= RECOMPUTE_DRIFT_LIMIT


def sdpa_is_causal(call: AttentionCall) -> Optional[bool]:
    """The ``is_causal`` that expresses the call's positional rules to SDPA, or None when qkv
    must fold them (and the padding) into a dense mask."""
    if call.key_padding_mask is not None:
        return None
    pm = call.positional
    if pm.trivial or call.nq == 0 or call.nk == 0 or pm.block_status(0, call.nq, 0, call.nk) == "full":
        return False  # e.g. bottom-right causal with one query row (a decoding step) sees every key
    if pm.causal and pm.band() == (None, 0) and not call.has_attn_mask:
        # includes bottom-right alignment when Nq == Nk; torch refuses is_causal with a mask
        # on most of its kernels, so a mask and causality travel folded into one mask
        return True
    return None


def needs_dense_mask(call: AttentionCall) -> bool:
    """Would qkv have to build an ``Nq × Nk`` mask to express this call to SDPA?"""
    return sdpa_is_causal(call) is None


class SdpaBackend(Backend):
    NAME = "sdpa"
    DESCRIPTION = "torch.nn.functional.scaled_dot_product_attention (torch's fused CPU/GPU kernels)"
    SUPPORTS_GENERATOR = False

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        reasons = []
        if call.return_lse:
            if call.device.type != "cpu":
                reasons.append("return_lse=True is only available from torch's CPU kernel")
            elif call.requires_grad:
                reasons.append("return_lse=True with gradients: torch's log-sum-exp output is not differentiable")
            elif call.dropout_p > 0:
                reasons.append("return_lse=True with dropout is not supported")
            if call.hq != call.hk:
                reasons.append("return_lse=True with grouped-query heads: torch's kernel would need K/V copied per head")
            if call.dv != call.d:
                reasons.append(f"return_lse=True needs value head dim == query head dim (got {call.dv} vs {call.d})")
            if lse_misses_rule(call):
                reasons.append(
                    "return_lse=True for 16-bit inputs (float16, bfloat16): torch's kernel computes that lse to about "
                    "1.8e-5, where qkv's math path and tile loops stay within 6e-7 (beyond qkv's accuracy rule); "
                    "use backend='auto'"
                )
        if (
            call.device.type == "cpu"
            and call.requires_grad
            and call.hq != call.hk
            and call.dtype != torch.float64
        ):
            reasons.append(
                "gradients for shared key/value heads: torch's CPU backward sums the heads' gradients in "
                "the input dtype from weights recomputed off a rounded lse (dV errors up to 40x qkv's "
                "accuracy rule in bfloat16, 10x in float32); use backend='auto'"
            )
        if call.device.type == "cpu" and call.requires_grad and call.dtype in (torch.float16, torch.bfloat16):
            reasons.append(
                "gradients of 16-bit inputs on the CPU (float16, bfloat16): torch's backward recomputes every weight from "
                "its forward's log-sum-exp, which for 16-bit inputs is off by up to ~5e-5 (hundreds of float32 "
                "units), and rounds each (batch, head)'s gradient to 16 bits (float16 dQ at 1.2x qkv's accuracy "
                "rule); use backend='auto'"
            )
        if call.device.type == "cpu" and call.requires_grad and backward_recompute_drifts(call):
            reasons.append(
                "gradients of scores this large (|scale| * max|q| * max|k| * D with D * eps of the dtype beyond 1/128): "
                "torch's CPU backward recomputes each weight as exp(score - lse) from scores it rounds in another "
                "order, so the weights drift past qkv's accuracy rule and, further out, come out e times too large "
                "or more, up to inf (NaN gradients from finite inputs); use backend='auto'"
            )
        if call.rows_may_be_empty and not empty_rows_are_zero(call.device.type):
            reasons.append(f"torch SDPA on {call.device.type} returns NaN for fully masked rows")
        return reasons

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return follow_rule(call, *self._attend(call))

    def _attend(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if call.batch_size * call.hq * call.nq == 0 or call.nk == 0 or call.d == 0:
            # nothing to compute; torch's kernels divide by these sizes or drop broadcasting
            # (an empty batch broadcast against 2 keeps its 1): the math path's empty matmuls
            # give the broadcast shapes, zeros and -inf
            return MathBackend().attend(call)
        if call.return_lse:
            return self._with_lse(call)
        is_causal = sdpa_is_causal(call)
        if is_causal is None:
            mask, is_causal = dense_sdpa_mask(call), False
        else:
            mask = call.attn_mask
        query, scale = call.positive_scale()
        out = F.scaled_dot_product_attention(
            query, call.key, call.value, mask, call.dropout_p, is_causal, scale=scale, enable_gqa=call.hq != call.hk
        )
        return out, None

    def _with_lse(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        b = call.batch_size
        query, scale = call.positive_scale()
        q, k, v = call.grouped_qkv(query)
        # (B, H, N, D), contiguous: this private kernel reads its inputs as if they were
        q, k, v = (t.reshape(b, call.hq, t.shape[3], t.shape[4]).contiguous() for t in (q, k, v))
        is_causal = sdpa_is_causal(call)
        mask = None
        if is_causal is None or call.attn_mask is not None:
            is_causal = False
            mask = dense_sdpa_mask(call)  # every rule in one float mask, so empty rows show in it
            if mask.dtype == torch.bool:
                mask = additive_mask(mask, call.dtype)
            mask = mask.expand(*call.batch_shape, call.hq, call.nq, call.nk).reshape(b, call.hq, call.nq, call.nk).contiguous()
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, call.dropout_p, is_causal, attn_mask=mask, scale=scale
        )
        if mask is not None:  # rows with no finite score: torch reports lse 0, qkv defines -inf
            empty = torch.isneginf(mask).all(-1)
            lse = lse.masked_fill(empty, float("-inf"))
        out = out.reshape(b, call.hk, call.group, call.nq, call.dv)
        return call.ungroup(out), call.ungroup(lse.to(call.lse_dtype).reshape(b, call.hk, call.group, call.nq))
