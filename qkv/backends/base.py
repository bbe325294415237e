"""What every backend is: a name, declared capabilities, readable reasons, and a forward."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch

from ..call import AttentionCall
from ..nonfinite import Checked, gate, guard


def follow_rule(call: AttentionCall, out: torch.Tensor, lse: Optional[torch.Tensor]) -> Checked:
    """A backend's ``out (..., Hq, Nq, Dv)`` and ``lse (..., Hq, Nq)`` after the non-finite rule
    (:mod:`qkv.nonfinite`), with every tensor of the call it covers: q, k, v, a built-in score
    function's bias (bound afresh: its gradient reaches the slopes or the table through its own
    ``rel``), the sinks and a float ``attn_mask``. Every backend ends its forward here, so the
    rule, gradients included, holds in one place whatever the kernel skipped."""
    # a Python callable is opaque (qkv.nonfinite): only a built-in's bias joins the rule
    bound = call.bound_score() if call.score_mod is not None and call.builtin_score else None
    bias = None if bound is None or bound.form is None else bound.form.rel  # (Hq, L); None for a softcap alone
    mask = call.given_mask if call.given_mask is not None and call.given_mask.is_floating_point() else None
    opaque = call.score_mod is not None and not call.builtin_score
    return Checked(*guard(call.query, call.key, call.value, out, lse, bias=bias, sinks=call.sinks, mask=mask, opaque=opaque))


def gate_call(call: AttentionCall) -> AttentionCall:
    """``call`` with its engine's tensors behind the non-finite rule's gate (:func:`qkv.nonfinite.gate`)
    where it has gradients on a GPU, so that :func:`follow_rule` fixes the engine's own gradients
    in place instead of adding the rule's to them; else ``call`` itself. A Python score function
    keeps the torch form: the tensors it reads get the formula's gradients, which only an output
    left as the engine computed it gives."""
    if call.score_mod is not None and not call.builtin_score:
        return call
    mask = call.given_mask if call.given_mask is not None and call.given_mask.is_floating_point() else None
    gated = gate(call.query, call.key, call.value, sinks=call.sinks, mask=mask)
    if gated is None:
        return call
    return dataclasses.replace(
        call, query=gated["query"], key=gated["key"], value=gated["value"], sinks=gated["sinks"],
        given_mask=call.given_mask if mask is None else gated["mask"],
    )  # fmt: skip


class EngineFailed(RuntimeError):
    """An engine found at run time that it cannot run a call (a compiler error, say); it gives
    the reason for such calls from then on, so ``auto`` can go on to the next engine."""


class Backend:
    """An implementation of exact attention.

    Subclasses set the capability flags and implement :meth:`forward`; the shared
    :meth:`not_supported_reasons` turns the flags into sentences a user can act on, and a
    backend adds its own special cases in :meth:`extra_reasons`.
    """

    NAME: ClassVar[str] = "?"
    DESCRIPTION: ClassVar[str] = ""
    DTYPES: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    DEVICES: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    SUPPORTS_DROPOUT: ClassVar[bool] = True
    SUPPORTS_GENERATOR: ClassVar[bool] = True
    SUPPORTS_LSE: ClassVar[bool] = True
    SUPPORTS_MASK_GRAD: ClassVar[bool] = True
    MATERIALIZES_SCORES: ClassVar[bool] = False
    # which score functions it runs: "none", "builtin" (qkv.score_mods, in its kernels) or "any"
    SCORE_MODS: ClassVar[str] = "none"
    SUPPORTS_SINKS: ClassVar[bool] = False

    def available(self) -> Optional[str]:
        """None when usable in this environment, else why not."""
        return None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons: list[str] = []
        why = self.available()
        if why:
            reasons.append(why)
        if call.dtype not in self.DTYPES:
            reasons.append(f"dtype {call.dtype} is not supported (supported: {', '.join(str(d) for d in self.DTYPES)})")
        if call.device.type not in self.DEVICES:
            reasons.append(f"device {call.device.type} is not supported (supported: {', '.join(self.DEVICES)})")
        if call.dropout_p > 0 and not self.SUPPORTS_DROPOUT:
            reasons.append("dropout_p > 0 is not supported")
        if call.generator is not None and not self.SUPPORTS_GENERATOR:
            reasons.append("a dropout generator= is not supported")
        if call.return_lse and not self.SUPPORTS_LSE:
            reasons.append("return_lse=True is not supported")
        if call.given_mask is not None and call.given_mask.requires_grad and torch.is_grad_enabled() and not self.SUPPORTS_MASK_GRAD:
            reasons.append("gradients with respect to a float attn_mask are not supported")
        if call.score_mod is not None and self.SCORE_MODS != "any":
            if self.SCORE_MODS == "none":
                reasons.append("score_mod is not supported (it has no score function; 'chunked' and 'math' run any)")
            elif not call.builtin_score:
                reasons.append(
                    "a Python score_mod cannot run in its kernels; use a built-in from qkv.score_mods "
                    "(Softcap, ALiBi, RelativeBias) or backend='chunked'"
                )
        if call.sinks is not None and not self.SUPPORTS_SINKS:
            reasons.append("attention sinks (sinks=) are not supported")
        reasons.extend(self.extra_reasons(call))
        return reasons

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        return []

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Return ``out (..., Hq, Nq, Dv)`` and, when ``call.return_lse``, ``lse (..., Hq, Nq)`` float32."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<qkv backend {self.NAME!r}>"


def half_to_float(t: torch.Tensor) -> torch.Tensor:
    """Compute dtype for scores: float32 for 16-bit inputs so large logits cannot overflow."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def dropout_weights(w: torch.Tensor, p: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Inverted dropout on attention weights: zero with probability p, rescale the rest by 1/(1-p)."""
    keep = torch.empty_like(w).bernoulli_(1.0 - p, generator=generator)
    return w * keep / (1.0 - p)
