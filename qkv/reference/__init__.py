"""The float64 oracle: attention in NumPy, written the way the equations read. Imports no torch.

:func:`attention_ref` is what every fast path is tested against (see the tolerance rule in
the docs' *Guarantees* page); :func:`~qkv.reference.linear.linear_attention_ref` is linear
attention's, with its ``N × N`` kernel written out. The glass box that prints and explains
these steps is :mod:`qkv.glass`.
"""

from .attention import attention_ref, combined_mask, positional_mask, softmax_rows
from .linear import linear_attention_ref, linear_steps

__all__ = ["attention_ref", "combined_mask", "positional_mask", "softmax_rows", "linear_attention_ref", "linear_steps"]
