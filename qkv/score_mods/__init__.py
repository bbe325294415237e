"""Score functions: change each scaled score before the softmax (FlexAttention's ``score_mod``).

Pass any of them, or your own ``fn(score, batch, head, q_idx, kv_idx) -> score``, as
``qkv.attention(..., score_mod=...)``. The built-ins run inside the fused kernels; a plain
function runs tile by tile in torch (never the whole ``Nq × Nk`` matrix) and gets gradients
for the tensors it reads. See :mod:`qkv.score_mods.base` for the contract and the order.

- :class:`Softcap` — ``cap·tanh(s/cap)`` (Gemma 2, Grok)
- :class:`ALiBi` and :func:`alibi_slopes` — linear distance penalty per head (BLOOM, MPT)
- :class:`RelativeBias` — T5's bucketed, trainable relative position bias

Attention sinks are not a score function (they add to the softmax's denominator, not to a
score): pass ``qkv.attention(..., sinks=logits)``.
"""

from .alibi import ALiBi, alibi_slopes
from .base import KernelForm, ScoreFn, ScoreMod
from .relative_bias import RelativeBias, relative_buckets
from .softcap import Softcap

__all__ = ["ScoreMod", "ScoreFn", "KernelForm", "Softcap", "ALiBi", "alibi_slopes", "RelativeBias", "relative_buckets"]
